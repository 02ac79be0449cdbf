"""Peer, hand-computed and property tests of the microscaling oracle (fp8rl.reference.microscaling).

Peers: ml_dtypes' ``float4_e2m1fn`` and ``float8_e8m0fnu`` casts, torch's ``float8_e8m0fnu`` cast and
``float4_e2m1fn_x2`` dtype, Python's exact float64 ``math.frexp``. Names say the comparison (``*_exact``, ``*_bound``).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.reference import microscaling as M
from fp8rl.reference.formats import decode_codes

RECIPES = list(M.RECIPES)


def _fp32_sample(n: int, seed: int = 0) -> np.ndarray:
    """n random fp32 bit patterns (finite), plus the E2M1 grid, its midpoints and their fp32 neighbours."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 1e30, 1e-40],
                    dtype=np.float32)
    grid = np.concatenate([grid, np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(-np.inf))])
    x = np.concatenate([x[np.isfinite(x)], grid, -grid]).astype(np.float32)
    return x


def test_e2m1_encode_vs_ml_dtypes_exact():
    x = _fp32_sample(400_000)
    ours = M.encode_e2m1(x)
    peer = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    bad = np.flatnonzero(ours != peer)
    assert bad.size == 0, f"{bad.size} of {x.size} differ, e.g. x={x[bad[:4]]} ours={ours[bad[:4]]} ml={peer[bad[:4]]}"


def test_e2m1_decode_vs_ml_dtypes_exact():
    codes = np.arange(16, dtype=np.uint8)
    peer = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(M.decode_e2m1(codes), peer)


def test_e2m1_ties_and_saturation_hand_exact():
    # hand-computed: ties go to the even mantissa (code with m = 0); beyond 6 saturates; tiny negatives keep −0
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 7.0, 1e30, -0.2, -0.0], dtype=np.float32)
    want = [0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8, 8]
    assert M.encode_e2m1(x).tolist() == want


def test_e2m1_nan_raises():
    with pytest.raises(ValueError, match="x: E2M1 has no NaN"):
        M.encode_e2m1(np.array([np.nan], dtype=np.float32))


def test_fp4_packing_low_nibble_first_exact():
    # element 0 = 1.0 (code 2) in the low nibble, element 1 = −6.0 (code 15) in the high nibble; odd K pads a zero
    codes = torch.tensor([[2, 15, 7]], dtype=torch.uint8)
    packed = M.pack_fp4(codes)
    assert packed.tolist() == [[0xF2, 0x07]]
    assert torch.equal(M.unpack_fp4(packed, 3), codes)
    # the bytes are a valid torch float4_e2m1fn_x2 tensor (two elements per byte) of the right size
    assert packed.view(torch.float4_e2m1fn_x2).numel() * 2 >= codes.shape[-1]


def test_unpack_rejects_wrong_width():
    with pytest.raises(ValueError, match="k: packed has 2 bytes per row"):
        M.unpack_fp4(torch.zeros(1, 2, dtype=torch.uint8), 7)


@pytest.mark.parametrize("elem,emax", [("e4m3fn", 8), ("e5m2", 15), ("e2m1", 2)])
def test_floor_exponent_vs_frexp_exact(elem, emax):
    """OCP floor rule: e = floor(log2 amax) − emax, with floor(log2 a) = frexp(a)[1] − 1 in exact float64."""
    x = _fp32_sample(50_000, seed=1)
    a = np.abs(x[(x != 0) & (np.abs(x) < 3e38)]).astype(np.float32)
    p = M.MXPolicy("t", elem, 32, exp_rounding="floor")
    got = M.e8m0_exponent(torch.from_numpy(a), p).numpy()
    want = np.clip(np.array([math.frexp(float(v))[1] - 1 for v in a]) - emax, -127, 127)
    np.testing.assert_array_equal(got, want)


def test_e8m0_scale_codes_vs_ml_dtypes_and_torch_exact():
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)) * torch.logspace(
        -30, 30, 8).reshape(8, 1).float()
    for name in ("ocp_mxfp8_e4m3", "te_mxfp8", "vllm_mxfp8_torch", "ocp_mxfp4"):
        q = M.mx_quantize(x, name)
        powers = torch.from_numpy(decode_codes(q.scales.numpy(), "e8m0fnu")).float()
        ml = powers.numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
        th = powers.to(torch.float8_e8m0fnu).view(torch.uint8)
        assert np.array_equal(q.scales.numpy(), ml), name
        assert torch.equal(q.scales, th), name


def test_exponent_rules_hand_exact():
    # amax = 448: floor → 2^0, ceil → 2^0; 449: floor → 2^0 (449 saturates to 448), ceil → 2^1; 512: both 2^1
    a = torch.tensor([448.0, 449.0, 512.0, 0.0])
    floor = M.e8m0_exponent(a, M.MX_PRESETS["ocp_mxfp8_e4m3"]).tolist()
    ceil = M.e8m0_exponent(a, M.MXPolicy("c", "e4m3fn", 32, exp_rounding="ceil")).tolist()
    assert floor == [0, 0, 1, -127]
    assert ceil == [0, 1, 1, -127]
    # ceil_log2 (vLLM torch): r = 2^8·(1 + 2^-23) → fl(log2 r) = 8 (ulp(8) = 2^-20 > log2(1+2^-23)) → 2^8, not 2^9
    r = np.float32(2.0**8) * np.float32(1 + 2.0**-23)
    amax = torch.tensor([float(np.float32(r) * np.float32(448.0))])
    assert float(amax[0] / 448.0) > 256.0  # the ratio is above the power of two
    assert M.e8m0_exponent(amax, M.MX_PRESETS["vllm_mxfp8_torch"]).tolist() == [8]
    assert M.e8m0_exponent(amax, M.MXPolicy("c", "e4m3fn", 32, exp_rounding="ceil")).tolist() == [9]


def test_te_mul_recip_at_448_exact():
    """te_mxfp8 forms fl(amax · fl(1/448)): computed here independently in numpy fp32."""
    recip = np.float32(1.0) / np.float32(448.0)
    amax = np.float32(448.0) * np.float32(2.0**-5)
    r = np.float32(amax * recip)
    want = math.frexp(float(r))[1] - 1 + (0 if float(r) == 2.0 ** (math.frexp(float(r))[1] - 1) else 1)
    got = M.e8m0_exponent(torch.tensor([float(amax)]), M.MX_PRESETS["te_mxfp8"]).tolist()
    assert got == [want]


def test_nvfp4_hand_exact():
    # tensor amax 6 → g = 2688/6 = 448; a block with amax 6 gets s = e4m3(448·6/6) = 448 and y = x/(448/448) = x
    x = torch.tensor([[6.0, -3.0, 0.5, 1.25] + [0.0] * 12 + [1.0] * 16])
    q = M.mx_quantize(x, "nvfp4")
    assert float(q.global_scale) == 448.0
    s = decode_codes(q.scales.numpy(), "e4m3fn")
    assert s.tolist()[0] == [448.0, float(decode_codes(M_e4m3(448.0 / 6.0), "e4m3fn")[0])]
    assert q.codes()[0, :4].tolist() == [7, 13, 1, 2]


def M_e4m3(v: float) -> np.ndarray:
    from fp8rl.reference.formats import encode_codes

    return encode_codes(np.array([v], dtype=np.float32), "e4m3fn")


def test_nvfp4_zero_tensor_exact():
    q = M.mx_quantize(torch.zeros(2, 32), "nvfp4")
    assert float(q.global_scale) == 1.0
    assert int(q.scales.abs().sum()) == 0 and int(q.data.sum()) == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_roundtrip_bound(recipe):
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((16, 200)).astype(np.float32)) * 5
    q = M.mx_quantize(x, recipe)
    err = (M.dequantize_mx(q) - x.double()).abs()
    bound = tolerances.mx_roundtrip_bound(q, x)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8_e4m3", "mxfp4"])
def test_gemm_fp32_dequant_matmul_bound(recipe):
    rng = np.random.default_rng(4)
    a = M.mx_quantize(torch.from_numpy(rng.standard_normal((8, 96)).astype(np.float32)), recipe)
    w = M.mx_quantize(torch.from_numpy(rng.standard_normal((12, 96)).astype(np.float32)), recipe)
    exact = M.mx_gemm_exact(a, w)
    # an fp32 dequantize-then-matmul implementation: S = fl(s · fl(1/g)), ã = fl(q·S), then an fp32 matmul
    impl = (M.dequantize_mx(a).float() @ M.dequantize_mx(w).float().T).double()
    bound = M.mx_gemm_error_bound(a, w, torch.float32)
    assert bool(((impl - exact).abs() <= bound).all())


def test_bad_input_errors():
    with pytest.raises(ValueError, match="x: microscaling quantizers are modelled for finite inputs"):
        M.mx_quantize(torch.tensor([1.0, float("inf")]), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="policy: unknown microscaling preset"):
        M.get_mx_policy("mxfp6")
    with pytest.raises(ValueError, match="scale_fmt: E4M3 block scales"):
        M.MXPolicy("x", "e4m3fn", 16, scale_fmt="e4m3fn")


def test_pow2_175_rule_hand_exact():
    # significand ≥ 1.75 rounds amax up a binade: 448 = 1.75·2^8 → 2^9 → e = 1; 447 (1.746·2^8) → e = 0; 256 → 0
    p = M.MX_PRESETS["ct_mxfp8"]
    assert M.e8m0_exponent(torch.tensor([448.0, 447.0, 256.0, 0.0]), p).tolist() == [1, 0, 0, -127]
    # e2m1 (T = 6 = 1.5·2^2): amax 6.5 keeps e = 0 and saturates to 6; amax 7 (1.75·2^2) → e = 1
    q = M.mx_quantize(torch.tensor([[6.5] + [0.0] * 31, [7.0] + [0.0] * 31]), M.MX_PRESETS["ct_mxfp4"])
    assert q.scales.flatten().tolist() == [127, 128]
    assert q.codes()[:, 0].tolist() == [7, 6]  # 6.5 → 6 (saturated), 7/2 = 3.5 → 4 (tie to even)


def test_nvfp4_zero_scale_block_keeps_signed_zeros_exact():
    # the second 16-block is 1e-9 of the first: g·amax_b/6 < 2^-10 → scale code 0, elements ±0 with x's sign
    x = torch.tensor([[6.0] * 16 + [1e-9, -1e-9] * 8])
    q = M.mx_quantize(x, "nvfp4")
    assert q.scales.tolist() == [[0x7E, 0x00]]  # 448 = e4m3 0x7E
    assert q.codes()[0, 16:].tolist() == [0, 8] * 8


def test_nvfp4_global_op_hand_exact():
    # amax = 912.84283 (fp32): fl(2688/amax) = 2.944647 but fl(fl(1/amax)·2688) = 2.9446468 — one fp32 ulp apart
    # (numpy fp32, computed here independently); 27.9 % of uniform amaxes in [1, 1000) differ so
    amax = np.float32(912.84283)
    div = np.float32(2688) / amax
    rm = (np.float32(1) / amax) * np.float32(2688)
    assert div != rm
    x = torch.tensor([[float(amax)] + [0.0] * 15])
    assert float(M.nvfp4_global_scale(x, "div")) == float(div)
    assert float(M.nvfp4_global_scale(x, "recip_mul")) == float(rm)
    assert float(M.mx_quantize(x, "ct_nvfp4").global_scale) == float(rm)
