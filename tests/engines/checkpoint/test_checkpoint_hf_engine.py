"""The ``hf-fp8`` engine (transformers' fine-grained FP8 loader): behaviour without accelerate (base environment)
and — where transformers 5.24 and accelerate are installed (the ``conformance_trl`` nox session) — executable
evidence of every finding in conformance/vendors/hf-fp8.xfails."""

from __future__ import annotations

import sys
import tempfile

import pytest
import torch
from fp8rl import fixtures
from fp8rl.checks import CHECKS
from fp8rl.engine import capability_reason
from fp8rl.engines.checkpoint_hf import HfFp8Engine
from fp8rl.plugin import parse_id_file
from fp8rl.reference import checkpoint as ck
from support import REPO_ROOT
from support.upstream import pinned

PIN = pinned("transformers", "==5.24.0", "Fp8Dequantize._dequantize_one derives the block from the scale grid and "
             "validates nothing else")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "hf-fp8.xfails"
try:
    import accelerate  # noqa: F401

    HAS_ACCELERATE = True
except ImportError:
    HAS_ACCELERATE = False
needs_loader = pytest.mark.skipif(not HAS_ACCELERATE, reason="transformers' FP8 loader needs accelerate (trl tier)")


def test_without_accelerate_load_says_why(monkeypatch):
    pytest.importorskip("transformers")  # imported first: it records accelerate's availability at import
    monkeypatch.setitem(sys.modules, "accelerate", None)
    reason = capability_reason(HfFp8Engine(), "checkpoint.load")
    assert reason is not None and "accelerate" in reason, reason
    assert "GPU" in (capability_reason(HfFp8Engine(), "checkpoint.write") or "")


def test_vendor_xfails_file_is_valid():
    import fp8rl.conformance.test_checkpoint  # noqa: F401  (registers the CKPT-* checks)

    entries = parse_id_file(XFAILS)
    assert entries
    for prefix, reason in entries:
        assert any(cid.startswith(prefix.split("[")[0]) for cid in CHECKS), f"stale xfail entry {prefix}"
        assert len(reason) > 80, f"{prefix}: the reason must give the numbers"


def _diff(held: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    d = held.double() != want.double()
    return int(d.sum()), float((held.double() - want.double()).abs().max())


@PIN
@needs_loader
def test_finding_non_multiple_of_128_raises():
    from fp8rl.conformance import test_checkpoint as tc

    with pytest.raises(RuntimeError, match="automatic conversion"):
        HfFp8Engine().checkpoint_load(tc._oracle_checkpoint("tiny-qwen3"))


@PIN
@needs_loader
def test_finding_block_from_grid_silently_wrong_exact():
    tm = fixtures.tiny_model("tiny-qwen3")
    cfg = dict(tm.config, hidden_size=256, intermediate_size=192)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, v in tm.state_dict.items():
        shape = [256 if s == 320 else 192 if s == 384 else s for s in v.shape]
        sd[k] = ((torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16) if v.dim() == 2
                 else torch.ones(*shape, dtype=torch.bfloat16))
    d = tempfile.mkdtemp(prefix="fp8rl-hf192-")
    ck.write_checkpoint(d, cfg, sd)
    held, want = HfFp8Engine().checkpoint_load(d), ck.dequantize_checkpoint(d)
    name = "model.layers.0.mlp.down_proj.weight"
    n, err = _diff(held[name], want[name])
    assert n == 8192 and 0.02 < err < 0.05, (n, err)
    assert torch.equal(held["model.layers.0.self_attn.q_proj.weight"], want["model.layers.0.self_attn.q_proj.weight"])


@PIN
@needs_loader
@pytest.mark.parametrize("defect, differ, nonfinite", [
    ("scale-wrong-shape", 32768, 0), ("scale-missing", 65533, 0), ("scale-nan", 16384, 16384),
    ("scale-inf", 16384, 16384), ("block-size-contradicts", 0, 0)])
def test_finding_bad_checkpoints_load_silently(defect, differ, nonfinite):
    from fp8rl.conformance import test_checkpoint as tc

    good = ck.dequantize_checkpoint(tc._oracle_checkpoint("tiny-qwen3-moe"))[tc._VICTIM]
    held = HfFp8Engine().checkpoint_load(tc._bad_checkpoint(defect))[tc._VICTIM]
    assert int((held.double() != good.double()).sum()) == differ
    assert int((~torch.isfinite(held.float())).sum()) == nonfinite


@PIN
@needs_loader
def test_interop_matrix_reference_writer_cells(tmp_path):
    """The writer x loader matrix in this tier: the oracle writer's checkpoints through the oracle and transformers
    (conformant, except the known non-multiple-of-128 failure), exit 0 (the failure is a listed deviation)."""
    import json

    from fp8rl.cli import main

    assert main(["checkpoint-matrix", "--writer", "reference", "--loader", "reference", "--loader", "hf-fp8",
                 "--out", str(tmp_path)]) == 0
    cells = {(c["loader"], c["model"]): c for c in json.loads((tmp_path / "matrix.json").read_text())["cells"]}
    assert cells[("hf-fp8", "tiny-qwen3-moe")]["status"] == "conformant"
    assert cells[("hf-fp8", "tiny-qwen3")]["status"] == "error" and cells[("hf-fp8", "tiny-qwen3")]["known"]
    assert all(cells[("reference", m)]["status"] == "conformant" for m in ("tiny-qwen3", "tiny-qwen3-moe"))
