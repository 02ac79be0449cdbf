"""Area ``formats``: the engine's fp32 → FP8 cast, code for code, under the overflow policy it declares."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8rl.checks import assert_codes_equal, check
from fp8rl.engine import ELEMENT_FORMATS
from fp8rl.reference.formats import bf16_bits_rne, encode, get_format
from fp8rl.strategies import fp32_near_fp8
from hypothesis import given
from hypothesis import strategies as st

from . import _space as S
from ._inputs import all_bf16, bf16_sweep, cast_sweep

FORMATS = pytest.mark.parametrize("fmt", ELEMENT_FORMATS)


@FORMATS
@check("CAST-POLICY-001", "The engine declares, per format, an overflow policy that the format can express "
       "(saturate or nan; inf only for formats with an infinity).", requires=["cast.{fmt}"])
def test_cast_declared_policy_is_valid_exact(engine, fmt):
    policy = engine.cast_overflow(fmt)
    allowed = get_format(fmt).allowed_overflow()
    assert policy in allowed, f"{engine.name} declares overflow policy {policy!r} for {fmt}; allowed: {allowed}"


@FORMATS
@check("CAST-SWEEP-001", "Casting every FP8 value, every midpoint between neighbours (ties to even), each ±1 fp32 "
       "ulp, the overflow region, ±inf, NaN, ±0 and fp32 subnormals gives exactly the oracle's codes under the "
       "declared overflow policy.", requires=["cast.{fmt}"])
def test_cast_sweep_exact(engine, fmt):
    x = cast_sweep(fmt)
    got = engine.cast(x, fmt)
    expected = encode(x, fmt, engine.cast_overflow(fmt))
    assert_codes_equal(got, expected, fmt, context=f"cast fp32→{fmt} sweep", inputs=x)


@FORMATS
@check("CAST-RANDOM-001", "Casting random fp32 values spanning the format's whole exponent range (and beyond) "
       "gives exactly the oracle's codes.", requires=["cast.{fmt}"])
def test_cast_random_exact(engine, fmt, rng):
    f = get_format(fmt)
    lo, hi = int(np.log2(f.min_subnormal)) - 3, int(np.log2(f.max_finite)) + 3
    x = rng.standard_normal(4096).astype(np.float32) * np.exp2(rng.integers(lo, hi, 4096)).astype(np.float32)
    xt = torch.from_numpy(x)
    got = engine.cast(xt, fmt)
    assert_codes_equal(got, encode(xt, fmt, engine.cast_overflow(fmt)), fmt, context=f"cast fp32→{fmt} random",
                       inputs=xt)


@FORMATS
@check("CAST-PROP-001", "For any fp32 input (hypothesis: subnormals, huge values, ±inf and NaN included) the cast "
       "gives exactly the oracle's codes, elementwise and for any tensor shape.", requires=["cast.{fmt}"])
def test_cast_property_exact(engine, fmt):
    values = st.one_of(fp32_near_fp8(fmt, allow_nan=True, allow_inf=True),
                       st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True))

    @given(st.lists(values, min_size=1, max_size=64),
           st.sampled_from([(-1,), (1, -1), (-1, 1)]))
    def inner(values, shape):
        x = torch.tensor(values, dtype=torch.float32).reshape(shape)
        got = engine.cast(x, fmt)
        assert_codes_equal(got, encode(x, fmt, engine.cast_overflow(fmt)).reshape(x.shape), fmt,
                           context=f"cast fp32→{fmt} hypothesis", inputs=x)

    inner()


@FORMATS
@check("CAST-BF16IN-001", "Casting a bf16 tensor (all 65,536 bf16 bit patterns: subnormals, ±max, ±inf, NaNs) "
       "to FP8 gives exactly the oracle's codes of the same values (bf16 ⊂ fp32, so one rounding), whatever "
       "internal path the engine takes for 16-bit inputs.", requires=["cast.{fmt}"])
def test_cast_from_bf16_exact(engine, fmt):
    x = all_bf16()
    got = engine.cast(x, fmt)
    x32 = x.to(torch.float32)
    assert_codes_equal(got, encode(x32, fmt, engine.cast_overflow(fmt)), fmt, context=f"cast bf16→{fmt}",
                       inputs=x32)


@check("CAST-BF16-001", "Rounding fp32 to bf16 gives the oracle's bf16 bits (round to nearest, ties to even; "
       "overflow to ±inf; subnormals kept) for every finite bf16 value, every tie between bf16 neighbours, each "
       "± 1 fp32 ulp and the specials; a NaN input gives a NaN (any payload).", requires=["cast.bf16"])
def test_round_bf16_exact(engine):
    x = bf16_sweep()
    got = engine.round_bf16(x).view(torch.int16).numpy().astype(np.uint16)
    expected = bf16_bits_rne(x)
    xn = x.numpy()
    is_nan = np.isnan(xn)
    got_nan = ((got & 0x7FFF) > 0x7F80)
    bad = np.where(is_nan, ~got_nan, got != expected)
    if bad.any():
        idx = np.flatnonzero(bad)[:6]
        rows = [f"x={float(xn[i])!r} (0x{xn[i:i + 1].view(np.uint32)[0]:08x}): expected 0x{int(expected[i]):04x}, "
                f"got 0x{int(got[i]):04x}" for i in idx]
        raise AssertionError(f"fp32→bf16: {int(bad.sum())}/{bad.size} values differ from round-to-nearest-even; "
                             "first: " + "; ".join(rows))


# ---------------------------------------------------------------------------------------------------------------
# the input space of cast / round_bf16 (fp8rl.inputspace): every dtype, layout, rank, size class and special value


@FORMATS
@pytest.mark.parametrize("cls", S.classes("cast", ("dtype.", "layout.", "rank.", "size.", "special.")))
@check("CAST-SPACE-001", "For every class of the cast input space — fp32/bf16/fp16 inputs; contiguous, transposed, "
       "sliced and strided layouts; 1-D, 2-D and batched 3-D tensors; sizes below, at and above the 64/128/256 "
       "tiles and ragged; NaN, ±inf, -0, fp32 subnormals and ±FLT_MAX placed in the tensor — the codes equal the "
       "oracle's for the same values, element by element, under the declared overflow policy.",
       requires=["cast.{fmt}"])
def test_cast_input_space_exact(engine, fmt, cls, rng):
    S.skip_if_limited(engine, "cast", cls)
    x = S.tensor_of_class(cls, rng, fmt=fmt)
    got = engine.cast(x, fmt)
    x32 = x.float().contiguous()
    expected = encode(x32, fmt, engine.cast_overflow(fmt)).reshape(x.shape)
    assert_codes_equal(got, expected, fmt, context=f"cast {cls} {tuple(x.shape)} {x.dtype}→{fmt}", inputs=x32)


@pytest.mark.parametrize("cls", S.classes("round_bf16", ("layout.", "rank.", "special.")))
@check("CAST-SPACE-002", "For every layout (contiguous, transposed, sliced, strided), rank and special value of the "
       "round_bf16 input space, fp32 → bf16 gives the oracle's bits element by element (a NaN input: any NaN).",
       requires=["cast.bf16"])
def test_round_bf16_input_space_exact(engine, cls, rng):
    S.skip_if_limited(engine, "round_bf16", cls)
    x = S.tensor_of_class(cls, rng, fmt="e5m2")
    got = engine.round_bf16(x).contiguous().view(torch.int16).numpy().astype(np.uint16).reshape(-1)
    xn = x.contiguous().reshape(-1)
    expected = bf16_bits_rne(xn)
    nan = np.isnan(xn.numpy())
    bad = np.where(nan, (got & 0x7FFF) <= 0x7F80, got != expected)
    assert not bad.any(), (f"round_bf16 {cls} {tuple(x.shape)}: {int(bad.sum())}/{bad.size} values differ from the "
                           f"oracle; first at flat index {int(np.flatnonzero(bad)[0])}: x={float(xn[np.flatnonzero(bad)[0]])!r}")
