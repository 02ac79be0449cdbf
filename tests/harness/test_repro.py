"""``fp8rl repro``: from a failing case of a report to a standalone, shrunk reproduction.

One conformance run of an engine made of four mutants (each breaks a different op: quantize's scale in bf16, the
KV store without its clamp, TIS weights without truncation, the proximal policy one version off) gives a report
with a failing case in the quantization, kv and correction areas and one in an op fp8rl repro has no comparison
for. The engine is named as an out-of-tree ``module:factory`` (its module in a temporary directory on
PYTHONPATH), so the scripts load it the way the report's run did. Each repro script runs from a directory outside
the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fp8rl import repro
from fp8rl.repro_capture import Opaque, decode, encode, load_call, save_call

REPO = Path(__file__).resolve().parents[2]

COMBO = textwrap.dedent('''
    """Four mutants of fp8rl in one engine: each overrides a different op."""
    from fp8rl.mutants import MUTANTS

    _BASES = tuple(MUTANTS[n].factory for n in ("bf16-scale", "kv-no-clamp", "corr-no-truncation",
                                                 "corr-prox-off-by-one"))
    Combo = type("Combo", _BASES, {"name": "combo-of-mutants"})
''')

CASES = {"quantization": "QUANT-EXACT-001[block]", "kv": "KV-STORE-001[head-e4m3fn]", "correction": "CORR-TIS-001",
         "other": "CORR-PROX-001"}


def _env(pkg: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(pkg), "FP8RL_HYPOTHESIS_PROFILE": "ci"}


@pytest.fixture(scope="module")
def failing_report(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(the report directory, the environment that finds the engine's module) of one conformance run."""
    root = tmp_path_factory.mktemp("repro")
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "combo_engine.py").write_text(COMBO)
    out = root / "report"
    proc = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", "combo_engine:Combo",
                           "-k", " or ".join(CASES.values()), "--out", str(out), "--no-isolation"],
                          cwd=pkg, env=_env(pkg), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {repro.case_label(c): c["outcome"] for c in json.loads((out / "report.json").read_text())["checks"]}
    for label in CASES.values():
        assert outcomes[label] == "failed", outcomes
    return out, _env(pkg)


def _repro(report: Path, env: dict[str, str], label: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp8rl", "repro", str(report), label, "--out", str(out)],
                          cwd=out.parent, env=env, capture_output=True, text=True, timeout=600, check=False)


def _script(folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    assert REPO not in folder.resolve().parents
    return subprocess.run([sys.executable, "repro.py", "--check"], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def _imported_modules(source: str) -> set[str]:
    import ast

    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add((node.module or "").split(".")[0])
    return out


def _tensor_shapes(folder: Path) -> list[list[int]]:
    doc = json.loads((folder / "call.json").read_text())
    return [a["shape"] for a in doc["args"] if isinstance(a, dict) and "__tensor__" in a]


def test_quantization_repro_is_one_element_pair_of_the_failing_block(failing_report, tmp_path):
    report, env = failing_report
    folder = tmp_path / "q"
    made = _repro(report, env, CASES["quantization"], folder)
    assert made.returncode == 0, made.stdout + made.stderr
    assert _tensor_shapes(folder) == [[1, 2]]  # the differing element and its 128x128 block's amax element
    original = json.loads((folder / "original.json").read_text())
    assert original["args"][0]["shape"] == [256, 256]
    ran = _script(folder, env)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    for text in ("amax/448 in fp32", "scale: oracle", "engine 380.0", "x/s with the oracle's scale: fp32",
                 "bf16", "expected code 0x", "engine code 0x", "of scale group (0, 0) of the original (256, 256)"):
        assert text in ran.stdout, (text, ran.stdout)
    source = (folder / "repro.py").read_text()
    assert str(REPO) not in source
    assert _imported_modules(source) <= {"__future__", "argparse", "sys", "pathlib", "fp8rl"}


def test_kv_repro_is_one_element_of_one_head(failing_report, tmp_path):
    report, env = failing_report
    folder = tmp_path / "kv"
    made = _repro(report, env, CASES["kv"], folder)
    assert made.returncode == 0, made.stdout + made.stderr
    shapes = _tensor_shapes(folder)
    assert shapes[0] == [1, 1, 1, 1] and shapes[1] == [1], shapes  # x: one element; its head's scale
    ran = _script(folder, env)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    for text in ("x/s fp32", "beyond", "expected code 0x7e (448.0), engine code 0x7f (nan)", "of the original (2, 33, 4, 64)"):
        assert text in ran.stdout, (text, ran.stdout)


def test_correction_repro_is_one_token(failing_report, tmp_path):
    report, env = failing_report
    folder = tmp_path / "corr"
    made = _repro(report, env, CASES["correction"], folder)
    assert made.returncode == 0, made.stdout + made.stderr
    assert _tensor_shapes(folder) == [[1, 1], [1, 1], [1, 1]]
    ran = _script(folder, env)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    for text in ("delta = log pi_train - log pi_rollout", "rho = e^delta", "weight: expected", "bound", "alone of the original"):
        assert text in ran.stdout, (text, ran.stdout)


def test_op_without_comparison_says_the_input_was_not_captured(failing_report, tmp_path):
    report, env = failing_report
    folder = tmp_path / "prox"
    made = _repro(report, env, CASES["other"], folder)
    assert made.returncode == 0, made.stdout + made.stderr
    readme = (folder / "README.md").read_text()
    assert "The input was not captured" in readme and "proximal_logp" in readme
    meta = json.loads((folder / "repro.json").read_text())
    assert meta["captured"] is False
    assert "conformance --engine combo_engine:Combo -k CORR-PROX-001 --seed 0" in meta["reproduce"]
    assert not (folder / "call.safetensors").exists()


def test_bad_arguments_name_what_was_expected(failing_report, tmp_path):
    report, _ = failing_report
    with pytest.raises(repro.ReproError, match="expected CHECK-ID or CHECK-ID"):
        repro.make_repro(report, "not a case", tmp_path / "a")
    with pytest.raises(repro.ReproError, match="no check 'QUANT-EXACT-002'"):
        repro.make_repro(report, "QUANT-EXACT-002[block]", tmp_path / "b")
    with pytest.raises(repro.ReproError, match="report: expected a report.json"):
        repro.make_repro(tmp_path / "missing", CASES["kv"], tmp_path / "c")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(repro.ReproError, match="non-empty directory that holds no repro folder"):
        repro.make_repro(report, CASES["kv"], tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_passed_case_has_nothing_to_reproduce():
    rep = {"checks": [{"id": "QUANT-EXACT-001", "case": "block", "outcome": "passed"}]}
    entry = repro.find_case(rep, "QUANT-EXACT-001[block]")
    assert entry["outcome"] == "passed"
    with pytest.raises(repro.ReproError, match="no case 'QUANT-EXACT-001\\[token\\]'"):
        repro.find_case(rep, "QUANT-EXACT-001[token]")


def test_engine_is_loaded_as_the_run_named_it():
    rep = {"engine": {"name": "my-engine"}, "command": ["x", "--fp8rl-engine", "pkg.mod:Factory", "-k", "A"]}
    assert repro.engine_spec(rep) == "pkg.mod:Factory"
    assert repro.engine_spec({"engine": {"name": "torch"}, "command": []}) == "torch"


def test_capture_round_trip_keeps_structure_dtype_and_layout(tmp_path):
    from fp8rl.reference.quant import Granularity

    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # transposed: not contiguous
    bf = torch.tensor([1.5, -0.0, float("nan")], dtype=torch.bfloat16)
    args = (x, Granularity.block((2, 3)), {"k": bf, 3: [1, 2.5, float("inf")]}, torch.float16, object())
    save_call(tmp_path / "c", "quantize", args, {"fmt": "e4m3fn"}, result=(x * 2, None))
    call = load_call(tmp_path / "c")
    assert call.op == "quantize" and call.kwargs == {"fmt": "e4m3fn"}
    assert torch.equal(call.args[0], x) and call.args[0].stride() == x.stride()
    assert call.args[1] == Granularity.block((2, 3))
    assert call.args[2]["k"].dtype == torch.bfloat16 and torch.equal(call.args[2]["k"].view(torch.int16),
                                                                      bf.view(torch.int16))
    assert call.args[2][3] == [1, 2.5, float("inf")]
    assert call.args[3] is torch.float16
    assert isinstance(call.args[4], Opaque)
    assert torch.equal(call.result[0], x * 2) and call.result[1] is None


def test_capture_rebuilds_only_fp8rl_classes():
    tensors: dict = {}
    value = {"__dataclass__": "os:PathLike", "fields": {}}
    with pytest.raises(ValueError, match="only fp8rl's own dataclasses"):
        decode(value, tensors)
    assert encode(1.0, tensors, "k") == 1.0 and tensors == {}
