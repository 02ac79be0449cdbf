"""``fp8rl repro``: from failing cases of a report to standalone, shrunk reproductions.

One conformance run of an engine made of mutants (each breaks a different op: quantize's scale in bf16, the KV store
without its clamp, TIS weights without truncation, the proximal policy one version off, one activation scale per
tensor in the GEMM, FP8 attention without the q descale, the policy loss on whitened corrected advantages, weight
sync storing 1/s, a checkpoint writer quantizing fp32 masters directly, the MX exponent rounded up) gives a report with a failing case in the
quantization, gemm, kv, correction, weight_sync and checkpoint areas and one in an op fp8rl repro has no comparison
for. ONE ``fp8rl repro REPORT CASE... --out DIR`` reruns the op-level cases together and writes a folder per case
(module fixture ``repros``); the op without a comparison goes through the single-case path. The engine is named as an
out-of-tree ``module:factory`` (its module in a temporary directory on PYTHONPATH), so the scripts load it the way
the report's run did. Each repro script runs (``--check``) from a directory outside the repository.
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

MUTANTS = ("bf16-scale", "kv-no-clamp", "corr-no-truncation", "corr-prox-off-by-one", "gemm-act-scale-per-tensor",
           "kv-q-scale-ignored", "learn-is-before-adv-norm", "wsync-scale-inverse", "ckpt-writer-fp32-direct",
           "mx-ceil-for-floor")
COMBO = textwrap.dedent(f'''
    """Mutants of fp8rl in one engine: each overrides a different op."""
    from fp8rl.mutants import MUTANTS

    _BASES = tuple(MUTANTS[n].factory for n in {MUTANTS!r})
    Combo = type("Combo", _BASES, {{"name": "combo-of-mutants"}})
''')

#: area → a case the combo engine fails; all but "other" are reproduced by one fp8rl repro call
CASES = {"quantization": "QUANT-EXACT-001[block]", "kv": "KV-STORE-001[head-e4m3fn]", "correction": "CORR-TIS-001",
         "gemm": "GEMM-BOUND-001[block-fp32]", "kv_attention": "KV-ATTN-001[varlen-causal-head-e4m3fn]",
         "correction_loss": "CORR-LOSS-001", "weight_sync": "WSYNC-EXACT-001[tiny-qwen3]",
         "checkpoint": "CKPT-WRITE-001[fp32-tiny-qwen3]", "mx_quantize": "MX-EXACT-001[mxfp8_e4m3]",
         "other": "CORR-PROX-001"}
TOGETHER = [label for area, label in CASES.items() if area != "other"]


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


@pytest.fixture(scope="module")
def repros(failing_report, tmp_path_factory) -> dict[str, Path]:
    """area → its repro folder, all written by ONE fp8rl repro call (one rerun capturing every case)."""
    report, env = failing_report
    out = tmp_path_factory.mktemp("repros") / "all"
    made = subprocess.run([sys.executable, "-m", "fp8rl", "repro", str(report), *TOGETHER, "--out", str(out)],
                          cwd=out.parent, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    assert made.stderr.count("rerunning") + made.stdout.count("rerunning") == 1  # one rerun for every case
    folders = {area: out / repro._safe(label) for area, label in CASES.items() if area != "other"}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folders.values())
    return folders


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


def _field_shape(arg: dict, name: str) -> list[int]:
    """The shape of tensor field ``name`` of a dataclass argument in call.json (QuantizedTensor, KVCache)."""
    return arg["fields"][name]["shape"]


def _call_doc(folder: Path, which: str = "call") -> dict:
    return json.loads((folder / f"{which}.json").read_text())


def _ran(folder: Path, env: dict[str, str], *texts: str) -> str:
    """Run the folder's repro.py --check (outside the repository): it must exit 1 and print ``texts``; it imports
    only the standard library and the installed fp8rl (the engine through its name)."""
    source = (folder / "repro.py").read_text()
    assert str(REPO) not in source
    assert _imported_modules(source) <= {"__future__", "argparse", "sys", "pathlib", "fp8rl", "json", "subprocess",
                                         "tempfile"}
    ran = _script(folder, env)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    for text in texts:
        assert text in ran.stdout, (text, ran.stdout)
    return ran.stdout


def test_quantization_repro_is_one_element_pair_of_the_failing_block(failing_report, repros):
    _, env = failing_report
    folder = repros["quantization"]
    assert _tensor_shapes(folder) == [[1, 2]]  # the differing element and its 128x128 block's amax element
    assert _call_doc(folder, "original")["args"][0]["shape"] == [256, 256]
    _ran(folder, env, "amax/448 in fp32", "scale: oracle", "engine 380.0", "x/s with the oracle's scale: fp32",
         "bf16", "expected code 0x", "engine code 0x", "of scale group (0, 0) of the original (256, 256)")
    source = (folder / "repro.py").read_text()
    assert str(REPO) not in source
    assert _imported_modules(source) <= {"__future__", "argparse", "sys", "pathlib", "fp8rl"}


def test_kv_repro_is_one_element_of_one_head(failing_report, repros):
    _, env = failing_report
    folder = repros["kv"]
    shapes = _tensor_shapes(folder)
    assert shapes[0] == [1, 1, 1, 1] and shapes[1] == [1], shapes  # x: one element; its head's scale
    _ran(folder, env, "x/s fp32", "beyond", "expected code 0x7e (448.0), engine code 0x7f (nan)",
         "of the original (2, 33, 4, 64)")


def test_correction_repro_is_one_token(failing_report, repros):
    _, env = failing_report
    folder = repros["correction"]
    assert _tensor_shapes(folder) == [[1, 1], [1, 1], [1, 1]]
    _ran(folder, env, "delta = log pi_train - log pi_rollout", "rho = e^delta", "weight: expected", "bound",
         "alone of the original")


def test_gemm_repro_is_the_failing_outputs_row_and_column(failing_report, repros):
    """gemm-act-scale-per-tensor: one K block alone has one activation scale (no discrepancy), so the repro is row
    i of a and row j of w over every K block, and prints each block's partial product."""
    _, env = failing_report
    folder = repros["gemm"]
    doc, orig = _call_doc(folder), _call_doc(folder, "original")
    assert doc["op"] == "block_gemm"
    assert [_field_shape(a, "codes") for a in orig["args"][:2]] == [[16, 256], [256, 256]]
    assert [_field_shape(a, "codes") for a in doc["args"][:2]] == [[1, 256], [1, 256]]
    assert [_field_shape(a, "scale") for a in doc["args"][:2]] == [[1, 2], [1, 2]]  # group 1x128; 128x128 block
    assert any("K 0:128 only" in t and "no discrepancy" in t for t in doc["repro"]["tried"])
    _ran(folder, env, "outputs beyond the bound: 1 of 1", "K 0:128: sum of code products", "K 128:256:", "s_a ",
         "s_w ", "fp32 accumulation", "running sum exact", "engine - oracle")


def test_kv_attention_repro_is_one_query_token_of_one_head(failing_report, repros):
    _, env = failing_report
    folder = repros["kv_attention"]
    doc, orig = _call_doc(folder), _call_doc(folder, "original")
    q, kc, vc = doc["args"]
    oq = orig["args"][0]["shape"]
    assert q["shape"] == [1, 1, 1, oq[-1]], q["shape"]  # one query token of one head
    ok = _field_shape(orig["args"][1], "codes")
    for cache in (kc, vc):
        shape = _field_shape(cache, "codes")
        assert shape[0] == 1 and shape[2] == 1 and shape[3] == ok[3] and 1 <= shape[1] <= ok[1], shape
        assert _field_shape(cache, "scale") == [1]  # layout head: that KV head's scale
    _ran(folder, env, "reads KV head", "q_scale", "Q-hat", "score sm*q.k", "output row o[0, 0, 0, :4]: oracle")


def test_correction_loss_repro_is_one_row(failing_report, repros):
    _, env = failing_report
    folder = repros["correction_loss"]
    doc = _call_doc(folder)
    assert doc["op"] == "correction_loss"
    shapes = _tensor_shapes(folder)  # logp, old_logp, advantages, mask, weights
    assert len(shapes) == 5 and all(s[0] == 1 for s in shapes), shapes
    assert _call_doc(folder, "original")["args"][0]["shape"][0] > 1
    assert doc["args"][0]["requires_grad"] is True
    _ran(folder, env, "loss: oracle", "dL/dlogp: oracle", "ratio r = e^(logp - old)", "per-token loss")


def test_weight_sync_repro_is_one_block_of_one_tensor(failing_report, repros):
    _, env = failing_report
    folder = repros["weight_sync"]
    doc = _call_doc(folder)
    (sd,) = doc["args"]
    entries = sd["__dict__"]
    assert len(entries) == 1 and entries[0][1]["shape"] == [128, 128], entries
    name = entries[0][0]
    assert len(_call_doc(folder, "original")["args"][0]["__dict__"]) > 10  # the whole tiny model's state dict
    out = _ran(folder, env, f"{name}_scale_inv[", "amax/448 fp32", "block (")
    # the mutant stores 1/s: the printed engine scale is the reciprocal of the oracle's
    line = next(x for x in out.splitlines() if f"{name}_scale_inv[" in x and "oracle" in x)
    oracle, engine = (float(part.split()[1]) for part in line.split(": ", 1)[1].split(", "))
    assert engine == pytest.approx(1.0 / oracle)


def test_checkpoint_repro_names_the_fixture_and_seed_and_reruns_the_case(failing_report, repros):
    _, env = failing_report
    folder = repros["checkpoint"]
    meta = json.loads((folder / "repro.json").read_text())
    seed = json.loads((REPO / "fixtures" / "tiny_models.json").read_text())["models"]["tiny-qwen3"]["seed"]
    assert meta["captured"] is False and meta["fixture"]["model"] == "tiny-qwen3"
    assert meta["fixture"]["model_seed"] == seed
    readme = (folder / "README.md").read_text()
    for text in ("checkpoint directory on disk", f"seed {seed} of fixtures/tiny_models.json",
                 "fp8rl.fixtures.master_state_dict('tiny-qwen3')", "CKPT-WRITE-001[fp32-tiny-qwen3]"):
        assert text in readme, (text, readme)
    assert not (folder / "call.safetensors").exists()
    _ran(folder, env, "CKPT-WRITE-001[fp32-tiny-qwen3]: failed", "codes differ")


def test_mx_quantize_repro_is_the_failing_32_element_block(failing_report, repros):
    """mx-ceil-for-floor (the E8M0 exponent rounded up where the OCP floor rule is declared): the repro is the first
    differing 32-element block alone."""
    _, env = failing_report
    folder = repros["mx_quantize"]
    assert _tensor_shapes(folder) == [[1, 32]]
    assert _call_doc(folder, "original")["args"][0]["shape"] == [8, 256]
    assert _call_doc(folder)["repro"]["declared"]["mx_policy"]["exp_rounding"] == "floor"
    _ran(folder, env, "exp_rounding floor", "amax/448 fp32", "scale code: oracle", "x/scale with the oracle's scale",
         "expected code 0x", "of the original (8, 256) x alone")


def test_e2e_fallback_names_the_fixture_seed_and_why():
    seed = json.loads((REPO / "fixtures" / "tiny_models.json").read_text())["models"]["tiny-qwen3-moe"]["seed"]
    entry = {"id": "E2E-MISMATCH-001", "case": "tiny-qwen3-moe-fp8-all", "area": "e2e"}
    why, info = repro.uncapturable_input(entry, 7, "fp8rl conformance --engine x -k 'E2E-MISMATCH-001'")
    assert info == {"area": "e2e", "model": "tiny-qwen3-moe", "run_seed": 7, "model_seed": seed}
    for text in ("rollout_init(config, state_dict, recipe)", f"seed {seed}", "fp8rl.fixtures.tiny_model('tiny-qwen3-moe')",
                 "fixtures/prompts.json", "run seed 7", "-k 'E2E-MISMATCH-001'"):
        assert text in why, (text, why)
    assert repro.uncapturable_input({"id": "GEMM-BOUND-001", "case": "block-fp32", "area": "gemm"}, 0, "c") is None


def test_op_without_comparison_says_the_input_was_not_captured(failing_report, tmp_path):
    """The single-case path (its folder is --out itself)."""
    report, env = failing_report
    folder = tmp_path / "prox"
    made = _repro(report, env, CASES["other"], folder)
    assert made.returncode == 0, made.stdout + made.stderr
    readme = (folder / "README.md").read_text()
    assert "The input was not captured" in readme and "proximal_logp" in readme
    meta = json.loads((folder / "repro.json").read_text())
    assert meta["captured"] is False and "fixture" not in meta
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
