"""The one tolerance table of fp8rl.

Every bound used anywhere in the suite (conformance checks, the suite's own tests, perf gates) is defined here,
with its derivation. Nothing else in the code base hard-codes a tolerance: code asks this module by name.

Two kinds of entries:

* constants (``Tolerance``): a number plus the derivation of why that number;
* bound functions: a pure function of the inputs (shapes, magnitudes, formats) returning an elementwise bound,
  whose docstring is the derivation.

The formulas the oracle itself needs (unit roundoffs, γ_n, eval_slack, the GEMM error bound) live in
:mod:`fp8rl.reference.bounds` (the oracle imports nothing from the harness); this module imports them and registers
their named entries with the derivations, so it stays the one place where named bounds and derivations live.

Unit roundoff notation: for a binary floating-point format with p significand bits (implicit bit included),
u = 2^-p is the maximal relative error of round-to-nearest; fp32 p = 24, bf16 p = 8, fp16 p = 11, fp64 p = 53.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fp8rl.reference.bounds import (  # noqa: F401  (re-exported: tolerances.gamma, tolerances.UNIT_ROUNDOFF, ...)
    EVAL_SLACK_EXTRA_OPS,
    GEMM_PRODUCT_ROUNDINGS,
    MAX_FINITE,
    MIN_SUBNORMAL,
    UNIT_ROUNDOFF,
    eval_slack,
    gamma,
    gemm_fp32_accum_bound,
)
from fp8rl.reference.bounds import dtype_name as _dtype_name


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

BOUND_EVAL_SLACK = _register(
    "bound_eval_slack",
    EVAL_SLACK_EXTRA_OPS,
    "Bounds are evaluated in fp64 floating point, so the computed number must be inflated to stay rigorous. A "
    "bound built from a sum S = Σ_{k≤n} p_k of n non-negative fp64 terms, each a product of ≤ 4 factors, and ≤ 4 "
    "further operations has computed value B̂ = B·(1+θ), |θ| ≤ γ_{n+8}(2^-53) (Higham Lemma 3.1; value: the 8 extra "
    "operations). Multiplying B̂ by eval_slack(n) = 1 + 2·γ_{n+8}(2^-53) ≥ 1/(1 − γ_{n+8}) gives a number ≥ B. "
    "For n = 0 (elementwise bounds) the factor is 1 + 1.8e-15. Formula: fp8rl.reference.bounds.eval_slack.",
)


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

# ---- GEMM --------------------------------------------------------------------------------------------------------

GEMM_FP32_PRODUCT_ROUNDINGS = _register(
    "gemm_fp32_product_roundings",
    GEMM_PRODUCT_ROUNDINGS,
    "c: fp32 roundings a single product term a_k·w_k may undergo before it enters the K-sum in gemm_fp32_accum: "
    "dequantize-then-matmul rounds code·s_a, code·s_w and their product (3); per-block-scale kernels (Triton "
    "w8a8_block_scaled_mm, TE split accumulation) form code products exactly (≤ 8-bit significands), sum a "
    "K-tile in fp32 (covered by the K term) and multiply the tile sum by s_a and s_w (2).",
)


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
    "η_out/2 (omitted when out_dtype is the accumulator dtype). Total: fp8rl.reference.bounds.gemm_fp32_accum_bound(). "
    "Implementations that round dequantized operands to bf16/fp16, or accumulate with fewer than 24 significand bits (Hopper FP8 "
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


# ---- microscaling (MXFP8, MXFP4, NVFP4: fp8rl.reference.microscaling) --------------------------------------------

MX_ROUNDTRIP = _register(
    "mx_roundtrip",
    8 * 2.0**-24,
    "Round trip of one element through a microscaling quantizer (value: the fp32 slack 8·u32; the elementwise "
    "function is mx_roundtrip_bound(q, x)). Each block has an exact dequant multiplier S: 2^e (E8M0, MX) or "
    "s/g (NVFP4: E4M3 block scale s over the fp32 global encode scale g). The engine computes y = x/S with at most "
    "4 fp32 roundings (NVFP4 'recip_decoded': fl(1/g), fl(s·(1/g)), fl(1/·), fl(x·); MX: 1, a division by a power "
    "of two), so |y − x/S| ≤ γ_4(u32)·|x/S|. Rounding y to the element grid (m mantissa bits: 3 e4m3fn, 2 e5m2, "
    "1 e2m1; T = 448, 57344, 6) moves it by ≤ 2^-(m+1)·|y| in the normal range and ≤ ½·min_subnormal (2^-10, "
    "2^-17, 0.5) in the subnormal range; beyond T the value saturates to T (clamp, or a saturating cast), an error "
    "of |y| − T — the whole top binade under the OCP floor rule (amax/2^e up to 2^(emax+1): e4m3 511.9 → 448), "
    "and up to 1/(1 − 2^-4) − 1 of T for NVFP4, whose E4M3 block scale is rounded to nearest and may round down. "
    "Dequantized exactly (fp64): |x − S·RNE(y)| ≤ max(2^-(m+1)·min(|x|, T·S), ½·min_sub·S) + max(0, |x| − T·S) "
    "+ 8·u32·(|x| + ½·min_sub·S) (γ_4·(1 + 2^-(m+1)) < 5·u32 rounded up to 8·u32), times eval_slack(0). A block "
    "whose NVFP4 scale rounds to 0 (amax_b·g/6 < 2^-10) must have all codes 0: its error is exactly |x|, the "
    "bound there. A subnormal E4M3 scale may round down by up to 1/3 (s_raw ∈ [2^-10, 1.5·2^-9) → 2^-9 or "
    "below): the saturation term max(0, |x| − T·S) with the actual S covers it.",
)

MX_GEMM_PRODUCT_ROUNDINGS = _register(
    "mx_gemm_product_roundings",
    7,
    "c for microscaled GEMMs: roundings one product term ã_k·w̃_k may undergo before it enters the fp32 K-sum. "
    "Two-level scales (NVFP4) dequantized then multiplied: per operand fl(1/g), fl(s·(1/g)) and fl(q·S) (3), twice, "
    "plus the product: 7. A block-scaled tensor-core kernel needs fewer: E2M1·E2M1 products (multiples of 1/4, "
    "≤ 36) and their 16-term block sums are exact, E4M3·E4M3 (or E8M0·E8M0) scale products are exact in fp32 "
    "(≤ 8-bit significands, exponents within ±36), and the global factor α = 1/(g_a·g_w) costs ≤ 3 roundings "
    "(two reciprocals and a product) plus 1 for α·acc — the regrouping the K-sum term allows, as in "
    "gemm_fp32_accum. MX (E8M0) operands: S = 2^e is exact, so 3 suffice; 7 covers both.",
)

MX_GEMM_FP32 = _register(
    "mx_gemm_fp32",
    MX_GEMM_PRODUCT_ROUNDINGS.value,
    "Microscaled GEMM y = Σ_k ã_k·w̃_k (ã = q_a·S_a exact dequantized values, S = 2^e or s/g) by any "
    "implementation with ≤ c = 7 roundings per product term ('mx_gemm_product_roundings'), fp32 accumulation in "
    "any order and grouping, and one rounding to out_dtype: the derivation of gemm_fp32_accum with c = 7 "
    "(Higham Lemma 3.1, §4.2): |acc − y| ≤ γ_{K+7}(2^-24)·Σ_k|ã_k||w̃_k| + 7·2^-149·Σ_k max(1,|q_a|)·max(1,|q_w|)"
    "·max(1,S_a)·max(1,S_w), then + u_out·(|y| + acc_err) + η_out/2, times eval_slack(K). Forgetting the global "
    "scale multiplies y by g_a·g_w (≈ 10^5 for unit-scale data), applying a 32-element scale to a 16-element "
    "block changes y by up to a factor 1/(1 − 2^-4) per term; both are far outside. Formula: "
    "fp8rl.reference.microscaling.mx_gemm_error_bound.",
)


def mx_roundtrip_bound(q, x):
    """Elementwise bound on |x − dequantize_mx(q)| (``TOLERANCES['mx_roundtrip']``); q an MXTensor of x."""
    import torch
    from fp8rl.reference import microscaling as mx
    from fp8rl.reference.formats import get_format

    p = q.policy
    if p.elem == "e2m1":
        man, min_sub = 1, 0.5
    else:
        man, min_sub = get_format(p.elem).man_bits, get_format(p.elem).min_subnormal
    t = mx.ELEMENT_MAX[p.elem]
    k = q.shape[-1]
    s = q.scale_values().repeat_interleave(p.block, dim=-1)[..., :k]
    xa = torch.as_tensor(x).to(torch.float64).abs()
    ts = t * s
    half_sub = 0.5 * min_sub * s
    inrange = torch.maximum(2.0 ** -(man + 1) * torch.minimum(xa, ts), half_sub)
    bound = inrange + torch.clamp(xa - ts, min=0.0) + MX_ROUNDTRIP.value * (xa + half_sub)
    if p.two_level:  # an NVFP4 block scale that rounded to 0 (amax_b·g/6 < 2^-10): every element dequantizes to 0
        bound = torch.where(s == 0, xa, bound)
    return bound * eval_slack(0)


# ---------------------------------------------------------------------------------------------------------------
# Rollout correction


CORR_EXP_ULPS = _register(
    "corr_exp_ulps",
    2,
    "Maximal error, in units of the unit roundoff u, of the engine's exp() of an fp32 argument (value: 2): glibc "
    "expf and PyTorch's vectorized CPU/CUDA exp are within 1 ulp (≤ 2u relative); the 2 covers a 1-ulp library "
    "plus the rounding of its result. Used by every bound below.",
)

CORR_WEIGHT = _register(
    "corr_weight",
    CORR_EXP_ULPS.value,
    "IS weights of an engine computing in the log-probs' dtype (u = its unit roundoff) vs the float64 oracle "
    "(elementwise relative bound: corr_weight_rel_bound; value: the exp ulps). Inputs are exact in that dtype. "
    "(1) log weight: a token's δ = fl(lo − lr) has |Δδ| ≤ u·|δ|; a row sum of n such terms in any order has "
    "|ΔS| ≤ γ_n(u)·Σ_t|δ_t| (Higham eq. 4.4 with the n subtraction roundings); a row mean adds one division: "
    "≤ γ_{n+1}(u)·Σ_t|δ_t|/n. Call this E (corr_log_weight_err). (2) the ±20 clamp and min(·, U) are monotone "
    "and 1-Lipschitz in log space, so they do not increase E; U itself is rounded to the dtype (+u: a truncated "
    "weight is ≤ fl(U) ≤ U·(1+u), corr_rounded_threshold_max). (3) exp adds ≤ 2u relative "
    "(corr_exp_ulps). So |ŵ/w − 1| ≤ e^E·(1+2u)·(1+u) − 1. (4) batch normalization divides by μ̂, a mean of ≤ N "
    "positive weights (token level) or of B row means of ≤ T tokens (sequence level): |μ̂/μ − 1| ≤ r + "
    "γ_{N+B+2}(u)·(1+r) with r the largest weight bound of the batch, and the division adds u. IcePop "
    "keeps/zeroes a weight by "
    "comparing it to lo/hi: within corr_decision_band of a threshold the decision is ambiguous and such examples "
    "are discarded.",
)


def corr_log_weight_err(delta_abs, valid, level: str, dtype="float32"):
    """Bound on an engine's absolute error in the log IS weight, per element (``corr_weight`` step 1).

    ``delta_abs``: |δ| (B, T) of the exact log-ratios, ``valid``: (B, T) bool, ``level``: ``token`` (u·|δ_t|: the
    one rounding of fl(lo − lr), the log-probs being exact in the dtype), ``sequence`` (γ_n(u)·Σ_t|δ_t|: the n
    subtractions and n − 1 additions of a row sum in any order, Higham eq. 4.4) or ``geometric``
    (γ_{n+1}(u)·Σ_t|δ_t|/n: one more rounding for the division by the row length n). Returns fp64 (B, T),
    broadcast over the row for the row levels, inflated by eval_slack for its own fp64 evaluation.
    """
    import torch

    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    d = torch.as_tensor(delta_abs, dtype=torch.float64).abs()
    if level == "token":
        return u * d * eval_slack(0)
    if level not in ("sequence", "geometric"):
        raise ValueError(f"level: expected 'token', 'sequence' or 'geometric', got {level!r}")
    m = torch.as_tensor(valid).bool()
    n = m.sum(-1, keepdim=True).clamp_min(1)
    s = torch.where(m, d, 0.0).sum(-1, keepdim=True)
    extra = 0 if level == "sequence" else 1
    g = torch.tensor([gamma(int(k) + extra, u) for k in n.flatten().tolist()], dtype=torch.float64).reshape(n.shape)
    err = g * s if level == "sequence" else g * s / n
    return err.expand_as(d) * eval_slack(d.shape[-1] + 1)


def corr_rounded_threshold_max(threshold: float, dtype="float32") -> float:
    """The largest value a threshold T can take once rounded to ``dtype``: fl(T) ≤ T·(1 + u) (round to nearest;
    ``corr_weight`` step 2). A TIS weight min(ρ, fl(U)) is ≤ this for U."""
    return float(threshold) * (1 + UNIT_ROUNDOFF[_dtype_name(dtype)]) * eval_slack(0)


def corr_weight_rel_bound(log_err, norm_counts: tuple[int, int] | None = None, dtype="float32"):
    """Elementwise relative bound on IS weights (``TOLERANCES['corr_weight']``).

    ``log_err``: bound on the engine's absolute error in the log weight per element (corr_log_weight_err);
    ``norm_counts``: (N valid tokens, B rows) when the weights are batch-normalized, else None — μ̂ is a mean of
    ≤ N weights (token level) or of B row means (sequence levels), each within the largest weight bound r_max, so
    |μ̂/μ − 1| ≤ r_μ = r_max + γ_{N+B+2}(u)·(1 + r_max) (the N + B additions and divisions, with 2 to spare), and
    w/μ adds one division. Returns an fp64 tensor of relative bounds.
    """
    import torch

    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    e = torch.as_tensor(log_err, dtype=torch.float64)
    r = torch.exp(e) * (1 + CORR_EXP_ULPS.value * u) * (1 + u) - 1
    if norm_counts is not None:
        n_tokens, n_rows = norm_counts
        r_max = float(r.max()) if r.numel() else 0.0
        r_mu = r_max + gamma(int(n_tokens) + int(n_rows) + 2, u) * (1 + r_max)
        r = (1 + r) * (1 + r_mu) / (1 - r_mu) * (1 + u) - 1
    return r * eval_slack(0)


CORR_STAT = _register(
    "corr_stat",
    8,
    "Rejection-sampling statistics (k1 = δs, k2 = ½δs², k3 = e^δs − 1 − δs on δs = clamp(δ, ±20)) computed in "
    "the log-probs' dtype vs the float64 oracle: the absolute error per token is ≤ c·u·A_t with A_t = |δ|·(1+|δ|) "
    "for k1/k2 (δ's rounding u·|δ| propagated through ½δ², plus 2 roundings) and A_t = (e^δs + 1 + |δ|)·(2+|δ|) "
    "for k3 (exp's 2u and δ's u·|δ| amplified by e^δs, plus two subtractions), c = 8 (value) covering the ≤ 4 "
    "roundings per token with room. Row sums add γ_n(u)·Σ|k|; row means add one more rounding (γ_{n+1}, then the "
    "division by n); row max takes the max error (corr_stat_err). Decisions within corr_decision_band of a "
    "threshold (which adds the threshold's own rounding) are ambiguous and such examples are discarded; every "
    "other keep/reject decision must equal the oracle's.",
)


def corr_stat_err(delta, k_abs, valid, option: str, safety_bound: float, dtype="float32"):
    """Bound on an engine's absolute error in a rejection-sampling statistic (``corr_stat``), broadcast like it.

    ``delta``: exact δ (B, T), ``k_abs``: |k| per token of the option's statistic (k1/k2/k3 of the clamped δ),
    ``valid``: (B, T) bool, ``option``: an RS option (``token_k1`` … ``seq_max_k3``), ``safety_bound``: the ±clamp
    of δ before exp (20). Per token e_t = c·u·|δ|·(1 + |δ|) for k1/k2 and c·u·(e^δs + 1 + |δ|)·(2 + |δ|) for k3
    (c: the table value); ``seq_sum``: Σe_t + γ_n(u)·Σ|k|; ``seq_mean``: (Σe_t + γ_{n+1}(u)·Σ|k|)/n; ``seq_max``:
    max e_t. Returns fp64 (B, T).
    """
    import torch

    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    c = CORR_STAT.value
    d = torch.as_tensor(delta, dtype=torch.float64)
    m = torch.as_tensor(valid).bool()
    kind = option[-2:]
    if kind in ("k1", "k2"):
        e_t = c * u * d.abs() * (1 + d.abs())
    else:
        ds = d.clamp(-float(safety_bound), float(safety_bound))
        e_t = c * u * (torch.exp(ds) + 1 + d.abs()) * (2 + d.abs())
    e_t = torch.where(m, e_t, 0.0)
    if option.startswith("token_"):
        return e_t * eval_slack(0)
    n = m.sum(-1).clamp_min(1)
    k_sum = torch.where(m, torch.as_tensor(k_abs, dtype=torch.float64).abs(), 0.0).sum(-1)
    if option.startswith("seq_sum_"):
        g = torch.tensor([gamma(int(k), u) for k in n.tolist()], dtype=torch.float64)
        e = e_t.sum(-1) + g * k_sum
    elif option.startswith("seq_mean_"):
        g = torch.tensor([gamma(int(k) + 1, u) for k in n.tolist()], dtype=torch.float64)
        e = (e_t.sum(-1) + g * k_sum) / n
    elif option.startswith("seq_max_"):
        e = e_t.amax(-1)
    else:
        raise ValueError(f"option: expected token_/seq_sum_/seq_mean_/seq_max_ + k1/k2/k3, got {option!r}")
    return e.unsqueeze(-1).expand_as(d) * eval_slack(d.shape[-1])


CORR_DECISION_BAND = _register(
    "corr_decision_band",
    4,
    "Ambiguous band of a keep/reject decision that compares a computed value v with a threshold t: the IcePop "
    "keep and the IS fraction metrics (log IS weight vs log lo / log hi), rejection sampling (a k1 statistic vs "
    "log lo / log hi, a k2/k3 statistic vs U) and the veto (δ vs log τ). The engine computes v with an absolute "
    "error ≤ E (corr_log_weight_err, corr_stat_err; u·|δ| for δ) and decides in one of three ways: (a) v̂ against "
    "t rounded to the dtype: + u·|t|; (b) in log space against fl(log fl(T)) for a ratio threshold T = e^t: + u "
    "(T's rounding) + 2u·|t| (a log within 1 ulp ≤ 2u relative); (c) in ratio space, exp(v̂) against fl(T): "
    "+ 3u (corr_weight step 3: exp within corr_exp_ulps, its rounding) + u (T's rounding) = 4u in log space "
    "(value: 4, in units of u). So an engine decides as the exact comparison whenever |v − t| > E + 4u + 2u·|t|. "
    "The oracle evaluates v and t in fp64, the same operations with u64 = 2^-53 in place of u, i.e. within "
    "(u64/u)·(E + 2u·|t|) of the exact values, and the band itself is evaluated in fp64: the band is therefore "
    "inflated by 1 + 2·u64/u (1 + 2^-28 for fp32; before, an absolute 1e-12 stood for this term, which does not "
    "scale with long sums of large log-ratios). Examples with a valid token (token options, IS, veto) or row "
    "(sequence options) inside the band are ambiguous — either outcome is right — and are discarded.",
)


def corr_decision_band(value_err, threshold: float, dtype="float32"):
    """Half-width of the ambiguous band around a threshold (``corr_decision_band``): (E + 4u + 2u·|t|)·(1 +
    2·u64/u). ``value_err``: E, the engine's error bound on the compared value (tensor or float); ``threshold``: t
    in the space of the value (log lo / log hi for log weights and k1, U for k2/k3, log τ for the veto)."""
    import torch

    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    e = torch.as_tensor(value_err, dtype=torch.float64)
    band = e + CORR_DECISION_BAND.value * u + 2 * u * abs(float(threshold))
    return band * (1 + 2 * UNIT_ROUNDOFF["float64"] / u)


CORR_NORM_FACTOR_FLOOR = _register(
    "corr_norm_factor_floor",
    1e-6,
    "Screen of the batch-normalization checks, not an error bound: examples whose batch-normalization factor μ "
    "(the oracle's mean weight) is ≤ 1e-6 (value) are discarded. The division by μ is guarded by an epsilon "
    "decision (the oracle's NORM_EPS = 1e-8: μ ≤ 1e-8 → not normalized; veRL 0.9.1: `weights_mean > 1e-8`), and "
    "near it an engine may legitimately decide the other way. The engine's μ̂ is within r_μ of μ (corr_weight "
    "step 4; r_μ < 1e-3 for any drawn batch), so the derived minimum is NORM_EPS·(1 + r_μ) ≈ 1.001e-8; the value "
    "1e-6 = 100·NORM_EPS is a choice, not derived: it leaves room for engines whose epsilon is up to ~100× the "
    "oracle's. With the suite's strategies kept weights are ≥ e^-4 (TIS, |δ| ≤ 4) or ≥ e^-2.5 (IcePop lo), so "
    "0 < μ ≤ 1e-6 needs a sequence-level TIS batch whose rows all have Π ρ ≲ B·1e-6: the screen rarely "
    "discards anything (μ = 0, IcePop zeroing every weight, is reported as factor 1 and screened by the checks' "
    "own rule).",
)

CORR_METRIC = _register(
    "corr_metric",
    8,
    "Scalar mismatch metrics (KL k1/k3, perplexities, χ², ppl ratio, IS means/ESS, prob-space diffs) computed "
    "in the log-probs' dtype (u) vs the float64 oracle: each metric is an aggregation (means over ≤ N tokens and "
    "≤ B rows, at most 2 levels) of terms built from ≤ 4 exp/arith operations on δ, lo, lr. An operation on an "
    "argument with absolute error ε_a ≤ u·L (L = max over valid tokens of |lo| + |lr| + 2|δ|, the largest "
    "exp argument) contributes relative error ≤ (L+2)·u; the aggregation of terms of magnitude M (the same "
    "aggregation of the absolute values of the terms' parts, i.e. before cancellation) adds γ_{N+B+8}(u)·M. "
    "Bound (corr_metric_bound): (γ_{N+B+8}(u) + 8·(L+2)·u)·M. Value: the 8 (roundings per term, with room). M per "
    "metric: corr_metric_magnitudes (its docstring derives each). Fraction metrics (IS fractions, RS masked "
    "fractions) are compared only on examples without an ambiguous decision (corr_decision_band), so their counts "
    "are exact and a fraction count/total has one rounding: M = max(|fraction|, 1) (corr_metric_magnitude's "
    "fallback). The same fallback applies to a metric the table has no magnitude model for (an engine's own extra "
    "metrics, compared run against run in CORR-PAD-*): there it is a relative bound with a floor, not derived.",
)


def corr_metric_bound(magnitude: float, n_terms: int, max_log: float, dtype="float32") -> float:
    """Absolute bound on a scalar correction metric (``TOLERANCES['corr_metric']``)."""
    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    rel = gamma(int(n_terms) + 8, u) + CORR_METRIC.value * (float(max_log) + 2) * u
    return rel * abs(float(magnitude)) * eval_slack(int(n_terms))


def corr_metric_magnitudes(train_logp, rollout_logp, valid, safety_bound: float, is_weights=None,
                           norm_factor: float | None = None) -> tuple[dict[str, float], float, int]:
    """(M per metric, L, N + B) of ``corr_metric_bound`` for one batch (``corr_metric``).

    ``train_logp`` lo, ``rollout_logp`` lr: (B, T) log-probs (padding ignored), ``valid``: (B, T) bool (≥ 1 valid
    row), ``safety_bound``: the ±clamp of δ = lo − lr before exp (20); for the IS metrics ``is_weights``: the
    oracle's applied weights *before* batch normalization and ``norm_factor``: its μ (None: not normalized).
    δc = clamp(δ), n_i the row lengths, mean_t over valid tokens, mean_i over valid rows, Σ_i a row sum.

    M is the metric's aggregation applied to the absolute values of its parts (before cancellation), times the
    amplification of the inputs' rounding where a part is an exp:

    * kl_k1 = mean_t(lo − lr): mean_t(|lo| + |lr|). kl_k3 = mean_t(e^δc − 1 − δc): mean_t((e^δc + 1 + |δc|)·(1 +
      |δ|)) — δ's own rounding u·|δ| enters e^δc multiplied by e^δc, hence the factor (1 + |δ|).
    * training/rollout_ppl = mean_i exp(−mean_t lo): mean_i(e^{−mean lo}·(1 + Σ_i|lo|)) — the exp of a row mean
      whose error is ≤ (L + 2)·u·Σ_i|lo|/n_i ≤ that; log-ppl: mean_i(Σ_i|lo|/n_i); log_ppl_diff and its abs/min:
      mean_i((Σ_i|lo| + Σ_i|lr|)/n_i), the max/min over rows: the max of it. ppl_ratio = mean_i exp(clamp(mean lr −
      mean lo)): mean_i(e^{that}·(1 + Σ_i|lo| + Σ_i|lr|)).
    * chi2_token = mean_t e^{2δc} − 1: mean_t(e^{2δc}·(1 + 2|δ|)) + 1; chi2_seq = mean_i e^{2·clamp(Σ_i δ)} − 1:
      mean_i(e^{2·clamp(Σ_i δ)}·(1 + 2Σ_i|δ|)) + 1 (the + 1 is the subtracted 1).
    * token_mult_prob_error = mean_t e^{|δc|}: mean_t(e^{|δc|}·(1 + |δ|)).
    * probs_diff_max/mean = max/mean_t |e^lo − e^lr|: pmag = max_t((e^lo + e^lr)·(1 + |lo| + |lr|)) (both exps, an
      engine that forms p from a shifted log-prob has an argument error ≤ u·|log p|); probs_diff_std: 3·pmag — std
      is 1-Lipschitz in the max-norm of its inputs (pmag), the mean subtraction moves each input by ≤ pmag more,
      and std's own rounding is relative to std ≤ pmag. probs_pearson_corr of x = p_tr − mean, y = p_ro − mean (k
      valid tokens): 4·√k·(1 + k)·pmag/min(‖x‖, ‖y‖) — ρ is an inner product of unit vectors, so it moves by ≤
      2‖Δx‖/‖x‖ + 2‖Δy‖/‖y‖ with ‖Δx‖ ≤ 2√k·max|Δp|, and the rounding of its three k-term sums adds ≤ 3γ_k ≤
      8u·2(1 + k) ≤ 8u·M (as pmag·√k/‖x‖ ≥ ½).
    * is_weight_mean = mean_t w: mean_t(w)·(1 + T·L) — a sequence weight's relative error is ≤ e^E − 1 with E ≤
      γ_T(u)·Σ_i|δ| ≲ T·L·u (corr_weight), (1 + T·L) turns the bound's (L + 2)·u into ≥ T·L·u; is_ess (a ratio
      of two such sums, squared numerator): 3·(1 + T·L); is_batch_norm_factor: μ·(1 + T·L) (1 when μ is None).
      is_weight_min/max: max_t w·(1 + T·L) (each weight within that relative bound, min/max add no rounding);
      is_weight_row_mean = mean_i(Σ_i w/n_i): the same aggregation of w times (1 + T·L).
    * abs_logp_diff_mean/max = mean/max_t |lo − lr|: one subtraction per term: mean_t / max_t (|lo| + |lr|).

    L = max_t(|lo| + |lr| + 2|δ|) is the largest exp argument; N + B counts the valid tokens and all rows.
    Returns fp64 Python floats.
    """
    import torch

    m = torch.as_tensor(valid).bool()
    z = torch.zeros((), dtype=torch.float64)
    lo = torch.where(m, torch.as_tensor(train_logp).double(), z)
    lr = torch.where(m, torch.as_tensor(rollout_logp).double(), z)
    d = torch.where(m, lo - lr, z)
    sb = float(safety_bound)
    dc = d.clamp(-sb, sb)
    rows_valid = m.any(-1)
    n = m.sum(-1).clamp_min(1).double()

    def mm(x):
        return float(torch.where(m, x, z).sum() / m.sum())

    def rsum(x):
        return torch.where(m, x, z).sum(-1)[rows_valid]

    L = float(torch.where(m, lo.abs() + lr.abs() + 2 * d.abs(), z).max())
    nv = n[rows_valid]
    mlo, mlr = rsum(lo) / nv, rsum(lr) / nv
    alo, alr = rsum(lo.abs()), rsum(lr.abs())
    di = (mlr - mlo).clamp(-sb, sb)
    srow = rsum(d).clamp(-sb, sb)
    p_tr, p_ro = torch.exp(lo[m]), torch.exp(lr[m])
    pmag = float(((p_tr + p_ro) * (1 + lo[m].abs() + lr[m].abs())).max())
    M = {
        "kl_k1": mm(lo.abs() + lr.abs()),
        "kl_k3": mm((torch.exp(dc) + 1 + dc.abs()) * (1 + d.abs())),
        "training_ppl": float((torch.exp(-mlo) * (1 + alo)).mean()),
        "rollout_ppl": float((torch.exp(-mlr) * (1 + alr)).mean()),
        "training_log_ppl": float((alo / nv).mean()),
        "rollout_log_ppl": float((alr / nv).mean()),
        "log_ppl_diff": float(((alo + alr) / nv).mean()),
        "log_ppl_abs_diff": float(((alo + alr) / nv).mean()),
        "log_ppl_diff_max": float(((alo + alr) / nv).max()),
        "log_ppl_diff_min": float(((alo + alr) / nv).max()),
        "ppl_ratio": float((torch.exp(di) * (1 + alo + alr)).mean()),
        "chi2_token": mm(torch.exp(2 * dc) * (1 + 2 * d.abs())) + 1,
        "chi2_seq": float((torch.exp(2 * srow) * (1 + 2 * rsum(d.abs()))).mean()) + 1,
        "token_mult_prob_error": mm(torch.exp(dc.abs()) * (1 + d.abs())),
        "probs_diff_max": pmag,
        "probs_diff_mean": pmag,
        "probs_diff_std": 3 * pmag,
    }
    x, y = p_tr - p_tr.mean(), p_ro - p_ro.mean()
    nx, ny = float(x.norm()), float(y.norm())
    k = p_tr.numel()
    if min(nx, ny) > 0:
        M["probs_pearson_corr"] = 4 * math.sqrt(k) * (1 + k) * pmag / min(nx, ny)
    # abs_logp_diff_mean/max = mean/max_t |lo − lr|: one subtraction of the inputs per term, M = the same
    # aggregation of |lo| + |lr| (the parts before cancellation)
    M["abs_logp_diff_mean"] = mm(lo.abs() + lr.abs())
    M["abs_logp_diff_max"] = float(torch.where(m, lo.abs() + lr.abs(), z).max())
    if is_weights is not None:
        w = torch.as_tensor(is_weights).double()
        amp = 1 + m.shape[-1] * L
        M["is_weight_mean"] = mm(w) * amp
        # min/max/row mean of the weights: each weight within (1 + T·L)·u-relative as for is_weight_mean; M = the
        # largest weight (min, max) or the row-mean aggregation of the weights, times the same amplification
        M["is_weight_min"] = M["is_weight_max"] = float(torch.where(m, w, z).max()) * amp
        M["is_weight_row_mean"] = float((rsum(w) / nv).mean()) * amp
        M["is_ess"] = 3 * amp
        M["is_batch_norm_factor"] = (norm_factor or 1.0) * amp
    return M, L, int(m.sum()) + m.shape[0]


def corr_metric_magnitude(magnitudes: dict[str, float], key: str, value: float) -> float:
    """M of one metric: ``magnitudes[key]`` (corr_metric_magnitudes), else max(|value|, 1) — the fraction metrics'
    M, and the underived fallback for metrics without a magnitude model (``corr_metric``)."""
    if key in magnitudes:
        return magnitudes[key]
    return max(abs(float(value)), 1.0)


CORR_RUN_PAIR = _register(
    "corr_run_pair",
    2,
    "Two runs of one engine on inputs that differ only in padding (CORR-PAD-001: appended padded columns with "
    "garbage log-probs; CORR-PAD-003: an appended all-padding row) compared with each other, not with the "
    "oracle: the oracle ignores padding exactly, so both runs are within their own bound of the same oracle value "
    "and by the triangle inequality |x_a − x_b| ≤ B_a + B_b (value: the two runs). Weights, with relative bounds "
    "r_a, r_b (corr_weight): |w_b − w_a| ≤ (r_a + r_b)·w ≤ (r_a + r_b)/(1 − r_a)·|w_a| (corr_weight_pair_rel). "
    "Metrics: B = corr_metric_bound(M, n, L) with each run's own term count n = N + B (appended padding columns "
    "add no valid token, and adding exact zeros adds no rounding in any summation order; an appended empty row "
    "adds 1 to B) (corr_metric_pair_bound). This replaces 2·corr_metric_bound(M, n + 16, L), whose + 16 was a "
    "guess at the longer run's extra terms.",
)


def corr_weight_pair_rel(rel_a, rel_b):
    """Relative bound on |w_b − w_a|/|w_a| for two runs within rel_a, rel_b of one oracle (``corr_run_pair``)."""
    return (rel_a + rel_b) / (1 - rel_a) * eval_slack(0)


def corr_metric_pair_bound(magnitude: float, n_terms_a: int, n_terms_b: int, max_log: float,
                           dtype="float32") -> float:
    """Absolute bound on |metric_a − metric_b| for two runs of one engine (``corr_run_pair``)."""
    return (corr_metric_bound(magnitude, n_terms_a, max_log, dtype)
            + corr_metric_bound(magnitude, n_terms_b, max_log, dtype)) * eval_slack(0)


CORR_ESS_RANGE = _register(
    "corr_ess_range",
    3,
    "The normalized ESS (Σw)²/(N·Σw²) lies in [0, 1] by Cauchy–Schwarz for ANY non-negative weights — the "
    "engine's own included, so its weight errors do not matter, only the rounding of the ESS formula itself. "
    "Kish's form: Σw (N − 1 additions of non-negative terms), its square (2N − 1 factors), Σw² (N squarings and "
    "N − 1 additions), N·Σw² (1) and the division (1): ≤ 3N + 1 factors (1 + δ)^±1; veRL's 1/mean((w/mean(w))²): "
    "the mean (N), the division per term (1), the square (2N + 3), the mean (N), the reciprocal (1): ≤ 3N + 4. So "
    "the computed ESS ≤ 1 + γ_{3n+4}(u) (value: the 3 roundings per term; corr_ess_max) with n the number of "
    "weights (valid tokens; the checks pass N + B to cover row-level forms). An engine that adds an ε to the mean "
    "(veRL: w/(mean + 1e-8)) exceeds 1 by ≈ 2ε/mean, outside this bound for small means. Replaces the bare "
    "1 + 1e-6 used before (tighter than this for N ≲ 4, looser beyond).",
)


def corr_ess_max(n_terms: int, dtype="float32") -> float:
    """Largest normalized ESS an engine may report for ``n_terms`` weights (``corr_ess_range``)."""
    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    return 1 + gamma(int(CORR_ESS_RANGE.value) * int(n_terms) + 4, u) * eval_slack(0)


CORR_LOSS = _register(
    "corr_loss",
    16,
    "Policy loss with IS weights (PPO-clip with dual clip, REINFORCE) computed in the log-probs' dtype vs the "
    "float64 oracle, and its gradient w.r.t. log π: per token ≤ 6 roundings (ratio exp of an argument with error "
    "u·|Δ|, clip, products with A and w, the dual-clip min) — relative ≤ (6 + |logp − old|)·u per term — then an "
    "aggregation over ≤ N tokens (γ_{N+2}). Bound: (γ_{N+2}(u) + 16·(1 + L)·u)·M where M is the aggregation of "
    "|per-token loss| (or |gradient|) and L the max |logp − old|, |logp|; value 16 = the per-term rounding "
    "count with room for the weight's own bound.",
)


def corr_loss_bound(magnitude: float, n_terms: int, max_log: float, dtype="float32") -> float:
    """Absolute bound on a policy loss or a gradient element (``TOLERANCES['corr_loss']``)."""
    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    return (gamma(int(n_terms) + 2, u) + CORR_LOSS.value * (1 + float(max_log)) * u) * abs(float(magnitude)) \
        * eval_slack(int(n_terms))


CORR_LOSS_HEADROOM = _register(
    "corr_loss_headroom",
    4,
    "Factor on the magnitude M given to corr_loss_bound by the loss checks (CORR-LOSS-001/002: M = 4 × the "
    "aggregation of |w·per-token loss|, and 4 × max|∂L/∂log π| for the gradient elements). Not derived: "
    "corr_loss's per-term count (16, against ≤ 6 roundings plus the argument error) already covers the "
    "derivation, so this is headroom kept from the checks' first version for fused or reordered loss kernels. "
    "Measured error/bound with it (ci profile): 0.0031 for veRL 0.9.1, 0.0012 for the reference engine, i.e. "
    "≤ 0.013 without it.",
)


CORR_PROX = _register(
    "corr_prox",
    8,
    "Decoupled PPO's approximated proximal log-prob (CORR-PROX-001) computed in the inputs' dtype (u) vs the "
    "float64 oracle (fp8rl.reference.correction.proximal_logp). α = (v_θ − 1 − v)/(v_θ − v) of exact small "
    "integers: one division, relative error ≤ u. loglinear l_b + α(l_θ − l_b): a subtraction, a product, an "
    "addition, each ≤ u relative to a result of magnitude ≤ |l_b| + |l_θ|, plus α's error times |l_θ − l_b|: "
    "≤ 4u·(|l_b| + |l_θ|). linear log((1−α)e^{l_b} + αe^{l_θ}): each exp has an argument exact and a result "
    "≤ 2u relative (a last-ulp exp), the two products and the sum ≤ 3u, α's error ≤ u: the argument of the log is "
    "≤ 6u relative, so the log is ≤ 6u absolute plus its own rounding u·|result| ≤ u·(|l_b| + |l_θ|). Bound "
    "(corr_prox_bound) per token: value·u·(|l_b| + |l_θ| + 1), value 8 covers both with room (4 + 1 and 6 + 1).",
)


def corr_prox_bound(behave_logp, theta_logp, dtype="float32"):
    """Elementwise absolute bound on an engine's proximal log-prob (``corr_prox``), as a float64 tensor."""
    import torch

    u = UNIT_ROUNDOFF[_dtype_name(dtype)]
    lb = torch.as_tensor(behave_logp).double().abs()
    lt = torch.as_tensor(theta_logp).double().abs()
    return CORR_PROX.value * u * (lb + lt + 1) * eval_slack(0)


CORR_KL_STAT_Z = _register(
    "corr_kl_stat_z",
    4.0,
    "Statistical check of the k1/k3 KL estimators: with n i.i.d. tokens sampled from a known categorical "
    "π_rollout and per-token estimator values X_i (k1: log π_rollout − log π_train; k3: ρ − 1 − log ρ), the "
    "sample mean is within z·σ̂/√n of the true KL(π_rollout‖π_train) except with probability ≤ 2·(1 − Φ(z)) "
    "(CLT; σ the exact standard deviation of X under π_rollout, computed from the distributions). z = 4 "
    "(value) gives a false-alarm rate ≤ 6.3e-5 per comparison; with a fixed seed the check is deterministic. "
    "n is derived so that the CI half-width z·σ/√n is ≤ 10% of the KL (n = ⌈(10·z·σ/KL)²⌉, capped at 40000 tokens in the conformance check), which "
    "detects any estimator whose bias exceeds ~10% of the KL (e.g. k1 on the inverse ratio, mean −KL). Note: k2 = ½δ² "
    "and the inverse-ratio k3 agree with KL to second order in the mismatch, so they are caught by the exact "
    "metric checks, not by this one.",
)


def corr_kl_stat_tokens(sd: float, kl: float) -> int:
    """Sample size n of the KL-estimator check (``corr_kl_stat_z``): ⌈(10·z·σ/KL)²⌉, so that the CI half-width
    z·σ/√n is ≤ 10 % of the KL, capped at 40000 tokens."""
    z = CORR_KL_STAT_Z.value
    return min(int(math.ceil((10 * z * float(sd) / float(kl)) ** 2)), 40_000)


# ---------------------------------------------------------------------------------------------------------------
# KV cache


KV_EXP_ULPS = _register(
    "kv_exp_ulps",
    4,
    "Relative error of the exp() inside an engine's softmax, in units of u (value: 4): PyTorch's CPU flash "
    "attention uses Vectorized::exp_u20 (a 2-ulp polynomial on AVX-512/AVX2/NEON; Sleef u10 elsewhere), CUDA "
    "kernels __expf/exp2f (≤ 2 ulp); 2 ulp ≤ 4u relative. Used by kv_attention_arith_bound.",
)

KV_ATTENTION_ARITH = _register(
    "kv_attention_arith",
    KV_EXP_ULPS.value,
    "Engine FP8 attention vs the oracle's FP8 attention on the *same* FP8 operands (K̂, V̂ from the caches, Q̂ "
    "quantized under the declared q policy), i.e. the engine's floating-point arithmetic only (value: the exp "
    "ulps; elementwise function kv_attention_arith_bound). Standard model with unit roundoff u of the compute "
    "dtype plus 2^-53 for the fp64 oracle. (1) Scores: sm·q̂·k̂ with D products, D−1 additions and ≤ 3 "
    "roundings of the scale (SDPA multiplies q and k by √sm each): |ŝ_ij − s_ij| ≤ e_i := γ_{D+4}(u)·max_j "
    "sm·Σ_d|q̂_id||k̂_jd| (+ (D+4)·η_min for gradual underflow). (2) Softmax: subtracting the row max rounds "
    "|ŝ − m̂| ≤ span_i + 2e_i with relative u, so each exp argument is off by ≤ η_i := e_i + u·(span_i + 2e_i); "
    "exp adds c_exp·u ('kv_exp_ulps'), the row sum γ_{Tk}, the normalisation 2u, and online-softmax block "
    "rescaling (flash kernels) ≤ (c_exp+3)·u per block, ≤ Tk blocks. A common shift cancels in the ratio, so "
    "p̂_j/p_j ∈ [e^{−2η}, e^{2η}]·(1 ± γ_{(c_exp+3)·Tk + 2c_exp + 8}(u)): |p̂_j/p_j − 1| ≤ R_i. (3) Output "
    "Σ_j p̂_j v̂_jd in any order: γ_{Tk+2}(u) more. Hence |ô_id − o_id| ≤ ((1+R_i)(1+γ_{Tk+2}(u)) − 1)·Σ_j p_ij "
    "|v̂_jd| + (Tk+2)·η_min, inflated by eval_slack. Padded query rows must be exactly 0. Tight (≈1e-5 relative "
    "for Tk = 64): wrong scales, an ignored q_scale, a mis-mapped GQA head or a read past kv_len are far outside.",
)


def kv_attention_arith_bound(score_abs_max, score_span, weighted_abs_v, head_dim: int, n_keys: int,
                             dtype="float32"):
    """Elementwise bound on |engine FP8 attention − oracle FP8 attention| (``TOLERANCES['kv_attention_arith']``).

    ``score_abs_max``, ``score_span``: [B, H, Tq] (max_j sm·Σ|q̂||k̂| and max_j s − min_j s over allowed keys);
    ``weighted_abs_v``: [B, Tq, H, D] (Σ_j p_j|v̂_jd|); see fp8rl.reference.kv.attention_bound_terms. Returns fp64
    [B, Tq, H, D].
    """
    import torch

    name = _dtype_name(dtype)
    u = UNIT_ROUNDOFF[name] + UNIT_ROUNDOFF["float64"]
    eta_min = MIN_SUBNORMAL[name]
    d, tk = int(head_dim), int(n_keys)
    c_exp = int(KV_EXP_ULPS.value)
    a = torch.as_tensor(score_abs_max, dtype=torch.float64)
    span = torch.as_tensor(score_span, dtype=torch.float64)
    w = torch.as_tensor(weighted_abs_v, dtype=torch.float64)
    e = gamma(d + 4, u) * a + (d + 4) * eta_min
    eta = e + u * (span + 2 * e)
    r = torch.exp(2 * eta) * (1 + gamma((c_exp + 3) * tk + 2 * c_exp + 8, u)) - 1
    r = r.permute(0, 2, 1).unsqueeze(-1)
    total = ((1 + r) * (1 + gamma(tk + 2, u)) - 1) * w + (tk + 2) * eta_min
    return total * eval_slack(tk + d)


KV_ATTENTION_QUANT = _register(
    "kv_attention_quant",
    2,
    "Derived (rigorous, worst-case) bound on FP8 attention vs the unquantized attention, for operands stored "
    "in range (|x/s| ≤ max, no clipping); elementwise function kv_attention_quant_bound; value: the 2 in "
    "e^{2ε}. With |Δq|, |Δk|, |Δv| ≤ the half-ulp bounds δ = max(2^-(m+1)|x|, ½·min_sub·s) of each store "
    "(fp8rl.reference.kv.half_ulp_bound): q̂·k̂ − q·k = Δq·k + q̂·Δk, so every score moves by ≤ ε_i := max_j "
    "sm·Σ_d(δq_d|k_jd| + (|q_d| + δq_d)δk_jd); a softmax with all logits moved by ≤ ε has p̂_j/p_j ∈ "
    "[e^{−2ε}, e^{2ε}], so with P = e^{2ε} − 1: |ô_d − o_d| = |Σ_j p_j(r_j v̂_jd − v_jd)| ≤ P·Σ_j p_j|v_jd| + "
    "(1+P)·Σ_j p_j δv_jd (p exact). Plus 2·γ_{D+Tk+16}(2^-53) of the two fp64 evaluations. Guaranteed but loose "
    "(worst-case rounding alignment, ~10–100× the typical error): it is the envelope FP8 rounding alone can "
    "explain. Clipped operands are outside its hypothesis: with V clipped by stale scales (range grown 8×) the "
    "error exceeds it (tests/oracle/test_reference_kv.py checks both directions). Clipped K mostly stays inside only "
    "because the bound is so loose, which is why the drift simulator uses kv_attention_vs_fresh instead.",
)


def kv_attention_quant_bound(eps, pv, pdv, head_dim: int, n_keys: int):
    """Elementwise bound on |FP8 attention − unquantized attention| (``TOLERANCES['kv_attention_quant']``).

    ``eps`` [B, H, Tq], ``pv``/``pdv`` [B, Tq, H, D] from fp8rl.reference.kv.quantization_bound_terms.
    """
    import torch

    e = torch.as_tensor(eps, dtype=torch.float64).permute(0, 2, 1).unsqueeze(-1)
    p = torch.exp(KV_ATTENTION_QUANT.value * e) - 1
    pv_ = torch.as_tensor(pv, dtype=torch.float64)
    pdv_ = torch.as_tensor(pdv, dtype=torch.float64)
    g = 2 * gamma(int(head_dim) + int(n_keys) + 16, UNIT_ROUNDOFF["float64"])
    return (p * pv_ + (1 + p) * pdv_ + g * (1 + p) * (pv_ + pdv_)) * eval_slack(int(n_keys))


KV_ATTENTION_VS_FRESH = _register(
    "kv_attention_vs_fresh",
    2.0,
    "Empirically justified factor κ_attn: with in-range scales, the relative Frobenius error ‖ô − o‖/‖o‖ of FP8 "
    "attention vs the unquantized attention stays within κ_attn × the error obtained with *fresh* scales "
    "(amax/max of the same data, per tensor). Why a ratio: FP8's relative precision is the same in every "
    "normal binade, so any scale that keeps values in range (and out of the subnormals) gives the same error up "
    "to the rounding realisation; scales that clip the largest |x| (stale scales after the ranges grew) blow it "
    "up. Measured (tests/oracle/test_reference_kv.py::test_rescaled_in_range_error_ratio_stat reproduces it): 120 "
    "random QK-normed configs (e4m3fn/e5m2, T 16–64, D 16/64, gains 0.5–4, outlier channels) rescaled by "
    "c ∈ {1.05, 1.3, 2.24, 4, 16, 64, 256}: ratio ∈ [0.39, 1.49] (powers of two give exactly 1); clipping by 2× "
    "(c = 0.5) gives ratio ≥ 1.33 and up to 8.4. Drift simulator, every-step recalibration (strategy B on a "
    "different batch): ratio ∈ [0.87, 1.13]; never recalibrating: up to 9.2. Value 2.0 = 1.49 + one third margin.",
)

KV_DRIFT_LOGPROB_VS_FRESH = _register(
    "kv_drift_logprob_vs_fresh",
    2.0,
    "Empirically justified factor κ_lp for the drift simulator's log-prob divergence mean_t |log π_fp8(a_t) − "
    "log π(a_t)|: a schedule holds if it stays within κ_lp × the divergence with fresh per-step amax scales "
    "(same reasoning as kv_attention_vs_fresh; the divergence aggregates ~200 tokens, so the rounding "
    "realisation moves it less). Measured on the default config (24 steps): every-step ratio ∈ [0.85, 1.28]; "
    "every-5 up to 2.75 just before a recalibration; never up to 9.9. Value 2.0.",
)


# ---------------------------------------------------------------------------------------------------------------
# Weight sync and end-to-end mismatch
#
# Weight sync is checked bit-exactly ('exact') plus 'quant_roundtrip' for the dequantized weights. The e2e budgets
# are empirical: the measured distribution of the reference FP8 emulation per model × recipe × metric, the method
# and each calibration's metadata live in the data file E2E_BUDGETS_FILE (package data of fp8rl), written by
# ``python -m fp8rl.conformance._e2e --seeds 10 --write``; this module loads it and registers one entry
# 'e2e.<metric>.<model>.<recipe>' per measured metric (margin rule below).

#: the e2e budgets data file, relative to the fp8rl package
E2E_BUDGETS_FILE = "data/e2e_budgets.json"
E2E_BUDGETS_FORMAT = "fp8rl-e2e-budgets/1"


def load_e2e_budgets(path=None) -> dict:
    """The e2e budgets document (``E2E_BUDGETS_FILE`` of the installed package, or ``path``), validated: format,
    method text, margins, calibration records, and per model/recipe/metric {min, median, max, n} with min ≤
    median ≤ max, finite, and a margin for every metric. ValueError otherwise."""
    import json
    from importlib import resources

    if path is None:
        text = resources.files(__package__).joinpath(E2E_BUDGETS_FILE).read_text(encoding="utf-8")
        where = f"fp8rl/{E2E_BUDGETS_FILE}"
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        where = str(path)
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != E2E_BUDGETS_FORMAT:
        raise ValueError(f"{where}: expected format {E2E_BUDGETS_FORMAT!r}, got {doc.get('format')!r}")
    for key in ("method", "margins", "calibrations", "measured"):
        if key not in doc:
            raise ValueError(f"{where}: missing {key!r}")
    margins, cals = doc["margins"], doc["calibrations"]
    for model, recipes in doc["measured"].items():
        for recipe, entry in recipes.items():
            what = f"{where}: measured[{model!r}][{recipe!r}]"
            if entry.get("calibration") not in cals:
                raise ValueError(f"{what}: calibration {entry.get('calibration')!r} is not in 'calibrations'")
            for metric, st in entry.items():
                if metric == "calibration":
                    continue
                if metric not in margins:
                    raise ValueError(f"{what}: no margin for metric {metric!r} (margins: {sorted(margins)})")
                lo, med, hi, n = (st.get(k) for k in ("min", "median", "max", "n"))
                vals = (lo, med, hi)
                if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals) or not lo <= med <= hi \
                        or not (isinstance(n, int) and n > 0):
                    raise ValueError(f"{what}[{metric!r}]: expected finite min ≤ median ≤ max and n > 0, got {st!r}")
    return doc


def e2e_budget_value(metric: str, stats: tuple[float, float, float], margin: float) -> float:
    """Budget (or floor, for ``first_div_mean``) from a measured (min, median, max) and the metric's margin:
    margin·max; 1 + margin·(max − 1) for token_mult_prob_error; margin·min for first_div_mean."""
    lo, _, hi = stats
    if metric == "token_mult_prob_error":
        return 1.0 + margin * (hi - 1.0)
    if metric == "first_div_mean":
        return margin * lo
    return margin * hi


E2E_BUDGETS: dict = load_e2e_budgets()
E2E_MARGINS: dict[str, float] = {k: float(v) for k, v in E2E_BUDGETS["margins"].items()}
#: (model, recipe) → metric → (min, median, max), from E2E_BUDGETS_FILE
E2E_MEASURED: dict[tuple[str, str], dict[str, tuple[float, float, float]]] = {
    (model, recipe): {m: (st["min"], st["median"], st["max"]) for m, st in entry.items() if m != "calibration"}
    for model, recipes in E2E_BUDGETS["measured"].items() for recipe, entry in recipes.items()
}


def _calibration_line(cid: str) -> str:
    c = E2E_BUDGETS["calibrations"][cid]
    return (f"{cid}: {c.get('command')}, {c.get('runs_per_case')} runs per case, torch {c.get('torch')}, "
            f"transformers {c.get('transformers')}, {c.get('date')}")


E2E_MISMATCH = _register(
    "e2e_mismatch",
    E2E_MARGINS["k3_kl"],
    "Mismatch budgets of the e2e checks (value: the k3 KL margin). Per (model, recipe) and metric the budget is "
    "the entry 'e2e.<metric>.<model>.<recipe>': max × 2 (k3_kl), 1 + 2·(max − 1) (token_mult_prob_error), "
    "max × 1.5 (max_abs_dlogp), and the floor min × 0.5 (first_div_mean), over the measured distribution of the "
    f"reference FP8 emulation in fp8rl/{E2E_BUDGETS_FILE}. Recipes: bf16 (incremental BF16 decoding vs the "
    "teacher-forced trainer), fp8-linear (W8A8 128x128/1x128), fp8-linear-ptpc (W8A8 per-channel weights / "
    "per-token activations, vLLM fp8_per_channel), fp8-kv (FP8 KV storage), fp8-all (both + FP8 query), mxfp8 "
    "(every projection MXFP8 e4m3 + E8M0 per 1x32, activations likewise) and nvfp4-experts (the routed experts "
    "NVFP4, activations NVFP4 with a per-input global scale; the rest BF16), docs/microscaling.md. Method "
    "(from the data file): " + E2E_BUDGETS["method"] + " Calibrations: "
    + "; ".join(_calibration_line(c) for c in E2E_BUDGETS["calibrations"]) + ".",
)

for (_model, _recipe), _stats in E2E_MEASURED.items():
    _cal = E2E_BUDGETS["measured"][_model][_recipe]["calibration"]
    for _metric, _s in _stats.items():
        _n = E2E_BUDGETS["measured"][_model][_recipe][_metric]["n"]
        _kind = "floor (the check needs ≥)" if _metric == "first_div_mean" else "budget (the check needs ≤)"
        _register(f"e2e.{_metric}.{_model}.{_recipe}", e2e_budget_value(_metric, _s, E2E_MARGINS[_metric]),
                  f"{_kind} for {_metric} of {_model} under {_recipe}: measured min/median/max "
                  f"{_s[0]:.4g}/{_s[1]:.4g}/{_s[2]:.4g} over {_n} reference-emulation runs (calibration "
                  f"{_calibration_line(_cal)}), margin {E2E_MARGINS[_metric]} (see 'e2e_mismatch'; data: "
                  f"fp8rl/{E2E_BUDGETS_FILE}). False-alarm rate for an engine with the reference emulation's "
                  f"distribution: at most 1/(n + 1) = {1 / (_n + 1):.2%} per run (distribution-free; the margin "
                  "only lowers it); measured 0 false alarms in the 20-seed sweep of the reference engine "
                  "(fp8rl conformance --engine reference --area e2e --seeds 0..19).")


ROLLOUT_LOGPROB_SLACK = _register(
    "rollout_logprob_slack",
    1e-4,
    "Largest positive log-prob a rollout may report (a log-prob is ≤ 0). An engine computes log π(a) = x_a − "
    "logsumexp(x) in fp32; for a near-certain token the exact value is ≈ 0⁻ and the subtraction of two nearly equal "
    "fp32 numbers of magnitude |lse| rounds with error ≤ u32·|lse| = 2^-24·|lse| (6e-6 for |lse| ≤ 100). Value "
    "1e-4: that rounding for |lse| ≤ 1600, far beyond the tiny fixtures' logit range; a log-prob above it (or "
    "non-finite) is an engine error, not a verdict on its numerics.",
)


# Rollout self-consistency (E2E-LOGPROB-001, E2E-ARGMAX-001, E2E-GOF-001): the log-probs, greedy tokens and samples
# an engine reports against the logits it exposes (capability rollout.logits).
ROLLOUT_LOGPROB_FP32 = _register(
    "rollout_logprob_fp32",
    UNIT_ROUNDOFF["float32"],
    "A reported log-prob is the fp32 log-softmax of the logits row ℓ (V entries) at the token t (value: u32 = 2^-24; "
    "the bound is rollout_logprob_fp32_bound). With m = max ℓ, d_i = ℓ_i − m, S = Σ exp(d_i), lse = log S: "
    "fl(d_i) errs by ≤ u·|d_i|; exp (≤ 1 ulp) and the propagated argument error give exp(d_i)(1 + η_i), "
    "|η_i| ≤ (|d_i| + 2)u; summing V positive terms (any order) adds ≤ (V − 1)u relative, so Ŝ = S(1 + σ) with "
    "|σ| ≤ (max|d| + V + 1)u; log adds ≤ 2u·|lse| and the final subtraction d_t − lse ≤ u·(|d_t| + |lse| + "
    "|lp_t|). The other usual implementation, log(softmax(ℓ))[t], has the same terms (p_t = exp(d_t)/Ŝ relative "
    "error (|d_t| + 3)u + |σ|, then a log rounding ≤ 2u·|lp_t|). An engine may report any per-row shift of its "
    "logits (e.g. its log-prob vector): that shift's rounding moves each entry by ≤ u·max|ℓ|, the log-softmax by "
    "≤ 2u·max|ℓ|. Bound (each linear term doubled for slack): u·(2·max|ℓ| + 2·|d_t| + 2·max|d| + V + 8 + "
    "2·|lse| + 2·|lp_t|); ≈ 4e-5 for V = 512 and logits within ±30. The checker's own log-softmax is fp64 "
    "(error ~1e-15). A log-prob computed in BF16 errs by up to 2^-9·|lp| (4e-3 at lp = −2): far outside.",
)


def rollout_logprob_fp32_bound(logits, index=None):
    """Elementwise bound of |reported log-prob − log_softmax(logits)[index]| for fp32 log-softmax evaluation (see
    the entry ``rollout_logprob_fp32``). ``logits``: (..., V) tensor; ``index``: (...) int64 token ids, or None for
    every entry (shape (..., V)). Returns fp64."""
    import torch

    x = logits.to(torch.float64)
    v = x.shape[-1]
    u = UNIT_ROUNDOFF["float32"]
    fin = torch.isfinite(x)  # a −inf entry (a masked token) adds exp(−inf) = 0 exactly and no rounding
    m = torch.where(fin, x, -math.inf).amax(-1, keepdim=True)
    d = x - m
    lse = torch.logsumexp(d, -1, keepdim=True)
    lp = d - lse
    if index is not None:
        d = d.gather(-1, index[..., None].long())
        lp = lp.gather(-1, index[..., None].long())
    spread = torch.where(fin, (x - m).abs(), 0.0).amax(-1, keepdim=True)
    common = 2 * torch.where(fin, x.abs(), 0.0).amax(-1, keepdim=True) + 2 * spread + v + 8 + 2 * lse.abs()
    b = u * (common + 2 * d.abs() + 2 * lp.abs())
    return b.squeeze(-1) if index is not None else b


ROLLOUT_GOF = _register(
    "rollout_gof",
    1e-6,
    "False-alarm rate α of the goodness-of-fit check E2E-GOF-001 (per check case; value: α). Test: for each "
    "sampled token t drawn from a reported row p = softmax(ℓ) (fp64 from the fp32 logits), order the vocabulary by "
    "decreasing p (ties by token id) and take the randomized probability integral transform U = P(tokens before t) "
    "+ W·p_t, W ~ Uniform(0, 1) from the checker's seeded generator. If every token is drawn from its row's "
    "distribution given the past (rows independent), the U are i.i.d. Uniform(0, 1) exactly (discrete PIT with "
    "randomization; sequential draws included, by conditioning on the past), whatever the rows. Statistic: the "
    "Kolmogorov–Smirnov distance D of the n values' empirical CDF from the uniform. Massart's tight "
    "Dvoretzky–Kiefer–Wolfowitz inequality P(D > ε) ≤ 2·exp(−2nε²) (Massart 1990, valid for every n and every "
    "ε ≥ sqrt(ln 2 / 2n)) gives the threshold ε(n, α) = sqrt(ln(2/α) / 2n), plus the total variation between the "
    "engine's sampling distribution and the checker's softmax: fp32 rounding of the log-softmax "
    "(exp(max rollout_logprob_fp32_bound) − 1 per row) and a sampler's own fp32 random numbers (inverse CDF or "
    "exponential race: ≤ V·2^-23), so a correct engine fails with probability ≤ α; the checker's generator is "
    "seeded (run seed), so the verdict is deterministic. rollout_gof_threshold computes it. Draws: the 8 fixed "
    "prompts × 64 copies × 16 new tokens = 8192 (ε = 0.0298 at α = 1e-6, + ≈ 1e-4 of TV allowance). Power: "
    "against an alternative at KS distance D_alt the check fires with probability ≥ 1 − 2·exp(−2n(D_alt − ε)²) "
    "(DKW applied to the alternative: ≥ 0.997 at D_alt = 0.05, ≈ 1 at 0.06). Per-row distances on the tiny "
    "fixtures' first-token rows: 0.15–0.27 for a temperature of 0.7, 0.06–0.10 for 0.9 or 1.1, 0.015–0.11 for "
    "top-k 50 and 0.05 for top-p 0.95. Measured on the check's 8192 draws (reference engine, run seed 0, the "
    "'ks_d' metric): correct sampling 0.005–0.014; temperature 0.7 0.11–0.23 per model (caught on all four); "
    "top-k 50 0.067–0.072 on tiny-qwen3, -qwen3-moe, -qwen2-moe (caught) and 0.026 on tiny-qwen3-tied-odd, whose "
    "tied-embedding distributions are peaked (missed there); one random stream shared by a batch's rows 0.063–0.087 "
    "(0.030 on tiny-qwen3-tied-odd). Over the e2e area's GoF cases (one per model: 4) the family-wise false-alarm "
    "rate is ≤ 4α.",
)


def rollout_gof_threshold(n: int, tv: float = 0.0, alpha: float | None = None) -> float:
    """KS threshold of E2E-GOF-001 for ``n`` i.i.d. PIT values: sqrt(ln(2/α) / 2n) + ``tv`` (the total-variation
    allowance; see ``rollout_gof``); α defaults to the table's value."""
    a = ROLLOUT_GOF.value if alpha is None else float(alpha)
    if not (0 < a < 1) or n < 1:
        raise ValueError(f"alpha/n: expected 0 < alpha < 1 and n ≥ 1, got {a}, {n}")
    return math.sqrt(math.log(2.0 / a) / (2.0 * n)) + float(tv)


def rollout_gof_power(n: int, distance: float, threshold: float) -> float:
    """Lower bound on the probability that the GoF check fires for draws whose PIT CDF is at KS distance
    ``distance`` from the uniform: 1 − 2·exp(−2n(distance − threshold)²) (0 when distance ≤ threshold)."""
    gap = distance - threshold
    return 0.0 if gap <= 0 else max(0.0, 1.0 - 2.0 * math.exp(-2.0 * n * gap * gap))


def e2e_budget(metric: str, model: str, recipe: str) -> float:
    """The e2e budget (or floor, for ``first_div_mean``) of a metric for a tiny model and recipe."""
    return get(f"e2e.{metric}.{model}.{recipe}").value


# ---------------------------------------------------------------------------------------------------------------
# Area learning: exact policy gradients of the enumerable toy policy (fp8rl.reference.learning,
# docs/learning-parity.md).
LEARNING_GRAD_ARITH = _register(
    "learning_grad_arith",
    64,
    "Arithmetic bound on the relative gradient bias ‖E_q[ĝ] − ∇J‖/‖∇J‖ of an estimator that is unbiased in exact "
    "arithmetic (on-policy rollouts, or untruncated sequence IS): value·u32·κ with κ = Σ_e (|c_e| + |c^J_e|)·‖g_e‖ / "
    "‖∇J‖ (the estimator's and ∇J's coefficients over the entries e = (prefix, token), ‖g_e‖ the norm of the "
    "entry's log-prob gradient; learning_arith_bound). Both vectors are Σ_e c_e g_e of the same float64 Jacobian "
    "rows g_e, so their difference is Σ_e (c_e − c^J_e) g_e plus the rows' own errors weighted by |c| + |c^J|. "
    "Each row comes from one float64 backward through the transformers Qwen3 model, whose RMSNorms compute in "
    "float32 (upcast, normalize, cast back: ≤ 2 roundings of u32 each way, forward and backward) — five norms in "
    "the one-layer toy (input, post-attention, q, k, final) → ≤ 20 u32-relative roundings on the path, ×3 for the "
    "products that follow (value 64 ≥ 60). The coefficients themselves carry float64 rounding only (ρ = e^(Σ δ) of "
    "float64 log-probs: ≤ (2H + 4)·u64), negligible beside u32. Measured on the seed-0 toy: on-policy relative "
    "bias 3.3e-8 against a bound of the order of 1e-5; a mutant's bias is ≥ 1e-3.",
)


def learning_arith_bound(kappa: float) -> float:
    """Relative-bias bound ``learning_grad_arith``·u32·κ (κ: see the table entry)."""
    return LEARNING_GRAD_ARITH.value * UNIT_ROUNDOFF["float32"] * float(kappa) * eval_slack(0)


LEARNING_TIS_BIAS = _register(
    "learning_tis_bias",
    1.0,
    "Analytic bound on the relative bias of truncated IS (value: the factor on the bound, 1 = the bound itself; "
    "plus learning_grad_arith). Sequence TIS with cap U: E_q[min(ρ, U)·A·G] = E_q[ρ·A·G] − E_q[(ρ − U)_+·A·G] and "
    "E_q[ρ·A·G] = ∇J (q > 0 wherever π > 0), so ‖bias‖ ≤ Σ_s q(s)(ρ(s) − U)_+ |A(s)| ‖G(s)‖. Token TIS: "
    "E_q[Σ_t min(ρ_t, U) A g_t] = ∇J + D − T with D = Σ_s Σ_t (q(s)ρ_t(s) − π(s)) A(s) g_t(s) (token IS reweights "
    "a token's own probability only, not its prefix's or suffix's) and T = Σ_s q(s) Σ_t (ρ_t(s) − U)_+ A(s) "
    "g_t(s), so ‖bias‖ ≤ Σ_s Σ_t (|q(s)ρ_t(s) − π(s)| + q(s)(ρ_t(s) − U)_+) |A(s)| ‖g_t(s)‖ (triangle inequality; "
    "fp8rl.reference.learning.tis_bias_bound). Both divided by ‖∇J‖.",
)

LEARNING_SAMPLE_Z = _register(
    "learning_sample_z",
    4.892,
    "Two-sided z threshold of LEARN-SAMPLE-001 (false-alarm rate α = 1e-6 per case, normal approximation): the "
    "mean over M i.i.d. sampled rollouts of the sequence-IS-corrected gradient's projection on ∇J, "
    "r(s) = ρ̂(s)·A(s)·⟨G(s), ∇J⟩/‖∇J‖², has expectation exactly 1 when the reported log-probs are those of the "
    "distribution sampled from (E_q[(π/q)·A·G] = ∇J); |mean − 1| / (sd/√M) ≤ 4.892 = Φ⁻¹(1 − 5e-7). M = 4096 and "
    "bounded r (|ρ̂| ≤ e^(H·max|δ|)) make the CLT approximation adequate; the float32 reported log-probs move the "
    "mean by ≤ (2H + 2)·u32 relative, far below the standard error.",
)
