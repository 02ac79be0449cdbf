"""The conformance harness end to end: CLI, registry, plugin outcomes, vendor files, reports, exit codes.

Each run goes through the real ``fp8rl`` CLI in a subprocess (as a user would run it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fp8rl.registry import EngineLoadError, available_engines, load_engine
from support import REPO_ROOT

ROOT = REPO_ROOT


#: runs of a misbehaving engine leave out the input-space (SPACE) checks: ~130 more cases of the same failure, each
#: a worker restart, prove nothing these tests ask (the SPACE checks have their own tests in tests/checks/)
NOT_SPACE = ("-k", "not input_space")


def fp8rl(*args: str, timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fp8rl", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


# ----------------------------------------------------------------------------------------------------------------
# registry


def test_registry_builtins_and_mutants_listed():
    names = available_engines()
    assert {"reference", "torch", "torch-cuda"} <= set(names)
    assert any(n.startswith("mutant:") for n in names)


@pytest.mark.parametrize("spec, match", [
    ("nope", "unknown engine 'nope'"),
    ("no_such_module_xyz:factory", "cannot import module"),
    ("support.bad_engines:missing", "has no attribute"),
    ("support.bad_engines:not_an_engine", "lacks"),
    ("support.bad_engines:factory_raises", "factory raised RuntimeError: cannot open device"),
    ("", "non-empty"),
])
def test_registry_load_errors_name_the_problem(spec, match, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    with pytest.raises(EngineLoadError, match=match):
        load_engine(spec)


def test_torch_cuda_capabilities_give_reasons_without_cuda():
    import torch

    eng = load_engine("torch-cuda")
    caps = eng.capabilities()
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert caps and all(isinstance(v, str) and "no CUDA device" in v for v in caps.values())


# ----------------------------------------------------------------------------------------------------------------
# CLI


def test_cli_engines_lists_capabilities_json():
    r = fp8rl("engines", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["reference"]["capabilities"]["quantize.block"] is True
    assert "no CUDA device" in str(rows["torch-cuda"]["capabilities"]) or rows["torch-cuda"]["capabilities"]


def test_cli_unknown_engine_exits_2():
    r = fp8rl("conformance", "--engine", "does-not-exist", "--out", "/tmp/fp8rl-x")
    assert r.returncode == 2
    assert "unknown engine 'does-not-exist'" in r.stdout + r.stderr


def test_cli_bad_option_exits_2():
    assert fp8rl("conformance", "--profile", "bogus").returncode == 2


def test_cli_missing_xfails_file_exits_2(tmp_path):
    r = fp8rl("conformance", "--engine", "reference", "--xfails", str(tmp_path / "nope"), "--out", str(tmp_path))
    assert r.returncode == 2 and "does not exist" in r.stdout


def test_conformance_reference_is_conformant(reference_ci_run):
    returncode, stdout, out = reference_ci_run  # the whole reference run, shared with tests/checks/test_coverage.py
    assert returncode == 0, stdout[-6000:]
    rep = _report(out)
    s = rep["summary"]
    assert s["verdict"] == "conformant" and s["failed"] == 0 and s["error"] == 0
    assert s["passed"] > 50, s
    areas = {c["area"] for c in rep["checks"]}
    assert {"formats", "quantization", "gemm"} <= areas
    for name in ("report.json", "junit.xml", "report.md", "report.html"):
        assert (out / name).is_file()
    assert "verdict: CONFORMANT" in stdout


def test_conformance_torch_passes_or_documented_xfails(tmp_path):
    r = fp8rl("conformance", "--engine", "torch", "--out", str(tmp_path))
    rep = _report(tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    for c in rep["checks"]:
        assert c["outcome"] in ("passed", "xfailed", "skipped"), c
        if c["outcome"] in ("xfailed", "skipped"):
            assert c["message"].strip(), c


@pytest.mark.parametrize("factory, needle", [
    ("Raises", "raised RuntimeError: kernel exploded"),
    ("WrongShape", "expected shape"),
    ("WrongDtypeForBf16Input", "expected dtype torch.uint8"),
    ("NanScale", "non-finite scales"),
])
def test_misbehaving_engine_gives_error_outcome_and_report(tmp_path, factory, needle):
    # a few checks of the area suffice (each one's ops misbehave the same way): the run must turn each into an error
    area, k = ("formats", "sweep or bf16") if factory != "NanScale" else ("quantization", "quantize_random or edge_val")
    r = fp8rl("conformance", "--engine", f"support.bad_engines:{factory}", "--area", area, "-k", k,
              "--out", str(tmp_path))
    assert r.returncode == 1, r.stdout[-2000:]
    rep = _report(tmp_path)
    errors = [c for c in rep["checks"] if c["outcome"] == "error"]
    assert errors, rep["summary"]
    assert any(needle in c["message"] for c in errors), errors[0]["message"]
    assert rep["summary"]["verdict"] == "non-conformant"


def test_the_callers_pytest_configuration_does_not_reach_the_run(tmp_path):
    """A conformance run started in a project with its own pytest.ini and conftest.py (one that would abort the run,
    one that would mark every check failed) is the same run as anywhere else."""
    proj = tmp_path / "proj"
    (proj / "tests").mkdir(parents=True)
    (proj / "pytest.ini").write_text("[pytest]\naddopts = --no-such-option\n")
    (proj / "conftest.py").write_text("raise SystemExit('the caller\\'s conftest.py was loaded')\n")
    (proj / "tests" / "conftest.py").write_text("import pytest\n@pytest.fixture(autouse=True)\ndef _x():\n"
                                                "    raise RuntimeError('the caller\\'s tests/conftest.py')\n")
    for isolation in ([], ["--no-isolation"]):
        out = tmp_path / f"out{len(isolation)}"
        r = fp8rl("conformance", "--engine", "reference", "--area", "formats", "-k", "SWEEP or sweep", *isolation,
                  "--out", str(out), cwd=proj)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        rep = _report(out)
        assert rep["summary"]["passed"] == rep["summary"]["total"] == 4, rep["summary"]


def test_hanging_engine_times_out_as_error_and_run_continues(tmp_path):
    for isolation in ([], ["--no-isolation"]):  # a worker ended by the thread timeout; pytest-timeout's signal
        # two cases (each timeout costs a worker restart in the isolated mode): the second runs after the first hung
        r = fp8rl("conformance", "--engine", "support.bad_engines:Hangs", "--area", "formats", "-k",
                  "sweep and fnuz", "--timeout", "2", *isolation, "--out", str(tmp_path), timeout=300)
        assert r.returncode == 1, r.stdout[-2000:]
        rep = _report(tmp_path)
        assert rep["summary"]["error"] == 2 and rep["status"] == "complete"  # every case timed out; run went on
        errors = [c["message"] for c in rep["checks"] if c["outcome"] == "error"]
        assert all("timeout" in m.lower() for m in errors), errors


def test_vendor_xfails_and_skips_files(tmp_path):
    xf = tmp_path / "x.xfails"
    xf.write_text("# vendor file\nCAST-SWEEP-001  # our cast is known to differ\nNO-SUCH-CHECK  # stale entry\n"
                  "CAST-RANDOM-001[no-such-case]  # a stale case of a check that ran\n"
                  "KV-STORE-001  # a finding of an area this run did not select: not stale\n")
    sk = tmp_path / "x.skips"
    sk.write_text("CAST-RANDOM  # too slow on our simulator\n")
    out = tmp_path / "out"
    r = fp8rl("conformance", "--engine", "support.bad_engines:Raises", "--area", "formats", "-k",
              "sweep or random or bf16", "--xfails", str(xf),
              "--skips", str(sk), "--out", str(out))
    rep = _report(out)
    by_id: dict[str, set] = {}
    for c in rep["checks"]:
        by_id.setdefault(c["id"], set()).add(c["outcome"])
    assert by_id["CAST-SWEEP-001"] == {"xfailed"}
    assert by_id["CAST-RANDOM-001"] == {"skipped"}
    assert any("NO-SUCH-CHECK" in w for w in rep["warnings"])
    assert any("no-such-case" in w for w in rep["warnings"])
    assert not any("KV-STORE-001" in w for w in rep["warnings"])
    assert r.returncode == 1  # the other cast checks still error


def test_id_file_without_reason_is_a_usage_error(tmp_path):
    xf = tmp_path / "x.xfails"
    xf.write_text("CAST-SWEEP-001\n")
    r = fp8rl("conformance", "--engine", "reference", "--area", "formats", "--xfails", str(xf),
              "--out", str(tmp_path / "o"))
    assert r.returncode == 2


def test_checks_listing_has_unique_ids_and_table_bounds():
    r = fp8rl("checks", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
    assert all(row["bounds"] and all(row["bounds"].values()) for row in rows)  # every bound has its derivation
    assert all(row["bound"] == ", ".join(row["bounds"]) for row in rows)


def test_entry_point_engine_is_loaded_by_name(tmp_path):
    """An out-of-tree package exposing an engine through the ``fp8rl.engines`` entry-point group."""
    dist = tmp_path / "vendor_engine-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vendor-engine\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fp8rl.engines]\nvendor-x = support.bad_engines:WrongShape\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", "vendor-x", "--area", "formats",
                        "-k", "sweep",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    rep = _report(tmp_path / "out")
    assert rep["engine"]["name"] == "wrong-shape"
    assert any("expected shape" in c["message"] for c in rep["checks"] if c["outcome"] == "error")


def test_gpu_per_worker_mapping_round_robin():
    from fp8rl.plugin import gpu_for_worker, visible_gpus

    assert [gpu_for_worker(f"gw{i}", ["0", "1", "2"]) for i in range(5)] == ["0", "1", "2", "0", "1"]
    assert gpu_for_worker("gw0", []) is None
    assert gpu_for_worker("master", ["0"]) is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == ["4", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_failure_message_carries_a_reproduction(tmp_path):
    r = fp8rl("conformance", "--engine", "mutant:truncating-cast", "--area", "formats", "-k", "sweep",
              "--out", str(tmp_path))
    assert r.returncode == 1
    failed = [c for c in _report(tmp_path)["checks"] if c["outcome"] == "failed"]
    assert failed
    msg = failed[0]["message"]
    for needle in ("codes differ", "shape", "first offending", "expected 0x", "got 0x", "x=", "reproduce: seed"):
        assert needle in msg, (needle, msg)


def test_xdist_run_gives_the_same_outcomes(tmp_path):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    assert fp8rl("conformance", "--engine", "reference", "--area", "formats", *NOT_SPACE, "--no-isolation", "--out",
                 str(serial)).returncode == 0
    r = fp8rl("conformance", "--engine", "reference", "--area", "formats", *NOT_SPACE, "-n", "2", "--out",
              str(parallel))
    assert r.returncode == 0, r.stdout[-2000:]
    a = {(c["id"], c["case"]): c["outcome"] for c in _report(serial)["checks"]}
    b = {(c["id"], c["case"]): c["outcome"] for c in _report(parallel)["checks"]}
    assert a == b and len(a) >= 16


def test_multi_engine_reports_keep_clean_case_labels(tmp_path):
    """With several engines (hyphenated mutant names included) each engine's report names the check's own
    parameters only, exactly as a single-engine run does."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "fp8rl.conformance", "-p", "no:cacheprovider",
                        "-q", "-o", "addopts=", "-k", "test_cast_sweep", "--fp8rl-profile", "ci",
                        "--fp8rl-engine", "reference", "--fp8rl-engine", "mutant:cast-no-saturation",
                        "--fp8rl-report-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1, r.stdout[-2000:]  # the mutant fails
    from fp8rl.engine import ELEMENT_FORMATS

    for name in ("reference", "mutant_cast-no-saturation"):
        rep = _report(tmp_path / "engines" / name)
        assert {c["case"] for c in rep["checks"]} == set(ELEMENT_FORMATS), rep["checks"]


def test_instrument_notes_named_in_every_report_format(tmp_path):
    r = fp8rl("conformance", "--engine", "support.bad_engines:WithNote", "--area", "formats", "-k", "sweep",
              "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    note = "results rely on shim X (validated by engine Y)"
    assert _report(tmp_path)["engine"]["notes"] == [note]
    assert note in (tmp_path / "report.md").read_text()
    assert note in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("factory, needle", [
    ("WrongDtype", "cast(<torch.float32 (2, 128)>, 'e4m3fn') returned a torch.int32 tensor, expected torch.uint8"),
    ("ReturnsNone", "cast(<torch.float32 (2, 128)>, 'e4m3fn') returned NoneType, expected a torch.uint8"),
    ("Bf16WrongDtype", "round_bf16(<torch.float32 (2, 128)>) returned a torch.float16 tensor, expected torch.bfloat16"),
    ("QuantizeReturnsTuple", "returned tuple, expected fp8rl.reference.quant.QuantizedTensor"),
    ("QuantizeFp8Codes", "codes: expected a torch.uint8 tensor, got torch.float8_e4m3fn"),
])
def test_wrong_return_type_is_one_load_error(tmp_path, factory, needle):
    """An op that returns the wrong type on any input (a tiny call at load shows it) is one load error, exit 2, not
    one error per check."""
    r = fp8rl("conformance", "--engine", f"support.bad_engines:{factory}", "--out", str(tmp_path))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert needle in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert not (tmp_path / "report.json").exists()


def test_wrong_protocol_signature_is_one_load_error(tmp_path):
    r = fp8rl("conformance", "--engine", "support.bad_engines:WrongSignature", "--out", str(tmp_path))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "WrongSignature.quantize(self, x) can't be called as the protocol's quantize(self, x: 'torch.Tensor', " \
           "granularity: 'Granularity') -> 'QuantizedTensor'" in out, out[-2000:]
    assert out.count("can't be called") == 1


def test_engine_given_twice_is_a_usage_error(tmp_path):
    r = fp8rl("conformance", "--engine", "torch", "--engine", "reference", "--out", str(tmp_path))
    assert r.returncode == 2
    assert "--engine: given more than once" in r.stderr
    assert not (tmp_path / "report.json").exists()


def test_per_tensor_kv_input_names_the_bad_argument():
    import torch
    from fp8rl.engine import per_tensor_kv_input

    x = torch.ones(2, 3, 4, 8)
    flat, s, shape = per_tensor_kv_input(x, 0.5)
    assert tuple(flat.shape) == (6, 4, 8) and s.dim() == 0 and float(s) == 0.5 and shape == (2, 3, 4, 8)
    with pytest.raises(ValueError, match="scale: layout 'tensor' needs a scale"):
        per_tensor_kv_input(x, None)
    with pytest.raises(ValueError, match="scale: expected a scalar"):
        per_tensor_kv_input(x, torch.ones(2))
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., T, H, D\]"):
        per_tensor_kv_input(torch.ones(4, 8), 1.0)


def test_engines_listing_keeps_square_brackets_in_reasons():
    """Capability reasons are plain text: install hints like pip install '.[sglang]' must not be eaten as markup."""
    r = fp8rl("engines", "support.bad_engines:BracketReason")
    assert r.returncode == 0, r.stderr
    assert "pip install '.[extra]'" in r.stdout and "[note]" in r.stdout


def test_import_failure_reasons():
    from fp8rl.engine import import_failure

    assert import_failure("json", "hint") is None
    assert import_failure("no_such_pkg_fp8rl", "pip install it") == "pip install it"
    broken = import_failure("support.bad_engines_broken_import", "hint")
    assert broken.startswith("support does not import (No module named 'no_such_dependency_fp8rl')")


def test_k_selects_by_check_id_and_case_and_the_reproduce_line_reruns_the_failure_exact(tmp_path):
    """``-k`` takes a check id or ``ID[case]``; a failure's reproduce line is an ``fp8rl conformance`` command that,
    run from another directory, fails the same case again."""
    out = tmp_path / "id"
    r = fp8rl("conformance", "--engine", "reference", "-k", "QUANT-EXACT-002", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:]
    assert {c["id"] for c in _report(out)["checks"]} == {"QUANT-EXACT-002"}
    out = tmp_path / "case"
    assert fp8rl("conformance", "--engine", "reference", "-k", "QUANT-EXACT-001[block]", "--out", str(out)).returncode == 0
    assert [(c["id"], c["case"]) for c in _report(out)["checks"]] == [("QUANT-EXACT-001", "block")]
    out = tmp_path / "fail"
    fp8rl("conformance", "--engine", "mutant:truncating-cast", "--area", "formats", "-k", "CAST-SWEEP-001",
          "--out", str(out))
    failed = [c for c in _report(out)["checks"] if c["outcome"] == "failed"]
    line = failed[0]["message"].splitlines()[-1]
    cmd = line.split("; ", 1)[1].rstrip("]")
    assert cmd.startswith("fp8rl conformance --engine mutant:truncating-cast -k 'CAST-SWEEP-001["), line
    import shlex

    args = shlex.split(cmd)[1:] + ["--out", str(tmp_path / "again")]
    again = fp8rl(*args, cwd=tmp_path)
    assert again.returncode == 1, again.stdout[-2000:]
    rerun = _report(tmp_path / "again")["checks"]
    assert [(c["id"], c["case"], c["outcome"]) for c in rerun] == [(failed[0]["id"], failed[0]["case"], "failed")]
