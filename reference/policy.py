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
* :data:`ZERO_AMAX_MODES`: what a zero (or non-finite) amax gives: the floor rule, s = 1 for some degenerate amaxes,
  NaN (unguarded 0/0), or — for a scale that comes out exactly 0 — s = finfo(D).eps of the dtype D the scale is
  computed in ("scale_dtype_eps": 2^-7 for bf16, 2^-10 for fp16, 2^-23 for fp32; compressed-tensors);
* :data:`COMPUTE_DTYPES`: the dtype of the scale and quotient arithmetic: fp32, or the input's own dtype;
* :data:`MULTIPLIER_OPS`: m = fl(T/amax') or fl(fl(1/amax')·T) (torch's ``T / t``);
* :data:`MULTIPLIER_OVERFLOWS`: what replaces a multiplier that overflows: FLT_MAX, the input dtype's max finite, or
  nothing (inf);
* :data:`FLOOR_ORDERS`: a scale floor before or after power-of-two rounding.

Needs only torch and numpy (through :mod:`fp8rl.reference.formats`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from fp8rl.reference.formats import ELEMENT_FORMATS, OVERFLOW_POLICIES, FP8Format, OverflowPolicy, get_format

__all__ = ["COMPUTE_DTYPES", "FLOOR_MODES", "FLOOR_ORDERS", "MULTIPLIER_OPS", "MULTIPLIER_OVERFLOWS", "POW2_MODES",
           "QUANT_OPS", "SCALE_OPS", "ZERO_AMAX_MODES", "OverflowPolicy", "ScalePolicy", "check_choice"]

FLOOR_MODES: tuple[str, ...] = ("none", "amax", "scale")
POW2_MODES: tuple[str, ...] = ("none", "ceil_log2", "ceil_bits", "floor_multiplier")
SCALE_OPS: tuple[str, ...] = ("div", "mul_recip_max", "recip_multiplier")
QUANT_OPS: tuple[str, ...] = ("div", "mul_recip", "mul_max_over_amax")
ZERO_AMAX_MODES: tuple[str, ...] = ("floor", "one", "one_zero_inf", "one_zero_nan", "nan", "scale_dtype_eps")
COMPUTE_DTYPES: tuple[str, ...] = ("fp32", "input", "scale_input")
MULTIPLIER_OPS: tuple[str, ...] = ("div", "recip_mul")
MULTIPLIER_OVERFLOWS: tuple[str, ...] = ("flt_max", "input_max", "inf")
FLOOR_ORDERS: tuple[str, ...] = ("floor_then_pow2", "pow2_then_floor")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


@dataclass(frozen=True)
class ScalePolicy:
    """Every numerical choice of a dynamic scaled-FP8 quantizer (the pipeline is :mod:`fp8rl.reference.quant`).

    Fields (``python -m fp8rl.docs_gen`` makes the field tables of docs/ from this list):

    * ``name``: the policy's name (a preset's key in :data:`fp8rl.reference.presets.PRESETS`; any non-empty string
      for a policy of your own).
    * ``fmt``: element format (an entry of ``ELEMENT_FORMATS``).
    * ``target_max`` T: the value the group's amax is mapped to; None → the format's max finite (448 for e4m3fn).
      ROCm fnuz engines use 224. Must satisfy 0 < T ≤ max finite.
    * ``floor``: where ``eps`` applies: ``"amax"`` (amax' = max(amax, eps)), ``"scale"`` (s = max(s, eps), before
      pow2 rounding unless ``floor_order`` says after) or ``"none"``. ``eps`` is rounded to fp32 first, as engines
      pass it as a C float.
    * ``eps``: the floor's value, a finite number ≥ 0 (rounded to fp32): 1e-10 (vLLM/SGLang group quant, veRL
      Triton), 1e-12 (torchao, SGLang MLA/ROCm), 1e-4 (DeepGEMM), 1/(448·512) ≈ 4.36e-6 as a *scale* floor (vLLM
      native and per-token), 0 (TE).
    * ``pow2``: ``"none"``; ``"ceil_log2"`` s = 2^ceil(fl(log2 s)) with torch's fp32 log2 (vLLM torch/Triton/CUDA
      ``exp2(ceil(log2 s))``: for s a few fp32 ulps above a power of two, fl(log2 s) rounds to the integer, so the
      scale rounds **down** and |x/s| can exceed T by ≤ 2^-16 relative, then clamps; docs/engine-numerics.md §7);
      ``"ceil_bits"`` s = 2^(e + (mantissa ≠ 0)) on the fp32 bits with the biased exponent clamped to [1, 254]
      (DeepGEMM ``ceil_to_ue8m0``, SGLang UE8M0): zero and subnormal scales give 2^-126, and an inf or NaN scale
      (biased exponent 255, plus 1 for NaN's mantissa) gives 2^127; ``"floor_multiplier"`` TE: the multiplier m = fl(T/amax') has its
      mantissa bits zeroed (rounded down to a power of two) and s = 1/m (needs ``scale_op="recip_multiplier"``).
    * ``scale_op``: ``"div"`` s = fl(amax'/T); ``"mul_recip_max"`` s = fl(amax'·fl(1/T)) (1 fp32 ulp from "div" in
      ~49 % of groups, docs/engine-numerics.md §7); ``"recip_multiplier"`` m = the multiplier (``multiplier_op``),
      s = fl32(1/m) (verl torch, torchao, TE, vLLM ``scaled_quantize``).
    * ``quant_op``: ``"div"`` q = fl(x/s); ``"mul_recip"`` q = fl(x·fl(1/s)); ``"mul_max_over_amax"`` q = fl(x·m)
      with m the multiplier computed from the amax (SGLang JIT, TE, torchao, verl torch); for pow2 policies m = 1/s
      exactly.
    * ``clamp``: clamp q to ±T before the cast (NaN stays NaN).
    * ``zero_amax``: what a zero (or non-finite) amax gives: ``"floor"`` the floor rule (needs ``floor != "none"``
      and eps > 0); ``"one"`` scale 1 and multiplier 1 when amax' is 0, ±inf or NaN (TE ``compute_scale_from_amax``);
      ``"one_zero_inf"`` the same for 0 and ±inf only, a NaN amax stays NaN (verl ``_scaled_fp8_blockwise_pytorch``:
      ``where(max_abs == 0 | max_abs == inf, 1, m)``); ``"one_zero_nan"`` the same for 0 and NaN only, an inf amax
      gives m = T/inf = 0 and s = 1/0 = inf (transformers ``where(max_abs > 0, m, 1)``); ``"nan"`` unguarded: s = 0
      and 0/0 → NaN codes (DeepSeek reference kernel, vLLM per-tensor CUDA — whose ``fminf(NaN, 448)`` is predicted
      to store +448 instead, docs/engine-numerics.md §2.1); ``"scale_dtype_eps"`` no floor, and a scale that is
      exactly 0 after every other step — a zero amax, or one whose quotient amax/T underflows to 0 in D — becomes
      s = finfo(D).eps, with D the dtype of the scale arithmetic (the input dtype under ``compute_dtype="input"`` or
      ``"scale_input"``, else fp32): 2^-7 for bf16, 2^-10 for fp16, 2^-23 for fp32; no other scale changes, so a NaN amax keeps
      s = NaN and an inf amax s = inf (compressed-tensors ``calculate_qparams`` step 5, ``_get_dtype_eps``; needs
      ``floor="none"``, and a quant op that uses s: ``"div"`` or ``"mul_recip"``).
    * ``overflow``: the cast's overflow policy for values that still overflow (no clamp, or ±inf with clamp off).
    * ``compute_dtype``: ``"fp32"`` every scale, multiplier and quotient operation is an fp32 operation (the input is
      upcast exactly); ``"input"`` for a bf16 or fp16 input each of them is rounded to the input dtype:
      R(v) = round-to-nearest-even of v to the input dtype, and every step is R(fp32 op) — amax' = R(max(amax,
      fl32(eps))), s = R(amax'/T), m = R(T/amax'), q = R(x/s) (or R(x·R(1/s)), R(x·m)), clamp(q, -T, T) — which is
      the correctly rounded bf16/fp16 result, as 24 ≥ 2p + 2 makes the double rounding innocuous. The returned scale
      is the fp32 value of the input-dtype s; with ``scale_op="recip_multiplier"`` it is fl32(1/m) of the
      input-dtype m (vLLM ``scale.float().reciprocal()``). SGLang's ``_native_dynamic_per_token_quant_fp8`` /
      ``_native_dynamic_per_tensor_quant_fp8`` and vLLM's ``scaled_quantize`` / ``input_to_float8`` compute so.
      ``"scale_input"``: the scale side (amax', s, m, R(1/s)) is rounded to the input dtype as under ``"input"``, the
      quotient is not: q = fl32(x/s) (or fl32(x·R(1/s)), fl32(x·m)) of the exactly upcast x and the input-dtype s
      (torchao ``_choose_scale_float8`` divides the bf16 amax by 448 in bf16, ``_quantize_affine_float8`` upcasts x
      to fp32 before dividing). fp32 inputs are unaffected.
    * ``multiplier_op``: how the multiplier m of ``scale_op="recip_multiplier"`` / ``quant_op="mul_max_over_amax"``
      is formed: ``"div"`` m = fl(T/amax') (one rounding); ``"recip_mul"`` m = fl(fl(1/amax')·T) (two roundings:
      torch's ``T / t`` for a Python number T is ``t.reciprocal() * T``; vLLM ``scaled_quantize``,
      ``input_to_float8``, SGLang ``input_to_float8``, transformers ``Fp8Quantize``).
    * ``multiplier_overflow``: what replaces a multiplier that overflows to +inf (a finite amax' > 0 below
      T/max-finite): ``"flt_max"`` FLT_MAX; ``"input_max"`` the input dtype's max finite value (FLT_MAX, 3.3895e38
      for bf16, 65504 for fp16: TransformerEngine's blockwise quantizer, ``value_for_inf``; invisible after
      ``floor_multiplier``, which makes both 2^127); ``"inf"`` nothing: m = inf, s = 1/inf = 0, q = x·inf (verl torch,
      transformers).
    * ``floor_order``: with ``floor="scale"`` and ``pow2`` ∈ {ceil_log2, ceil_bits}: ``"floor_then_pow2"`` s =
      pow2(max(s, eps)) (always a power of two; vLLM 0.33.0 ``_quantize_group_native``); ``"pow2_then_floor"`` s =
      max(pow2(s), eps) (a group below the floor gets the non-power-of-two eps; vLLM ≤ 0.32.0).
    * ``description``: free text, where the policy comes from (shown by ``fp8rl presets``); not compared: two
      policies that differ only in it are equal.
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
    zero_amax: Literal["floor", "one", "one_zero_inf", "one_zero_nan", "nan", "scale_dtype_eps"] = "floor"
    overflow: OverflowPolicy = "saturate"
    compute_dtype: Literal["fp32", "input", "scale_input"] = "fp32"
    multiplier_op: Literal["div", "recip_mul"] = "div"
    multiplier_overflow: Literal["flt_max", "input_max", "inf"] = "flt_max"
    floor_order: Literal["floor_then_pow2", "pow2_then_floor"] = "floor_then_pow2"
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
        if self.zero_amax == "scale_dtype_eps" and (self.floor != "none" or self.quant_op == "mul_max_over_amax"):
            raise ValueError("zero_amax: 'scale_dtype_eps' replaces a scale that is exactly 0, so it needs "
                             "floor='none' (a floor keeps every scale above 0) and a quant_op that uses the scale "
                             f"('div' or 'mul_recip'), got floor={self.floor!r}, quant_op={self.quant_op!r}")
        check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        check_choice("multiplier_op", self.multiplier_op, MULTIPLIER_OPS)
        check_choice("multiplier_overflow", self.multiplier_overflow, MULTIPLIER_OVERFLOWS)
        check_choice("floor_order", self.floor_order, FLOOR_ORDERS)
        if self.floor_order == "pow2_then_floor" and (self.floor != "scale" or self.pow2 not in ("ceil_log2",
                                                                                                 "ceil_bits")):
            raise ValueError("floor_order: 'pow2_then_floor' orders a scale floor after power-of-two rounding, so it "
                             "needs floor='scale' and pow2 'ceil_log2' or 'ceil_bits', got "
                             f"floor={self.floor!r}, pow2={self.pow2!r}")
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

