"""The weight-sync and e2e conformance areas end to end: reference conformant with its mismatch report section,
the hf engine BF16-only with reasons, and every weight-sync / e2e mutant killed by the intended checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fp8rl.mutants import MUTANTS

RECIPES = ("bf16", "fp8-linear", "fp8-linear-ptpc", "fp8-kv", "fp8-all")
E2E_MUTANTS = {  # mutant → the checks that must kill it
    "wsync-router-quantized": {"WSYNC-EXCL-001", "WSYNC-NAMES-001"},
    "wsync-lm-head-quantized": {"WSYNC-EXCL-001", "WSYNC-NAMES-001"},
    "wsync-scale-inverse": {"WSYNC-EXACT-001", "WSYNC-BOUND-001"},
    "wsync-block-grid-transposed": {"WSYNC-EXACT-001", "WSYNC-BOUND-001"},
    "e2e-stale-weights": {"E2E-UPDATE-001"},
    "e2e-stale-kv-scales": {"E2E-UPDATE-001"},
}


def _pytest(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "fp8rl.conformance", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=", "-W", "ignore::pytest.PytestAssertRewriteWarning", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _report(path) -> dict:
    return json.loads(path.read_text())


def test_mutants_registered():
    import fp8rl.mutants_e2e  # noqa: F401

    for name in E2E_MUTANTS:
        assert name in MUTANTS and MUTANTS[name].area == ("e2e" if name.startswith("e2e-") else "weight_sync")


def test_reference_is_conformant_and_reports_the_mismatch_table(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", "reference", "--area", "weight_sync",
                        "--area", "e2e", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = _report(tmp_path / "report.json")
    assert rep["summary"]["verdict"] == "conformant" and rep["summary"]["total"] == 38
    assert {c["area"] for c in rep["checks"]} == {"weight_sync", "e2e"}
    sec = rep["sections"]["mismatch"]
    rows = sec["table"]["rows"]
    assert [(row[0], row[1]) for row in rows] == [(m, r) for m in ("tiny-qwen3", "tiny-qwen3-moe")
                                                 for r in RECIPES]
    k3 = {(row[0], row[1]): row[2] for row in rows}
    for m in ("tiny-qwen3", "tiny-qwen3-moe"):  # FP8 linear layers move the policy far more than BF16 decoding
        assert k3[(m, "fp8-linear")] > 10 * k3[(m, "bf16")] and k3[(m, "fp8-linear-ptpc")] > 10 * k3[(m, "bf16")]
    plots = sec["plot"]
    assert len(plots) == 2 and all(set(p["series"]) == set(RECIPES) for p in plots)
    assert all(len(ys) == len(p["x"]) == 20 for p in plots for ys in p["series"].values())
    html = (tmp_path / "report.html").read_text()
    assert "FP8 rollout vs BF16 trainer" in html


def test_hf_engine_runs_bf16_and_declares_fp8_unavailable(tmp_path):
    r = _pytest(["--fp8rl-engine", "fp8rl.engines.hf:HFEngine", "--fp8rl-report-dir", str(tmp_path),
                 "-k", "test_weight_sync_names or test_mismatch_budget or (test_update_weights and bf16)"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = _report(tmp_path / "report.json")
    by = {(c["id"], c["case"]): c for c in rep["checks"]}
    for model in ("tiny-qwen3", "tiny-qwen3-moe"):
        assert by[("E2E-MISMATCH-001", f"{model}-bf16")]["outcome"] == "passed"
        assert by[("E2E-UPDATE-001", f"{model}-bf16")]["outcome"] == "passed"
        for recipe in ("fp8-linear", "fp8-linear-ptpc"):
            c = by[("E2E-MISMATCH-001", f"{model}-{recipe}")]
            assert c["outcome"] == "skipped" and "BF16 only" in c["message"]
        assert by[("WSYNC-NAMES-001", model)]["outcome"] == "skipped"
    assert [row[1] for row in rep["sections"]["mismatch"]["table"]["rows"]] == ["bf16", "bf16"]


@pytest.mark.slow
def test_weight_sync_and_e2e_mutants_are_killed_by_their_checks(tmp_path):
    engines = ["reference"] + [f"mutant:{m}" for m in E2E_MUTANTS]
    args = [a for e in engines for a in ("--fp8rl-engine", e)]
    sel = "test_weight_sync or (test_update_weights and (tiny-qwen3-fp8-kv or tiny-qwen3-bf16))"
    r = _pytest([*args, "--fp8rl-profile", "mutants", "--fp8rl-report-dir", str(tmp_path), "-k", sel, "-n", "0"])
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    for e in engines:
        rep = _report(tmp_path / "engines" / e.replace(":", "_") / "report.json")
        failed = {c["id"] for c in rep["checks"] if c["outcome"] in ("failed", "error")}
        if e == "reference":
            assert not failed, rep["checks"]
        else:
            want = E2E_MUTANTS[e.split(":", 1)[1]]
            assert want <= failed, (e, failed)
