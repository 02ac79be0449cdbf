"""Tolerances of area correction (rollout correction): IS weights, rejection-sampling statistics, keep/reject
decision bands, mismatch metrics (with the per-metric magnitude model :func:`corr_metric_magnitudes`),
runs compared pairwise, ESS, policy loss, the decoupled-PPO proximal log-prob and the KL-estimator statistics.
"""

from __future__ import annotations

import math

from fp8rl.reference.bounds import UNIT_ROUNDOFF, eval_slack, gamma
from fp8rl.reference.bounds import dtype_name as _dtype_name

from ._registry import _register

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
