"""The presets that distinguish one upstream version or code path from another, on hand-computed cases (expected
values from numpy/ml_dtypes fp32/bf16 arithmetic, never from the oracle), plus the provenance and verification
records every preset carries. The presets themselves are verified against the upstream code by the peers tests
(tests/engines/<tier>/test_peers_*.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from fp8rl.reference.presets import PRESETS, PROVENANCE, VERIFICATION, formula, get_policy, preset_record
from fp8rl.reference.quant import Granularity, quantize, scale_from_amax

f32 = np.float32
ROOT = Path(__file__).resolve().parents[2]
G4 = Granularity.group(4)
T = Granularity.token()


def _bits(t: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFFFFFF for v in t.contiguous().view(torch.int32).flatten().tolist()]


def _f32bits(v) -> int:
    return int(np.array([v], dtype=f32).view(np.uint32)[0])


def test_every_preset_has_provenance_and_verification_exact():
    assert set(PROVENANCE) == set(PRESETS) == set(VERIFICATION)
    for name in PRESETS:
        src, ver = PROVENANCE[name], VERIFICATION[name]
        assert src.repo and src.file and src.function and src.version and src.date, name
        assert ver.status.startswith(("verified against ", "not verifiable on CPU: ")), name
        if ver.verified:
            test_file = ver.test.split()[0]
            assert (ROOT / test_file).is_file(), f"{name}: {test_file} does not exist"
        rec = preset_record(name)
        assert rec["formula"] == formula(name) and rec["verification"]["status"] == ver.status


def test_deepseek_ref_renamed_with_dated_successors_exact():
    with pytest.raises(ValueError, match=r"preset 'deepseek_ref' was renamed; use deepseek_ref_2024_12"):
        get_policy("deepseek_ref")
    assert PROVENANCE["deepseek_ref_2025_08"].version == "adecc0e"
    assert PROVENANCE["deepseek_ref_2025_08"].date == "2025-08-27"


def test_deepseek_zero_group_old_nan_new_floor_exact():
    z = torch.zeros(1, 4)
    old = quantize(z, G4, "deepseek_ref_2024_12")
    assert old.scale.tolist() == [[0.0]] and all(c in (0x7F, 0xFF) for c in old.codes.flatten().tolist())
    new = quantize(z, G4, "deepseek_ref_2025_08")
    assert _bits(new.scale) == [_f32bits(f32(1e-4) / f32(448))] and new.codes.tolist() == [[0, 0, 0, 0]]
    ue = quantize(z, G4, "deepseek_ref_2025_08_ue8m0")  # 1e-4/448 = 2^-22.09 → 2^-22
    assert ue.scale.tolist() == [[2.0 ** -22]]


def test_deepgemm_ue8m0_inf_and_nan_amax_give_2_pow_127_exact():
    x = torch.tensor([[math.inf, 1.0, -1.0, 0.0], [math.nan, 2.0, -1.0, 0.0]])
    q = quantize(x, G4, "deepgemm_ue8m0")
    assert q.scale.tolist() == [[2.0 ** 127], [2.0 ** 127]]
    # inf·2^-127 = inf, no clamp, the cast saturates: 448 (0x7e); ±1·2^-127 rounds to ±0; NaN stays NaN
    assert q.codes[0].tolist() == [0x7E, 0x00, 0x80, 0x00]
    assert q.codes[1, 0].item() in (0x7F, 0xFF) and q.codes[1, 1:].tolist() == [0x00, 0x80, 0x00]
    # vLLM's copy rounds with log2: the inf/NaN scale stays inf/NaN
    v = quantize(x, G4, "vllm_deepgemm_ue8m0")
    assert math.isinf(v.scale[0, 0].item()) and math.isnan(v.scale[1, 0].item())


def test_vllm_native_group_ue8m0_floor_order_0_32_vs_0_33_exact():
    z = torch.zeros(1, 4)
    old = quantize(z, G4, "vllm_native_group_ue8m0_0_32")  # pow2(0) = 0, then the floor 1/(448·512)
    assert _bits(old.scale) == [_f32bits(f32(1.0) / f32(448.0 * 512.0))]
    new = quantize(z, G4, "vllm_native_group_ue8m0_0_33")  # floor 1/229376 = 2^-17.8, then pow2: 2^-17
    assert new.scale.tolist() == [[2.0 ** -17]]
    # above the floor both orders agree: amax 448·3 → s = 3 → 4
    x = torch.tensor([[1344.0, 1.0, 0.0, 0.0]])
    assert quantize(x, G4, "vllm_native_group_ue8m0_0_32").scale.tolist() == [[4.0]]
    assert quantize(x, G4, "vllm_native_group_ue8m0_0_33").scale.tolist() == [[4.0]]


def test_reciprocal_then_multiply_rounds_twice_exact():
    # torch's 448.0 / t is t.reciprocal() * 448: find amaxes where that differs from one division
    amaxes = [f32(v) for v in (3.0, 7.0, 11.0, 13.0, 0.3, 5.1, 9.7, 123.4)]
    two = [f32(f32(1.0) / a) * f32(448.0) for a in amaxes]
    one = [f32(448.0) / a for a in amaxes]
    differ = [i for i in range(len(amaxes)) if two[i] != one[i]]
    assert differ, "no amax in the list tells the two roundings apart"
    a = torch.tensor([[float(v)] for v in amaxes])
    s = scale_from_amax(a, "vllm_scaled_quantize").flatten()
    assert _bits(s) == [_f32bits(f32(1.0) / m) for m in two]
    s_ao = scale_from_amax(a, "torchao").flatten()
    assert _bits(s_ao) == [_f32bits(f32(1.0) / m) for m in one]


def test_input_dtype_arithmetic_for_bf16_inputs_exact():
    bf = ml_dtypes.bfloat16
    x = torch.tensor([[3.0, 1.0, -0.8125, 0.0]]).to(torch.bfloat16)
    # SGLang's native fallback in bf16: s = bf16(3/448), q = bf16(x/s), clamp, cast
    s = bf(f32(3.0) / f32(448.0))
    q = quantize(x, T, "sglang_native")
    assert q.scale.tolist() == [[float(s)]]
    # the quotient is rounded to bf16 first, then to e4m3 (150 → 144, -121.5 → -120)
    quot = [bf(f32(v) / f32(s)) for v in (3.0, 1.0, -0.8125, 0.0)]
    assert q.values().tolist() == [[float(ml_dtypes.float8_e4m3fn(min(448.0, max(-448.0, float(e))))) for e in quot]]
    # the same policy on fp32 input is plain fp32 arithmetic
    q32 = quantize(x.float(), T, "sglang_native")
    assert _bits(q32.scale) == [_f32bits(f32(3.0) / f32(448.0))]
    # vLLM scaled_quantize in bf16: m = bf16(bf16(1/3)·448), s = fl32(1/m)
    m = bf(f32(bf(f32(1.0) / f32(3.0))) * f32(448.0))
    qv = quantize(x, T, "vllm_scaled_quantize")
    assert _bits(qv.scale) == [_f32bits(f32(1.0) / f32(m))]


def test_te_multiplier_overflow_uses_the_input_dtype_max_exact():
    tiny = torch.tensor([[1e-38]])
    te = PRESETS["te_blockwise_pow2"]
    assert te.multiplier_overflow == "input_max"
    # with pow2 both FLT_MAX and bf16's max finite round down to 2^127: invisible
    for dt in (torch.float32, torch.bfloat16):
        assert scale_from_amax(tiny, te, input_dtype=dt).tolist() == [[2.0 ** -127]]
    plain = replace(te, name="te-no-pow2", pow2="none")
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    assert _bits(scale_from_amax(tiny, plain, input_dtype=torch.bfloat16)) == [_f32bits(f32(1.0) / f32(bf16_max))]
    flt_max = float(np.finfo(f32).max)
    assert _bits(scale_from_amax(tiny, plain, input_dtype=torch.float32)) == [_f32bits(f32(1.0) / f32(flt_max))]


def test_verl_torch_nan_and_overflowing_multiplier_exact():
    a = torch.tensor([[0.0], [math.inf], [math.nan], [1e-40], [448.0]])
    s = scale_from_amax(a, "verl_torch").flatten().tolist()
    assert s[0] == 1.0 and s[1] == 1.0 and math.isnan(s[2]) and s[3] == 0.0 and s[4] == 1.0


def test_hf_finegrained_zero_nan_inf_amax_exact():
    a = torch.tensor([[0.0], [math.nan], [math.inf], [448.0]])
    s = scale_from_amax(a, "hf_finegrained_fp8").flatten().tolist()
    assert s[0] == 1.0 and s[1] == 1.0 and math.isinf(s[2]) and s[3] == 1.0
