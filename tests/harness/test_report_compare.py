"""``fp8rl report compare``: engine × correction-option cells from report.json entries (fp8rl.reports.compare)."""

from __future__ import annotations

from fp8rl.reports import compare as K


def _check(cid, outcome, message="", area="correction"):
    return {"id": cid, "area": area, "outcome": outcome, "message": message}


def _report(name, checks):
    return {"engine": {"name": name, "version": f"{name} 1.0"}, "checks": checks}


def test_cell_verdicts():
    checks = {c["id"]: c for c in (
        _check("CORR-TIS-001", "passed"), _check("CORR-TIS-004", "skipped", "no lower clamp"),
        _check("CORR-RS-002", "passed"), _check("CORR-RS-003", "xfailed", "vendor xfail: inverse ratio\nmore"),
        _check("CORR-GEO-001", "skipped", "rollout_correction: no geometric level"),
        _check("CORR-VAL-001", "failed", "DID NOT RAISE"))}
    assert K.judge(checks, ("CORR-TIS-001", "CORR-TIS-004")).text() == "conformant: 1/2 ran"
    dev = K.judge(checks, ("CORR-RS-002", "CORR-RS-003"))
    assert dev.verdict == "deviation" and dev.reason == "CORR-RS-003 (known deviation): inverse ratio"
    assert K.judge(checks, ("CORR-GEO-001",)).text() == "skipped: rollout_correction: no geometric level"
    assert K.judge(checks, ("CORR-VAL-001",)).reason == "CORR-VAL-001 (failed): DID NOT RAISE"
    assert K.judge(checks, ("CORR-LOSS-001",)).verdict == "—"


def test_table_markdown_and_html():
    a = K.column_from_report(_report("a", [_check("CORR-TIS-001", "passed"), _check("WSYNC-X", "passed", area="x")]))
    b = K.column_from_report(_report("b", [_check("CORR-TIS-001", "xfailed", "vendor xfail: a | pipe")]))
    rows = K.rows_of([a, b])
    assert rows == ["token-level TIS (truncate at U)"]  # other areas are dropped by default, empty rows too
    c = K.column_unavailable("c", "c not installed", "not run: needs CUDA", rows)
    md = K.to_markdown([a, b, c], rows)
    assert "| token-level TIS (truncate at U) | conformant | deviation: CORR-TIS-001 (known deviation): a \\| pipe " \
           "| not run |" in md
    assert "**c not run:** needs CUDA" in md
    page = K.to_html([a, b, c], rows)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    assert "class='deviation'" in page and "c not run:</b> needs CUDA" in page


def test_one_line():
    assert K.one_line("vendor xfail: first line\nsecond") == "first line"
    assert K.one_line("x" * 300, 10) == "x" * 9 + "…"


def test_a_failing_case_of_a_parametrized_check_makes_the_deviation():
    rep = _report("a", [_check("CORR-TIS-001", "passed"), _check("CORR-TIS-001", "failed", "case 2 wrong"),
                        _check("CORR-TIS-001", "passed")])
    cell = K.column_from_report(rep).cells["token-level TIS (truncate at U)"]
    assert cell.text() == "deviation: CORR-TIS-001 (failed): case 2 wrong"
