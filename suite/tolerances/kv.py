"""Tolerances of area kv (FP8 KV cache): attention arithmetic on FP8 operands, FP8 attention vs unquantized
attention, and the drift simulator's factors against fresh scales.
"""

from __future__ import annotations

from fp8rl.reference.bounds import MIN_SUBNORMAL, UNIT_ROUNDOFF, eval_slack, gamma
from fp8rl.reference.bounds import dtype_name as _dtype_name

from ._registry import _register

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
