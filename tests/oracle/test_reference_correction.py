"""Properties and statistics of the rollout-correction oracle (fp8rl.reference.correction).

Names say how the expectation is compared: ``*_exact`` (equality, or the fp64 rounding of the formula),
``*_bound`` (an inequality from the spec or the tolerance table), ``*_stat`` (a confidence interval, fixed seed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.reference import correction as C
from fp8rl.strategies_correction import (
    Batch,
    batches,
    icepop_bounds,
    is_configs,
    k1_bounds,
    make_batch,
    rs_specs,
    tis_thresholds,
)
from hypothesis import given, settings
from hypothesis import strategies as st

F64 = tolerances.UNIT_ROUNDOFF["float64"]


def _run(b: Batch, cfg: C.CorrectionConfig) -> C.CorrectionResult:
    return C.rollout_correction(b.train_logp, b.rollout_logp, b.mask, cfg)


def _m(b: Batch) -> torch.Tensor:
    return b.mask != 0


def _identity(b: Batch) -> Batch:
    return Batch(torch.where(_m(b), b.rollout_logp, b.train_logp), b.rollout_logp, b.mask, b.seed)


# ----------------------------------------------------------------------------------------------------------------
# identity, bounds, padding


@given(batches(), st.sampled_from(C.IS_LEVELS), st.one_of(tis_thresholds(), st.just("0.5_1.5")), st.booleans(),
       rs_specs(symmetric=True, max_options=3))
def test_identity_exact(b, level, thr, norm, spec):
    same = _identity(b)
    cfg = C.CorrectionConfig(level, thr, norm, spec[0], spec[1])
    r = _run(same, cfg)
    m = _m(b)
    assert bool((r.weights[m] == 1).all()) and bool((r.weights[~m] == 0).all())
    assert torch.equal(r.mask, same.mask)
    for k in ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff", "probs_diff_max",
              "rs_masked_fraction", "rs_seq_masked_fraction"):
        assert r.metrics[k] == 0.0, k
    assert r.metrics["ppl_ratio"] == 1.0 and r.metrics["token_mult_prob_error"] == 1.0
    assert r.metrics["is_ess"] == 1.0 and r.metrics["training_ppl"] == r.metrics["rollout_ppl"]


@given(batches(extreme=True), tis_thresholds(), st.sampled_from(C.IS_LEVELS))
def test_tis_weight_bound(b, u, level):
    r = _run(b, C.CorrectionConfig(level, u))
    w = r.weights.double()
    assert bool((w >= 0).all()) and bool((w <= tolerances.corr_rounded_threshold_max(u)).all())  # U rounded to fp32
    assert bool((w[~_m(b)] == 0).all())


@given(batches(), is_configs(levels=C.IS_LEVELS), rs_specs(max_options=3), st.integers(1, 7))
def test_padding_length_invariance_exact(b, cfg, spec, k):
    cfg = C.CorrectionConfig(cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize, *spec)
    r1 = _run(b, cfg)
    rows = b.mask.shape[0]
    rng = np.random.default_rng(b.seed)
    pad_lo = torch.from_numpy(np.where(rng.random((rows, k)) < 0.3, -np.inf, rng.uniform(-1e4, 50, (rows, k))))
    pad_lr = torch.from_numpy(np.where(rng.random((rows, k)) < 0.3, np.nan, rng.uniform(-1e4, 50, (rows, k))))
    wide = Batch(torch.cat([b.train_logp, pad_lo.float()], 1), torch.cat([b.rollout_logp, pad_lr.float()], 1),
                 torch.cat([b.mask, torch.zeros(rows, k, dtype=b.mask.dtype)], 1), b.seed)
    r2 = _run(wide, cfg)
    t = b.mask.shape[1]
    assert torch.equal(r2.mask[:, :t], r1.mask) and not bool(r2.mask[:, t:].any())
    torch.testing.assert_close(r2.weights[:, :t], r1.weights, rtol=4 * F64 * t, atol=0)
    assert bool((r2.weights[:, t:] == 0).all())
    assert r1.metrics.keys() == r2.metrics.keys()
    for key, v in r1.metrics.items():
        w = r2.metrics[key]
        assert (math.isnan(v) and math.isnan(w)) or w == pytest.approx(v, rel=1e-12, abs=1e-12), key


@given(batches(empty_rows=False), is_configs(levels=C.IS_LEVELS), rs_specs(max_options=2))
def test_empty_row_invariance_exact(b, cfg, spec):
    cfg = C.CorrectionConfig(cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize, *spec)
    cols = b.mask.shape[1]
    ext = Batch(torch.cat([b.train_logp, torch.full((1, cols), -math.inf)]),
                torch.cat([b.rollout_logp, torch.full((1, cols), 3.0)]),
                torch.cat([b.mask, torch.zeros(1, cols, dtype=b.mask.dtype)]), b.seed)
    r1, r2 = _run(b, cfg), _run(ext, cfg)
    torch.testing.assert_close(r2.weights[:-1], r1.weights, rtol=1e-12, atol=0)
    assert torch.equal(r2.mask[:-1], r1.mask)
    for key, v in r1.metrics.items():
        w = r2.metrics[key]
        assert (math.isnan(v) and math.isnan(w)) or w == pytest.approx(v, rel=1e-12, abs=1e-12), key


@given(batches(max_delta=1.0), tis_thresholds())
def test_sequence_weight_is_product_of_token_ratios_exact(b, u):
    """Before truncation (U huge) the sequence weight is Π_t ρ_t over valid tokens (fp64: n+2 roundings)."""
    r = _run(b, C.CorrectionConfig("sequence", 1e30))
    m = _m(b)
    tok = _run(b, C.CorrectionConfig("token", 1e30)).weights.double()
    prod = torch.where(m, tok, 1.0).prod(-1)
    n = m.sum(-1)
    for i in range(b.mask.shape[0]):
        if n[i] == 0:
            continue
        got = float(r.weights[i, 0])
        bound = tolerances.gamma(int(n[i]) + 4, 2.0**-24) * abs(float(prod[i])) * 2  # fp32 output rounding
        assert abs(got - float(prod[i])) <= bound, (i, got, float(prod[i]))
        assert bool((r.weights[i][m[i]] == r.weights[i, 0]).all())


def test_extreme_values_finite_bound():
    lo = torch.tensor([[-1e4, -0.5, -1.0, 0.0], [-1.0, -1e4, -2.0, 0.0]])
    lr = torch.tensor([[-0.5, -1e4, -math.inf, math.nan], [-3e3, -1.0, math.nan, -math.inf]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]])
    for level in C.IS_LEVELS:
        for thr in (2.0, "0.5_5.0"):
            cfg = C.CorrectionConfig(level, thr, True, "token_k1,seq_max_k3,seq_sum_k2", "2.0,1e6,1e6",
                                     rollout_token_veto_threshold=1e-4)
            r = C.rollout_correction(lo, lr, mask, cfg)
            assert bool(torch.isfinite(r.weights).all())
            bad = {k: v for k, v in r.metrics.items() if k not in C.PERPLEXITY_METRICS and not math.isfinite(v)}
            assert not bad
    r = C.rollout_correction(lo, lr, mask, C.CorrectionConfig("token", 2.0))
    assert r.weights[0, 1] == 2.0 and r.weights[0, 0] == pytest.approx(math.exp(-20), rel=1e-6)


def test_weights_detached_exact():
    b = make_batch(3, 3, 7, empty_rows=False)
    lo = b.train_logp.clone().requires_grad_(True)
    for cfg in (C.CorrectionConfig("token", 2.0, True), C.CorrectionConfig("sequence", "0.5_5.0"),
                C.CorrectionConfig("geometric", 3.0, True)):
        r = C.rollout_correction(lo, b.rollout_logp, b.mask, cfg)
        assert not r.weights.requires_grad and r.weights.grad_fn is None


@given(batches(extreme=True))
def test_k3_nonnegative_bound(b):
    d = C.log_ratio(b.train_logp, b.rollout_logp, b.mask)
    assert bool((C.rs_token_stats(d)["k3"] >= 0).all())
    assert _run(b, C.CorrectionConfig(None)).metrics["kl_k3"] >= 0


# ----------------------------------------------------------------------------------------------------------------
# IS modes, normalization, RS


def test_token_tis_values_exact():
    lo = torch.tensor([[math.log(0.1), math.log(0.9), math.log(0.5)]])
    lr = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.5)]])
    r = C.rollout_correction(lo, lr, torch.ones(1, 3), C.CorrectionConfig("token", 2.0))
    torch.testing.assert_close(r.weights, torch.tensor([[0.2, 2.0, 1.0]]), rtol=1e-6, atol=0)
    assert r.metrics["is_fraction_high"] == pytest.approx(1 / 3) and r.metrics["is_fraction_low"] == pytest.approx(1 / 3)


def test_icepop_matches_verl_anchor_exact():
    """docs/verl-correction.md §2.1 anchor: raw [0.4, 0.8, 6.0], '0.5_5.0' → w = [0, 0.8, 0], oob 2/3, ESS 1/3; mask untouched."""
    lr = torch.zeros(1, 3)
    lo = torch.log(torch.tensor([[0.4, 0.8, 6.0]]))
    r = C.rollout_correction(lo, lr, torch.ones(1, 3), C.CorrectionConfig("token", "0.5_5.0"))
    torch.testing.assert_close(r.weights, torch.tensor([[0.0, 0.8, 0.0]]), rtol=1e-6, atol=1e-7)
    assert torch.equal(r.mask, torch.ones(1, 3))
    assert r.metrics["is_oob_fraction"] == pytest.approx(2 / 3) and r.metrics["is_ess"] == pytest.approx(1 / 3)


def test_sequence_icepop_zeroes_rows_exact():
    lr = torch.zeros(2, 3)
    lo = torch.tensor([[0.5, 0.5, 0.5], [0.1, 0.1, 0.0]])  # Π ρ = e^1.5 ≈ 4.48 (out of [0.5, 2]), e^0.2 (in)
    r = C.rollout_correction(lo, lr, torch.ones(2, 3), C.CorrectionConfig("sequence", "0.5_2.0"))
    assert bool((r.weights[0] == 0).all())
    torch.testing.assert_close(r.weights[1], torch.full((3,), math.exp(0.2)), rtol=1e-6, atol=0)


def test_geometric_weight_exact():
    lr = torch.zeros(1, 4)
    lo = torch.tensor([[0.4, -0.2, 0.6, 9.0]])
    r = C.rollout_correction(lo, lr, torch.tensor([[1, 1, 1, 0]]), C.CorrectionConfig("geometric", 5.0))
    torch.testing.assert_close(r.weights, torch.tensor([[math.exp(0.8 / 3)] * 3 + [0.0]]), rtol=1e-6, atol=0)


@given(batches(), st.one_of(tis_thresholds(), icepop_bounds()))
def test_batch_norm_mean_one_exact(b, thr):
    m = _m(b)
    rt = _run(b, C.CorrectionConfig("token", thr, True))
    rs = _run(b, C.CorrectionConfig("sequence", thr, True))
    if rt.metrics["is_batch_norm_factor"] != 1.0 or rt.weights[m].double().mean() > 0:
        mean = float(rt.weights.double()[m].mean())
        assert mean == pytest.approx(1.0, rel=1e-6) or mean == 0.0
    valid = m.any(-1)
    row_w = rs.weights.double()[:, 0][valid]
    assert float(row_w.mean()) == pytest.approx(1.0, rel=1e-6) or float(row_w.max()) == 0.0


def test_rs_k1_ratio_direction_exact():
    """k1 bounds are on ρ = π_train/π_rollout: '0.9_4.0' keeps ρ = 3, rejects ρ = 1/3 at every k1 level."""
    lr = torch.full((2, 1), -2.0)
    lo = lr + torch.tensor([[math.log(3.0)], [-math.log(3.0)]])
    for opt in ("token_k1", "seq_sum_k1", "seq_mean_k1"):
        r = C.rollout_correction(lo, lr, torch.ones(2, 1), C.CorrectionConfig(None, rollout_rs=opt,
                                                                                rollout_rs_threshold="0.9_4.0"))
        assert r.mask.flatten().tolist() == [1.0, 0.0], opt


def test_rs_levels_exact():
    d = torch.tensor([[0.1, 0.2, -0.3, 0.0], [1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    lr = torch.full_like(d, -1.0)
    lo = lr + d

    def keep(opt, thr):
        return C.rollout_correction(lo, lr, mask, C.CorrectionConfig(None, rollout_rs=opt,
                                                                       rollout_rs_threshold=thr)).mask.tolist()

    assert keep("token_k2", "0.03") == [[1, 1, 0, 0], [0, 1, 0, 0]]         # ½δ² ≤ 0.03: |δ| ≤ 0.245
    assert keep("seq_max_k2", "0.3") == [[1, 1, 1, 0], [0, 0, 0, 0]]        # row max ½ > 0.3
    assert keep("seq_sum_k1", "0.9_1.2") == [[1, 1, 1, 0], [0, 0, 0, 0]]    # Π ρ: e^0 kept, e^1 rejected
    assert keep("seq_mean_k1", "1.7") == [[1, 1, 1, 0], [1, 1, 0, 0]]       # geo mean e^0.5 ≈ 1.65 ≤ 1.7
    assert keep("seq_mean_k1", "1.6") == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert keep("token_k1,token_k2", "2.0,0.03") == [[1, 1, 0, 0], [0, 1, 0, 0]]
    k3 = math.expm1(1.0) - 1.0
    assert keep("seq_mean_k3", str(k3 / 2 * 1.001)) == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert keep("seq_mean_k3", str(k3 / 2 * 0.999)) == [[1, 1, 1, 0], [0, 0, 0, 0]]


def test_veto_exact():
    lr = torch.zeros(2, 3)
    lo = torch.tensor([[0.0, -10.0, 0.0], [0.0, -1.0, -30.0]])
    r = C.rollout_correction(lo, lr, torch.tensor([[1, 1, 1], [1, 1, 0]]),
                             C.CorrectionConfig("token", 2.0, rollout_token_veto_threshold=1e-4))
    assert r.mask.tolist() == [[0, 0, 0], [1, 1, 0]]  # row 0: ρ = e^-10 < 1e-4; row 1's e^-30 is padding
    assert r.weights[0, 0] == 1.0  # weights untouched


@given(batches(), is_configs(levels=C.IS_LEVELS, normalize=False), rs_specs(max_options=3))
def test_rs_never_changes_weights_exact(b, cfg, spec):
    with_rs = _run(b, C.CorrectionConfig(cfg.rollout_is, cfg.rollout_is_threshold, False, *spec))
    assert torch.equal(with_rs.weights, _run(b, cfg).weights)
    assert bool((with_rs.mask.double() <= b.mask.double()).all())


# ----------------------------------------------------------------------------------------------------------------
# metrics


def test_offpolicy_metrics_values_exact():
    lo = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    lr = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    mt = C.rollout_correction(lo, lr, mask, C.CorrectionConfig(None)).metrics
    d = np.array([0.5, -1.0, 0.0])
    assert mt["kl_k1"] == pytest.approx(-d.mean())
    assert mt["kl_k3"] == pytest.approx(np.mean(np.expm1(d) - d))
    assert mt["chi2_token"] == pytest.approx(np.mean(np.exp(2 * d)) - 1)
    assert mt["chi2_seq"] == pytest.approx((math.exp(2 * -0.5) + 1) / 2 - 1)
    di = np.array([-1.25 + 1.5, 0.0])  # mean lr − mean lo per row
    assert mt["log_ppl_diff"] == pytest.approx(di.mean()) and mt["ppl_ratio"] == pytest.approx(np.exp(di).mean())
    assert mt["training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2)
    assert mt["token_mult_prob_error"] == pytest.approx(np.mean(np.exp(np.abs(d))))
    p = np.exp([-1.0, -2.0, -0.5])
    q = np.exp([-1.5, -1.0, -0.5])
    assert mt["probs_diff_mean"] == pytest.approx(np.abs(p - q).mean())
    assert mt["probs_diff_std"] == pytest.approx(np.abs(p - q).std(ddof=1))
    assert mt["probs_pearson_corr"] == pytest.approx(np.corrcoef(p, q)[0, 1])


def _kl_case(seed: int, vocab: int):
    r = np.random.default_rng(seed)
    p = r.dirichlet(np.ones(vocab))
    q = p * np.exp(r.normal(0, 0.4, vocab))
    return p, q / q.sum()


@pytest.mark.parametrize("vocab", [4, 16, 64])
def test_kl_estimators_unbiased_stat(vocab):
    """Tokens ~ π_rollout = p; the k1 and k3 metrics converge to KL(p‖q) (q = π_train) within z·σ/√n.

    Fixed seed; n = ⌈(10·z·σ/KL)²⌉ (the CI half-width is ≤ 10% of the KL, see ``corr_kl_stat_z``), so a
    biased estimator (bias > 10% of the KL, e.g. k1 on the inverse ratio) is rejected."""
    z = tolerances.get("corr_kl_stat_z").value
    p, q = _kl_case(1234 + vocab, vocab)
    lp, lq = np.log(p), np.log(q)
    kl = float(np.sum(p * (lp - lq)))
    rng = np.random.default_rng(vocab)
    for key, x in (("kl_k1", lp - lq), ("kl_k3", np.exp(lq - lp) - 1 - (lq - lp))):
        mu = float(np.sum(p * x))
        assert mu == pytest.approx(kl, rel=1e-9)  # both estimators are unbiased in expectation (exact identity)
        sd = math.sqrt(float(np.sum(p * (x - mu) ** 2)))
        n = int(math.ceil((10 * z * sd / kl) ** 2))
        tok = rng.choice(vocab, size=n, p=p)
        lo = torch.from_numpy(lq[tok].reshape(1, n))
        lr = torch.from_numpy(lp[tok].reshape(1, n))
        est = C.rollout_correction(lo, lr, torch.ones(1, n), C.CorrectionConfig(None)).metrics[key]
        assert abs(est - kl) <= z * sd / math.sqrt(n), (key, est, kl, n)
    # k1 on the inverse ratio (the corr-inverted-ratio mutant) has mean −KL: far outside the CI
    tok = rng.choice(vocab, size=n, p=p)
    inv = C.rollout_correction(torch.from_numpy(lp[tok].reshape(1, n)), torch.from_numpy(lq[tok].reshape(1, n)),
                               torch.ones(1, n), C.CorrectionConfig(None)).metrics["kl_k1"]
    assert abs(inv - kl) > 10 * z * sd / math.sqrt(n)


# ----------------------------------------------------------------------------------------------------------------
# loss helpers


def test_ppo_clip_dual_clip_exact():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 5.0, 1.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    cfg = C.LossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    per = C.ppo_clip_token_loss(logp.double(), old.double(), adv.double(), cfg)
    # A>0, r=1.5: max(-1.5, -1.28) = -1.28; A>0, r=0.5: max(-0.5, -0.8) = -0.5;
    # A<0, r=5: max(5, 1.28) = 5 then dual clip min(5, 3) = 3; A=-2, r=1: 2
    torch.testing.assert_close(per, torch.tensor([[-1.28, -0.5, 3.0, 2.0]], dtype=torch.float64))
    w = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    loss = C.policy_loss(logp, old, adv, torch.ones(1, 4), w, cfg)
    assert float(loss) == pytest.approx((-1.28 * 2 - 0.5 + 1.5) / 4)


def test_reinforce_and_aggregation_exact():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 9.0], [2.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w = torch.tensor([[0.5, 2.0, 7.0], [1.0, 7.0, 7.0]])
    cfg = C.LossConfig(kind="reinforce", agg="token-mean")
    loss = C.policy_loss(logp, torch.zeros(2, 3), adv, mask, w, cfg)
    assert float(loss.detach()) == pytest.approx((0.5 + 4.0 + 1.0) / 3)
    (g,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, torch.tensor([[-0.5, -2.0, 0.0], [-2.0, 0.0, 0.0]]) / 3)
    seq = C.policy_loss(logp, torch.zeros(2, 3), adv, mask, w, C.LossConfig(kind="reinforce",
                                                                             agg="seq-mean-token-mean"))
    assert float(seq.detach()) == pytest.approx(((0.5 + 4.0) / 2 + 1.0) / 2)
    tsum = C.policy_loss(logp, torch.zeros(2, 3), adv, mask, w, C.LossConfig(kind="reinforce",
                                                                              agg="seq-mean-token-sum"))
    assert float(tsum.detach()) == pytest.approx((4.5 + 1.0) / 2)


def test_loss_weights_are_constants_exact():
    logp = torch.tensor([[-1.0, -0.7]], requires_grad=True)
    w = torch.exp(logp)  # a weight that *would* carry gradient
    loss = C.policy_loss(logp, torch.tensor([[-1.0, -0.7]]), torch.ones(1, 2), torch.ones(1, 2), w,
                         C.LossConfig(kind="reinforce"))
    (g,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, -w.detach() / 2)


# ----------------------------------------------------------------------------------------------------------------
# configuration and input validation (clear errors naming the argument)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"rollout_is_threshold": True}, TypeError, r"rollout_is_threshold: .*bool"),
    ({"rollout_is_threshold": "5.0_0.5"}, ValueError, r"rollout_is_threshold: expected lower bound ≤ upper"),
    ({"rollout_is_threshold": -1.0}, ValueError, r"rollout_is_threshold: expected a positive"),
    ({"rollout_is_threshold": "a_b"}, ValueError, r"rollout_is_threshold lower bound"),
    ({"rollout_is": "geo"}, ValueError, r"rollout_is: unknown level 'geo'"),
    ({"rollout_rs": "token_k4", "rollout_rs_threshold": "1"}, ValueError, r"rollout_rs: unknown option 'token_k4'"),
    ({"rollout_rs": "token_k2"}, ValueError, r"rollout_rs_threshold: required when rollout_rs is set"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2.0_0.5"}, ValueError,
     r"rollout_rs_threshold\[token_k1\]: expected lower bound ≤ upper"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_2"}, ValueError,
     r"rollout_rs_threshold\[token_k2\]: token_k2 takes a single positive upper bound"),
    ({"rollout_rs": "token_k2,seq_max_k3", "rollout_rs_threshold": "1,2,3"}, ValueError, r"expected 1 or 2 entries"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": True}, TypeError, r"rollout_rs_threshold: .*bool"),
    ({"rollout_rs_threshold": "1.0"}, ValueError, r"rollout_rs_threshold: given .* but rollout_rs is None"),
    ({"rollout_is_batch_normalize": 1}, TypeError, r"rollout_is_batch_normalize: expected a bool"),
    ({"rollout_token_veto_threshold": 0.0}, ValueError, r"rollout_token_veto_threshold: expected a positive"),
])
def test_config_validation_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        C.CorrectionConfig(**kwargs)


def test_config_parsing_exact():
    cfg = C.CorrectionConfig("token", "0.5_5.0", rollout_rs="seq_mean_k1,token_k1,seq_mean_k1",
                             rollout_rs_threshold="2.0,0.25_8")
    assert cfg.icepop and cfg.is_bounds == (0.5, 5.0) and cfg.is_lower == 0.5
    assert cfg.rs_bounds == {"seq_mean_k1": (0.5, 2.0), "token_k1": (0.25, 8.0)}
    assert C.CorrectionConfig("sequence", (0.5, 2)).is_bounds == (0.5, 2.0)
    assert C.CorrectionConfig("token", "3").is_bounds == (None, 3.0) and C.CorrectionConfig().is_lower == 0.5
    assert C.parse_rs("token_k2,seq_sum_k1", 4.0) == {"token_k2": (None, 4.0), "seq_sum_k1": (0.25, 4.0)}


def test_input_validation_errors():
    b = make_batch(0, 2, 3, empty_rows=False)
    cfg = C.CorrectionConfig()
    with pytest.raises(ValueError, match="mask: expected at least one valid token"):
        C.rollout_correction(b.train_logp, b.rollout_logp, torch.zeros_like(b.mask), cfg)
    with pytest.raises(ValueError, match=r"shape mismatch: train_logp \(2, 2\)"):
        C.rollout_correction(b.train_logp[:, :2], b.rollout_logp, b.mask, cfg)
    with pytest.raises(ValueError, match="mask: expected only 0/1"):
        C.rollout_correction(b.train_logp, b.rollout_logp, b.mask * 2, cfg)
    with pytest.raises(ValueError, match="train_logp: expected a 2-D"):
        C.rollout_correction(b.train_logp[0], b.rollout_logp[0], b.mask[0], cfg)
    with pytest.raises(TypeError, match="config: expected a CorrectionConfig"):
        C.rollout_correction(b.train_logp, b.rollout_logp, b.mask, {"rollout_is": "token"})
    with pytest.raises(ValueError, match="clip_ratio_c: expected a float > 1"):
        C.LossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="agg: unknown aggregation"):
        C.LossConfig(agg="token-sum")


@settings(max_examples=10)
@given(k1_bounds(symmetric=False))
def test_strategy_asymmetric_bounds_exact(spec):
    lo, hi = (float(x) for x in spec.split("_"))
    assert 0 < lo <= hi and not math.isclose(lo * hi, 1.0, rel_tol=1e-9)
