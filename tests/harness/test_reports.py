"""fp8rl.reports: schema, validation, the four artifacts, escaping, and a headless-Chromium render."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from fp8rl import reports

# ---------------------------------------------------------------------------------------------------------------
# a realistic synthetic report

EVIL = "<script>alert('x')</script> | pipe & `tick` $x^2$ *em* _u_"


def _check(id_, area, outcome, case="", message="", metrics=None, bound=None, title=None):
    return {
        "id": id_,
        "area": area,
        "title": title or f"{id_}: the engine output stays within its bound.",
        "nodeid": f"fp8rl/conformance/test_{area}.py::test_{id_.lower().replace('-', '_')}"
        + (f"[{case}]" if case else ""),
        "case": case,
        "outcome": outcome,
        "message": message,
        "duration_s": 0.012,
        "bound": bound,
        "metrics": metrics or {},
    }


def make_report(kind: str = "conformance") -> dict:
    checks = [
        _check("QUANT-GROUP-001", "quantization", "passed", "e4m3-128", bound="quant.e4m3.rel",
               metrics={"max_abs_err": 1e-3, "bound": 4e-3, "err_over_bound": 0.25,
                        "ulp_hist": {"0": 1000, "1": 24, ">=2": 0}, "mismatch_frac": 0.0}),
        _check("QUANT-GROUP-002", "quantization", "passed", "e5m2-64", bound="quant.e5m2.rel",
               metrics={"max_abs_err": 0.0, "bound": 1e-2, "err_over_bound": 0.0, "ulp_hist": {"0": 4096}}),
        _check("QUANT-GROUP-003", "quantization", "failed", "e4m3-128",
               message="AssertionError: max |err| 3.1e-2 exceeds quant.e4m3.rel 4e-3\n  at block (3, 7)\n"
                       "\x1b[31mred\x1b[0m and a NUL \x00 byte",
               bound="quant.e4m3.rel",
               metrics={"max_abs_err": 3.1e-2, "bound": 4e-3, "err_over_bound": 7.75,
                        "ulp_hist": {"0": 900, "1": 100, ">=2": 24}, "mismatch_frac": 0.023}),
        _check("GEMM-ACC-001", "gemm", "passed", "m64-n128-k4096", bound="gemm.fp32acc",
               metrics={"max_abs_err": 2e-5, "bound": 1e-4}),  # err_over_bound derived
        _check("GEMM-ACC-002", "gemm", "error", "m64-n128-k4096",
               message="RuntimeError: CUDA error: an illegal memory access was encountered"),
        _check("GEMM-ACC-003", "gemm", "failed", "inf-case", message="err/bound is infinite",
               bound="gemm.fp32acc", metrics={"err_over_bound": math.inf, "max_abs_err": np.float32(2.5)}),
        _check("KV-CACHE-001", "kv_cache", "skipped", message="engine lacks capability fp8_kv_cache: not built"),
        _check("KV-CACHE-002", "kv_cache", "skipped", message="engine lacks capability fp8_kv_cache: not built"),
        _check("KV-CACHE-003", "kv_cache", "skipped", message="requires a GPU"),
        _check("SCALE-AMAX-001", "scaling", "xfailed", message="known vendor issue #12: amax history off by one"),
        _check("SCALE-AMAX-002", "scaling", "xpassed", message="vendor xfail list says this fails"),
        _check("LOGP-MISMATCH-001", "mismatch", "passed", title=EVIL, case="a|b",
               metrics={"mismatch_frac": float("nan"), "per_token": [0.1, None, 0.3]}),
    ]
    r = {
        "schema_version": "1.0",
        "suite": {"name": "fp8rl", "version": "0.1.0"},
        "kind": kind,
        "engine": {"name": "reference", "version": "0.1.0",
                   "capabilities": {"fp8_gemm": True, "fp8_kv_cache": "not built with FP8 KV support"}},
        "environment": {"python": "3.11.2", "torch": "2.13.0+cpu", "numpy": "2.1.0", "platform": "Linux-x86_64",
                        "device": "cpu", "cpu": "AMD EPYC", "hostname": EVIL},
        "profile": "quick",
        "seed": 1234,
        "started_at": "2025-06-01T12:00:00.123456+00:00",
        "duration_s": 12.5,
        "command": ["fp8rl", "conform", "--engine", "reference", "--profile", "quick"],
        "summary": reports.summarize(checks),
        "checks": checks,
        "sections": {
            "kv_drift": {
                "title": "KV-cache drift over decode steps",
                "text": "Max |Δ| of K/V vs the bf16 cache. " + EVIL,
                "table": {"columns": ["step", "max_abs_dk", "max_abs_dv"],
                          "rows": [[1, 1e-3, 2e-3], [64, 4e-3, 5e-3], [512, 9e-3, 1.1e-2]]},
                "plot": {"type": "lines", "title": "KV drift", "x": [1, 64, 512],
                         "series": {"dk": [1e-3, 4e-3, 9e-3], "dv": [2e-3, 5e-3, 1.1e-2], "_hidden": [1, 2, 3]},
                         "xlabel": "decode step", "ylabel": "max |Δ|", "yscale": "log",
                         "hlines": [{"y": 2e-2, "label": "kv.drift bound"}]},
            },
            "mismatch": {
                "plot": [
                    {"type": "lines", "title": "per-token |Δlogp| $cost$", "x": ["t0", "t1", "t2"],
                     "series": {"seq0": [0.01, None, "inf"]}, "xlabel": "token", "ylabel": "|Δlogp|"},
                    {"type": "lines", "title": "empty", "x": [0, 1], "series": {"s": [None, "nan"]}},
                ],
                "raw": {"n_tokens": 3},
            },
        },
    }
    if kind == "mutants":
        r["mutants"] = [
            {"mutant": "round-toward-zero", "description": "cast rounds toward zero", "killed": True,
             "killed_by": ["QUANT-GROUP-003"]},
            {"mutant": "drop-scale", "description": "forgets the per-group scale " + EVIL, "killed": False,
             "killed_by": []},
        ]
        r["mutation_score"] = 0.5
    return r


def test_schema_is_valid_draft_2020_12_package_data():
    from jsonschema import Draft202012Validator

    s = reports.schema()
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(s)
    s["mutated"] = True  # a fresh copy each call
    assert "mutated" not in reports.schema()


@pytest.mark.parametrize("kind", ["conformance", "mutants"])
def test_realistic_report_validates(kind):
    doc = reports.validate(make_report(kind))
    # normalised: inf/nan -> tokens, numpy scalar -> float; strict JSON round-trips
    gemm3 = next(c for c in doc["checks"] if c["id"] == "GEMM-ACC-003")
    assert gemm3["metrics"]["err_over_bound"] == "inf"
    assert isinstance(gemm3["metrics"]["max_abs_err"], float)
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc
    assert reports.validate(doc) == doc


def _errors(report) -> str:
    with pytest.raises(reports.ReportValidationError) as ei:
        reports.validate(report)
    return str(ei.value)


def test_rejects_missing_summary():
    r = make_report()
    del r["summary"]
    msg = _errors(r)
    assert "$: 'summary' is a required property" in msg


def test_rejects_bad_outcome_with_path():
    r = make_report()
    r["checks"][2]["outcome"] = "passd"
    msg = _errors(r)
    assert "$.checks[2].outcome: 'passd' is not one of" in msg


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r["summary"].update(failed=0), "$.summary.failed: is 0 but 2 check(s)"),
        (lambda r: r["summary"].update(verdict="conformant"), "$.summary.verdict: 'conformant' with failed"),
        (lambda r: r["engine"]["capabilities"].update(fp8_gemm=False), "$.engine.capabilities.fp8_gemm"),
        (lambda r: r.update(kind="mutants"), "'mutants' is a required property"),
        (lambda r: r.update(mutation_score=0.5), "$:"),
        (lambda r: r.update(started_at="yesterday"), "$.started_at: 'yesterday' does not match"),
        (lambda r: r["checks"][0]["metrics"]["ulp_hist"].update({"two": 3}), "$.checks[0].metrics.ulp_hist"),
        (lambda r: r["checks"][0].pop("bound"), "$.checks[0]: 'bound' is a required property"),
        (lambda r: r.update(extra=1), "Additional properties are not allowed ('extra'"),
        (lambda r: r["sections"]["kv_drift"]["plot"]["series"].update(dk=[1.0]),
         "$.sections.kv_drift.plot.series.dk: 1 values but x has 3"),
        (lambda r: r["sections"]["kv_drift"]["table"]["rows"].append([1]), "$.sections.kv_drift.table.rows[3]"),
        (lambda r: r.update(duration_s=float("nan")), "$.duration_s"),
    ],
)
def test_rejects_broken_reports(mutate, expected):
    r = make_report()
    mutate(r)
    msg = _errors(r)
    assert msg.startswith("invalid fp8rl report")
    assert expected in msg, msg


def test_error_lists_several_paths_in_document_order():
    r = make_report()
    r["checks"][10]["outcome"] = "nope"
    r["checks"][2]["area"] = 3
    errs = _errors(r).splitlines()[1:]
    assert errs[0].strip().startswith("- $.checks[2].area")
    assert errs[1].strip().startswith("- $.checks[10].outcome")


def test_summarize_verdict():
    assert reports.summarize([])["verdict"] == "conformant"
    s = reports.summarize([_check("A-001", "a", "passed"), _check("A-002", "a", "xfailed")])
    assert (s["total"], s["passed"], s["xfailed"], s["verdict"]) == (2, 1, 1, "conformant")
    assert reports.summarize([_check("A-001", "a", "error")])["verdict"] == "non-conformant"


# ---------------------------------------------------------------------------------------------------------------
# artifacts


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    paths = reports.write_report(make_report(), out)
    return out, paths


def test_write_report_creates_four_files_no_temp_left(written):
    out, paths = written
    assert set(paths) == {"json", "junit", "md", "html"}
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "report.html", "report.json", "report.md"]
    for p in paths.values():
        assert p.parent == out and p.stat().st_size > 0
    doc = json.loads(paths["json"].read_text())
    assert doc["summary"]["failed"] == 2
    assert reports.load_report(paths["json"]) == doc


def test_write_report_replaces_existing_and_is_atomic(tmp_path, monkeypatch):
    (tmp_path / "report.json").write_text("old")
    (tmp_path / "report.md").write_text("old")
    r = make_report()
    reports.write_report(r, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["seed"] == 1234
    assert (tmp_path / "report.md").read_text() != "old"

    # an invalid report writes nothing and leaves the old artifacts as they were
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    bad = make_report()
    bad["summary"]["verdict"] = "maybe"
    with pytest.raises(reports.ReportValidationError):
        reports.write_report(bad, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    # every file goes through os.replace from a temp file in the same directory
    calls = []
    real_replace = os.replace

    def spy(src, dst):
        calls.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    r["seed"] = 99
    reports.write_report(r, tmp_path)
    assert sorted(d.name for _, d in calls) == ["junit.xml", "report.html", "report.json", "report.md"]
    assert all(s.parent == tmp_path and s.name.startswith(".") for s, _ in calls)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junit.xml", "report.html", "report.json", "report.md"]

    # a failure while writing removes its temp file and keeps the previous artifact
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    r["seed"] = 7
    with pytest.raises(OSError, match="disk full"):
        reports.write_report(r, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junit.xml", "report.html", "report.json", "report.md"]
    assert json.loads((tmp_path / "report.json").read_text())["seed"] == 99


def test_junit_counts_and_elements(written):
    _, paths = written
    root = ET.parse(paths["junit"]).getroot()
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    ts = suites[0]
    # 12 checks: 2 failed, 1 error, 3 skipped + 1 xfailed
    assert (ts.get("tests"), ts.get("failures"), ts.get("errors"), ts.get("skipped")) == ("12", "2", "1", "4")
    cases = ts.findall("testcase")
    assert len(cases) == 12
    by_name = {c.get("name"): c for c in cases}
    q3 = by_name["QUANT-GROUP-003[e4m3-128]"]
    assert q3.get("classname") == "quantization"
    f = q3.find("failure")
    assert f is not None and f.get("message").startswith("AssertionError: max |err|")
    assert "\x1b" not in f.text and "\\x00" in f.text  # ANSI stripped, NUL made visible (XML-legal)
    assert by_name["GEMM-ACC-002[m64-n128-k4096]"].find("error") is not None
    assert by_name["SCALE-AMAX-001"].find("skipped").get("message").startswith("xfail: known vendor issue")
    xp = by_name["SCALE-AMAX-002"]
    assert xp.find("failure") is None and xp.find("skipped") is None
    assert "xpassed" in xp.find("system-out").text
    assert by_name["KV-CACHE-003"].find("skipped").get("message") == "requires a GPU"
    assert by_name["LOGP-MISMATCH-001[a|b]"].find("properties/property[@name='title']").get("value") == EVIL
    props = {p.get("name"): p.get("value") for p in ts.find("properties")}
    assert props["verdict"] == "non-conformant" and props["seed"] == "1234"


def test_markdown_content_and_escaping(written):
    _, paths = written
    text = paths["md"].read_text()
    assert text.startswith("# fp8rl conformance report — reference 0.1.0")
    assert "NON-CONFORMANT" in text
    # failing ids come before the skipped section and the per-area table
    i_fail = text.index("## Failures and errors (3)")
    for cid in ("QUANT-GROUP-003", "GEMM-ACC-002", "GEMM-ACC-003"):
        assert text.index(cid) > i_fail
    assert i_fail < text.index("## Skipped (3)") < text.index("## Per area")
    assert "engine lacks capability fp8\\_kv\\_cache: not built** (2)" in text  # grouped reason
    assert "<script>" not in text and "&lt;script&gt;" in text
    # every table row has exactly the header's number of unescaped pipes
    for block in re.findall(r"((?:^\|.*\n)+)", text, flags=re.M):
        rows = block.strip("\n").split("\n")
        n = len(re.findall(r"(?<!\\)\|", rows[0]))
        assert all(len(re.findall(r"(?<!\\)\|", r)) == n for r in rows), block
    assert "## KV-cache drift over decode steps" in text and "see report.html" in text


def test_markdown_mutants_table(tmp_path):
    paths = reports.write_report(make_report("mutants"), tmp_path)
    text = paths["md"].read_text()
    assert "## Mutants" in text and "Mutation score 50.0% (1/2 mutants killed)" in text
    assert "| `drop-scale` |" in text and "**NO**" in text
    html_text = paths["html"].read_text()
    assert "<h2>Mutants</h2>" in html_text and "&lt;script&gt;" in html_text
    assert ET.parse(paths["junit"]).getroot().find("testsuite/properties/property[@name='mutation_score']") is not None


def test_html_self_contained_with_plots(written):
    _, paths = written
    text = paths["html"].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", text, flags=re.I)
    assert "<link" not in text and "<script" not in text.replace("&lt;script", "")
    assert "@import" not in text and "url(" not in text
    # 3 summary plots + kv_drift + 1 mismatch plot (the empty one becomes a note)
    assert text.count('<img src="data:image/png;base64,') == 5
    assert "no data to plot" in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "default-src 'none'" in text
    for cid in ("QUANT-GROUP-003", "GEMM-ACC-002", "KV-CACHE-001"):
        assert cid in text


def test_html_omits_plots_without_data(tmp_path):
    checks = [_check("A-001", "a", "passed"), _check("A-002", "a", "skipped", message="nope")]
    r = make_report()
    r.update(checks=checks, summary=reports.summarize(checks))
    del r["sections"]
    text = reports.write_report(r, tmp_path)["html"].read_text()
    assert text.count("data:image/png;base64,") == 1  # only outcomes per area
    assert "no check reported metrics.err_over_bound" in text
    assert "no check reported metrics.ulp_hist" in text


def test_render_section_plots_contract():
    out = reports.render_section_plots(reports.validate(make_report()))
    assert [(o["section"], o["title"]) for o in out] == [
        ("kv_drift", "KV drift"), ("mismatch", "per-token |Δlogp| $cost$"), ("mismatch", "empty")]
    assert out[0]["png"].startswith(b"\x89PNG") and out[1]["png"].startswith(b"\x89PNG")
    assert out[2]["png"] is None and out[2]["note"] == "no data to plot"
    broken = {"sections": {"x": {"plot": {"type": "bars", "x": [1], "series": {"s": [1]}}}}}
    (o,) = reports.render_section_plots(broken)
    assert o["png"] is None and "unsupported plot type" in o["note"]


def test_print_summary(capsys):
    from rich.console import Console

    console = Console(record=True, width=140, force_terminal=False)
    reports.print_summary(make_report(), console=console)
    out = console.export_text()
    assert "verdict: NON-CONFORMANT" in out
    for area in ("quantization", "gemm", "kv_cache", "scaling", "mismatch"):
        assert area in out
    assert "QUANT-GROUP-003[e4m3-128] [failed] AssertionError: max |err| 3.1e-2" in out
    assert "SCALE-AMAX-002 [xpassed]" in out
    assert "at block" not in out  # first line of the message only

    console = Console(record=True, width=140)
    ok = [_check("A-001", "a", "passed", title="[bold]x[/bold]")]
    r = make_report("mutants")
    r.update(checks=ok, summary=reports.summarize(ok))
    reports.print_summary(r, console=console)
    out = console.export_text()
    assert "verdict: CONFORMANT" in out and "mutation score: 50.0%" in out and "survived: drop-scale" in out


# ---------------------------------------------------------------------------------------------------------------
# a real browser renders the page: no console errors, a non-blank screenshot


def _chromium() -> str | None:
    for name in ("chromium", "chromium-headless-shell", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


_BROWSER_PROBLEM = re.compile(r":CONSOLE[:(]|CONSOLE\(\d+\)|Uncaught|Refused to|Content Security Policy|net::ERR_")


def _render(exe: str, page: Path, tmp_path: Path, size=(1200, 2000)) -> tuple[Path, list[str], str]:
    """Screenshot ``page`` headless; return (screenshot, problem log lines, full log)."""
    shot = tmp_path / f"{page.stem}.png"
    cmd = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
        f"--screenshot={shot}", f"--window-size={size[0]},{size[1]}", page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    log = proc.stderr + proc.stdout
    # the page has no script at all: any console line (JS error, CSP violation of an external load) is a failure
    return shot, [ln for ln in log.splitlines() if _BROWSER_PROBLEM.search(ln)], log


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on PATH (CI installs it: apt-get install -y chromium)")
    return exe


def test_chromium_log_check_catches_a_broken_page(chromium, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "img-src data:\"></head><body><img src=\"http://example.invalid/x.png\">"
        "<p>x</p></body></html>"
    )
    _, bad, log = _render(chromium, page, tmp_path, size=(400, 300))
    assert any("example.invalid" in ln for ln in bad), log[-3000:]


def test_html_renders_in_headless_chromium(chromium, written, tmp_path):
    _, paths = written
    shot, bad, log = _render(chromium, paths["html"], tmp_path)
    assert not bad, "\n".join(bad)
    assert shot.exists(), f"no screenshot:\n{log[-3000:]}"
    from matplotlib.image import imread

    img = imread(shot)
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000, img.shape
    assert float(img[..., :3].std()) > 0.05, "screenshot is blank"
    # the verdict badge's red is on the page
    red = (img[..., 0] > 0.7) & (img[..., 1] < 0.25) & (img[..., 2] < 0.25)
    assert red.sum() > 200
