"""The ``hf-fp8`` engine (transformers' fine-grained FP8 loader): behaviour without accelerate (base environment)
and — where transformers 5.24 and accelerate are installed (the ``conformance_checkpoint`` nox session) — executable
evidence of every finding in conformance/vendors/hf-fp8.xfails."""

from __future__ import annotations

import sys
import tempfile

import pytest
import torch
from fp8rl import fixtures
from fp8rl.engine import capability_reason
from fp8rl.engines.hf_fp8 import HfFp8Engine
from fp8rl.reference import checkpoint as ck
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import pinned

PIN = pinned("transformers", ">=5.24.0,<=5.25.0", "Fp8Dequantize._dequantize_one derives the block from the scale grid and "
             "validates nothing else")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "hf-fp8.xfails"
try:
    import accelerate  # noqa: F401

    HAS_ACCELERATE = True
except ImportError:
    HAS_ACCELERATE = False
needs_loader = pytest.mark.skipif(not HAS_ACCELERATE, reason="transformers' FP8 loader needs accelerate (checkpoint tier)")


def test_without_accelerate_load_says_why(monkeypatch):
    pytest.importorskip("transformers")  # imported first: it records accelerate's availability at import
    monkeypatch.setitem(sys.modules, "accelerate", None)
    reason = capability_reason(HfFp8Engine(), "checkpoint.load")
    assert reason is not None and "accelerate" in reason, reason
    assert "GPU" in (capability_reason(HfFp8Engine(), "checkpoint.write") or "")


def test_one_checkpoint_loads_once_and_a_rewritten_one_again(monkeypatch, tmp_path):
    """checkpoint_load then checkpoint_score of one file share one from_pretrained; a rewritten file (size or mtime
    of a file changed) or another directory loads again; a failed load is not kept."""
    loads = []

    def fake(self, path):
        loads.append(str(path))
        if "broken" in str(path):
            raise RuntimeError("conversion failed")
        return object()

    monkeypatch.setattr(HfFp8Engine, "_from_pretrained", fake)
    eng = HfFp8Engine()
    for d in ("a", "b", "broken"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text("{}")
    first = eng._load_model(tmp_path / "a")
    assert eng._load_model(tmp_path / "a") is first and len(loads) == 1
    (tmp_path / "a" / "model.safetensors").write_bytes(b"x")
    assert eng._load_model(tmp_path / "a") is not first and len(loads) == 2
    eng._load_model(tmp_path / "b")
    assert len(loads) == 3
    for _ in range(2):
        with pytest.raises(RuntimeError, match="conversion failed"):
            eng._load_model(tmp_path / "broken")
    assert len(loads) == 5


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=81)


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
@pytest.mark.parametrize("model, fp8_held, wrong", [("tiny-qwen3", 0, 1228769), ("tiny-qwen3-moe", 48, 393204)])
def test_finding_per_tensor_weight_scale_ignored_exact(model, fp8_held, wrong):
    """A per-tensor checkpoint (weight_block_size null) with vLLM's scale name ``<m>.weight_scale`` loads with every
    dense projection at scale 1 (the raw FP8 values) and the MoE experts left in FP8; the same file with transformers'
    own per-tensor name ``weight_scale_inv`` loads exactly (the control: the name is the whole cause)."""
    from fp8rl.conformance import test_checkpoint as tc

    path = tc._oracle_checkpoint(model, fmt="fp8-per-tensor")
    config, tensors = ck.read_checkpoint(path)
    want = ck.dequantize_checkpoint(config=config, tensors=tensors)
    projections = [n for n in want if n.endswith("proj.weight") and n + "_scale" in tensors]

    def judged(held):
        fp8 = [n for n in projections if held[n].dtype == torch.float8_e4m3fn]
        return len(fp8), sum(int((held[n].double() != want[n].double()).sum()) for n in projections if n not in fp8)

    assert judged(HfFp8Engine().checkpoint_load(path)) == (fp8_held, wrong)
    renamed = {(k + "_inv" if k.endswith(".weight_scale") else k): v for k, v in tensors.items()}
    control = ck.write_tensors(tempfile.mkdtemp(prefix="fp8rl-hf-pt-"), config, renamed, config["quantization_config"])
    assert judged(HfFp8Engine().checkpoint_load(control)) == (0, 0)


@PIN
@needs_loader
def test_interop_matrix_reference_writer_cells(tmp_path):
    """The writer x loader matrix in this tier (its default writers: the oracle writer, blockwise and per-tensor):
    through the oracle, conformant; through transformers, the blockwise MoE file conformant, the known
    non-multiple-of-128 failure and the known ignored per-tensor weight_scale (a deviation with the count of
    CKPT-LOAD-001[per-tensor:tiny-qwen3], keyed by the per-tensor format, not by the blockwise finding); exit 0 (every
    failure is a listed deviation)."""
    import json

    from fp8rl.cli import main

    assert main(["checkpoint-matrix", "--loader", "reference", "--loader", "hf-fp8", "--out", str(tmp_path)]) == 0
    cells = {(c["writer"], c["loader"], c["model"]): c
             for c in json.loads((tmp_path / "matrix.json").read_text())["cells"]}
    assert cells[("reference", "hf-fp8", "tiny-qwen3-moe")]["status"] == "conformant"
    assert cells[("reference", "hf-fp8", "tiny-qwen3")]["status"] == "error"
    assert cells[("reference", "hf-fp8", "tiny-qwen3")]["known"]
    pt = cells[("reference-per-tensor", "hf-fp8", "tiny-qwen3")]
    assert (pt["status"], pt["format"], pt["values_differ"], pt["known"]) == ("deviation", "per-tensor", 1228769, True)
    assert all(cells[(w, "reference", m)]["status"] == "conformant" for w in ("reference", "reference-per-tensor")
               for m in ("tiny-qwen3", "tiny-qwen3-moe"))


# ----------------------------------------------------------------------------------------------------------------
# compressed-tensors checkpoints (transformers' CompressedTensorsHfQuantizer, dequantize=True)

try:
    import compressed_tensors  # noqa: F401

    HAS_CT = True
except ImportError:
    HAS_CT = False
needs_ct = pytest.mark.skipif(not HAS_CT, reason="compressed-tensors is not installed (checkpoint tier)")
needs_ct_loader = pytest.mark.skipif(not (HAS_CT and HAS_ACCELERATE),
                                     reason="transformers' compressed-tensors loader needs compressed-tensors and "
                                            "accelerate (checkpoint tier)")
PIN_CT = pinned("compressed-tensors", ">=0.17.0,<=0.20.1", "NaiveQuantizationCompressor.decompress: before 0.19.0 "
                "it calls dequantize without the scheme's args (the block is inferred from the scale grid); from "
                "0.19.0 on the scheme's block is used")
#: the first compressed-tensors release whose decompress uses the scheme's block (measured with `fp8rl matrix --tier
#: checkpoint --package compressed-tensors --engine hf-fp8 --area checkpoint --all`, 0.17.0..0.20.1: CKPT-LOAD-001/005
#: [compressed-tensors:tiny-qwen3] xfailed in 0.17.0, 0.17.1, 0.18.0 and pass from 0.19.0; fp8rl.data
#: matrix-checkpoint-compressed-tensors-hf.json)
CT_DECOMPRESS_FIXED_IN = "0.19.0"


def _ct_decompress_fixed() -> bool:
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("compressed-tensors")) >= Version(CT_DECOMPRESS_FIXED_IN)


def test_formats_without_compressed_tensors_say_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    eng = HfFp8Engine()
    assert eng.checkpoint_formats == ("fp8",)
    assert "compressed-tensors" in eng.checkpoint_format_notes["compressed-tensors"]


@needs_ct
def test_formats_with_compressed_tensors():
    eng = HfFp8Engine()
    assert eng.checkpoint_formats == ("fp8", "compressed-tensors") and eng.checkpoint_format_notes == {}


def _ct_weight(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 codes (rows, cols), a BF16 128x128 block-scale grid (ceil-div) and codes x expanded scales (in BF16,
    one rounding of the exact fp32 product)."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    full = scale.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return codes, scale, (codes.float() * full).to(torch.bfloat16)


@PIN_CT
@needs_ct
@pytest.mark.parametrize("rows, cols, error", [
    (128, 320, "group_size 106 but got 320"),  # grid (1, 3): inferred GROUP of int(320/3) columns
    (320, 384, r"tensor a \(4\) must match the size of tensor b \(3\)"),  # (3, 3): inferred BLOCK 106x128
    (256, 128, r"tensor a \(256\) must match the size of tensor b \(2\)"),  # (2, 1): inferred CHANNEL
])
def test_ct_decompress_ceil_div_grids_by_version_exact(rows, cols, error):
    """compressed-tensors' own decompress of one FP8 block weight on ceil-div grids (dimensions not multiples of
    128): before 0.19.0 it raises (the block inferred from the grid), from 0.19.0 on it equals codes x expanded
    scales bit for bit; its dequantize given the scheme's args is exact in every version (the defect was decompress
    dropping args, not dequantize)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    comp = BaseCompressor.get_value_from_registry("float-quantized")
    codes, scale, want = _ct_weight(rows, cols)
    if _ct_decompress_fixed():
        got = comp.decompress({"weight": codes, "weight_scale": scale}, scheme)["weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    else:
        with pytest.raises((RuntimeError, ValueError), match=error):
            comp.decompress({"weight": codes, "weight_scale": scale}, scheme)
    assert torch.equal(dequantize(codes, scale, args=scheme.weights, dtype=torch.bfloat16), want)


@PIN_CT
@needs_ct
@pytest.mark.parametrize("rows, cols", [(256, 256), (128, 256), (384, 256)])
def test_ct_decompress_divisible_grids_exact(rows, cols):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    codes, scale, want = _ct_weight(rows, cols)
    got = BaseCompressor.get_value_from_registry("float-quantized").decompress(
        {"weight": codes, "weight_scale": scale}, scheme)["weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def _ct_write(cfg: dict, sd: dict) -> str:
    from fp8rl.registry import load_engine

    return str(load_engine("compressed-tensors").checkpoint_write(tempfile.mkdtemp(prefix="fp8rl-hfct-"), cfg, sd))


def _dense_variant(hidden: int, inter: int) -> tuple[dict, dict]:
    tm = fixtures.tiny_model("tiny-qwen3")
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, v in tm.state_dict.items():
        shape = [hidden if s == 320 else inter if s == 384 else s for s in v.shape]
        sd[k] = ((torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16) if v.dim() == 2
                 else torch.ones(*shape, dtype=torch.bfloat16))
    return dict(tm.config, hidden_size=hidden, intermediate_size=inter), sd


@PIN
@PIN_CT
@needs_ct_loader
def test_ct_divisible_checkpoint_loads_exact():
    """hidden 256, intermediate 384: every grid divides, compressed-tensors' inference is right, every held weight
    equals codes x scales of the file exactly (BF16, plain nn.Linear: decompressed on load)."""
    from fp8rl.reference import checkpoint_ct as cct

    path = _ct_write(*_dense_variant(256, 384))
    held = HfFp8Engine().checkpoint_load(path)
    config, tensors = ck.read_checkpoint(path)
    want = cct.dequantize_any(config, tensors, dtype=torch.bfloat16)
    assert len(want) == 25
    for name, w in want.items():
        assert held[name].dtype == torch.bfloat16 and torch.equal(held[name], w), name


@PIN
@PIN_CT
@needs_ct_loader
def test_ct_k128_weight_by_version_exact():
    """intermediate 128: down_proj (256, 128) has grid (2, 1), which compressed-tensors before 0.19.0 reads as
    per-channel (the load raises); from 0.19.0 on every held weight equals codes x scales of the file exactly."""
    from fp8rl.reference import checkpoint_ct as cct

    path = _ct_write(*_dense_variant(256, 128))
    if not _ct_decompress_fixed():
        with pytest.raises(RuntimeError, match=r"decompress|tensor a \(256\) must match the size of tensor b \(2\)"):
            HfFp8Engine().checkpoint_load(path)
        return
    held = HfFp8Engine().checkpoint_load(path)
    config, tensors = ck.read_checkpoint(path)
    want = cct.dequantize_any(config, tensors, dtype=torch.bfloat16)
    for name, w in want.items():
        assert held[name].dtype == torch.bfloat16 and torch.equal(held[name], w), name


@PIN
@PIN_CT
@needs_ct_loader
def test_interop_matrix_compressed_tensors_writer_cells(tmp_path):
    """The compressed-tensors writer's checkpoints through transformers, exit 0: tiny-qwen3-moe is a known loader
    error (transformers' FP8-experts fold); tiny-qwen3 is one before compressed-tensors 0.19.0 (its decompress) and
    loads conformant from 0.19.0 on."""
    import json

    from fp8rl.cli import main

    assert main(["checkpoint-matrix", "--writer", "compressed-tensors", "--loader", "hf-fp8",
                 "--out", str(tmp_path)]) == 0
    cells = {c["model"]: c for c in json.loads((tmp_path / "matrix.json").read_text())["cells"]}
    dense, moe = cells["tiny-qwen3"], cells["tiny-qwen3-moe"]
    assert dense["format"] == moe["format"] == "compressed-tensors"
    if _ct_decompress_fixed():
        assert dense["status"] == "conformant" and not dense["known"], dense
    else:
        assert dense["status"] == "error", dense
        assert "CompressedTensorsDequantize" in dense["detail"] and (
            "group_size 106" in dense["detail"] or "tensor a (4) must match the size of tensor b (3)" in dense["detail"])
    assert moe["status"] == "error" and moe["known"], moe
    assert "mlp.experts" in moe["detail"] and "tensor a (256) must match the size of tensor b (2)" in moe["detail"]


@PIN
@needs_loader
def test_loaded_moe_scores_like_the_oracle_exact():
    """CKPT-LOAD-005 where transformers loads the file (blockwise tiny-qwen3-moe): the loaded model's own forward
    gives the oracle's dequantized model's log-probs bit for bit (both are BF16 transformers models holding the same
    weights); the teacher-forced tokens are the oracle's sampled rollout."""
    from fp8rl.conformance import _e2e as E
    from fp8rl.conformance import test_checkpoint as tc

    path = tc._oracle_checkpoint("tiny-qwen3-moe")
    tokens, lp_oracle = E.checkpoint_oracle_scored(str(path), E.sampling_seed(0))
    lp = HfFp8Engine().checkpoint_score(path, tokens, E.prompt_len())
    assert lp.dtype == torch.float32 and lp.shape == lp_oracle.shape
    assert torch.equal(lp, lp_oracle), float((lp - lp_oracle).abs().max())


@PIN
@needs_ct_loader
def test_channel_checkpoint_exact_and_bad_row_scale_findings():
    """The oracle's compressed-tensors channel (FP8_DYNAMIC) file of tiny-qwen3 loads exactly (every projection
    codes x its rows' scales rounded once to BF16); with a NaN in row 0 of q_proj's weight_scale it still loads,
    that row NaN (hf-fp8.xfails CKPT-BAD-001[channel-scale-nan]; an inf row scale likewise, [channel-scale-inf]),
    a file without the row scales with the raw codes as the weight ([channel-scale-missing]), while a row-scale
    vector of half the length raises."""
    from fp8rl.conformance import test_checkpoint as tc
    from fp8rl.engine import EngineError
    from fp8rl.reference import checkpoint_ct as cct

    path = tc._oracle_checkpoint("tiny-qwen3", fmt="compressed-tensors-channel")
    held = HfFp8Engine().checkpoint_load(path)
    want = cct.dequantize_checkpoint(*ck.read_checkpoint(path))
    for name, w in want.items():
        assert torch.equal(held[name].view(torch.int16), w.view(torch.int16)) if w.dtype == torch.bfloat16 \
            else torch.equal(held[name], w), name
    bad = HfFp8Engine().checkpoint_load(tc._bad_channel_checkpoint("channel-scale-nan"))
    q = bad[tc._VICTIM].float()
    assert int(torch.isnan(q).sum()) == q.shape[1] and bool(torch.isnan(q[0]).all())
    # CKPT-BAD-001[channel-scale-inf]: the last row inf, every other row exact
    q = HfFp8Engine().checkpoint_load(tc._bad_channel_checkpoint("channel-scale-inf"))[tc._VICTIM]
    assert int(torch.isinf(q.float()).sum()) == q.shape[1] and bool(torch.isinf(q[-1].float()).all())
    assert torch.equal(q[:-1].view(torch.int16), want[tc._VICTIM][:-1].view(torch.int16))
    # CKPT-BAD-001[channel-scale-missing]: the raw e4m3 codes as the weight (scale 1)
    codes = ck.read_checkpoint(path)[1][tc._VICTIM]
    q = HfFp8Engine().checkpoint_load(tc._bad_channel_checkpoint("channel-scale-missing"))[tc._VICTIM]
    assert torch.equal(q.float(), codes.float()) and float((q.double() - want[tc._VICTIM].double()).abs().max()) > 400
    with pytest.raises((RuntimeError, ValueError, EngineError)):
        HfFp8Engine().checkpoint_load(tc._bad_channel_checkpoint("channel-scale-wrong-shape"))
