"""Property, hand-computed and peer tests of the quantization oracle (fp8rl.reference.quant).

Names say the comparison: ``*_exact`` (bit-exact), ``*_bound`` (within a derived bound of fp8rl.tolerances).
"""

from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.reference.formats import ELEMENT_FORMATS, decode_codes, get_format
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import PRESETS, get_policy
from fp8rl.reference.quant import (
    Granularity,
    QuantizedTensor,
    compute_amax,
    dequantize,
    expand_scale,
    quant_multiplier_from_amax,
    quantize,
    quantize_with_scale,
    scale_from_amax,
)
from fp8rl.reference.quant_plain import quantize_plain, quantize_with_scale_plain
from fp8rl.strategies import (
    amax_near_pow2_boundaries,
    block_shapes,
    blocks_with_zero_block,
    fp8_edge_values,
    fp32_near_fp8,
    granularities,
    scale_policies,
    scales,
    tensors,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

f32 = np.float32
ALL_PRESETS = sorted(PRESETS)
GUARDED = [n for n in ALL_PRESETS if PRESETS[n].zero_amax != "nan"]
UNGUARDED = [n for n in ALL_PRESETS if PRESETS[n].zero_amax == "nan"]
NOT_CEIL_LOG2 = [n for n in ALL_PRESETS if PRESETS[n].pow2 != "ceil_log2"]
POW2_EXACT = [n for n in ALL_PRESETS if PRESETS[n].pow2 in ("ceil_bits", "floor_multiplier")]
POW2_ALL = [n for n in ALL_PRESETS if PRESETS[n].pow2 != "none"]
DIV_SCALE = [n for n in GUARDED if PRESETS[n].scale_op == "div" and PRESETS[n].pow2 == "none"]
NON_DIV_SCALE = [n for n in GUARDED if PRESETS[n].scale_op != "div" and PRESETS[n].pow2 == "none"]
#: presets whose multiplier is one fp32 division with FLT_MAX on overflow, in fp32 arithmetic: the generic numpy
#: models below; the others (multiplier_op, multiplier_overflow, compute_dtype) are tested in test_preset_fidelity.py
ONE_DIVISION = [n for n in ALL_PRESETS if PRESETS[n].multiplier_op == "div" and PRESETS[n].multiplier_overflow != "inf"
                and PRESETS[n].compute_dtype == "fp32" and PRESETS[n].zero_amax not in ("one_zero_inf", "one_zero_nan")]
SIGNED_ZERO = [f for f in ELEMENT_FORMATS if get_format(f).nan_encoding != "neg_zero"]

GRAN_2D = granularities()
SHAPES = block_shapes((4, 8), max_row_blocks=2, max_col_blocks=3, huge_k_blocks=16)

# Heavily parametrized properties run a fraction of the profile's examples per case (they scale with the profile:
# nightly runs 10x); the 68 format x preset cases together still run ~6x the profile's budget.
_BASE = settings().max_examples
per_case = settings(max_examples=max(4, _BASE // 5))
per_preset = settings(max_examples=max(6, _BASE // 3))


def _finite_x(fmt: str = "e4m3fn", **kw):
    return fp32_near_fp8(fmt, **kw)


def _ulp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ulp distance of same-sign finite values (monotone int view)."""
    ia = a.contiguous().view(torch.int32).to(torch.int64)
    ib = b.contiguous().view(torch.int32).to(torch.int64)
    return (ia - ib).abs()


def _group_ids(g: Granularity, shape) -> torch.Tensor:
    ss = g.scale_shape(tuple(shape))
    return expand_scale(torch.arange(int(np.prod(ss))).reshape(ss), g, tuple(shape))


# ---------------------------------------------------------------------------------------------------------------
# Round trip, every format × preset


@pytest.mark.parametrize("fmt,name", [(f, n) for f in ELEMENT_FORMATS for n in ALL_PRESETS])
@per_case
@given(data=st.data())
def test_roundtrip_within_quant_roundtrip_bound(fmt, name, data):
    policy = PRESETS[name].for_format(fmt)
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, _finite_x(fmt)), label="x")
    qt = quantize(x, g, policy)
    s = qt.expanded_scale()
    deq = qt.dequantize(torch.float64)  # exact; an fp32 dequant of |x| ≈ FLT_MAX can round to inf
    amax = expand_scale(compute_amax(x, g), g, qt.shape)
    if policy.zero_amax == "nan":  # documented: an all-zero group has no scale; its codes are NaN
        zero = amax == 0
        assert torch.isnan(qt.values()[zero]).all()
        assert (qt.scale[compute_amax(x, g) == 0] == 0).all()
    # precondition of the bound: a normal fp32 scale, or a power of two (exact reciprocal); see quant_roundtrip
    ok = (amax > 0) | (policy.zero_amax != "nan")
    ok &= (s >= 2.0**-126) | (torch.frexp(s).mantissa == 0.5)
    bound = tolerances.quant_roundtrip_bound(x.abs(), s, fmt, policy.max_value)
    err = (x.double() - deq).abs()
    bad = ok & ~(err <= bound)
    assert not bad.any(), (f"{name}/{fmt}: |x - deq| > bound at {bad.nonzero()[:3].tolist()}: "
                           f"x={x[bad][:3].tolist()} deq={deq[bad][:3].tolist()} s={s[bad][:3].tolist()}")


# ---------------------------------------------------------------------------------------------------------------
# Saturation and overflow


@pytest.mark.parametrize("fmt", ELEMENT_FORMATS)
@pytest.mark.parametrize("name", ["reference", "deepgemm_block"])
@per_preset
@given(data=st.data())
def test_saturation_at_max_times_scale_exact(fmt, name, data):
    policy = PRESETS[name].for_format(fmt)
    t = policy.max_value
    s = data.draw(scales(), label="scale")
    factor = data.draw(st.one_of(st.sampled_from([1.0, 1.0000001, 1.5, 2.0, 1e6, math.inf]),
                                 st.floats(1.0, 1e4)), label="factor")
    sign = data.draw(st.sampled_from([1.0, -1.0]))
    x = torch.tensor([[sign * float(f32(t) * f32(s)) * factor]], dtype=torch.float32)
    assume(abs(x.double().item()) >= t * s)  # |x/s| ≥ T (fp32 rounding of the product may land below)
    scale = torch.tensor([[s]], dtype=torch.float32)
    codes = quantize_with_scale(x, scale, Granularity.token(), policy)
    qt = QuantizedTensor(codes, scale, Granularity.token(), policy)
    f = get_format(fmt)
    want_code = f.max_finite_code | ((1 << (f.exp_bits + f.man_bits)) if sign < 0 else 0)
    assert int(codes.item()) == want_code
    assert qt.dequantize().item() == float(f32(sign * t) * f32(s))  # exactly fl32(±T·s)


@pytest.mark.parametrize("fmt,overflow", [("e4m3fn", "nan"), ("e5m2", "inf"), ("e5m2", "nan"),
                                          ("e4m3fnuz", "nan"), ("e5m2fnuz", "nan")])
def test_unclamped_overflow_policy_exact(fmt, overflow):
    f = get_format(fmt)
    policy = replace(PRESETS["reference"].for_format(fmt), name="t", clamp=False, overflow=overflow)
    vals = decode_codes(np.arange(256), fmt)
    vals = np.unique(vals[np.isfinite(vals) & (vals > 0)])
    mx, below = vals[-1], vals[-2]
    mid = mx + (mx - below) / 2  # RNE tie at the top: keeps max (even mantissa)
    above = float(np.nextafter(f32(mid), f32(np.inf)))
    x = torch.tensor([[mid, above, -above, mx]], dtype=torch.float32)
    codes = quantize_with_scale(x, torch.ones(1, 1), Granularity.token(), policy)
    got = decode_codes(codes.numpy(), fmt)[0]
    assert got[3] == mx and f.max_finite == mx
    # the tie at max + ulp/2 goes to the even neighbour: max itself when its mantissa is even (e4m3fn: 1.110b),
    # else the next binade, which overflows (e5m2 61440, e4m3fnuz 248: both have an odd max mantissa)
    tie_keeps_max = f.max_finite_code % 2 == 0
    overflowed = [got[1], got[2]] + ([] if tie_keeps_max else [got[0]])
    if tie_keeps_max:
        assert got[0] == mx
    if overflow == "inf":
        assert np.isinf(overflowed).all() and got[2] < 0
    else:
        assert np.isnan(overflowed).all()


# ---------------------------------------------------------------------------------------------------------------
# Zero groups


@pytest.mark.parametrize("name", GUARDED)
@per_preset
@given(data=st.data())
def test_zero_blocks_give_finite_scale_and_zero_codes_exact(name, data):
    policy = PRESETS[name]
    g = data.draw(granularities(("group", "block", "token", "channel")), label="granularity")
    x = data.draw(blocks_with_zero_block(g, SHAPES, _finite_x()), label="x")
    qt = quantize(x, g, policy)
    zero_groups = compute_amax(x, g) == 0
    assert zero_groups.any()
    zs = qt.scale[zero_groups]
    assert torch.isfinite(zs).all() and (zs > 0).all()
    zero_elems = expand_scale(zero_groups, g, qt.shape)
    assert (qt.values()[zero_elems] == 0).all()
    want = scale_from_amax(torch.zeros(1), policy)  # every zero group gets the same, policy-defined scale
    assert (zs == want).all()


@pytest.mark.parametrize("name", UNGUARDED)
def test_zero_block_without_floor_gives_nan_codes_exact(name):
    # Documented engine behaviour (DeepSeek reference kernel: s = 0/448 = 0, x/s = 0/0): the reference keeps it.
    x = torch.zeros(2, 8)
    x[1] = torch.arange(8.0)
    qt = quantize(x, Granularity.group(4), PRESETS[name])
    assert qt.scale[0].tolist() == [0.0, 0.0]
    assert torch.isnan(qt.values()[0]).all()
    assert torch.isfinite(qt.values()[1]).all()


# ---------------------------------------------------------------------------------------------------------------
# Scale equivariance, independence, sign symmetry


def _scalable_values():
    # nonzero |x| in [2^-40, 2^20] so that x·2^k (|k| ≤ 20) stays a normal fp32 number and scales stay normal
    mag = st.floats(2.0**-40, 2.0**20, width=32)
    return st.one_of(st.just(0.0), mag, mag.map(lambda v: -v), fp8_edge_values("e4m3fn").filter(
        lambda v: v == 0 or 2.0**-40 <= abs(v) <= 2.0**20))


@pytest.mark.parametrize("name", NOT_CEIL_LOG2)
@per_preset
@given(data=st.data())
def test_pow2_input_scaling_scales_scale_exact(name, data):
    policy = PRESETS[name]
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, _scalable_values()), label="x")
    amax = compute_amax(x, g)
    assume(bool((amax >= 1.0).all()))  # keep every floor (≤ 2e-3 in amax terms) inactive before and after
    lo = -int(math.floor(math.log2(float(amax.min()))))
    k = data.draw(st.integers(max(lo, -20), 20), label="k")
    q1 = quantize(x, g, policy)
    q2 = quantize(x * 2.0**k, g, policy)
    assert torch.equal(q2.scale, q1.scale * 2.0**k)
    assert torch.equal(q2.codes, q1.codes)


def test_ceil_log2_not_scale_equivariant_documented_exact():
    # amax = 1.75 + 2^-23: amax/448 = 2^-8·(1 + 2^-23/1.75) rounds to 2^-8·(1+2^-23) (0.571 ulp above 2^-8).
    # ×2^6: s_raw = 2^-2·(1+2^-23), log2 = -2 + 1.72e-7 rounds (spacing 2^-22 near 2) to -2 + 2^-22 → ceil -1 → 0.5.
    # ×2^3: s_raw = 2^-5·(1+2^-23), log2 = -5 + 1.72e-7 rounds (spacing 2^-21 near 5) to -5.0 → ceil -5 → 2^-5.
    p = PRESETS["vllm_ue8m0_group"]
    base = f32(1.75) + f32(2.0**-23)
    s6 = scale_from_amax(torch.tensor([float(base * f32(64))]), p).item()
    s3 = scale_from_amax(torch.tensor([float(base * f32(8))]), p).item()
    assert s6 == 0.5
    assert s3 == 2.0**-5  # 2^-3 × s6 would be 2^-4: the log2 path rounds down here (docs/engine-numerics.md §7)
    bits = replace(p, name="bits", pow2="ceil_bits")
    assert scale_from_amax(torch.tensor([float(base * f32(8))]), bits).item() == 2.0**-4


@given(data=st.data())
def test_blocks_are_independent_exact(data):
    policy = data.draw(scale_policies(names=GUARDED), label="policy")
    g = data.draw(granularities(("group", "block", "token", "channel")), label="granularity")
    x = data.draw(tensors(SHAPES, _finite_x()), label="x")
    ids = _group_ids(g, x.shape)
    n_groups = int(ids.max()) + 1
    assume(n_groups > 1)
    victim = data.draw(st.integers(0, n_groups - 1), label="victim")
    repl = data.draw(tensors(tuple(x.shape), _finite_x()), label="replacement")
    y = torch.where(ids == victim, repl, x)
    qx, qy = quantize(x, g, policy), quantize(y, g, policy)
    keep_groups = torch.arange(n_groups).reshape(qx.scale.shape) != victim
    assert torch.equal(qx.scale[keep_groups], qy.scale[keep_groups])
    keep = ids != victim
    assert torch.equal(qx.codes[keep], qy.codes[keep])


@pytest.mark.parametrize("fmt", ELEMENT_FORMATS)
@per_preset
@given(data=st.data())
def test_sign_symmetry_exact(fmt, data):
    policy = data.draw(scale_policies(fmt, names=GUARDED), label="policy")
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, _finite_x(fmt)), label="x")
    qp, qn = quantize(x, g, policy), quantize(-x, g, policy)
    assert torch.equal(qp.scale, qn.scale)
    vp, vn = qp.values(), qn.values()
    assert torch.equal(vn, -vp)  # -0.0 == 0.0 for the fnuz formats, which have no negative zero
    if fmt in SIGNED_ZERO:
        assert torch.equal(qn.codes, qp.codes ^ 0x80)


# ---------------------------------------------------------------------------------------------------------------
# Re-quantization of the dequantized tensor


@pytest.mark.parametrize("name", DIV_SCALE)
@per_preset
@given(data=st.data())
def test_requantize_dequantized_is_identity_exact(name, data):
    # fl(fl(T·s)/T) == s for every s = fl(a/T) (exhaustively true over a binade, see requant_scale_ulps), and the
    # max element's code is T, so div-scale policies reproduce codes and scales bit for bit.
    policy = PRESETS[name]
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, _finite_x(max_magnitude=2.0**100)), label="x")
    q1 = quantize(x, g, policy)
    assume(bool((q1.scale >= 2.0**-126).all()))
    q2 = quantize(q1.dequantize(), g, policy)
    assert torch.equal(q2.codes, q1.codes)
    assert torch.equal(q2.scale, q1.scale)


@pytest.mark.parametrize("name", POW2_ALL)
@per_preset
@given(data=st.data())
def test_requantize_pow2_keeps_values_exact(name, data):
    policy = PRESETS[name]
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, st.one_of(_finite_x(max_magnitude=2.0**60),
                                            amax_near_pow2_boundaries(policy.max_value))), label="x")
    q1 = quantize(x, g, policy)
    q2 = quantize(q1.dequantize(), g, policy)
    assert torch.equal(q2.dequantize(torch.float64), q1.dequantize(torch.float64))


def test_requantize_pow2_renormalizes_scale_exact():
    # amax 225: 225/448 = 0.502 → UE8M0 ceil → s = 1; 225 rounds to 224 (e4m3 neighbours 224, 240) = 0x76.
    # Requantizing 224: 224/448 = 0.5 exactly → s = 0.5 and the code becomes 448 = 0x7E. Same value, new bytes.
    p = PRESETS["deepgemm_ue8m0"]
    q1 = quantize(torch.tensor([[225.0]]), Granularity.token(), p)
    assert q1.scale.item() == 1.0 and q1.codes.item() == 0x76
    q2 = quantize(q1.dequantize(), Granularity.token(), p)
    assert q2.scale.item() == 0.5 and q2.codes.item() == 0x7E
    assert q2.dequantize().item() == q1.dequantize().item() == 224.0


@pytest.mark.parametrize("name", [n for n in NON_DIV_SCALE if n in ONE_DIVISION])
@per_preset
@given(data=st.data())
def test_requantize_scale_within_one_ulp_bound(name, data):
    policy = PRESETS[name]
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, _finite_x(max_magnitude=2.0**100)), label="x")
    q1 = quantize(x, g, policy)
    assume(bool((q1.scale >= 2.0**-126).all()))
    q2 = quantize(q1.dequantize(), g, policy)
    assert torch.equal(q2.codes, q1.codes)
    assert int(_ulp32(q2.scale, q1.scale).max()) <= tolerances.REQUANT_SCALE_ULPS.value


@pytest.mark.parametrize("name,amax,s1,s2", [
    # sglang_group: s = amax·fl(1/448). fl(1/448) = 9586981·2^-32. amax = 0.375 = 3·2^-3:
    # s1 = fl(3·9586981·2^-35) = fl(28760943·2^-35) → 25 bits, tie → even: 14380472·2^-34.
    # deq max = fl(448·s1) = fl(6442451456·2^-34 ...) = 0.37500003 (one ulp above 0.375), so
    # s2 = fl(0.37500003·fl(1/448)) = 14380473·2^-34: the scale moved by one ulp.
    ("sglang_group", 0.375, 14380472 * 2.0**-34, 14380473 * 2.0**-34),
    # torchao: m = fl(448/1.375), s1 = fl(1/m); fl(448·s1) = 1.3750001 and the chain lands one ulp higher.
    ("torchao", 1.375, float(f32(1) / (f32(448) / f32(1.375))),
     float(f32(1) / (f32(448) / (f32(448) * (f32(1) / (f32(448) / f32(1.375))))))),
])
def test_requantize_non_div_scale_moves_one_ulp_exact(name, amax, s1, s2):
    p = PRESETS[name]
    q1 = quantize(torch.tensor([[amax]]), Granularity.token(), p)
    assert q1.scale.item() == s1
    q2 = quantize(q1.dequantize(), Granularity.token(), p)
    assert q2.scale.item() == s2 != s1
    assert q2.codes.item() == q1.codes.item() == 0x7E


# ---------------------------------------------------------------------------------------------------------------
# Power-of-two scales


def _pow2_inputs(policy):
    return st.one_of(amax_near_pow2_boundaries(policy.max_value),
                     amax_near_pow2_boundaries(policy.max_value).map(lambda v: -v),
                     _finite_x(max_magnitude=2.0**60))


@pytest.mark.parametrize("fmt", ELEMENT_FORMATS)
@pytest.mark.parametrize("name", POW2_EXACT)
@per_preset
@given(data=st.data())
def test_pow2_scales_never_overflow_exact(fmt, name, data):
    policy = PRESETS[name].for_format(fmt)
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, _pow2_inputs(policy)), label="x")
    qt = quantize(x, g, policy)
    s = qt.expanded_scale().double()
    assert (torch.frexp(qt.scale).mantissa == 0.5).all()  # powers of two
    ratio = x.double().abs() / s  # exact: s is a power of two
    assert (ratio <= policy.max_value).all(), float(ratio.max())
    assert torch.equal(qt.dequantize(torch.float64), qt.values().double() * s)


@given(data=st.data())
def test_ceil_log2_overshoot_within_documented_bound(data):
    policy = PRESETS["vllm_ue8m0_group"]
    g = data.draw(GRAN_2D, label="granularity")
    x = data.draw(tensors(SHAPES, _pow2_inputs(policy)), label="x")
    qt = quantize(x, g, policy)
    ratio = x.double().abs() / qt.expanded_scale().double()
    limit = policy.max_value * (1 + tolerances.UE8M0_CEIL_LOG2_OVERSHOOT.value)
    assert (ratio <= limit).all()


def test_ceil_log2_rounds_down_just_above_pow2_exact():
    # amax = 1.75 + 2^-23 → s_raw = fl(amax/448) = 2^-8·(1+2^-23); fl32(log2 s_raw) = -8.0 (the exact value
    # -8 + 1.7e-7 is within half an ulp (2.4e-7) of -8) → s = 2^-8 and amax/s = 448 + 2^-15 > 448 → clamped to 0x7E.
    # The bit path sees a nonzero mantissa and rounds up: s = 2^-7, amax/s = 224.00000763 → 224 = 0x76.
    amax = float(f32(1.75) + f32(2.0**-23))
    x = torch.tensor([[amax]])
    ql = quantize(x, Granularity.token(), "vllm_ue8m0_group")
    assert ql.scale.item() == 2.0**-8 and amax / 2.0**-8 > 448 and ql.codes.item() == 0x7E
    qb = quantize(x, Granularity.token(), replace(PRESETS["vllm_ue8m0_group"], name="bits", pow2="ceil_bits"))
    assert qb.scale.item() == 2.0**-7 and qb.codes.item() == 0x76


# ---------------------------------------------------------------------------------------------------------------
# Non-divisible shapes, against per-slice computations


@given(data=st.data())
def test_edge_groups_use_only_real_elements_exact(data):
    policy = data.draw(scale_policies(names=GUARDED), label="policy")
    g = data.draw(granularities(("group", "block")), label="granularity")
    x = data.draw(tensors(SHAPES, _finite_x()), label="x")
    qt = quantize(x, g, policy)
    bm, bk = (1, g.size[1]) if g.kind == "group" else g.size
    rows, cols = x.shape
    for i, r0 in enumerate(range(0, rows, bm) if g.kind == "block" else [0]):
        for j, c0 in enumerate(range(0, cols, bk)):
            r1 = r0 + bm if g.kind == "block" else rows
            piece = x[r0:r1, c0:c0 + bk]
            # quantizing the slice alone (one scale per row for groups, per tensor for blocks) must agree
            alone = quantize(piece, Granularity.token() if g.kind == "group" else Granularity.tensor(), policy)
            want_scale = qt.scale[:, j] if g.kind == "group" else qt.scale[i, j]
            assert torch.equal(alone.scale.reshape(-1), want_scale.reshape(-1))
            assert torch.equal(alone.codes, qt.codes[r0:r1, c0:c0 + bk])
            assert compute_amax(piece, Granularity.tensor()).item() == float(piece.abs().max())


# ---------------------------------------------------------------------------------------------------------------
# Scale formulas against numpy fp32 (independent arithmetic)


def _np_scale(amax: np.ndarray, p: ScalePolicy) -> np.ndarray:
    t = f32(p.max_value)
    a = np.maximum(amax, f32(p.eps)) if p.floor == "amax" else amax
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if p.scale_op == "div":
            s = a / t
        elif p.scale_op == "mul_recip_max":
            s = a * (f32(1) / t)
        else:
            m = t / a
            m = np.where(np.isinf(m) & (a > 0), np.finfo(f32).max, m).astype(f32)
            s = f32(1) / m
    if p.floor == "scale":
        s = np.maximum(s, f32(p.eps))
    if p.zero_amax == "one":
        s = np.where((a == 0) | ~np.isfinite(a), f32(1), s)
    return s.astype(f32)


@pytest.mark.parametrize("name", [n for n in ONE_DIVISION if PRESETS[n].pow2 == "none"])
@per_preset
@given(amax=st.lists(st.one_of(st.floats(0, 2.0**100, width=32), st.sampled_from([0.0, 1e-45, 1e-12, 1e-10, 1e-4])),
                     min_size=1, max_size=16))
def test_scale_from_amax_matches_numpy_fp32_exact(name, amax):
    p = PRESETS[name]
    a = np.array(amax, dtype=f32)
    got = scale_from_amax(torch.from_numpy(a), p).numpy()
    np.testing.assert_array_equal(got, _np_scale(a, p))


def test_multiplier_floor_pow2_matches_te_rule_exact():
    # TE: m = 448/amax, mantissa bits zeroed; amax 0/inf/NaN → 1; m overflow → FLT_MAX → 2^127.
    p = PRESETS["te_blockwise_pow2"]
    amax = torch.tensor([1.0, 3.0, 448.0, 0.0, math.inf, math.nan, 1e-45, float(np.finfo(f32).max)])
    m = quant_multiplier_from_amax(amax, p)
    want = [256.0, 128.0, 1.0, 1.0, 1.0, 1.0, 2.0**127, 2.0 ** math.floor(math.log2(448 / float(np.finfo(f32).max)))]
    assert m.tolist() == want
    assert scale_from_amax(amax, p).tolist() == [1 / v for v in want]


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed cases: on the oracle's definition (fp8rl.reference.quant_plain) and on its fast path
# (fp8rl.reference.quant.quantize; tests/oracle/test_quant_fast_path.py compares the two everywhere)

QUANTIZERS = pytest.mark.parametrize("quantize", [quantize_plain, quantize], ids=["plain", "fast"])
QUANTIZERS_WITH_SCALE = pytest.mark.parametrize("quantize_with_scale", [quantize_with_scale_plain, quantize_with_scale],
                                                ids=["plain", "fast"])


@QUANTIZERS
def test_all_ones_block_scale_and_codes_exact(quantize):
    qt = quantize(torch.ones(4, 8), Granularity.block(4), "reference")
    assert qt.scale.tolist() == [[float(f32(1) / f32(448))] * 2]  # s = fl32(1/448), computed independently
    assert (qt.codes == 0x7E).all()  # 1/s = 448·(1±2^-24) → RNE 448 = 1.75·2^8 → e=15, m=110 → 0x7E


@QUANTIZERS_WITH_SCALE
def test_max_times_scale_encodes_to_0x7e_exact(quantize_with_scale):
    x = torch.tensor([[224.0, -224.0, 112.0]])  # 448·0.5, -448·0.5, 224·0.5 with s = 0.5
    codes = quantize_with_scale(x, torch.tensor([[0.5]]), Granularity.token(), "reference")
    assert codes.tolist() == [[0x7E, 0xFE, 0x76]]


@QUANTIZERS
def test_te_all_ones_block_pow2_exact(quantize):
    # m = 448/1 = 448 = 1.75·2^8 → mantissa zeroed → 256; scale = 1/256; 1·256 = 2^8 → e=15, m=000 → 0x78.
    qt = quantize(torch.ones(2, 4), Granularity.block(2), "te_blockwise_pow2")
    assert (qt.scale == 2.0**-8).all() and (qt.codes == 0x78).all()
    z = quantize(torch.zeros(2, 4), Granularity.block(2), "te_blockwise_pow2")
    assert (z.scale == 1.0).all() and (z.codes == 0).all()  # TE: all zeros → scale_inv 1.0


@QUANTIZERS_WITH_SCALE
def test_div_vs_mul_recip_quant_op_differ_exact(quantize_with_scale):
    # s = fl32(0.1) = 13421773·2^-27; x = fl32(0.19375) = 6501171·2^-25.
    # mul_recip: fl(1/s) = 10.0 (1/s = 9.99999985, within 0.16 ulp of 10); x·10 = 65011710·2^-25
    #   = 16252927.5·2^-23 → fp32 tie → even → 16252928·2^-23 = 1.9375, the e4m3 midpoint of 1.875 (0x3F, m=111)
    #   and 2.0 (0x40, m=000) → RNE → 2.0 = 0x40.
    # div: x/s = 26004684/13421773 = 1.9375 - 8.85e-8 → fp32 1.93749988 (0.74 ulp below) → below the midpoint
    #   → 1.875 = 0x3F.
    x = torch.tensor([[float(f32(0.19375))]])
    s = torch.tensor([[float(f32(0.1))]])
    div = quantize_with_scale(x, s, Granularity.token(), "reference")
    mul = quantize_with_scale(x, s, Granularity.token(), replace(PRESETS["reference"], name="m", quant_op="mul_recip"))
    assert (div.item(), mul.item()) == (0x3F, 0x40)


def test_div_vs_mul_recip_max_scale_op_differ_exact():
    # fl(1/448) = round(2^32/448 = 9586980.57) · 2^-32 = 9586981·2^-32.
    # div: 3/448 = 14380470.857·2^-31 → 14380471·2^-31.
    # mul_recip_max: 3·9586981·2^-32 = 28760943·2^-32 (25 bits) → tie → even → 14380472·2^-31: one ulp higher.
    a = torch.tensor([3.0])
    assert scale_from_amax(a, "vllm_cuda_group").item() == 14380471 * 2.0**-31
    assert scale_from_amax(a, "vllm_triton_group").item() == 14380472 * 2.0**-31


@QUANTIZERS
def test_vllm_min_scale_floor_exact(quantize):
    qt = quantize(torch.zeros(3, 5), Granularity.token(), "vllm_per_token")
    assert (qt.scale == float(f32(1.0 / (448.0 * 512.0)))).all() and (qt.codes == 0).all()


@QUANTIZERS
def test_rocm_fnuz_clamps_at_224_exact(quantize):
    qt = quantize(torch.tensor([[1.0, -2.0, 0.0]]), Granularity.token(), "rocm_fnuz")
    assert qt.scale.item() == float(f32(2.0) / f32(224.0))
    assert qt.values().tolist() == [[112.0, -224.0, 0.0]]  # -224 = 0xF7 in e4m3fnuz (bias 8), not 240


# ---------------------------------------------------------------------------------------------------------------
# Peer cross-checks (independent implementations)


@pytest.mark.parametrize("kind", ["token", "tensor"])
@per_preset
@given(data=st.data())
def test_vllm_native_matches_torch_cast_peer_exact(kind, data):
    x = data.draw(tensors(SHAPES, fp32_near_fp8("e4m3fn", allow_inf=True)), label="x")
    # vLLM QuantFP8.forward_native written out with torch's own (saturating, torch ≥ 2.12) fp8 cast
    x_max = x.abs().amax(dim=-1, keepdim=True) if kind == "token" else x.abs().amax().reshape(1)
    scale = (x_max / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    shaped = scale if kind == "token" else scale.reshape(1, 1)
    peer = (x * shaped.reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    qt = quantize(x, Granularity(kind), "vllm_native")
    assert torch.equal(qt.scale, scale)
    nan = torch.isnan(qt.values())
    assert torch.equal(nan, torch.isnan(peer.view(torch.float8_e4m3fn).float()))
    assert torch.equal(qt.codes[~nan], peer[~nan])


@pytest.mark.parametrize("fmt", ELEMENT_FORMATS)
@per_preset
@given(data=st.data())
def test_block_quant_matches_ml_dtypes_peer_exact(fmt, data):
    g = data.draw(granularities(("block",)), label="granularity")
    x = data.draw(tensors(SHAPES, fp32_near_fp8(fmt)), label="x").numpy()
    t = f32(get_format(fmt).max_finite)
    bm, bn = g.size
    rows, cols = x.shape
    codes = np.zeros(x.shape, np.uint8)
    sc = np.zeros(g.scale_shape(x.shape), f32)
    dt = getattr(ml_dtypes, f"float8_{fmt}")
    for i in range(0, rows, bm):
        for j in range(0, cols, bn):
            blk = x[i:i + bm, j:j + bn]
            s = np.maximum(np.abs(blk).max(), f32(1e-10)) / t
            sc[i // bm, j // bn] = s
            # ml_dtypes overflows to NaN (issue #400): clamp first, as the reference policy does
            codes[i:i + bm, j:j + bn] = np.clip(blk / s, -t, t).astype(dt).view(np.uint8)
    qt = quantize(torch.from_numpy(x), g, "reference" if fmt == "e4m3fn" else PRESETS["reference"].for_format(fmt))
    np.testing.assert_array_equal(qt.scale.numpy(), sc)
    np.testing.assert_array_equal(qt.codes.numpy(), codes)


# ---------------------------------------------------------------------------------------------------------------
# Shapes and bad input


def test_scale_shapes_exact():
    assert Granularity.tensor().scale_shape((3, 4, 5)) == (1,)
    assert Granularity.token().scale_shape((3, 4, 5)) == (3, 4, 1)
    assert Granularity.channel().scale_shape((6, 5)) == (6, 1)
    assert Granularity.group(128).scale_shape((2, 3, 300)) == (2, 3, 3)
    assert Granularity.block(128).scale_shape((200, 328)) == (2, 3)
    assert Granularity.block((64, 128)).scale_shape((1, 129)) == (1, 2)
    assert Granularity.group(128).label == "group128" and Granularity.block((2, 4)).label == "block2x4"


def test_dtypes_upcast_exact():
    x = torch.tensor([[1.5, -3.25, 0.0078125, 300.0]])
    ref = quantize(x, Granularity.token())
    for dt in (torch.bfloat16, torch.float16):
        q = quantize(x.to(dt), Granularity.token())
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scale, ref.scale)


def test_presets_have_descriptions_and_valid_policies_exact():
    required = {"reference", "vllm_cuda_group", "vllm_triton_group", "vllm_native", "vllm_per_token",
                "vllm_per_tensor_cuda", "vllm_ue8m0_group", "deepgemm_block", "deepgemm_ue8m0", "verl_triton",
                "verl_torch", "te_blockwise_pow2", "sglang_group", "torchao", "deepseek_ref_2024_12", "rocm_fnuz",
                "sglang_triton_group", "sglang_triton_group_colmajor", "sglang_triton_group_ue8m0", "sglang_static",
                "sglang_mla_tensor", "sglang_native", "sglang_fp8_quantize", "vllm_triton_ue8m0_group"}
    assert required <= set(PRESETS)
    for name, p in PRESETS.items():
        assert p.name == name and ("docs/engine-numerics.md" in p.description or "docs/paper-numbers.md" in p.description)
        assert get_policy(name) is p and get_policy(p) is p


BAD = [
    (lambda: get_policy("nope"), ValueError, r"policy: unknown preset 'nope'"),
    (lambda: get_policy(3), TypeError, r"policy: expected a preset name"),
    (lambda: ScalePolicy("p", floor="both"), ValueError, r"floor: expected one of"),
    (lambda: ScalePolicy("p", pow2="round"), ValueError, r"pow2: expected one of"),
    (lambda: ScalePolicy("p", scale_op="x"), ValueError, r"scale_op: expected one of"),
    (lambda: ScalePolicy("p", quant_op="x"), ValueError, r"quant_op: expected one of"),
    (lambda: ScalePolicy("p", zero_amax="zero"), ValueError, r"zero_amax: expected one of"),
    (lambda: ScalePolicy("p", eps=-1.0), ValueError, r"eps: expected a number >= 0"),
    (lambda: ScalePolicy("p", target_max=0.0), ValueError, r"target_max: expected a positive"),
    (lambda: ScalePolicy("p", target_max=500.0), ValueError, r"target_max: 500.0 exceeds"),
    (lambda: ScalePolicy("p", fmt="e8m0fnu"), ValueError, r"fmt: expected one of"),
    (lambda: ScalePolicy("p", overflow="inf"), ValueError, r"overflow: e4m3fn allows"),
    (lambda: ScalePolicy("p", floor="none"), ValueError, r"zero_amax: 'floor' needs a floor"),
    (lambda: ScalePolicy("p", pow2="floor_multiplier"), ValueError, r"pow2: 'floor_multiplier'.*recip_multiplier"),
    (lambda: Granularity.group(0), ValueError, r"granularity: group size 0 must be a positive integer"),
    (lambda: Granularity.block((128, -1)), ValueError, r"granularity: block size"),
    (lambda: Granularity("row"), ValueError, r"granularity: expected one of"),
    (lambda: quantize(torch.ones(3, 4, 5), Granularity.block(2)), ValueError,
     r"x: expected a 2-D tensor for block granularity, got shape \(3, 4, 5\)"),
    (lambda: quantize(torch.ones(3, 4, 5), Granularity.channel()), ValueError, r"x: expected a 2-D weight"),
    (lambda: quantize(torch.ones(3, 4, dtype=torch.float64), Granularity.token()), TypeError,
     r"x: expected dtype float32, bfloat16 or float16, got torch.float64"),
    (lambda: quantize(torch.ones(3, 4, dtype=torch.int32), Granularity.token()), TypeError, r"x: expected dtype"),
    (lambda: quantize(np.ones((3, 4), np.float32), Granularity.token()), TypeError, r"x: expected a torch.Tensor"),
    (lambda: quantize(torch.ones(0, 4), Granularity.token()), ValueError, r"x: expected a non-empty tensor"),
    (lambda: quantize(torch.tensor(1.0), Granularity.tensor()), ValueError, r"x: expected at least a 1-D"),
    (lambda: quantize(torch.ones(2, 4), "token"), TypeError, r"granularity: expected a Granularity"),
    (lambda: quantize_with_scale(torch.ones(2, 4), torch.ones(2, 2), Granularity.token()), ValueError,
     r"scale: expected shape \(2, 1\)"),
    (lambda: quantize_with_scale(torch.ones(2, 4), torch.ones(2, 1, dtype=torch.float64), Granularity.token()),
     TypeError, r"scale: expected a torch.float32 tensor"),
    (lambda: QuantizedTensor(torch.zeros(2, 4), torch.ones(2, 1), Granularity.token(), PRESETS["reference"]),
     TypeError, r"codes: expected a torch.uint8 tensor"),
    (lambda: QuantizedTensor(torch.zeros(2, 4, dtype=torch.uint8), torch.ones(1), Granularity.token(),
                             PRESETS["reference"]), ValueError, r"scale: expected shape \(2, 1\)"),
    (lambda: dequantize("q"), TypeError, r"qt: expected a QuantizedTensor"),
    (lambda: expand_scale(torch.ones(3), Granularity.group(2), (2, 4)), ValueError, r"scale: expected shape"),
]


@pytest.mark.parametrize("fn,exc,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_raises_exact(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


@QUANTIZERS
def test_vllm_triton_ue8m0_zero_group_scale_exact(quantize):
    """Hand-worked: amax 0 → max(0, 1e-10)·fl(1/448) ≈ 2.23e-13 → 2^ceil(log2) = 2^-42 on the Triton fallback; the
    CUDA kernel floors the *scale* at 1e-10 first → 2^ceil(log2 1e-10) = 2^-33."""
    x = torch.zeros(2, 128)
    g = Granularity.group(128)
    assert quantize(x, g, "vllm_triton_ue8m0_group").scale.flatten().tolist() == [2.0 ** -42] * 2
    assert quantize(x, g, "vllm_ue8m0_group").scale.flatten().tolist() == [2.0 ** -33] * 2
