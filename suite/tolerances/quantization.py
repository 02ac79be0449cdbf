"""Tolerances of area quantization (scaled FP8 casts): the element round trip, its input-dtype slack, re-quantized
scales and UE8M0 (power-of-two) scale rounding.
"""

from __future__ import annotations

from fp8rl.reference.bounds import MIN_SUBNORMAL, UNIT_ROUNDOFF, eval_slack
from fp8rl.reference.bounds import dtype_name as _dtype_name

from ._registry import _register

QUANT_ROUNDTRIP_FP32_SLACK = _register(
    "quant_roundtrip_fp32_slack",
    8 * 2.0**-24,
    "Relative slack of quant_roundtrip_bound for the fp32 arithmetic around the FP8 rounding. The quantized value "
    "is computed as q = fl(x/s), fl(x·fl(1/s)) or fl(x·m) with m = fl(T/amax) and s from amax by ≤ 2 fp32 "
    "roundings, so |q − x/s| ≤ γ_4(u32)·|x/s| (4 roundings, u32 = 2^-24) — for pow2 scales only 1. The clamp to "
    "±T moves q toward x/s when |x/s| ≤ T. The dequantized value is rounded once to fp32 (u32·|x̂|). Collecting "
    "terms: total extra ≤ (γ_4 + γ_4·2^-(m+1) + u32·(1 + 2^-(m+1)) + …)·|x| ≤ 5.9·u32·|x| (+ u32·½·min_sub·s), "
    "rounded up to 8·u32·(|x| + ½·min_sub·s).",
)

QUANT_ROUNDTRIP = _register(
    "quant_roundtrip",
    2.0**-4,
    "Round trip of one element through scaled FP8 quantization (value: the relative part 2^-(m+1) for e4m3fn, "
    "m = 3 mantissa bits; the elementwise function is quant_roundtrip_bound(x_abs, scale, fmt)). For a dequant "
    "scale s, target max T and r = x/s: RNE to a format with m mantissa bits has |RNE(r) − r| ≤ 2^-(m+1)·|r| in the "
    "normal range (half an ulp, ulp ≤ 2^-m·|r|) and ≤ ½·min_subnormal in the subnormal range, hence "
    "|x − s·RNE(r)| ≤ max(2^-(m+1)·|x|, ½·min_subnormal·s) for |r| ≤ T. Beyond T the value saturates exactly at "
    "±T·s (clamp, or a saturating cast of a value within one ulp of T), so the error is |x| − T·s plus the in-range "
    "bound at T. Plus the fp32 slack 'quant_roundtrip_fp32_slack' (the arithmetic before the cast and the fp32 "
    "rounding of the dequantized value):  bound = max(2^-(m+1)·min(|x|, T·s), ½·min_sub·s) + max(0, |x| − T·s) "
    "+ 8·u32·(|x| + ½·min_sub·s). Holds for every ScalePolicy preset (any scale_op/quant_op/pow2) and any s > 0 "
    "given with quantize_with_scale, for finite x, under three preconditions: (a) s is a normal fp32 number or a "
    "power of two (a subnormal non-pow2 scale, reachable only without an amax floor for amax < 448·2^-126 — e.g. "
    "verl torch path, s = fl(1/m) — loses relative accuracy in s itself); (b) values beyond T are clamped or "
    "saturated (clamp=True, or overflow='saturate' with T = max finite); (c) the dequantized value is taken exactly "
    "(fp64) or does not overflow fp32 (|x| ≈ FLT_MAX can round up to 2^128 = inf in an fp32 dequant).",
)


def quant_roundtrip_bound(x_abs, scale, fmt, target_max: float | None = None):
    """Elementwise bound on |x − dequant(quant(x))| (derivation: ``TOLERANCES['quant_roundtrip']``).

    ``x_abs``: |x| (tensor), ``scale``: the dequant scale broadcast to x's shape (tensor), ``fmt``: element format
    name, ``target_max``: T (None → the format's max finite). Returns an fp64 tensor of x's shape.
    """
    import torch
    from fp8rl.reference.formats import get_format

    f = get_format(fmt)
    t = float(target_max) if target_max is not None else f.max_finite
    xa = torch.as_tensor(x_abs).to(torch.float64).abs()
    s = torch.as_tensor(scale).to(torch.float64)
    ts = t * s
    half_sub = 0.5 * f.min_subnormal * s
    inrange = torch.maximum(2.0 ** -(f.man_bits + 1) * torch.minimum(xa, ts), half_sub)
    bound = inrange + torch.clamp(xa - ts, min=0.0) + QUANT_ROUNDTRIP_FP32_SLACK.value * (xa + half_sub)
    return bound * eval_slack(0)


QUANT_ROUNDTRIP_INPUT_DTYPE_SLACK = _register(
    "quant_roundtrip_input_dtype_slack",
    3.0,
    "Extra slack of the quantization round trip ('quant_roundtrip') for a bf16/fp16 input x quantized under a "
    "policy with compute_dtype='input', where the quotient q is rounded to the input dtype D before the FP8 cast "
    "(value: the factor on u_D, the unit roundoff of D: 2^-8 bf16, 2^-11 fp16; the elementwise function is "
    "quant_roundtrip_input_dtype_bound(x_abs, scale, fmt, input_dtype)). The returned scale s is the one the "
    "quotient used (the fp32 value of the D-rounded scale, or s = fl32(1/m) of the multiplier m used), so only q's "
    "own roundings add: q = R_D(x/s) (one rounding: fl32 then R_D is correctly rounded, 24 ≥ 2p + 2), "
    "R_D(x·R_D(1/s)) (two), or R_D(x·m) with x·m = (x/s)(1 + δ), |δ| ≤ u32 (one, plus u32). Hence "
    "|q − x/s| ≤ γ·|x/s| + ½·min_sub_D with γ = 2·u_D + u_D² (the absolute term for q in D's subnormal range). "
    "The clamp to ±T moves q toward x/s when |x/s| ≤ T (a q rounded above T clamps to T, within |q − x/s|). The "
    "FP8 rounding of q adds ≤ 2^-(m+1)·|q| (≤ ½·min_sub_fp8 in its subnormal range) with |q| ≤ (1 + γ)·|x/s| + "
    "½·min_sub_D, so |x − s·RNE(q)| ≤ quant_roundtrip_bound(x) + (1 + 2^-(m+1))·(γ·|x| + ½·min_sub_D·s); with "
    "m ≥ 2 (e5m2) and u_D ≤ 2^-8, (1 + 2^-3)·(2 + 2^-8)·u_D ≤ 2.26·u_D, rounded up to 3·u_D·|x| + min_sub_D·s. "
    "Under compute_dtype='scale_input' (q = fl32 of the exactly upcast x) and for fp32 inputs the plain "
    "quant_roundtrip bound holds. Measured (seeded data spanning ±8 binades, 20 seeds × 5 granularities, presets "
    "compressed_tensors_fp8, sglang_native, vllm_scaled_quantize): the largest excess over quant_roundtrip_bound "
    "is 0.99·u_D·|x| (bf16) and 0.89·u_D·|x| (fp16) — double rounding of x/s at an FP8 tie.",
)


def quant_roundtrip_input_dtype_bound(x_abs, scale, fmt, input_dtype, target_max: float | None = None):
    """Elementwise bound on |x − dequant(quant(x))| for a policy whose quotient is rounded to the input dtype
    (``compute_dtype="input"``; derivation: ``TOLERANCES['quant_roundtrip_input_dtype_slack']``):
    :func:`quant_roundtrip_bound` plus 3·u_D·|x| + min_sub_D·s for a bf16/fp16 ``input_dtype`` D (torch dtype or
    name); the plain round-trip bound for fp32. Returns an fp64 tensor of x's shape.
    """
    import torch

    base = quant_roundtrip_bound(x_abs, scale, fmt, target_max)
    name = _dtype_name(input_dtype)
    if name in ("float32", "float64"):
        return base
    xa = torch.as_tensor(x_abs).to(torch.float64).abs()
    s = torch.as_tensor(scale).to(torch.float64)
    extra = QUANT_ROUNDTRIP_INPUT_DTYPE_SLACK.value * UNIT_ROUNDOFF[name] * xa + MIN_SUBNORMAL[name] * s
    return base + extra * eval_slack(0)


REQUANT_SCALE_ULPS = _register(
    "requant_scale_ulps",
    1.0,
    "Re-quantizing the fp32 dequantized tensor (quantize(dequantize(q))) with a policy whose scale is not "
    "s = fl(amax/T) changes a group's scale by at most 1 fp32 ulp: the max element dequantizes to fl(T·s) = "
    "T·s·(1+δ), |δ| ≤ 2^-24, and the scale formula (≤ 2 roundings: amax·fl(1/T) or 1/fl(T/amax)) maps it back within "
    "(1 ± 2^-24)^3, i.e. to s or a neighbour. Measured exhaustively over a binade (T = 448): 'mul_recip_max' "
    "changes 45.8 % of scales, 'recip_multiplier' 6.8 %; 'div' none (fl(fl(T·s)/T) = s for every s = fl(a/T)), "
    "which is why 'div' policies are checked bit-exactly.",
)

UE8M0_CEIL_LOG2_OVERSHOOT = _register(
    "ue8m0_ceil_log2_overshoot",
    2.0**-16,
    "pow2='ceil_log2' computes 2^ceil(fl(log2 s)) in fp32. When fl(log2 s) rounds to an integer k while s > 2^k "
    "the scale is rounded *down*: with log2 accurate to 1 ulp, that needs log2 s − k ≤ ulp(k) ≤ 2^-16 (|log2 s| "
    "< 256 for any fp32 s), so s/2^k ≤ 2^(2^-16) < 1 + 2^-16 and |x/s| ≤ T·(1 + 2^-16) before the clamp "
    "(docs/engine-numerics.md §7 measures s = 2^-8·(1+2^-23) → 2^-8).",
)
