"""The zero-scale rule ``zero_amax="scale_dtype_eps"`` (compressed-tensors' ``calculate_qparams`` step 5: a scale
that is exactly 0 becomes ``torch.finfo(scale dtype).eps``) and the preset ``compressed_tensors_fp8``, on
hand-computed cases: every expected value below is a literal worked out by hand (powers of two, 8-bit bf16
significands), never taken from the oracle."""

from __future__ import annotations

import math

import pytest
import torch
from fp8rl.reference.policy import ZERO_AMAX_MODES, ScalePolicy
from fp8rl.reference.presets import PRESETS, formula
from fp8rl.reference.quant import Granularity, quantize, scale_from_amax, zero_scale_to_dtype_eps

CT = "compressed_tensors_fp8"
T = Granularity.token()


def test_mode_is_declared_and_preset_fields_exact():
    assert "scale_dtype_eps" in ZERO_AMAX_MODES
    p = PRESETS[CT]
    assert (p.fmt, p.max_value, p.floor, p.zero_amax, p.scale_op, p.quant_op, p.clamp, p.compute_dtype) == \
        ("e4m3fn", 448.0, "none", "scale_dtype_eps", "div", "div", True, "input")
    assert formula(CT) == "s = amax/448; s = 0 → finfo(D).eps; q = clamp(x/s); in the input dtype"


def test_zero_scale_to_dtype_eps_replaces_only_exact_zeros_exact():
    s = torch.tensor([0.0, -0.0, 1.0, 2.0 ** -140, math.nan, math.inf])
    for dtype, eps in ((torch.bfloat16, 2.0 ** -7), (torch.float16, 2.0 ** -10), (torch.float32, 2.0 ** -23),
                       (None, 2.0 ** -23)):
        out = zero_scale_to_dtype_eps(s, dtype)
        assert out.dtype == torch.float32
        assert out[:4].tolist() == [eps, eps, 1.0, 2.0 ** -140], dtype
        assert math.isnan(out[4].item()) and out[5].item() == math.inf, dtype


@pytest.mark.parametrize("dtype,eps", [(torch.bfloat16, 2.0 ** -7), (torch.float16, 2.0 ** -10),
                                       (torch.float32, 2.0 ** -23)])
def test_all_zero_group_gets_the_input_dtype_eps_exact(dtype, eps):
    x = torch.zeros(2, 4, dtype=dtype)
    q = quantize(x, T, CT)
    assert q.scale.tolist() == [[eps], [eps]]
    assert q.codes.tolist() == [[0] * 4] * 2


def test_underflowing_quotient_is_replaced_in_bf16_but_not_in_fp32_exact():
    # amax = 2^-133, bf16's smallest subnormal: 2^-133/448 ≈ 2^-141.8 is below half of it, so the bf16 scale is 0
    # and becomes 2^-7; in fp32 it is a subnormal (≥ 2^-149) and stays. 2^-133/448 = 2^-140 · (1/3.5) = 2^-140 ·
    # 0.2857…, which fp32 stores with 149 - 140 = 9 fraction bits below 2^-140: round(0.2857… · 2^9) = 146 → 146·2^-149
    tiny = 2.0 ** -133
    s_bf = scale_from_amax(torch.tensor([0.0, tiny, 448.0]), CT, input_dtype=torch.bfloat16)
    assert s_bf.tolist() == [2.0 ** -7, 2.0 ** -7, 1.0]
    s_32 = scale_from_amax(torch.tensor([0.0, tiny, 448.0]), CT, input_dtype=torch.float32)
    assert s_32.tolist() == [2.0 ** -23, 146 * 2.0 ** -149, 1.0]
    # codes: 2^-133 / 2^-7 = 2^-126, far below e4m3's smallest subnormal 2^-9: +0
    q = quantize(torch.tensor([[tiny, 0.0]], dtype=torch.bfloat16), T, CT)
    assert q.scale.tolist() == [[2.0 ** -7]] and q.codes.tolist() == [[0x00, 0x00]]


def test_bf16_scale_and_quotient_arithmetic_exact():
    # 3/448 = 1.7142857·2^-8; bf16 keeps 7 fraction bits: round(1.7142857·128) = 219 → s = 219·2^-15
    s = 219 * 2.0 ** -15
    x = torch.tensor([[3.0, 1.0, -0.8125, 0.0]], dtype=torch.bfloat16)
    q = quantize(x, T, CT)
    assert q.scale.tolist() == [[s]]
    # 3/s = 448.58… → bf16 448 (bf16 step at 448 is 2) → clamp 448 → e4m3 448 (0x7E)
    # 1/s = 149.53… → bf16 150 (step 1 in [128, 256)) → e4m3 (step 16 in [128, 256)): 144
    # -0.8125/s = -121.49… → bf16 -121.5 (step 0.5 in [64, 128)) → e4m3 step 8 in [64, 128): -120
    assert q.values().tolist() == [[448.0, 144.0, -120.0, 0.0]]
    # e4m3 bits: 448 = 1.75·2^8 → 0 1111 110; 144 = 1.125·2^7 → 0 1110 001; -120 = -1.875·2^6 → 1 1101 111
    assert q.codes.tolist() == [[0x7E, 0x71, 0xEF, 0x00]]
    # the same values in fp32: s = fl32(3/448) (not bf16), 1/s = 149.33… → e4m3 144, -0.8125/s = -121.33… → -120
    q32 = quantize(x.float(), T, CT)
    assert q32.scale.item() == torch.tensor(3.0 / 448.0, dtype=torch.float32).item() != s
    assert q32.values().tolist() == [[448.0, 144.0, -120.0, 0.0]]


def test_nan_and_inf_amax_are_not_replaced_exact():
    s = scale_from_amax(torch.tensor([math.nan, math.inf]), CT, input_dtype=torch.bfloat16)
    assert math.isnan(s[0].item()) and s[1].item() == math.inf


@pytest.mark.parametrize("kw,match", [
    (dict(floor="amax", eps=1e-10), r"'scale_dtype_eps' replaces a scale that is exactly 0, so it needs floor='none'"),
    (dict(floor="scale", eps=1e-10), r"floor='none'"),
    (dict(floor="none", eps=0.0, scale_op="recip_multiplier", quant_op="mul_max_over_amax"), r"quant_op"),
])
def test_scale_dtype_eps_validation_exact(kw, match):
    with pytest.raises(ValueError, match=match):
        ScalePolicy("p", zero_amax="scale_dtype_eps", **kw)


def test_mul_recip_quant_op_uses_the_replaced_scale_exact():
    # with q = x·fl(1/s) the replaced scale 2^-23 (fp32) gives the multiplier 2^23: an all-zero row stays 0, and a
    # row [0, 2^-30] has amax 2^-30 → s = 2^-30/448 (nonzero, kept)
    p = ScalePolicy("p", floor="none", eps=0.0, zero_amax="scale_dtype_eps", quant_op="mul_recip")
    q = quantize(torch.tensor([[0.0, 0.0], [0.0, 2.0 ** -30]]), T, p)
    assert q.scale[0].tolist() == [2.0 ** -23]
    assert q.scale[1].item() == torch.tensor(2.0 ** -30 / 448.0, dtype=torch.float32).item()
    assert q.codes[0].tolist() == [0, 0] and q.values()[1].tolist() == [0.0, 448.0]
