"""Scaled FP8 quantization as small, explicit steps: amax → scale → cast.

A quantized tensor is ``codes`` (uint8, the FP8 bit patterns) plus ``scale``, the fp32 **dequant** multiplier:
x ≈ decode(code) · scale. The scale is computed per tensor, token (row), output channel, 1×G group or Bm×Bn block
(:class:`Granularity`) from the group's amax by a :class:`~fp8rl.reference.policy.ScalePolicy`
(:mod:`fp8rl.reference.policy`), which names every numerical choice engines make differently (docs/engine-numerics.md §2–§7): the
maximum the group is mapped to, where a floor (eps) applies, power-of-two rounding of the scale, how the scale and the
quantized value are computed in fp32 (division, multiplication by a reciprocal, or by a separately computed
multiplier), the clamp before the cast, what a zero amax gives, and the cast's overflow policy.
:data:`~fp8rl.reference.presets.PRESETS` (:mod:`fp8rl.reference.presets`) holds the policies of the engines we test,
each citing its source. ``ScalePolicy``, ``PRESETS`` and ``get_policy`` are re-exported here.

All scale arithmetic is fp32 with IEEE round-to-nearest (torch CPU fp32 ops: division, multiplication and the
reciprocal are correctly rounded), exactly like the engines' kernels — unless the policy says
``compute_dtype="input"``, where every step is rounded to a bf16/fp16 input's own dtype (R below; the identity for
fp32), or ``"scale_input"``, where only the scale steps are (the quotient q stays fl32); the FP8 cast is the bit-level encoder of :mod:`fp8rl.reference.formats` (round-to-nearest-even), never
torch's fp8 cast.

Pipeline (``T`` = target max, ``fl`` = fp32 rounding, ``R`` = fl then the compute-dtype rounding):

1. ``amax = max |x|`` over the group (:func:`compute_amax`; NaN in a group gives a NaN amax).
2. ``amax' = R(max(amax, eps))`` if ``floor == "amax"``.
3. degenerate amax' with a ``zero_amax`` "one*" mode (0, and ±inf and/or NaN by the mode) → scale 1 and
   multiplier 1.
4. raw scale by ``scale_op``: ``R(amax'/T)`` ("div"), ``R(amax'·R(1/T))`` ("mul_recip_max") or ``fl(1/m)`` with
   the multiplier ``m = R(T/amax')`` or ``R(R(1/amax')·T)`` (``multiplier_op``) whose overflow is replaced per
   ``multiplier_overflow`` ("recip_multiplier").
5. ``s = R(max(s, eps))`` if ``floor == "scale"`` (before power-of-two rounding, so pow2 policies give powers of
   two, unless ``floor_order="pow2_then_floor"`` puts it after step 6).
6. power-of-two rounding by ``pow2`` (see :func:`round_scale_pow2`); then, with ``zero_amax="scale_dtype_eps"``,
   ``s = finfo(D).eps`` where ``s == 0`` (D: the dtype of the scale arithmetic; :func:`zero_scale_to_dtype_eps`).
7. codes: ``q = R(x/s)``, ``R(x·R(1/s))`` or ``R(x·m)`` (``quant_op``), ``clamp(q, -T, T)`` if ``clamp``, then the
   RNE cast with the ``overflow`` policy.

The definition and the fast path: :func:`fp8rl.reference.quant_plain.quantize_plain` is the oracle's definition of
this pipeline — :func:`~fp8rl.reference.quant_plain.compute_amax_plain` → :func:`scale_from_amax` →
:func:`~fp8rl.reference.quant_plain.quantize_with_scale_plain`, whole-tensor torch steps, one per formula.
:func:`quantize` (and :func:`compute_amax`, :func:`quantize_with_scale`) is an optimisation of it — fp32 quotients
strip by strip in numpy on several threads, the table encoder — that must equal it bit for bit, codes and scales
(tests/oracle/test_quant_fast_path.py: every class of the quantize input space × granularity × preset, and
hypothesis-drawn edge values); the oracle's speed matters (``python -m fp8rl.perf.suite_speed``).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from fp8rl.reference.formats import bf16_bits_rne, decode, encode_codes, encode_codes_into, get_format
from fp8rl.reference.policy import (
    FLOOR_MODES,
    POW2_MODES,
    QUANT_OPS,
    SCALE_OPS,
    ZERO_AMAX_MODES,
    OverflowPolicy,
    ScalePolicy,
    check_choice,
)
from fp8rl.reference.presets import PRESETS, get_policy

# ScalePolicy, its mode tuples, PRESETS and get_policy live in fp8rl.reference.policy and fp8rl.reference.presets;
# they are re-exported here for engines that import them from fp8rl.reference.quant.
__all__ = [
    "ACCEPTED_INPUT_DTYPES", "FLOOR_MODES", "GRANULARITY_KINDS", "Granularity", "GranularityKind", "OverflowPolicy", "POW2_MODES",
    "PRESETS", "QUANT_OPS", "QuantizedTensor", "SCALE_OPS", "ScalePolicy", "ZERO_AMAX_MODES", "compute_amax",
    "dequantize", "expand_scale", "get_policy", "quant_multiplier_from_amax", "quantize", "quantize_with_scale",
    "round_scale_pow2", "scale_from_amax", "zero_scale_to_dtype_eps",
]

GranularityKind = Literal["tensor", "token", "channel", "group", "block"]
GRANULARITY_KINDS: tuple[str, ...] = ("tensor", "token", "channel", "group", "block")
#: input dtypes quantize() accepts; all are upcast to fp32 exactly
ACCEPTED_INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

_F32 = torch.float32
_FLT_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------------------------------------
# Granularity


def _positive_int(v) -> bool:
    return bool(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0)


@dataclass(frozen=True)
class Granularity:
    """Which elements share one scale.

    ============  ======================  ============================================================
    kind          input                   scale shape
    ============  ======================  ============================================================
    ``tensor``    any shape               ``(1,)``
    ``token``     x (..., K)              ``(..., 1)``: one scale per row (per token)
    ``channel``   w (N, K), 2-D only      ``(N, 1)``: one per output channel = row of the weight; the
                                          same math as ``token``, named for weights
    ``group``     x (..., K)              ``(..., ceil(K/G))``: 1×G groups along the last dim
    ``block``     w (M, N), 2-D only      ``(ceil(M/Bm), ceil(N/Bn))``: Bm×Bn tiles
    ============  ======================  ============================================================

    Non-divisible shapes: the edge group/block holds only the real elements (its amax is over those; equivalent to
    zero padding, what vLLM, verl and TE do). NeMo-RL pads with the tensor's last element instead, which can change
    an edge block's amax; that is not modelled.
    """

    kind: GranularityKind
    size: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        check_choice("granularity", self.kind, GRANULARITY_KINDS)
        size = self.size
        if not isinstance(size, tuple) or len(size) != 2:
            raise ValueError(f"granularity: size must be a 2-tuple of positive integers, got {size!r}")
        for v in size:
            if not _positive_int(v):
                raise ValueError(f"granularity: {self.kind} size {v!r} must be a positive integer")
        if self.kind == "group" and size[0] != 1:
            raise ValueError(f"granularity: a group is 1×G, got size {size}")
        object.__setattr__(self, "size", (int(size[0]), int(size[1])))

    @classmethod
    def tensor(cls) -> Granularity:
        return cls("tensor")

    @classmethod
    def token(cls) -> Granularity:
        return cls("token")

    @classmethod
    def channel(cls) -> Granularity:
        return cls("channel")

    @classmethod
    def group(cls, G: int = 128) -> Granularity:
        if not _positive_int(G):
            raise ValueError(f"granularity: group size {G!r} must be a positive integer")
        return cls("group", (1, int(G)))

    @classmethod
    def block(cls, B: int | tuple[int, int] = 128) -> Granularity:
        size = (B, B) if not isinstance(B, (tuple, list)) else tuple(B)
        if len(size) != 2 or not all(_positive_int(v) for v in size):
            raise ValueError(f"granularity: block size {B!r} must be a positive integer or a pair of them")
        return cls("block", (int(size[0]), int(size[1])))

    @property
    def label(self) -> str:
        """Short name: tensor, token, channel, group128, block128x128."""
        if self.kind == "group":
            return f"group{self.size[1]}"
        if self.kind == "block":
            return f"block{self.size[0]}x{self.size[1]}"
        return self.kind

    def check_shape(self, shape: tuple[int, ...], name: str = "x") -> tuple[int, ...]:
        """Validate an element shape for this granularity (ValueError naming ``name``)."""
        shape = tuple(int(s) for s in shape)
        if len(shape) == 0:
            raise ValueError(f"{name}: expected at least a 1-D tensor for {self.kind} granularity, got a 0-d tensor")
        if any(s == 0 for s in shape):
            raise ValueError(f"{name}: expected a non-empty tensor, got shape {shape}")
        if self.kind in ("channel", "block") and len(shape) != 2:
            what = "weight (N, K)" if self.kind == "channel" else "tensor"
            raise ValueError(f"{name}: expected a 2-D {what} for {self.kind} granularity, got shape {shape}")
        return shape

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the scale tensor for an element tensor of ``shape``."""
        shape = self.check_shape(shape)
        if self.kind == "tensor":
            return (1,)
        if self.kind in ("token", "channel"):
            return (*shape[:-1], 1)
        if self.kind == "group":
            return (*shape[:-1], -(-shape[-1] // self.size[1]))
        bm, bn = self.size
        return (-(-shape[0] // bm), -(-shape[1] // bn))


# ---------------------------------------------------------------------------------------------------------------
# Quantized tensor


@dataclass(frozen=True)
class QuantizedTensor:
    """FP8 codes plus their fp32 dequant scale: x ≈ decode(code) · scale (broadcast by the granularity)."""

    codes: torch.Tensor
    scale: torch.Tensor
    granularity: Granularity
    policy: ScalePolicy

    def __post_init__(self) -> None:
        if not isinstance(self.codes, torch.Tensor) or self.codes.dtype != torch.uint8:
            got = self.codes.dtype if isinstance(self.codes, torch.Tensor) else type(self.codes).__name__
            raise TypeError(f"codes: expected a torch.uint8 tensor, got {got}")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != _F32:
            got = self.scale.dtype if isinstance(self.scale, torch.Tensor) else type(self.scale).__name__
            raise TypeError(f"scale: expected a torch.float32 tensor, got {got}")
        if not isinstance(self.granularity, Granularity):
            raise TypeError(f"granularity: expected a Granularity, got {type(self.granularity).__name__}")
        if not isinstance(self.policy, ScalePolicy):
            raise TypeError(f"policy: expected a ScalePolicy, got {type(self.policy).__name__}")
        shape = self.granularity.check_shape(tuple(self.codes.shape), "codes")
        want = self.granularity.scale_shape(shape)
        if tuple(self.scale.shape) != want:
            raise ValueError(f"scale: expected shape {want} for {self.granularity.label} codes of shape {shape}, "
                             f"got {tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def fmt(self) -> str:
        return self.policy.fmt

    def values(self) -> torch.Tensor:
        """Decoded codes as fp32, unscaled (every FP8 value is exact in fp32)."""
        return decode(self.codes.cpu(), self.fmt).reshape(self.shape)

    def expanded_scale(self) -> torch.Tensor:
        """The scale broadcast to the element shape (fp32)."""
        return expand_scale(self.scale, self.granularity, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values · scale: computed exactly in fp64 (≤ 4 + 24 significant bits) then rounded once to ``dtype``."""
        return dequantize(self, dtype)


# ---------------------------------------------------------------------------------------------------------------
# Steps


def _as_input(x, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACCEPTED_INPUT_DTYPES:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    return x.detach().to("cpu", _F32)


def compute_amax(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """amax = max |x| over each group of ``g`` (fp32, shape ``g.scale_shape(x.shape)``).

    Edge groups/blocks of non-divisible shapes use only their real elements. A NaN anywhere in a group makes its
    amax NaN (torch's max propagates NaN). CUDA kernels reducing with ``fmaxf`` drop NaNs instead, so engines may
    differ on NaN inputs; every such difference is reported, not hidden.

    Fast path (strips of rows in numpy, on threads) of :func:`fp8rl.reference.quant_plain.compute_amax_plain`, the
    definition: equal to it bit for bit.
    """
    x = _as_input(x)
    shape = g.check_shape(tuple(x.shape))
    # one strip of rows at a time (max is exact, so this equals one reduction over the whole group)
    return torch.from_numpy(_amax_by_strips(_rows_view(x, g), g)).reshape(g.scale_shape(shape))


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=_F32)


def _compute_dtype(policy: ScalePolicy, input_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype every scale/quotient step is rounded to (None: fp32, no extra rounding)."""
    if policy.compute_dtype == "fp32" or input_dtype is None or input_dtype == _F32:
        return None
    if input_dtype not in ACCEPTED_INPUT_DTYPES:
        raise TypeError(f"input_dtype: expected float32, bfloat16 or float16, got {input_dtype}")
    return input_dtype


def _quotient_dtype(policy: ScalePolicy, input_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype the quotient q is rounded to: the compute dtype, except under ``compute_dtype="scale_input"``
    (scale in the input dtype, q = fl32(x/s)): None."""
    return None if policy.compute_dtype == "scale_input" else _compute_dtype(policy, input_dtype)


def _round(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """R(t): the fp32 tensor ``t`` rounded to nearest even in ``dtype`` (bf16 by the oracle's bit-level rounding,
    fp16 by numpy's IEEE conversion), returned as fp32; the identity for None."""
    if dtype is None:
        return t
    t = t.to(_F32).contiguous()
    if dtype == torch.bfloat16:
        bits = bf16_bits_rne(t.numpy()).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32).reshape(tuple(t.shape)).copy())
    return torch.from_numpy(t.numpy().astype(np.float16).astype(np.float32).reshape(tuple(t.shape)))


def _floored_amax(amax: torch.Tensor, policy: ScalePolicy, rd: torch.dtype | None = None) -> torch.Tensor:
    amax = amax.to(_F32)
    if policy.floor == "amax":
        return _round(torch.maximum(amax, _f32(policy.eps)), rd)  # propagates NaN
    return amax


def _degenerate(amax_f: torch.Tensor, mode: str = "one") -> torch.Tensor:
    """amax' that ``zero_amax`` maps to scale 1 and multiplier 1: zero, and ±inf and/or NaN by the mode."""
    if mode == "one_zero_inf":
        return (amax_f == 0) | torch.isinf(amax_f)
    if mode == "one_zero_nan":
        return (amax_f == 0) | torch.isnan(amax_f)
    return (amax_f == 0) | ~torch.isfinite(amax_f)


def _multiplier_raw(amax_f: torch.Tensor, t: float, policy: ScalePolicy | None = None,
                    input_dtype: torch.dtype | None = None) -> torch.Tensor:
    """m = R(T / amax') (``multiplier_op="div"``) or R(R(1/amax')·T) (``"recip_mul"``); a multiplier that overflows
    (amax' > 0 tiny) is replaced by ``multiplier_overflow``: FLT_MAX, the input dtype's max finite, or kept (inf)."""
    rd = _compute_dtype(policy, input_dtype) if policy is not None else None
    if policy is not None and policy.multiplier_op == "recip_mul":
        m = _round(_round(_f32(1.0) / amax_f, rd) * _f32(t), rd)
    else:
        m = _round(_f32(t) / amax_f, rd)
    mode = policy.multiplier_overflow if policy is not None else "flt_max"
    if mode == "inf":
        return m
    sub = _FLT_MAX
    if mode == "input_max" and input_dtype is not None:
        sub = float(torch.finfo(input_dtype).max)
    return torch.where(torch.isinf(m) & (amax_f > 0), _f32(sub), m)


def _pow2_floor(m: torch.Tensor) -> torch.Tensor:
    """Zero the mantissa bits of fp32 m: the largest power of two ≤ m (TE ``scale_bits &= 0xFF800000``)."""
    bits = m.contiguous().view(torch.int32) & torch.tensor(0xFF800000 - (1 << 32), dtype=torch.int32)
    return bits.view(_F32)


def _exact_pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as fp32 built from the bits (k int64): normal, subnormal (k ≥ -149), 0 below, inf above 127."""
    normal = ((k.clamp(-126, 127) + 127) << 23).to(torch.int32).view(_F32)
    sub = (torch.ones_like(k) << (k.clamp(-149, -127) + 149)).to(torch.int32).view(_F32)
    out = torch.where(k >= -126, normal, sub)
    out = torch.where(k < -149, torch.zeros_like(out), out)
    return torch.where(k > 127, torch.full_like(out, math.inf), out)


def round_scale_pow2(s: torch.Tensor, mode: str) -> torch.Tensor:
    """Round an fp32 scale up to a power of two.

    * ``ceil_log2``: 2^ceil(fl(log2 s)) with torch's fp32 log2 (the power is formed exactly). log2 rounding makes
      scales a few ulps above 2^k give 2^k (round *down*), docs/engine-numerics.md §7. log2(0) = -inf gives 0;
      inf and NaN pass through.
    * ``ceil_bits``: biased exponent e of the fp32 bits of |s|, plus 1 if any mantissa bit is set, clamped to
      [1, 254]; s = 2^(e-127) (DeepGEMM ``ceil_to_ue8m0``). Subnormal and zero scales give 2^-126; inf (e = 255) and
      NaN (e = 255, mantissa ≠ 0: 256) are clamped to 254 and give 2^127.
    * ``none``: s unchanged. (``floor_multiplier`` acts on the multiplier, see :func:`scale_from_amax`.)
    """
    check_choice("pow2", mode, POW2_MODES)
    s = s.to(_F32)
    if mode == "none":
        return s
    if mode == "ceil_log2":
        k = torch.ceil(torch.log2(s))
        finite = torch.isfinite(k)
        p = _exact_pow2(torch.where(finite, k, torch.zeros_like(k)).to(torch.int64))
        return torch.where(finite, p, torch.exp2(k))  # exp2(-inf) = 0, exp2(nan) = nan, exp2(inf) = inf
    if mode == "ceil_bits":
        bits = s.abs().contiguous().view(torch.int32).to(torch.int64)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int64)
        return (e.clamp(1, 254) << 23).to(torch.int32).view(_F32)
    raise ValueError("pow2: 'floor_multiplier' rounds the multiplier, not the scale; use scale_from_amax")


def zero_scale_to_dtype_eps(s: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """s' = finfo(D).eps where s == 0, else s (fp32 result): the zero-scale rule of ``zero_amax="scale_dtype_eps"``.

    D = ``dtype`` (the dtype the scale was computed in), fp32 when None: eps = 2^-7 for bf16, 2^-10 for fp16,
    2^-23 for fp32. Only an exact zero is replaced (a NaN or inf scale passes through): compressed-tensors'
    ``calculate_qparams`` step 5, ``torch.where(scales == 0, _get_dtype_eps(scales.dtype), scales)``.
    """
    eps = float(torch.finfo(dtype if dtype is not None else _F32).eps)
    s = s.to(_F32)
    return torch.where(s == 0, _f32(eps), s)


def quant_multiplier_from_amax(amax: torch.Tensor, policy: ScalePolicy | str, *,
                               input_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The multiplier m of ``quant_op="mul_max_over_amax"`` (q = x·m), fp32, same shape as ``amax``.

    m = R(T/amax') or R(R(1/amax')·T) (``multiplier_op``; R rounds to the input dtype under
    ``compute_dtype="input"``), an overflow replaced per ``multiplier_overflow``; with ``floor_multiplier`` its
    mantissa is zeroed; for ``zero_amax`` "one*" modes a degenerate amax' gives m = 1. For ``ceil_log2``/``ceil_bits``
    policies m = 1/s exactly (s is a power of two), which is what engines with power-of-two scales multiply by.
    ``input_dtype``: the dtype of the quantized tensor (fp32 when None).
    """
    policy = get_policy(policy)
    t = policy.max_value
    rd = _compute_dtype(policy, input_dtype)
    amax_f = _floored_amax(amax, policy, rd)
    if policy.pow2 in ("ceil_log2", "ceil_bits"):
        return _f32(1.0) / scale_from_amax(amax, policy, input_dtype=input_dtype)
    m = _multiplier_raw(amax_f, t, policy, input_dtype)
    if policy.pow2 == "floor_multiplier":
        m = _pow2_floor(m)
    if policy.zero_amax.startswith("one"):
        m = torch.where(_degenerate(amax_f, policy.zero_amax), _f32(1.0), m)
    return m


def scale_from_amax(amax: torch.Tensor, policy: ScalePolicy | str, *,
                    input_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fp32 dequant scale s for each amax (pipeline steps 2–6 of the module docstring).

    * "div": s = R(amax'/T);  "mul_recip_max": s = R(amax'·R(1/T));  "recip_multiplier": s = fl32(1/m), m the
      multiplier (``multiplier_op``; with ``floor_multiplier``: m's mantissa zeroed first, so s = 1/m is exact);
      R rounds to ``input_dtype`` under ``compute_dtype="input"`` and is the identity otherwise;
    * ``floor="scale"``: s = R(max(s, fl(eps))), then pow2 rounding (:func:`round_scale_pow2`), or pow2 rounding
      first with ``floor_order="pow2_then_floor"``;
    * ``zero_amax`` "one*" modes: s = 1 for the degenerate amax' of the mode;
    * ``zero_amax="scale_dtype_eps"``: last, s = finfo(D).eps where s == 0 (:func:`zero_scale_to_dtype_eps`; D the
      compute dtype: the input dtype under ``compute_dtype="input"``, else fp32).
    """
    policy = get_policy(policy)
    if not isinstance(amax, torch.Tensor):
        raise TypeError(f"amax: expected a torch.Tensor, got {type(amax).__name__}")
    t = policy.max_value
    rd = _compute_dtype(policy, input_dtype)
    amax_f = _floored_amax(amax, policy, rd)
    if policy.scale_op == "div":
        s = _round(amax_f / _f32(t), rd)
    elif policy.scale_op == "mul_recip_max":
        s = _round(amax_f * _round(_f32(1.0) / _f32(t), rd), rd)
    else:
        m = _multiplier_raw(amax_f, t, policy, input_dtype)
        if policy.pow2 == "floor_multiplier":
            m = _pow2_floor(m)
        s = _f32(1.0) / m
    pow2 = policy.pow2 in ("ceil_log2", "ceil_bits")
    if pow2 and policy.floor_order == "pow2_then_floor":
        s = _round(round_scale_pow2(s, policy.pow2), rd)
        pow2 = False
    if policy.floor == "scale":
        s = _round(torch.maximum(s, _f32(policy.eps)), rd)
    if pow2:
        s = _round(round_scale_pow2(s, policy.pow2), rd)
    if policy.zero_amax.startswith("one"):
        s = torch.where(_degenerate(amax_f, policy.zero_amax), _f32(1.0), s)
    if policy.zero_amax == "scale_dtype_eps":
        s = zero_scale_to_dtype_eps(s, rd)
    return s.to(_F32)


def _expand(t: torch.Tensor, g: Granularity, shape: tuple[int, ...]) -> torch.Tensor:
    if g.kind == "tensor":
        return t.reshape([1] * len(shape)).expand(shape)
    if g.kind in ("token", "channel"):
        return t.expand(shape)
    # each group's value repeated over its G columns (its Bm×Bn tile), cut to the shape (ragged edges); by
    # broadcasting: torch's repeat_interleave along dim 1 took milliseconds on a (128, 3) tensor
    if g.kind == "group":
        gs = g.size[1]
        return t.unsqueeze(-1).expand(*t.shape, gs).reshape(*t.shape[:-1], -1)[..., : shape[-1]]
    bm, bn = g.size
    nm, nn = t.shape
    return t[:, None, :, None].expand(nm, bm, nn, bn).reshape(nm * bm, nn * bn)[: shape[0], : shape[1]]


def _apply_per_group(x: torch.Tensor, t: torch.Tensor, g: Granularity, op) -> torch.Tensor:
    """op(x, expand(t)) elementwise; for divisible group/block shapes through a broadcast view (no expanded copy).

    The result is bit-identical to the expanded form: the same fp32 operation on the same operand pairs.
    """
    shape = tuple(x.shape)
    if g.kind == "group" and shape[-1] % g.size[1] == 0:
        gs = g.size[1]
        xv = x.reshape(*shape[:-1], shape[-1] // gs, gs)
        return op(xv, t.unsqueeze(-1)).reshape(shape)
    if g.kind == "block" and shape[0] % g.size[0] == 0 and shape[1] % g.size[1] == 0:
        bm, bn = g.size
        xv = x.reshape(shape[0] // bm, bm, shape[1] // bn, bn)
        return op(xv, t[:, None, :, None]).reshape(shape)
    return op(x, _expand(t, g, shape))


# ---------------------------------------------------------------------------------------------------------------
# Strip-wise evaluation (the hot path of compute_amax and quantize_with_scale)
#
# Large inputs are processed one strip of rows at a time, in numpy, the rows split between torch.get_num_threads()
# threads (numpy releases the GIL inside its loops; each thread writes only its own rows). Every element gets exactly
# the fp32 operation of the whole-tensor formula (max is exact; x/s and x·m are the same IEEE operation on the same
# operand pair), so amax and codes are bit-identical to it; only the order of independent elementwise passes
# changes, so that a strip's intermediates stay in cache between them and no tensor-sized temporary is allocated.
# It is the fast path of fp8rl.reference.quant_plain (the definition: whole-tensor torch steps);
# tests/oracle/test_quant_fast_path.py compares both on every input class, granularity, preset, strip size and
# special value.

#: elements per strip (fp32: 512 KiB, so a strip and its code table indexes stay in cache)
_STRIP_ELEMS = 1 << 17


def _rows_view(x: torch.Tensor, g: Granularity) -> np.ndarray:
    """x as a C-contiguous 2-D fp32 array: (M, N) for channel/block, (prod(leading dims), K) otherwise; a tensor-wide
    group as (1, n)."""
    a = np.ascontiguousarray(x.numpy())
    return a.reshape(1, -1) if g.kind == "tensor" else a.reshape(-1, a.shape[-1])


def _strips(g: Granularity, lo: int, hi: int, cols: int):
    """Row ranges [r0, r1) covering rows lo..hi, about ``_STRIP_ELEMS`` elements each (whole rows, at least one); for
    blocks a strip never crosses a block-row boundary, so it shares one row of scales."""
    step = max(1, _STRIP_ELEMS // cols)
    r0 = lo
    while r0 < hi:
        r1 = min(r0 + step, hi)
        if g.kind == "block":
            r1 = min(r1, (r0 // g.size[0] + 1) * g.size[0])
        yield r0, r1
        r0 = r1


def _col_spans(g: Granularity, cols: int) -> tuple[int, int]:
    """(columns per group, number of column groups) of the 2-D view: (G or Bn, ceil(cols/G or Bn)), else (cols, 1)."""
    if g.kind in ("group", "block"):
        return g.size[1], -(-cols // g.size[1])
    return cols, 1


def _row_ranges(g: Granularity, rows: int, cols: int = 1) -> list[tuple[int, int]]:
    """``rows`` (of ``cols`` elements) split into one contiguous range per worker thread (``torch.get_num_threads()``,
    but no more ranges than strips: small inputs stay on the calling thread); for blocks the cuts fall on block-row
    boundaries, so no two ranges share a row of scales."""
    align = g.size[0] if g.kind == "block" else 1
    units = -(-rows // align)
    parts = max(1, min(torch.get_num_threads(), units, rows * cols // _STRIP_ELEMS))
    cuts = [min(rows, (units * i // parts) * align) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _on_threads(work, ranges: list[tuple[int, int]]) -> list:
    """[work(lo, hi) for each range], the ranges on parallel threads (numpy releases the GIL in its loops; each range
    writes only its own rows of the outputs)."""
    def run(r: tuple[int, int]):
        with np.errstate(all="ignore"):  # per thread; NaN, inf and 0/0 are inputs like any other here
            return work(*r)

    if len(ranges) == 1:
        return [run(ranges[0])]
    with ThreadPoolExecutor(max_workers=len(ranges)) as pool:
        return list(pool.map(run, ranges))


def _amax_by_strips(a: np.ndarray, g: Granularity) -> np.ndarray:
    """max |x| per group of the 2-D view ``a`` (:func:`_rows_view`), one strip at a time; shape (rows, groups) for
    token/channel/group, (ceil(M/Bm), ceil(N/Bn)) for block, (1, 1) for tensor. np.max and np.maximum propagate NaN,
    as torch's amax does."""
    if g.kind == "tensor":  # strips of the flat array, one maximum each
        flat = a.reshape(-1)

        def tensor_work(lo: int, hi: int) -> np.floating:
            buf = np.empty(min(hi - lo, _STRIP_ELEMS), dtype=np.float32)
            maxima = []
            for c0 in range(lo, hi, buf.size):
                piece = flat[c0:min(c0 + buf.size, hi)]
                np.abs(piece, out=buf[:piece.size])
                maxima.append(buf[:piece.size].max())
            return np.max(np.array(maxima, dtype=np.float32))

        return np.array([[np.max(np.array(_on_threads(tensor_work, _row_ranges(g, flat.size)), dtype=np.float32))]],
                        dtype=np.float32)
    rows, cols = a.shape
    width, ngroups = _col_spans(g, cols)
    out = np.empty((-(-rows // g.size[0]) if g.kind == "block" else rows, ngroups), dtype=np.float32)
    starts = np.arange(0, cols, width)

    def work(lo: int, hi: int) -> None:
        buf = np.empty(min(hi - lo, max(1, _STRIP_ELEMS // cols)) * cols, dtype=np.float32)
        for r0, r1 in _strips(g, lo, hi, cols):
            b = buf[:(r1 - r0) * cols].reshape(r1 - r0, cols)
            np.abs(a[r0:r1], out=b)
            if g.kind == "block":  # rows first (an elementwise max down the strip), then the column groups
                b = b.max(axis=0, keepdims=True)
            if cols % width == 0:
                per_group = b.reshape(len(b), ngroups, width).max(axis=2)
            else:
                per_group = np.maximum.reduceat(b, starts, axis=1)
            if g.kind != "block":
                out[r0:r1] = per_group
            elif r0 % g.size[0] == 0:
                out[r0 // g.size[0]] = per_group[0]
            else:
                np.maximum(out[r0 // g.size[0]], per_group[0], out=out[r0 // g.size[0]])

    _on_threads(work, _row_ranges(g, rows, cols))
    return out


def _codes_by_strips(x: torch.Tensor, t: torch.Tensor, g: Granularity, divide: bool, policy: ScalePolicy) -> torch.Tensor:
    """Pipeline step 7 for fp32 arithmetic: codes of q = fl(x/t) (``divide``) or fl(x·t) with t the per-group scale or
    multiplier, clamp(q, -T, T) if ``policy.clamp``, then the RNE cast (:func:`~fp8rl.reference.formats.
    encode_codes_into`) — a strip of rows at a time.

    The clamp is skipped when it cannot change a code: with ``overflow="saturate"`` and fl32(T) equal to the
    format's max finite value, the cast already maps every |q| > T to ±max finite, and NaN passes both unchanged.
    """
    a = _rows_view(x, g)
    rows, cols = a.shape
    width, ngroups = _col_spans(g, cols)
    tv = np.ascontiguousarray(t.numpy()).reshape(-1, ngroups)  # (rows or block rows, groups); (1, 1) for tensor
    op = np.divide if divide else np.multiply
    limit = np.float32(policy.max_value)
    clamp = policy.clamp and not (policy.overflow == "saturate" and float(limit) == get_format(policy.fmt).max_finite)
    codes = np.empty(a.size, dtype=np.uint8)

    def finish(qs: np.ndarray, lo: int) -> None:
        """clamp and cast a strip's quotients ``qs`` (flat) into codes[lo:lo + qs.size]."""
        if clamp:
            np.clip(qs, -limit, limit, out=qs)
        encode_codes_into(qs, codes[lo:lo + qs.size], policy.fmt, policy.overflow)

    def tensor_work(lo: int, hi: int) -> None:  # one scale: strips of the flat array
        flat = a.reshape(-1)
        q = np.empty(min(hi - lo, _STRIP_ELEMS), dtype=np.float32)
        for c0 in range(lo, hi, q.size):
            piece = flat[c0:min(c0 + q.size, hi)]
            op(piece, tv[0, 0], out=q[:piece.size])
            finish(q[:piece.size], c0)

    def work(lo: int, hi: int) -> None:
        q = np.empty(min(hi - lo, max(1, _STRIP_ELEMS // cols)) * cols, dtype=np.float32)
        for r0, r1 in _strips(g, lo, hi, cols):
            xs = a[r0:r1]
            ts = tv[r0 // g.size[0]][None, :] if g.kind == "block" else tv[r0:r1]  # (1 or rows, groups)
            qs = q[:xs.size]
            if cols % width == 0 and g.kind in ("group", "block"):  # broadcast view, no expanded operand
                op(xs.reshape(r1 - r0, ngroups, width), ts[:, :, None], out=qs.reshape(r1 - r0, ngroups, width))
            elif g.kind in ("group", "block"):
                op(xs, np.repeat(ts, width, axis=1)[:, :cols], out=qs.reshape(r1 - r0, cols))
            else:
                op(xs, ts, out=qs.reshape(r1 - r0, cols))
            finish(qs, r0 * cols)

    if g.kind == "tensor":
        _on_threads(tensor_work, _row_ranges(g, a.size))
    else:
        _on_threads(work, _row_ranges(g, rows, cols))
    return torch.from_numpy(codes.reshape(tuple(x.shape)))


def expand_scale(scale: torch.Tensor, g: Granularity, shape: tuple[int, ...]) -> torch.Tensor:
    """Broadcast a per-group tensor (scale, amax, multiplier) of shape ``g.scale_shape(shape)`` to ``shape``."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale: expected a torch.Tensor, got {type(scale).__name__}")
    shape = g.check_shape(tuple(shape), "shape")
    want = g.scale_shape(shape)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale: expected shape {want} for {g.label} over {shape}, got {tuple(scale.shape)}")
    return _expand(scale, g, shape).contiguous()


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, g: Granularity, policy: ScalePolicy | str = "reference",
                        *, amax: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes of x for the given dequant ``scale`` (fp32, shape ``g.scale_shape(x.shape)``).

    q = R(x/s) ("div"), R(x·R(1/s)) ("mul_recip") or R(x·m) ("mul_max_over_amax", m from
    :func:`quant_multiplier_from_amax` of ``amax``, which is recomputed from x when not given — a dynamic-quant
    op); then clamp(q, -T, T) if ``policy.clamp``; then the RNE cast with ``policy.overflow``. R rounds to x's own
    dtype under ``compute_dtype="input"`` (so pass x in the dtype it was quantized from); under ``"scale_input"``
    only R(1/s) and m are, q is fl32.

    An optimisation (fp32 quotients strip by strip, the table encoder) of
    :func:`fp8rl.reference.quant_plain.quantize_with_scale_plain`, the definition: equal to it bit for bit.
    """
    policy = get_policy(policy)
    in_dtype = x.dtype if isinstance(x, torch.Tensor) else None
    x = _as_input(x)
    rd = _compute_dtype(policy, in_dtype)
    rq = _quotient_dtype(policy, in_dtype)
    shape = g.check_shape(tuple(x.shape))
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale: expected a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != _F32:
        raise TypeError(f"scale: expected a torch.float32 tensor, got {scale.dtype}")
    want = g.scale_shape(shape)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale: expected shape {want} for {g.label} over {shape}, got {tuple(scale.shape)}")
    scale = scale.cpu()
    if policy.quant_op == "div":
        operand, divide = scale, True
    elif policy.quant_op == "mul_recip":
        operand, divide = _round(_f32(1.0) / scale, rd), False
    else:
        if amax is None:
            amax = compute_amax(x, g)
        elif tuple(amax.shape) != g.scale_shape(shape):
            raise ValueError(f"amax: expected shape {g.scale_shape(shape)}, got {tuple(amax.shape)}")
        operand, divide = quant_multiplier_from_amax(amax.to("cpu", _F32), policy, input_dtype=in_dtype), False
    if rq is None:  # fp32 quotient: strip by strip, bit-identical to the lines below (see _codes_by_strips)
        return _codes_by_strips(x, operand, g, divide, policy)
    q = _round(_apply_per_group(x, operand, g, torch.div if divide else torch.mul), rq)
    if policy.clamp:
        t = policy.max_value
        q = q.clamp_(-t, t)
    codes = encode_codes(q.numpy(), policy.fmt, policy.overflow)
    return torch.from_numpy(codes.reshape(shape))


def quantize(x: torch.Tensor, g: Granularity, policy: ScalePolicy | str = "reference") -> QuantizedTensor:
    """Dynamic quantization: amax per group → scale (:func:`scale_from_amax`) → codes (:func:`quantize_with_scale`).

    ``x``: fp32, bf16 or fp16 tensor (upcast to fp32 exactly), non-empty, shape valid for ``g``; its dtype is the
    input dtype of ``compute_dtype="input"`` and ``multiplier_overflow="input_max"``.

    The fast path of :func:`fp8rl.reference.quant_plain.quantize_plain`, the oracle's definition: the same formulas
    with the fp32 amax and quotients evaluated strip by strip in numpy on ``torch.get_num_threads()`` threads and the
    cast through the encoder's lookup table. It must equal ``quantize_plain`` bit for bit — codes and scales
    (tests/oracle/test_quant_fast_path.py); the one freedom is the sign of a NaN code where both factors of the
    quotient are NaN (a NaN element in a group whose reciprocal or multiplier is NaN), which IEEE 754 leaves to the
    vector unit.
    """
    if not isinstance(g, Granularity):
        raise TypeError(f"granularity: expected a Granularity, got {type(g).__name__}")
    policy = get_policy(policy)
    raw = x
    x = _as_input(x)
    amax = compute_amax(x, g)
    scale = scale_from_amax(amax, policy, input_dtype=raw.dtype)
    codes = quantize_with_scale(raw, scale, g, policy, amax=amax)
    return QuantizedTensor(codes, scale.contiguous(), g, policy)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """decode(codes) · scale, computed in fp64 (exact: an FP8 significand has ≤ 4 bits, the scale 24) and rounded
    once to ``dtype`` (fp32 by default; fp64 gives the exact value)."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt: expected a QuantizedTensor, got {type(qt).__name__}")
    vals = qt.values().to(torch.float64)
    s = expand_scale(qt.scale.cpu(), qt.granularity, qt.shape).to(torch.float64)
    return (vals * s).to(dtype)
