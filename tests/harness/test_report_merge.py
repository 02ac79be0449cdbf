"""``fp8rl report merge`` (fp8rl.reports.merge): many report.json files → one engine × check matrix, JSON and a
self-contained HTML page that a headless browser renders with no request leaving the page."""

from __future__ import annotations

import json
import re

import pytest
from fp8rl.cli import main
from fp8rl.reports import merge as M
from fp8rl.reports import summarize


def _report(outcomes: dict[str, str], *, engine: str = "vllm", version: str = "0.32.0", cpu: str = "AMD EPYC",
            gpus: list | None = None, kind: str = "conformance", area: str = "quantization") -> dict:
    checks = []
    for key, outcome in outcomes.items():
        cid, _, case = key.partition("[")
        checks.append({"id": cid, "area": "formats" if cid.startswith("CAST") else area, "title": f"title of {cid}",
                       "nodeid": f"n::{key}", "case": case.rstrip("]"), "outcome": outcome,
                       "message": f"{outcome} because <{cid}>", "bound": None, "metrics": {}, "duration_s": 0.0})
    return {"schema_version": "1.0", "suite": {"name": "fp8rl", "version": "0.1.0"}, "kind": kind,
            "engine": {"name": engine, "version": version, "capabilities": {}},
            "environment": {"python": "3.11", "torch": "2.13.0", "numpy": "2.4", "platform": "linux", "device": "cpu",
                            "cpu": cpu, "cpu_count": 2, "gpus": gpus or []},
            "profile": "ci", "seed": 0, "started_at": "2026-12-01T00:00:00+00:00", "duration_s": 1.0,
            "command": ["fp8rl"], "summary": summarize(checks), "checks": checks, "warnings": [], "sections": {}}


@pytest.mark.parametrize(("outcomes", "worst"), [
    (["passed", "passed"], "passed"), (["passed", "skipped"], "passed"), (["skipped", "skipped"], "skipped"),
    (["passed", "xfailed"], "xfailed"), (["xfailed", "xpassed"], "xpassed"), (["passed", "failed", "xpassed"], "failed"),
    (["failed", "error"], "error"), (["passed", "not_run"], "not_run"), (["xpassed", "not_run"], "not_run"),
])
def test_fold_takes_the_worst_case_and_counts_each_outcome_exact(outcomes, worst):
    cases = [{"id": "Q-1", "case": f"c{i}", "outcome": o, "message": f"m{i}"} for i, o in enumerate(outcomes)]
    cell = M.fold(cases)
    assert cell.outcome == worst
    assert sum(cell.counts.values()) == len(outcomes) and cell.counts[worst] == outcomes.count(worst)
    i = outcomes.index(worst)
    assert cell.message == (f"[c{i}] m{i}" if len(outcomes) > 1 else f"m{i}")


def test_merge_builds_the_engine_by_check_matrix_exact():
    a = _report({"Q-1[x]": "passed", "Q-1[y]": "passed", "Q-2": "xfailed", "CAST-1": "passed"})
    b = _report({"Q-1[x]": "passed", "Q-1[y]": "failed", "Q-2": "xfailed", "Q-3": "skipped"}, version="0.33.0")
    c = _report({"Q-1[x]": "passed", "Q-2": "xfailed"}, version="0.33.0", gpus=[{"name": "NVIDIA H200"}] * 8)
    m = M.merge([("a.json", a), ("b.json", b), ("c.json", c)])
    keys = [col.key for col in m.columns]
    assert keys == ["vllm 0.32.0 @ AMD EPYC ×2; torch 2.13.0", "vllm 0.33.0 @ AMD EPYC ×2; torch 2.13.0",
                    "vllm 0.33.0 @ NVIDIA H200 ×8; torch 2.13.0"]
    cells = {r.check: [r.cells[k].outcome for k in keys] for r in m.rows}
    assert cells == {"CAST-1": ["passed", "absent", "absent"], "Q-1": ["passed", "failed", "passed"],
                     "Q-2": ["xfailed", "xfailed", "xfailed"], "Q-3": ["absent", "skipped", "absent"]}
    assert [r.check for r in m.rows] == ["Q-1", "Q-2", "Q-3", "CAST-1"]  # areas in first-seen order, ids sorted
    assert [r.check for r in m.differing] == ["Q-1"]  # absent cells do not make a difference
    row = next(r for r in m.rows if r.check == "Q-1")
    assert row.cells[keys[1]].counts == {"failed": 1, "passed": 1}
    assert row.cells[keys[1]].message == "[y] failed because <Q-1>"
    d = m.as_dict()
    assert d["differing_rows"] == 1 and d["columns"][2]["machine"] == "NVIDIA H200 ×8; torch 2.13.0"
    json.dumps(d)  # JSON-serializable as is


def test_same_engine_version_and_machine_twice_gets_distinct_columns_exact():
    a = _report({"Q-1": "passed"})
    m = M.merge([("1/report.json", a), ("2/report.json", a)])
    assert [c.key for c in m.columns] == ["vllm 0.32.0 @ AMD EPYC ×2; torch 2.13.0",
                                          "vllm 0.32.0 @ AMD EPYC ×2; torch 2.13.0 #2"]


def test_merge_rejects_a_mutants_report_naming_it():
    with pytest.raises(M.MergeError, match="m.json: a 'mutants' report"):
        M.merge([("m.json", _report({"Q-1": "passed"}, kind="mutants"))])
    with pytest.raises(M.MergeError, match="at least one"):
        M.merge([])


def test_html_is_self_contained_escaped_and_lists_differing_rows_first():
    a = _report({"Q-1": "passed", "Q-2": "passed"}, engine="<eng>")
    b = _report({"Q-1": "failed", "Q-2": "passed"}, engine="<eng>", version="0.33.0")
    page = M.to_html(M.merge([("a", a), ("b", b)]))
    assert "default-src 'none'" in page and "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing loaded from anywhere
    assert "<eng>" not in page and "&lt;eng&gt;" in page and "failed because &lt;Q-1&gt;" in page
    differ = page.index("differs between reports (1)")
    assert differ < page.index("All 2 checks")


def test_report_merge_cli_finds_reports_writes_both_files_and_exit_codes(tmp_path, capsys):
    runs = tmp_path / "artifacts"
    for i, (version, out) in enumerate((("0.32.0", "passed"), ("0.33.0", "failed"))):
        d = runs / f"job-{i}" / "fp8rl-report-vllm"
        d.mkdir(parents=True)
        (d / "report.json").write_text(json.dumps(_report({"Q-1": out, "Q-2": "xfailed"}, version=version)))
    single = tmp_path / "single"
    single.mkdir()
    (single / "report.json").write_text(json.dumps(_report({"Q-1": "passed"}, engine="torch", version="2.13")))
    out = tmp_path / "merged"
    assert main(["report", "merge", str(runs), str(single / "report.json"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 report(s), 2 checks, 1 differ" in text and "Q-1: [1] passed  [2] failed  [3] passed" in text
    d = json.loads((out / "merge.json").read_text())
    assert [c["engine"] for c in d["columns"]] == ["vllm", "vllm", "torch"]
    assert (out / "merge.html").read_text().startswith("<!DOCTYPE html>")
    # usage errors name the argument
    assert main(["report", "merge", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["report", "merge", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "no report.json" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "conformance"}))
    assert main(["report", "merge", str(bad), "--out", str(out)]) == 2
    assert "bad.json" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    assert main(["report", "merge", str(single), "--out", str(tmp_path / "file" / "sub")]) == 2
    assert "--out" in capsys.readouterr().out


def test_merge_html_renders_in_headless_chromium_with_no_console_problem(tmp_path):
    from test_reports import _chromium, _render

    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on PATH (CI installs it: apt-get install -y chromium)")
    a = _report({"Q-1": "passed", "Q-2": "xfailed", "CAST-1": "passed"})
    b = _report({"Q-1": "failed", "Q-2": "xpassed"}, version="0.33.0")
    _, html_path = M.write(M.merge([("a", a), ("b", b)]), tmp_path / "m")
    shot, bad, log = _render(exe, html_path, tmp_path, size=(900, 700))
    assert not bad, "\n".join(bad)
    from matplotlib.image import imread

    img = imread(shot)
    assert float(img[..., :3].std()) > 0.05, "screenshot is blank"
    # the failed cell's red (#fbd3d3) is on the page
    pink = (img[..., 0] > 0.95) & (abs(img[..., 1] - 0.83) < 0.03) & (abs(img[..., 2] - 0.83) < 0.03)
    assert pink.sum() > 50
