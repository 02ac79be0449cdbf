"""``fp8rl scaffold``: a throwaway check and engine scaffolded into a temporary copy of the repository, then run
through the CLI from that copy (its ``fp8rl`` package is the copy's, imported through a path shim)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT

#: the copy's package-dir mapping (pyproject.toml): fp8rl = suite/, its subpackages beside it
SUBPACKAGES = ("reference", "conformance", "perf", "reports", "fixtures")


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo") / "fp8rl"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO_ROOT / rel
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    return root


def run(copy: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    shim = copy.parent / "shim"
    if not shim.exists():
        shim.mkdir()
        (shim / "fp8rl").symlink_to(copy / "suite")
        for d in SUBPACKAGES:
            (copy / "suite" / d).symlink_to(copy / d)
    env = dict(os.environ, PYTHONPATH=str(shim))
    return subprocess.run([sys.executable, "-m", "fp8rl", *args], capture_output=True, text=True, env=env,
                          cwd=cwd or copy, timeout=600)


def test_scaffolded_check_and_engine_run_through_the_cli_exact(copy, tmp_path):
    r = run(copy, "scaffold", "check", "kv", "KV-SCAFFOLD-001", "--title", "A scaffolded check.", "--requires",
            "kv.store")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("wrote ") == 2  # the check and its mutant (the bound 'exact' exists): at most 4 files
    r = run(copy, "scaffold", "check", "kv", "KV-SCAFFOLD-002", "--bound", "kv_scaffold_bound", "--bound-value",
            "0.001", "--judged", "bound")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("wrote ") == 3 and "wrote suite/tolerances/kv.py" in r.stdout  # a new bound: one more file
    r = run(copy, "scaffold", "engine", "acme-test", "--tier", "trl")
    assert r.returncode == 0, r.stdout + r.stderr
    wrote = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("wrote ")]
    assert wrote == ["suite/engines/acme_test.py", "suite/registry.py", "conformance/vendors/acme-test.xfails",
                     "tests/engines/trl/test_acme_test_engine.py", "noxfile.py"]
    assert 'Conformance("acme-test")' in (copy / "noxfile.py").read_text()
    # the copy's fp8rl knows them: the check in the catalogue, the engine loadable, the check run
    cat = json.loads(run(copy, "checks", "--json").stdout)
    assert [c["id"] for c in cat if c["id"] == "KV-SCAFFOLD-001"] == ["KV-SCAFFOLD-001"]
    (new,) = [c for c in cat if c["id"] == "KV-SCAFFOLD-002"]
    assert new["bound"] == "kv_scaffold_bound" and "TODO KV-SCAFFOLD-002" in new["bounds"]["kv_scaffold_bound"]
    out = tmp_path / "ref"
    r = run(copy, "conformance", "--engine", "reference", "--area", "kv", "-k", "scaffold_001", "--out", str(out))
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    (c,) = json.loads((out / "report.json").read_text())["checks"]
    assert c["id"] == "KV-SCAFFOLD-001" and c["outcome"] == "error" and "is a scaffold" in c["message"]
    out = tmp_path / "eng"
    r = run(copy, "conformance", "--engine", "acme-test", "--area", "kv", "-k", "scaffold_001", "--out", str(out))
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]  # it declares nothing yet: nothing certified
    assert json.loads((out / "report.json").read_text())["engine"]["name"] == "acme-test"
    # a second scaffold of the same names is refused, naming the argument
    again = run(copy, "scaffold", "check", "kv", "KV-SCAFFOLD-001")
    assert again.returncode == 2 and "check id: 'KV-SCAFFOLD-001' is already declared" in again.stdout
    bad = run(copy, "scaffold", "engine", "Acme_Test")
    assert bad.returncode == 2 and "engine name: expected lower-case words" in bad.stdout
