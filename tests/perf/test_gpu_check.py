"""The GPU readiness script (``python -m fp8rl.perf.gpu_check``) on CPU: its plan fits the 8-minute budget, the probe
stage runs whatever probe command it is given (and records a missing one as unavailable, not failed), the budget
cuts stages short with exit 4, and bad arguments name themselves. No GPU number is produced or claimed here."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from fp8rl.perf import gpu_check

TINY = ["--force-cpu", "--shapes", "tiny", "--repeats", "3", "--iters", "1", "--warmup", "0"]


def test_plan_fits_the_budget_when_every_stage_uses_its_whole_limit(capsys):
    """Worst case: the probe and the GEMM use their whole limits, conformance then starts with its minimum, the gate
    gets its reserve — together no more than the budget (480 s by default: one 8-minute H200 lease)."""
    assert gpu_check.main(["--plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["budget_s"] == gpu_check.DEFAULT_BUDGET_S == 480.0
    stages = {s["stage"]: s for s in plan["stages"]}
    assert list(stages) == ["probe", "gemm", "conformance", "gate"]
    worst = (stages["probe"]["limit_s"] + stages["gemm"]["limit_s"] + stages["conformance"]["min_s"]
             + stages["gate"]["limit_s"])
    assert worst <= plan["budget_s"]


def _fake_probe(tmp_path, body: str) -> str:
    script = tmp_path / "probe.py"
    script.write_text(body)
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{out}}"


def test_probe_stage_runs_the_given_command_and_keeps_its_entry(tmp_path, capsys):
    out = tmp_path / "gc"
    cmd = _fake_probe(tmp_path, "import json, sys\nopen(sys.argv[1] + '/hardware-probe.json', 'w').write("
                                "json.dumps({'name': 'probed-cpu', 'class': 'cpu'}))\n")
    assert gpu_check.main([*TINY, "--probe-cmd", cmd, "--out", str(out)]) == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["stages"]["probe"]["status"] == "ok"
    assert summary["probe"]["entry"] == {"name": "probed-cpu", "class": "cpu"}
    assert summary["stages"]["gemm"]["status"] == "ok" and summary["stages"]["gate"]["status"] == "ok"
    assert set(summary["ratios"]) == {"tiny.a.M32", "tiny.b.M32"}
    for per_config in summary["ratios"].values():
        assert per_config["fp8-row"]["measured"] > 0 and per_config["fp8-row"]["ceiling"] is None  # cpu: no entry


def test_a_probe_this_installation_lacks_is_unavailable_not_failed(tmp_path):
    """Exit 2 is argparse's usage error: e.g. an fp8rl whose ``perf hardware`` has no ``--probe`` yet."""
    out = tmp_path / "gc"
    cmd = _fake_probe(tmp_path, "import sys\nprint('usage: fp8rl perf hardware: unrecognized arguments: --probe', "
                                "file=sys.stderr)\nsys.exit(2)\n")
    assert gpu_check.main([*TINY, "--probe-cmd", cmd, "--out", str(out)]) == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["stages"]["probe"]["status"] == "unavailable"
    assert "unrecognized arguments" in summary["probe"]["output_tail"]


def test_a_failing_probe_fails_the_check(tmp_path):
    out = tmp_path / "gc"
    cmd = _fake_probe(tmp_path, "raise SystemExit(3)\n")
    assert gpu_check.main([*TINY, "--probe-cmd", cmd, "--out", str(out)]) == 1
    assert json.loads((out / "gpu_check.json").read_text())["stages"]["probe"]["status"] == "failed"


def test_budget_exhausted_cuts_the_run_short_with_exit_4(tmp_path, capsys):
    """A budget smaller than the gate's reserve leaves no time for the GEMM stage: it is skipped, recorded, and the
    run exits 4 (cut short, nothing failed); gpu_check.json is still written."""
    out = tmp_path / "gc"
    assert gpu_check.main([*TINY, "--skip-probe", "--budget-s", "1", "--out", str(out)]) == gpu_check.EXIT_CUT == 4
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["stages"]["gemm"] == {**summary["stages"]["gemm"], "status": "skipped", "reason": "budget"}
    assert not (out / "gemm.json").exists()
    assert "CUT SHORT" in capsys.readouterr().out


def test_gemm_stops_between_shapes_at_the_deadline(tmp_path):
    """run_gemm measures no shape once its deadline has passed and names every shape it skipped."""
    import time

    res, details, skipped = gpu_check.run_gemm(tmp_path, device="cpu", m_values=(32,), shapes=gpu_check.TINY_SHAPES,
                                               repeats=1, iters=1, warmup=0, seed=0, hardware_name=None,
                                               deadline=time.monotonic() - 1)
    assert res is None and details == {} and skipped == ["tiny.a.M32", "tiny.b.M32"]


@pytest.mark.parametrize("argv, name", [(["--repeats", "0"], "--repeats"), (["--iters", "0"], "--iters"),
                                        (["--warmup", "-1"], "--warmup"), (["--budget-s", "0"], "--budget-s"),
                                        (["--conformance-timeout", "-5"], "--conformance-timeout")])
def test_bad_arguments_name_themselves(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv)
    assert exc.value.code == 2
    assert name in capsys.readouterr().err
