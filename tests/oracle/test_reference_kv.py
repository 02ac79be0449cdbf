"""Tests of the FP8 KV-cache oracle (``fp8rl.reference.kv``): store/load, attention, calibration, bounds.

Independent references used here: hand-computed values, numpy float32 arithmetic (for the fp32 emulation),
torch's own fp8 casts after an explicit clamp (torch ≥ 2.12 RNE), and torch's fp64 scaled_dot_product_attention.
Names say the comparison: *_exact (bit-exact), *_bound (a tolerance-table bound), *_stat (a statistical claim).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.reference import kv
from fp8rl.reference.formats import decode_codes, get_format
from hypothesis import given, settings
from hypothesis import strategies as st

FMTS = ("e4m3fn", "e5m2")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _qk_normed(g: torch.Generator, shape, gain: float = 1.0, outlier: float = 1.0) -> torch.Tensor:
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    x[..., :2] *= outlier
    return (x * gain).float()


# ----------------------------------------------------------------------------------------------------------------
# store / load


def test_store_hand_values_exact():
    x = torch.tensor([1.0, 1.0625, 1.1875, 470.0, -1e6, float("nan"), float("inf"), 0.0, -0.0, 2.0**-9, 2.0**-11]
                     ).reshape(1, 1, -1)
    cache = kv.quantize_kv(x, torch.tensor(1.0), kv.default_policy("e4m3fn"))
    # 1.0 → 0x38; 1.0625 ties to even 1.0; 1.1875 ties to even 1.25 (0x3A); 470 and 1e6 saturate to ±448 (0x7E/0xFE);
    # NaN → 0x7F; +inf → 448; ±0; 2^-9 is the smallest subnormal (0x01); 2^-11 rounds to 0
    assert cache.codes.flatten().tolist() == [0x38, 0x38, 0x3A, 0x7E, 0xFE, 0x7F, 0x7E, 0x00, 0x80, 0x01, 0x00]
    cache5 = kv.quantize_kv(torch.tensor([60000.0, -1e9, 1.25]).reshape(1, 1, 3), torch.tensor(1.0),
                            kv.default_policy("e5m2"))
    assert cache5.codes.flatten().tolist() == [0x7B, 0xFB, 0x3D]  # ±57344 (saturate), 1.25


def test_store_uses_scale_exact():
    x = torch.tensor([3.0, -7.5, 100.0]).reshape(1, 1, 3)
    cache = kv.quantize_kv(x, torch.tensor(0.5), kv.default_policy("e4m3fn"))
    assert decode_codes(cache.codes, "e4m3fn").flatten().tolist() == [6.0, -15.0, 192.0]
    assert kv.dequantize_kv(cache).flatten().tolist() == [3.0, -7.5, 96.0]


@pytest.mark.parametrize("op", kv.QUANT_OPS)
def test_fp32_scaled_matches_numpy_fp32_exact(op):
    r = np.random.default_rng(0)
    x = (r.standard_normal(20000) * np.exp2(r.integers(-30, 30, 20000))).astype(np.float32)
    s = (r.random(20000) * np.exp2(r.integers(-20, 20, 20000)) + 1e-30).astype(np.float32)
    with np.errstate(over="ignore"):
        expected = x / s if op == "div" else x * (np.float32(1.0) / s)
    got = kv.fp32_scaled(torch.from_numpy(x), torch.from_numpy(s), op).numpy()
    assert np.array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))


def test_div_and_mul_recip_differ_exact():
    """x/s and x·fl(1/s) round to different codes at an FP8 tie (s = fl32(1/448), x = fl32(mid · s)); the policy
    decides which code is right, and each equals torch's RNE cast of the numpy-fp32 quotient/product."""
    s = np.float32(np.float32(1.0) / np.float32(448.0))
    x = np.float32(5.8855330280493945e-05)
    xt = torch.tensor([[[float(x)]]])
    div = kv.quantize_kv(xt, torch.tensor(float(s)), kv.KVPolicy(quant_op="div")).codes.item()
    mul = kv.quantize_kv(xt, torch.tensor(float(s)), kv.KVPolicy(quant_op="mul_recip")).codes.item()
    assert (div, mul) == (0x0E, 0x0D)
    for y, code in ((x / s, div), (x * (np.float32(1.0) / s), mul)):
        assert torch.tensor(float(np.float32(y))).to(torch.float8_e4m3fn).view(torch.uint8).item() == code


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("layout", kv.LAYOUTS)
def test_store_matches_clamped_torch_cast_exact(fmt, layout):
    """The oracle (bit-level encoder) equals torch's RNE cast applied to the clamped fp32 value."""
    r = np.random.default_rng(2)
    x = torch.from_numpy((r.standard_normal((3, 9, 4, 16)) * np.exp2(r.integers(-8, 8, (1, 1, 4, 1)))
                          ).astype(np.float32))
    pol = kv.default_policy(fmt, layout)
    scale = None
    if layout == "tensor":
        scale = (x.abs().amax().double() / pol.fmax * 0.6).float()
    elif layout == "head":
        scale = (x.abs().amax(dim=(0, 1, 3)).double() / pol.fmax * 0.6).float()
    cache = kv.quantize_kv(x, scale, pol)
    full = kv.expand_scale(cache.scale, layout, tuple(x.shape))
    y = kv.fp32_scaled(x, full, pol.quant_op).clamp(-pol.fmax, pol.fmax)
    ref = y.to(get_format(fmt).torch_dtype()).view(torch.uint8)
    assert torch.equal(cache.codes, ref)


def test_token_head_scales_exact():
    r = np.random.default_rng(3)
    x = (r.standard_normal((5, 3, 7)) * np.exp2(r.integers(-40, 8, (5, 3, 1)))).astype(np.float32)
    x[0, 0] = 0.0
    got = kv.token_head_scales(torch.from_numpy(x), "e4m3fn").numpy()
    expected = np.maximum(np.abs(x).max(-1) / np.float32(448.0), np.float32(1e-6)).astype(np.float32)
    assert np.array_equal(got, expected)
    assert got[0, 0] == np.float32(1e-6)


def test_layout_shapes_exact():
    shape = (2, 5, 3, 8)
    assert kv.scale_shape(shape, "tensor") == ()
    assert kv.scale_shape(shape, "head") == (3,)
    assert kv.scale_shape(shape, "token_head") == (2, 5, 3)
    s = torch.tensor([1.0, 2.0, 4.0])
    full = kv.expand_scale(s, "head", shape)
    assert full.shape == shape and torch.equal(full[1, 4, :, 7], s)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_torch_view_exact(fmt):
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 8, 2, 8)
    scale = torch.tensor([0.37, 3.0e-3])
    cache = kv.KVCache(codes, scale, fmt, "head")
    ref = codes.view(get_format(fmt).torch_dtype()).double() * scale.double().reshape(2, 1)
    got = cache.dequantize()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got[~torch.isnan(got)], ref[~torch.isnan(ref)])


def test_clip_threshold_and_saturation_exact():
    assert kv.clip_threshold("e4m3fn") == 464.0
    assert kv.clip_threshold("e5m2") == 61440.0
    x = torch.tensor([400.0, 460.0, 470.0, -1000.0, float("nan")]).reshape(1, 1, 5)
    assert kv.saturation_fraction(x, torch.tensor(1.0)) == pytest.approx(2 / 5, abs=0)


def test_half_ulp_bound_holds_exact():
    """|x̂ − x| ≤ half_ulp_bound for every in-range value (normal and subnormal), both formats."""
    r = np.random.default_rng(4)
    for fmt in FMTS:
        x = torch.from_numpy((r.standard_normal((64, 2, 32)) * np.exp2(r.integers(-20, 0, (64, 1, 1)))
                              ).astype(np.float32))
        s = (x.abs().amax().double() / get_format(fmt).max_finite).float()
        cache = kv.quantize_kv(x, s, kv.default_policy(fmt))
        err = (cache.dequantize() - x.double()).abs()
        assert bool((err <= kv.half_ulp_bound(x, s.expand(x.shape), fmt)).all())


@pytest.mark.parametrize("kwargs, match", [
    ({"fmt": "e4m3fnuz"}, "fmt"), ({"layout": "block"}, "layout"), ({"quant_op": "mul"}, "quant_op"),
    ({"fmt": "e4m3fn", "overflow": "inf"}, "overflow"), ({"token_head_floor": 0.0}, "token_head_floor"),
])
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kv.KVPolicy(**kwargs)


def test_store_argument_validation():
    x = torch.randn(2, 3, 4)
    pol = kv.default_policy()
    with pytest.raises(ValueError, match="scale"):
        kv.quantize_kv(x, None, pol)
    with pytest.raises(ValueError, match="scale"):
        kv.quantize_kv(x, torch.ones(5), kv.default_policy("e4m3fn", "head"))
    with pytest.raises(ValueError, match="scale"):
        kv.quantize_kv(x, torch.tensor(1.0), kv.default_policy("e4m3fn", "token_head"))
    with pytest.raises(ValueError, match="x"):
        kv.quantize_kv(torch.ones(2, 3, 4, dtype=torch.int32), torch.tensor(1.0), pol)
    with pytest.raises(ValueError, match="x"):
        kv.quantize_kv(torch.ones(4), torch.tensor(1.0), pol)


# ----------------------------------------------------------------------------------------------------------------
# attention


def test_attention_causal_bottom_right_exact():
    """q = 0 gives uniform weights over the visible keys, so each output is the mean of the visible v's (2 or 4
    visible keys make the weights exact)."""
    b, tk, d = 1, 4, 2
    q = torch.zeros(b, 3, 1, d)
    k = torch.randn(b, tk, 1, d)
    v = torch.tensor([1.0, 2.0, 4.0, 8.0]).reshape(1, tk, 1, 1).expand(b, tk, 1, d)
    out = kv.attention(q, k, v, causal=True)  # the 3 queries are the last 3 positions: they see 2, 3, 4 keys
    assert out[0, 0, 0, 0].item() == 1.5 and out[0, 2, 0, 0].item() == 3.75
    assert math.isclose(out[0, 1, 0, 0].item(), 7 / 3, rel_tol=4 * 2.0**-53)
    out = kv.attention(q, k, v, causal=True, q_lengths=torch.tensor([1]), kv_lengths=torch.tensor([2]))
    assert out[0, :, 0, 0].tolist() == [1.5, 0.0, 0.0]  # one valid query sees both keys; padded rows are 0
    out = kv.attention(q, k, v, causal=False, kv_lengths=torch.tensor([4]))
    assert out[0, :, 0, 0].tolist() == [3.75] * 3


def test_attention_gqa_head_mapping_exact():
    q = torch.zeros(1, 1, 6, 2)
    k = torch.zeros(1, 3, 3, 2)
    v = torch.arange(3.0).reshape(1, 1, 3, 1).expand(1, 3, 3, 2)  # kv head j holds the value j
    out = kv.attention(q, k, v, causal=False)
    assert out[0, 0, :, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]  # query head h reads kv head h // 2


def test_attention_ignores_padding_exact():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 7, 2, 8, generator=g), torch.randn(2, 7, 2, 8,
                                                                                                     generator=g)
    lens = {"q_lengths": torch.tensor([5, 2]), "kv_lengths": torch.tensor([7, 3])}
    ref = kv.attention(q, k, v, **lens)
    k2, v2 = k.clone(), v.clone()
    k2[1, 3:] = float("nan")
    v2[1, 3:] = float("inf")
    q2 = q.clone()
    q2[1, 2:] = float("nan")
    assert torch.equal(kv.attention(q2, k2, v2, **lens), ref)
    assert bool((ref[1, 2:] == 0).all())


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_torch_sdpa_fp64_bound(causal):
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 9, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 9, 2, 16, generator=g, dtype=torch.float64)
    got = kv.attention(q, k, v, causal=causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal, enable_gqa=True).transpose(1, 2)
    terms = kv.attention_bound_terms(q, k, v, causal=causal)
    bound = tolerances.kv_attention_arith_bound(terms.score_abs_max, terms.score_span, terms.weighted_abs_v, 16, 9,
                                                dtype="float64")
    assert bool(((got - ref).abs() <= bound).all())


@pytest.mark.parametrize("bad, match", [
    ({"q_lengths": torch.tensor([3]), "kv_lengths": torch.tensor([2])}, "q_lengths"),
    ({"kv_lengths": torch.tensor([9])}, "kv_lengths"),
    ({"kv_lengths": torch.tensor([1.5])}, "kv_lengths"),
])
def test_attention_argument_validation(bad, match):
    q, k = torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 1, 4)
    with pytest.raises(ValueError, match=match):
        kv.attention(q, k, k, causal=True, **bad)
    with pytest.raises(ValueError, match="q"):
        kv.attention(torch.zeros(1, 3, 3, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))


def test_fp8_attention_uses_q_scale_exact():
    """Q̂ = value(RNE(clamp(q · fl(1/s_q)))) · s_q enters the fp64 attention."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 4, 1, 8, generator=g), torch.randn(1, 4, 1, 8,
                                                                                                     generator=g)
    pol = kv.default_policy()
    kc, vc = kv.quantize_kv(k, torch.tensor(0.01), pol), kv.quantize_kv(v, torch.tensor(0.02), pol)
    qs = torch.tensor(0.013)
    q_hat = kv.quantize_q(q, qs)
    manual = ((q * (1 / qs)).clamp(-448, 448).to(torch.float8_e4m3fn).double() * qs.double())
    assert torch.equal(q_hat, manual)
    assert torch.equal(kv.fp8_attention(q, kc, vc, q_scale=qs), kv.attention(q_hat, kc.dequantize(), vc.dequantize()))


@settings(deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(FMTS), st.sampled_from(kv.LAYOUTS), st.booleans(),
       st.sampled_from([0.25, 0.5, 1.0]))
def test_fp8_attention_within_worstcase_quant_bound(seed, fmt, layout, causal, gain):
    """Derived bound kv_attention_quant: FP8 attention (in-range stores) vs unquantized attention."""
    g = torch.Generator().manual_seed(seed)
    q = _qk_normed(g, (2, 6, 4, 8), gain)
    k = _qk_normed(g, (2, 6, 2, 8), gain, outlier=3.0)
    v = torch.randn(2, 6, 2, 8, generator=g)
    pol = kv.default_policy(fmt, layout)
    caps = [[(q, k, v)]]
    sc = kv.calibrate(caps, "amax", layout="head" if layout == "head" else "tensor", fmt=fmt)
    static = layout != "token_head"
    kc = kv.quantize_kv(k, sc.k if static else None, pol)
    vc = kv.quantize_kv(v, sc.v if static else None, pol)
    ref = kv.attention(q, k, v, causal=causal)
    got = kv.fp8_attention(q, kc, vc, q_scale=sc.q, causal=causal)
    dq = kv.half_ulp_bound(q, sc.q.expand(q.shape), "e4m3fn")
    dk = kv.half_ulp_bound(k, kv.expand_scale(kc.scale, layout, k.shape), fmt)
    dv = kv.half_ulp_bound(v, kv.expand_scale(vc.scale, layout, v.shape), fmt)
    eps, pv, pdv = kv.quantization_bound_terms(q, k, v, dq=dq, dk=dk, dv=dv, causal=causal)
    bound = tolerances.kv_attention_quant_bound(eps, pv, pdv, 8, 6)
    assert bool(((got - ref).abs() <= bound).all())


def test_clipping_leaves_worstcase_quant_bound():
    """Stale scales that clip V (range grown 8× since calibration) produce errors FP8 rounding alone cannot
    explain: the derived bound, evaluated as if the store were in range, is exceeded."""
    g = torch.Generator().manual_seed(8)
    q, k = _qk_normed(g, (1, 16, 2, 16), 0.5), _qk_normed(g, (1, 16, 1, 16), 0.5)
    v = torch.randn(1, 16, 1, 16, generator=g)
    sc = kv.calibrate([[(q, k, v / 8)]], "amax")  # calibrated before V's range grew 8×
    pol = kv.default_policy()
    got = kv.fp8_attention(q, kv.quantize_kv(k, sc.k, pol), kv.quantize_kv(v, sc.v, pol), q_scale=sc.q)
    ref = kv.attention(q, k, v)
    dq = kv.half_ulp_bound(q, sc.q.expand(q.shape), "e4m3fn")
    dk = kv.half_ulp_bound(k, sc.k.expand(k.shape), "e4m3fn")
    dv = kv.half_ulp_bound(v, sc.v.expand(v.shape), "e4m3fn")
    eps, pv, pdv = kv.quantization_bound_terms(q, k, v, dq=dq, dk=dk, dv=dv)
    bound = tolerances.kv_attention_quant_bound(eps, pv, pdv, 16, 16)
    assert kv.saturation_fraction(v, sc.v) > 0.1
    assert bool(((got - ref).abs() > bound).any())


def test_rescaled_in_range_error_ratio_stat():
    """Justification of κ_attn (kv_attention_vs_fresh): in-range rescalings of the fresh scales keep the FP8
    attention error within κ of the fresh-scale error; clipping by 4× leaves it."""
    kappa = tolerances.get("kv_attention_vs_fresh").value
    r = np.random.default_rng(9)
    worst, clipped = 0.0, []
    for i in range(16):
        fmt = FMTS[i % 2]
        g = torch.Generator().manual_seed(100 + i)
        gain = float(r.choice([0.5, 1.0, 2.0]))
        q = _qk_normed(g, (2, 32, 4, 32), gain)
        k = _qk_normed(g, (2, 32, 2, 32), gain, outlier=float(r.choice([1.0, 6.0])))
        v = torch.randn(2, 32, 2, 32, generator=g)
        sc = kv.calibrate([[(q, k, v)]], "amax", fmt=fmt)
        ref = kv.attention(q, k, v)
        pol = kv.default_policy(fmt)

        errs = {}
        for c in (1.0, 1.05, 1.3, 2.24, 16.0, 0.25):
            out = kv.fp8_attention(q, kv.quantize_kv(k, sc.k * c, pol), kv.quantize_kv(v, sc.v * c, pol),
                                   q_scale=sc.q * c)
            errs[c] = kv.relative_error(out, ref)
        worst = max(worst, *(errs[c] / errs[1.0] for c in (1.05, 1.3, 2.24, 16.0)))
        clipped.append(errs[0.25] / errs[1.0])
    assert worst <= kappa
    assert np.median(clipped) > kappa


def test_relative_error_edge_exact():
    z = torch.zeros(3)
    assert kv.relative_error(z, z) == 0.0
    assert kv.relative_error(torch.ones(3), z) == math.inf
    assert kv.relative_error(torch.tensor([float("nan")]), torch.ones(1)) == math.inf


# ----------------------------------------------------------------------------------------------------------------
# calibration


def _t(*vals):
    return torch.tensor(vals, dtype=torch.float32).reshape(1, 1, 1, -1)


def test_engine_first_batch_hand_exact():
    q, k, v = _t(-4.0, 1.0), _t(10.0, -3.0), _t(0.5, -3.0)
    s = kv.calibrate_engine_first_batch(q, k, v)
    assert float(s.q) == float(np.float32(4.0) / np.float32(200.0))
    assert float(s.k) == float(np.float32(10.0) / np.float32(200.0))
    assert float(s.v) == float(np.float32(3.0) / np.float32(100.0))
    later = (_t(1e3), _t(1e3), _t(1e3))
    assert kv.calibrate([[(q, k, v), later], [later]], "A").equals(s)  # only the first batch counts


@pytest.mark.parametrize("values, p, expected", [
    ([5.0], 99.9, 5.0), ([1.0, 2.0, 3.0], 99.9, 3.0), (list(range(1001)), 99.9, 999.0),
    (list(range(1501)), 99.9, 1499.0), (list(range(1001)), 0.0, 0.0), ([], 99.9, 0.0), ([3.0, 1.0, 2.0], 50.0, 2.0),
])
def test_nearest_rank_percentile_exact(values, p, expected):
    assert kv.nearest_rank_percentile(values, p) == expected


def test_trainer_percentile_hand_exact():
    rank0 = [(_t(float(i)), _t(float(2 * i)), _t(float(i) / 4)) for i in range(1, 1002)]  # p99.9 → 2nd largest
    rank1 = [(_t(7.0), _t(3000.0), _t(1.0))]  # one micro-batch: its amax
    s = kv.calibrate_trainer_percentile([rank0, rank1])
    assert float(s.q) == float(np.float32((1000.0 * 1.05) / 448.0))
    assert float(s.k) == float(np.float32((3000.0 * 1.05) / 448.0))  # max over ranks
    assert float(s.v) == float(np.float32((250.0 * 1.05) / 448.0))


def test_amax_per_head_exact():
    k = torch.tensor([[1.0, -2.0], [30.0, 4.0]]).reshape(1, 2, 2, 1).transpose(1, 2).contiguous()  # [1, T, H, D]
    v = k * 0.5
    q = torch.full((1, 2, 4, 1), -9.0)
    s = kv.calibrate_amax([[(q, k, v)]], 448.0, "head")
    heads = k.abs().amax(dim=(0, 1, 3))
    assert torch.equal(s.k, (heads.double() / 448.0).float())
    assert float(s.q) == float(np.float32(9.0 / 448.0))
    s5 = kv.calibrate([[(q, k, v)]], "amax", fmt="e5m2")
    assert float(s5.k) == float(np.float32(30.0 / 57344.0)) and float(s5.q) == float(np.float32(9.0 / 448.0))


@pytest.mark.parametrize("call, match", [
    (lambda: kv.calibrate([], "amax"), "captures"),
    (lambda: kv.calibrate([[(_t(1.0),)]], "amax"), "captures"),
    (lambda: kv.calibrate([[(_t(1.0), _t(1.0), _t(1.0))]], "median"), "strategy"),
    (lambda: kv.calibrate([[(_t(1.0), _t(1.0), _t(1.0))]], "B", layout="head"), "layout"),
    (lambda: kv.calibrate_trainer_percentile([[(_t(1.0), _t(1.0), _t(1.0))]], margin=0), "margin"),
    (lambda: kv.calibrate_engine_first_batch(_t(1.0), _t(1.0), _t(1.0), constants=(1, 0, 1)), "constants"),
    (lambda: kv.nearest_rank_percentile([1.0], 101), "percentile"),
])
def test_calibration_argument_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()
