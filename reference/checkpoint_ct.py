"""The oracle's second checkpoint reader: compressed-tensors FP8 checkpoints (``quant_method: compressed-tensors``,
``format: float-quantized``), the format llm-compressor writes and vLLM loads (docs/compressed-tensors.md).

Format (compressed-tensors 0.17.0, vllm-project/compressed-tensors ``src/compressed_tensors/compressors/
naive_quantized/base.py`` ``FloatQuantizationCompressor``, ``compressors/model_compressors/model_compressor.py``
``ModelCompressor.update_config``): every quantized linear module ``<m>`` stores

* ``<m>.weight``: FP8 codes (``torch.float8_e4m3fn``) of the weight's shape (N, K);
* ``<m>.weight_scale``: the **dequant** multiplier (W ≈ fp8 · scale), in the weight's own dtype (bf16 for a bf16
  model; fp32 and fp16 accepted), of the strategy's shape:

  ============  ====================================  ===========================================
  strategy      scale shape                           element (n, k) uses
  ============  ====================================  ===========================================
  ``tensor``    (1,)                                  scale[0]
  ``channel``   (N, 1)                                scale[n, 0]
  ``group``     (N, ⌈K/G⌉), G = ``group_size``        scale[n, k // G]
  ``block``     (⌈N/Bn⌉, ⌈K/Bk⌉), ``block_structure``  scale[n // Bn, k // Bk]
  ============  ====================================  ===========================================

``config.json``'s ``quantization_config`` = ``{"quant_method": "compressed-tensors", "format": "float-quantized",
"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": true,
"strategy": ..., "group_size": ..., "block_structure": ..., "dynamic": false, ...}, "input_activations": ...}},
"ignore": [...], "quantization_status": "compressed", ...}``. ``ignore`` lists the Linear modules kept in full
precision (``lm_head``, MoE routers); an entry ``re:<pattern>`` is a regular expression matched from the start of
the module name (compressed-tensors ``utils/match.py``).

Reader: :func:`weight_scheme` validates the config (one config group with FP8 float weights; the reader cannot map
modules to several groups' ``targets`` without the model, so it refuses more than one); :func:`fp8_weights`
validates every FP8 weight against it and returns (codes, scale); :func:`dequantize_exact` computes codes · scale
in fp64 (exact) and rounds **once** (:func:`fp8rl.reference.checkpoint.round_exact`). A malformed file raises
:class:`~fp8rl.reference.checkpoint.CheckpointError` naming the tensor and the expectation.
:func:`dequantize_any` and :func:`fp8_weights_any` read either format (dispatch on ``quant_method``);
:func:`to_blockwise` rewrites a block-strategy file as the oracle's blockwise form (``*_weight_scale_inv`` fp32,
``quant_method: fp8``), for comparing a compressed-tensors writer with the blockwise oracle; :func:`from_blockwise`
the other way, so that the oracle's checkpoints can be fed to compressed-tensors loaders. :func:`channel_tensors` /
:func:`write_channel_checkpoint` write the oracle's own per-channel file (llm-compressor's ``FP8_DYNAMIC`` scheme:
one scale per output row, dynamic per-token FP8 activations), the compressed-tensors layout that vLLM runs on
every CPU.

Pure: torch and fp8rl.reference only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from fp8rl.reference import checkpoint as ck

__all__ = ["QUANT_METHOD", "STRATEGIES", "CTWeightScheme", "dequantize_any", "dequantize_checkpoint",
           "dequantize_exact", "expand_scale", "fp8_weights", "fp8_weights_any", "is_compressed_tensors",
           "from_blockwise", "is_ignored", "quantization_config", "scale_shape", "scale_suffix_any", "to_blockwise",
           "weight_scheme",
           "channel_tensors", "channel_quantization_config", "write_channel_checkpoint"]

QUANT_METHOD = "compressed-tensors"
FORMAT = "float-quantized"
STRATEGIES = ("tensor", "channel", "group", "block")
SCALE_SUFFIX = "_scale"  # <m>.weight → <m>.weight_scale
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CTWeightScheme:
    """The weight quantization of a compressed-tensors FP8 config group: ``strategy`` and its ``group_size`` (group)
    or ``block`` (Bn, Bk) (block); the element format is e4m3fn (compressed-tensors' only 8-bit float)."""

    strategy: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    fmt: str = "e4m3fn"


def is_compressed_tensors(config: Mapping[str, Any]) -> bool:
    """True iff ``config.quantization_config.quant_method`` is ``compressed-tensors``."""
    qc = config.get("quantization_config")
    return isinstance(qc, Mapping) and qc.get("quant_method") == QUANT_METHOD


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def weight_scheme(config: Mapping[str, Any]) -> tuple[CTWeightScheme, list[str]]:
    """(the weight scheme, the ``ignore`` list) of a compressed-tensors FP8 config; CheckpointError naming the field
    otherwise: quant_method, format float-quantized (top level or the group's), exactly one config group, weights
    num_bits 8 / type float / symmetric / not dynamic, a known strategy with its group_size or block_structure."""
    qc = config.get("quantization_config")
    if not is_compressed_tensors(config):
        raise ck.CheckpointError(f"config.quantization_config: expected quant_method {QUANT_METHOD!r}, got {qc!r}")
    assert isinstance(qc, Mapping)
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        n = len(groups) if isinstance(groups, Mapping) else groups
        raise ck.CheckpointError(f"quantization_config.config_groups: expected exactly one config group, got {n!r}")
    gname, group = next(iter(groups.items()))
    where = f"quantization_config.config_groups.{gname}"
    if not isinstance(group, Mapping):
        raise ck.CheckpointError(f"{where}: expected a dict, got {group!r}")
    fmt = group.get("format") or qc.get("format")
    if fmt != FORMAT:
        raise ck.CheckpointError(f"{where}.format: expected {FORMAT!r} (FP8 codes + weight_scale), got {fmt!r}")
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise ck.CheckpointError(f"{where}.weights: expected a dict of quantization args, got {w!r}")
    want = {"num_bits": 8, "type": "float", "symmetric": True}
    for key, value in want.items():
        if w.get(key, value if key == "symmetric" else None) != value:
            raise ck.CheckpointError(f"{where}.weights.{key}: expected {value!r}, got {w.get(key)!r}")
    if w.get("dynamic") not in (False, None):
        raise ck.CheckpointError(f"{where}.weights.dynamic: expected false (static weight scales in the file), got "
                                 f"{w.get('dynamic')!r}")
    strategy = w.get("strategy")
    if strategy not in STRATEGIES:
        raise ck.CheckpointError(f"{where}.weights.strategy: expected one of {STRATEGIES}, got {strategy!r}")
    scheme = CTWeightScheme(strategy)
    if strategy == "group":
        gs = w.get("group_size")
        if not _positive_int(gs):
            raise ck.CheckpointError(f"{where}.weights.group_size: expected a positive int, got {gs!r}")
        scheme = CTWeightScheme(strategy, group_size=int(gs))  # type: ignore[arg-type]
    elif strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(_positive_int(b) for b in bs)):
            raise ck.CheckpointError(f"{where}.weights.block_structure: expected two positive ints, got {bs!r}")
        scheme = CTWeightScheme(strategy, block=(int(bs[0]), int(bs[1])))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ck.CheckpointError(f"quantization_config.ignore: expected a list of module names, got {ignore!r}")
    return scheme, list(ignore)


def scale_shape(scheme: CTWeightScheme, shape: Sequence[int]) -> tuple[int, ...]:
    """The ``weight_scale`` shape of an (N, K) weight: (1,); (N, 1); (N, ⌈K/G⌉); (⌈N/Bn⌉, ⌈K/Bk⌉)."""
    n, k = int(shape[0]), int(shape[1])
    if scheme.strategy == "tensor":
        return (1,)
    if scheme.strategy == "channel":
        return (n, 1)
    if scheme.strategy == "group":
        assert scheme.group_size is not None
        return (n, math.ceil(k / scheme.group_size))
    assert scheme.block is not None
    return (math.ceil(n / scheme.block[0]), math.ceil(k / scheme.block[1]))


def expand_scale(scale: torch.Tensor, scheme: CTWeightScheme, shape: Sequence[int]) -> torch.Tensor:
    """The scale of each element of an (N, K) weight (fp64): the table of the module docstring."""
    n, k = int(shape[0]), int(shape[1])
    s = scale.to(torch.float64)
    if scheme.strategy == "tensor":
        return s.reshape(1, 1).expand(n, k)
    if scheme.strategy == "channel":
        return s.reshape(n, 1).expand(n, k)
    if scheme.strategy == "group":
        assert scheme.group_size is not None
        return s.repeat_interleave(scheme.group_size, 1)[:, :k]
    assert scheme.block is not None
    return s.repeat_interleave(scheme.block[0], 0)[:n].repeat_interleave(scheme.block[1], 1)[:, :k]


def is_ignored(module: str, ignore: Sequence[str]) -> bool:
    """``module`` is listed in ``ignore``: by name, or by an entry ``re:<pattern>`` matched from its start."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif entry == module:
            return True
    return False


def fp8_weights(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor,
                                                                                                  torch.Tensor]]:
    """Validate a compressed-tensors FP8 checkpoint: ``weight name → (fp8 codes, fp32 scale)``.

    CheckpointError for: the config (:func:`weight_scheme`); a ``*.weight_scale`` without its FP8 weight; an FP8
    weight without ``weight_scale``, of another FP8 dtype than e4m3fn, not 2-D, or whose module ``ignore`` lists;
    a scale that is not fp32/bf16/fp16, not of :func:`scale_shape`, or NaN, ±inf or negative.
    """
    scheme, ignore = weight_scheme(config)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.endswith(".weight" + SCALE_SUFFIX):
            w = tensors.get(name[: -len(SCALE_SUFFIX)])
            if w is None or w.dtype != torch.float8_e4m3fn:
                got = "missing" if w is None else f"{w.dtype}"
                raise ck.CheckpointError(f"{name}: a weight scale whose weight {name[: -len(SCALE_SUFFIX)]!r} is "
                                         f"{got}, expected torch.float8_e4m3fn codes")
            continue
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if t.dtype != torch.float8_e4m3fn:
            raise ck.CheckpointError(f"{name}: dtype {t.dtype}, expected torch.float8_e4m3fn (num_bits 8, type float)")
        if not name.endswith(".weight"):
            raise ck.CheckpointError(f"{name}: an FP8 tensor that is not a module weight (<module>.weight)")
        if is_ignored(module, ignore):
            raise ck.CheckpointError(f"{name}: stored as {t.dtype} but {module!r} is listed in "
                                     "quantization_config.ignore (expected full precision)")
        if t.dim() != 2:
            raise ck.CheckpointError(f"{name}: expected a 2-D FP8 weight, got shape {tuple(t.shape)}")
        sname = name + SCALE_SUFFIX
        s = tensors.get(sname)
        if s is None:
            raise ck.CheckpointError(f"{name}: FP8 weight without its scale {sname!r}")
        want = scale_shape(scheme, tuple(t.shape))
        if tuple(s.shape) != want:
            detail = {"tensor": "(1,)", "channel": "(N, 1)", "group": f"(N, ceil(K / group_size {scheme.group_size}))",
                      "block": f"ceil((N, K) / block_structure {list(scheme.block or ())})"}[scheme.strategy]
            raise ck.CheckpointError(f"{sname}: shape {tuple(s.shape)}, expected {want} = {detail} for the "
                                     f"{scheme.strategy} strategy and weight shape {tuple(t.shape)}")
        if s.dtype not in _SCALE_DTYPES:
            raise ck.CheckpointError(f"{sname}: dtype {s.dtype}, expected float32, bfloat16 or float16")
        sf = s.float()
        bad = ~torch.isfinite(sf) | (sf < 0)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise ck.CheckpointError(f"{sname}: {int(bad.sum())} of {sf.numel()} scales are NaN, inf or negative "
                                     f"(first at {idx}: {float(sf[idx])}); expected finite non-negative dequant "
                                     "scales")
        out[name] = (t, sf)
    return out


def dequantize_exact(codes: torch.Tensor, scale: torch.Tensor, scheme: CTWeightScheme,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes · scale (broadcast per :func:`expand_scale`), exact in fp64, rounded once to ``dtype``."""
    return ck.round_exact(codes.to(torch.float64) * expand_scale(scale, scheme, tuple(codes.shape)), dtype)


def dequantize_checkpoint(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The weights a correct loader holds: every FP8 weight dequantized exactly into ``dtype``, its scale dropped,
    every other tensor as stored."""
    pairs = fp8_weights(config, tensors)
    scheme, _ = weight_scheme(config)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight" + SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in pairs:
            continue
        out[name] = dequantize_exact(t, pairs[name][1], scheme, dtype) if name in pairs else t
    return out


def fp8_weights_any(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[
        torch.Tensor, torch.Tensor]]:
    """Either format: ``weight name → (fp8 codes, fp64 scale of each element)``, validated
    (compressed-tensors: :func:`fp8_weights`; blockwise FP8: :func:`fp8rl.reference.checkpoint.fp8_pairs`)."""
    if is_compressed_tensors(config):
        scheme, _ = weight_scheme(config)
        return {n: (c, expand_scale(s, scheme, tuple(c.shape))) for n, (c, s) in fp8_weights(config, tensors).items()}
    pairs = ck.fp8_pairs(config, tensors)
    block = config["quantization_config"]["weight_block_size"]  # null: per-tensor, the (1, 1) scale broadcast
    return {n: (c, expand_scale(s, CTWeightScheme("block", block=tuple(block or c.shape)),  # type: ignore[arg-type]
                                tuple(c.shape)))
            for n, (c, s) in pairs.items()}


def scale_suffix_any(config: Mapping[str, Any]) -> str:
    """The scale-name suffix of a checkpoint of either format: ``_scale`` (compressed-tensors), else
    :func:`fp8rl.reference.checkpoint.scale_suffix` (``_scale_inv`` blockwise, ``_scale`` per-tensor)."""
    return SCALE_SUFFIX if is_compressed_tensors(config) else ck.scale_suffix(config)


def dequantize_any(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The held weights of a checkpoint of either format (dispatch on ``quant_method``)."""
    if is_compressed_tensors(config):
        return dequantize_checkpoint(config, tensors, dtype)
    return ck.dequantize_checkpoint(config=config, tensors=tensors, dtype=dtype)


def to_blockwise(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any],
                                                                                          dict[str, torch.Tensor]]:
    """A validated block-strategy compressed-tensors checkpoint in the oracle's blockwise form: ``<m>.weight_scale``
    → ``<m>.weight_scale_inv`` as fp32 (exact from bf16/fp16), ``quantization_config`` = the blockwise config of the
    same block, fmt e4m3 and ``ignore`` as ``ignored_layers`` / ``modules_to_not_convert``. Codes unchanged."""
    pairs = fp8_weights(config, tensors)
    scheme, ignore = weight_scheme(config)
    if scheme.strategy != "block":
        raise ck.CheckpointError(f"quantization_config.config_groups: weights strategy {scheme.strategy!r}; only a "
                                 "block-strategy checkpoint has a blockwise-FP8 equivalent")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight" + SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in pairs:
            out[name[: -len(SCALE_SUFFIX)] + "_scale_inv"] = pairs[name[: -len(SCALE_SUFFIX)]][1]
        else:
            out[name] = t
    cfg = dict(config)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(scheme.block or ()), "ignored_layers": list(ignore),
                                  "modules_to_not_convert": list(ignore)}
    return cfg, out


def from_blockwise(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any],
                                                                                            dict[str, torch.Tensor]]:
    """The inverse of :func:`to_blockwise`: a blockwise-FP8 checkpoint (``quant_method: fp8``, ``weight_block_size``
    [Bn, Bk]) in the compressed-tensors block-strategy form — ``<m>.weight_scale_inv`` → ``<m>.weight_scale`` (the
    same fp32 dequant multipliers, so codes · scale is unchanged), ``quantization_config`` =
    :func:`quantization_config` of the block scheme with ``quantization_status: compressed`` and the FP8_BLOCK
    scheme's dynamic 1×128 activation groups, ``ignore`` = the file's ``ignored_layers`` plus ``lm_head`` when the
    file keeps it (a ``Linear`` target would include it). Codes and every other tensor unchanged."""
    qc = config.get("quantization_config") or {}
    block = qc.get("weight_block_size")
    if qc.get("quant_method") != "fp8" or not (isinstance(block, list) and len(block) == 2):
        raise ck.CheckpointError("config.json: quantization_config: expected quant_method 'fp8' with a "
                                 f"weight_block_size [Bn, Bk], got {dict(qc)!r}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        out[name[: -len("_scale_inv")] + SCALE_SUFFIX if name.endswith(".weight_scale_inv") else name] = t
    ignore = sorted(set(qc.get("ignored_layers") or []) | ({"lm_head"} if "lm_head.weight" in tensors else set()))
    cfg = dict(config)
    cfg["quantization_config"] = dict(quantization_config(CTWeightScheme("block", block=(int(block[0]),
                                                                                           int(block[1]))), ignore),
                                      quantization_status="compressed")
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group", "group_size": 128}
    return cfg, out


def quantization_config(scheme: CTWeightScheme, ignore: Sequence[str]) -> dict[str, Any]:
    """The fields of ``quantization_config`` a compressed-tensors FP8 writer's file must carry (a subset: the
    library adds version, status and the activation args): quant_method, format, one config group targeting
    ``Linear`` with the weight args of ``scheme``, and ``ignore``."""
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                               "strategy": scheme.strategy}
    if scheme.strategy == "group":
        weights["group_size"] = scheme.group_size
    if scheme.strategy == "block":
        weights["block_structure"] = list(scheme.block or ())
    return {"quant_method": QUANT_METHOD, "format": FORMAT,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": FORMAT}},
            "ignore": list(ignore)}


#: the activation args of llm-compressor's FP8_DYNAMIC scheme (compressed-tensors ``quantization/quant_scheme.py``):
#: FP8 per token, scale computed at run time
TOKEN_DYNAMIC_ACTIVATIONS: Mapping[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                                "strategy": "token"}


def channel_tensors(state_dict: Mapping[str, torch.Tensor], spec: ck.CheckpointSpec | None = None) -> dict[
        str, torch.Tensor]:
    """The tensors of the oracle's per-channel checkpoint: each weight the blockwise writer would quantize (``spec``'s
    include / exclude / keep filters) cast to BF16 and quantized with one scale per output row,
    s_n = amax(|w[n, :]|) / fmt_max under ``spec.policy`` (its floor and rounding of s), codes = cast(w / s_n),
    stored as ``<m>.weight`` (e4m3fn) and ``<m>.weight_scale`` (N, 1) fp32; every other tensor in BF16."""
    from fp8rl.reference import weight_sync as ws
    from fp8rl.reference.quant import Granularity, quantize

    spec = spec or ck.CheckpointSpec()
    tensors = ws.quantize_state_dict(state_dict, spec.recipe(),
                                     quantize_fn=lambda x, _g: quantize(x, Granularity.channel(), spec.policy))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight" + ws.SCALE_SUFFIX) and name[: -len(ws.SCALE_SUFFIX)] in tensors:
            w = tensors[name[: -len(ws.SCALE_SUFFIX)]]
            out[name[: -len(ws.SCALE_SUFFIX)] + SCALE_SUFFIX] = t.reshape(w.shape[0], 1).float()
        else:
            out[name] = t
    return out


def channel_quantization_config(ignore: Sequence[str]) -> dict[str, Any]:
    """The ``quantization_config`` of :func:`write_channel_checkpoint`: :func:`quantization_config` of the channel
    strategy, ``quantization_status: compressed``, FP8_DYNAMIC's per-token dynamic input activations."""
    cfg = dict(quantization_config(CTWeightScheme("channel"), ignore), quantization_status="compressed")
    cfg["config_groups"]["group_0"]["input_activations"] = dict(TOKEN_DYNAMIC_ACTIVATIONS)
    return cfg


def write_channel_checkpoint(out_dir: Any, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                             spec: ck.CheckpointSpec | None = None) -> Any:
    """The oracle's per-channel compressed-tensors checkpoint (:func:`channel_tensors`) of ``state_dict`` in
    ``out_dir``; ``ignore`` = the 2-D linears kept in BF16 (:func:`fp8rl.reference.checkpoint.ignored_modules`)
    plus ``lm_head`` when stored (a ``Linear`` target would include it). Returns the directory."""
    spec = spec or ck.CheckpointSpec()
    ignore = sorted(set(ck.ignored_modules(state_dict, spec)) | ({"lm_head"} if "lm_head.weight" in state_dict
                                                                 else set()))
    return ck.write_tensors(out_dir, config, channel_tensors(state_dict, spec), channel_quantization_config(ignore))
