"""The FP8 checkpoint path: the oracle's writer and reader of blockwise-FP8 HF checkpoints (docs/checkpoint.md).

A blockwise-FP8 checkpoint is a directory with ``config.json`` and ``*.safetensors``. Every quantized linear weight
``<module>.weight`` of shape (N, K) is stored as FP8 codes (``torch.float8_e4m3fn``) next to
``<module>.weight_scale_inv``, fp32 of shape (⌈N/Bn⌉, ⌈K/Bk⌉): the **dequant** multiplier of each Bn×Bk tile
(W ≈ fp8 · scale; the DeepSeek-V3 convention that vLLM's ``Fp8Config`` (vllm-project/vllm
``vllm/model_executor/layers/quantization/fp8.py``) and transformers' ``FineGrainedFP8Config``
(huggingface/transformers ``src/transformers/utils/quantization_config.py``) read). ``config.json`` carries::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [Bn, Bk],
                            "ignored_layers": [...], "modules_to_not_convert": [...]}

A **per-tensor** FP8 checkpoint (``weight_block_size: null``) stores one scale per weight instead:
``<module>.weight_scale``, a 0-d fp32 dequant multiplier (W ≈ fp8 · s), the name vLLM's ``Fp8LinearMethod``
registers for per-tensor checkpoints (``PerTensorScaleParameter``, one per shard of a fused QKV / gate_up layer) and
llm-compressor / AutoFP8 write. ``null`` is written explicitly: vLLM's ``Fp8Config`` reads an absent
``weight_block_size`` as per-tensor, transformers' ``FineGrainedFP8Config`` as its default [128, 128].

``ignored_layers`` is the key vLLM reads, ``modules_to_not_convert`` the one transformers reads; the writer writes
both with the same list: the module names (without ``.weight``) of the 2-D linear weights kept in BF16 that a loader
building FP8 layers from the config would otherwise quantize (MoE routers, shared-expert gates, and any module the
spec keeps).

The writer quantizes with :func:`fp8rl.reference.weight_sync.quantize_state_dict` (fp32 masters are cast to BF16
first). The reader validates the file against its own config and dequantizes each weight **exactly**: codes · scale
in fp64 (≤ 4 + 24 significant bits, exact), rounded **once** to the target dtype (bf16 through round-to-odd at fp32,
so no double rounding). A malformed checkpoint raises :class:`CheckpointError` naming the tensor and the expectation.

Pure: torch, numpy, safetensors and fp8rl.reference only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fp8rl.reference import formats
from fp8rl.reference import weight_sync as ws
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy

__all__ = ["ATTENTION_SCALES", "PER_TENSOR_SCALE_SUFFIX", "CheckpointError", "CheckpointSpec", "attention_scale_name",
           "attention_scales_in_file", "dequantize_checkpoint", "dequantize_exact", "per_tensor_state_dict", "scale_suffix", "expected_attention_scales",
           "fp8_pairs", "quantization_config", "write_attention_scales", "read_checkpoint", "round_exact", "write_checkpoint", "write_tensors"]

#: the checkpoint's ``fmt`` string of each FP8 element format
CONFIG_FMT = {"e4m3fn": "e4m3", "e5m2": "e5m2"}
_FMT_OF_DTYPE = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2"}
_ROUTERS = r"(^|\.)mlp\.(gate|shared_expert_gate)\.weight$"
#: a per-tensor checkpoint's scale name suffix: ``<m>.weight`` → ``<m>.weight_scale`` (a blockwise one's is
#: :data:`fp8rl.reference.weight_sync.SCALE_SUFFIX`, ``<m>.weight_scale_inv``)
PER_TENSOR_SCALE_SUFFIX = "_scale"


class CheckpointError(ValueError):
    """A checkpoint that contradicts itself or its config (the message names the tensor and the expectation)."""


@dataclass(frozen=True)
class CheckpointSpec:
    """What the oracle writer writes.

    ``block``: (Bn, Bk) weight tile, or None for one scale per weight (a per-tensor checkpoint); ``policy``: the ScalePolicy of the block quantizer (its ``fmt`` is the element
    format); ``keep``: module names (``model.layers.0.self_attn.o_proj``) additionally kept in BF16 and listed as
    ignored; ``activation_scheme``: ``dynamic`` (the only one blockwise FP8 supports).
    """

    block: tuple[int, int] | None = (128, 128)
    policy: ScalePolicy | str = "reference"
    keep: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"
    include: tuple[str, ...] = ws.DEFAULT_INCLUDE
    exclude: tuple[str, ...] = ws.DEFAULT_EXCLUDE
    extra_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", get_policy(self.policy))
        if self.block is not None and (len(self.block) != 2
                                       or not all(isinstance(b, int) and b > 0 for b in self.block)):
            raise ValueError(f"block: expected two positive ints or None (per-tensor), got {self.block!r}")
        if get_policy(self.policy).fmt not in CONFIG_FMT:
            raise ValueError(f"policy: expected an e4m3fn or e5m2 policy, got {get_policy(self.policy).fmt!r}")
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"activation_scheme: expected 'dynamic' or 'static', got {self.activation_scheme!r}")

    def with_(self, **changes: Any) -> CheckpointSpec:
        return replace(self, **changes)

    def recipe(self) -> ws.WeightSyncRecipe:
        keep = tuple(rf"(^|\.){re.escape(m)}\.weight$" for m in self.keep)
        return ws.WeightSyncRecipe(block=tuple(self.block or (128, 128)), policy=self.policy, include=self.include,  # type: ignore[arg-type]
                                   exclude=self.exclude + keep)


def ignored_modules(state_dict: Mapping[str, torch.Tensor], spec: CheckpointSpec) -> list[str]:
    """Module names of the 2-D linear weights kept in BF16 that a config-driven loader would otherwise quantize:
    the routers / shared-expert gates and ``spec.keep``."""
    r = spec.recipe()
    out = []
    for name, t in state_dict.items():
        if t.dim() != 2 or not name.endswith(".weight") or ws.is_quantized_name(name, tuple(t.shape), r):
            continue
        module = name[: -len(".weight")]
        if re.search(_ROUTERS, name) or module in spec.keep:
            out.append(module)
    return out


def quantization_config(spec: CheckpointSpec, ignored: Sequence[str] = ()) -> dict[str, Any]:
    """The ``quantization_config`` the writer puts into config.json (see the module docstring)."""
    cfg: dict[str, Any] = {"quant_method": "fp8", "fmt": CONFIG_FMT[get_policy(spec.policy).fmt],
                           "activation_scheme": spec.activation_scheme,
                           "weight_block_size": None if spec.block is None else list(spec.block),
                           "ignored_layers": list(ignored), "modules_to_not_convert": list(ignored)}
    cfg.update(spec.extra_config)
    return cfg


def write_tensors(out_dir: str | Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                  qconfig: Mapping[str, Any]) -> Path:
    """Write ``tensors`` as ``model.safetensors`` and ``config`` (with ``quantization_config = qconfig`` and
    ``torch_dtype: bfloat16``) as ``config.json`` into ``out_dir``. Returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    cfg["quantization_config"] = dict(qconfig)
    cfg["torch_dtype"] = "bfloat16"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def write_checkpoint(out_dir: str | Path, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                     spec: CheckpointSpec | None = None) -> Path:
    """The oracle writer: quantize ``state_dict`` (BF16 weights or fp32 masters, HF checkpoint names) under
    ``spec`` and write the checkpoint directory. Returns it."""
    spec = spec or CheckpointSpec()
    if not isinstance(spec, CheckpointSpec):
        raise TypeError(f"spec: expected a CheckpointSpec or None, got {type(spec).__name__}")
    if spec.block is None:
        tensors = per_tensor_state_dict(state_dict, spec)
    else:
        tensors = ws.quantize_state_dict(state_dict, spec.recipe())
    return write_tensors(out_dir, config, tensors, quantization_config(spec, ignored_modules(state_dict, spec)))


def per_tensor_state_dict(state_dict: Mapping[str, torch.Tensor], spec: CheckpointSpec) -> dict[str, torch.Tensor]:
    """The tensors of a per-tensor checkpoint: each eligible weight (the recipe's filters) cast to BF16 and quantized
    with one scale s = amax / fmt_max (the spec's policy: its floor, its rounding of s) to codes = cast(w / s),
    stored as ``<m>.weight`` (FP8) and ``<m>.weight_scale`` (0-d fp32 s); every other tensor in BF16."""
    from fp8rl.reference.quant import Granularity, quantize

    tensors = ws.quantize_state_dict(state_dict, spec.recipe(),
                                     quantize_fn=lambda x, _g: quantize(x, Granularity.tensor(), spec.policy))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight" + ws.SCALE_SUFFIX) and name[: -len(ws.SCALE_SUFFIX)] in tensors:
            out[name[: -len(ws.SCALE_SUFFIX)] + PER_TENSOR_SCALE_SUFFIX] = t.reshape(())
        else:
            out[name] = t
    return out


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors as stored) of a checkpoint directory (every ``*.safetensors`` file)."""
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").is_file():
        raise CheckpointError(f"path: {p} has no config.json")
    config = json.loads((p / "config.json").read_text())
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"path: {p} has no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return config, tensors


def _block(qc: Mapping[str, Any]) -> tuple[int, int] | None:
    """(Bn, Bk) of a blockwise checkpoint, None of a per-tensor one (``weight_block_size: null``)."""
    if "weight_block_size" not in qc:
        raise CheckpointError("quantization_config.weight_block_size: missing; expected [Bn, Bk] (blockwise) or null "
                              "(per-tensor: vLLM reads an absent key as per-tensor, transformers as [128, 128])")
    wbs = qc["weight_block_size"]
    if wbs is None:
        return None
    if not (isinstance(wbs, (list, tuple)) and len(wbs) == 2 and all(isinstance(b, int) and b > 0 for b in wbs)):
        raise CheckpointError(f"quantization_config.weight_block_size: expected two positive ints, got {wbs!r}")
    return int(wbs[0]), int(wbs[1])


def fp8_pairs(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor,
                                                                                                   torch.Tensor]]:
    """Validate an FP8 checkpoint (blockwise, or per-tensor with ``weight_block_size: null``) and return ``weight
    name → (fp8 codes tensor, fp32 scale)``: the scale grid (⌈N/Bn⌉, ⌈K/Bk⌉) of a blockwise file, (1, 1) of a
    per-tensor one.

    Raises :class:`CheckpointError` for: a config that is not ``quant_method: fp8`` with a ``weight_block_size``
    key; an FP8 weight without ``*_scale_inv`` (``*_scale`` for per-tensor: missing scale) or a scale without its
    weight; a scale whose shape is not (⌈N/Bn⌉, ⌈K/Bk⌉) (wrong shape, or a ``weight_block_size`` that contradicts
    the shapes), or not a single value in a per-tensor file; a scale that is NaN,
    ±inf, negative or not fp32/bf16; an FP8 dtype other than the config's ``fmt``; a module listed in
    ``ignored_layers`` / ``modules_to_not_convert`` stored in FP8.
    """
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "fp8":
        raise CheckpointError("config.quantization_config: expected a dict with quant_method 'fp8', got "
                              f"{qc!r}")
    block = _block(qc)
    suffix = _scale_suffix_of(block)
    fmt = qc.get("fmt", "e4m3")
    want_fmt = {v: k for k, v in CONFIG_FMT.items()}.get(fmt)
    if want_fmt is None:
        raise CheckpointError(f"quantization_config.fmt: expected 'e4m3' or 'e5m2', got {fmt!r}")
    ignored = set(qc.get("ignored_layers") or ()) | set(qc.get("modules_to_not_convert") or ())
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.endswith(".weight" + suffix):
            if name[: -len(suffix)] not in tensors:
                raise CheckpointError(f"{name}: a scale without its weight {name[: -len(suffix)]!r}")
            continue
        if t.dtype not in _FMT_OF_DTYPE and t.dtype not in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if module in ignored:
            raise CheckpointError(f"{name}: stored as {t.dtype} but {module!r} is listed in "
                                  "ignored_layers/modules_to_not_convert (expected BF16)")
        if _FMT_OF_DTYPE.get(t.dtype) != want_fmt:
            raise CheckpointError(f"{name}: dtype {t.dtype}, but quantization_config.fmt is {fmt!r} "
                                  f"(expected {ws.FP8_TORCH_DTYPES[want_fmt]})")
        sname = name + suffix
        if sname not in tensors:
            raise CheckpointError(f"{name}: FP8 weight without its scale {sname!r}"
                                  + (" (weight_block_size is null: a per-tensor file)" if block is None else ""))
        s = tensors[sname]
        if t.dim() != 2:
            raise CheckpointError(f"{name}: expected a 2-D FP8 weight, got shape {tuple(t.shape)}")
        if block is None:
            if s.numel() != 1:
                raise CheckpointError(f"{sname}: shape {tuple(s.shape)}, expected a single per-tensor scale "
                                      "(weight_block_size is null)")
            s = s.reshape(1, 1)
            want_shape = (1, 1)
        else:
            want_shape = (math.ceil(t.shape[0] / block[0]), math.ceil(t.shape[1] / block[1]))
        if tuple(s.shape) != want_shape:
            raise CheckpointError(f"{sname}: shape {tuple(s.shape)}, expected {want_shape} = ceil({tuple(t.shape)} "
                                  f"/ weight_block_size {list(block or ())})")
        if s.dtype not in (torch.float32, torch.bfloat16):
            raise CheckpointError(f"{sname}: dtype {s.dtype}, expected torch.float32")
        sf = s.float()
        bad = ~torch.isfinite(sf) | (sf < 0)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise CheckpointError(f"{sname}: {int(bad.sum())} of {sf.numel()} scales are NaN, inf or negative "
                                  f"(first at {idx}: {float(sf[idx])}); expected finite non-negative dequant scales")
        out[name] = (t, sf)
    return out


def round_exact(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 values → ``dtype`` rounded once to nearest even (torch's fp64 → bf16 cast goes through fp32 and can
    round twice; here bf16 goes through round-to-odd at fp32, which makes the second rounding exact)."""
    if dtype in (torch.float64, torch.float32):
        return v.to(dtype)
    if dtype != torch.bfloat16:
        raise ValueError(f"dtype: expected torch.bfloat16, torch.float32 or torch.float64, got {dtype}")
    a = v.detach().cpu().contiguous().numpy().astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = a.astype(np.float32)
        back = f.astype(np.float64)
    fb = f.view(np.uint32).copy()
    finite = np.isfinite(a)
    inexact = finite & (back != a)
    over = inexact & (np.abs(back) > np.abs(a))
    fb = np.where(over, fb - np.uint32(1), fb)
    fb = np.where(inexact, fb | np.uint32(1), fb).astype(np.uint32)
    bits = formats.bf16_bits_rne(fb.view(np.float32)).astype(np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16).reshape(v.shape)


def dequantize_exact(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes (an FP8 tensor) · scale broadcast over ``block`` tiles, exact in fp64, rounded once to ``dtype``."""
    n, k = codes.shape
    vals = codes.to(torch.float64)
    s = scale.to(torch.float64).repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return round_exact(vals * s, dtype)


def dequantize_checkpoint(path: str | Path | None = None, *, config: Mapping[str, Any] | None = None,
                          tensors: Mapping[str, torch.Tensor] | None = None,
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The weights a correct loader holds: every FP8 weight dequantized exactly (:func:`dequantize_exact`) into
    ``dtype``, scales dropped, every other tensor as stored. Give ``path`` or both ``config`` and ``tensors``."""
    if path is not None:
        config, tensors = read_checkpoint(path)
    if config is None or tensors is None:
        raise ValueError("dequantize_checkpoint: expected path, or config and tensors")
    pairs = fp8_pairs(config, tensors)
    block = _block(config["quantization_config"])
    suffix = _scale_suffix_of(block)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(suffix) and name[: -len(suffix)] in pairs:
            continue
        out[name] = dequantize_exact(t, pairs[name][1], block or (t.shape[0], t.shape[1]), dtype) if name in pairs else t
    return out


def _scale_suffix_of(block: tuple[int, int] | None) -> str:
    return ws.SCALE_SUFFIX if block is not None else PER_TENSOR_SCALE_SUFFIX


def scale_suffix(config: Mapping[str, Any]) -> str:
    """The scale-name suffix of an FP8 checkpoint's config: ``_scale_inv`` (blockwise) or ``_scale`` (per-tensor)."""
    return _scale_suffix_of(_block(config["quantization_config"]))


# ----------------------------------------------------------------------------------------------------------------
# attention (KV cache and query) scales stored in a checkpoint

#: the attention scales a checkpoint may store per layer, as ``model.layers.<i>.self_attn.<x>_scale`` (fp32 scalars,
#: the dequant multiplier of the FP8 key / value cache and of the FP8 query: the names llm-compressor writes and
#: vLLM's ``maybe_remap_kv_scale_name`` maps to ``self_attn.attn.<x>_scale``, vllm-project/vllm
#: ``vllm/model_executor/model_loader/weight_utils.py``)
ATTENTION_SCALES = ("q", "k", "v")


def attention_scale_name(layer: int, which: str) -> str:
    """The checkpoint name of layer ``layer``'s ``which`` (q, k or v) attention scale."""
    if which not in ATTENTION_SCALES:
        raise ValueError(f"which: expected one of {ATTENTION_SCALES}, got {which!r}")
    return f"model.layers.{int(layer)}.self_attn.{which}_scale"


def attention_scales_in_file(tensors: Mapping[str, torch.Tensor], num_layers: int) -> dict[int, dict[str, float]]:
    """Layer → the attention scales the file stores (absent ones left out), validated: each must be a single fp32 /
    bf16 value, finite and > 0 (:class:`CheckpointError` naming the tensor otherwise)."""
    out: dict[int, dict[str, float]] = {}
    for i in range(int(num_layers)):
        row: dict[str, float] = {}
        for x in ATTENTION_SCALES:
            name = attention_scale_name(i, x)
            t = tensors.get(name)
            if t is None:
                continue
            if t.numel() != 1 or t.dtype not in (torch.float32, torch.bfloat16):
                raise CheckpointError(f"{name}: {t.dtype} of shape {tuple(t.shape)}, expected one fp32 value "
                                      "(a per-tensor attention scale)")
            v = float(t.float().reshape(()))
            if not math.isfinite(v) or v <= 0:
                raise CheckpointError(f"{name}: {v!r}, expected a finite attention scale > 0")
            row[x] = v
        out[i] = row
    return out


def expected_attention_scales(stored: Mapping[int, Mapping[str, float]]) -> dict[int, dict[str, float]]:
    """The q/k/v scales a loader running an FP8 KV cache must use, per layer: the file's, and where absent the
    documented defaults of vLLM's ``BaseKVCacheMethod.process_weights_after_loading`` (vllm-project/vllm
    ``vllm/model_executor/layers/quantization/kv_cache.py``, 0.32.0, its comments and warnings): k and v both absent
    → 1.0 each; one of them present → that value for both ("duplicate k_scale to v_scale"); q absent → the k scale
    ("Checkpoint does not provide a q scaling factor. Setting it to k_scale")."""
    out: dict[int, dict[str, float]] = {}
    for i, row in stored.items():
        k, v = row.get("k"), row.get("v")
        if k is None and v is None:
            k = v = 1.0
        elif k is None or v is None:
            k = v = float(k if k is not None else v)  # type: ignore[arg-type]
        out[int(i)] = {"q": float(row.get("q", k)), "k": float(k), "v": float(v)}
    return out


def write_attention_scales(path: str | Path, scales: Mapping[int, Mapping[str, float]]) -> Path:
    """Add per-layer attention scales (layer → {q|k|v: value}; absent keys are not written) to the checkpoint at
    ``path`` as fp32 scalars under :func:`attention_scale_name`. Returns the directory."""
    from safetensors.torch import save_file

    p = Path(path)
    _, tensors = read_checkpoint(p)
    tensors = dict(tensors)
    for i, row in scales.items():
        for x, v in row.items():
            tensors[attention_scale_name(i, x)] = torch.tensor(float(v), dtype=torch.float32)
    for f in p.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(p / "model.safetensors"), metadata={"format": "pt"})
    return p
