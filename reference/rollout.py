"""FP8 rollout numerics: fake quantization, W8A8 linear and FP8 KV-cache emulation, KV calibration, mismatch metrics.

This is the pure-torch half of the rollout oracle and needs only torch and numpy. Its other half,
:mod:`fp8rl.reference.rollout_hf`, puts these numerics into a ``transformers`` model
(:class:`~fp8rl.reference.rollout_hf.RolloutPolicy`: HF config dict → model, checkpoint-named state dict, scoring and
generation) and needs transformers and safetensors.

A :class:`RolloutRecipe` (:data:`RECIPES`, named like the perf model's precision configs) says which parts of the
rollout run in FP8:

* ``bf16``: the model as transformers runs it in BF16 (``sdpa`` attention, the ``eager`` expert loop). Its
  teacher-forced score is **the trainer's policy** π_old, the oracle every rollout is compared with; its generation
  decodes incrementally with a KV cache.
* ``fp8-linear``: W8A8 blockwise linear layers (docs/paper-numbers.md §1.1, :class:`FP8Linear`, :class:`FP8Experts`,
  :class:`FP8Router`): the synced weights (FP8 codes + 128×128 ``*_weight_scale_inv``,
  :mod:`fp8rl.reference.weight_sync`) are dequantized exactly, activations are quantized dynamically per token and
  1×128 group under the activation ScalePolicy, the product is formed in fp64 (exact up to fp64 rounding) and
  rounded once to BF16 — what a W8A8 kernel with fp32 accumulation computes, without its accumulation error. Every
  weight the synced dict holds in FP8 runs this way (a quantized lm_head or router too); everything else stays BF16.
* ``fp8-linear-ptpc``: W8A8 "PTPC" linear layers (vLLM ``quantization="fp8_per_channel"``, llm-compressor
  FP8_DYNAMIC): the same layers as ``fp8-linear`` quantized per output channel (one scale per weight row, from the
  BF16 weights under the weight ScalePolicy; no weight sync: the engine quantizes what it loads), activations
  quantized dynamically per token under the activation ScalePolicy; exact dequantized operands, fp64 product
  rounded once to BF16.
* ``fp8-kv``: FP8 (e4m3fn) KV cache "for storage only" (verl PR #4435): post-RoPE keys and values are quantized
  per tensor and per layer, ``code = RNE_sat(clamp(x / s, ±448))``, and attention reads them dequantized (fp32
  attention math, output rounded to BF16).
* ``fp8-all``: both, and the query is quantized too (FP8 attention, "storage and attention calculation").
* ``mxfp8`` and ``nvfp4-experts``: the microscaling rollout recipes (docs/microscaling.md). The weights are the
  microscaling weight sync's (:mod:`fp8rl.reference.mx_weight_sync`: ``mxfp8`` every projection MXFP8 e4m3 with E8M0
  scales per 1×32, ``nvfp4-experts`` the routed experts only NVFP4), dequantized exactly; activations are quantized
  dynamically with the same recipe per token and 1×32 block (NVFP4: 1×16 blocks under a dynamic per-tensor global
  scale of the GEMM input, :class:`MXActQuant`); fp64 product rounded once to BF16. Everything the sync keeps BF16
  runs in BF16 (under nvfp4-experts: attention, dense MLPs, a shared expert, router, lm_head); BF16 KV cache.

KV scales (:class:`_KVState`) are calibrated as vLLM's ``calculate_kv_scales`` did (docs/paper-numbers.md §2.3, strategy A;
``kv_calibration="first_batch"``): on the first forward after load or after every weight update, per layer,
``q_scale = max|q|/200``, ``k_scale = max|k|/200``, ``v_scale = max|v|/100`` over that batch, then frozen.
``"amax"`` uses ``max|x|/448`` instead (:data:`KV_CALIBRATIONS`). Scales can also be pushed (strategy B).

The FP8 casts use torch's ``float8_e4m3fn`` conversion only after a canary has shown it equal to the oracle's
bit-level encoder (:func:`fp8rl.reference.formats.encode_codes`) on every e4m3fn rounding boundary; otherwise, and
for other formats or overflow policies, the oracle's :func:`~fp8rl.reference.quant.quantize` is used (slow but the
same values). The test suite checks :func:`fake_quant` against the oracle bit for bit.

Also here: :func:`mismatch_metrics` (k3 KL, token_mult_prob_error, max |Δlogp|, docs/paper-numbers.md §3.4),
:func:`first_divergence` for greedy rollouts, :class:`RolloutOutput` (the (tokens, logprobs) pair of a rollout)
and :func:`single_thread`.
"""

from __future__ import annotations

import contextlib
import functools
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
    "KV_CALIBRATIONS", "RECIPES", "FP8Experts", "FP8Linear", "FP8Router", "MXActQuant", "RolloutOutput", "RolloutRecipe",
    "fake_quant", "fake_quant_with_scale", "first_divergence", "get_recipe", "mismatch_metrics", "recipe_with",
    "single_thread",
]

#: per-tensor KV calibration: name → divisor of max|x| for (q, k, v)
KV_CALIBRATIONS: dict[str, tuple[float, float, float]] = {
    "first_batch": (200.0, 200.0, 100.0),  # vLLM Q/K/V_SCALE_CONSTANT (calculate_kv_scales), verl PR #4435
    "amax": (448.0, 448.0, 448.0),
}

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
    #: a microscaling recipe (fp8rl.reference.mx_weight_sync.MX_SYNC_RECIPES: "mxfp8", "nvfp4-experts") instead of
    #: FP8: its weight sync and its format for the activations
    mx: str | None = None

    def __post_init__(self) -> None:
        if self.linear not in ("block", "channel"):
            raise ValueError(f"linear: expected 'block' or 'channel', got {self.linear!r}")
        if self.kv_calibration not in KV_CALIBRATIONS:
            raise ValueError(f"kv_calibration: expected one of {sorted(KV_CALIBRATIONS)}, got {self.kv_calibration!r}")
        if self.fp8_q and not self.fp8_kv:
            raise ValueError("fp8_q: FP8 attention needs the FP8 KV cache (fp8_kv=True)")
        if self.mx is not None:
            from fp8rl.reference.mx_weight_sync import get_mx_sync_recipe

            get_mx_sync_recipe(self.mx)  # a clear error for an unknown recipe
            if not self.fp8_linear:
                raise ValueError(f"mx: the microscaling recipe {self.mx!r} quantizes linear layers (fp8_linear=True)")

    @property
    def synced_weights(self) -> bool:
        """True when the recipe runs on the FP8 weight-sync output (128×128 block FP8 weights + scales)."""
        return self.fp8_linear and self.linear == "block" and self.mx is None

    def act_granularity(self) -> Granularity:
        """Granularity of the dynamic activation quantization of the FP8 linear layers."""
        return Granularity.token() if self.linear == "channel" else Granularity.group(self.act_group)


RECIPES: dict[str, RolloutRecipe] = {r.name: r for r in (
    RolloutRecipe("bf16"),
    RolloutRecipe("fp8-linear", fp8_linear=True),
    RolloutRecipe("fp8-linear-ptpc", fp8_linear=True, linear="channel"),
    RolloutRecipe("fp8-kv", fp8_kv=True),
    RolloutRecipe("fp8-all", fp8_linear=True, fp8_kv=True, fp8_q=True),
    RolloutRecipe("mxfp8", fp8_linear=True, mx="mxfp8"),
    RolloutRecipe("nvfp4-experts", fp8_linear=True, mx="nvfp4-experts"),
)}


def get_recipe(recipe: str | RolloutRecipe) -> RolloutRecipe:
    if isinstance(recipe, RolloutRecipe):
        return recipe
    try:
        return RECIPES[recipe]
    except (KeyError, TypeError):
        raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {recipe!r}") from None


def recipe_with(recipe: str | RolloutRecipe, **changes: Any) -> RolloutRecipe:
    """A copy of a recipe with fields changed (e.g. ``kv_calibration="amax"``)."""
    return replace(get_recipe(recipe), **changes)


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
# FP8 modules


class _ActQuant:
    """Dynamic 1×G (or per-token) activation quantization under a ScalePolicy → exact fp64 dequantized
    activations. ``group``: the group size G, or a Granularity (e.g. ``Granularity.token()``)."""

    def __init__(self, policy: ScalePolicy, group: int | Granularity) -> None:
        self.policy = policy
        self.g = group if isinstance(group, Granularity) else Granularity.group(group)

    def __call__(self, x2d: torch.Tensor) -> torch.Tensor:
        return fake_quant(x2d.float(), self.g, self.policy)


class MXActQuant:
    """Dynamic microscaling activation quantization → exact fp64 dequantized activations: blocks of the recipe along
    the last dim of each row (1×32 E8M0; NVFP4 1×16 E4M3 under one fp32 global scale g = 2688/amax of the GEMM
    input, computed per call), by :func:`fp8rl.reference.microscaling.mx_quantize` under ``policy``."""

    def __init__(self, policy: Any) -> None:
        from fp8rl.reference import microscaling as mx

        self.policy = mx.get_mx_policy(policy)

    def __call__(self, x2d: torch.Tensor) -> torch.Tensor:
        from fp8rl.reference import microscaling as mx

        if x2d.numel() == 0:
            return x2d.to(torch.float64)
        return mx.dequantize_mx(mx.mx_quantize(x2d.float(), self.policy))


def _fp8_matmul(x: torch.Tensor, w64: torch.Tensor, act: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    shp = x.shape
    y = act(x.reshape(-1, shp[-1])) @ w64.t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype).reshape(*shp[:-1], w64.shape[0])


class FP8Linear(nn.Module):
    """W8A8 blockwise linear: exact dequantized FP8 weight (fp64), dynamic 1×G activations, fp64 product → BF16.

    ``bias`` (e.g. Qwen2's q/k/v biases, kept BF16 by weight sync): added to the exact fp64 product before the one
    rounding to BF16, as a GEMM epilogue does."""

    w64: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w64: torch.Tensor, act: _ActQuant, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("w64", w64, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_matmul(x, self.w64, self.act, self.bias)


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
# FP8 KV cache: calibration and quantize-on-store


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


# ----------------------------------------------------------------------------------------------------------------
# rollouts


class RolloutOutput(NamedTuple):
    tokens: torch.Tensor  # (B, P + N) int64: prompts then the generated tokens
    logprobs: torch.Tensor  # (B, N) float32: log π(token) of each generated token under the policy


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


# ----------------------------------------------------------------------------------------------------------------
# mismatch metrics (docs/paper-numbers.md §3.4, verl rollout_corr, NeMo-RL)


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

