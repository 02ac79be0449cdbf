"""The KV conformance area end to end: one pytest run of ``fp8rl.conformance`` (``-k test_kv``) with the reference
and torch engines side by side through the real plugin: every KV check passes for both, and the report carries the
``kv_drift`` section with its table and plots. (Which mutant each KV check kills: ``suite/mutants/kv.py``, proven by
tests/checks/test_mutants.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fp8rl.checks import all_checks
from fp8rl.tolerances import TOLERANCES
from support import REPO_ROOT

ROOT = REPO_ROOT

KV_CHECK_IDS = {
    "KV-POLICY-001", "KV-STORE-001", "KV-STORE-002", "KV-STORE-003", "KV-STORE-004", "KV-STORE-005",
    "KV-ATTN-001", "KV-ATTN-002", "KV-ATTN-003", "KV-CAL-001", "KV-CAL-002", "KV-CAL-003", "KV-UPDATE-001",
    "KV-UPDATE-002", "KV-DEFAULT-001", "KV-DRIFT-001", "KV-SPACE-001", "KV-SPACE-002",
}

def test_kv_checks_registered_with_known_bounds():
    kv = {cid: spec for cid, spec in all_checks().items() if spec.area == "kv"}
    assert set(kv) == KV_CHECK_IDS
    assert all(b in TOLERANCES for spec in kv.values() for b in spec.bounds)


def test_reference_and_torch_pass_kv_area(tmp_path):
    out = tmp_path / "rep"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "fp8rl.conformance", "-k", "test_kv", "-p", "no:cacheprovider",
           "-q", "-o", "addopts=", "--fp8rl-profile", "ci", "--fp8rl-engine", "reference", "--fp8rl-engine", "torch",
           "--fp8rl-report-dir", str(out)]
    if env.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        cmd += ["-p", "fp8rl.plugin"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    for engine in ("reference", "torch"):
        path = out / "engines" / engine / "report.json"
        assert path.exists(), proc.stdout[-3000:] + proc.stderr[-2000:]
        report = json.loads(path.read_text())
        kv = [c for c in report["checks"] if c["area"] == "kv"]
        bad = [(c["id"], c["case"], c["outcome"], c["message"][:300]) for c in kv if c["outcome"] != "passed"]
        assert not bad, f"{engine}: {bad}"
        assert {c["id"] for c in kv} == KV_CHECK_IDS
        section = report["sections"]["kv_drift"]
        assert len(section["plot"]) == 3 and section["table"]["rows"]
        assert section["summary"]["every-step"]["violations"] == 0
        assert section["summary"]["never"]["violations"] > 0
