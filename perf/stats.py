"""Bootstrap statistics of the perf gate: throughput ratios with confidence intervals.

``paired_speedup`` takes the per-pair log speedup ``log(cand/base)`` of runs that ran back to back and reports the
geometric-mean speedup; ``unpaired_ratio`` the ratio of geometric means of two independent samples (a regression
against a baseline file). Both CIs come from ``scipy.stats.bootstrap`` (BCa by default, falling back to the
percentile method when BCa fails) with a fixed seed, so the same samples always give the same interval.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

__all__ = ["Estimate", "paired_speedup", "unpaired_ratio"]


@dataclass(frozen=True)
class Estimate:
    point: float
    lo: float
    hi: float
    n: int
    confidence: float
    method: str


def _bootstrap_mean_ci(samples: tuple[np.ndarray, ...], statistic, confidence: float, n_resamples: int, seed: int,
                       method: str, paired: bool = False) -> tuple[float, float, str]:
    from scipy import stats

    flat = np.concatenate(samples)
    if np.allclose(flat, flat[0], rtol=0, atol=1e-15) and len(samples) == 1:
        return float(flat[0]), float(flat[0]), "degenerate"
    methods = [method] + (["percentile"] if method.lower() != "percentile" else [])
    for m in methods:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                res = stats.bootstrap(samples, statistic, confidence_level=confidence, n_resamples=n_resamples,
                                      method=m, paired=paired, vectorized=True,
                                      random_state=np.random.default_rng(seed))
            except (ValueError, FloatingPointError):
                continue
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, m
    return float("nan"), float("nan"), "failed"


def paired_speedup(base: list[float] | np.ndarray, cand: list[float] | np.ndarray, confidence: float = 0.95,
                   n_resamples: int = 9999, seed: int = 0, method: str = "BCa") -> Estimate:
    """Geometric-mean speedup cand/base over pairs, with a bootstrap CI (resampling pairs)."""
    b = np.asarray(base, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    if b.shape != c.shape or b.ndim != 1:
        raise ValueError("paired_speedup: base and cand must be 1-D and the same length")
    if np.any(b <= 0) or np.any(c <= 0):
        raise ValueError("paired_speedup: throughputs must be positive")
    n = len(b)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, confidence, "none")
    d = np.log(c) - np.log(b)
    point = float(np.exp(d.mean()))
    if n < 2:
        return Estimate(point, float("nan"), float("nan"), n, confidence, "none")
    lo, hi, m = _bootstrap_mean_ci((d,), lambda x, axis=-1: np.mean(x, axis=axis), confidence, n_resamples, seed,
                                   method)
    return Estimate(point, math.exp(lo) if math.isfinite(lo) else lo, math.exp(hi) if math.isfinite(hi) else hi, n,
                    confidence, m)


def unpaired_ratio(base: list[float] | np.ndarray, cand: list[float] | np.ndarray, confidence: float = 0.95,
                   n_resamples: int = 9999, seed: int = 0, method: str = "BCa") -> Estimate:
    """Ratio of geometric means cand/base of two independent samples, with a bootstrap CI."""
    lb = np.log(np.asarray(base, dtype=np.float64))
    lc = np.log(np.asarray(cand, dtype=np.float64))
    if len(lb) == 0 or len(lc) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, confidence, "none")
    point = float(np.exp(lc.mean() - lb.mean()))
    n = min(len(lb), len(lc))
    if n < 2:
        return Estimate(point, float("nan"), float("nan"), n, confidence, "none")
    if np.ptp(lb) == 0 and np.ptp(lc) == 0:
        return Estimate(point, point, point, n, confidence, "degenerate")

    def stat(x, y, axis=-1):
        return np.mean(y, axis=axis) - np.mean(x, axis=axis)

    lo, hi, m = _bootstrap_mean_ci((lb, lc), stat, confidence, n_resamples, seed, method)
    return Estimate(point, math.exp(lo) if math.isfinite(lo) else lo, math.exp(hi) if math.isfinite(hi) else hi, n,
                    confidence, m)
