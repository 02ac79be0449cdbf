"""``fp8rl checkpoint-matrix``: the writer x loader table, its files and its exit code."""

from __future__ import annotations

import json

import pytest
from fp8rl.checkpoint_cli import known_keys
from fp8rl.cli import main
from fp8rl.engine import Engine
from fp8rl.engines.hf_fp8 import HfFp8Engine


def test_matrix_conformant_and_deviation_cells(tmp_path):
    out = tmp_path / "m"
    rc = main(["checkpoint-matrix", "--writer", "reference", "--writer", "mutant:ckpt-writer-scale-inverse",
               "--loader", "reference", "--loader", "mutant:ckpt-loader-inverts-scale", "--loader", "hf-fp8",
               "--model", "tiny-qwen3-moe", "--out", str(out)])
    assert rc == 1
    doc = json.loads((out / "matrix.json").read_text())
    cells = {(c["writer"], c["loader"]): c for c in doc["cells"]}
    assert cells[("reference", "reference")]["status"] == "conformant"
    # the file of the inverse-scale writer is still a valid checkpoint: a correct loader reads it exactly
    assert cells[("mutant:ckpt-writer-scale-inverse", "reference")]["status"] == "conformant"
    bad = cells[("reference", "mutant:ckpt-loader-inverts-scale")]
    assert bad["status"] == "deviation" and bad["values_differ"] > 0 and bad["max_abs_err"] > 0
    assert cells[("reference", "hf-fp8")]["status"] in ("conformant", "not run")
    md = (out / "matrix.md").read_text()
    assert "| reference | tiny-qwen3-moe | within bound (max error/bound " in md
    # ... but its file is not within the round-trip bound of the BF16 weights (the writer's column)
    assert cells[("mutant:ckpt-writer-scale-inverse", "reference")]["file"]["status"] == "deviation"
    assert cells[("reference", "reference")]["file"]["status"] == "conformant"
    assert "<table>" in (out / "matrix.html").read_text()


def test_matrix_reads_checkpoints_written_elsewhere_and_exits_0(tmp_path):
    ck = tmp_path / "cks"
    assert main(["checkpoint-matrix", "--writer", "reference", "--loader", "reference", "--model", "tiny-qwen3",
                 "--checkpoints", str(ck), "--out", str(tmp_path / "a")]) == 0
    assert (ck / "reference" / "tiny-qwen3" / "config.json").is_file()


def test_matrix_unknown_engine_is_a_usage_error(tmp_path):
    assert main(["checkpoint-matrix", "--loader", "no-such-engine", "--out", str(tmp_path)]) == 2


def _ct_checkpoint(root, model: str = "tiny-qwen3-moe", corrupt: bool = False):
    """A compressed-tensors FP8 block checkpoint as the writer ``compressed-tensors`` lays it out under
    ``--checkpoints``, built from the oracle's blockwise file (weight_scale_inv → weight_scale, the CT config)."""
    from fp8rl import fixtures
    from fp8rl.reference import checkpoint as ck
    from fp8rl.reference import checkpoint_ct as cct

    tm = fixtures.tiny_model(model)
    src = ck.write_checkpoint(root / "src", tm.config, tm.state_dict)
    _, tensors = ck.read_checkpoint(src)
    out = {(n[: -len("_inv")] if n.endswith("_scale_inv") else n): t for n, t in tensors.items()}
    if corrupt:
        s = out["model.layers.0.self_attn.q_proj.weight_scale"].clone()
        s[0, 0] = float("nan")
        out["model.layers.0.self_attn.q_proj.weight_scale"] = s
    routers = [n[: -len(".weight")] for n in tm.state_dict if n.endswith(".mlp.gate.weight")]
    qc = cct.quantization_config(cct.CTWeightScheme("block", block=(128, 128)), ["lm_head", *routers])
    return ck.write_tensors(root / "cks" / "compressed-tensors" / model, tm.config, out, qc)


def test_matrix_compressed_tensors_file_read_by_reference_not_run_for_hf_fp8(tmp_path):
    _ct_checkpoint(tmp_path)
    out = tmp_path / "m"
    rc = main(["checkpoint-matrix", "--writer", "compressed-tensors", "--loader", "reference", "--loader", "hf-fp8",
               "--model", "tiny-qwen3-moe", "--checkpoints", str(tmp_path / "cks"), "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "matrix.json").read_text())
    cells = {c["loader"]: c for c in doc["cells"]}
    assert cells["reference"]["status"] == "conformant"
    assert cells["reference"]["file"]["status"] == "conformant"
    hf = cells["hf-fp8"]
    assert cells["reference"]["format"] == "compressed-tensors"
    if "compressed-tensors" not in HfFp8Engine().checkpoint_formats:  # the base environment: no compressed-tensors
        assert hf["status"] == "not run" and "'compressed-tensors'" in hf["detail"] and "fp8" in hf["detail"]
        assert "compressed-tensors package" in hf["detail"]
    assert "| compressed-tensors | tiny-qwen3-moe | within bound" in (out / "matrix.md").read_text()


def test_matrix_bad_compressed_tensors_file_names_the_tensor(tmp_path):
    _ct_checkpoint(tmp_path, corrupt=True)
    out = tmp_path / "m"
    rc = main(["checkpoint-matrix", "--writer", "compressed-tensors", "--loader", "reference", "--model",
               "tiny-qwen3-moe", "--checkpoints", str(tmp_path / "cks"), "--out", str(out)])
    assert rc == 1
    cell = json.loads((out / "matrix.json").read_text())["cells"][0]
    assert cell["file"]["status"] == "deviation"
    assert "model.layers.0.self_attn.q_proj.weight_scale" in cell["file"]["detail"]
    assert cell["status"] == "error" and "q_proj.weight_scale" in cell["detail"]


def test_known_keys_are_format_aware():
    assert known_keys("CKPT-LOAD-001", "tiny-qwen3") == {"CKPT-LOAD-001[tiny-qwen3]"}
    assert known_keys("CKPT-LOAD-001", "tiny-qwen3", "fp8") == {"CKPT-LOAD-001[tiny-qwen3]",
                                                                 "CKPT-LOAD-001[fp8:tiny-qwen3]"}
    # an fp8 finding (the plain key) never vouches for a compressed-tensors cell
    assert known_keys("CKPT-LOAD-001", "tiny-qwen3", "compressed-tensors") == {
        "CKPT-LOAD-001[compressed-tensors:tiny-qwen3]"}


class _RaisingLoader(Engine):
    """A loader of both formats that raises on every file."""

    name = "fake-loader"
    checkpoint_formats = ("fp8", "compressed-tensors")

    def version(self) -> str:
        return "fake 0"

    def capabilities(self):
        return {"checkpoint.load": True}

    def checkpoint_load(self, path):
        raise RuntimeError("fake loader: cannot load")


@pytest.mark.parametrize("entries, rc, known_fp8, known_ct", [
    (["CKPT-LOAD-001[tiny-qwen3-moe]"], 1, True, False),  # the fp8 entry: the compressed-tensors cell is not known
    (["CKPT-LOAD-001[compressed-tensors:tiny-qwen3-moe]"], 1, False, True),
    (["CKPT-LOAD-001[fp8:tiny-qwen3-moe]", "CKPT-LOAD-001[compressed-tensors:tiny-qwen3-moe]"], 0, True, True),
    # an entry is a prefix, as in a conformance run: the unclosed case and the bare check id cover their cells
    (["CKPT-LOAD-001[tiny-qwen3-moe"], 1, True, False),
    (["CKPT-LOAD-001"], 0, True, True),
    (["CKPT-LOAD-001[tiny-qwen3-moe-x]"], 1, False, False),
])
def test_matrix_known_is_format_aware_exact(tmp_path, monkeypatch, entries, rc, known_fp8, known_ct):
    import fp8rl.registry
    import fp8rl.vendor_files

    xf = tmp_path / "fake-loader.xfails"
    xf.write_text("".join(f"{e}  # a finding of the fake loader on this cell, for the format-aware known-ness\n"
                          for e in entries))
    real_load, real_vendor = fp8rl.registry.load_engine, fp8rl.vendor_files.packaged_vendor_file
    monkeypatch.setattr(fp8rl.registry, "load_engine",
                        lambda name: _RaisingLoader() if name == "fake-loader" else real_load(name))
    monkeypatch.setattr(fp8rl.vendor_files, "packaged_vendor_file",
                        lambda engine, kind: xf if engine == "fake-loader" and kind == "xfails"
                        else real_vendor(engine, kind))
    _ct_checkpoint(tmp_path)
    out = tmp_path / "m"
    assert main(["checkpoint-matrix", "--writer", "reference", "--writer", "compressed-tensors", "--loader",
                 "fake-loader", "--model", "tiny-qwen3-moe", "--checkpoints", str(tmp_path / "cks"),
                 "--out", str(out)]) == rc
    cells = {c["writer"]: c for c in json.loads((out / "matrix.json").read_text())["cells"]}
    assert cells["reference"]["format"] == "fp8" and cells["compressed-tensors"]["format"] == "compressed-tensors"
    assert cells["reference"]["status"] == cells["compressed-tensors"]["status"] == "error"
    assert cells["reference"]["known"] is known_fp8 and cells["compressed-tensors"]["known"] is known_ct


def test_matrix_logprobs_deviation_of_a_loader_whose_forward_misreads_scales(tmp_path):
    """A loader that reads the file's weights back exactly but computes with a column-major reading of the scale
    grids: its held weights are exact, so only the log-prob comparison (CKPT-LOAD-005's statement) makes the cell a
    deviation; the correct loader's cell is conformant with the oracle's log-probs exactly."""
    out = tmp_path / "m"
    rc = main(["checkpoint-matrix", "--writer", "reference", "--loader", "reference", "--loader",
               "mutant:ckpt-loader-forward-scale-layout", "--model", "tiny-qwen3", "--out", str(out)])
    assert rc == 1
    cells = {c["loader"]: c for c in json.loads((out / "matrix.json").read_text())["cells"]}
    good, bad = cells["reference"], cells["mutant:ckpt-loader-forward-scale-layout"]
    assert good["status"] == "conformant" and good["logprobs"]["max_abs_dlogp"] == 0.0
    assert bad["status"] == "deviation" and "values_differ" not in bad and not bad["known"]
    from fp8rl import tolerances

    assert bad["logprobs"]["status"] == "deviation"
    assert bad["logprobs"]["k3_kl"] > 10 * tolerances.e2e_budget("k3_kl", "tiny-qwen3", "bf16")
    assert "log-probs vs the oracle's dequantized model (bf16 budgets): k3_kl" in bad["detail"]
    assert "conformant (log-probs: max Δlogp 0, k3 KL 0)" in (out / "matrix.md").read_text()


def test_matrix_channel_layout_row_and_a_loader_that_cannot_load_it_here(tmp_path, monkeypatch):
    """Writer ``reference-channel`` (the oracle's FP8_DYNAMIC file): read exactly by the reference loader, format
    ``compressed-tensors-channel``; a loader whose ``checkpoint_layout_reason`` refuses that layout on this machine
    gets a "not run" cell with its reason, the blockwise row still runs."""
    from fp8rl.engines.reference import ReferenceEngine

    monkeypatch.setattr(ReferenceEngine, "checkpoint_layout_reason",
                        lambda self, layout: "no channel kernel here" if layout == "compressed-tensors-channel"
                        else None, raising=False)
    out = tmp_path / "m"
    rc = main(["checkpoint-matrix", "--writer", "reference-channel", "--writer", "reference", "--loader",
               "mutant:ckpt-loader-ct-strategy-ignored", "--model", "tiny-qwen3", "--out", str(out)])
    doc = json.loads((out / "matrix.json").read_text())
    cells = {c["writer"]: c for c in doc["cells"]}
    ch = cells["reference-channel"]
    assert ch["format"] == "compressed-tensors-channel" and ch["file"]["status"] == "conformant"
    assert ch["status"] == "not run" and "no channel kernel here" in ch["detail"]
    assert cells["reference"]["status"] == "conformant"  # the mutant misreads compressed-tensors files only
    assert rc == 0
    monkeypatch.undo()
    rc = main(["checkpoint-matrix", "--writer", "reference-channel", "--loader", "reference", "--loader",
               "mutant:ckpt-loader-ct-strategy-ignored", "--model", "tiny-qwen3", "--out", str(tmp_path / "n")])
    cells = {c["loader"]: c for c in json.loads((tmp_path / "n" / "matrix.json").read_text())["cells"]}
    assert cells["reference"]["status"] == "conformant" and cells["reference"]["logprobs"]["k3_kl"] == 0.0
    bad = cells["mutant:ckpt-loader-ct-strategy-ignored"]
    assert bad["status"] == "deviation" and bad["values_differ"] > 0 and not bad["known"]
    assert rc == 1


def test_checkpoint_layout_reason_checks_the_format_then_the_engine():
    from fp8rl.engine import CHECKPOINT_LAYOUTS, checkpoint_layout_reason
    from fp8rl.engines.reference import ReferenceEngine

    class FP8Only(ReferenceEngine):
        checkpoint_formats = ("fp8",)

        def checkpoint_layout_reason(self, layout):
            return "needs AMX" if layout == "fp8" else None

    eng = FP8Only()
    assert set(CHECKPOINT_LAYOUTS) == {"fp8", "fp8-per-tensor", "compressed-tensors", "compressed-tensors-channel"}
    assert checkpoint_layout_reason(eng, "fp8") == "needs AMX"
    assert checkpoint_layout_reason(eng, "fp8-per-tensor") is None
    assert "'compressed-tensors'" in checkpoint_layout_reason(eng, "compressed-tensors-channel")  # format first
    assert checkpoint_layout_reason(ReferenceEngine(), "compressed-tensors-channel") is None  # no hook: loads
    with pytest.raises(ValueError, match="layout: expected one of"):
        checkpoint_layout_reason(eng, "fp8-block")


def test_matrix_channel_writer_of_an_engine_without_it_is_not_run_with_the_reason(tmp_path, monkeypatch):
    """A layout writer (``compressed-tensors-channel``: engine compressed-tensors' ``checkpoint_write_channel``)
    whose engine lacks ``checkpoint.write_channel`` here gets "not run" cells carrying the capability's reason;
    ``reference-channel`` goes through the reference engine's channel writer (its file within bound, read exactly)."""
    from fp8rl.engines.compressed_tensors import CompressedTensorsEngine

    monkeypatch.setattr(CompressedTensorsEngine, "capabilities",
                        lambda self: {"checkpoint.write_channel": "no FP8_DYNAMIC writer in this environment"})
    out = tmp_path / "m"
    rc = main(["checkpoint-matrix", "--writer", "compressed-tensors-channel", "--writer", "reference-channel",
               "--loader", "reference", "--model", "tiny-qwen3", "--out", str(out)])
    cells = {c["writer"]: c for c in json.loads((out / "matrix.json").read_text())["cells"]}
    ct = cells["compressed-tensors-channel"]
    assert ct["status"] == "not run" and "no FP8_DYNAMIC writer in this environment" in ct["detail"]
    ref = cells["reference-channel"]
    assert ref["format"] == "compressed-tensors-channel" and ref["file"]["status"] == "conformant"
    assert ref["status"] == "conformant"
    assert rc == 0


def test_reference_channel_writer_meets_the_channel_writer_checks(tmp_path):
    """The reference engine's ``checkpoint_write_channel`` (the oracle writer under its channel policy) passes
    CKPT-WRITE-004/005/006 and CKPT-CONFIG-002, which the channel-writer mutants fail (tests/checks/test_mutants.py)."""
    out = tmp_path / "r"
    rc = main(["conformance", "--engine", "reference", "--area", "checkpoint", "-k",
               "channel_writer", "--no-isolation", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    ids = {c["id"] for c in report["checks"]}
    assert ids == {"CKPT-WRITE-004", "CKPT-WRITE-005", "CKPT-WRITE-006", "CKPT-CONFIG-002"}
    assert {c["outcome"] for c in report["checks"]} == {"passed"} and len(report["checks"]) == 29
    assert rc == 0


def test_loader_cases_of_one_checkpoint_run_next_to_each_other():
    """conformance/conftest.py orders CKPT-LOAD-005[x] right after CKPT-LOAD-001[x] (the same file, so a loader that
    keeps its last started checkpoint starts once); the other checks keep their collection order."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                        str(root / "conformance" / "test_checkpoint.py"), "-k",
                        "loader_exact or logprobs_bound or channel_writer_config"],
                       capture_output=True, text=True, timeout=300, cwd=root)
    ids = [ln.split("::", 1)[1] for ln in r.stdout.splitlines() if "::" in ln]
    assert len(ids) == 18, r.stdout[-2000:] + r.stderr[-2000:]
    load = [i for i in ids if i.startswith(("test_checkpoint_loader_exact", "test_checkpoint_loaded_logprobs"))]
    for a, b in zip(load[::2], load[1::2]):
        assert a.startswith("test_checkpoint_loader_exact[") and b.startswith("test_checkpoint_loaded_logprobs_bound[")
        assert a.split("[", 1)[1] == b.split("[", 1)[1], (a, b)
    others = [i for i in ids if i not in load]
    assert others == ["test_checkpoint_channel_writer_config_exact[tiny-qwen3]",
                      "test_checkpoint_channel_writer_config_exact[tiny-qwen3-moe]"]
    assert ids.index(others[0]) < ids.index(load[0])  # defined before the loader checks: still first
