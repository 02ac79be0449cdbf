"""Rollout correction oracle: importance-sampling (IS) weights, rejection sampling (RS), loss helpers and
mismatch metrics for FP8 (or any low-precision) rollouts.

An independent implementation of the spec written down in ``docs/verl-correction.md`` §1–§2 and the FP8-RL report
(arXiv 2601.18150, §3): it neither imports nor copies veRL. Everything is computed in float64 on sanitized
inputs; tensors come back in the input dtype, metrics as Python floats.

Notation (per row i, token t): ``m`` the response mask (1 valid, 0 padding); ``lo`` = log π_train (veRL's
``old_log_prob``); ``lr`` = log π_rollout; δ = lo − lr = log ρ with ρ = π_train / π_rollout; ``C(x)`` =
clamp(x, −20, 20) (the safety clamp, e^20 ≈ 4.85e8). A row is *valid* if it has at least one valid token.
Values at padding positions (m = 0) are never read: they may be −inf or NaN.

IS weights (``rollout_is``; all detached, zero on padding):

* ``"token"``     w_t = exp(C(δ_t))
* ``"sequence"``  w_i = exp(C(Σ_t δ_t)) — product of token ratios, clamp applied to the *sum* — broadcast
* ``"geometric"`` w_i = exp(C(mean_t δ_t)) — geometric-mean ratio — broadcast

then ``rollout_is_threshold``: a float U gives TIS, w = min(w, U) (no lower truncation); ``"lo_hi"`` (or a
(lo, hi) pair) gives IcePop/MIS, w kept iff lo ≤ w ≤ hi, else 0 — the mask is not changed; lo = 0 ("0_hi") is MIS
with an upper bound only (TRL's ``*_mask`` modes without ``clip_min``). Optional batch
normalization divides by μ (token level: mean over valid tokens; sequence/geometric level: mean of the row
weights over valid rows) when μ > 1e-8; it is applied after truncation, and the IS metrics are taken before it.

RS (``rollout_rs``, comma list, AND-combined; only the mask changes, never the weights), on δs = C(δ_t) per token:
k1 = δs (log-ratio), k2 = ½δs², k3 = e^δs − 1 − δs at levels ``token_kX``, ``seq_sum_kX`` (row sum),
``seq_mean_kX`` (row mean) and ``seq_max_k2/k3`` (row max). k1 options take ratio bounds "lo_hi" (a bare float
hi means lo = 1/hi) and keep iff log lo ≤ stat ≤ log hi — i.e. lo ≤ ρ_t, lo ≤ Π_t ρ_t, lo ≤ (Π_t ρ_t)^(1/T) ≤ hi
by level; k2/k3 options take an upper bound U and keep iff stat ≤ U. A sequence option rejects whole rows.
Historical veto (``rollout_token_veto_threshold`` τ, Nov 2025–Jan 2026): reject a whole row if any valid token
has ρ_t < τ (tested as δ_t < log τ on the unclamped δ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

SAFETY_BOUND = 20.0
#: μ ≤ this disables batch normalization (factor reported as 1.0)
NORM_EPS = 1e-8

IS_LEVELS = ("token", "sequence", "geometric")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_KINDS = ("ppo_clip", "reinforce")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

#: metrics that are exp(−mean log p) of one policy (not ratios): they overflow to inf for mean log p < −709
PERPLEXITY_METRICS = ("training_ppl", "rollout_ppl")


# ----------------------------------------------------------------------------------------------------------------
# configuration


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a positive number, got bool {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a positive number, got {value!r}") from None
    if not (v > 0) or math.isinf(v):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return v


def _nonnegative(name: str, value: Any) -> float:
    """A lower bound of an IS band: 0 is allowed (MIS with an upper bound only), negatives are not."""
    try:
        if not isinstance(value, bool) and float(value) == 0.0:
            return 0.0
    except (TypeError, ValueError):
        pass
    return _positive(name, value)


def parse_is_threshold(spec: Any) -> tuple[float | None, float]:
    """``rollout_is_threshold`` → (lower or None for TIS, upper). Floats and float strings are TIS; ``"lo_hi"``
    strings and (lo, hi) pairs are IcePop bounds, and a lower bound 0 (``"0_hi"``) is masked IS (MIS) with an upper
    bound only: w kept iff w ≤ hi. Bools, non-positive upper bounds, negative lower bounds and lo > hi are
    errors."""
    name = "rollout_is_threshold"
    if isinstance(spec, bool):
        raise TypeError(f"{name}: expected a positive float (TIS) or a 'lo_hi' string (IcePop), got bool {spec!r}")
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"{name}: expected a (lo, hi) pair, got {len(spec)} values {spec!r}")
        lo, hi = _nonnegative(f"{name} lower bound", spec[0]), _positive(f"{name} upper bound", spec[1])
    elif isinstance(spec, str):
        s = spec.strip()
        if not s:
            raise ValueError(f"{name}: expected a positive float or a 'lo_hi' string, got an empty string")
        if "_" in s:
            a, b = s.split("_", 1)
            lo, hi = _nonnegative(f"{name} lower bound", a), _positive(f"{name} upper bound", b)
        else:
            return None, _positive(name, s)
    elif isinstance(spec, (int, float)):
        return None, _positive(name, spec)
    else:
        raise TypeError(f"{name}: expected a positive float or a 'lo_hi' string, got {type(spec).__name__}")
    if lo > hi:
        raise ValueError(f"{name}: expected lower bound ≤ upper bound, got lo={lo:g} > hi={hi:g}")
    return lo, hi


def parse_rs(options: Any, thresholds: Any) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` + ``rollout_rs_threshold`` → {option: (lower or None, upper)} in the given order.

    Options: a comma list (or sequence) of :data:`RS_OPTIONS`, duplicates dropped. Thresholds: a comma list (or
    sequence) with one entry per option or a single entry broadcast to all. k1 entries are ratio bounds "lo_hi"
    (or a (lo, hi) pair; a bare float hi means lo = 1/hi); k2/k3 entries are one positive upper bound.
    """
    if isinstance(options, str):
        opts = [o.strip() for o in options.split(",") if o.strip()]
    elif isinstance(options, Sequence):
        opts = [str(o).strip() for o in options]
    else:
        raise TypeError(f"rollout_rs: expected a comma-separated string of options, got {type(options).__name__}")
    if not opts:
        raise ValueError(f"rollout_rs: expected at least one option from {RS_OPTIONS}, got {options!r}")
    seen: list[str] = []
    for o in opts:
        if o not in RS_OPTIONS:
            raise ValueError(f"rollout_rs: unknown option {o!r}; expected one of {RS_OPTIONS}")
        if o not in seen:
            seen.append(o)
    if thresholds is None:
        raise ValueError(f"rollout_rs_threshold: required when rollout_rs is set ({','.join(seen)}); got None")
    if isinstance(thresholds, bool):
        raise TypeError(f"rollout_rs_threshold: expected numbers or 'lo_hi' strings, got bool {thresholds!r}")
    if isinstance(thresholds, str):
        specs: list[Any] = [t.strip() for t in thresholds.split(",") if t.strip()]
    elif isinstance(thresholds, (int, float)):
        specs = [thresholds]
    elif isinstance(thresholds, Sequence):
        specs = list(thresholds)
    else:
        raise TypeError(f"rollout_rs_threshold: expected a string, number or sequence, got {type(thresholds).__name__}")
    if len(specs) not in (1, len(seen)):
        raise ValueError(f"rollout_rs_threshold: expected 1 or {len(seen)} entries (one per rollout_rs option), "
                         f"got {len(specs)}: {thresholds!r}")
    if len(specs) == 1:
        specs = specs * len(seen)
    out: dict[str, tuple[float | None, float]] = {}
    for o, spec in zip(seen, specs):
        name = f"rollout_rs_threshold[{o}]"
        if isinstance(spec, bool):
            raise TypeError(f"{name}: expected a number or 'lo_hi' string, got bool {spec!r}")
        if o.endswith("k1"):
            if isinstance(spec, (tuple, list)):
                if len(spec) != 2:
                    raise ValueError(f"{name}: expected a (lo, hi) pair, got {spec!r}")
                lo, hi = _positive(f"{name} lower bound", spec[0]), _positive(f"{name} upper bound", spec[1])
            elif isinstance(spec, str) and "_" in spec:
                a, b = spec.split("_", 1)
                lo, hi = _positive(f"{name} lower bound", a), _positive(f"{name} upper bound", b)
            else:
                hi = _positive(name, spec)
                lo = 1.0 / hi
            if lo > hi:
                raise ValueError(f"{name}: expected lower bound ≤ upper bound, got lo={lo:g} > hi={hi:g}")
            out[o] = (lo, hi)
        else:
            if isinstance(spec, (tuple, list)) or (isinstance(spec, str) and "_" in spec):
                raise ValueError(f"{name}: {o} takes a single positive upper bound, got the bounds {spec!r}")
            out[o] = (None, _positive(name, spec))
    return out


@dataclass(frozen=True)
class CorrectionConfig:
    """The documented rollout-correction knobs (veRL ``algorithm.rollout_correction`` names), validated.

    ``rollout_is``: None (no weights), "token", "sequence" or "geometric". ``rollout_is_threshold``: float U
    (TIS) or "lo_hi" / (lo, hi) (IcePop). ``rollout_is_batch_normalize``: normalize the weights to mean 1.
    ``rollout_rs``: None or a comma list of :data:`RS_OPTIONS`; ``rollout_rs_threshold``: required with it.
    ``rollout_token_veto_threshold``: historical veto τ ∈ (0, ∞) or None.

    Defaults are the FP8-RL recipe (token-level TIS, U = 2). veRL's own defaults differ between its YAML
    (``rollout_is: null``) and its dataclass (``"sequence"``), so no default can "match veRL".
    """

    rollout_is: str | None = "token"
    rollout_is_threshold: Any = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    rollout_token_veto_threshold: float | None = None
    #: parsed forms (filled by __post_init__)
    is_bounds: tuple[float | None, float] | None = field(default=None, init=False, compare=False)
    rs_bounds: dict[str, tuple[float | None, float]] = field(default_factory=dict, init=False, compare=False)

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is: unknown level {self.rollout_is!r}; expected None or one of {IS_LEVELS}")
        if not isinstance(self.rollout_is_batch_normalize, bool):
            raise TypeError(f"rollout_is_batch_normalize: expected a bool, got {self.rollout_is_batch_normalize!r}")
        if self.rollout_is is not None:
            if self.rollout_is_threshold is None:
                raise ValueError("rollout_is_threshold: required when rollout_is is set; got None")
            object.__setattr__(self, "is_bounds", parse_is_threshold(self.rollout_is_threshold))
        if self.rollout_rs is not None:
            object.__setattr__(self, "rs_bounds", parse_rs(self.rollout_rs, self.rollout_rs_threshold))
        elif self.rollout_rs_threshold is not None:
            raise ValueError(f"rollout_rs_threshold: given ({self.rollout_rs_threshold!r}) but rollout_rs is None")
        if self.rollout_token_veto_threshold is not None:
            _positive("rollout_token_veto_threshold", self.rollout_token_veto_threshold)

    @property
    def icepop(self) -> bool:
        return self.is_bounds is not None and self.is_bounds[0] is not None

    @property
    def is_upper(self) -> float | None:
        return None if self.is_bounds is None else self.is_bounds[1]

    @property
    def is_lower(self) -> float | None:
        """IcePop lower bound, or 1/U for TIS (the "low" fraction's threshold)."""
        if self.is_bounds is None:
            return None
        lo, hi = self.is_bounds
        return lo if lo is not None else 1.0 / hi


@dataclass
class CorrectionResult:
    """What a rollout-correction op returns.

    ``weights``: (B, T) detached IS weights (zero on padding), or None when ``rollout_is`` is None.
    ``mask``: (B, T) response mask after rejection sampling (same dtype as the input mask).
    ``metrics``: name → float, the suite's canonical metric names (see :func:`compute_metrics`).
    """

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class LossConfig:
    """Policy-loss knobs: PPO-clip with dual clip, or REINFORCE; both multiply the per-token loss by w."""

    kind: str = "ppo_clip"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    agg: str = "token-mean"

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"kind: unknown loss {self.kind!r}; expected one of {LOSS_KINDS}")
        if self.agg not in LOSS_AGG_MODES:
            raise ValueError(f"agg: unknown aggregation {self.agg!r}; expected one of {LOSS_AGG_MODES}")
        if isinstance(self.clip_ratio_low, bool) or not 0 <= float(self.clip_ratio_low) < 1:
            raise ValueError(f"clip_ratio_low: expected a float in [0, 1), got {self.clip_ratio_low!r}")
        if isinstance(self.clip_ratio_high, bool) or not float(self.clip_ratio_high) >= 0:
            raise ValueError(f"clip_ratio_high: expected a float ≥ 0, got {self.clip_ratio_high!r}")
        if isinstance(self.clip_ratio_c, bool) or not float(self.clip_ratio_c) > 1.0:
            raise ValueError(f"clip_ratio_c: expected a float > 1 (dual-clip bound), got {self.clip_ratio_c!r}")


# ----------------------------------------------------------------------------------------------------------------
# input validation and masked helpers (float64)


def validate_inputs(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
    for name, t in (("train_logp", train_logp), ("rollout_logp", rollout_logp), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D (batch, response_length) tensor, got shape {tuple(t.shape)}")
    if train_logp.shape != rollout_logp.shape or train_logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: train_logp {tuple(train_logp.shape)}, rollout_logp "
                         f"{tuple(rollout_logp.shape)} and mask {tuple(mask.shape)} must be equal")
    mb = mask.detach()
    if not bool(((mb == 0) | (mb == 1)).all()):
        raise ValueError("mask: expected only 0/1 values")
    if not bool((mb != 0).any()):
        raise ValueError("mask: expected at least one valid token (1), got all zeros")


def _sanitize(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float64 copy with padding positions set to 0 (so −inf/NaN there never propagate)."""
    return torch.where(m, x.detach().double(), torch.zeros((), dtype=torch.float64))


def _mm(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Masked mean over all valid tokens (m has ≥ 1 valid token)."""
    return torch.where(m, x, 0.0).sum() / m.sum()


def _row_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, 0.0).sum(-1)


def _row_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per-row masked mean; 0 for a row without valid tokens."""
    n = m.sum(-1)
    return torch.where(n > 0, _row_sum(x, m) / n.clamp_min(1), 0.0)


def _row_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    out = torch.where(m, x, -math.inf).amax(-1)
    return torch.where(m.any(-1), out, 0.0)


def log_ratio(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """δ = log π_train − log π_rollout in float64, 0 at padding."""
    m = mask.detach() != 0
    return torch.where(m, _sanitize(train_logp, m) - _sanitize(rollout_logp, m), 0.0)


# ----------------------------------------------------------------------------------------------------------------
# IS weights


def raw_log_weights(delta: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    """log of the raw (pre-truncation, post safety clamp) IS weight, broadcast to (B, T)."""
    if level == "token":
        lw = delta
    elif level == "sequence":
        lw = _row_sum(delta, m).unsqueeze(-1).expand_as(delta)
    elif level == "geometric":
        lw = _row_mean(delta, m).unsqueeze(-1).expand_as(delta)
    else:
        raise ValueError(f"rollout_is: unknown level {level!r}; expected one of {IS_LEVELS}")
    return lw.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def is_weights(delta: torch.Tensor, m: torch.Tensor, cfg: CorrectionConfig) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       float | None]:
    """(applied weights after truncation/IcePop and optional batch norm, raw weights, batch-norm factor μ)."""
    assert cfg.rollout_is is not None and cfg.is_bounds is not None
    raw = torch.where(m, torch.exp(raw_log_weights(delta, m, cfg.rollout_is)), 0.0)
    lo, hi = cfg.is_bounds
    if lo is None:
        w = raw.clamp(max=hi)
    else:
        w = torch.where((raw >= lo) & (raw <= hi), raw, 0.0)
    w = torch.where(m, w, 0.0)
    factor = None
    if cfg.rollout_is_batch_normalize:
        factor = batch_norm_factor(w, m, cfg.rollout_is)
        if factor > NORM_EPS:
            w = w / factor
        else:
            factor = 1.0
    return w, raw, factor


def batch_norm_factor(w: torch.Tensor, m: torch.Tensor, level: str) -> float:
    """μ: mean of w over valid tokens (token level) or of the row weights over valid rows (sequence levels)."""
    if level == "token":
        return float(_mm(w, m))
    valid = m.any(-1)
    row_w = _row_mean(w, m)
    return float(row_w[valid].mean())


# ----------------------------------------------------------------------------------------------------------------
# rejection sampling


def rs_token_stats(delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token k1 (log-ratio), k2 = ½δs², k3 = e^δs − 1 − δs on the clamped δs."""
    ds = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": ds, "k2": 0.5 * ds * ds, "k3": torch.expm1(ds) - ds}


def rs_keep(delta: torch.Tensor, m: torch.Tensor, option: str, bounds: tuple[float | None, float]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep (B, T) bool broadcast over the row for sequence options, the statistic (B, T))."""
    kind = option[-2:]
    stat_tok = rs_token_stats(delta)[kind]
    if option.startswith("token_"):
        stat = stat_tok
    elif option.startswith("seq_sum_"):
        stat = _row_sum(stat_tok, m).unsqueeze(-1).expand_as(delta)
    elif option.startswith("seq_mean_"):
        stat = _row_mean(stat_tok, m).unsqueeze(-1).expand_as(delta)
    elif option.startswith("seq_max_"):
        stat = _row_max(stat_tok, m).unsqueeze(-1).expand_as(delta)
    else:
        raise ValueError(f"rollout_rs: unknown option {option!r}; expected one of {RS_OPTIONS}")
    lo, hi = bounds
    if kind == "k1":
        assert lo is not None
        keep = (stat >= math.log(lo)) & (stat <= math.log(hi))
    else:
        keep = stat <= hi
    return keep, stat


def veto_keep(delta: torch.Tensor, m: torch.Tensor, tau: float) -> torch.Tensor:
    """Historical veto: reject a whole row if any valid token has δ < log τ (unclamped)."""
    bad = (m & (delta < math.log(tau))).any(-1, keepdim=True)
    return (~bad).expand_as(delta)


# ----------------------------------------------------------------------------------------------------------------
# metrics


def offpolicy_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mismatch diagnostics on the *original* mask. Rows without valid tokens never contribute.

    ``kl_k1`` = mean_t (lr − lo) (k1 estimate of KL(π_rollout‖π_train), may be negative); ``kl_k3`` =
    mean_t (e^C(δ) − 1 − C(δ)) (k3, ≥ 0); ``training_ppl``/``rollout_ppl`` = mean over valid rows of
    exp(−mean_t log p); ``*_log_ppl`` the same without exp; ``log_ppl_diff`` = mean_i d_i with d_i =
    mean_t lr − mean_t lo (positive: training PPL higher), ``log_ppl_abs_diff``, ``log_ppl_diff_max/min``;
    ``ppl_ratio`` = mean_i exp(C(d_i)); ``chi2_token`` = mean_t e^{2C(δ)} − 1; ``chi2_seq`` = mean_i
    e^{2C(Σ_t δ)} − 1; probability space: ``probs_diff_max/mean/std`` of |e^lo − e^lr| (std unbiased, 0 for
    one token), ``probs_pearson_corr`` (NaN if either side has zero variance or < 2 tokens); NeMo-RL's
    ``token_mult_prob_error`` = mean_t exp(C(|δ|)) (1.0 is perfect).
    """
    m = mask.detach() != 0
    lo, lr = _sanitize(train_logp, m), _sanitize(rollout_logp, m)
    d = torch.where(m, lo - lr, 0.0)
    dc = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    valid = m.any(-1)
    mlo, mlr = _row_mean(lo, m)[valid], _row_mean(lr, m)[valid]
    di = mlr - mlo
    s = _row_sum(d, m)[valid].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = {
        "kl_k1": float(_mm(lr - lo, m)),
        "kl_k3": float(_mm(torch.expm1(dc) - dc, m)),
        "training_ppl": float(torch.exp(-mlo).mean()),
        "rollout_ppl": float(torch.exp(-mlr).mean()),
        "training_log_ppl": float((-mlo).mean()),
        "rollout_log_ppl": float((-mlr).mean()),
        "log_ppl_diff": float(di.mean()),
        "log_ppl_abs_diff": float(di.abs().mean()),
        "log_ppl_diff_max": float(di.max()),
        "log_ppl_diff_min": float(di.min()),
        "ppl_ratio": float(torch.exp(di.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean()),
        "chi2_token": float(_mm(torch.exp(2 * dc), m) - 1.0),
        "chi2_seq": float(torch.exp(2 * s).mean() - 1.0),
        "token_mult_prob_error": float(_mm(torch.exp(dc.abs()), m)),
    }
    p_tr, p_ro = torch.exp(lo[m]), torch.exp(lr[m])
    diff = (p_tr - p_ro).abs()
    n = diff.numel()
    out["probs_diff_max"] = float(diff.max())
    out["probs_diff_mean"] = float(diff.mean())
    out["probs_diff_std"] = float(diff.std()) if n > 1 else 0.0
    if n > 1:
        x, y = p_tr - p_tr.mean(), p_ro - p_ro.mean()
        den = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
        out["probs_pearson_corr"] = float((x * y).sum()) / den if den > 0 else math.nan
    else:
        out["probs_pearson_corr"] = math.nan
    return out


def is_metrics(w: torch.Tensor, raw: torch.Tensor, delta: torch.Tensor, m: torch.Tensor,
               cfg: CorrectionConfig) -> dict[str, float]:
    """IS diagnostics on the applied weights *before* batch normalization.

    ``is_weight_mean`` = mean_t w (token-weighted at every level); ``is_ess`` = normalized Kish ESS
    (Σw)² / (N Σw²) over valid tokens, in (0, 1], 0 if every weight is 0; ``is_fraction_high`` /
    ``is_fraction_low``: share of raw weights above U / below the lower bound (IcePop lo, else 1/U) — over
    valid tokens at token level, over valid rows (using the row's raw log weight) at sequence levels;
    ``is_oob_fraction`` (IcePop): mean_t 1[raw outside [lo, hi]]; ``is_fraction_truncated`` (TIS):
    mean_t 1[raw > U].
    """
    assert cfg.rollout_is is not None and cfg.is_bounds is not None
    lo_b, hi = cfg.is_bounds
    low = lo_b if lo_b is not None else 1.0 / hi
    out: dict[str, float] = {"is_weight_mean": float(_mm(w, m))}
    s1 = float(torch.where(m, w, 0.0).sum())
    s2 = float(torch.where(m, w * w, 0.0).sum())
    n = float(m.sum())
    out["is_ess"] = (s1 * s1) / (n * s2) if s2 > 0 else 0.0
    if cfg.rollout_is == "token":
        out["is_fraction_high"] = float(_mm((raw > hi).double(), m))
        out["is_fraction_low"] = float(_mm((raw < low).double(), m))
    else:
        valid = m.any(-1)
        lw = raw_log_weights(delta, m, cfg.rollout_is)[:, 0][valid]
        out["is_fraction_high"] = float((lw > math.log(hi)).double().mean())
        out["is_fraction_low"] = float((lw < math.log(low)).double().mean()) if low > 0 else 0.0
    if lo_b is None:
        out["is_fraction_truncated"] = float(_mm((raw > hi).double(), m))
    else:
        out["is_oob_fraction"] = float(_mm(((raw < lo_b) | (raw > hi)).double(), m))
    return out


def weight_extreme_metrics(w: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """Extremes and row mean of the applied weights (before batch normalization), over valid positions only.

    ``is_weight_min`` = min_t w_t, ``is_weight_max`` = max_t w_t over valid tokens (an IcePop/MIS-zeroed token counts
    as 0); ``is_weight_row_mean`` = mean_i (Σ_t m_t w_t / n_i) over valid rows — at sequence levels the mean of the
    row weights w_i, not token-weighted (TRL logs sampling/importance_sampling_ratio/min, /mean (its sequence-mode
    mean), /max)."""
    valid = m.any(-1)
    vals = w[m]
    return {"is_weight_min": float(vals.min()), "is_weight_max": float(vals.max()),
            "is_weight_row_mean": float(_row_mean(w, m)[valid].mean())}


def logp_diff_metrics(delta: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """``abs_logp_diff_mean`` = mean_t |δ_t| and ``abs_logp_diff_max`` = max_t |δ_t| over valid tokens, on the
    unclamped δ = log π_train − log π_rollout (TRL's sampling/sampling_logp_difference/mean and /max)."""
    a = delta.abs()
    return {"abs_logp_diff_mean": float(_mm(a, m)), "abs_logp_diff_max": float(a[m].max())}


# ----------------------------------------------------------------------------------------------------------------
# the whole pipeline


def rollout_correction(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       config: CorrectionConfig) -> CorrectionResult:
    """IS weights, RS mask and metrics for one batch (the oracle of the ``rollout_correction`` op).

    Metrics: :func:`offpolicy_metrics` and :func:`logp_diff_metrics` always (on the original mask);
    :func:`is_metrics` and :func:`weight_extreme_metrics` when IS is on, plus ``is_batch_norm_factor`` with batch
    normalization; with RS (or veto): ``rs_masked_fraction`` (share of valid
    tokens rejected), ``rs_seq_masked_fraction`` (share of valid rows with ≥ 1 rejected token) and the same per
    option as ``rs_{option}_masked_fraction`` / ``rs_{option}_seq_masked_fraction`` (option ``veto`` for the veto).
    """
    if not isinstance(config, CorrectionConfig):
        raise TypeError(f"config: expected a CorrectionConfig, got {type(config).__name__}")
    validate_inputs(train_logp, rollout_logp, mask)
    m = mask.detach() != 0
    delta = log_ratio(train_logp, rollout_logp, mask)
    metrics = offpolicy_metrics(train_logp, rollout_logp, mask)
    metrics.update(logp_diff_metrics(delta, m))
    weights = None
    if config.rollout_is is not None:
        w, raw, factor = is_weights(delta, m, config)
        # metrics on the pre-normalization weights
        w_pre = w * factor if factor is not None else w
        metrics.update(is_metrics(w_pre, raw, delta, m, config))
        metrics.update(weight_extreme_metrics(w_pre, m))
        if factor is not None:
            metrics["is_batch_norm_factor"] = factor
        dtype = train_logp.dtype if train_logp.is_floating_point() else torch.float32
        weights = w.to(dtype)
    keep_all = torch.ones_like(m)
    checks: list[tuple[str, torch.Tensor]] = []
    for opt, bounds in config.rs_bounds.items():
        checks.append((opt, rs_keep(delta, m, opt, bounds)[0]))
    if config.rollout_token_veto_threshold is not None:
        checks.append(("veto", veto_keep(delta, m, float(config.rollout_token_veto_threshold))))
    if checks:
        valid = m.any(-1)
        for name, keep in checks:
            keep_all &= keep
            metrics[f"rs_{name}_masked_fraction"] = float(_mm((~keep).double(), m))
            metrics[f"rs_{name}_seq_masked_fraction"] = float((m & ~keep).any(-1)[valid].double().mean())
        metrics["rs_masked_fraction"] = float(_mm((~keep_all).double(), m))
        metrics["rs_seq_masked_fraction"] = float((m & ~keep_all).any(-1)[valid].double().mean())
    new_mask = (m & keep_all).to(mask.dtype)
    return CorrectionResult(weights, new_mask, metrics)


# ----------------------------------------------------------------------------------------------------------------
# loss application


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """token-mean = Σ m·ℓ / Σ m; seq-mean-token-mean = mean over valid rows of (Σ_t m·ℓ / n_i);
    seq-mean-token-sum = mean over valid rows of Σ_t m·ℓ. Padding values (even NaN) never contribute."""
    m = mask.detach() != 0
    lm = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype))
    if mode == "token-mean":
        return lm.sum() / m.sum()
    n = m.sum(-1)
    valid = n > 0
    row = lm.sum(-1)
    if mode == "seq-mean-token-mean":
        row = row / n.clamp_min(1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"mode: unknown aggregation {mode!r}; expected one of {LOSS_AGG_MODES}")
    return row[valid].sum() / valid.sum()


def ppo_clip_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        cfg: LossConfig) -> torch.Tensor:
    """Per-token PPO-clip with dual clip: r = e^C(logp − old); ℓ = max(−A·r, −A·clip(r, 1−ε_lo, 1+ε_hi));
    for A < 0, ℓ = min(ℓ, −A·c)."""
    r = torch.exp((logp - old_logp).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    l1 = -advantages * r
    l2 = -advantages * r.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    lc = torch.maximum(l1, l2)
    return torch.where(advantages < 0, torch.minimum(lc, -advantages * cfg.clip_ratio_c), lc)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                weights: torch.Tensor | None, cfg: LossConfig) -> torch.Tensor:
    """The scalar policy loss with the per-token loss multiplied by the (detached) IS weight w:
    PPO-clip ``agg(w · ℓ_clip)``, REINFORCE ``agg(−A · logp · w)``. Gradients flow into ``logp`` only.
    Computed in float64 (the gradient is returned in ``logp``'s dtype)."""
    m = mask.detach() != 0
    zero = torch.zeros((), dtype=torch.float64)
    lp = torch.where(m, logp.double(), zero)
    old = torch.where(m, old_logp.detach().double(), zero)
    adv = torch.where(m, advantages.detach().double(), zero)
    if cfg.kind == "ppo_clip":
        loss = ppo_clip_token_loss(lp, old, adv, cfg)
    else:
        loss = -adv * lp
    if weights is not None:
        loss = loss * torch.where(m, weights.detach().double(), zero)
    return aggregate(loss, mask, cfg.agg)


# ----------------------------------------------------------------------------------------------------------------
# decoupled PPO: the proximal policy (AReaL, Fu et al. 2025 "AReaL: A Large-Scale Asynchronous Reinforcement
# Learning System for Language Reasoning", §5; Hilton et al. 2021 "Batch size-invariance for policy optimization")

PROX_METHODS = ("loglinear", "linear", "rollout")


def proximal_alpha(versions: torch.Tensor, current_version: int) -> torch.Tensor:
    """Interpolation factor of the approximated proximal policy, per token (float64).

    The proximal policy is the last policy broadcast before the current one, version v_prox = v_θ − 1 (v_θ =
    ``current_version``); a token sampled by the policy of version v (``versions``, < 0 for prompt tokens) gets
    α = clamp((v_prox − v) / (v_θ − v), 0, 1) when v ≥ 0 and v_θ > v, else α = 0 (π_prox = π_behave): α = 0 for a
    token sampled by v_prox itself, α → 1 as the token gets staler."""
    if not isinstance(versions, torch.Tensor):
        raise TypeError(f"versions: expected a torch.Tensor of per-token policy versions, got {type(versions).__name__}")
    if isinstance(current_version, bool) or not isinstance(current_version, int):
        raise TypeError(f"current_version: expected an int, got {current_version!r}")
    v = versions.detach().double()
    vt = float(current_version)
    ok = (v >= 0) & (vt > v)
    a = torch.where(ok, (vt - 1.0 - v) / torch.where(ok, vt - v, 1.0), 0.0)
    return a.clamp(0.0, 1.0)


def proximal_logp(behave_logp: torch.Tensor, theta_logp: torch.Tensor, versions: torch.Tensor,
                  current_version: int, method: str = "loglinear") -> torch.Tensor:
    """log π_prox approximated from the behaviour policy's log-probs l_b (rollout) and the current policy's l_θ,
    without a forward pass of the proximal policy (α from :func:`proximal_alpha`):

    * ``"loglinear"``  log π_prox = (1 − α)·l_b + α·l_θ (geometric interpolation in probability space);
    * ``"linear"``     log π_prox = log((1 − α)·e^{l_b} + α·e^{l_θ}) (arithmetic interpolation), exact for any
      probability > 0 (no additive floor);
    * ``"rollout"``    log π_prox = l_b.

    Computed in float64 from the inputs (θ's log-probs detached); returned in ``behave_logp``'s dtype."""
    if method not in PROX_METHODS:
        raise ValueError(f"method: unknown proximal approximation {method!r}; expected one of {PROX_METHODS}")
    for name, t in (("behave_logp", behave_logp), ("theta_logp", theta_logp)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if behave_logp.shape != theta_logp.shape or behave_logp.shape != versions.shape:
        raise ValueError(f"shape mismatch: behave_logp {tuple(behave_logp.shape)}, theta_logp "
                         f"{tuple(theta_logp.shape)} and versions {tuple(versions.shape)} must be equal")
    a = proximal_alpha(versions, current_version)
    lb, lt = behave_logp.detach().double(), theta_logp.detach().double()
    if method == "rollout":
        out = lb
    elif method == "loglinear":
        out = lb + a * (lt - lb)
    else:
        # log((1−α)e^lb + αe^lt) = M + log((1−α)e^{lb−M} + αe^{lt−M}), M the larger exponent with weight > 0
        big = torch.where(a >= 1, lt, torch.where(a <= 0, lb, torch.maximum(lb, lt)))
        out = big + torch.log((1 - a) * torch.exp(lb - big) + a * torch.exp(lt - big))
    return out.to(behave_logp.dtype)


def decoupled_ppo_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behave_logp: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, loss_cfg: LossConfig,
                       correction: CorrectionConfig) -> torch.Tensor:
    """Decoupled PPO: the trust region is taken around the proximal policy, the off-policyness of the behaviour
    (rollout) policy is corrected by an importance weight:

        L = Σ_t m'_t · w_t · ℓ_t / Σ_t m_t,   ℓ_t = PPO-clip(r_t = π_θ/π_prox, A_t) (:func:`ppo_clip_token_loss`),

    with (w, m') = :func:`rollout_correction` (log π_prox, log π_behave, m, ``correction``) — w the behaviour IS
    weight π_prox/π_behave after its truncation/masking (1 when ``correction.rollout_is`` is None), m' the mask
    after rejection — and the denominator the *original* count of valid tokens (token-mean; a rejected token adds 0
    but still counts, so rejection does not rescale the surviving tokens' gradients). Only ``loss_cfg.kind ==
    "ppo_clip"`` and ``agg == "token-mean"`` are defined. Gradients flow into ``logp`` only; float64."""
    if not isinstance(loss_cfg, LossConfig):
        raise TypeError(f"loss_cfg: expected a LossConfig, got {type(loss_cfg).__name__}")
    if loss_cfg.kind != "ppo_clip" or loss_cfg.agg != "token-mean":
        raise ValueError(f"loss_cfg: decoupled PPO is defined for kind='ppo_clip', agg='token-mean'; got "
                         f"kind={loss_cfg.kind!r}, agg={loss_cfg.agg!r}")
    res = rollout_correction(prox_logp, behave_logp, mask, correction)
    m = mask.detach() != 0
    kept = res.mask.detach() != 0
    zero = torch.zeros((), dtype=torch.float64)
    lp = torch.where(m, logp.double(), zero)
    prox = torch.where(m, prox_logp.detach().double(), zero)
    adv = torch.where(m, advantages.detach().double(), zero)
    loss = ppo_clip_token_loss(lp, prox, adv, loss_cfg)
    if correction.rollout_is is not None:  # the float64 weights (res.weights is rounded to the inputs' dtype)
        w, _, _ = is_weights(log_ratio(prox_logp, behave_logp, mask), m, correction)
        loss = loss * w
    return torch.where(kept, loss, zero).sum() / m.sum()


__all__ = [
    "IS_LEVELS", "LOSS_AGG_MODES", "LOSS_KINDS", "PERPLEXITY_METRICS", "RS_OPTIONS", "SAFETY_BOUND",
    "PROX_METHODS", "CorrectionConfig", "CorrectionResult", "LossConfig", "aggregate", "batch_norm_factor",
    "decoupled_ppo_loss", "is_metrics", "logp_diff_metrics", "proximal_alpha", "proximal_logp",
    "weight_extreme_metrics",
    "is_weights", "log_ratio", "offpolicy_metrics", "parse_is_threshold", "parse_rs", "policy_loss",
    "ppo_clip_token_loss", "raw_log_weights", "rollout_correction", "rs_keep", "rs_token_stats", "validate_inputs",
    "veto_keep",
]
