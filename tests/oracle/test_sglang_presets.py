"""The SGLang presets of fp8rl.reference.quant (PRESETS), on hand-computed cases — oracle only, no sglang import.

Each preset names one SGLang code path (see its description and fp8rl.engines.sglang); the engine's conformance
run and tests/engines/triton/test_sglang_engine.py check SGLang against them. Here: the fields, and small inputs whose scales and
codes were worked out by hand (fp32 bit patterns given in hex).
"""

from __future__ import annotations

import pytest
import torch
from fp8rl.reference.presets import PRESETS, get_policy
from fp8rl.reference.quant import Granularity, quantize, quantize_with_scale

SGLANG_PRESETS = {
    # name: (floor, eps, pow2, scale_op, quant_op, clamp)
    "sglang_group": ("amax", 1e-10, "none", "mul_recip_max", "mul_max_over_amax", True),
    "sglang_triton_group": ("amax", 1e-10, "none", "div", "mul_recip", True),
    "sglang_triton_group_colmajor": ("amax", 1e-10, "none", "div", "div", True),
    "sglang_triton_group_ue8m0": ("amax", 1e-10, "ceil_log2", "div", "div", True),
    "sglang_static": ("amax", 1e-10, "none", "div", "mul_recip", True),
    "sglang_mla_tensor": ("amax", 1e-12, "none", "div", "mul_recip", True),
    "sglang_native": ("amax", 1e-12, "none", "div", "div", True),
    "sglang_fp8_quantize": ("amax", 1e-10, "none", "div", "mul_recip", False),
}
G4 = Granularity.group(4)


def _bits(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.contiguous().view(torch.int32).flatten().tolist()]


@pytest.mark.parametrize("name", sorted(SGLANG_PRESETS))
def test_sglang_preset_fields_exact(name):
    p = get_policy(name)
    assert (p.floor, p.eps, p.pow2, p.scale_op, p.quant_op, p.clamp) == SGLANG_PRESETS[name]
    assert p.fmt == "e4m3fn" and p.max_value == 448.0 and p.overflow == "saturate" and p.zero_amax == "floor"
    assert "SGLang" in p.description and PRESETS[name] is p


def test_row_major_multiplies_by_the_reciprocal_exact():
    # amax = 7·448 → s = 7 exactly. x = 10.9375: x/7 = 1.5625 is the tie between 1.5 (0x3c, even) and 1.625 (0x3d);
    # x/s rounds to even (0x3c), x·fl32(1/7) = x·0.14285714924… = 1.56250007 lies above the tie → 0x3d.
    x = torch.tensor([[3136.0, 10.9375, 0.0, 0.0]])
    row = quantize(x, G4, "sglang_triton_group")
    col = quantize(x, G4, "sglang_triton_group_colmajor")
    assert row.scale.tolist() == col.scale.tolist() == [[7.0]]
    assert row.codes.tolist() == [[0x7E, 0x3D, 0, 0]]
    assert col.codes.tolist() == [[0x7E, 0x3C, 0, 0]]


def test_zero_group_scales_by_eps_and_scale_op_exact():
    z = torch.zeros(1, 4)
    # Triton kernels: fl32(fl32(1e-10)/448) = 0x2a7b5123; the CUDA JIT multiplies by fl32(1/448): 0x2a7b5124
    assert _bits(quantize(z, G4, "sglang_triton_group").scale) == [0x2A7B5123]
    assert _bits(quantize(z, G4, "sglang_triton_group_colmajor").scale) == [0x2A7B5123]
    assert _bits(quantize(z, G4, "sglang_group").scale) == [0x2A7B5124]
    # MLA per-tensor and the ROCm torch fallbacks floor at 1e-12: fl32(fl32(1e-12)/448) = 0x2720d7c5
    for name in ("sglang_mla_tensor", "sglang_native"):
        q = quantize(z, Granularity.tensor(), name)
        assert _bits(q.scale) == [0x2720D7C5] and q.codes.tolist() == [[0, 0, 0, 0]]
    # UE8M0: 2^ceil(log2(2.23e-13)) = 2^-42 = 0x2a800000
    assert _bits(quantize(z, G4, "sglang_triton_group_ue8m0").scale) == [0x2A800000]


def test_ue8m0_rounds_the_scale_up_to_a_power_of_two_exact():
    x = torch.tensor([[672.0, 3.0, -1.0, 0.0]])  # amax/448 = 1.5
    col = quantize(x, G4, "sglang_triton_group_colmajor")
    assert col.scale.tolist() == [[1.5]] and col.values().tolist() == [[448.0, 2.0, -0.6875, 0.0]]
    ue = quantize(x, G4, "sglang_triton_group_ue8m0")
    # s = 2: 672/2 = 336 is the tie between 320 (0x7a, even) and 352 → 320; 3/2 = 1.5 (0x3c); -1/2 = -0.5 (0xb0)
    assert ue.scale.tolist() == [[2.0]]
    assert ue.values().tolist() == [[320.0, 1.5, -0.5, 0.0]]
    assert ue.codes.tolist() == [[0x7A, 0x3C, 0xB0, 0]]


def test_static_and_fp8_quantize_saturate_and_keep_nan_exact():
    x = torch.tensor([[1000.0, float("nan"), float("inf"), 3.0]])
    one = torch.ones(1)
    for name in ("sglang_static", "sglang_fp8_quantize"):  # clamp resp. satfinite: both end at ±448, NaN stays NaN
        assert quantize_with_scale(x, one, Granularity.tensor(), name).tolist() == [[0x7E, 0x7F, 0x7E, 0x44]]
    # static scale 7: x = 10.9375, x/7 = 1.5625 is a tie (→ even 0x3c); x·fl32(1/7) lies above it (→ 0x3d)
    y = torch.tensor([[10.9375]])
    seven = torch.tensor([7.0])
    assert quantize_with_scale(y, seven, Granularity.tensor(), "sglang_static").tolist() == [[0x3D]]
    assert quantize_with_scale(y, seven, Granularity.tensor(), "sglang_native").tolist() == [[0x3C]]


def test_mla_tensor_takes_the_max_over_rows_exact():
    # per row max(amax,1e-12)/448, atomic max over rows = the tensor amax / 448 (division is monotone)
    x = torch.tensor([[896.0, -1.0], [0.0, 0.0], [-1344.0, 2.0]])
    q = quantize(x, Granularity.tensor(), "sglang_mla_tensor")
    assert q.scale.tolist() == [3.0]
    assert q.values().tolist()[2][0] == -448.0 and q.values().tolist()[1] == [0.0, 0.0]
