"""``fp8rl checkpoint-matrix``: the writer x loader table, its files and its exit code."""

from __future__ import annotations

import json

from fp8rl.cli import main


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
