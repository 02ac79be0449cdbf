"""``fp8rl parity`` (suite/parity.py): the toy GRPO curves, their JSON/HTML and the paired-bootstrap verdict, on a
configuration small enough for CI (the default one is the nightly's)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fp8rl import parity as P
from fp8rl.cli import main


def test_paired_bootstrap_exact():
    mean, lo, hi = P.paired_bootstrap([0.25] * 5, boot=200)
    assert mean == lo == hi == 0.25
    mean, lo, hi = P.paired_bootstrap([-1.0, 1.0], boot=2000)
    assert mean == 0.0 and -1.0 <= lo < 0 < hi <= 1.0


def test_parity_command_writes_curves_and_verdict_exact(tmp_path, capsys):
    out = tmp_path / "par"
    rc = main(["parity", "--engine", "reference", "--recipe", "fp8-all", "--correction", "tis", "--seeds", "2",
               "--steps", "2", "--final", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    res = json.loads((out / "parity.json").read_text())
    assert res["conditions"] == ["bf16", "fp8-all+none", "fp8-all+tis"]
    for name in res["conditions"]:
        runs = res["runs"][name]
        assert len(runs) == 2 and all(len(m["reward"]) == 2 for m in runs)
        assert set(runs[0]) == {"reward", "k3", "tis_clip", "grad_norm", "cos_bf16"}
    v = res["verdicts"]["fp8-all+tis"]
    assert v["ci95"][0] <= v["reward_gap"] <= v["ci95"][1]
    # 2 seeds never carry a verdict (MIN_SEEDS = 3): "underpowered", exit 4. The power is still stated: the SD of
    # the paired run-mean differences, recomputed here from the curves, floored at the rewards' rounding
    # (1/(64 responses × 2 steps))/√6, and MDE = (t_.975,1 + t_.8,1)·sd/√2 = (12.7062 + 1.3764)·sd/√2 (t tables)
    diffs = [sum(a) / len(a) - sum(b) / len(b)
             for a, b in zip([m["reward"] for m in res["runs"]["fp8-all+tis"]],
                             [m["reward"] for m in res["runs"]["bf16"]], strict=True)]
    sd = abs(diffs[0] - diffs[1]) / math.sqrt(2)
    assert v["sd_observed"] == pytest.approx(sd, abs=1e-12)
    assert v["sd_diff"] == pytest.approx(max(sd, 1 / 128 / math.sqrt(6)), abs=1e-12)
    assert v["mde80"] == pytest.approx((12.7062 + 1.3764) * v["sd_diff"] / math.sqrt(2), rel=1e-4)
    assert rc == 4 and v["verdict"] == "underpowered", (rc, v)
    assert all(x["verdict"] == "underpowered" for x in res["verdicts"].values())
    assert "fp8-all+tis" in printed and "matches BF16" not in printed
    page = (out / "parity.html").read_text()
    assert "<svg" in page and "fp8-all+tis" in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    # the baseline's gradients are its own: cosine 1 by definition; the FP8 runs' cosines are real numbers ≤ 1
    assert all(c == 1.0 for m in res["runs"]["bf16"] for c in m["cos_bf16"])


# ---------------------------------------------------------------------------------------------------------------
# stated power: the minimum detectable gap and the seeds it needs (t quantiles from printed tables, not scipy)


def test_min_detectable_gap_matches_the_t_table():
    # t_{0.975,7} = 2.3646, t_{0.8,7} = 0.8960; t_{0.975,3} = 3.1824, t_{0.8,3} = 0.9785
    assert P.min_detectable_gap(1.0, 8) == pytest.approx((2.3646 + 0.8960) / math.sqrt(8), rel=1e-4)
    assert P.min_detectable_gap(0.02, 4) == pytest.approx((3.1824 + 0.9785) * 0.02 / 2, rel=1e-4)
    assert P.min_detectable_gap(0.5, 1) == math.inf


def test_seeds_needed_is_the_fewest_that_reach_delta():
    # sd 0.03, δ 0.05: n = 4 gives (3.1824 + 0.9785)·0.03/2 = 0.0624 > δ; n = 5 gives
    # (t_{0.975,4} = 2.7764 + t_{0.8,4} = 0.9410)·0.03/√5 = 0.0499 ≤ δ
    assert P.seeds_needed(0.03, 0.05) == 5
    for sd, delta in ((0.0191, 0.05), (0.2148, 0.05), (0.01, 0.001)):
        n = P.seeds_needed(sd, delta)
        assert P.min_detectable_gap(sd, n) <= delta < P.min_detectable_gap(sd, n - 1) or n == P.MIN_SEEDS
    assert P.seeds_needed(0.0, 0.05) == P.MIN_SEEDS == 3
    with pytest.raises(ValueError, match="delta"):
        P.seeds_needed(0.03, 0.0)


def test_underpowered_refuses_matches():
    """A CI well inside ±δ is not "matches" when δ is below what the seeds could detect."""
    diffs = [0.004, -0.004, 0.012, -0.002]  # sd 0.00719: MDE = (3.1824 + 0.9785)·0.00719/2 = 0.01495
    powered = P.judge("x", diffs, 0.02, 2000)
    assert powered["verdict"] == "matches" and powered["matches"] and "matches BF16 within δ = 0.02" in powered["text"]
    weak = P.judge("x", diffs, 0.014, 2000)
    assert -0.014 <= weak["ci95"][0] and weak["ci95"][1] <= 0.014  # the CI alone would have said "matches"
    assert weak["verdict"] == "underpowered" and not weak["matches"]
    assert weak["mde80"] == pytest.approx(0.01495, abs=2e-5)
    # n = 5: (2.7764 + 0.9410)·0.00719/√5 = 0.01195 ≤ 0.014
    assert weak["seeds_needed"] == 5 and "underpowered: need 5 seeds" in weak["text"]
    assert "matches" not in weak["text"]
    one = P.judge("x", [0.0], 0.05, 200)
    assert one["verdict"] == "underpowered" and one["mde80"] is None and "need ≥ 3 seeds" in one["text"]
    two = P.judge("x", [-0.30, -0.20], 0.05, 2000)  # a large gap, but 2 seeds carry no verdict
    assert two["verdict"] == "underpowered" and "need ≥" in two["text"]


def test_tied_differences_do_not_fake_power():
    """Equal paired differences (ties of the discrete rewards) give an SD of 0, i.e. an MDE of 0; the SD is floored at
    the rewards' rounding: resolution/√6 for a difference of two values rounded to multiples of resolution."""
    ties = [0.0, 0.0, 0.0, 0.0]
    assert P.judge("x", ties, 0.005, 200)["verdict"] == "matches"  # no floor: "powered" by a zero SD
    v = P.judge("x", ties, 0.005, 200, resolution=1 / 128)
    assert v["sd_observed"] == 0.0 and v["sd_diff"] == pytest.approx(1 / 128 / math.sqrt(6))
    assert v["mde80"] == pytest.approx((3.1824 + 0.9785) * (1 / 128 / math.sqrt(6)) / 2, rel=1e-4)  # 0.00664
    assert v["verdict"] == "underpowered"
    with pytest.raises(ValueError, match="resolution"):
        P.judge("x", ties, 0.005, 200, resolution=-1.0)


def test_a_gap_beyond_delta_does_not_match_whatever_the_power():
    far = P.judge("x", [-0.30, -0.20, -0.25], 0.05, 2000)  # MDE = (4.3027 + 1.0607)·0.05/√3 = 0.155 > δ
    assert far["mde80"] > 0.05 and far["verdict"] == "does-not-match" and "lies beyond ±δ" in far["text"]
    # powered (sd 0.0068 → MDE 0.0078) but the CI crosses −δ: "does not match"
    near = P.judge("x", [-0.04, -0.06, -0.05, -0.045, -0.055, -0.05, -0.042, -0.058], 0.05, 2000)
    assert near["mde80"] < 0.05 and near["ci95"][0] < -0.05 < near["ci95"][1]
    assert near["verdict"] == "does-not-match" and "crosses ±δ" in near["text"]


@pytest.mark.parametrize("args,needle", [(["--correction", "bogus"], "--correction"),
                                         (["--steps", "3", "--final", "5"], "--final"),
                                         (["--recipe", "fp9"], "fp9"),
                                         (["--sigma", "0.5"], "--sigma: applies to --control only"),
                                         (["--control", "noise", "--sigma", "a,b"], "--sigma"),
                                         (["--control", "noise", "--sigma", "-1"], "--sigma"),
                                         (["--control", "noise", "--sigma", "1,1"], "distinct"),
                                         (["--control", "noise", "--temperature", "2"], "takes --sigma"),
                                         (["--control", "wrong-policy", "--sigma", "2"], "takes --temperature"),
                                         (["--control", "wrong-policy", "--temperature", "1"], "--temperature"),
                                         (["--control", "inverted-ratio", "--sigma", "1,2"], "one sigma"),
                                         (["--control", "noise", "--engine", "torch"], "--engine"),
                                         (["--control", "bogus"], "--control")])
def test_parity_usage_errors_exact(tmp_path, capsys, args, needle):
    rc = main(["parity", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, (rc, err)


# ---------------------------------------------------------------------------------------------------------------
# regime options (docs/learning-parity.md, "A regime where correction matters")


def test_regime_options_default_to_the_measured_configuration():
    d = P.ParityConfig()
    assert (d.stale, d.metric, d.vocab, d.horizon, d.logit_gain) == (0, "rollout", 8, 3, 2.0)
    assert d.task().vocab == 8 and d.task().horizon == 3 and d.task().modulus == 5


def _two_steps(**kw):
    from fp8rl.reference.learning import toy_config, toy_state_dict
    from fp8rl.registry import load_engine

    pc = P.ParityConfig(steps=3, groups=4, group_size=8, final=1, **kw)
    task = pc.task()
    cfg = toy_config(task)
    return load_engine("reference"), task, cfg, toy_state_dict(cfg, 0), pc


def test_stale_rollouts_come_from_the_weights_k_steps_old():
    """--stale 1: step t rolls out from the weights after t − 1 updates. Recorded by the engine's update_weights:
    steps 0 and 1 both use the initial weights (no update), step 2 the weights after the first update."""
    engine, task, cfg, sd, pc = _two_steps(stale=1)
    synced = []
    orig = engine.update_weights

    def spy(handle, state):
        synced.append({k: v.clone() for k, v in state.items()})
        return orig(handle, state)

    engine.update_weights = spy
    seen = []
    orig_state = P._bf16_state

    def record(model):
        st = orig_state(model)
        seen.append(st)
        return st

    P._bf16_state, saved = record, P._bf16_state
    try:
        res = P.run_one(engine, task, cfg, sd, "bf16", "none", 0, pc)
    finally:
        P._bf16_state = saved
    # seen: init (rollout_init), the history's copy of θ0, then θ1, θ2 appended at steps 1, 2
    assert len(synced) == 1, "one sync: step 2's rollout from θ1; steps 0 and 1 use θ0"
    theta1 = seen[2]
    assert all(torch.equal(synced[0][k], theta1[k]) for k in theta1)
    assert not all(torch.equal(synced[0][k], seen[0][k]) for k in theta1)  # θ1 differs from θ0
    # a stale rollout differs from its trainer: the k3 mismatch KL is 0 at steps 0 (same weights) and > 0 after
    assert res["metrics"]["k3"][0] < 1e-4 < res["metrics"]["k3"][2]


def test_exact_metric_is_the_enumerated_expected_reward():
    """--metric exact records J(θ) = Σ_s π_θ(s) R(s) before each step's update: at step 0 it is the initial policy's,
    recomputed here from the float64 oracle's table (the trainer is float32)."""
    from fp8rl.reference.learning import gradient_table

    engine, task, cfg, sd, pc = _two_steps(metric="exact")
    res = P.run_one(engine, task, cfg, sd, "bf16", "none", 0, pc)
    tab = gradient_table(task, cfg, sd)
    j0 = float((tab.seq_token_logp().sum(-1).exp() * task.reward(tab.seqs)).sum())
    assert res["metrics"]["exact_reward"][0] == pytest.approx(j0, abs=1e-5)
    assert len(res["metrics"]["exact_reward"]) == 3
    default = P.run_one(engine, task, cfg, sd, "bf16", "none", 0, P.ParityConfig(steps=3, groups=4, group_size=8,
                                                                                  final=1))
    assert "exact_reward" not in default["metrics"]
    assert default["metrics"]["reward"] == res["metrics"]["reward"]  # the enumeration leaves the run as it was


@pytest.mark.parametrize("args,needle", [(["--stale", "-1"], "--stale"),
                                         (["--metric", "exact", "--vocab", "20"], "--metric exact"),
                                         (["--vocab", "1"], "--vocab"),
                                         (["--logit-gain", "0"], "--logit-gain")])
def test_regime_option_usage_errors(tmp_path, capsys, args, needle):
    rc = main(["parity", "--out", str(tmp_path / "x"), *args])
    assert rc == 2 and needle in capsys.readouterr().err
