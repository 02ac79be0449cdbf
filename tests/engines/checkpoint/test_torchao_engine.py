"""The ``torchao`` engine (torchao's float8: ``Float8Tensor.from_hp``, ``Float8WeightOnlyConfig``,
``to_fp8_saturated``, the QAT ``Float8FakeQuantizer``): behaviour without torchao (base environment) and — where
torchao 0.18.0 is installed (the ``conformance_checkpoint`` nox session) — pins of the upstream arithmetic and executable
evidence of each finding in conformance/vendors/torchao.xfails.

Expected values come from plain fp32/bf16 arithmetic written here (numpy / torch elementwise ops) or from the
oracle under an explicitly constructed ScalePolicy, never from the adapter."""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from fp8rl.engine import capability_reason
from fp8rl.engines.torchao import TorchaoEngine
from fp8rl.reference.formats import decode_codes, encode
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, quantize, quantize_with_scale
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import installed_version, pinned

PIN = pinned("torchao", "==0.18.0", "Float8Tensor.from_hp: s = amax/448 with no eps (zero groups NaN); bf16 scale")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "torchao.xfails"
needs_torchao = pytest.mark.skipif(installed_version("torchao") is None,
                                   reason="torchao is not installed (the checkpoint tier installs it)")
#: torchao's float8 quantizer as read in quant_primitives.py, written independently of the preset
UNGUARDED = ScalePolicy(name="test_unguarded_amax_over_448", floor="none", eps=0.0, zero_amax="nan")


def _gaussian(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-8, 9, (shape[0], 1), generator=g).float())


@pytest.fixture(scope="module")
def engine():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TorchaoEngine()


def test_without_torchao_every_capability_says_why(monkeypatch):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)
    e = TorchaoEngine()
    caps = e.capabilities()
    assert caps and all(isinstance(v, str) and "torchao" in v for v in caps.values()), caps
    assert e.version() == "torchao not installed"


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=81)


@needs_torchao
def test_capabilities_run_what_the_cpu_runs_and_say_why_not_the_rest_exact(engine):
    caps = engine.capabilities()
    on = sorted(k for k, v in caps.items() if v is True)
    assert on == sorted(["cast.e4m3fn", "cast.e5m2", "cast.e4m3fnuz", "cast.e5m2fnuz", "quantize.tensor",
                         "quantize.token", "quantize.channel", "quantize.group", "quantize.block",
                         "quantize_nonfinite", "checkpoint.write"])
    assert "Triton" in (capability_reason(engine, "gemm.block") or "")
    assert "_scaled_mm" in (capability_reason(engine, "gemm.row") or "")
    assert "in place" in (capability_reason(engine, "weight_sync") or "")
    assert {engine.scale_policy(k).name for k in ("tensor", "token", "channel", "group", "block")} == {
        "torchao_float8"}
    assert engine.input_limits("quantize") == {}  # bf16 / fp16 inputs run (compute_dtype="scale_input")


# ---- upstream pins: the arithmetic of _choose_scale_float8 / _quantize_affine_float8 ----------------------------

@needs_torchao
@PIN
def test_from_hp_fp32_scale_is_amax_over_448_with_no_eps_exact():
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    x = torch.tensor([[3.0, -1.5, 0.25], [1e-30, 0.0, -2e-30], [0.0, 0.0, 0.0]])
    t = Float8Tensor.from_hp(x, granularity=PerRow())
    amax = np.abs(x.numpy()).max(axis=1)
    want = (amax / np.float32(448.0)).astype(np.float32)  # one fp32 division, no floor
    assert np.array_equal(t.scale.float().numpy().ravel(), want)
    assert t.scale[2].item() == 0.0
    codes = t.qdata.view(torch.uint8)
    assert np.isnan(decode_codes(codes[2].numpy(), "e4m3fn")).all()  # 0/0
    # row 0: 3·(448/3) = 448, -1.5/(3/448) = -224, 0.25/(3/448) = 37.33 → 36 (e4m3 step 4 in [32, 64)... RNE)
    assert decode_codes(codes[0].numpy(), "e4m3fn").tolist() == [448.0, -224.0, 36.0]


@needs_torchao
@PIN
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_hp_low_precision_scale_in_input_dtype_quotient_in_fp32_exact(dtype):
    """s = R_dtype(amax/448), q = fl32(x)/s (not R_dtype(x/s)): the preset's compute_dtype="scale_input"."""
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    x = _gaussian((64, 512), seed=3).to(dtype)
    t = Float8Tensor.from_hp(x, granularity=PerRow())
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = (amax.float() / 448.0).to(dtype).float()  # fp32 division rounded once to the input dtype
    assert torch.equal(t.scale.float(), s)
    q = (x.float() / s).clamp(-448.0, 448.0)
    want = encode(q, "e4m3fn", "saturate").reshape(q.shape)
    assert torch.equal(t.qdata.view(torch.uint8), want)
    # the preset reproduces it; the other compute dtypes do not: fp32 arithmetic misses the scales,
    # compute_dtype="input" the codes (x/s rounded to the input dtype first: double rounding)
    preset = quantize(x, Granularity.token(), get_policy("torchao_float8"))
    assert torch.equal(preset.scale, s) and torch.equal(preset.codes, want)
    fp32 = quantize(x, Granularity.token(), UNGUARDED)
    inp = quantize(x, Granularity.token(), replace(UNGUARDED, name="inp", compute_dtype="input"))
    assert not torch.equal(fp32.scale, s)
    assert torch.equal(inp.scale, s) and int((inp.codes != want).sum()) > 0


@needs_torchao
@PIN
@pytest.mark.parametrize("kind", ["tensor", "token", "channel", "group", "block"])
def test_quantize_fp32_matches_unguarded_oracle_exact(engine, kind):
    g = {"tensor": Granularity.tensor(), "token": Granularity.token(), "channel": Granularity.channel(),
         "group": Granularity.group(128), "block": Granularity.block(128)}[kind]
    for shape, seed in (((256, 512), 0), ((128, 1024), 1)):
        x = _gaussian(shape, seed)
        x[5, :] = 0.0  # a zero row: a zero row/group, part of a block
        got, want = engine.quantize(x, g), quantize(x, g, UNGUARDED)
        assert torch.equal(got.scale, want.scale), (kind, shape)
        assert torch.equal(got.codes, want.codes), (kind, shape)


@needs_torchao
def test_channel_goes_through_float8_weight_only_config_exact(engine):
    """quantize_(nn.Linear, Float8WeightOnlyConfig(PerRow())) holds what Float8Tensor.from_hp(PerRow()) gives."""
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    w = _gaussian((96, 256), 4)
    q = engine.quantize(w, Granularity.channel())
    t = Float8Tensor.from_hp(w, granularity=PerRow())
    assert torch.equal(q.codes, t.qdata.view(torch.uint8)) and torch.equal(q.scale, t.scale.float())


@needs_torchao
@PIN
def test_zero_output_channel_makes_the_weight_only_linear_nan_exact(engine):
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    w = _gaussian((8, 64), 5)
    w[3] = 0.0
    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    quantize_(lin, Float8WeightOnlyConfig(set_inductor_config=False))
    assert lin.weight.scale.flatten()[3].item() == 0.0
    y = lin(torch.ones(2, 64))
    assert torch.isnan(y[:, 3]).all() and torch.isfinite(torch.cat([y[:, :3], y[:, 4:]], 1)).all()


@needs_torchao
@PIN
@pytest.mark.parametrize("kind,shape,scales,codes", [("tensor", (64, 256), 1, 16384), ("token", (64, 256), 64, 16384),
                                                     ("channel", (128, 256), 128, 32768),
                                                     ("group", (32, 512), 128, 16384), ("block", (256, 256), 4, 65536)])
def test_all_zero_input_gets_scale_zero_and_nan_codes_exact(engine, kind, shape, scales, codes):
    g = {"tensor": Granularity.tensor(), "token": Granularity.token(), "channel": Granularity.channel(),
         "group": Granularity.group(128), "block": Granularity.block(128)}[kind]
    q = engine.quantize(torch.zeros(shape), g)
    assert int((q.scale == 0).sum()) == q.scale.numel() == scales
    assert int(np.isnan(decode_codes(q.codes.numpy(), "e4m3fn")).sum()) == q.codes.numel() == codes


@needs_torchao
def test_nonfinite_groups_follow_the_unguarded_division_exact(engine):
    x = _gaussian((4, 256), 6)
    x[0, 0], x[1, 130], x[2, 7] = float("inf"), float("-inf"), float("nan")
    q = engine.quantize(x, Granularity.group(128))
    assert q.scale[0, 0].item() == float("inf") and q.scale[1, 1].item() == float("inf")
    assert np.isnan(q.scale[2, 0].item())
    want = quantize(x, Granularity.group(128), UNGUARDED)
    assert torch.equal(q.codes, want.codes)


@needs_torchao
def test_non_divisible_group_and_block_are_unsupported_with_the_reason(engine):
    from fp8rl.engine import Unsupported

    with pytest.raises(Unsupported, match="PerGroup"):
        engine.quantize(torch.ones(4, 200), Granularity.group(128))
    with pytest.raises(Unsupported, match="PerBlock"):
        engine.quantize(torch.ones(200, 256), Granularity.block(128))


@needs_torchao
@PIN
def test_qat_float8_fake_quantizer_is_the_same_quantizer_dequantized_exact(engine):
    """Float8FakeQuantizer (torchao/quantization/qat/fake_quantizer.py) = dequant(from_hp) in the input dtype."""
    from torchao.quantization.granularity import PerRow, PerTensor
    from torchao.quantization.qat.fake_quantize_config import Float8FakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import Float8FakeQuantizer

    x = _gaussian((32, 256), 7)
    x[4] = 0.0
    for gran, g in ((PerRow(), Granularity.token()), (PerTensor(), Granularity.tensor())):
        fq = Float8FakeQuantizer(Float8FakeQuantizeConfig(granularity=gran))(x)
        q = quantize(x, g, UNGUARDED)
        deq = torch.from_numpy(decode_codes(q.codes.numpy(), "e4m3fn")).float() * q.expanded_scale()
        assert torch.equal(torch.isnan(fq), torch.isnan(deq))
        same = torch.isnan(fq) | (fq == deq)
        assert bool(same.all()), gran
    assert torch.isnan(Float8FakeQuantizer(Float8FakeQuantizeConfig(granularity=PerRow()))(x)[4]).all()


@needs_torchao
@PIN
def test_to_fp8_saturated_flips_positive_bf16_nans_from_32_elements_exact(engine):
    pos_nan = torch.full((64,), 0x7F81, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert set(engine.cast(pos_nan[:16], "e4m3fn").tolist()) == {0x7F}  # scalar tail: sign kept
    assert set(engine.cast(pos_nan, "e4m3fn").tolist()) == {0xFF}  # vectorized clamp: sign flipped
    assert set(engine.cast(pos_nan, "e5m2").tolist()) == {0xFF}
    assert set(pos_nan.to(torch.float8_e4m3fn).view(torch.uint8).tolist()) == {0x7F}  # torch's cast alone: kept
    assert set(engine.cast(pos_nan.float(), "e4m3fn").tolist()) == {0x7F}  # fp32 input: kept


@needs_torchao
def test_blockwise_prototypes_need_triton():
    from torchao.prototype.blockwise_fp8_inference import fp8_blockwise_weight_quant

    with pytest.raises(AssertionError, match="without triton"):
        fp8_blockwise_weight_quant(torch.ones(128, 128))
    with pytest.raises(ImportError):
        import torchao.prototype.blockwise_fp8_training.kernels  # noqa: F401


# ---- the checkpoint writer ----------------------------------------------------------------------------------------

@needs_torchao
def test_checkpoint_codes_and_scales_are_torchaos_on_a_ragged_weight_exact(engine, tmp_path):
    from fp8rl.reference import checkpoint as ck

    w = _gaussian((200, 300), 8).to(torch.bfloat16)
    w[:128, 128:256] = 0  # an all-zero 128x128 block
    sd = {"model.layers.0.self_attn.q_proj.weight": w}
    _, t = ck.read_checkpoint(engine.checkpoint_write(tmp_path / "c", {"model_type": "qwen3"}, sd))
    codes = t["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8)
    s = t["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert s.shape == (2, 3) and s.dtype == torch.float32
    w32 = w.float()
    for i in range(2):
        for j in range(3):
            blk = w32[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            # amax/448 of the real elements, no floor, rounded once to bf16 (the BF16 weight's own dtype)
            want_s = (blk.abs().amax() / 448.0).to(torch.bfloat16).float().reshape(1)
            assert torch.equal(s[i, j].reshape(1), want_s), (i, j)
            cb = codes[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            if want_s.item() == 0.0:
                assert np.isnan(decode_codes(cb.numpy(), "e4m3fn")).all()  # the finding, in the file
            else:  # the quotient in fp32 (UNGUARDED: compute_dtype fp32, x passed as fp32)
                want = quantize_with_scale(blk, want_s, Granularity.tensor(), UNGUARDED)
                assert torch.equal(cb, want.reshape(cb.shape)), (i, j)
    assert s[0, 1].item() == 0.0


# The conformance run itself (areas quantization, formats, checkpoint: every failure an error of the tier, every
# finding an xfail of conformance/vendors/torchao.xfails) is the checkpoint tier's job (noxfile.py TIERS), not a test
# here: it would run the same three areas a second time in CI.
