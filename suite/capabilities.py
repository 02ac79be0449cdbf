"""The capability table: every key an engine may declare, the area it belongs to, the engine ops a check needing it
calls, and what it means.

An engine's ``capabilities()`` maps keys of this table to ``True`` (available) or to a reason why not; a check
``requires=`` keys of this table (with ``{param}`` placeholders filled from its parameters) and is skipped with the
engine's reason when one is missing. An engine that declares a key not in this table fails to load, with the list
of known keys. The mutant-matrix pruning (``conformance/conftest.py``), ``fp8rl engines`` and the adapters read
this table; engines name the keys they declare (a key's area, ops and meaning are only here), and the lists the
keys are built from (element formats, granularity kinds, rollout and microscaling recipes) are the oracle's
(fp8rl.reference), imported, not copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fp8rl import fixtures
from fp8rl.fixtures import WSYNC_FAMILIES
from fp8rl.reference import microscaling, mx_weight_sync, rollout
from fp8rl.reference.formats import ELEMENT_FORMATS
from fp8rl.reference.quant import GRANULARITY_KINDS

#: the granularity kinds of ``quantize.<kind>``: the oracle's (fp8rl.reference.quant.GRANULARITY_KINDS)
QUANT_KINDS: tuple[str, ...] = GRANULARITY_KINDS
GEMM_KINDS = ("block", "tensor", "row")
#: the rollout numerics recipes (``rollout.<recipe>``): the oracle's recipes
ROLLOUT_RECIPES: tuple[str, ...] = tuple(rollout.RECIPES)
#: the microscaling recipes (``mx_quantize.<recipe>``): fp8rl.reference.microscaling.RECIPES
MX_RECIPES: tuple[str, ...] = tuple(microscaling.RECIPES)
#: the microscaling weight-sync recipes (``mx_weight_sync.<recipe>``): fp8rl.reference.mx_weight_sync.MX_SYNC_RECIPES
MX_SYNC_RECIPES: tuple[str, ...] = tuple(mx_weight_sync.MX_SYNC_RECIPES)

#: what each weight-sync architecture family beyond Qwen adds (``weight_sync.<family>``; the families are the
#: fixtures' list, fp8rl.fixtures.WSYNC_FAMILIES, imported)
WSYNC_FAMILY_NOTES: dict[str, str] = {
    "llama": "Llama dense (tiny-llama)",
    "mla": "DeepSeek-V3 MLA attention (q_a/q_b/kv_a_proj_with_mqa/kv_b_proj; tiny-deepseek-v3)",
    "fused-experts": "3-D packed MoE experts, transformers 5's mlp.experts.gate_up_proj / down_proj "
                     "(tiny-qwen3-moe-fused, tiny-deepseek-v3)",
    "multimodal": "multimodal wrapper: language model under model.language_model., vision tower model.visual. "
                  "kept BF16 (tiny-qwen2.5-vl)",
}
#: the capability keys of those families, ``weight_sync.<family>``
WSYNC_FAMILY_KEYS: tuple[str, ...] = tuple(f"weight_sync.{fam}" for fam in WSYNC_FAMILIES)
#: the families the e2e area rolls out (those of fixtures.E2E_FAMILY_MODELS), and their keys ``rollout.<family>``
ROLLOUT_FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(
    fam for m in fixtures.E2E_FAMILY_MODELS for fam in fixtures.model_families(m)))
ROLLOUT_FAMILY_KEYS: tuple[str, ...] = tuple(f"rollout.{fam}" for fam in ROLLOUT_FAMILIES)


def family_keys(prefix: str, model: str) -> tuple[str, ...]:
    """The capability keys ``<prefix>.<family>`` a case of the fixture ``model`` needs for its families
    (``prefix`` "weight_sync" or "rollout"; none for the Qwen fixtures)."""
    return tuple(f"{prefix}.{fam}" for fam in fixtures.model_families(model))
_KV_OPS = ("kv_policy", "kv_store", "kv_attention", "kv_calibrate", "kv_update_scales", "kv_forward",
           "_kv_current_scales", "_kv_layers")
_ROLLOUT_OPS = ("rollout_init", "rollout", "weight_sync", "_weight_sync_recipe", "scale_policy",
                "_rollout_policy_class")


@dataclass(frozen=True)
class Capability:
    key: str
    area: str
    #: the engine methods a check needing this capability calls (a deterministic mutant that overrides none of
    #: them answers exactly as the reference engine does, so ``fp8rl mutants`` may skip the pair)
    ops: tuple[str, ...]
    description: str


def _table() -> dict[str, Capability]:
    rows: list[Capability] = []
    for f in ELEMENT_FORMATS:
        rows.append(Capability(f"cast.{f}", "formats", ("cast", "cast_overflow"),
                               f"cast(x, '{f}'): fp32 or bf16 → {f} codes under the declared overflow policy"))
    rows.append(Capability("cast.bf16", "formats", ("round_bf16",), "round_bf16(x): fp32 → bfloat16, nearest even"))
    for k in QUANT_KINDS:
        rows.append(Capability(f"quantize.{k}", "quantization", ("quantize", "scale_policy"),
                               f"quantize(x, Granularity.{k}(...)) under the declared scale_policy('{k}')"))
    rows.append(Capability("quantize_nonfinite", "quantization", ("quantize", "scale_policy"),
                           "quantize(x, ...) of groups holding ±inf or NaN follows the declared scale_policy too "
                           "(e.g. DeepGEMM's UE8M0 exponent clamp: an inf/NaN amax gives 2^127)"))
    gemm_desc = {"block": "1×G activations × B×B weights (W8A8 blockwise)", "tensor": "per-tensor scaled operands",
                 "row": "per-token activations × per-channel weights"}
    for k in GEMM_KINDS:
        rows.append(Capability(f"gemm.{k}", "gemm", ("block_gemm",), f"block_gemm(a, w, out_dtype): {gemm_desc[k]}"))
    kv_desc = {
        "kv.store": "kv_store: quantize-on-store of K/V under the declared kv_policy (tensor/head/token_head scales)",
        "kv.attention": "kv_attention: FP8 attention over FP8 caches (GQA, causal, ragged lengths, q_scale)",
        "kv.calibrate": "kv_calibrate: Q/K/V scales from captured activations (engine first batch, trainer p99.9, "
                        "amax)",
        "kv.forward": "kv_forward: one layer's FP8 KV path with the scales the engine would use by itself",
        "kv.update_scales": "kv_update_scales: install new scales after a weight update, or reset for engine-side "
                            "recalibration",
    }
    rows += [Capability(k, "kv", _KV_OPS, d) for k, d in kv_desc.items()]
    corr = ("rollout_correction", "correction_loss")
    rows += [
        Capability("rollout_correction", "correction", corr,
                   "rollout_correction: token/sequence TIS, IcePop, batch normalization, rejection sampling, "
                   "mismatch metrics"),
        Capability("rollout_correction.geometric", "correction", corr, "rollout_is='geometric' sequence weights"),
        Capability("rollout_correction.veto", "correction", corr, "the rollout_token_veto_threshold option"),
        Capability("rollout_correction.loss", "correction", corr,
                   "correction_loss: PPO-clip / REINFORCE policy loss weighted by IS weights"),
        Capability("rollout_correction.proximal", "correction", ("proximal_logp",),
                   "proximal_logp: decoupled PPO's proximal policy approximated from the behaviour and current "
                   "policies and per-token versions (loglinear / linear interpolation)"),
        Capability("rollout_correction.decoupled", "correction", ("decoupled_loss",),
                   "decoupled_loss: decoupled PPO, PPO-clip around the proximal policy × the behaviour IS weight "
                   "π_prox/π_behave, token-mean over the original mask"),
        Capability("weight_sync", "weight_sync", ("weight_sync", "_weight_sync_recipe", "scale_policy"),
                   "weight_sync: BF16 → FP8 128×128 state-dict sync (*_weight_scale_inv), exclusions"),
        Capability("weight_sync.refit", "weight_sync", ("refit", "weight_sync", "_weight_sync_recipe", "scale_policy"),
                   "refit(config, state_dict): each step's FP8 refit into the live inference model, every "
                   "parameter read back (codes, scales, BF16 leftovers); a failed refit raises, nothing half-updated"),
        Capability("weight_sync.refit_kv", "weight_sync", ("refit", "weight_sync", "_weight_sync_recipe", "scale_policy"),
                   "refit with an FP8 KV cache (config kv_cache_dtype 'fp8_e4m3'): the step's KV-cache scales "
                   "(<layer>.self_attn.k_scale/v_scale) ride in the stream and the read-back holds the scales the "
                   "attention kernels use"),
        Capability("weight_sync.refit_memory", "weight_sync", ("refit",),
                   "refit's live model lives in the checking process, so the tensor memory each refit leaves behind "
                   "can be counted (every tensor Python reaches; an engine whose model runs in another process "
                   "leaves this unavailable with that reason)"),
        Capability("rollout", "e2e", _ROLLOUT_OPS, "rollout_init / rollout: generation with reported log-probs"),
        Capability("update_weights", "e2e", ("update_weights",) + _ROLLOUT_OPS,
                   "update_weights: load new weights into a running policy (per-step sync)"),
    ]
    for fam, key in zip(ROLLOUT_FAMILIES, ROLLOUT_FAMILY_KEYS):
        rows.append(Capability(key, "e2e", _ROLLOUT_OPS,
                               f"rollouts of the {WSYNC_FAMILY_NOTES[fam]} fixture (fp8rl.fixtures.E2E_FAMILY_MODELS)"))
    for fam, key in zip(WSYNC_FAMILIES, WSYNC_FAMILY_KEYS):
        what = WSYNC_FAMILY_NOTES[fam]
        rows.append(Capability(key, "weight_sync", ("weight_sync", "_weight_sync_recipe", "scale_policy"),
                               f"weight_sync of the {what} fixtures (fp8rl.fixtures.WSYNC_FAMILIES)"))
    rows += [
        Capability("checkpoint.write", "checkpoint", ("checkpoint_write", "scale_policy"),
                   "checkpoint_write: BF16/fp32 weights → a blockwise-FP8 HF checkpoint (codes, *_weight_scale_inv, "
                   "quantization_config) under the declared scale_policy('block')"),
        Capability("checkpoint.write_channel", "checkpoint", ("checkpoint_write_channel", "scale_policy"),
                   "checkpoint_write_channel: BF16/fp32 weights → a compressed-tensors channel-strategy checkpoint "
                   "(llm-compressor's FP8_DYNAMIC: codes, one weight_scale per output row, dynamic per-token FP8 "
                   "activations) under the declared scale_policy('channel')"),
        Capability("checkpoint.load", "checkpoint", ("checkpoint_load",),
                   "checkpoint_load: the weights a loader holds after loading a blockwise-FP8 checkpoint "
                   "(dequantized, checkpoint names); bad checkpoints raise"),
        Capability("checkpoint.score", "checkpoint", ("checkpoint_score",),
                   "checkpoint_score: the log-probs the model a loader loads from a checkpoint gives to given tokens "
                   "(teacher-forced, its own forward; (B, T - prompt_len) float32)"),
        Capability("checkpoint.attention_scales", "checkpoint", ("checkpoint_attention_scales",),
                   "checkpoint_attention_scales: the q/k/v scales each attention layer uses after loading a checkpoint "
                   "with an FP8 (e4m3) KV cache (layer index → {'q', 'k', 'v'}: the file's k_scale / v_scale / "
                   "q_scale or the documented defaults)"),
    ]
    rows += [Capability(f"rollout.{r}", "e2e", _ROLLOUT_OPS, f"rollouts under the {r} numerics recipe")
             for r in ROLLOUT_RECIPES]
    rows.append(Capability("rollout.logits", "e2e", ("rollout_logits",) + _ROLLOUT_OPS,
                           "rollout_logits: a rollout that also returns the fp32 logits each token was drawn from "
                           "(the self-consistency checks: log-probs, greedy argmax, goodness of fit)"))
    # the microscaling recipes belong to the quantization and gemm areas (docs/microscaling.md)
    mx_ops = ("mx_quantize", "mx_policy")
    for r in MX_RECIPES:
        rows.append(Capability(f"mx_quantize.{r}", "quantization", mx_ops,
                               f"mx_quantize(x, '{r}'): microscaled codes and scales under the declared mx_policy('{r}') "
                               "(fp8rl.reference.microscaling)"))
        rows.append(Capability(f"mx_gemm.{r}", "gemm", ("mx_gemm",),
                               f"mx_gemm(a, w, out_dtype): y = a @ wᵀ of two {r} tensors, fp32 accumulation"))
    for r in MX_SYNC_RECIPES:
        rows.append(Capability(f"mx_weight_sync.{r}", "weight_sync", ("mx_weight_sync", "mx_policy"),
                               f"mx_weight_sync(state_dict, '{r}'): the {r} weight sync, compressed-tensors names "
                               "(fp8rl.reference.mx_weight_sync)"))
    rows.append(Capability("mx_quantize.nondivisible", "quantization", mx_ops,
                           "mx_quantize of a last dimension that is not a multiple of the block (32 or 16) or odd "
                           "(packed FP4): the edge block holds the real elements only"))
    return {c.key: c for c in rows}


#: every capability key, in display order
CAPABILITIES: dict[str, Capability] = _table()


def keys(area: str | None = None, prefix: str | None = None) -> list[str]:
    """The capability keys of an area and/or with a key prefix (e.g. ``prefix="cast."``)."""
    return [k for k, c in CAPABILITIES.items()
            if (area is None or c.area == area) and (prefix is None or k.startswith(prefix))]


def all_of(area: str, status: bool | str = True) -> dict[str, bool | str]:
    """Every key of ``area`` with one status (True, or the reason they are all unavailable)."""
    return dict.fromkeys(keys(area), status)


def get(key: str) -> Capability:
    """The table entry of ``key``; KeyError names the known keys."""
    try:
        return CAPABILITIES[key]
    except KeyError:
        raise KeyError(f"unknown capability {key!r}; known: {', '.join(CAPABILITIES)}") from None


def validate_declared(engine_name: str, caps: Any) -> dict[str, bool | str]:
    """An engine's ``capabilities()`` result, checked against the table: a mapping of known keys to True or a
    non-empty reason. Raises ValueError naming the engine, the key and the expectation."""
    if not isinstance(caps, Mapping):
        raise ValueError(f"engine {engine_name!r}: capabilities() returned {type(caps).__name__}, expected a dict of "
                         "capability key → True or a reason")
    out: dict[str, bool | str] = {}
    for key, status in caps.items():
        if key not in CAPABILITIES:
            raise ValueError(f"engine {engine_name!r} declares unknown capability {key!r}; known keys: "
                             f"{', '.join(CAPABILITIES)}")
        if status is not True and not (isinstance(status, str) and status.strip()):
            raise ValueError(f"engine {engine_name!r}: capability {key!r} is {status!r}; expected True or a "
                             "non-empty reason why it is unavailable")
        out[key] = status
    return out


def ops_of(required: list[str]) -> set[str] | None:
    """The engine methods the checks needing ``required`` call (None if one key is unknown: never prune)."""
    out: set[str] = set()
    for key in required:
        cap = CAPABILITIES.get(key)
        if cap is None:
            return None
        out.update(cap.ops)
    return out


__all__ = ["CAPABILITIES", "Capability", "ELEMENT_FORMATS", "GEMM_KINDS", "MX_RECIPES", "MX_SYNC_RECIPES",
           "QUANT_KINDS", "ROLLOUT_RECIPES", "all_of", "get", "keys", "ops_of", "validate_declared"]
