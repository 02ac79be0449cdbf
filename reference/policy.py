"""The scale policy of a dynamic scaled-FP8 quantizer: :class:`ScalePolicy` and the modes of its fields.

A :class:`ScalePolicy` names every numerical choice engines make differently when they turn a group's amax into an
fp32 dequant scale s and cast x/s to FP8 (docs/engine-numerics.md §2–§7); the pipeline that applies it, with every formula, is
:mod:`fp8rl.reference.quant` (amax → scale → cast). The named policies of the engines we test are
:data:`fp8rl.reference.presets.PRESETS`.

Each mode tuple lists the accepted values of one field (the fields' meanings are in the ScalePolicy docstring):

* :data:`FLOOR_MODES`: where eps applies: amax' = max(amax, eps) ("amax"), s = max(s, eps) ("scale"), nowhere;
* :data:`POW2_MODES`: power-of-two rounding of s: none, 2^ceil(fl(log2 s)), 2^(e + (mantissa ≠ 0)) on the fp32
  bits, or the multiplier T/amax' rounded down to a power of two;
* :data:`SCALE_OPS`: s = fl(amax'/T), fl(amax'·fl(1/T)) or fl(1/m) with m = fl(T/amax');
* :data:`QUANT_OPS`: q = fl(x/s), fl(x·fl(1/s)) or fl(x·m);
* :data:`ZERO_AMAX_MODES`: what a zero amax gives: the floor rule, s = 1, or NaN (unguarded 0/0).

Needs only torch and numpy (through :mod:`fp8rl.reference.formats`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from fp8rl.reference.formats import ELEMENT_FORMATS, OVERFLOW_POLICIES, FP8Format, OverflowPolicy, get_format

__all__ = ["FLOOR_MODES", "POW2_MODES", "QUANT_OPS", "SCALE_OPS", "ZERO_AMAX_MODES", "OverflowPolicy", "ScalePolicy",
           "check_choice"]

FLOOR_MODES: tuple[str, ...] = ("none", "amax", "scale")
POW2_MODES: tuple[str, ...] = ("none", "ceil_log2", "ceil_bits", "floor_multiplier")
SCALE_OPS: tuple[str, ...] = ("div", "mul_recip_max", "recip_multiplier")
QUANT_OPS: tuple[str, ...] = ("div", "mul_recip", "mul_max_over_amax")
ZERO_AMAX_MODES: tuple[str, ...] = ("floor", "one", "nan")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


@dataclass(frozen=True)
class ScalePolicy:
    """Every numerical choice of a dynamic scaled-FP8 quantizer (the pipeline is :mod:`fp8rl.reference.quant`).

    Fields:

    * ``fmt``: element format (an entry of ``ELEMENT_FORMATS``).
    * ``target_max`` T: the value the group's amax is mapped to; None → the format's max finite (448 for e4m3fn).
      ROCm fnuz engines use 224. Must satisfy 0 < T ≤ max finite.
    * ``floor``: where ``eps`` applies: ``"amax"`` (amax' = max(amax, eps)), ``"scale"`` (s = max(s, eps), before
      pow2 rounding) or ``"none"``. ``eps`` is rounded to fp32 first, as engines pass it as a C float.
    * ``pow2``: ``"none"``; ``"ceil_log2"`` s = 2^ceil(fl(log2 s)) with torch's fp32 log2 (vLLM torch/Triton/CUDA
      ``exp2(ceil(log2 s))``: for s a few fp32 ulps above a power of two, fl(log2 s) rounds to the integer, so the
      scale rounds **down** and |x/s| can exceed T by ≤ 2^-16 relative, then clamps; docs/engine-numerics.md §7);
      ``"ceil_bits"`` s = 2^(e + (mantissa ≠ 0)) on the fp32 bits with the biased exponent clamped to [1, 254]
      (DeepGEMM ``ceil_to_ue8m0``, SGLang UE8M0); ``"floor_multiplier"`` TE: the multiplier m = fl(T/amax') has its
      mantissa bits zeroed (rounded down to a power of two) and s = 1/m (needs ``scale_op="recip_multiplier"``).
    * ``scale_op``: ``"div"`` s = fl(amax'/T); ``"mul_recip_max"`` s = fl(amax'·fl(1/T)) (1 fp32 ulp from "div" in
      ~49 % of groups, docs/engine-numerics.md §7); ``"recip_multiplier"`` m = fl(T/amax'), s = fl(1/m) (verl torch, torchao,
      TE). A multiplier that overflows fp32 (amax' < T/FLT_MAX ≈ 1.3e-36) is replaced by FLT_MAX (TE's rule).
    * ``quant_op``: ``"div"`` q = fl(x/s); ``"mul_recip"`` q = fl(x·fl(1/s)); ``"mul_max_over_amax"`` q = fl(x·m)
      with m = fl(T/amax') computed from the amax (SGLang JIT, TE, torchao, verl torch); for pow2 policies m = 1/s
      exactly.
    * ``clamp``: clamp q to ±T before the cast (NaN stays NaN).
    * ``zero_amax``: what a zero amax gives: ``"floor"`` the floor rule (needs ``floor != "none"`` and eps > 0);
      ``"one"`` scale 1 and multiplier 1 when amax' is 0, ±inf or NaN (TE ``compute_scale_from_amax``; verl torch
      does it for 0 and inf only); ``"nan"`` unguarded: s = 0 and 0/0 → NaN codes (DeepSeek reference kernel,
      vLLM per-tensor CUDA — whose ``fminf(NaN, 448)`` is predicted to store +448 instead, docs/engine-numerics.md §2.1).
    * ``overflow``: the cast's overflow policy for values that still overflow (no clamp, or ±inf with clamp off).
    """

    name: str
    fmt: str = "e4m3fn"
    target_max: float | None = None
    floor: Literal["none", "amax", "scale"] = "amax"
    eps: float = 1e-10
    pow2: Literal["none", "ceil_log2", "ceil_bits", "floor_multiplier"] = "none"
    scale_op: Literal["div", "mul_recip_max", "recip_multiplier"] = "div"
    quant_op: Literal["div", "mul_recip", "mul_max_over_amax"] = "div"
    clamp: bool = True
    zero_amax: Literal["floor", "one", "nan"] = "floor"
    overflow: OverflowPolicy = "saturate"
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        if self.fmt not in ELEMENT_FORMATS:
            raise ValueError(f"fmt: expected one of {ELEMENT_FORMATS}, got {self.fmt!r}")
        f = get_format(self.fmt)
        if self.target_max is not None:
            t = self.target_max
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"target_max: expected a positive finite number or None, got {t!r}")
            if t > f.max_finite:
                raise ValueError(f"target_max: {t} exceeds the max finite value {f.max_finite} of {self.fmt}")
        check_choice("floor", self.floor, FLOOR_MODES)
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not (self.eps >= 0):
            raise ValueError(f"eps: expected a number >= 0, got {self.eps!r}")
        if not math.isfinite(self.eps):
            raise ValueError(f"eps: expected a finite number, got {self.eps!r}")
        check_choice("pow2", self.pow2, POW2_MODES)
        check_choice("scale_op", self.scale_op, SCALE_OPS)
        check_choice("quant_op", self.quant_op, QUANT_OPS)
        if not isinstance(self.clamp, bool):
            raise ValueError(f"clamp: expected a bool, got {self.clamp!r}")
        check_choice("zero_amax", self.zero_amax, ZERO_AMAX_MODES)
        check_choice("overflow", self.overflow, OVERFLOW_POLICIES)
        if self.overflow not in f.allowed_overflow():
            raise ValueError(f"overflow: {self.fmt} allows {f.allowed_overflow()}, got {self.overflow!r}")
        if self.zero_amax == "floor" and (self.floor == "none" or self.eps == 0):
            raise ValueError("zero_amax: 'floor' needs a floor (floor != 'none' and eps > 0); use zero_amax='one' "
                             f"or 'nan' to say what a zero amax gives (floor={self.floor!r}, eps={self.eps!r})")
        if self.pow2 == "floor_multiplier" and self.scale_op != "recip_multiplier":
            raise ValueError("pow2: 'floor_multiplier' rounds the multiplier T/amax, so it needs "
                             f"scale_op='recip_multiplier', got scale_op={self.scale_op!r}")

    @property
    def format(self) -> FP8Format:
        return get_format(self.fmt)

    @property
    def max_value(self) -> float:
        """T: ``target_max`` or the format's max finite value."""
        return float(self.target_max) if self.target_max is not None else self.format.max_finite

    def for_format(self, fmt: str) -> ScalePolicy:
        """The same policy for another element format (``target_max`` is kept only if the format is unchanged;
        an overflow policy the new format lacks falls back to ``"saturate"``)."""
        f = get_format(fmt)
        if f.name == self.fmt:
            return self
        overflow = self.overflow if self.overflow in f.allowed_overflow() else "saturate"
        return replace(self, fmt=f.name, target_max=None, overflow=overflow)

