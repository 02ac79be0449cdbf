"""Hypothesis strategies for the rollout-correction area (batches of log-probs, IS and RS configurations).

Design: log-probs are drawn on a dyadic grid (multiples of 1/64), so δ = lo − lr and short row sums are exact
in fp32 and an fp32 engine differs from the fp64 oracle only by its exp/sum roundings. Thresholds are drawn at
e^{(j + ½)/64}: their logs sit half a grid step away from every token log-ratio, which keeps token-level
keep/reject decisions far from ties (row means can still land near a threshold; checks treat such decisions as
ambiguous). Covered: asymmetric IcePop / k1 bounds, single-token rows, empty (all-padding) rows, garbage and
non-finite padding, extreme values (log-probs −1e4, |δ| far beyond the ±20 safety clamp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from fp8rl.reference.correction import RS_OPTIONS, CorrectionConfig
from hypothesis import strategies as st

GRID = 64.0


@dataclass
class Batch:
    """One correction input: (B, T) float32 log-probs and a 0/1 mask (float32 or int64)."""

    train_logp: torch.Tensor
    rollout_logp: torch.Tensor
    mask: torch.Tensor
    seed: int

    def describe(self) -> str:
        n = self.mask.sum(-1).tolist()
        return f"batch B={self.mask.shape[0]} T={self.mask.shape[1]} row lengths {n} seed {self.seed}"


def make_batch(seed: int, rows: int, cols: int, *, max_delta: float = 4.0, max_nll: float = 8.0,
               empty_rows: bool = True, single_token: bool = True, pad: str = "finite",
               mask_dtype: torch.dtype = torch.float32, extreme: bool = False) -> Batch:
    """A seeded batch. ``pad``: "finite" (garbage in [-50, 5]), "zero", "nonfinite" (−inf / NaN at padding).
    ``extreme``: some valid tokens get log-probs −1e4 or |δ| up to 1e4 (beyond the ±20 clamp)."""
    r = np.random.default_rng(seed)
    lengths = r.integers(1, cols + 1, size=rows)
    if single_token and rows > 1:
        lengths[r.integers(0, rows)] = 1
    if empty_rows and rows > 1 and r.random() < 0.5:
        lengths[r.integers(0, rows)] = 0
    if lengths.sum() == 0:
        lengths[0] = 1
    mask = (np.arange(cols)[None, :] < lengths[:, None]).astype(np.float64)
    lr = -np.round(r.random((rows, cols)) * max_nll * GRID) / GRID
    # δ: mostly small, a few large (within max_delta), on the grid
    d = np.round(r.standard_normal((rows, cols)) * (max_delta / 3) * GRID) / GRID
    d = np.clip(d, -max_delta, max_delta)
    lo = lr + d
    if extreme:
        pick = r.random((rows, cols))
        lo = np.where(pick < 0.1, -1e4, lo)
        lr = np.where((pick >= 0.1) & (pick < 0.2), -1e4, lr)
        lo = np.where((pick >= 0.2) & (pick < 0.25), -0.5, lo)
        lr = np.where((pick >= 0.2) & (pick < 0.25), -3e3, lr)
    if pad == "finite":
        padv_lo, padv_lr = r.uniform(-50, 5, (rows, cols)), r.uniform(-50, 5, (rows, cols))
    elif pad == "zero":
        padv_lo = padv_lr = np.zeros((rows, cols))
    elif pad == "nonfinite":
        padv_lo = np.where(r.random((rows, cols)) < 0.5, -np.inf, np.nan)
        padv_lr = np.where(r.random((rows, cols)) < 0.7, -np.inf, np.nan)
    else:
        raise ValueError(f"pad: expected 'finite', 'zero' or 'nonfinite', got {pad!r}")
    lo = np.where(mask > 0, lo, padv_lo)
    lr = np.where(mask > 0, lr, padv_lr)
    return Batch(torch.from_numpy(lo.astype(np.float32)), torch.from_numpy(lr.astype(np.float32)),
                 torch.from_numpy(mask).to(mask_dtype), seed)


@st.composite
def batches(draw, *, max_rows: int = 6, max_cols: int = 24, max_delta: float = 4.0, pad: str = "finite",
            empty_rows: bool = True, extreme: bool = False) -> Batch:
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, max_cols))
    seed = draw(st.integers(0, 2**31 - 1))
    mask_dtype = draw(st.sampled_from([torch.float32, torch.int64]))
    return make_batch(seed, rows, cols, max_delta=max_delta, pad=pad, empty_rows=empty_rows,
                      mask_dtype=mask_dtype, extreme=extreme)


def _off_grid(j: int) -> float:
    """e^{(j + ½)/64}: a threshold whose log is half a grid step from every grid log-ratio."""
    return math.exp((j + 0.5) / GRID)


def tis_thresholds() -> st.SearchStrategy[float]:
    """TIS upper bounds U in (1.008, ~12]."""
    return st.integers(0, 160).map(_off_grid)


def icepop_bounds() -> st.SearchStrategy[str]:
    """IcePop "lo_hi" strings, asymmetric in log space (lo and hi drawn independently; both may be < 1 or > 1)."""
    return st.tuples(st.integers(-160, 40), st.integers(0, 160)).map(
        lambda ab: (min(ab), max(ab))).map(lambda ab: f"{_off_grid(ab[0])!r}_{_off_grid(ab[1])!r}")


def k1_bounds(symmetric: bool | None = None) -> st.SearchStrategy[str]:
    """k1 ratio bounds: "lo_hi" (asymmetric unless symmetric=True) or a bare float hi (lo = 1/hi)."""
    sym = st.integers(0, 160).map(lambda j: f"{_off_grid(j)!r}")
    asym = st.tuples(st.integers(-200, 60), st.integers(-60, 200)).filter(lambda ab: ab[0] + ab[1] != -1).map(
        lambda ab: (min(ab), max(ab))).map(lambda ab: f"{_off_grid(ab[0])!r}_{_off_grid(ab[1])!r}")
    if symmetric is True:
        return sym
    if symmetric is False:
        return asym
    return st.one_of(sym, asym)


def upper_bounds(option: str) -> st.SearchStrategy[str]:
    """k2/k3 upper bounds, scaled to the option's typical statistic size (sums are larger than means)."""
    top = 400 if option.startswith("seq_sum") else 200
    return st.integers(-300, top).map(lambda j: repr(_off_grid(j)))


@st.composite
def rs_specs(draw, *, k1: bool | None = None, symmetric: bool | None = None, max_options: int = 3
             ) -> tuple[str, str]:
    """(rollout_rs, rollout_rs_threshold): 1..max_options distinct options with one threshold each.
    ``k1``: True only k1 options, False no k1 options, None any."""
    pool = [o for o in RS_OPTIONS if k1 is None or o.endswith("k1") == k1]
    opts = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=max_options, unique=True))
    thr = [draw(k1_bounds(symmetric)) if o.endswith("k1") else draw(upper_bounds(o)) for o in opts]
    return ",".join(opts), ",".join(thr)


@st.composite
def is_configs(draw, *, levels=("token", "sequence"), icepop: bool | None = None, normalize: bool | None = None
               ) -> CorrectionConfig:
    level = draw(st.sampled_from(list(levels)))
    use_icepop = draw(st.booleans()) if icepop is None else icepop
    thr = draw(icepop_bounds()) if use_icepop else draw(tis_thresholds())
    norm = draw(st.booleans()) if normalize is None else normalize
    return CorrectionConfig(rollout_is=level, rollout_is_threshold=thr, rollout_is_batch_normalize=norm)


__all__ = ["Batch", "batches", "icepop_bounds", "is_configs", "k1_bounds", "make_batch", "rs_specs",
           "tis_thresholds", "upper_bounds"]
