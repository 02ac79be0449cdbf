"""Positive controls of ``fp8rl parity`` (suite/parity_controls.py): conditions built to be wrong must get "does not
match BF16", at a budget small enough for CI.

The budget: 4 paired seeds × 30 GRPO steps (8 × 8 responses a step; the default steps, lr, modulus and δ = 0.05,
i.e. the nightly's runs with fewer seeds). Measured on the reference engine (docs/learning-parity.md, "Positive
controls"): 3 seeds is the fewest that carry a verdict at all (``MIN_SEEDS``), and there the inverted-ratio
control's CI ends at −0.061, a hair beyond −δ; with 4 seeds each control's 95 % CI lies well beyond −δ (inverted
ratio at σ = 1: gap −0.311 [−0.501, −0.131]; temperature 3: −0.218 [−0.351, −0.114]; noise σ = 8: −0.520
[−0.566, −0.450]), so the verdict does not hinge on the power rule or on a bootstrap draw. A control run is 8 GRPO
runs of 30 steps: 5-10 s of CPU on one thread (20-25 s wall on the shared 2-core machine).
"""

from __future__ import annotations

import json

import pytest
from fp8rl import parity as P
from fp8rl import parity_controls as PC
from fp8rl.cli import main

BUDGET = ["--seeds", "4", "--steps", "30", "--final", "10"]


def _run(tmp_path, capsys, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "par"
    rc = main(["parity", *args, *BUDGET, "--out", str(out)])
    printed = capsys.readouterr().out
    return rc, json.loads((out / "parity.json").read_text()), printed


@pytest.mark.slow
def test_inverted_ratio_control_does_not_match(tmp_path, capsys):
    rc, res, printed = _run(tmp_path, capsys, "--control", "inverted-ratio")
    name = "bf16+noise(1)+is [inverted-ratio]"
    assert res["conditions"] == ["bf16", name]
    v = res["verdicts"][name]
    assert v["verdict"] == "does-not-match" and v["ci95"][1] < -0.05, v["text"]
    assert res["control"]["caught"] == {name: True} and res["control"]["smallest_sigma_detected"] == 1.0
    assert rc == 0 and "does NOT match BF16" in printed and "parity caught 1 of 1" in printed


@pytest.mark.slow
def test_wrong_policy_control_does_not_match(tmp_path, capsys):
    rc, res, printed = _run(tmp_path, capsys, "--control", "wrong-policy")
    name = "bf16+tis [wrong-policy T=3]"
    v = res["verdicts"][name]
    assert v["verdict"] == "does-not-match" and v["ci95"][1] < -0.05, v["text"]
    assert res["control"]["parameter"] == "temperature" and res["control"]["smallest_temperature_detected"] == 3.0
    assert rc == 0


@pytest.mark.slow
def test_noise_sweep_records_the_smallest_sigma_caught(tmp_path, capsys):
    """σ = 0.5 is too small to matter at this budget (a powered "matches", MDE 0.032), σ = 1 is not resolved
    (gap −0.025, "underpowered": MDE 0.077 > δ), σ = 8 is caught: the smallest σ caught is 8, not the first one."""
    rc, res, printed = _run(tmp_path, capsys, "--control", "noise", "--sigma", "8,0.5,1")
    names = ["bf16+noise(0.5)+none", "bf16+noise(1)+none", "bf16+noise(8)+none"]
    assert res["conditions"] == ["bf16", *names]
    assert [res["verdicts"][n]["verdict"] for n in names] == ["matches", "underpowered", "does-not-match"]
    ctl = res["control"]
    assert ctl["values"] == [0.5, 1.0, 8.0] and ctl["caught"] == dict(zip(names, [False, False, True], strict=True))
    assert ctl["smallest_detected"] == ctl["smallest_sigma_detected"] == 8.0
    assert rc == 0 and "smallest sigma detected 8" in printed


def test_control_exit_codes():
    def result(*verdicts):
        return {"verdicts": {f"c{i}": {"verdict": v} for i, v in enumerate(verdicts)}}

    assert P.control_exit(result("matches", "does-not-match")) == 0  # caught at one strength
    assert P.control_exit(result("matches", "matches")) == 1  # blind to it
    assert P.control_exit(result("matches", "underpowered")) == 4  # neither


def test_noisy_engine_reports_the_distribution_it_samples(monkeypatch):
    """The noise control's rollouts are consistent: each reported log-prob is log_softmax(logits + σ·ε) at the
    drawn token, and the drawn tokens follow that noisy distribution — the mismatch is of known size and correctable."""
    import torch

    policy_cls = PC.NoisyLogitsEngine(2.0)._rollout_policy_class()
    policy = policy_cls.__new__(policy_cls)  # decode_step uses no model state
    logits = torch.tensor([[0.0, 3.0, -1.0, 0.5]]).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    nxt, lp, x = policy.decode_step(logits, False, gen)
    noisy = torch.log_softmax(x, -1)
    assert torch.equal(lp, noisy.gather(-1, nxt[:, None]).squeeze(-1))
    assert not torch.equal(x, logits) and float((x - logits).std()) == pytest.approx(2.0, rel=0.05)
    # without noise the top token (3.0) has p = 0.82; σ = 2 flattens the average distribution
    assert 0.4 < float((nxt == 1).double().mean()) < 0.75
    g_nxt, g_lp, g_x = policy.decode_step(logits[:3], True, gen)  # greedy: no noise
    assert torch.equal(g_x, logits[:3]) and g_nxt.tolist() == [1, 1, 1]


def test_temperature_engine_samples_hot_and_reports_cold():
    import torch

    policy_cls = PC.TemperatureMismatchEngine(3.0)._rollout_policy_class()
    policy = policy_cls.__new__(policy_cls)
    logits = torch.tensor([[0.0, 3.0, -1.0, 0.5]]).repeat(20000, 1)
    nxt, lp, _ = policy.decode_step(logits, False, torch.Generator().manual_seed(0))
    cold = torch.log_softmax(logits, -1)
    assert torch.equal(lp, cold.gather(-1, nxt[:, None]).squeeze(-1))  # the temperature-1 log-probs
    hot = torch.softmax(logits[0] / 3.0, -1)
    freq = torch.bincount(nxt, minlength=4).double() / nxt.numel()
    assert torch.allclose(freq, hot.double(), atol=0.015)  # drawn from temperature 3, not from exp(lp)
    assert float(hot[1]) < 0.6 < float(cold.exp()[0, 1])


def test_controls_memoize_per_strength():
    """The reference policy memoizes rollouts by policy class name: each σ / temperature needs its own."""
    a = PC.NoisyLogitsEngine(1.0)._rollout_policy_class()
    b = PC.NoisyLogitsEngine(2.0)._rollout_policy_class()
    c = PC.TemperatureMismatchEngine(2.0)._rollout_policy_class()
    assert len({a.__qualname__, b.__qualname__, c.__qualname__}) == 3
    with pytest.raises(ValueError, match="sigma"):
        PC.NoisyLogitsEngine(0.0)
    with pytest.raises(ValueError, match="temperature"):
        PC.TemperatureMismatchEngine(1.0)
