"""Floating-point error-bound formulas of the oracle: unit roundoffs, Higham's γ_n, the slack of bounds evaluated in
fp64, and the rigorous elementwise bound of fp32-accumulating scaled FP8 GEMMs.

Each function is small and pure; its docstring is the formula. The harness's tolerance table (:mod:`fp8rl.tolerances`)
imports them from here and registers the named entries with their derivations (``bound_eval_slack``,
``gemm_fp32_product_roundings``, ``gemm_fp32_accum``); the oracle itself never imports the harness.

Unit roundoff notation: for a binary floating-point format with p significand bits (implicit bit included),
u = 2^-p is the maximal relative error of round-to-nearest; fp32 p = 24, bf16 p = 8, fp16 p = 11, fp64 p = 53.

Needs only torch.
"""

from __future__ import annotations

import math

import torch

__all__ = ["EVAL_SLACK_EXTRA_OPS", "GEMM_PRODUCT_ROUNDINGS", "MAX_FINITE", "MIN_SUBNORMAL", "UNIT_ROUNDOFF",
           "dtype_name", "eval_slack", "gamma", "gemm_fp32_accum_bound"]

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
#: largest finite value of each output/accumulation format (a result beyond it rounds to inf: no bound holds)
MAX_FINITE: dict[str, float] = {
    "float64": 1.7976931348623157e308,
    "float32": 3.4028234663852886e38,
    "bfloat16": 3.3895313892515355e38,
    "float16": 65504.0,
}

#: operations beyond an n-term sum that a bound evaluated in fp64 may contain (the 8 of eval_slack's γ_{n+8};
#: tolerance ``bound_eval_slack``)
EVAL_SLACK_EXTRA_OPS = 8

#: c: fp32 roundings one product term a_k·w_k of a scaled FP8 GEMM may undergo before it enters the K-sum
#: (dequantize-then-matmul: code·s_a, code·s_w and their product; tolerance ``gemm_fp32_product_roundings``)
GEMM_PRODUCT_ROUNDINGS = 3


def dtype_name(dtype) -> str:
    """'float32' for torch.float32 / 'float32' / numpy float32 (KeyError-free names of UNIT_ROUNDOFF)."""
    name = str(dtype).replace("torch.", "")
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {sorted(UNIT_ROUNDOFF)}, got {dtype!r}")
    return name


def gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 − n·u) (Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1); inf if n·u ≥ 1.

    |Π_{i≤n}(1+δ_i)^{±1} − 1| ≤ γ_n when every |δ_i| ≤ u and n·u < 1. Recursive summation of n terms in a
    format with unit roundoff u, in any order, has |fl(Σx) − Σx| ≤ γ_{n−1}·Σ|x| (Higham eq. 4.4).
    """
    if n * u >= 1:
        return math.inf
    return n * u / (1 - n * u)


def eval_slack(n: int = 0) -> float:
    """1 + 2·γ_{n+8}(2^-53): inflation of a bound evaluated in fp64 from n-term sums (``bound_eval_slack``).

    A bound B built from a sum of n non-negative fp64 terms (each a product of ≤ 4 factors) and ≤ 8 further
    operations is computed as B̂ = B·(1+θ), |θ| ≤ γ_{n+8}(2^-53); B̂·(1 + 2·γ_{n+8}) ≥ B̂/(1 − γ_{n+8}) ≥ B.
    """
    return 1 + 2 * gamma(int(n) + EVAL_SLACK_EXTRA_OPS, UNIT_ROUNDOFF["float64"])


def gemm_fp32_accum_bound(abs_y_exact, sum_abs_products, k: int, out_dtype="float32", accum_dtype="float32",
                          underflow_mass=0.0):
    """Rigorous elementwise bound on |y_impl − y_exact| for a scaled FP8 GEMM (tolerance ``gemm_fp32_accum``).

    For any implementation that forms each product a_k·w_k with at most c = 3 roundings in ``accum_dtype``
    (:data:`GEMM_PRODUCT_ROUNDINGS`), accumulates the K terms in ``accum_dtype`` in any order/grouping and rounds
    once to ``out_dtype`` (u: unit roundoff, η: smallest subnormal):

        acc_err ≤ γ_{K+c}(u_acc)·Σ_k |a_k||w_k| + c·η_acc·Σ_k max(1,|q_a|)·max(1,|q_w|)·max(1,s_a)·max(1,s_w)
        total   = (acc_err + u_out·(|y| + acc_err) + η_out/2)·eval_slack(K)   (no final term if out = accum)

    and inf where |y| + acc_err ≥ min(max finite of out_dtype, of accum_dtype) (the result can overflow).

    ``abs_y_exact``: |y| exact (fp64 tensor), ``sum_abs_products``: Σ_k |a_k|·|w_k| of the exact dequantized
    operands, ``k``: the reduction length, ``underflow_mass``: Σ_k max(1,|q_a|)·max(1,|q_w|)·max(1,s_a)·max(1,s_w)
    (q: FP8 values, s: scales; 0 to ignore underflow). Returns an fp64 tensor.
    """
    acc = dtype_name(accum_dtype)
    out = dtype_name(out_dtype)
    c = GEMM_PRODUCT_ROUNDINGS
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
