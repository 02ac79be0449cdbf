"""The one tolerance table of fp8rl.

Every bound used anywhere in the suite (conformance checks, the suite's own tests, perf gates) is defined here,
with its derivation. Nothing else in the code base hard-codes a tolerance: code asks this module by name.

Two kinds of entries:

* constants (``Tolerance``): a number plus the derivation of why that number;
* bound functions: a pure function of the inputs (shapes, magnitudes, formats) returning an elementwise bound,
  whose docstring is the derivation.

Unit roundoff notation: for a binary floating-point format with p significand bits (implicit bit included),
u = 2^-p is the maximal relative error of round-to-nearest; fp32 p = 24, bf16 p = 8, fp16 p = 11, fp64 p = 53.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: unit roundoff (round-to-nearest) of the formats used for accumulation/output
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}
#: smallest positive subnormal of each output/accumulation format (absolute underflow term)
MIN_SUBNORMAL: dict[str, float] = {
    "float64": 2.0**-1074,
    "float32": 2.0**-149,
    "bfloat16": 2.0**-133,
    "float16": 2.0**-24,
}


@dataclass(frozen=True)
class Tolerance:
    """A named bound and its derivation."""

    name: str
    value: float
    derivation: str

    def __float__(self) -> float:
        return self.value


TOLERANCES: dict[str, Tolerance] = {}


def _register(name: str, value: float, derivation: str) -> Tolerance:
    if name in TOLERANCES:
        raise ValueError(f"tolerance {name!r} defined twice")
    t = Tolerance(name, float(value), derivation)
    TOLERANCES[name] = t
    return t


def get(name: str) -> Tolerance:
    """Look a tolerance up by name (KeyError lists the known names)."""
    try:
        return TOLERANCES[name]
    except KeyError:
        raise KeyError(f"unknown tolerance {name!r}; known: {sorted(TOLERANCES)}") from None


def gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 − n·u) (Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1).

    |Π_{i≤n}(1+δ_i)^{±1} − 1| ≤ γ_n when every |δ_i| ≤ u and n·u < 1. Recursive summation of n terms in a
    format with unit roundoff u, in any order, has |fl(Σx) − Σx| ≤ γ_{n−1}·Σ|x| (Higham eq. 4.4).
    """
    if n * u >= 1:
        return math.inf
    return n * u / (1 - n * u)


# ---------------------------------------------------------------------------------------------------------------
# Exact comparisons (bit-exact checks) — recorded so the table is complete.
EXACT = _register(
    "exact",
    0.0,
    "Bit-exact: the spec fixes the result (an FP8 cast with a declared rounding/overflow policy, codes and scales "
    "given a ScalePolicy). Any difference is a bug or an undeclared policy.",
)

# ---------------------------------------------------------------------------------------------------------------
# Foundation (formats, quantization, GEMM) entries are added below this line.

#: largest finite value of each output/accumulation format (a result beyond it rounds to inf: no bound holds)
MAX_FINITE: dict[str, float] = {
    "float64": 1.7976931348623157e308,
    "float32": 3.4028234663852886e38,
    "bfloat16": 3.3895313892515355e38,
    "float16": 65504.0,
}


def _dtype_name(dtype) -> str:
    """'float32' for torch.float32 / 'float32' / numpy float32 (KeyError-free names of UNIT_ROUNDOFF)."""
    name = str(dtype).replace("torch.", "")
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {sorted(UNIT_ROUNDOFF)}, got {dtype!r}")
    return name


BOUND_EVAL_SLACK = _register(
    "bound_eval_slack",
    8,
    "Bounds are evaluated in fp64 floating point, so the computed number must be inflated to stay rigorous. A "
    "bound built from a sum S = Σ_{k≤n} p_k of n non-negative fp64 terms, each a product of ≤ 4 factors, and ≤ 4 "
    "further operations has computed value B̂ = B·(1+θ), |θ| ≤ γ_{n+8}(2^-53) (Higham Lemma 3.1; value: the 8 extra "
    "operations). Multiplying B̂ by eval_slack(n) = 1 + 2·γ_{n+8}(2^-53) ≥ 1/(1 − γ_{n+8}) gives a number ≥ B. "
    "For n = 0 (elementwise bounds) the factor is 1 + 1.8e-15.",
)


def eval_slack(n: int = 0) -> float:
    """1 + 2·γ_{n+8}(2^-53): inflation of a bound evaluated in fp64 from n-term sums (``bound_eval_slack``)."""
    return 1 + 2 * gamma(int(n) + int(BOUND_EVAL_SLACK.value), UNIT_ROUNDOFF["float64"])


# ---- quantization ------------------------------------------------------------------------------------------------

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
    "given with quantize_with_scale, for finite x.",
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
    "(engines.md §7 measures s = 2^-8·(1+2^-23) → 2^-8).",
)

# ---- GEMM --------------------------------------------------------------------------------------------------------

GEMM_FP32_PRODUCT_ROUNDINGS = _register(
    "gemm_fp32_product_roundings",
    3,
    "c: fp32 roundings a single product term a_k·w_k may undergo before it enters the K-sum in gemm_fp32_accum: "
    "dequantize-then-matmul rounds code·s_a, code·s_w and their product (3); per-block-scale kernels (Triton "
    "w8a8_block_scaled_mm, TE split accumulation) form code products exactly (≤ 8-bit significands), sum a "
    "K-tile in fp32 (covered by the K term) and multiply the tile sum by s_a and s_w (2).",
)


def gemm_fp32_accum_bound(abs_y_exact, sum_abs_products, k: int, out_dtype="float32", accum_dtype="float32",
                          underflow_mass=0.0):
    """Rigorous elementwise bound on |y_impl − y_exact| for a scaled FP8 GEMM (``TOLERANCES['gemm_fp32_accum']``).

    ``abs_y_exact``: |y| exact (fp64 tensor), ``sum_abs_products``: Σ_k |a_k|·|w_k| of the exact dequantized
    operands, ``k``: the reduction length, ``underflow_mass``: Σ_k max(1,|q_a|)·max(1,|q_w|)·max(1,s_a)·max(1,s_w)
    (q: FP8 values, s: scales; 0 to ignore underflow). Returns an fp64 tensor; inf where the result can overflow
    ``out_dtype``.
    """
    import torch

    acc = _dtype_name(accum_dtype)
    out = _dtype_name(out_dtype)
    c = int(GEMM_FP32_PRODUCT_ROUNDINGS.value)
    u = UNIT_ROUNDOFF[acc]
    y = torch.as_tensor(abs_y_exact).to(torch.float64).abs()
    s = torch.as_tensor(sum_abs_products).to(torch.float64)
    g = gamma(int(k) + c, u)
    acc_err = g * s + c * MIN_SUBNORMAL[acc] * torch.as_tensor(underflow_mass, dtype=torch.float64)
    if out != acc:
        total = acc_err + UNIT_ROUNDOFF[out] * (y + acc_err) + MIN_SUBNORMAL[out] / 2
    else:
        total = acc_err
    total = total * eval_slack(int(k))
    overflow = (y + acc_err) >= min(MAX_FINITE[out], MAX_FINITE[acc])
    return torch.where(overflow, torch.full_like(total, math.inf), total)


GEMM_FP32_ACCUM = _register(
    "gemm_fp32_accum",
    GEMM_FP32_PRODUCT_ROUNDINGS.value,
    "Scaled FP8 GEMM y = Σ_k a_k·w_k (a_k = q_a·s_a, w_k = q_w·s_w exact dequantized values) computed by ANY "
    "implementation that (i) forms each product term with at most c = 3 fp32 roundings "
    "('gemm_fp32_product_roundings'; value: c), (ii) accumulates the K terms in fp32 in any order and grouping "
    "(tiles, split-K, pairwise, FMA), (iii) rounds once to out_dtype. Standard model fl(a∘b) = (a∘b)(1+δ), "
    "|δ| ≤ u32 = 2^-24: every term reaches the accumulator multiplied by a product of at most c roundings, and "
    "any summation tree of K terms multiplies each term by at most K−1 further (1+δ) factors (Higham, Accuracy "
    "and Stability, §4.2: |fl(Σ) − Σ| ≤ γ_{K−1}·Σ|x|); with the (at most 1) tile-sum-times-scale regrouping that "
    "is ≤ K + c factors in all, so by Higham Lemma 3.1  |acc − y| ≤ γ_{K+c}(u32)·Σ_k|a_k||w_k|. Gradual underflow "
    "adds an absolute error ≤ η32/2 (η32 = 2^-149) per multiplication, later multiplied by the remaining factors "
    "(each ≤ max(1,|factor|)): ≤ c·η32·Σ_k max(1,|q_a|)·max(1,|q_w|)·max(1,s_a)·max(1,s_w); additions of "
    "subnormals are exact. The final rounding to out_dtype adds u_out·|acc| + η_out/2 ≤ u_out·(|y| + acc_err) + "
    "η_out/2 (omitted when out_dtype is the accumulator dtype). Total: gemm_fp32_accum_bound(). Implementations "
    "that round dequantized operands to bf16/fp16, or accumulate with fewer than 24 significand bits (Hopper FP8 "
    "WGMMA without promotion, ~14 bits), are outside the model — the bound is meant to catch them.",
)

FP64_GEMM_AGREEMENT = _register(
    "fp64_gemm_agreement",
    2,
    "Agreement of two fp64 evaluations of the same scaled FP8 GEMM (block_gemm_exact vs an fp64 matmul of the "
    "exactly dequantized operands). Each is within γ_{K+3}(2^-53)·Σ|a_k||w_k| of the exact value (block_gemm_exact: "
    "exact integer partial sums, ≤ 3 fp64 roundings when a partial sum is split into 16-bit limbs, 1 for the scale "
    "product, nseg−1 ≤ K−1 for the sum over K segments; fp64 matmul: 1 per product + K−1 additions; fp64 products "
    "of FP8·fp32 values cannot underflow: |a_k w_k| ≥ 2^-332 or 0). Value: the factor 2 in "
    "fp64_gemm_agreement_bound = 2·γ_{K+3}(2^-53)·Σ|a||w|.",
)


def fp64_gemm_agreement_bound(sum_abs_products, k: int):
    """|y_1 − y_2| bound for two fp64 evaluations of one scaled FP8 GEMM (``TOLERANCES['fp64_gemm_agreement']``)."""
    import torch

    s = torch.as_tensor(sum_abs_products).to(torch.float64)
    return FP64_GEMM_AGREEMENT.value * gamma(int(k) + 3, UNIT_ROUNDOFF["float64"]) * s * eval_slack(int(k))
