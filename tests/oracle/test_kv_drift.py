"""Tests of the KV-scale drift simulator (``fp8rl.reference.drift``) and the ``fp8rl kv-drift`` command.

The headline claims, on the default configuration: never recalibrating degrades (saturation grows, attention
error and log-prob divergence leave the bound), per-step recalibration holds the bound at every step, every-N
sits in between; the default run is fast. Bounds come from fp8rl.tolerances (kv_attention_vs_fresh,
kv_drift_logprob_vs_fresh), whose values the oracle holds as its default κ factors (checked equal below).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from fp8rl import tolerances
from fp8rl.engines.torch import TorchEngine
from fp8rl.reference import drift
from fp8rl.reports import render_section_plots, summarize, validate
from support import REPO_ROOT

ROOT = REPO_ROOT
SMALL = {"steps": 6, "grow_steps": 4, "growth": 0.12, "seq_len": 24, "batch": 2, "calib_batch": 4}


@pytest.fixture(scope="module")
def default_run() -> tuple[drift.DriftResult, float]:
    t0 = time.process_time()
    result = drift.simulate()
    return result, time.process_time() - t0


def test_default_kappas_are_the_tolerance_table_values_exact(default_run):
    """The oracle's default κ factors (drift.py imports nothing from the harness) equal the table's entries, and a
    default run uses them."""
    result, _ = default_run
    assert drift.KAPPA_ATTN_VS_FRESH == tolerances.get("kv_attention_vs_fresh").value == result.kappa_attn
    assert drift.KAPPA_LP_VS_FRESH == tolerances.get("kv_drift_logprob_vs_fresh").value == result.kappa_lp


def test_default_never_degrades_stat(default_run):
    result, _ = default_run
    never = result.schedules["never"]
    late = [r for r in never if r.step >= 6]
    assert all(r.attn_err > result.attn_bound(r.step) for r in late)
    assert all(r.logprob_div > result.lp_bound(r.step) for r in late)
    assert max(r.saturation for r in never) > 0.02
    summ = result.summary()
    assert summ["never"]["max_attn_err"] > 4 * summ["every-step"]["max_attn_err"]
    assert summ["never"]["max_kl"] > 10 * summ["every-step"]["max_kl"]


def test_default_every_step_holds_bound_stat(default_run):
    result, _ = default_run
    assert result.holds("every-step"), result.violations("every-step")
    assert max(r.saturation for r in result.schedules["every-step"]) < 1e-3
    assert all(r.recalibrated for r in result.schedules["every-step"])


def test_default_every_n_in_between_stat(default_run):
    result, _ = default_run
    n_never, n_every_n = len(result.violations("never")), len(result.violations("every-n"))
    assert 0 < n_every_n < n_never
    recal = [r.step for r in result.schedules["every-n"] if r.recalibrated]
    assert recal == list(range(0, result.config.steps, result.config.every_n))
    assert [r.step for r in result.schedules["never"] if r.recalibrated] == [0]
    # right after each recalibration every-N equals every-step (same scales, same data)
    for t in recal:
        assert result.schedules["every-n"][t] == result.schedules["every-step"][t]


def test_default_runtime_under_5s_cpu(default_run):
    _, cpu_s = default_run
    assert cpu_s < 5.0 * max(1, torch.get_num_threads()), f"default simulation took {cpu_s:.2f} s of CPU"


def test_deterministic_exact():
    cfg = drift.DriftConfig(**SMALL)
    a, b = drift.simulate(cfg), drift.simulate(cfg)
    assert a.schedules == b.schedules and a.fresh == b.fresh and a.k_amax == b.k_amax


@pytest.mark.parametrize("strategy", ["A", "C"])
def test_other_strategies_every_step_holds_stat(strategy):
    cfg = drift.DriftConfig(strategy=strategy, **SMALL)
    result = drift.simulate(cfg, schedules=("every-step", "never"))
    assert result.holds("every-step")
    sat = max(r.saturation for r in result.schedules["every-step"])
    if strategy == "A":
        assert sat == 0  # 2.2× (Q, K) and 4.5× (V) headroom over the first batch's amax
    else:
        assert sat < 1e-3  # exact amax of the training batch; the rollout batch may exceed it slightly


def test_e5m2_per_head_layout_runs_stat():
    cfg = drift.DriftConfig(fmt="e5m2", layout="head", strategy="C", **SMALL)
    result = drift.simulate(cfg, schedules=("every-step",))
    assert result.holds("every-step")


def test_engine_backend_matches_oracle_backend_bound():
    """The torch engine's KV path gives the same drift numbers as the oracle within the fp32 arithmetic."""
    cfg = drift.DriftConfig(**SMALL)
    oracle = drift.simulate(cfg, schedules=("every-step", "never"))
    torch_run = drift.simulate(cfg, backend=drift.EngineBackend(TorchEngine(), cfg.fmt, cfg.layout),
                               schedules=("every-step", "never"))
    for name in ("every-step", "never"):
        for a, b in zip(oracle.schedules[name], torch_run.schedules[name]):
            assert a.saturation == b.saturation
            assert abs(a.attn_err - b.attn_err) <= 1e-4 * a.attn_err
            assert abs(a.logprob_div - b.logprob_div) <= 1e-3 * a.logprob_div


def test_section_is_a_valid_report_section_exact(default_run):
    result, _ = default_run
    section = result.to_section()
    assert len(section["table"]["rows"]) == result.config.steps
    assert all(len(row) == len(section["table"]["columns"]) for row in section["table"]["rows"])
    report = {
        "schema_version": "1.0", "suite": {"name": "fp8rl", "version": "0"}, "kind": "conformance",
        "engine": {"name": "reference", "version": "0", "capabilities": {}},
        "environment": {k: "x" for k in ("python", "torch", "numpy", "platform", "device", "cpu")},
        "profile": "ci", "seed": 0, "started_at": "2026-01-01T00:00:00+00:00", "duration_s": 0.0, "command": [],
        "summary": summarize([]), "checks": [], "sections": {"kv_drift": section},
    }
    doc = validate(report)
    plots = render_section_plots(doc)
    assert len(plots) == 3 and all(p["png"] for p in plots)


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 0}, "steps"), ({"n_heads": 3, "n_kv_heads": 2}, "n_heads"), ({"head_dim": 7}, "head_dim"),
    ({"calib_batch": 5}, "calib_batch"), ({"fmt": "e4m3fnuz"}, "fmt"), ({"layout": "token_head"}, "layout"),
    ({"layout": "head", "strategy": "B"}, "strategy"), ({"strategy": "median"}, "strategy"),
    ({"growth": -1.0}, "growth"), ({"outlier_channels": 99}, "outlier_channels"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        drift.DriftConfig(**kwargs)


def test_unknown_schedule_rejected():
    with pytest.raises(ValueError, match="schedules"):
        drift.simulate(drift.DriftConfig(**SMALL), schedules=("sometimes",))


def test_cli_kv_drift_json_and_report(tmp_path):
    out = tmp_path / "rep"
    proc = subprocess.run([sys.executable, "-m", "fp8rl", "kv-drift", "--steps", "6", "--grow-steps", "4",
                           "--growth", "0.12", "--json", "--out", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["every_step_holds"] is True and len(data["table"]["rows"]) == 6
    report = json.loads((out / "report.json").read_text())
    assert "kv_drift" in report["sections"]
    assert (out / "report.html").read_text().count("data:image/png") >= 3


def test_cli_kv_drift_usage_error():
    proc = subprocess.run([sys.executable, "-m", "fp8rl", "kv-drift", "--steps", "0"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "steps" in proc.stdout + proc.stderr


def test_cli_defaults_are_the_simulators_exact():
    """``fp8rl kv-drift`` restates DriftConfig's defaults (its parser must not import torch): they must agree."""
    from fp8rl.kv_cli import DRIFT_DEFAULTS

    d = drift.DriftConfig()
    assert DRIFT_DEFAULTS == {k: getattr(d, k) for k in DRIFT_DEFAULTS}


def test_cli_parser_builds_without_torch():
    """Every ``fp8rl`` command builds the whole parser first: it must not pay torch's import (~2 s per command)."""
    code = "import sys; from fp8rl.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
