"""The learning area end to end: ``fp8rl conformance --engine reference --area learning`` passes every check and
writes the bias table section (the torch engine's skips, with reasons, are exercised by the main job). (The
mutants the area kills: suite/mutants/learning.py, proven by tests/checks/test_mutants.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

AREA_CHECKS = {"LEARN-ONPOL-001", "LEARN-CORR-001", "LEARN-ROLLOUT-001", "LEARN-SAMPLE-001"}


def _run(tmp_path, engine: str) -> dict:
    out = tmp_path / engine
    r = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", engine, "--area", "learning",
                        "--no-isolation", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _results(report: dict) -> list[dict]:
    return report["checks"] if "checks" in report else report["results"]


def test_reference_passes_the_learning_area_exact(tmp_path):
    rep = _run(tmp_path, "reference")
    res = _results(rep)
    assert {c["id"] for c in res} == AREA_CHECKS
    assert all(c["outcome"] == "passed" for c in res), [(c["id"], c["outcome"]) for c in res if
                                                        c["outcome"] != "passed"]
    table = rep["sections"]["learning"]["bias"]
    assert set(table) == {"bf16", "fp8-linear", "fp8-linear-ptpc", "fp8-kv", "fp8-all"}
    for recipe, row in table.items():
        # untruncated sequence IS removes the mismatch bias; no correction leaves it (the toy's mismatch is visible)
        assert row["is"] < 1e-5 < row["none"], (recipe, row)

