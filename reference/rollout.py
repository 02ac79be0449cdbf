"""Rollout policies: the same transformers model under BF16 (the trainer) or emulated FP8 numerics (the rollout).

:class:`RolloutPolicy` wraps a ``transformers`` model class (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, …) built
from an HF config dict and a checkpoint-named state dict, and swaps its numerics according to a
:class:`RolloutRecipe` (:data:`RECIPES`, named like the perf model's precision configs):

* ``bf16``: the model as transformers runs it in BF16 (``sdpa`` attention, the ``eager`` expert loop). Its
  teacher-forced :meth:`RolloutPolicy.score` is **the trainer's policy** π_old, the oracle every rollout is
  compared with; its :meth:`~RolloutPolicy.generate` decodes incrementally with a KV cache.
* ``fp8-linear``: W8A8 blockwise linear layers (paper §1.1): the synced weights (FP8 codes + 128×128
  ``*_weight_scale_inv``, :mod:`fp8rl.reference.weight_sync`) are dequantized exactly, activations are quantized
  dynamically per token and 1×128 group under the activation ScalePolicy, the product is formed in fp64 (exact up
  to fp64 rounding) and rounded once to BF16 — what a W8A8 kernel with fp32 accumulation computes, without its
  accumulation error. Every weight the synced dict holds in FP8 runs this way (a quantized lm_head or router too);
  everything else stays BF16.
* ``fp8-linear-ptpc``: W8A8 "PTPC" linear layers (vLLM ``quantization="fp8_per_channel"``, llm-compressor
  FP8_DYNAMIC): the same layers as ``fp8-linear`` quantized per output channel (one scale per weight row, from the
  BF16 weights under the weight ScalePolicy; no weight sync: the engine quantizes what it loads), activations
  quantized dynamically per token under the activation ScalePolicy; exact dequantized operands, fp64 product
  rounded once to BF16.
* ``fp8-kv``: FP8 (e4m3fn) KV cache "for storage only" (verl PR #4435): post-RoPE keys and values are quantized
  per tensor and per layer, ``code = RNE_sat(clamp(x / s, ±448))``, and attention reads them dequantized (fp32
  attention math, output rounded to BF16).
* ``fp8-all``: both, and the query is quantized too (FP8 attention, "storage and attention calculation").

KV scales are calibrated as vLLM's ``calculate_kv_scales`` did (paper §2.3, strategy A; ``kv_calibration=
"first_batch"``): on the first forward after load or after every weight update, per layer,
``q_scale = max|q|/200``, ``k_scale = max|k|/200``, ``v_scale = max|v|/100`` over that batch, then frozen.
``"amax"`` uses ``max|x|/448`` instead. Scales can also be pushed (:meth:`RolloutPolicy.set_kv_scales`, strategy B).
:meth:`RolloutPolicy.update_weights` recalibrates unless told not to (the stale-scale failure mode of §2.5).

The FP8 casts use torch's ``float8_e4m3fn`` conversion only after a canary has shown it equal to the oracle's
bit-level encoder (:func:`fp8rl.reference.formats.encode_codes`) on every e4m3fn rounding boundary; otherwise, and
for other formats or overflow policies, the oracle's :func:`~fp8rl.reference.quant.quantize` is used (slow but the
same values). The test suite checks :func:`fake_quant` against the oracle bit for bit.

Also here: :func:`mismatch_metrics` (k3 KL, token_mult_prob_error, max |Δlogp|, paper §3.4) and
:func:`first_divergence` for greedy rollouts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import (
    Granularity,
    compute_amax,
    expand_scale,
    quant_multiplier_from_amax,
    quantize,
    quantize_with_scale,
    scale_from_amax,
)
from torch import nn

__all__ = [
    "KV_CALIBRATIONS", "RECIPES", "RolloutOutput", "RolloutPolicy", "RolloutRecipe", "build_hf_model", "cache_kwarg", "transformers_reason",
    "fake_quant", "fake_quant_with_scale", "first_divergence", "get_recipe", "mismatch_metrics", "recipe_with",
    "single_thread", "to_model_state_dict",
]

#: per-tensor KV calibration: name → divisor of max|x| for (q, k, v)
KV_CALIBRATIONS: dict[str, tuple[float, float, float]] = {
    "first_batch": (200.0, 200.0, 100.0),  # vLLM Q/K/V_SCALE_CONSTANT (calculate_kv_scales), verl PR #4435
    "amax": (448.0, 448.0, 448.0),
}
_ATTN_NAME = "fp8rl_fp8_attention"


@dataclass(frozen=True)
class RolloutRecipe:
    """Which parts of the rollout run in FP8 (see the module docstring)."""

    name: str
    fp8_linear: bool = False
    fp8_kv: bool = False
    fp8_q: bool = False
    kv_fmt: str = "e4m3fn"
    kv_calibration: str = "first_batch"
    act_group: int = 128
    #: FP8 linear granularity: "block" (128×128 synced weights, 1×act_group activations) or "channel" (per-output-
    #: channel weights, per-token activations: PTPC)
    linear: str = "block"

    def __post_init__(self) -> None:
        if self.linear not in ("block", "channel"):
            raise ValueError(f"linear: expected 'block' or 'channel', got {self.linear!r}")
        if self.kv_calibration not in KV_CALIBRATIONS:
            raise ValueError(f"kv_calibration: expected one of {sorted(KV_CALIBRATIONS)}, got {self.kv_calibration!r}")
        if self.fp8_q and not self.fp8_kv:
            raise ValueError("fp8_q: FP8 attention needs the FP8 KV cache (fp8_kv=True)")

    @property
    def synced_weights(self) -> bool:
        """True when the recipe runs on the weight-sync output (128×128 block FP8 weights + scales)."""
        return self.fp8_linear and self.linear == "block"

    def act_granularity(self) -> Granularity:
        """Granularity of the dynamic activation quantization of the FP8 linear layers."""
        return Granularity.token() if self.linear == "channel" else Granularity.group(self.act_group)


RECIPES: dict[str, RolloutRecipe] = {r.name: r for r in (
    RolloutRecipe("bf16"),
    RolloutRecipe("fp8-linear", fp8_linear=True),
    RolloutRecipe("fp8-linear-ptpc", fp8_linear=True, linear="channel"),
    RolloutRecipe("fp8-kv", fp8_kv=True),
    RolloutRecipe("fp8-all", fp8_linear=True, fp8_kv=True, fp8_q=True),
)}


def get_recipe(recipe: str | RolloutRecipe) -> RolloutRecipe:
    if isinstance(recipe, RolloutRecipe):
        return recipe
    try:
        return RECIPES[recipe]
    except (KeyError, TypeError):
        raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {recipe!r}") from None


# ----------------------------------------------------------------------------------------------------------------
# fast exact fake quantization (torch cast, guarded by a canary against the oracle's encoder)

_TORCH_FP8 = {"e4m3fn": torch.float8_e4m3fn}


@functools.cache
def _torch_cast_is_oracle(fmt: str) -> bool:
    """True if torch's saturating cast to ``fmt`` equals the oracle encoder on every rounding boundary."""
    if fmt not in _TORCH_FP8:
        return False
    from fp8rl.reference.formats import decode_codes, encode_codes

    vals = np.unique(np.abs(decode_codes(np.arange(256, dtype=np.uint8), fmt)))
    vals = vals[np.isfinite(vals)]
    mids = (vals[:-1] + vals[1:]) / 2
    probe = np.concatenate([vals, mids, np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                            np.nextafter(mids.astype(np.float32), np.float32(-np.inf)), [vals.max() * 1.01, 1e-30]])
    probe = np.concatenate([probe, -probe]).astype(np.float32)
    rng = np.random.default_rng(0)
    probe = np.concatenate([probe, (rng.standard_normal(4096) * 40).astype(np.float32)])
    want = encode_codes(probe, fmt, "saturate")
    got = torch.from_numpy(probe).to(_TORCH_FP8[fmt]).view(torch.uint8).numpy()
    return bool(np.array_equal(want, got))


def _fast_ok(policy: ScalePolicy) -> bool:
    return policy.fmt in _TORCH_FP8 and (policy.clamp or policy.overflow == "saturate") and \
        _torch_cast_is_oracle(policy.fmt)


def _q_values(x: torch.Tensor, s_full: torch.Tensor, policy: ScalePolicy, amax: torch.Tensor | None,
              g: Granularity) -> torch.Tensor:
    """fp32 values fed to the cast (the oracle's quantize_with_scale before encode_codes)."""
    if policy.quant_op == "div":
        q = x / s_full
    elif policy.quant_op == "mul_recip":
        q = x * (torch.tensor(1.0, dtype=torch.float32) / s_full)
    else:
        if amax is None:
            amax = compute_amax(x, g)
        m = quant_multiplier_from_amax(amax, policy)
        q = x * expand_scale(m, g, tuple(x.shape))
    if policy.clamp:
        t = policy.max_value
        q = q.clamp(-t, t)
    return q


def fake_quant(x: torch.Tensor, g: Granularity, policy: ScalePolicy | str = "reference") -> torch.Tensor:
    """dequantize(quantize(x, g, policy)) exactly, as fp64 (the oracle's values, computed with torch ops)."""
    policy = get_policy(policy)
    x = x.detach().to("cpu", torch.float32)
    if not _fast_ok(policy):
        return quantize(x, g, policy).dequantize(torch.float64)
    amax = compute_amax(x, g)
    s = scale_from_amax(amax, policy)
    s_full = expand_scale(s, g, tuple(x.shape))
    q = _q_values(x, s_full, policy, amax, g)
    return q.to(_TORCH_FP8[policy.fmt]).to(torch.float64) * s_full.to(torch.float64)


def fake_quant_with_scale(x: torch.Tensor, scale: float | torch.Tensor, policy: ScalePolicy | str = "reference",
                          ) -> torch.Tensor:
    """Per-tensor quantization with a *given* dequant scale (KV cache, FP8 query): fp64 dequantized values."""
    policy = get_policy(policy)
    x = x.detach().to("cpu", torch.float32)
    g = Granularity.tensor()
    s = torch.as_tensor(scale, dtype=torch.float32).reshape(1)
    if not _fast_ok(policy) or policy.quant_op == "mul_max_over_amax":
        codes = quantize_with_scale(x, s, g, policy)
        from fp8rl.reference.formats import decode

        return decode(codes, policy.fmt).reshape(x.shape).to(torch.float64) * s.double()
    q = _q_values(x, s.expand(x.shape), policy, None, g)
    return q.to(_TORCH_FP8[policy.fmt]).to(torch.float64) * s.double()


# ----------------------------------------------------------------------------------------------------------------
# model construction and state-dict conversion

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_ATTN_NAME, _fp8_attention)
    AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)


def transformers_reason() -> str | None:
    """None if a usable transformers (≥ 5: fused MoE expert tensors, attention interface) and safetensors are
    installed, else why not (an engine capability reason)."""
    import importlib.metadata
    import importlib.util

    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install 'fp8rl[e2e]')"
    version = importlib.metadata.version("transformers")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < 5:
        return f"transformers >= 5 is required for the rollout oracle (found {version})"
    return None


def build_hf_model(config: Mapping[str, Any], *, attn_implementation: str = "sdpa",
                   experts_implementation: str | None = "eager", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A transformers causal LM for an HF config dict (random init; load weights afterwards), eval mode, no grads."""
    _offline()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in dict(config).items() if k not in ("quantization_config", "transformers_version")}
    model_type = cfg.pop("model_type")
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "dtype": dtype}
    if experts_implementation is not None and "moe" in model_type:
        kwargs["experts_implementation"] = experts_implementation
    if attn_implementation == _ATTN_NAME:
        _register_attention()
    try:
        model = AutoModelForCausalLM.from_config(hf_cfg, **kwargs)
    except TypeError:  # transformers without selectable expert kernels: its only kernel is the eager loop
        if "experts_implementation" not in kwargs:
            raise
        kwargs.pop("experts_implementation")
        model = AutoModelForCausalLM.from_config(hf_cfg, **kwargs)
    model.eval().requires_grad_(False)
    return model


def to_model_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names → the parameter names of transformers ≥ 5 modules: MoE experts fused into
    ``mlp.experts.gate_up_proj`` (E, 2I, H) = [gate; up] per expert and ``mlp.experts.down_proj`` (E, H, I)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state_dict.items():
        m = _EXPERT_RE.match(name)
        if m is None:
            out[name] = t
            continue
        experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["proj"]] = t
    for prefix, per in experts.items():
        ids = sorted(per)
        if ids != list(range(len(ids))) or any(len(per[e]) != 3 for e in ids):
            raise ValueError(f"{prefix}: incomplete expert weights (experts {ids})")
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in ids])
        out[prefix + ".down_proj"] = torch.stack([per[e]["down_proj"] for e in ids])
    return out


def cache_kwarg(model: nn.Module) -> str:
    """Name of the KV-cache argument of a transformers model's forward (``cache`` from 5.2x, before that
    ``past_key_values``, which newer versions still accept with a deprecation warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _get_module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


# ----------------------------------------------------------------------------------------------------------------
# FP8 modules


class _ActQuant:
    """Dynamic 1×G (or per-token) activation quantization under a ScalePolicy → exact fp64 dequantized
    activations. ``group``: the group size G, or a Granularity (e.g. ``Granularity.token()``)."""

    def __init__(self, policy: ScalePolicy, group: int | Granularity) -> None:
        self.policy = policy
        self.g = group if isinstance(group, Granularity) else Granularity.group(group)

    def __call__(self, x2d: torch.Tensor) -> torch.Tensor:
        return fake_quant(x2d.float(), self.g, self.policy)


def _fp8_matmul(x: torch.Tensor, w64: torch.Tensor, act: _ActQuant) -> torch.Tensor:
    shp = x.shape
    y = act(x.reshape(-1, shp[-1])) @ w64.t()
    return y.to(x.dtype).reshape(*shp[:-1], w64.shape[0])


class FP8Linear(nn.Module):
    """W8A8 blockwise linear: exact dequantized FP8 weight (fp64), dynamic 1×G activations, fp64 product → BF16."""

    w64: torch.Tensor

    def __init__(self, w64: torch.Tensor, act: _ActQuant) -> None:
        super().__init__()
        self.register_buffer("w64", w64, persistent=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_matmul(x, self.w64, self.act)


class FP8Experts(nn.Module):
    """The transformers eager expert loop (Qwen3MoeExperts) with every expert GEMM as an FP8 W8A8 linear."""

    gate64: torch.Tensor
    up64: torch.Tensor
    down64: torch.Tensor

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act_fn: Any, act: _ActQuant) -> None:
        super().__init__()
        self.register_buffer("gate64", gate, persistent=False)
        self.register_buffer("up64", up, persistent=False)
        self.register_buffer("down64", down, persistent=False)
        self.num_experts = gate.shape[0]
        self.act_fn = act_fn
        self.act = act

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final = torch.zeros_like(hidden_states)
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
        for e in torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            top_k_pos, token_idx = torch.where(expert_mask[e])
            x = hidden_states[token_idx]
            h = self.act_fn(_fp8_matmul(x, self.gate64[e], self.act)) * _fp8_matmul(x, self.up64[e], self.act)
            h = _fp8_matmul(h, self.down64[e], self.act) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final


class FP8Router(nn.Module):
    """Qwen3-MoE top-k router whose logits come from an FP8 W8A8 linear (what a quantized router computes)."""

    w64: torch.Tensor
    top_k: int
    num_experts: int
    norm_topk_prob: bool
    hidden_dim: int

    def __init__(self, router: Any, w64: torch.Tensor, act: _ActQuant) -> None:
        super().__init__()
        self.top_k, self.num_experts = int(router.top_k), int(router.num_experts)
        self.norm_topk_prob, self.hidden_dim = bool(router.norm_topk_prob), int(router.hidden_dim)
        self.register_buffer("w64", w64, persistent=False)
        self.act = act

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = _fp8_matmul(hidden_states, self.w64, self.act)
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value /= top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_idx


# ----------------------------------------------------------------------------------------------------------------
# FP8 KV cache and attention


def _kv_oracle():
    """``fp8rl.reference.kv`` (the KV-cache oracle) if it is importable, else None (the local fallback is used)."""
    try:
        from fp8rl.reference import kv
    except ImportError:  # pragma: no cover - kv.py ships with the suite
        return None
    return kv


class _KVState:
    """Per-layer q/k/v scales: calibrated on the first forward after a reset (or pushed), then frozen.

    Store and FP8-query numerics are the KV oracle's defaults (:func:`fp8rl.reference.kv.default_policy`, vLLM
    CUDA: K/V ``code = RNE_sat(clamp(x/s))``, Q ``x·fl32(1/s)``), computed by :mod:`fp8rl.reference.kv` when it is
    importable and by the equivalent local fast path otherwise. Calibration: s = fl32(max|x| / C) per tensor and
    layer with C from :data:`KV_CALIBRATIONS` (the formula of ``kv.calibrate_engine_first_batch`` for
    ``"first_batch"``; an all-zero batch gives 1.0 instead of vLLM's 0).
    """

    def __init__(self, recipe: RolloutRecipe) -> None:
        self.recipe = recipe
        self.policy = get_policy("reference").for_format(recipe.kv_fmt)  # div, clamp, RNE, saturate
        self.q_policy = replace(get_policy("reference"), quant_op="mul_recip")
        self.scales: dict[int, dict[str, float]] = {}
        self.calibrations = 0  # how many per-layer scales were (re)computed

    def reset(self) -> None:
        self.scales = {}

    def scale(self, layer: int, which: str, x: torch.Tensor) -> float:
        per = self.scales.setdefault(layer, {})
        if which not in per:
            div = KV_CALIBRATIONS[self.recipe.kv_calibration]["qkv".index(which)]
            amax = x.detach().float().abs().amax().double()
            s = float((amax / float(np.float32(div))).float())
            per[which] = s if s > 0 and np.isfinite(s) else 1.0
            self.calibrations += 1
        return per[which]

    def quant(self, layer: int, which: str, x: torch.Tensor) -> torch.Tensor:
        """The FP8-rounded tensor (dequantized, fp32) with the layer's current scale (calibrating if needed)."""
        s = self.scale(layer, which, x)
        kv = _kv_oracle()
        if kv is not None:
            if which == "q":
                return kv.quantize_q(x, s, self.recipe.kv_fmt, "mul_recip").to(torch.float32)
            policy = kv.default_policy(self.recipe.kv_fmt, "tensor")
            return kv.quantize_kv(x, torch.tensor(s, dtype=torch.float32), policy).dequantize(torch.float32)
        return fake_quant_with_scale(x, s, self.q_policy if which == "q" else self.policy).to(torch.float32)


def _make_fp8_cache(config: Any, state: _KVState):
    from transformers import DynamicCache

    class FP8KVCache(DynamicCache):
        """DynamicCache that stores keys/values FP8-rounded (dequantized to fp32) with per-layer scales."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k = state.quant(layer_idx, "k", key_states)
            v = state.quant(layer_idx, "v", value_states)
            return super().update(k, v, layer_idx, *args, **kwargs)

    return FP8KVCache(config=config)


def _fp8_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any):
    """Attention over the FP8 cache: fp32 math on dequantized K/V (and an FP8 query when the recipe says so)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state: _KVState = getattr(module, "_fp8rl_kv")  # noqa: B009 - set by RolloutPolicy on attention modules
    layer = int(getattr(module, "layer_idx"))  # noqa: B009
    q = state.quant(layer, "q", query) if state.recipe.fp8_q else query.float()
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, q, key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


# ----------------------------------------------------------------------------------------------------------------
# the policy


class RolloutOutput(NamedTuple):
    tokens: torch.Tensor  # (B, P + N) int64: prompts then the generated tokens
    logprobs: torch.Tensor  # (B, N) float32: log π(token) of each generated token under the policy


class RolloutPolicy:
    """A transformers model with swapped numerics (see the module docstring).

    * ``config``: HF config dict; ``state_dict``: BF16 checkpoint-named weights (what the trainer holds);
    * ``recipe``: a :data:`RECIPES` name or a :class:`RolloutRecipe`;
    * ``synced``: for block FP8-linear recipes, the weight-sync output to run on (FP8 + ``*_scale_inv`` + BF16
      rest, e.g. an engine's); default: :func:`~fp8rl.reference.weight_sync.quantize_state_dict` of
      ``state_dict`` under ``weight_policy``. Per-channel recipes (PTPC) take no synced weights: the same weights
      are quantized per output channel under ``weight_policy``;
    * ``act_policy``: ScalePolicy of the dynamic activation quantization (1×128 groups, or per token for PTPC);
    * ``experts_implementation``: the transformers expert kernel for BF16 experts (``"eager"``: the reference loop);
    * ``memo``: share :meth:`generate` results between policies with identical weights, numerics and KV scales
      (content-keyed, process-wide; generation is deterministic). The reference engine turns it on so that the
      many engines of a mutants run do not recompute identical rollouts.
    """

    def __init__(self, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                 recipe: str | RolloutRecipe = "bf16", *, synced: Mapping[str, torch.Tensor] | None = None,
                 weight_policy: ScalePolicy | str = "reference", act_policy: ScalePolicy | str = "reference",
                 experts_implementation: str | None = "eager", weight_block: tuple[int, int] = (128, 128),
                 memo: bool = False) -> None:
        self.config = dict(config)
        self.memo = memo
        self.recipe = get_recipe(recipe)
        self.weight_policy = get_policy(weight_policy)
        self.act_policy = get_policy(act_policy)
        self.experts_implementation = experts_implementation
        self.weight_block = tuple(weight_block)
        self.kv = _KVState(self.recipe) if self.recipe.fp8_kv else None
        self.version = 0
        with single_thread():
            self._load(state_dict, synced)

    # -- loading -----------------------------------------------------------------------------------------------
    def _load(self, state_dict: Mapping[str, torch.Tensor], synced: Mapping[str, torch.Tensor] | None) -> None:
        from fp8rl.reference import weight_sync as ws

        r = self.recipe
        attn = _ATTN_NAME if r.fp8_kv else "sdpa"
        model = build_hf_model(self.config, attn_implementation=attn,
                               experts_implementation=self.experts_implementation)
        if r.fp8_linear and not r.synced_weights:
            if synced is not None:
                raise ValueError(f"synced: recipe {r.name!r} quantizes the BF16 weights per channel itself")
            g = Granularity.channel()
            names = set(ws.quantized_names(state_dict))
            qts = {n: quantize(state_dict[n].detach().to("cpu", torch.bfloat16), g, self.weight_policy)
                   for n in state_dict if n in names}
            plain = {k: v for k, v in state_dict.items() if k not in names}
        elif r.fp8_linear:
            if synced is None:
                synced = ws.quantize_state_dict(state_dict, ws.WeightSyncRecipe(block=self.weight_block,
                                                                                policy=self.weight_policy))
            qts = ws.synced_tensors(synced, self.weight_block)
            scale_names = {ws.scale_name(n) for n in qts}
            plain = {k: v for k, v in synced.items() if k not in qts and k not in scale_names}
        else:
            qts, plain = {}, dict(state_dict)
        self._fingerprint = (r, self.weight_block, self.act_policy, self.experts_implementation,
                             self.weight_policy, _digest(synced if r.synced_weights else state_dict),
                             _digest(self.config))
        params = to_model_state_dict(plain)
        missing, unexpected = model.load_state_dict(params, strict=False)
        if unexpected:
            raise ValueError(f"state_dict: names the model does not have: {unexpected[:5]}")
        covered = self._install_fp8(model, qts)
        left = [m for m in missing if m not in covered]
        if left:
            raise ValueError(f"state_dict: missing weights {left[:5]}")
        if self.kv is not None:
            for mod in model.modules():
                if hasattr(mod, "layer_idx") and hasattr(mod, "k_proj"):
                    setattr(mod, "_fp8rl_kv", self.kv)  # noqa: B010 - read by _fp8_attention
        self.model = model

    def _install_fp8(self, model: nn.Module, qts: Mapping[str, Any]) -> set[str]:
        """Swap every module whose weight is FP8 in the synced dict; returns the model param names it covers."""
        act = _ActQuant(self.act_policy, self.recipe.act_granularity())
        covered: set[str] = set()
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for name, qt in qts.items():
            w64 = qt.dequantize(torch.float64)
            m = _EXPERT_RE.match(name)
            if m is not None:
                experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["proj"]] = w64
                continue
            path = name[: -len(".weight")] if name.endswith(".weight") else name
            mod = _get_module(model, path)
            if isinstance(mod, nn.Linear):
                if mod.bias is not None:
                    raise ValueError(f"{path}: FP8 linear with bias is not emulated")
                _set_module(model, path, FP8Linear(w64, act))
            elif hasattr(mod, "top_k") and hasattr(mod, "weight"):  # MoE router
                _set_module(model, path, FP8Router(mod, w64, act))
            elif isinstance(mod, nn.Embedding):  # weight-only: a lookup has no activation to quantize
                mod.weight.data.copy_(w64.to(mod.weight.dtype))
            else:
                raise ValueError(f"{name}: no FP8 emulation for module type {type(mod).__name__}")
            covered.add(name)
        for prefix, per in experts.items():
            ids = sorted(per)
            old: Any = _get_module(model, prefix)
            if ids != list(range(old.num_experts)) or any(len(per[e]) != 3 for e in ids):
                raise ValueError(f"{prefix}: expected FP8 gate/up/down for all {old.num_experts} experts")
            stack = {p: torch.stack([per[e][p] for e in ids]) for p in ("gate_proj", "up_proj", "down_proj")}
            _set_module(model, prefix, FP8Experts(stack["gate_proj"], stack["up_proj"], stack["down_proj"],
                                                  old.act_fn, act))
            covered.update({prefix + ".gate_up_proj", prefix + ".down_proj"})
        return covered

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *,
                       synced: Mapping[str, torch.Tensor] | None = None, recalibrate_kv: bool = True) -> None:
        """Load new weights (re-quantized for FP8 linears); KV scales are recalibrated on the next forward unless
        ``recalibrate_kv`` is False (then the old scales are kept: stale)."""
        with single_thread():
            self._load(state_dict, synced)
        if self.kv is not None and recalibrate_kv:
            self.kv.reset()
        self.version += 1

    # -- KV scales ---------------------------------------------------------------------------------------------
    @property
    def kv_scales(self) -> dict[int, dict[str, float]]:
        """Current per-layer scales {layer: {"q", "k", "v"}} (empty until the first forward; {} without FP8 KV)."""
        return {k: dict(v) for k, v in self.kv.scales.items()} if self.kv is not None else {}

    def set_kv_scales(self, scales: Mapping[int, Mapping[str, float]]) -> None:
        """Push scales (trainer-side calibration): they replace the current ones and are not recalibrated."""
        if self.kv is None:
            raise ValueError(f"recipe {self.recipe.name!r} has no FP8 KV cache")
        self.kv.scales = {int(k): {w: float(s) for w, s in v.items()} for k, v in scales.items()}

    # -- running -----------------------------------------------------------------------------------------------
    @property
    def _cache_kw(self) -> str:
        return cache_kwarg(self.model)

    def _cache(self):
        if self.kv is not None:
            return _make_fp8_cache(self.model.config, self.kv)
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """BF16 logits (B, T, V) of a full teacher-forced forward (through the FP8 cache for KV recipes)."""
        cache = self._cache() if self.kv is not None else None
        with single_thread():
            return self.model(input_ids=tokens, **{self._cache_kw: cache}, use_cache=cache is not None).logits

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """log π(tokens[:, t] | tokens[:, :t]) for t ≥ prompt_len: (B, T − prompt_len) float32."""
        tokens = _as_tokens(tokens, "tokens")
        if not 1 <= prompt_len < tokens.shape[1]:
            raise ValueError(f"prompt_len: expected 1 ≤ prompt_len < {tokens.shape[1]}, got {prompt_len}")
        logits = self.logits(tokens)[:, prompt_len - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, prompt_len:, None]).squeeze(-1)

    @torch.inference_mode()
    def generate(self, prompts: torch.Tensor, max_new_tokens: int, *, greedy: bool = True, seed: int = 0,
                 ) -> RolloutOutput:
        """Fixed-length rollouts (EOS ignored): greedy (argmax) or sampled at temperature 1 with a seeded
        ``torch.Generator``; prefill then incremental decoding with the (FP8 or BF16) KV cache."""
        prompts = _as_tokens(prompts, "prompts")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected ≥ 1, got {max_new_tokens}")
        if not self.memo:
            with single_thread():
                return self._generate(prompts, max_new_tokens, greedy, seed)
        key = (self._fingerprint, self._kv_snapshot(), tuple(prompts.shape), prompts.numpy().tobytes(),
               int(max_new_tokens), bool(greedy), int(seed) if not greedy else 0)
        hit = _GENERATE_MEMO.get(key)
        if hit is None:
            with single_thread():
                out = self._generate(prompts, max_new_tokens, greedy, seed)
            hit = (out, self.kv_scales)
            if len(_GENERATE_MEMO) >= 256:
                _GENERATE_MEMO.pop(next(iter(_GENERATE_MEMO)))
            _GENERATE_MEMO[key] = hit
        elif self.kv is not None:  # replay the calibration side effect
            self.kv.scales = {k: dict(v) for k, v in hit[1].items()}
        return RolloutOutput(hit[0].tokens.clone(), hit[0].logprobs.clone())

    def _kv_snapshot(self) -> tuple:
        return tuple(sorted((k, tuple(sorted(v.items()))) for k, v in self.kv.scales.items())) if self.kv else ()

    def _generate(self, prompts: torch.Tensor, max_new_tokens: int, greedy: bool, seed: int) -> RolloutOutput:
        gen = torch.Generator().manual_seed(int(seed))
        cache = self._cache()
        kw = self._cache_kw
        logits = self.model(input_ids=prompts, **{kw: cache}, use_cache=True).logits[:, -1]
        toks, lps = [], []
        for t in range(max_new_tokens):
            lp = torch.log_softmax(logits.float(), dim=-1)
            nxt = lp.argmax(-1) if greedy else torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
            toks.append(nxt)
            lps.append(lp.gather(-1, nxt[:, None]).squeeze(-1))
            if t + 1 < max_new_tokens:
                logits = self.model(input_ids=nxt[:, None], **{kw: cache}, use_cache=True).logits[:, -1]
        return RolloutOutput(torch.cat([prompts, torch.stack(toks, 1)], 1), torch.stack(lps, 1).float())

    @torch.inference_mode()
    def greedy_full(self, prompts: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy tokens (B, P + N) where every step is a full forward over the whole prefix without a cache —
        the trainer's own greedy continuation (the reference for first-divergence positions)."""
        tokens = _as_tokens(prompts, "prompts")
        for _ in range(int(max_new_tokens)):
            nxt = self.logits(tokens)[:, -1].float().argmax(-1)
            tokens = torch.cat([tokens, nxt[:, None]], 1)
        return tokens


@contextlib.contextmanager
def single_thread():
    """Run torch ops on one intra-op thread (restored afterwards). The tiny GEMMs here gain nothing from threads,
    and with several processes on a 2-core CI machine (pytest -n 2) intra-op thread contention makes them 10–50×
    slower."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


_GENERATE_MEMO: dict[tuple, tuple[RolloutOutput, dict[int, dict[str, float]]]] = {}


def _digest(obj: Any) -> str:
    """sha256 of a state dict (names, dtypes, shapes, bytes) or of a JSON-able object."""
    import hashlib
    import json

    h = hashlib.sha256()
    if isinstance(obj, Mapping) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        for name in sorted(obj):
            t = obj[name].detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(json.dumps(obj, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _as_tokens(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected a (B, T) integer tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return t.to(torch.int64)


# ----------------------------------------------------------------------------------------------------------------
# mismatch metrics (paper §3.4, verl rollout_corr, NeMo-RL)


def mismatch_metrics(lp_rollout: torch.Tensor, lp_trainer: torch.Tensor) -> dict[str, float]:
    """Train–inference mismatch of one batch of rollouts (every token counts; fp64):

    * ``k3_kl`` = mean_t (ρ_t − log ρ_t − 1), ρ_t = π_old(a_t)/π_rollout(a_t) (verl ``rollout_corr/k3_kl``, an
      estimate of KL(π_rollout ‖ π_old) from rollout samples, ≥ 0);
    * ``k1_kl`` = mean_t (log π_rollout − log π_old) (verl ``rollout_corr/kl``);
    * ``token_mult_prob_error`` = mean_t exp(|log π_rollout − log π_old|) (NeMo-RL; 1 is perfect);
    * ``max_abs_dlogp``, ``mean_abs_dlogp``: max and mean of |log π_rollout − log π_old|.
    """
    a = torch.as_tensor(lp_rollout).double()
    b = torch.as_tensor(lp_trainer).double()
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(f"log-probs: expected equal non-empty shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    d = a - b
    log_rho = -d
    return {
        "k3_kl": float((torch.exp(log_rho) - log_rho - 1).mean()),
        "k1_kl": float(d.mean()),
        "token_mult_prob_error": float(torch.exp(d.abs()).mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "mean_abs_dlogp": float(d.abs().mean()),
    }


def first_divergence(tokens: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Per row, the index (0-based, within the response) of the first generated token that differs from
    ``reference``; the response length when none differs. int64 (B,)."""
    a = torch.as_tensor(tokens)[:, prompt_len:]
    b = torch.as_tensor(reference)[:, prompt_len:]
    if a.shape != b.shape:
        raise ValueError(f"tokens: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    diff = a != b
    n = a.shape[1]
    idx = torch.where(diff.any(1), diff.float().argmax(1), torch.full((a.shape[0],), n))
    return idx.to(torch.int64)


def recipe_with(recipe: str | RolloutRecipe, **changes: Any) -> RolloutRecipe:
    """A copy of a recipe with fields changed (e.g. ``kv_calibration="amax"``)."""
    return replace(get_recipe(recipe), **changes)
