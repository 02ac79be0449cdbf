"""Rollout policies on HF ``transformers`` models: the same model under BF16 (the trainer) or emulated FP8 numerics
(the rollout).

:class:`RolloutPolicy` builds a ``transformers`` causal LM (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, …) from an
HF config dict (:func:`build_hf_model`), loads a checkpoint-named state dict (:func:`to_model_state_dict`: MoE
experts fused the transformers ≥ 5 way) and swaps its numerics according to a
:class:`~fp8rl.reference.rollout.RolloutRecipe`: FP8 linear layers become the W8A8 emulation modules of
:mod:`fp8rl.reference.rollout`, and FP8-KV recipes run attention through a registered attention function over a
``DynamicCache`` that stores keys/values FP8-rounded with the recipe's calibrated scales. Its teacher-forced
:meth:`RolloutPolicy.score` under ``bf16`` is **the trainer's policy** π_old; :meth:`RolloutPolicy.generate`
decodes incrementally with the (FP8 or BF16) KV cache. :meth:`RolloutPolicy.update_weights` recalibrates the KV
scales unless told not to (the stale-scale failure mode of docs/paper-numbers.md §2.5); :meth:`RolloutPolicy.set_kv_scales` pushes
trainer-side scales (strategy B).

Dependencies: building and running a model needs ``transformers`` ≥ 5 and ``safetensors`` (``pip install
'fp8rl[e2e]'``) on top of torch and numpy. Every transformers import is inside a function, so importing this module
needs only torch and numpy and :func:`transformers_reason` can say what is missing. The numerics themselves
(recipes, fake quantization, FP8 linear/KV emulation, calibration, mismatch metrics) are in
:mod:`fp8rl.reference.rollout`; the recipe table and the metrics are re-exported here so that an e2e caller needs one
module.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, cast

import torch
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, quantize
from fp8rl.reference.rollout import (
    KV_CALIBRATIONS,
    RECIPES,
    FP8Experts,
    FP8Linear,
    FP8Router,
    MXActQuant,
    RolloutOutput,
    RolloutRecipe,
    _ActQuant,
    _KVState,
    first_divergence,
    get_recipe,
    mismatch_metrics,
    recipe_with,
    single_thread,
)
from torch import nn

__all__ = [
    "RolloutPolicy", "build_hf_model", "cache_kwarg", "checkpoint_policy", "to_model_state_dict",
    "transformers_reason",
    # re-exported from fp8rl.reference.rollout
    "KV_CALIBRATIONS", "RECIPES", "RolloutOutput", "RolloutRecipe", "first_divergence", "get_recipe",
    "mismatch_metrics", "recipe_with", "single_thread",
]

_ATTN_NAME = "fp8rl_fp8_attention"


# ----------------------------------------------------------------------------------------------------------------
# model construction and state-dict conversion

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
#: an expert's slice of transformers 5's packed experts, as fp8rl.reference.weight_sync.synced_tensors keys it
#: (``mlp.experts.gate_up_proj[e]``: rows [gate_e; up_e]; ``mlp.experts.down_proj[e]``)
_PACKED_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)\[(?P<e>\d+)\]$")


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
    """A transformers causal LM for an HF config dict (random init; load weights afterwards), eval mode, no grads.
    A multimodal config (one ``AutoModelForCausalLM`` has no class for, e.g. ``Qwen2_5_VLConfig``) builds its
    ``AutoModelForImageTextToText`` class, whose text-only forward is its language model's with its LM head."""
    _offline()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cfg = {k: v for k, v in dict(config).items() if k not in ("quantization_config", "transformers_version")}
    model_type = cfg.pop("model_type")
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    auto = AutoModelForCausalLM if type(hf_cfg) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModelForImageTextToText
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "dtype": dtype}
    if experts_implementation is not None and "moe" in model_type:
        kwargs["experts_implementation"] = experts_implementation
    if attn_implementation == _ATTN_NAME:
        _register_attention()
    try:
        model = auto.from_config(hf_cfg, **kwargs)
    except TypeError:  # transformers without selectable expert kernels: its only kernel is the eager loop
        if "experts_implementation" not in kwargs:
            raise
        kwargs.pop("experts_implementation")
        model = auto.from_config(hf_cfg, **kwargs)
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


def _tied_names(model: nn.Module, missing: list[str]) -> set[str]:
    """The ``missing`` parameter names that are tied to a loaded parameter (``tie_word_embeddings``: ``lm_head.weight``
    is ``model.embed_tokens.weight``, which the checkpoint holds once)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    miss = set(missing)
    return {n for names in by_id.values() if any(m not in miss for m in names) for n in names if n in miss}


def _get_module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


# ----------------------------------------------------------------------------------------------------------------
# FP8 KV cache and attention (transformers glue)


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
      (content-keyed, process-wide, per policy class: a subclass with another :meth:`decode_step` never shares;
      generation is deterministic). The reference engine turns it on so that the
      many engines of a mutants run do not recompute identical rollouts.
    """

    def __init__(self, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                 recipe: str | RolloutRecipe = "bf16", *, synced: Mapping[str, torch.Tensor] | None = None,
                 weight_policy: ScalePolicy | str = "reference", act_policy: ScalePolicy | str = "reference",
                 experts_implementation: str | None = "eager", weight_block: tuple[int, int] = (128, 128),
                 memo: bool = False, mx_policy: Any = None) -> None:
        self.config = dict(config)
        self.memo = memo
        self.recipe = get_recipe(recipe)
        self.mx_policy = None
        if self.recipe.mx is not None:
            from fp8rl.reference import microscaling as mx
            from fp8rl.reference.mx_weight_sync import get_mx_sync_recipe

            self.mx_policy = mx.get_mx_policy(mx_policy if mx_policy is not None else
                                              get_mx_sync_recipe(self.recipe.mx).mx_recipe)
        self.weight_policy = get_policy(weight_policy)
        self.act_policy = get_policy(act_policy)
        self.experts_implementation = experts_implementation
        self.weight_block = cast(tuple[int, int], tuple(weight_block))  # a list from JSON/YAML becomes the pair
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
        qts: Mapping[str, Any]
        if r.fp8_linear and not r.synced_weights and r.mx is None:
            if synced is not None:
                raise ValueError(f"synced: recipe {r.name!r} quantizes the BF16 weights per channel itself")
            g = Granularity.channel()
            names = set(ws.quantized_names(state_dict))
            qts = {n: quantize(state_dict[n].detach().to("cpu", torch.bfloat16), g, self.weight_policy)
                   for n in state_dict if n in names}
            plain = {k: v for k, v in state_dict.items() if k not in names}
        elif r.mx is not None:
            qts, plain = self._mx_weights(state_dict, synced)
        elif r.fp8_linear:
            if synced is None:
                synced = ws.quantize_state_dict(state_dict, ws.WeightSyncRecipe(block=self.weight_block,
                                                                                policy=self.weight_policy))
            qts = ws.synced_tensors(synced, self.weight_block)
            scale_names = {ws.scale_name(n) for n in synced if ws.scale_name(n) in synced}  # packed: keys name[e]
            plain = {k: v for k, v in synced.items() if k not in qts and k not in scale_names}
        else:
            qts, plain = {}, dict(state_dict)
        self._fingerprint = (type(self).__module__, type(self).__qualname__, r, self.weight_block, self.act_policy, self.experts_implementation,
                             self.weight_policy, self.mx_policy,
                             _digest(synced if r.synced_weights or (r.mx and synced is not None) else state_dict),
                             _digest(self.config))
        params = to_model_state_dict(plain)
        missing, unexpected = model.load_state_dict(params, strict=False)
        if unexpected:
            raise ValueError(f"state_dict: names the model does not have: {unexpected[:5]}")
        covered = self._install_fp8(model, qts) | _tied_names(model, missing)
        left = [m for m in missing if m not in covered]
        if left:
            raise ValueError(f"state_dict: missing weights {left[:5]}")
        if self.kv is not None:
            if any(hasattr(mod, "kv_a_proj_with_mqa") for mod in model.modules()):
                raise ValueError(f"recipe {r.name!r}: the FP8 KV emulation quantizes each head's K and V as a paged "
                                 "cache holds them; an MLA model (DeepSeek's kv_a_proj_with_mqa) caches its compressed "
                                 "latent instead (one scale over c_kv and the roped k_pe), which this oracle does not "
                                 "emulate: use a recipe without an FP8 KV cache (bf16, fp8-linear)")
            for mod in model.modules():
                if hasattr(mod, "layer_idx") and hasattr(mod, "k_proj"):
                    setattr(mod, "_fp8rl_kv", self.kv)  # noqa: B010 - read by _fp8_attention
        self.model = model

    def _mx_weights(self, state_dict: Mapping[str, torch.Tensor], synced: Mapping[str, torch.Tensor] | None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The microscaling recipe's weights: (checkpoint weight name → exact fp64 dequantized weight, the BF16 rest),
        from ``synced`` (an engine's mx_weight_sync output) or the oracle's sync of ``state_dict``."""
        from fp8rl.reference import microscaling as mx
        from fp8rl.reference import mx_weight_sync as mxws

        policy = self.mx_policy
        if self.recipe.mx is None or policy is None:  # pragma: no cover - _load calls this for mx recipes only
            raise ValueError(f"recipe {self.recipe.name!r} is not a microscaling recipe")
        rec = mxws.get_mx_sync_recipe(self.recipe.mx)
        if synced is None:
            synced = mxws.mx_sync_state_dict(state_dict, rec, policy)
        w64s: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        for name in mxws.mx_quantized_names(state_dict, rec):
            parts = mxws.mx_synced_names(name, rec)
            missing = [p for p in parts if p not in synced]
            if missing:
                raise ValueError(f"synced: {name} is quantized by {rec.name} but {missing} are missing")
            data = synced[parts[0]].contiguous().view(torch.uint8)
            scales = synced[parts[1]].contiguous().view(torch.uint8)
            g = synced[parts[2]].reshape(()).float() if policy.two_level else None
            q = mx.MXTensor(data, scales, g, tuple(state_dict[name].shape), policy)
            w64s[name] = mx.dequantize_mx(q)
            used.update(parts)
        plain = {k: v for k, v in synced.items() if k not in used}
        return w64s, plain

    def _install_fp8(self, model: nn.Module, qts: Mapping[str, Any]) -> set[str]:
        """Swap every module whose weight is quantized (FP8 QuantizedTensors, or the exact fp64 weights of a
        microscaling recipe); returns the model param names it covers."""
        act: Any = MXActQuant(self.mx_policy) if self.recipe.mx is not None else \
            _ActQuant(self.act_policy, self.recipe.act_granularity())
        covered: set[str] = set()
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for name, qt in qts.items():
            w64 = qt if isinstance(qt, torch.Tensor) else qt.dequantize(torch.float64)
            m = _EXPERT_RE.match(name)
            if m is not None:
                experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["proj"]] = w64
                continue
            m = _PACKED_EXPERT_RE.match(name)
            if m is not None:  # a packed slice: gate_up_proj[e] holds [gate_e; up_e] (fixtures.fuse_experts)
                slot = experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})
                if m["proj"] == "down_proj":
                    slot["down_proj"] = w64
                else:
                    half = w64.shape[0] // 2
                    slot["gate_proj"], slot["up_proj"] = w64[:half], w64[half:]
                continue
            path = name[: -len(".weight")] if name.endswith(".weight") else name
            mod = _get_module(model, path)
            if isinstance(mod, nn.Linear):  # attention/MLP/shared-expert projections (a bias stays BF16)
                _set_module(model, path, FP8Linear(w64, act, mod.bias))
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
        ``torch.Generator`` (one generator for the batch: its rows are independent draws); prefill then incremental
        decoding with the (FP8 or BF16) KV cache. Each step is :meth:`decode_step`."""
        tokens, logprobs, _ = self.generate_with_logits(prompts, max_new_tokens, greedy=greedy, seed=seed)
        return RolloutOutput(tokens, logprobs)

    @torch.inference_mode()
    def generate_with_logits(self, prompts: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
                             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`generate` (the same tokens and log-probs) plus the fp32 logits (B, N, V) each generated token was
        drawn from (greedy: the argmax of)."""
        prompts = _as_tokens(prompts, "prompts")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected ≥ 1, got {max_new_tokens}")
        if not self.memo:
            with single_thread():
                out = self._generate(prompts, max_new_tokens, greedy, seed)
            return out
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
        tokens, logprobs, logits = hit[0]
        return tokens.clone(), logprobs.clone(), logits.clone()

    def _kv_snapshot(self) -> tuple:
        return tuple(sorted((k, tuple(sorted(v.items()))) for k, v in self.kv.scales.items())) if self.kv else ()

    def decode_step(self, logits: torch.Tensor, greedy: bool, generator: torch.Generator,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoding step from the last position's logits (B, V) (BF16 from the model): returns the next tokens
        (B,) int64, their log-probs (B,) and the fp32 logits (B, V) they were drawn from. The log-probs are
        ``log_softmax`` of the fp32 logits; greedy takes the first maximal token (``torch.argmax``), sampling draws
        from ``softmax`` at temperature 1 (``torch.multinomial`` with ``generator``: rows independent)."""
        x = logits.float()
        lp = torch.log_softmax(x, dim=-1)
        nxt = lp.argmax(-1) if greedy else torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x

    def _generate(self, prompts: torch.Tensor, max_new_tokens: int, greedy: bool, seed: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(int(seed))
        cache = self._cache()
        kw = self._cache_kw
        logits = self.model(input_ids=prompts, **{kw: cache}, use_cache=True).logits[:, -1]
        toks, lps, xs = [], [], []
        for t in range(max_new_tokens):
            nxt, lp, x = self.decode_step(logits, greedy, gen)
            toks.append(nxt)
            lps.append(lp)
            xs.append(x)
            if t + 1 < max_new_tokens:
                logits = self.model(input_ids=nxt[:, None], **{kw: cache}, use_cache=True).logits[:, -1]
        return (torch.cat([prompts, torch.stack(toks, 1)], 1), torch.stack(lps, 1).float(),
                torch.stack(xs, 1).float())

    @torch.inference_mode()
    def greedy_full(self, prompts: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy tokens (B, P + N) where every step is a full forward over the whole prefix without a cache —
        the trainer's own greedy continuation (the reference for first-divergence positions)."""
        tokens = _as_tokens(prompts, "prompts")
        for _ in range(int(max_new_tokens)):
            nxt = self.logits(tokens)[:, -1].float().argmax(-1)
            tokens = torch.cat([tokens, nxt[:, None]], 1)
        return tokens


_GENERATE_MEMO: dict[tuple, tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict[int, dict[str, float]]]] = {}


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


def checkpoint_policy(path: Any) -> RolloutPolicy:
    """The oracle's model of an FP8 checkpoint directory, for judging what a loader's model computes: every FP8
    weight w = codes × scale (blockwise ``*_weight_scale_inv`` grids or a compressed-tensors scheme, by the file's
    ``quant_method``) computed exactly in fp64 and rounded once to BF16
    (:func:`fp8rl.reference.checkpoint_ct.dequantize_any`), every other tensor as stored, in a BF16 transformers
    model of the file's config under the ``bf16`` recipe (the trainer's numerics: BF16 GEMMs, BF16 KV).
    :meth:`RolloutPolicy.score` of it is log π_ckpt(a_t | a_<t), the log-probs a correct loader's model gives."""
    from fp8rl.reference import checkpoint as ck
    from fp8rl.reference import checkpoint_ct as cct

    config, tensors = ck.read_checkpoint(path)
    state = cct.dequantize_any(config, tensors, dtype=torch.bfloat16)
    return RolloutPolicy(config, state, "bf16")
