"""``fp8rl report diff`` (fp8rl.reports.diff), the pinned-upstream test marks and the nightly drift report."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fp8rl.cli import main
from fp8rl.reports import summarize
from fp8rl.reports.diff import classify, diff_reports
from support import REPO_ROOT, upstream

ROOT = REPO_ROOT


def _report(outcomes: dict[str, str], *, engine: str = "vllm", version: str = "0.32.0",
            warnings: list[str] | None = None) -> dict:
    checks = []
    for key, outcome in outcomes.items():
        cid, _, case = key.partition("[")
        checks.append({"id": cid, "area": "quantization", "title": "t", "nodeid": f"n::{key}",
                       "case": case.rstrip("]"), "outcome": outcome, "message": f"{outcome} because", "bound": None,
                       "metrics": {}, "duration_s": 0.0})
    return {"schema_version": "1.0", "suite": {"name": "fp8rl", "version": "0.1.0"}, "kind": "conformance",
            "engine": {"name": engine, "version": version, "capabilities": {}},
            "environment": {"python": "3.11", "torch": "2.13.0", "numpy": "2.4", "platform": "linux", "device": "cpu", "cpu": "x"}, "profile": "ci", "seed": 0,
            "started_at": "2026-12-01T00:00:00+00:00", "duration_s": 1.0, "command": ["fp8rl"],
            "summary": summarize(checks), "checks": checks, "warnings": warnings or [], "sections": {}}


@pytest.mark.parametrize(("old", "new", "kind"), [
    ("passed", "failed", "regression"), ("passed", "error", "regression"), ("xfailed", "error", "regression"),
    ("skipped", "failed", "regression"), ("passed", None, "regression"), ("failed", "passed", "improvement"),
    ("error", "xfailed", "improvement"), ("xfailed", "xpassed", "xfail"), ("xpassed", "xfailed", "xfail"),
    ("passed", "skipped", "other"), (None, "passed", "other"), (None, "failed", "regression"),
    ("skipped", None, "other"), ("failed", "error", "other"),
])
def test_classify_outcome_changes_exact(old, new, kind):
    assert classify(old, new) == kind


def test_diff_lists_every_changed_check_exact():
    old = _report({"A-1[x]": "passed", "A-2": "xfailed", "A-3": "passed", "A-4": "failed", "A-5": "passed"},
                  warnings=["fp8rl: xfails entry 'Z' matches no collected check (stale entry?)"])
    new = _report({"A-1[x]": "failed", "A-2": "xpassed", "A-3": "passed", "A-4": "passed", "A-6": "skipped"},
                  version="0.33.0")
    d = diff_reports(old, new)
    got = {(c.key, c.old, c.new, c.kind) for c in d.changes}
    assert got == {("A-1[x]", "passed", "failed", "regression"), ("A-2", "xfailed", "xpassed", "xfail"),
                   ("A-4", "failed", "passed", "improvement"), ("A-5", "passed", None, "regression"),
                   ("A-6", None, "skipped", "other")}
    assert d.unchanged == 1 and len(d.regressions) == 2
    assert d.stale_xfails_removed == ["fp8rl: xfails entry 'Z' matches no collected check (stale entry?)"]
    assert (d.old_label, d.new_label) == ("vllm 0.32.0", "vllm 0.33.0")


def test_report_diff_cli_exit_codes(tmp_path, capsys):
    for name, outcomes in (("old", {"A-1": "passed", "A-2": "xfailed"}), ("same", {"A-1": "passed", "A-2": "xfailed"}),
                           ("fixed", {"A-1": "passed", "A-2": "xpassed"}), ("worse", {"A-1": "error", "A-2": "xfailed"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(_report(outcomes)))
    assert main(["report", "diff", str(tmp_path / "old"), str(tmp_path / "same")]) == 0
    assert main(["report", "diff", str(tmp_path / "old"), str(tmp_path / "fixed" / "report.json")]) == 0
    assert "xfailed" in capsys.readouterr().out
    assert main(["report", "diff", "--json", str(tmp_path / "old"), str(tmp_path / "worse")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["regressions"] == 1 and out["changes"][0]["check"] == "A-1"
    assert main(["report", "diff", str(tmp_path / "old"), str(tmp_path / "missing")]) == 2
    assert "expected a report.json" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# pinned-upstream marks


def test_holds_compares_public_versions_exact():
    v = upstream.installed_version("torch")
    assert v is not None
    major_minor = ".".join(v.split("+")[0].split(".")[:2])
    assert upstream.holds("torch", f"=={major_minor}.*")  # local label (+cpu) ignored
    assert not upstream.holds("torch", f"<{major_minor}")
    assert not upstream.holds("a-package-that-is-not-installed", ">=0")


def test_pin_marks_skip_outside_the_range_with_a_reason(pytester):
    pytester.makepyfile(support_pin=(ROOT / "tests" / "support" / "upstream.py").read_text())
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_pins="""
        from support_pin import pinned
        @pinned("torch", ">=0", "anything")
        def test_in_range(): pass
        @pinned("torch", "<0.1", "old behaviour")
        def test_out_of_range(): raise AssertionError("must not run")
    """)
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider", "--junitxml=j.xml")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*pins torch<0.1 behaviour (old behaviour); installed: *: re-verify*"])
    props = {p.get("value") for p in ET.parse(pytester.path / "j.xml").getroot().iter("property")
             if p.get("name") == "upstream_pin"}
    assert props == {"torch>=0", "torch<0.1"}


# ---------------------------------------------------------------------------------------------------------------
# the nightly drift report (.ci/drift.py) on synthetic tier outputs


def _drift_module():
    spec = importlib.util.spec_from_file_location("ci_drift", ROOT / ".ci" / "drift.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tier(root: Path, mode: str, freeze: str, outcomes: dict[str, str], junit_outcome: str) -> None:
    d = root / mode / "base"
    (d / "fp8rl-report").mkdir(parents=True)
    (d / "freeze.txt").write_text(freeze)
    (d / "failed.json").write_text("[]")
    (d / "fp8rl-report" / "report.json").write_text(json.dumps(_report(outcomes)))
    skipped = "<skipped message='pins'/>" if junit_outcome == "skipped" else ""
    (d / "pytest-0.xml").write_text(
        "<testsuites><testsuite><testcase classname='tests.test_x' name='test_pin'>"
        "<properties><property name='upstream_pin' value='ml_dtypes&lt;0.7'/></properties>"
        f"{skipped}</testcase><testcase classname='tests.test_x' name='test_plain'/></testsuite></testsuites>")


def test_drift_report_versions_only_exits_0(tmp_path):
    drift = _drift_module()
    _tier(tmp_path, "locked", "ml_dtypes==0.6.0\nnumpy==2.4.6\n", {"A-1": "passed"}, "passed")
    _tier(tmp_path, "latest", "ml-dtypes==0.7.0\nnumpy==2.4.6\n", {"A-1": "passed"}, "passed")
    assert drift.main([str(tmp_path)]) == 0
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data[0]["versions"] == [{"package": "ml-dtypes", "locked": "0.6.0", "latest": "0.7.0"}]
    assert "versions only" in (tmp_path / "drift.md").read_text()


def test_drift_report_flags_changed_checks_and_pins_exits_1(tmp_path):
    drift = _drift_module()
    _tier(tmp_path, "locked", "ml_dtypes==0.6.0\n", {"A-1": "passed", "A-2": "xfailed"}, "passed")
    _tier(tmp_path, "latest", "ml_dtypes==0.7.0\n", {"A-1": "passed", "A-2": "xpassed"}, "skipped")
    assert drift.main([str(tmp_path)]) == 1
    data = json.loads((tmp_path / "drift.json").read_text())[0]
    assert data["check_diffs"][0]["changes"][0]["kind"] == "xfail"
    assert data["tests"] == [{"test": "tests.test_x::test_pin", "locked": "passed", "latest": "skipped",
                              "pin": "ml_dtypes<0.7"}]
    md = (tmp_path / "drift.md").read_text()
    assert "| base | 1 | 1 | 0 | 1 (1) | changed |" in md
