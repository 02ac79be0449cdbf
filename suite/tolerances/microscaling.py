"""Tolerances of microscaling (MXFP8, MXFP4, NVFP4: fp8rl.reference.microscaling): the element round trip and
microscaled GEMMs.
"""

from __future__ import annotations

from fp8rl.reference.bounds import eval_slack

from ._registry import _register

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
