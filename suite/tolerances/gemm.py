"""Tolerances of area gemm: scaled FP8 GEMMs with fp32 accumulation, and the agreement of two fp64 evaluations.
"""

from __future__ import annotations

from fp8rl.reference.bounds import GEMM_PRODUCT_ROUNDINGS, UNIT_ROUNDOFF, eval_slack, gamma

from ._registry import _register

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
