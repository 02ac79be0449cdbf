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
fp32); the FP8 cast is the bit-level encoder of :mod:`fp8rl.reference.formats` (round-to-nearest-even), never
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
6. power-of-two rounding by ``pow2`` (see :func:`round_scale_pow2`).
7. codes: ``q = R(x/s)``, ``R(x·R(1/s))`` or ``R(x·m)`` (``quant_op``), ``clamp(q, -T, T)`` if ``clamp``, then the
   RNE cast with the ``overflow`` policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from fp8rl.reference.formats import bf16_bits_rne, decode, encode_codes
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
    "round_scale_pow2", "scale_from_amax",
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


def _pad_to(x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Zero-pad the trailing dims of x to ``sizes`` (only growing)."""
    pads: list[int] = []
    for dim_size, want in zip(reversed(x.shape[-len(sizes):]), reversed(sizes)):
        pads += [0, want - dim_size]
    return torch.nn.functional.pad(x, pads) if any(pads) else x


def compute_amax(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """amax = max |x| over each group of ``g`` (fp32, shape ``g.scale_shape(x.shape)``).

    Edge groups/blocks of non-divisible shapes use only their real elements. A NaN anywhere in a group makes its
    amax NaN (torch's max propagates NaN). CUDA kernels reducing with ``fmaxf`` drop NaNs instead, so engines may
    differ on NaN inputs; every such difference is reported, not hidden.
    """
    x = _as_input(x)
    shape = g.check_shape(tuple(x.shape))
    a = x.abs()
    if g.kind == "tensor":
        return a.amax().reshape(1)
    if g.kind in ("token", "channel"):
        return a.amax(dim=-1, keepdim=True)
    if g.kind == "group":
        gs = g.size[1]
        n = -(-shape[-1] // gs)
        a = _pad_to(a, (n * gs,))
        return a.reshape(*shape[:-1], n, gs).amax(dim=-1)
    bm, bn = g.size
    nm, nn = -(-shape[0] // bm), -(-shape[1] // bn)
    a = _pad_to(a, (nm * bm, nn * bn))
    # inner (contiguous) dim first, then the rows: the same maxima (max is exact and NaN-propagating either way),
    # ~1.5x faster than one reduction over the strided dims (1, 3)
    return a.reshape(nm, bm, nn, bn).amax(dim=3).amax(dim=1)


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=_F32)


def _compute_dtype(policy: ScalePolicy, input_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype every scale/quotient step is rounded to (None: fp32, no extra rounding)."""
    if policy.compute_dtype == "fp32" or input_dtype is None or input_dtype == _F32:
        return None
    if input_dtype not in ACCEPTED_INPUT_DTYPES:
        raise TypeError(f"input_dtype: expected float32, bfloat16 or float16, got {input_dtype}")
    return input_dtype


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
    * ``zero_amax`` "one*" modes: s = 1 for the degenerate amax' of the mode.
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
    return s.to(_F32)


def _expand(t: torch.Tensor, g: Granularity, shape: tuple[int, ...]) -> torch.Tensor:
    if g.kind == "tensor":
        return t.reshape([1] * len(shape)).expand(shape)
    if g.kind in ("token", "channel"):
        return t.expand(shape)
    if g.kind == "group":
        return t.repeat_interleave(g.size[1], dim=-1)[..., : shape[-1]]
    bm, bn = g.size
    return t.repeat_interleave(bm, dim=0).repeat_interleave(bn, dim=1)[: shape[0], : shape[1]]


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
    dtype under ``compute_dtype="input"`` (so pass x in the dtype it was quantized from).
    """
    policy = get_policy(policy)
    in_dtype = x.dtype if isinstance(x, torch.Tensor) else None
    x = _as_input(x)
    rd = _compute_dtype(policy, in_dtype)
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
        q = _apply_per_group(x, scale, g, torch.div)
    elif policy.quant_op == "mul_recip":
        q = _apply_per_group(x, _round(_f32(1.0) / scale, rd), g, torch.mul)
    else:
        if amax is None:
            amax = compute_amax(x, g)
        elif tuple(amax.shape) != g.scale_shape(shape):
            raise ValueError(f"amax: expected shape {g.scale_shape(shape)}, got {tuple(amax.shape)}")
        m = quant_multiplier_from_amax(amax.to("cpu", _F32), policy, input_dtype=in_dtype)
        q = _apply_per_group(x, m, g, torch.mul)
    q = _round(q, rd)
    if policy.clamp:
        t = policy.max_value
        q = q.clamp_(-t, t)
    codes = encode_codes(q.numpy(), policy.fmt, policy.overflow)
    return torch.from_numpy(codes.reshape(shape))


def quantize(x: torch.Tensor, g: Granularity, policy: ScalePolicy | str = "reference") -> QuantizedTensor:
    """Dynamic quantization: amax per group → scale (:func:`scale_from_amax`) → codes (:func:`quantize_with_scale`).

    ``x``: fp32, bf16 or fp16 tensor (upcast to fp32 exactly), non-empty, shape valid for ``g``; its dtype is the
    input dtype of ``compute_dtype="input"`` and ``multiplier_overflow="input_max"``.
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
