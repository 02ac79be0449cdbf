"""The verdict names its scope: a vendor's out-of-tree adapter (tests/support/acme/acme_engine.py, plain-PyTorch
kernels) run through the CLI from a directory outside the repository, as a new user runs it.

CONFORMANT must mean "your code was run and it is right": an adapter that refuses every case, or whose ops are the
oracle's own, gets INCOMPLETE (exit 4) with each untested capability named; a declared policy that is unsound in its
compute dtype is a load error; the fixed adapter is CONFORMANT."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT

ACME = REPO_ROOT / "tests" / "support" / "acme" / "acme_engine.py"


@pytest.fixture
def vendor_dir(tmp_path: Path) -> Path:
    """A vendor's project directory outside the repository holding only its adapter module."""
    d = tmp_path / "vendor"
    d.mkdir()
    shutil.copy(ACME, d / "acme_engine.py")
    return d


def fp8rl(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the repository's test tree
    return subprocess.run([sys.executable, "-m", "fp8rl", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


#: pytest's own summary line ("202 skipped in 4.10s"): a second set of counts beside fp8rl's table
PYTEST_SUMMARY = re.compile(r"^=*\s*\d+ (passed|failed|skipped|error)", re.M)


def test_adapter_that_refuses_every_case_is_incomplete_exact(vendor_dir):
    out = vendor_dir / "r"
    r = fp8rl(vendor_dir, "conformance", "--engine", "acme_engine:AcmeEngine", "--area", "quantization",
              "--out", str(out))
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
    rep = report(out)
    s = rep["summary"]
    assert s["verdict"] == "incomplete" and s["failed"] == s["error"] == 0
    scope = s["scope"]
    assert scope["engine_cases"] == 0 and scope["oracle_cases"] == 0
    assert scope["untested"] == ["quantize.block", "quantize.group"]
    for key in scope["untested"]:
        row = scope["capabilities"][key]
        assert row["refused"] == row["cases"] > 0 and row["engine"] == 0
        assert "acme has no Granularity(kind=" in row["refusals"][0]
    refused = [c for c in rep["checks"] if c.get("refused")]
    assert len(refused) == scope["refused_cases"] > 0
    assert all(c["outcome"] == "skipped" and c["message"].startswith("refused by the engine: quantize: ")
               for c in refused)
    assert "INCOMPLETE (untested: no check ran the engine's own code)" in r.stdout
    assert "UNTESTED quantize.block" in r.stdout and "UNTESTED quantize.group" in r.stdout
    assert not PYTEST_SUMMARY.search(r.stdout), r.stdout[-2000:]  # one set of counts on screen: fp8rl's
    assert "scope: what ran the engine's own code" in (out / "report.md").read_text()
    junit = (out / "junit.xml").read_text()
    assert 'name="scope_untested" value="quantize.block, quantize.group"' in junit


def test_readme_literal_subclass_labels_inherited_ops_exact(vendor_dir):
    """README's old example (subclass ReferenceEngine, override one op): the inherited ops' cases are reported as
    the oracle's and do not count; every capability they carry is untested."""
    out = vendor_dir / "r"
    r = fp8rl(vendor_dir, "conformance", "--engine", "acme_engine:ReadmeLiteral", "--area", "quantization",
              "--area", "formats", "--out", str(out))
    assert r.returncode == 4, r.stdout[-3000:] + r.stderr[-3000:]
    rep = report(out)
    scope = rep["summary"]["scope"]
    assert scope["capabilities"]["quantize.group"]["engine"] > 0
    assert "quantize.group" not in scope["untested"]
    assert {"cast.e4m3fn", "cast.bf16", "quantize.block", "quantize.tensor"} <= set(scope["inherited"])
    by_ex = {c["exercised"] for c in rep["checks"] if c["outcome"] == "passed"}
    assert by_ex == {"engine", "oracle", "none"} or by_ex == {"engine", "oracle"}
    group_cases = [c for c in rep["checks"] if c["id"] == "QUANT-EXACT-001" and c["case"] == "group"]
    assert group_cases and group_cases[0]["exercised"] == "engine"
    block_cases = [c for c in rep["checks"] if c["id"] == "QUANT-EXACT-001" and c["case"] == "block"]
    assert block_cases and block_cases[0]["exercised"] == "oracle"
    assert "cases ran only the oracle's inherited code (not counted)" in r.stdout
    assert "UNTESTED quantize.block" in r.stdout and "inherited from the oracle" in r.stdout


def test_fixed_adapter_declaring_only_its_own_ops_is_conformant_exact(vendor_dir):
    out = vendor_dir / "r"
    r = fp8rl(vendor_dir, "conformance", "--engine", "acme_engine:AcmeFixed", "--area", "quantization",
              "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    scope = report(out)["summary"]["scope"]
    assert scope["untested"] == [] and scope["oracle_cases"] == 0
    assert list(scope["capabilities"]) == ["quantize.group"] and scope["capabilities"]["quantize.group"]["engine"] > 0


def test_eps_that_underflows_in_the_compute_dtype_is_a_load_error_exact(vendor_dir):
    out = vendor_dir / "r"
    r = fp8rl(vendor_dir, "conformance", "--engine", "acme_engine:AcmeBlockDeclared", "--area", "quantization",
              "--out", str(out))
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout + r.stderr
    assert "policy lint" in text and "eps=1e-12 rounds to 0 in fp16" in text, text[-2000:]
    assert not (out / "report.json").exists()


def test_engines_lists_a_module_factory_from_the_current_directory_exact(vendor_dir):
    r = fp8rl(vendor_dir, "engines", "acme_engine:ReadmeLiteral")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "cannot import module" not in r.stdout
    assert "inherited from fp8rl's oracle" in r.stdout
    assert "fp8rl's own oracle" not in r.stdout  # the vendor's engine is not described as the oracle
    rows = json.loads(fp8rl(vendor_dir, "engines", "--json", "acme_engine:ReadmeLiteral").stdout)
    assert "cast.e4m3fn" in rows[0]["inherited"] and "quantize.group" not in rows[0]["inherited"]
    bad = fp8rl(vendor_dir, "engines", "acme_engine:NoSuchEngine")
    assert bad.returncode == 2 and "has no attribute 'NoSuchEngine'" in bad.stdout


def test_kv_store_adapter_scope_names_its_one_capability_exact(vendor_dir):
    out = vendor_dir / "r"
    r = fp8rl(vendor_dir, "conformance", "--engine", "acme_engine:AcmeKV", "--area", "kv", "-k", "store",
              "--out", str(out))
    rep = report(out)
    scope = rep["summary"]["scope"]
    assert list(scope["capabilities"]) == ["kv.store"], scope
    assert scope["capabilities"]["kv.store"]["engine"] > 0
    assert r.returncode in (0, 1), r.stdout[-3000:]  # whatever its verdict, it is one about the vendor's code


def test_fp16_zero_block_quantizer_fails_an_invariant_whatever_it_declares_exact(vendor_dir):
    """The vendor's block quantizer (scale in the input dtype, eps 1e-12): declaring its policy honestly is a load
    error (above); declaring fp8rl's fp32 policy instead still fails the universal invariant on fp16 zero blocks."""
    out = vendor_dir / "r"
    r = fp8rl(vendor_dir, "conformance", "--engine", "acme_engine:AcmeBlockFp32Declared", "--area", "invariants",
              "-k", "quantize_finite and block and fp16", "--out", str(out))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    failed = {c["case"]: c for c in report(out)["checks"] if c["outcome"] == "failed"}
    zero = failed.get("block-fp16-all-zero")
    assert zero is not None and zero["id"] == "INV-FINITE-001", sorted(failed)
    assert "scale 0.0" in zero["message"] and "not finite and > 0" in zero["message"], zero["message"]
