"""Exact comparisons (bit-exact checks) — recorded so the table is complete — and the slack with which every
bound function of the table is evaluated in fp64 (the foundation of the formats, quantization and GEMM
entries that follow).
"""

from __future__ import annotations

from fp8rl.reference.bounds import EVAL_SLACK_EXTRA_OPS

from ._registry import _register

EXACT = _register(
    "exact",
    0.0,
    "Bit-exact: the spec fixes the result (an FP8 cast with a declared rounding/overflow policy, codes and scales "
    "given a ScalePolicy). Any difference is a bug or an undeclared policy.",
)

BOUND_EVAL_SLACK = _register(
    "bound_eval_slack",
    EVAL_SLACK_EXTRA_OPS,
    "Bounds are evaluated in fp64 floating point, so the computed number must be inflated to stay rigorous. A "
    "bound built from a sum S = Σ_{k≤n} p_k of n non-negative fp64 terms, each a product of ≤ 4 factors, and ≤ 4 "
    "further operations has computed value B̂ = B·(1+θ), |θ| ≤ γ_{n+8}(2^-53) (Higham Lemma 3.1; value: the 8 extra "
    "operations). Multiplying B̂ by eval_slack(n) = 1 + 2·γ_{n+8}(2^-53) ≥ 1/(1 − γ_{n+8}) gives a number ≥ B. "
    "For n = 0 (elementwise bounds) the factor is 1 + 1.8e-15. Formula: fp8rl.reference.bounds.eval_slack.",
)
