"""Tolerances of area learning: exact policy gradients of the enumerable toy policy (fp8rl.reference.learning,
docs/learning-parity.md).
"""

from __future__ import annotations

from fp8rl.reference.bounds import UNIT_ROUNDOFF, eval_slack

from ._registry import _register

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
