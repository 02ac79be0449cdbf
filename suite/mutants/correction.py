"""Rollout-correction mutants: the reference engine with one realistic IS/RS bug each (area ``correction``).

Most mutants run the oracle with one of its module-level helpers swapped for a buggy one
(the oracle looks its helpers up at call time), which is how such bugs arise in real code: one wrong line.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import replace

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import correction as C

from ._base import mutant


@contextlib.contextmanager
def _patched(**attrs) -> Iterator[None]:
    """Temporarily replace module attributes of the oracle (single-threaded use; restored on exit)."""
    old = {k: getattr(C, k) for k in attrs}
    try:
        for k, v in attrs.items():
            setattr(C, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(C, k, v)


class _CorrectionMutant(ReferenceEngine):
    """Reference engine whose rollout_correction runs the oracle under ``_patches()``."""

    def _patches(self) -> dict:
        return {}

    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        with _patched(**self._patches()):
            return C.rollout_correction(train_logp, rollout_logp, mask, config)


@mutant("corr-inverted-ratio", "IS ratio inverted: ρ = π_rollout/π_train (δ = log π_rollout − log π_train)",
        kills=("CORR-EDGE-001", "CORR-GEO-001", "CORR-MET-001", "CORR-MET-002", "CORR-MET-003", "CORR-MIS-001",
               "CORR-MIS-002", "CORR-NORM-001", "CORR-NORM-002", "CORR-RS-001", "CORR-RS-003", "CORR-RS-004",
               "CORR-RS-005", "CORR-RS-006", "CORR-STAT-001", "CORR-TIS-001", "CORR-TIS-003", "CORR-TIS-004"))
class InvertedRatio(ReferenceEngine):
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        return C.rollout_correction(rollout_logp, train_logp, mask, config)


@mutant("corr-no-truncation", "TIS weights not truncated at U (w = ρ)",
        kills=("CORR-EDGE-001", "CORR-GEO-001", "CORR-NORM-001", "CORR-RS-006", "CORR-TIS-001", "CORR-TIS-002",
               "CORR-TIS-003", "CORR-TIS-004"))
class NoTruncation(ReferenceEngine):
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        if config.rollout_is is None or config.icepop:
            return C.rollout_correction(train_logp, rollout_logp, mask, config)
        res = C.rollout_correction(train_logp, rollout_logp, mask, config)
        loose = C.rollout_correction(train_logp, rollout_logp, mask, replace(config, rollout_is_threshold=1e30))
        res.weights = loose.weights
        return res


@mutant("corr-two-sided-clamp", "TIS clamps weights to [1/U, U] instead of truncating from above only",
        kills=("CORR-EDGE-001", "CORR-GEO-001", "CORR-MET-002", "CORR-NORM-001", "CORR-NORM-002", "CORR-RS-006",
               "CORR-TIS-001", "CORR-TIS-003", "CORR-TIS-004"))
class TwoSidedClamp(_CorrectionMutant):
    def _patches(self):
        orig = C.is_weights

        def is_weights(delta, m, cfg):
            w, raw, factor = orig(delta, m, cfg)
            if cfg.icepop:
                return w, raw, factor
            hi = cfg.is_upper
            w2 = torch.where(m, raw.clamp(1.0 / hi, hi), 0.0)
            if factor is not None:
                f = C.batch_norm_factor(w2, m, cfg.rollout_is)
                w2 = w2 / f if f > C.NORM_EPS else w2
                factor = f if f > C.NORM_EPS else 1.0
            return w2, raw, factor

        return {"is_weights": is_weights}


@mutant("corr-padding-in-means", "metric means taken over all B·T positions (padding zero-filled) instead of the "
        "valid tokens",
        kills=("CORR-GEO-001", "CORR-ID-001", "CORR-MET-001", "CORR-MET-002", "CORR-MET-003", "CORR-MET-005",
               "CORR-NORM-001", "CORR-NORM-002", "CORR-PAD-001", "CORR-PAD-003", "CORR-RS-001", "CORR-RS-002",
               "CORR-RS-003", "CORR-RS-004"))
class PaddingInMeans(_CorrectionMutant):
    def _patches(self):
        def _mm(x, m):
            return torch.where(m, x, 0.0).sum() / m.numel()

        def _row_mean(x, m):
            return torch.where(m, x, 0.0).sum(-1) / m.shape[-1]

        return {"_mm": _mm, "_row_mean": _row_mean}


@mutant("corr-seq-sum-of-ratios", "sequence IS weight computed as the sum of token ratios instead of their product",
        kills=("CORR-EDGE-001", "CORR-ID-001", "CORR-MET-002", "CORR-MIS-002", "CORR-NORM-002", "CORR-TIS-003",
               "CORR-TIS-004"))
class SeqSumOfRatios(_CorrectionMutant):
    def _patches(self):
        orig = C.raw_log_weights

        def raw_log_weights(delta, m, level):
            if level != "sequence":
                return orig(delta, m, level)
            s = torch.where(m, torch.exp(delta.clamp(-C.SAFETY_BOUND, C.SAFETY_BOUND)), 0.0).sum(-1)
            return torch.log(s.clamp_min(1e-300)).clamp(-C.SAFETY_BOUND, C.SAFETY_BOUND).unsqueeze(-1).expand_as(
                delta)

        return {"raw_log_weights": raw_log_weights}


@mutant("corr-weights-not-detached", "IS weights keep the autograd graph of log π_train (missing .detach())",
        kills=("CORR-GRAD-001",))
class WeightsNotDetached(ReferenceEngine):
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        res = C.rollout_correction(train_logp, rollout_logp, mask, config)
        if res.weights is not None and train_logp.requires_grad:
            # same values, but d w / d log π_train = w (a token weight computed without detach)
            m = mask.detach() != 0
            res.weights = res.weights * torch.exp(torch.where(m, train_logp - train_logp.detach(), 0.0))
        return res


@mutant("corr-no-safety-clamp", "no ±20 clamp on log-ratios before exp (overflow to inf, RS statistics unclamped)",
        kills=("CORR-EDGE-001",))
class NoSafetyClamp(_CorrectionMutant):
    def _patches(self):
        return {"SAFETY_BOUND": math.inf}


@mutant("corr-k3-wrong-sign", "k3 computed with the inverse ratio: e^{-δ} − 1 + δ (KL metric and RS statistic)",
        kills=("CORR-MET-001", "CORR-MET-003", "CORR-RS-001", "CORR-RS-004", "CORR-RS-005", "CORR-STAT-001"))
class K3WrongSign(_CorrectionMutant):
    def _patches(self):
        orig = C.rs_token_stats

        def rs_token_stats(delta):
            out = orig(delta)
            ds = delta.clamp(-C.SAFETY_BOUND, C.SAFETY_BOUND)
            out["k3"] = torch.expm1(-ds) + ds
            return out

        return {"rs_token_stats": rs_token_stats}

    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        res = super().rollout_correction(train_logp, rollout_logp, mask, config)
        m = mask.detach() != 0
        d = C.log_ratio(train_logp, rollout_logp, mask).clamp(-C.SAFETY_BOUND, C.SAFETY_BOUND)
        res.metrics["kl_k3"] = float(C._mm(torch.expm1(-d) + d, m))
        return res


@mutant("corr-rs-on-weights", "rejection sampling zeroes the IS weights instead of the mask",
        kills=("CORR-EDGE-001", "CORR-RS-001", "CORR-RS-002", "CORR-RS-003", "CORR-RS-004", "CORR-RS-005",
               "CORR-RS-006"))
class RsOnWeights(ReferenceEngine):
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        res = C.rollout_correction(train_logp, rollout_logp, mask, config)
        if res.weights is not None:
            res.weights = res.weights * res.mask.to(res.weights.dtype)
        res.mask = mask.clone()
        return res


@mutant("corr-batch-norm-padding", "batch normalization averages over padded positions too",
        kills=("CORR-GEO-001", "CORR-MET-002", "CORR-NORM-001", "CORR-NORM-002", "CORR-PAD-003"))
class BatchNormPadding(_CorrectionMutant):
    def _patches(self):
        def batch_norm_factor(w, m, level):
            if level == "token":
                return float(w.mean())
            return float(w.amax(-1).mean())

        return {"batch_norm_factor": batch_norm_factor}


@mutant("corr-mis-implied-lower", "masked IS with an upper bound only ('0_hi') also rejects ratios below 1/hi, as "
        "if the band were symmetric", kills=("CORR-SMIS-001",))
class MisImpliedLower(ReferenceEngine):
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        if config.is_bounds is not None and config.is_bounds[0] == 0.0:
            hi = config.is_bounds[1]
            config = replace(config, rollout_is_threshold=(1.0 / hi, hi))
        return C.rollout_correction(train_logp, rollout_logp, mask, config)


@mutant("corr-extremes-over-padding", "weight min/max taken over every position, padding (weight 0) included",
        kills=("CORR-MET-007",))
class ExtremesOverPadding(_CorrectionMutant):
    def _patches(self):
        def weight_extreme_metrics(w, m):
            valid = m.any(-1)
            return {"is_weight_min": float(w.min()), "is_weight_max": float(w.max()),
                    "is_weight_row_mean": float(C._row_mean(w, m)[valid].mean())}

        return {"weight_extreme_metrics": weight_extreme_metrics}


@mutant("corr-prox-off-by-one", "the proximal policy taken as version v_θ instead of v_θ − 1 (α off by one version)",
        kills=("CORR-PROX-001",))
class ProxOffByOne(ReferenceEngine):
    def proximal_logp(self, behave_logp, theta_logp, versions, current_version, method):
        return C.proximal_logp(behave_logp, theta_logp, versions, current_version + 1, method)


@mutant("corr-dppo-behave-ratio", "decoupled PPO collapsed to plain PPO on the behaviour policy: the clip ratio is "
        "π_θ/π_behave and no behaviour weight is applied", kills=("CORR-DPPO-001",))
class DecoupledBehaveRatio(ReferenceEngine):
    def decoupled_loss(self, logp, prox_logp, behave_logp, advantages, mask, loss_config, correction_config):
        return C.decoupled_ppo_loss(logp, behave_logp, behave_logp, advantages, mask, loss_config,
                                    correction_config).to(logp.dtype)


__all__ = ["BatchNormPadding", "DecoupledBehaveRatio", "ExtremesOverPadding", "InvertedRatio", "K3WrongSign",
           "MisImpliedLower", "NoSafetyClamp", "NoTruncation", "PaddingInMeans", "ProxOffByOne", "RsOnWeights",
           "SeqSumOfRatios", "TwoSidedClamp", "WeightsNotDetached"]


@mutant("corr-masked-nan-poisons", "log-ratios are masked by multiplication (δ·mask) instead of selection: a NaN "
        "or -inf log-prob in a padded slot turns its row's sequence weight and the batch metrics into NaN",
        kills=("CORR-SPACE-001",))
class MaskedNanPoisons(ReferenceEngine):
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        res = super().rollout_correction(train_logp, rollout_logp, mask, config)
        if res.weights is None:
            return res
        poisoned = ((train_logp - rollout_logp) * mask).sum(-1, keepdim=True) * 0  # NaN where a padded slot is
        return replace(res, weights=res.weights + poisoned.to(res.weights.dtype))
