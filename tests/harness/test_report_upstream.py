"""``fp8rl report upstream`` and ``fp8rl report findings``: every finding can become an upstream issue.

Every entry of every vendor xfails file fp8rl ships renders an issue (without a report: the version from the lock of
the tier that runs the engine) that names its check's spec sentence and the entry's own reason. A real report with
an xfailed case (a mutant, a vendor file of the test's own) renders an issue with the failure message's numbers,
the environment and the repro folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fp8rl.checks import all_checks
from fp8rl.reports import findings as F
from fp8rl.reports import upstream as U


def _count_entry_lines(directory: Path) -> int:
    """Entries counted from the files' text: non-blank lines that are not comments and carry a '#' reason."""
    n = 0
    for p in directory.glob("*.xfails"):
        for line in p.read_text().splitlines():
            s = line.strip()
            if s and not s.startswith("#") and "#" in s:
                n += 1
    return n


def test_every_vendor_xfails_entry_renders_its_upstream_issue():
    entries = U.all_entries()
    assert len(entries) == _count_entry_lines(U.vendor_dir()) > 100
    known = all_checks()
    for e in entries:
        ids = U.checks_of(e.prefix, known)
        assert ids, f"{e.path.name}:{e.lineno}: {e.prefix!r} names no check"
        issue = U.issue_from_entry(e)
        text = issue.markdown()
        for cid in ids:
            assert known[cid].title in text, (e.prefix, cid)
        assert e.reason in text, e.prefix
        assert issue.title.startswith(f"{issue.project}: ") and e.prefix.split("[")[0] in issue.title
        # a version from a lock, or a plain statement that none pins it
        assert "(locks/" in text or "not pinned" in text, e.prefix
    print(f"{len(entries)} vendor xfails entries rendered as upstream issues")


def test_an_entry_names_its_upstream_code_and_lock_version():
    e = next(x for x in U.all_entries() if x.engine == "areal" and x.prefix == "CORR-PROX-001")
    text = U.issue_from_entry(e).markdown()
    assert "`compute_prox_logp_approximations`" in text and "`areal/trainer/ppo/actor.py`" in text
    assert "areal 1.0.4 (locks/areal.txt)" in text
    assert "https://github.com/inclusionAI/AReaL" in text


def test_instrument_findings_go_to_triton():
    e = next(x for x in U.all_entries() if x.engine == "vllm-triton")
    assert U.issue_from_entry(e).project == "Triton"


def test_one_line_and_code_names():
    assert U.one_line("[when cpu:amx] signed zero lost: _quantize adds +0") == "signed zero lost"
    assert U.code_names("calculate_qparams step 5 (quantization/utils/helpers.py) uses Fp8Dequantize._dequantize_one"
                        " and 1.0e-6") == ["calculate_qparams", "quantization/utils/helpers.py",
                                           "Fp8Dequantize._dequantize_one"]
    assert U.message_line("AssertionError: kv_store[e4m3fn/head]: 3/8 codes differ\n  at (0,)") == \
        "kv_store[e4m3fn/head]: 3/8 codes differ"


@pytest.fixture(scope="module")
def xfailed_report(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("upstream")
    xf = root / "mine.xfails"
    xf.write_text("KV-STORE-001[tensor-e5m2]  # store_fp8_kv (kernels/cache.py) casts x/s without a clamp: overflow "
                  "becomes inf\n")
    out = root / "report"
    proc = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", "mutant:kv-no-clamp", "-k",
                           "KV-STORE-001[tensor-e5m2]", "--xfails", str(xf), "--out", str(out), "--no-isolation"],
                          cwd=root, capture_output=True, text=True, timeout=600, check=False)
    checks = json.loads((out / "report.json").read_text())["checks"]
    assert [c["outcome"] for c in checks] == ["xfailed"], proc.stdout[-2000:]
    return out


def test_upstream_issue_from_a_report(xfailed_report, tmp_path):
    repro_dir = tmp_path / "attached"
    repro_dir.mkdir()
    out = tmp_path / "issue.md"
    proc = subprocess.run([sys.executable, "-m", "fp8rl", "report", "upstream", str(xfailed_report),
                           "KV-STORE-001[tensor-e5m2]", "--out", str(out), "--repro", str(repro_dir)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    title = text.splitlines()[0]
    assert title.startswith("# ") and "store_fp8_kv (kernels/cache.py) casts x/s without a clamp" in title
    assert all_checks()["KV-STORE-001"].title in text
    assert "`store_fp8_kv`" in text and "`kernels/cache.py`" in text
    assert "codes differ (e5m2)" in text and "expected 0x" in text  # the failure message's numbers
    assert "- torch: " in text and "engine `mutant:kv-no-clamp`" in text
    assert f"`{repro_dir}`" in text
    assert "fp8rl conformance --engine mutant:kv-no-clamp -k 'KV-STORE-001[tensor-e5m2]' --seed 0" in text


def test_upstream_refuses_a_passed_case_and_a_missing_repro(xfailed_report, tmp_path):
    from fp8rl.cli import main

    assert main(["report", "upstream", str(xfailed_report), "KV-STORE-001[tensor-e4m3fn]"]) == 2
    assert main(["report", "upstream", str(xfailed_report), "KV-STORE-001[tensor-e5m2]", "--repro",
                 str(tmp_path / "nope")]) == 2


def test_findings_from_reports_and_xfails(xfailed_report, tmp_path):
    from fp8rl.cli import main

    assert main(["report", "findings", str(xfailed_report), "--from-xfails", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "findings.md").read_text()
    page = (tmp_path / "findings.html").read_text()
    n = _count_entry_lines(U.vendor_dir())
    assert f"{n + 1} findings." in md and f"{n + 1} findings." in page
    row = next(line for line in md.splitlines() if "KV-STORE-001[tensor-e5m2]" in line)
    assert "mutant:kv-no-clamp" in row and "xfailed" in row and "fp8rl repro" in row
    assert "store_fp8_kv (kernels/cache.py) casts x/s without a clamp" in row
    assert "Content-Security-Policy" in page and "<script" not in page
    assert main(["report", "findings", "--out", str(tmp_path / "none")]) == 2


def test_findings_rows_for_a_report():
    rep = {"engine": {"name": "vllm", "version": "vllm 0.32.0"}, "command": [],
           "checks": [{"id": "A-B-001", "case": "x", "outcome": "failed", "message": "AssertionError: 2/9 differ"},
                      {"id": "A-B-002", "case": "", "outcome": "passed"}]}
    rows = F.findings_from_report(rep, Path("/r/report.json"))
    assert [(r.check, r.project, r.finding, r.repro) for r in rows] == [
        ("A-B-001[x]", "vLLM", "2/9 differ", "fp8rl repro /r 'A-B-001[x]'")]


def test_findings_search_a_folder_of_runs_and_list_an_entry_once(xfailed_report, tmp_path):
    """The nightly hands `fp8rl report findings` folders of runs (one report.json per engine, nested): every report
    below the folder is read, and a vendor entry whose case a report already shows (same engine, case under the
    entry's prefix) is one row, the report's, not two."""
    from fp8rl.cli import main

    rep = json.loads((xfailed_report / "report.json").read_text())
    runs = tmp_path / "runs"
    for sub, engine, case in (("a/mutant", rep["engine"]["name"], None), ("b/torchao", "torchao", "tensor")):
        doc = json.loads(json.dumps(rep))
        doc["engine"]["name"] = engine
        if case is not None:  # the torchao entry QUANT-EDGE-001[tensor] shipped in conformance/vendors/torchao.xfails
            doc["checks"][0].update(id="QUANT-EDGE-001", area="quantization", case=case,
                                    nodeid="test_quantization.py::test_x[tensor]")
        (runs / sub).mkdir(parents=True)
        (runs / sub / "report.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert main(["report", "findings", str(runs), "--from-xfails", "--out", str(out)]) == 0
    md = (out / "findings.md").read_text()
    n = _count_entry_lines(U.vendor_dir())
    assert f"{n + 2 - 1} findings." in md  # two report rows + every entry but the one the torchao report shows
    rows = [line for line in md.splitlines() if "QUANT-EDGE-001[tensor]" in line and line.startswith("| torchao ")]
    assert len(rows) == 1 and "| xfailed |" in rows[0], rows
