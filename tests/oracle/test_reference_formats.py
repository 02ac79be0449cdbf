"""Cross-checks of the bit-level FP8 format oracle (``fp8rl.reference.formats``) against torch and ml_dtypes.

The oracle is written with integer arithmetic and never calls torch's fp8 cast, so it can be compared against
two independent implementations:

* torch 2.13 ``.to(float8_*)`` (measured behaviour in docs/platform-notes.md §1, docs/engine-numerics.md §1), and
* ml_dtypes (numpy ``astype``), which differs from torch in its overflow policy for e4m3fn and in a few
  special encodings.

Every comparison is bit-exact on codes. Where torch, ml_dtypes and the oracle are known to differ, the
difference is written down as an explicit, asserted rule (``_torch_expected`` / ``_ml_expected`` and the
``test_*_policy_*`` / ``test_e8m0_*`` tests), never masked silently. Sweeps are generated from the decoded code
table, not copied from the encoder.
"""

from __future__ import annotations

import functools
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from fp8rl.reference import formats as F
from support.upstream import holds, pin_marks, pinned

FMT_NAMES = ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e8m0fnu")
FNUZ = ("e4m3fnuz", "e5m2fnuz")

#: The overflow policy torch 2.13's eager CPU cast implements, per format (docs/platform-notes.md §1).
TORCH_POLICY = {"e4m3fn": "saturate", "e5m2": "inf", "e4m3fnuz": "nan", "e5m2fnuz": "nan", "e8m0fnu": "saturate"}
#: The overflow policy ml_dtypes 0.6 implements (docs/engine-numerics.md §1: e4m3fn overflow → NaN, ml_dtypes issue #400).
ML_POLICY = {"e4m3fn": "nan", "e5m2": "inf", "e4m3fnuz": "nan", "e5m2fnuz": "nan", "e8m0fnu": "saturate"}

FORMAT_POLICIES = [(n, p) for n in FMT_NAMES for p in F.FORMATS[n].allowed_overflow()]

F32_MAX = float(np.finfo(np.float32).max)
INF = float("inf")


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------

def _f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def _up(x) -> np.ndarray:
    """x + 1 fp32 ulp (toward +inf)."""
    x = _f32(x)
    return np.nextafter(x, np.float32(np.inf)).astype(np.float32)


def _down(x) -> np.ndarray:
    """x - 1 fp32 ulp (toward -inf)."""
    x = _f32(x)
    return np.nextafter(x, np.float32(-np.inf)).astype(np.float32)


def _ml_dtype(name: str):
    return getattr(ml_dtypes, F.FORMATS[name].ml_dtypes_name)


def torch_codes(x, name: str) -> np.ndarray:
    """torch's cast of fp32 ``x`` to the format, as uint8 codes."""
    t = torch.from_numpy(np.array(x, dtype=np.float32))  # a writable copy
    return t.to(F.FORMATS[name].torch_dtype()).view(torch.uint8).numpy()


def ml_codes(x, name: str) -> np.ndarray:
    """ml_dtypes' cast of fp32 ``x`` to the format, as uint8 codes (its cast warns on NaN/overflow: silenced)."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return _f32(x).astype(_ml_dtype(name)).view(np.uint8)


def ours(x, name: str, overflow: str | None = None) -> np.ndarray:
    if overflow is None:
        return F.encode_codes(_f32(x), name)
    return F.encode_codes(_f32(x), name, overflow)


def _hex(a) -> list[str]:
    return [f"0x{int(v):02X}" for v in np.asarray(a).ravel()]


def assert_codes_equal(x: np.ndarray, got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit-exact code comparison with a readable failure listing (input value, fp32 bits, got, want)."""
    got = np.asarray(got, dtype=np.uint8)
    want = np.asarray(want, dtype=np.uint8)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.nonzero(got != want)[0]
    if bad.size:
        rows = [
            f"  x={float(x[i])!r} (0x{int(_bits(x)[i]):08X}): got 0x{int(got[i]):02X}, want 0x{int(want[i]):02X}"
            for i in bad[:12]
        ]
        pytest.fail(f"{what}: {bad.size} of {x.size} codes differ:\n" + "\n".join(rows))


@functools.cache
def code_table(name: str) -> np.ndarray:
    """Decoded value of every code 0..255 (float64; NaN for NaN codes)."""
    return F.decode_codes(np.arange(256), name)


@functools.cache
def finite_values(name: str) -> np.ndarray:
    """Sorted distinct finite values of the format (±0 collapse to one entry)."""
    v = code_table(name)
    return np.unique(v[np.isfinite(v)])


def _max_and_top_step(name: str) -> tuple[float, float]:
    fin = finite_values(name)
    return float(fin[-1]), float(fin[-1] - fin[-2])


@functools.cache
def sweep(name: str) -> np.ndarray:
    """Dense fp32 sweep for one format, derived from the decoded code table (both signs)."""
    fin = finite_values(name)
    fin32 = fin.astype(np.float32)
    assert np.array_equal(fin32.astype(np.float64), fin), "every FP8 value is exact in fp32"
    mids = (fin[:-1] + fin[1:]) / 2.0  # exact midpoints between consecutive codes
    mids32 = mids.astype(np.float32)
    assert np.array_equal(mids32.astype(np.float64), mids), "every midpoint is exact in fp32"
    mx, step = _max_and_top_step(name)
    tie = np.float32(mx + step / 2.0)  # (max + half-ulp): the overflow tie
    assert float(tie) == mx + step / 2.0
    min_pos = float(fin[fin > 0][0])
    half_min = _f32([min_pos / 2.0])  # underflow tie (0 vs smallest positive code)
    big = [v for v in (mx + step, 2 * mx, 4 * mx) if v <= F32_MAX]  # e8m0: 2^128 is beyond fp32
    specials = _f32([0.0, INF, np.nan, F32_MAX, 1e30, 1e-30, *big])
    # fp32 subnormals: the extremes, 2^-127 neighbourhood (e8m0's smallest value), and a random handful
    rng = np.random.default_rng(1234)
    f32_sub = _from_bits(
        np.concatenate([
            [1, 2, 3, 0x00200000, 0x003FFFFF, 0x00400000, 0x00400001, 0x005FFFFF, 0x00600000, 0x00600001,
             0x007FFFFE, 0x007FFFFF],
            rng.integers(1, 1 << 23, 200),
        ])
    )
    # 10^5 random fp32: 80 % with exponents around the format's range, 20 % over the whole fp32 range
    n = 100_000
    rng = np.random.default_rng(FMT_NAMES.index(name) + 2026)
    e_lo = int(np.floor(np.log2(min_pos))) - 4
    e_hi = int(np.floor(np.log2(mx))) + 4
    n_near = (n * 4) // 5
    exp_field = np.concatenate([
        np.clip(rng.integers(e_lo, e_hi + 1, n_near) + 127, 0, 254),
        rng.integers(0, 255, n - n_near),
    ])
    rand_bits = (rng.integers(0, 2, n) << 31) | (exp_field << 23) | rng.integers(0, 1 << 23, n)
    rand = _from_bits(rand_bits.astype(np.uint32))
    parts = [
        fin32, _up(fin32), _down(fin32),                        # every code's value ± 1 fp32 ulp
        mids32, _up(mids32), _down(mids32),                     # every midpoint (tie) ± 1 fp32 ulp
        _f32([tie]), _up([tie]), _down([tie]),                  # max + half-ulp tie ± ulp
        half_min, _up(half_min), _down(half_min),
        specials, f32_sub,
    ]
    x = np.concatenate([np.asarray(p, np.float32).ravel() for p in parts])
    x = np.concatenate([x, -x, rand])
    x.setflags(write=False)
    return x


# --- documented differences between the references and the oracle ----------------------------------------

#: versions in which the documented differences below were verified (tests/support/upstream.py): a version outside
#: a range skips the tests that pin it ("re-verify"), it does not fail them.
TORCH_E8M0_PIN = ("torch", "==2.13.*", "e8m0fnu: fp32 subnormals in (2^-127, 1.5·2^-127) round up to 0x01; finite "
                  "x ≥ 1.5·2^127 gives NaN 0xFF")
#: ml_dtypes up to 0.6.x rounds fp32 subnormals to e8m0fnu like torch (0x01); 0.7.0 changed that rounding, and
#: now gives 0x00 for (2^-127, 1.5·2^-127), as the oracle does (measured on 0.5.0, 0.5.1, 0.5.3, 0.5.4, 0.6.0, 0.7.0)
ML_E8M0_SUBNORMAL_UP = ("ml_dtypes", ">=0.5,<0.7", "e8m0fnu: fp32 subnormals in (2^-127, 1.5·2^-127) round up "
                        "to 0x01")
ML_E8M0_SUBNORMAL_NEAREST = ("ml_dtypes", ">=0.7", "e8m0fnu: fp32 subnormals in (2^-127, 1.5·2^-127) round to "
                             "0x00, as the oracle does")
#: ml_dtypes 0.5.0 still gave 0xFE for exactly 1.5·2^127; from 0.5.1 every finite x ≥ 1.5·2^127 gives NaN 0xFF
ML_E8M0_OVERFLOW_NAN = ("ml_dtypes", ">=0.5.1", "e8m0fnu: finite x ≥ 1.5·2^127 gives NaN 0xFF")


def _e8m0_quirks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the two e8m0fnu regions where torch's cast (and ml_dtypes', by version) differ from the oracle.

    * ``sub``: |x| an fp32 subnormal strictly between 2^-127 (bits 0x00400000) and 1.5·2^-127 (0x00600000).
      torch (and ml_dtypes < 0.7) round the fp32 *exponent field* with guard/round/sticky bits, so any subnormal
      above 2^-127 goes up to 2^-126 (code 0x01); the oracle rounds the value (nearest, ties up) → 2^-127 (0x00).
    * ``ovf``: finite |x| ≥ 1.5·2^127 (bits ≥ 0x7F400000): torch/ml_dtypes round up past 0xFE into 0xFF (NaN);
      the oracle ignores the overflow policy for e8m0 and clamps to 0xFE (2^127).
    """
    mag = _bits(x) & 0x7FFFFFFF
    sub = (mag > 0x00400000) & (mag < 0x00600000)
    ovf = (mag >= 0x7F400000) & (mag < 0x7F800000)
    return sub, ovf


def _e8m0_expected(x: np.ndarray, oracle: np.ndarray, *, subnormal_up: bool) -> np.ndarray:
    """An e8m0fnu cast predicted from the oracle's codes plus the documented differences: overflow → NaN 0xFF,
    and the subnormal rounding up to 0x01 when ``subnormal_up``."""
    sub, ovf = _e8m0_quirks(x)
    assert np.all(oracle[sub] == 0x00) and np.all(oracle[ovf] == 0xFE)
    want = oracle.copy()
    if subnormal_up:
        want[sub] = 0x01
    want[ovf] = 0xFF
    return want


#: the torch cross-checks: e8m0fnu includes torch's documented differences, so it is a pin of torch's behaviour
TORCH_SWEEP_NAMES = [n if n != "e8m0fnu" else pytest.param(n, marks=pin_marks(*TORCH_E8M0_PIN)) for n in FMT_NAMES]


def _torch_expected(x: np.ndarray, name: str, oracle: np.ndarray) -> np.ndarray:
    """torch's codes predicted from the oracle's codes (under TORCH_POLICY) plus the documented differences."""
    if name == "e8m0fnu":
        return _e8m0_expected(x, oracle, subnormal_up=True)
    return oracle.copy()


def _ml_expected(x: np.ndarray, name: str, oracle: np.ndarray) -> np.ndarray:
    """ml_dtypes' codes predicted from the oracle's codes (under ML_POLICY) plus the documented differences of the
    installed ml_dtypes version."""
    want = oracle.copy()
    neg = (_bits(x) >> 31) == 1
    if name == "e5m2":
        # ml_dtypes' e5m2 NaN is 0x7E/0xFE (quiet NaN, mantissa 10); torch and the oracle use 0x7F/0xFF.
        nan = np.isnan(x)
        assert np.all(oracle[nan] == np.where(neg[nan], 0xFF, 0x7F))
        want[nan] = np.where(neg[nan], 0xFE, 0x7E)
    if name == "e8m0fnu":
        want = _e8m0_expected(x, oracle, subnormal_up=holds(*ML_E8M0_SUBNORMAL_UP[:2]))
        # ml_dtypes: e8m0 has no zero and no sign, so ±0 and every negative input (sign bit set) → NaN 0xFF;
        # torch and the oracle ignore the sign and send ±0 to 2^-127 (0x00).
        want[neg | (x == 0)] = 0xFF
    return want


# ----------------------------------------------------------------------------------------------------------
# decode: all 256 codes
# ----------------------------------------------------------------------------------------------------------

def _assert_values_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    with np.errstate(invalid="ignore"):  # torch decodes some NaN codes to signalling fp32 NaNs
        got = np.asarray(got, np.float64)
        want = np.asarray(want, np.float64)
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"{what}: NaN codes differ: {_hex(np.nonzero(nan_g != nan_w)[0])}"
    ok = ~nan_g
    bad = np.nonzero(ok & ((got != want) | (np.signbit(got) != np.signbit(want))))[0]
    assert bad.size == 0, f"{what}: codes {_hex(bad)} decode to {got[bad]} instead of {want[bad]}"


@pytest.mark.parametrize("name", FMT_NAMES)
def test_decode_all_256_codes_match_torch_exact(name):
    f = F.FORMATS[name]
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(f.torch_dtype()).float().numpy()
    _assert_values_equal(F.decode_codes(np.arange(256), name), want, f"decode_codes vs torch {name}")
    got_t = F.decode(codes, name)
    assert got_t.dtype == torch.float32
    _assert_values_equal(got_t.numpy(), want, f"decode (tensor) vs torch {name}")
    # the code↔dtype reinterpretation helpers are exact inverses
    assert torch.equal(F.torch_to_codes(F.codes_to_torch(codes, name)), codes)


@pytest.mark.parametrize("name", FMT_NAMES)
def test_decode_all_256_codes_match_ml_dtypes_exact(name):
    want = np.arange(256, dtype=np.uint8).view(_ml_dtype(name)).astype(np.float64)
    _assert_values_equal(F.decode_codes(np.arange(256), name), want, f"decode_codes vs ml_dtypes {name}")


# Hand-derived NaN / inf code sets (by the format definitions, not by the decoder).
NAN_CODES = {
    "e4m3fn": {0x7F, 0xFF},                                    # S.1111.111
    "e5m2": {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF},              # S.11111.mm, mm != 0
    "e4m3fnuz": {0x80},                                        # "negative zero" pattern is the only NaN
    "e5m2fnuz": {0x80},
    "e8m0fnu": {0xFF},
}
INF_CODES = {"e5m2": {0x7C, 0xFC}}


@pytest.mark.parametrize("name", FMT_NAMES)
def test_decode_nan_and_inf_code_sets_hand_derived_exact(name):
    v = code_table(name)
    assert set(np.nonzero(np.isnan(v))[0].tolist()) == NAN_CODES[name]
    assert set(np.nonzero(np.isinf(v))[0].tolist()) == INF_CODES.get(name, set())


# ----------------------------------------------------------------------------------------------------------
# metadata
# ----------------------------------------------------------------------------------------------------------

# Hand-derived values: value = 2^(e - bias)·(1 + m/2^M) for e ≥ 1, 2^(1 - bias)·(m/2^M) for e = 0.
HAND = {
    # e4m3fn: bias 7. S.1111.111 is NaN, so max is e=15, m=6: 2^8·1.75 = 448 (code 0x7E).
    # min normal 2^(1-7) = 2^-6; min subnormal 2^-6·(1/8) = 2^-9; eps 2^-3 (1 → 1.125).
    "e4m3fn": dict(max=448.0, max_code=0x7E, min_normal=2.0**-6, min_subnormal=2.0**-9, eps=0.125,
                   nan_code=0x7F, inf_code=None),
    # e5m2: bias 15. e=31 is inf/NaN, so max is e=30, m=3: 2^15·1.75 = 57344 (0x7B).
    # min normal 2^-14; min subnormal 2^-14·(1/4) = 2^-16; eps 2^-2; +inf = 0.11111.00 = 0x7C.
    "e5m2": dict(max=57344.0, max_code=0x7B, min_normal=2.0**-14, min_subnormal=2.0**-16, eps=0.25,
                 nan_code=0x7F, inf_code=0x7C),
    # e4m3fnuz: bias 8, only 0x80 is special, so max is e=15, m=7: 2^7·1.875 = 240 (0x7F).
    # min normal 2^(1-8) = 2^-7; min subnormal 2^-7·(1/8) = 2^-10; eps 2^-3.
    "e4m3fnuz": dict(max=240.0, max_code=0x7F, min_normal=2.0**-7, min_subnormal=2.0**-10, eps=0.125,
                     nan_code=0x80, inf_code=None),
    # e5m2fnuz: bias 16, max is e=31, m=3: 2^15·1.75 = 57344 (0x7F).
    # min normal 2^(1-16) = 2^-15; min subnormal 2^-15·(1/4) = 2^-17; eps 2^-2.
    "e5m2fnuz": dict(max=57344.0, max_code=0x7F, min_normal=2.0**-15, min_subnormal=2.0**-17, eps=0.25,
                     nan_code=0x80, inf_code=None),
    # e8m0fnu: value 2^(e - 127), e = 0..254, 0xFF is NaN: max 2^127 (0xFE), min 2^-127 (0x00, no subnormals,
    # no zero); eps = 2^1 - 2^0 = 1.
    "e8m0fnu": dict(max=2.0**127, max_code=0xFE, min_normal=2.0**-127, min_subnormal=2.0**-127, eps=1.0,
                    nan_code=0xFF, inf_code=None),
}


@pytest.mark.parametrize("name", FMT_NAMES)
def test_metadata_matches_hand_derived_literals_exact(name):
    f, h = F.FORMATS[name], HAND[name]
    assert f.max_finite == h["max"]
    assert f.max_finite_code == h["max_code"]
    assert f.min_normal == h["min_normal"]
    assert f.min_subnormal == h["min_subnormal"]
    assert f.nan_code == h["nan_code"]
    assert f.inf_code == h["inf_code"]
    assert f.has_inf == (h["inf_code"] is not None)
    assert f.allowed_overflow() == (("saturate", "nan", "inf") if f.has_inf else ("saturate", "nan"))
    # the decoder agrees with the literals too
    v = code_table(name)
    assert v[h["max_code"]] == h["max"]
    assert np.nanmax(v[np.isfinite(v)]) == h["max"]
    pos = v[np.isfinite(v) & (v > 0)]
    assert pos.min() == h["min_subnormal"]
    one = int(np.nonzero(v == 1.0)[0][0])
    assert v[one + 1] - 1.0 == h["eps"]
    assert F.get_format(name) is f and F.get_format(f) is f


@pytest.mark.parametrize("name", FMT_NAMES)
def test_metadata_matches_torch_finfo_exact(name):
    f, fi = F.FORMATS[name], torch.finfo(F.FORMATS[name].torch_dtype())
    assert fi.bits == 8
    assert f.max_finite == fi.max
    assert f.min_normal == fi.tiny == fi.smallest_normal
    if name == "e8m0fnu":
        assert fi.min == 2.0**-127  # unsigned: torch's finfo.min is the smallest value, not -max
    else:
        assert fi.min == -f.max_finite
    # torch.finfo has no smallest_subnormal; eps is checked against hand values in the next tests


@pytest.mark.parametrize("name", [n for n in FMT_NAMES if n != "e5m2fnuz"])
def test_torch_finfo_eps_matches_hand_derived_exact(name):
    assert torch.finfo(F.FORMATS[name].torch_dtype()).eps == HAND[name]["eps"]


@pinned("torch", "==2.13.*", "finfo(float8_e5m2fnuz).eps is 0.125, half the true epsilon 0.25")
def test_torch_finfo_e5m2fnuz_eps_is_half_the_true_epsilon_exact():
    """Known torch quirk (2.13): finfo(float8_e5m2fnuz).eps is 2^-3, but with 2 mantissa bits the step after
    1.0 is 2^-2 (1.0 = 0x40 → 1.25 = 0x41, confirmed by torch's own decode). ml_dtypes reports 0.25."""
    fi = torch.finfo(torch.float8_e5m2fnuz)
    assert fi.eps == 0.125, "torch fixed finfo(float8_e5m2fnuz).eps: drop this quirk test"
    steps = torch.tensor([0x40, 0x41], dtype=torch.uint8).view(torch.float8_e5m2fnuz).float().tolist()
    assert steps == [1.0, 1.25]
    assert float(ml_dtypes.finfo(ml_dtypes.float8_e5m2fnuz).eps) == HAND["e5m2fnuz"]["eps"] == 0.25


@pytest.mark.parametrize("name", FMT_NAMES)
def test_metadata_matches_ml_dtypes_finfo_exact(name):
    f, fi = F.FORMATS[name], ml_dtypes.finfo(_ml_dtype(name))
    assert float(fi.max) == f.max_finite
    assert float(fi.smallest_normal) == float(fi.tiny) == f.min_normal
    assert float(fi.smallest_subnormal) == f.min_subnormal
    assert float(fi.eps) == HAND[name]["eps"]
    assert fi.nmant == f.man_bits and fi.nexp == f.exp_bits
    assert fi.minexp == f.min_exponent


# ----------------------------------------------------------------------------------------------------------
# encoder vs torch and ml_dtypes on dense sweeps
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TORCH_SWEEP_NAMES)
def test_encode_sweep_matches_torch_exact(name):
    x = sweep(name)
    oracle = ours(x, name, TORCH_POLICY[name])
    want = _torch_expected(x, name, oracle)
    assert_codes_equal(x, torch_codes(x, name), want, f"torch .to({name}) vs oracle[{TORCH_POLICY[name]}]")
    if name == "e8m0fnu":  # the documented exceptions are exercised by the sweep, not vacuous
        sub, ovf = _e8m0_quirks(x)
        assert sub.sum() >= 4 and ovf.sum() >= 4


@pytest.mark.parametrize("name", FMT_NAMES)
def test_encode_sweep_matches_ml_dtypes_exact(name):
    x = sweep(name)
    oracle = ours(x, name, ML_POLICY[name])
    want = _ml_expected(x, name, oracle)
    assert_codes_equal(x, ml_codes(x, name), want, f"ml_dtypes {name} vs oracle[{ML_POLICY[name]}]")


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", TORCH_SWEEP_NAMES)
def test_encode_bf16_fp16_sources_match_torch_exact(name, src):
    """torch casts straight from bf16/fp16; the oracle takes the same tensor (upcast to fp32 exactly)."""
    t = torch.from_numpy(np.array(sweep(name))).to(src)
    x = t.float().numpy()
    oracle = F.encode_codes(t, name, TORCH_POLICY[name])
    assert_codes_equal(x, oracle, ours(x, name, TORCH_POLICY[name]), "bf16/fp16 input vs its fp32 upcast")
    got = t.to(F.FORMATS[name].torch_dtype()).view(torch.uint8).numpy()
    assert_codes_equal(x, got, _torch_expected(x, name, oracle), f"torch {src} → {name}")


# Overflow thresholds, hand-derived: a finite |x| overflows iff it rounds (RNE) above max, i.e. |x| > max +
# step/2, or |x| == max + step/2 when max's mantissa is odd (the tie then goes to the even value above max).
OVERFLOW_TIE = {
    "e4m3fn": (464.0, False),    # 448 + 32/2; 448 = 1.110b·2^8 has even mantissa → the tie stays at 448
    "e5m2": (61440.0, True),     # 57344 + 8192/2; 57344 = 1.11b·2^15, odd → tie goes up to 65536: overflow
    "e4m3fnuz": (248.0, True),   # 240 + 16/2; 240 = 1.111b·2^7, odd → tie overflows
    "e5m2fnuz": (61440.0, True),  # 57344 + 8192/2; odd → tie overflows
}


def _overflows(x: np.ndarray, name: str) -> np.ndarray:
    tie, tie_overflows = OVERFLOW_TIE[name]
    a = np.abs(x.astype(np.float64))
    return (a > tie) | ((a == tie) & tie_overflows)  # includes ±inf; NaN compares False


def _policy_code(name: str, policy: str, negative: np.ndarray) -> np.ndarray:
    """Hand-derived code for an overflowing input of the given sign under ``policy``."""
    sign = np.where(negative, 0x80, 0x00)
    if policy == "saturate":
        return sign | HAND[name]["max_code"]
    if policy == "inf":
        return sign | HAND[name]["inf_code"]
    if name in FNUZ:
        return np.full(negative.shape, 0x80)  # the single, unsigned NaN
    return sign | HAND[name]["nan_code"]


@pytest.mark.parametrize(("name", "policy"), FORMAT_POLICIES)
def test_encode_sweep_every_policy_matches_torch_outside_overflow_exact(name, policy):
    """Every policy equals torch's cast wherever nothing overflows, and the hand-derived policy code where the
    input overflows (e8m0fnu: the policy is ignored, so every policy equals the default)."""
    x = sweep(name)
    got = ours(x, name, policy)
    if name == "e8m0fnu":
        assert_codes_equal(x, got, ours(x, name), f"e8m0fnu[{policy}] vs default")
        return
    want = torch_codes(x, name).astype(np.int64)
    ov = _overflows(x, name)
    neg = (_bits(x) >> 31) == 1
    want[ov] = _policy_code(name, policy, neg[ov])
    assert ov.sum() > 1000 and (~ov & np.isfinite(x)).sum() > 1000
    assert_codes_equal(x, got, want, f"oracle {name}[{policy}] vs torch + hand overflow rule")


# ----------------------------------------------------------------------------------------------------------
# known policy differences, asserted explicitly
# ----------------------------------------------------------------------------------------------------------

def _e4m3fn_overflow_inputs() -> np.ndarray:
    # 464 is the tie that still rounds to 448, 464 + 1 ulp is the first overflowing fp32
    return _f32([float(_up([464.0])[0]), 465.0, 480.0, 500.0, 1e6, 1e30, F32_MAX, INF])


def test_e4m3fn_overflow_policy_torch_saturates_ml_dtypes_nans_exact():
    pos = _e4m3fn_overflow_inputs()
    x = np.concatenate([pos, -pos])
    neg = np.repeat([False, True], pos.size)
    t, m = torch_codes(x, "e4m3fn"), ml_codes(x, "e4m3fn")
    assert_codes_equal(x, t, np.where(neg, 0xFE, 0x7E), "torch e4m3fn overflow (saturate to ±448)")
    assert_codes_equal(x, m, np.where(neg, 0xFF, 0x7F), "ml_dtypes e4m3fn overflow (signed NaN)")
    assert_codes_equal(x, ours(x, "e4m3fn", "saturate"), t, "oracle[saturate] vs torch")
    assert_codes_equal(x, ours(x, "e4m3fn", "nan"), m, "oracle[nan] vs ml_dtypes")
    # and right below the overflow region all three agree on 448
    below = _f32([448.0, float(_up([448.0])[0]), 464.0, -464.0])
    for codes in (torch_codes(below, "e4m3fn"), ml_codes(below, "e4m3fn"), ours(below, "e4m3fn", "nan")):
        assert _hex(codes) == ["0x7E", "0x7E", "0x7E", "0xFE"]


def test_torch_e4m3fn_saturation_canary_exact():
    """Canary: the suite expects torch ≥ 2.12, whose eager e4m3fn cast saturates (PyTorch PR #178817)."""
    pos = _e4m3fn_overflow_inputs()
    x = np.concatenate([pos, -pos])
    got = torch_codes(x, "e4m3fn")
    want = np.repeat([0x7E, 0xFE], pos.size)
    assert np.array_equal(got, want), (
        f"torch {torch.__version__}: float32 → float8_e4m3fn no longer saturates on overflow "
        f"(inputs {x.tolist()} gave {_hex(got)}, expected ±448 = 0x7E/0xFE). The fp8rl suite's expectation is "
        f"for torch >= 2.12 (eager CPU casts saturate, incl. ±inf → ±448); older torch gave NaN. Pin torch or "
        f"switch the torch-facing tests to overflow='nan'."
    )


@pytest.mark.parametrize("name", FNUZ)
def test_fnuz_overflow_gives_unsigned_nan_in_torch_ml_dtypes_and_oracle_exact(name):
    tie, _ = OVERFLOW_TIE[name]
    pos = _f32([tie, float(_up([tie])[0]), 2 * tie, 1e30, F32_MAX, INF])
    x = np.concatenate([pos, -pos])
    nan = np.full(x.shape, 0x80)
    assert_codes_equal(x, torch_codes(x, name), nan, f"torch {name} overflow")
    assert_codes_equal(x, ml_codes(x, name), nan, f"ml_dtypes {name} overflow")
    assert_codes_equal(x, ours(x, name, "nan"), nan, f"oracle {name}[nan] overflow")
    mc = HAND[name]["max_code"]
    assert_codes_equal(x, ours(x, name, "saturate"), np.repeat([mc, 0x80 | mc], pos.size), "saturate")
    # just below the tie every implementation gives ±max
    below = _f32([float(_down([tie])[0]), -float(_down([tie])[0])])
    for codes in (torch_codes(below, name), ml_codes(below, name), ours(below, name, "nan")):
        assert codes.tolist() == [mc, 0x80 | mc]


@pytest.mark.parametrize("name", F.ELEMENT_FORMATS)
def test_saturate_maps_inf_to_max_exact(name):
    x = _f32([INF, -INF])
    mc = HAND[name]["max_code"]
    assert ours(x, name, "saturate").tolist() == [mc, 0x80 | mc]
    if TORCH_POLICY[name] == "saturate":
        assert torch_codes(x, name).tolist() == [mc, 0x80 | mc]


def test_e5m2_overflow_to_inf_exact():
    """e5m2: 57344 ≤ x < 61440 → 57344 (0x7B); 61440 is the tie between 57344 (odd) and 65536 (even) → inf."""
    below = _f32([57344.0, float(_up([57344.0])[0]), 60000.0, float(_down([61440.0])[0])])
    above = _f32([61440.0, float(_up([61440.0])[0]), 65504.0, 1e6, F32_MAX, INF])
    for x, code in ((below, 0x7B), (above, 0x7C)):
        xs = np.concatenate([x, -x])
        want = np.repeat([code, 0x80 | code], x.size)
        assert_codes_equal(xs, torch_codes(xs, "e5m2"), want, "torch e5m2")
        assert_codes_equal(xs, ml_codes(xs, "e5m2"), want, "ml_dtypes e5m2")
        assert_codes_equal(xs, ours(xs, "e5m2", "inf"), want, "oracle e5m2[inf]")
    xs = np.concatenate([above, -above])
    assert _hex(np.unique(ours(xs, "e5m2", "saturate"))) == ["0x7B", "0xFB"]
    assert _hex(np.unique(ours(xs, "e5m2", "nan"))) == ["0x7F", "0xFF"]


def test_e8m0_ties_go_up_exact():
    """e8m0 rounding (torch, ml_dtypes, oracle default): 1.5·2^k → 2^(k+1); just below → 2^k; for every k."""
    k = np.arange(-126, 127)  # 1.5·2^k normal in fp32 and 2^(k+1) ≤ 2^127
    ties = np.ldexp(1.5, k).astype(np.float32)
    exact = np.ldexp(1.0, k).astype(np.float32)
    cases = [
        (ties, k + 1 + 127),
        (_down(ties), k + 127),
        (_up(ties), k + 1 + 127),
        (exact, k + 127),
        (_up(exact), k + 127),
        (_down(exact), k + 127),  # 2^k - ulp = 1.99..·2^(k-1) ≥ 1.5·2^(k-1) → 2^k
    ]
    for x, want in cases:
        for got, what in ((torch_codes(x, "e8m0fnu"), "torch"), (ml_codes(x, "e8m0fnu"), "ml_dtypes"),
                          (ours(x, "e8m0fnu"), "oracle")):
            assert_codes_equal(x, got, want, f"{what} e8m0fnu ties up")
    # docs/platform-notes.md §1's measured vector
    x = _f32([2.5, 2.9, 3.0, 3.1, 5.9, 6.0, 6.1, 1.5, 1.0000001, 0.75, 0.7])
    want = F.encode_codes(_f32([2, 2, 4, 4, 4, 8, 8, 2, 1, 1, 0.5]), "e8m0fnu")
    assert_codes_equal(x, torch_codes(x, "e8m0fnu"), want, "torch e8m0 measured vector")
    assert_codes_equal(x, ours(x, "e8m0fnu"), want, "oracle e8m0 measured vector")


def test_e8m0_rounding_modes_hand_derived_exact():
    x = _f32([1.0, float(_up([1.0])[0]), 1.5, 1.99, 0.75, 3.0, 2.0**-127, 2.0**127])
    # 2^e ↔ code e + 127: 1.0 → 0x7F, 2 → 0x80, 4 → 0x81, 0.5 → 0x7E
    assert _hex(F.encode_codes(x, "e8m0fnu", e8m0_rounding="ceil")) == [
        "0x7F", "0x80", "0x80", "0x80", "0x7F", "0x81", "0x00", "0xFE"]
    assert _hex(F.encode_codes(x, "e8m0fnu", e8m0_rounding="floor")) == [
        "0x7F", "0x7F", "0x7F", "0x7F", "0x7E", "0x80", "0x00", "0xFE"]
    assert _hex(F.encode_codes(x, "e8m0fnu", e8m0_rounding="nearest_ties_up")) == [
        "0x7F", "0x7F", "0x80", "0x80", "0x7F", "0x81", "0x00", "0xFE"]
    with pytest.raises(ValueError, match="e8m0_rounding"):
        F.encode_codes(x, "e8m0fnu", e8m0_rounding="nearest_even")


def test_e8m0_zero_negative_handling_torch_vs_ml_dtypes_exact():
    """e8m0fnu has no zero and no sign. torch (and the oracle) ignore the sign and send ±0 (and anything tiny)
    to 2^-127 (0x00); ml_dtypes sends ±0 and every negative input to NaN (0xFF). ±inf/NaN → 0xFF in all."""
    x = _f32([0.0, -0.0, -1.0, -1.5, -3.0, -2.0**-127, -1e-45, -(2.0**127), 1e-45, -INF, INF, np.nan])
    torch_want = [0x00, 0x00, 0x7F, 0x80, 0x81, 0x00, 0x00, 0xFE, 0x00, 0xFF, 0xFF, 0xFF]
    ml_want = [0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x00, 0xFF, 0xFF, 0xFF]
    assert_codes_equal(x, torch_codes(x, "e8m0fnu"), torch_want, "torch e8m0 zero/negative")
    assert_codes_equal(x, ml_codes(x, "e8m0fnu"), ml_want, "ml_dtypes e8m0 zero/negative")
    for policy in F.E8M0FNU.allowed_overflow():
        assert_codes_equal(x, ours(x, "e8m0fnu", policy), torch_want, f"oracle e8m0[{policy}]")


#: fp32 subnormals 2^-127 + 1 ulp, 1.25·2^-127, 1.5·2^-127 - 1 ulp: where torch rounds up and the oracle does not
E8M0_SUBNORMAL_SPLIT = [0x00400001, 0x00500000, 0x005FFFFF]
#: the rest of the subnormal range, where every implementation agrees
E8M0_SUBNORMAL_AGREE = ([1, 0x00200000, 0x003FFFFF, 0x00400000, 0x00600000, 0x00600001, 0x007FFFFF],
                        [0x00, 0x00, 0x00, 0x00, 0x01, 0x01, 0x01])


@pinned(*TORCH_E8M0_PIN)
def test_e8m0_fp32_subnormal_rounding_torch_vs_oracle_exact():
    """Known difference: torch sends fp32 subnormals in (2^-127, 1.5·2^-127) to 2^-126 (0x01): it rounds the fp32
    exponent field with guard/round/sticky bits, for which a subnormal's implicit bit is 0. The oracle rounds the
    value: 2^-127·(1+δ) with δ < 1/2 is nearest to 2^-127 (0x00)."""
    x = _from_bits(E8M0_SUBNORMAL_SPLIT)
    assert torch_codes(x, "e8m0fnu").tolist() == [0x01] * 3
    assert ours(x, "e8m0fnu").tolist() == [0x00] * 3
    agree, want = E8M0_SUBNORMAL_AGREE  # everywhere else in the subnormal range torch and the oracle agree
    for got in (torch_codes(_from_bits(agree), "e8m0fnu"), ours(_from_bits(agree), "e8m0fnu")):
        assert got.tolist() == want


@pinned(*ML_E8M0_SUBNORMAL_UP)
def test_e8m0_fp32_subnormal_rounding_ml_dtypes_before_0_7_rounds_up_exact():
    """Known difference up to ml_dtypes 0.6.x: the same rounding as torch (0x01 where the oracle gives 0x00)."""
    assert ml_codes(_from_bits(E8M0_SUBNORMAL_SPLIT), "e8m0fnu").tolist() == [0x01] * 3
    agree, want = E8M0_SUBNORMAL_AGREE
    assert ml_codes(_from_bits(agree), "e8m0fnu").tolist() == want


@pinned(*ML_E8M0_SUBNORMAL_NEAREST)
def test_e8m0_fp32_subnormal_rounding_ml_dtypes_from_0_7_matches_oracle_exact():
    """ml_dtypes 0.7.0 changed e8m0fnu rounding of fp32 subnormals: (2^-127, 1.5·2^-127) now gives 0x00, code for
    code the oracle's, over the whole fp32 subnormal range."""
    x = _from_bits(E8M0_SUBNORMAL_SPLIT)
    assert ml_codes(x, "e8m0fnu").tolist() == ours(x, "e8m0fnu").tolist() == [0x00] * 3
    every_subnormal = _from_bits(np.arange(1, 0x00800000, 97, dtype=np.uint32))
    assert_codes_equal(every_subnormal, ml_codes(every_subnormal, "e8m0fnu"), ours(every_subnormal, "e8m0fnu"),
                       "ml_dtypes e8m0fnu vs oracle on fp32 subnormals")


@pinned(*TORCH_E8M0_PIN)
def test_e8m0_overflow_torch_nans_oracle_saturates_exact():
    """Known difference: finite x ≥ 1.5·2^127 rounds up past 2^127; torch gives NaN (0xFF), the oracle clamps to
    2^127 (0xFE) under every policy (its e8m0 path ignores ``overflow``)."""
    x = _from_bits([0x7F400000, 0x7F400001, 0x7F7FFFFF])  # 1.5·2^127, +1 ulp, FLT_MAX
    assert torch_codes(x, "e8m0fnu").tolist() == [0xFF] * 3
    for policy in F.E8M0FNU.allowed_overflow():
        assert ours(x, "e8m0fnu", policy).tolist() == [0xFE] * 3
    below = _from_bits([0x7F000000, 0x7F3FFFFF])  # 2^127, 1.5·2^127 - 1 ulp
    for got in (torch_codes(below, "e8m0fnu"), ours(below, "e8m0fnu")):
        assert got.tolist() == [0xFE, 0xFE]


@pinned(*ML_E8M0_OVERFLOW_NAN)
def test_e8m0_overflow_ml_dtypes_nans_exact():
    """Known difference: ml_dtypes, like torch, gives NaN (0xFF) for finite x ≥ 1.5·2^127 (0xFE below)."""
    assert ml_codes(_from_bits([0x7F400000, 0x7F400001, 0x7F7FFFFF]), "e8m0fnu").tolist() == [0xFF] * 3
    assert ml_codes(_from_bits([0x7F000000, 0x7F3FFFFF]), "e8m0fnu").tolist() == [0xFE, 0xFE]


# fp32 NaN inputs: quiet, signalling, full payload, other payload; the same with the sign bit set.
NAN_BITS = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000]
NAN_CODES_BY_IMPL = {
    # name: (torch +NaN, torch -NaN), (ml_dtypes +NaN, -NaN), (oracle +NaN, -NaN)
    "e4m3fn": ((0x7F, 0xFF), (0x7F, 0xFF), (0x7F, 0xFF)),
    "e5m2": ((0x7F, 0xFF), (0x7E, 0xFE), (0x7F, 0xFF)),  # ml_dtypes' e5m2 NaN has mantissa 10, torch's 11
    "e4m3fnuz": ((0x80, 0x80), (0x80, 0x80), (0x80, 0x80)),
    "e5m2fnuz": ((0x80, 0x80), (0x80, 0x80), (0x80, 0x80)),
    "e8m0fnu": ((0xFF, 0xFF), (0xFF, 0xFF), (0xFF, 0xFF)),
}


@pytest.mark.parametrize("name", FMT_NAMES)
def test_nan_sign_and_bit_patterns_exact(name):
    x = _from_bits(NAN_BITS + [b | 0x80000000 for b in NAN_BITS])
    n = len(NAN_BITS)
    (tp, tn), (mp, mn), (op, on) = NAN_CODES_BY_IMPL[name]
    assert_codes_equal(x, torch_codes(x, name), [tp] * n + [tn] * n, f"torch {name} NaN")
    assert_codes_equal(x, ml_codes(x, name), [mp] * n + [mn] * n, f"ml_dtypes {name} NaN")
    for policy in F.FORMATS[name].allowed_overflow():
        assert_codes_equal(x, ours(x, name, policy), [op] * n + [on] * n, f"oracle {name}[{policy}] NaN")


@pytest.mark.parametrize("name", FMT_NAMES)
def test_zero_and_fp32_subnormals_flush_exact(name):
    """±0 and fp32 subnormals (all below half the smallest FP8 subnormal) → signed zero; fnuz has no -0, so
    negatives go to +0 (0x00); e8m0 has no zero, its smallest code 0x00 (2^-127) takes them."""
    tiny = _from_bits([0, 1, 0x00012345, 0x007FFFFF])  # +0, smallest and largest fp32 subnormals
    x = np.concatenate([tiny, -tiny])
    if name in ("e4m3fn", "e5m2"):
        want = [0x00] * 4 + [0x80] * 4
    elif name in FNUZ:
        want = [0x00] * 8
    else:  # e8m0fnu: 0x007FFFFF ≈ 2^-126 (largest fp32 subnormal) → 0x01
        want = [0x00, 0x00, 0x00, 0x01] * 2
    for policy in F.FORMATS[name].allowed_overflow():
        assert_codes_equal(x, ours(x, name, policy), want, f"oracle {name}[{policy}]")
    assert_codes_equal(x, torch_codes(x, name), want, f"torch {name}")
    if name != "e8m0fnu":  # ml_dtypes e8m0: negatives/zero → NaN (see the zero/negative test)
        assert_codes_equal(x, ml_codes(x, name), want, f"ml_dtypes {name}")


# ----------------------------------------------------------------------------------------------------------
# overflow policies vs hand-derived expectations; argument errors
# ----------------------------------------------------------------------------------------------------------

# (input, {policy: code}) for positive inputs; negatives mirror with the sign bit (fnuz NaN stays 0x80).
HAND_OVERFLOW = {
    "e4m3fn": [  # max 448 (0x7E); 464 is the tie 448|480 → even 448; NaN 0x7F
        (448.0, {"saturate": 0x7E, "nan": 0x7E}),
        (464.0, {"saturate": 0x7E, "nan": 0x7E}),
        ("464+ulp", {"saturate": 0x7E, "nan": 0x7F}),
        (480.0, {"saturate": 0x7E, "nan": 0x7F}),
        (INF, {"saturate": 0x7E, "nan": 0x7F}),
    ],
    "e5m2": [  # max 57344 (0x7B); 61440 tie 57344|65536 → even 65536: overflow; inf 0x7C; NaN 0x7F
        (57344.0, {"saturate": 0x7B, "nan": 0x7B, "inf": 0x7B}),
        ("61440-ulp", {"saturate": 0x7B, "nan": 0x7B, "inf": 0x7B}),
        (61440.0, {"saturate": 0x7B, "nan": 0x7F, "inf": 0x7C}),
        (1e6, {"saturate": 0x7B, "nan": 0x7F, "inf": 0x7C}),
        (INF, {"saturate": 0x7B, "nan": 0x7F, "inf": 0x7C}),
    ],
    "e4m3fnuz": [  # max 240 (0x7F); 248 tie 240|256 → even 256: overflow; NaN 0x80
        (240.0, {"saturate": 0x7F, "nan": 0x7F}),
        ("248-ulp", {"saturate": 0x7F, "nan": 0x7F}),
        (248.0, {"saturate": 0x7F, "nan": 0x80}),
        (448.0, {"saturate": 0x7F, "nan": 0x80}),
        (INF, {"saturate": 0x7F, "nan": 0x80}),
    ],
    "e5m2fnuz": [  # max 57344 (0x7F); 61440 tie → overflow; NaN 0x80
        (57344.0, {"saturate": 0x7F, "nan": 0x7F}),
        ("61440-ulp", {"saturate": 0x7F, "nan": 0x7F}),
        (61440.0, {"saturate": 0x7F, "nan": 0x80}),
        (1e6, {"saturate": 0x7F, "nan": 0x80}),
        (INF, {"saturate": 0x7F, "nan": 0x80}),
    ],
    "e8m0fnu": [  # max 2^127 (0xFE); the oracle clamps finite overflow; inf → NaN 0xFF whatever the policy
        (2.0**127, {"saturate": 0xFE, "nan": 0xFE}),
        (F32_MAX, {"saturate": 0xFE, "nan": 0xFE}),
        (INF, {"saturate": 0xFF, "nan": 0xFF}),
    ],
}


def _hand_input(v) -> float:
    if isinstance(v, str):
        base, op = (v[:-4], v[-4:])
        return float((_up if op == "+ulp" else _down)([float(base)])[0])
    return v


@pytest.mark.parametrize(("name", "policy"), FORMAT_POLICIES)
def test_overflow_policy_hand_derived_exact(name, policy):
    pos = _f32([_hand_input(v) for v, _ in HAND_OVERFLOW[name]])
    want_pos = np.array([codes[policy] for _, codes in HAND_OVERFLOW[name]])
    assert_codes_equal(pos, ours(pos, name, policy), want_pos, f"{name}[{policy}] positive")
    if name == "e8m0fnu":
        assert_codes_equal(-pos, ours(-pos, name, policy), want_pos, f"{name}[{policy}] sign ignored")
        return
    want_neg = np.where(want_pos == 0x80, 0x80, want_pos | 0x80) if name in FNUZ else want_pos | 0x80
    assert_codes_equal(-pos, ours(-pos, name, policy), want_neg, f"{name}[{policy}] negative")


@pytest.mark.parametrize("name", [n for n in FMT_NAMES if not F.FORMATS[n].has_inf])
def test_inf_policy_without_infinity_raises(name):
    with pytest.raises(ValueError, match="overflow"):
        F.encode_codes(_f32([1.0]), name, "inf")
    with pytest.raises(ValueError, match="overflow"):
        F.round_to_format(_f32([1.0]), name, "inf")


def test_unknown_overflow_policy_raises():
    with pytest.raises(ValueError, match="overflow"):
        F.encode_codes(_f32([1.0]), "e4m3fn", "clamp")


@pytest.mark.parametrize("bad", ["e4m3", "E4M3FN", "fp8", "float8_e4m3fn", ""])
def test_unknown_fmt_raises_value_error_naming_fmt(bad):
    for call in (lambda: F.get_format(bad), lambda: F.encode_codes(_f32([1.0]), bad),
                 lambda: F.decode_codes(np.array([0]), bad), lambda: F.ulp_distance([0], [1], bad)):
        with pytest.raises(ValueError, match="fmt"):
            call()


@pytest.mark.parametrize(
    "bad",
    [np.array([1, 2], np.int32), np.array([1], np.int64), np.array([True]), [1, 2], np.array([1], np.uint8)],
    ids=["int32", "int64", "bool", "pylist_int", "uint8"],
)
def test_non_float_input_raises_type_error_naming_x(bad):
    with pytest.raises(TypeError, match="x"):
        F.encode_codes(bad, "e4m3fn")


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
def test_non_float_torch_tensor_raises_type_error_naming_x(dtype):
    with pytest.raises(TypeError, match="x"):
        F.encode_codes(torch.tensor([1, 2], dtype=dtype), "e4m3fn")


def test_float_inputs_of_other_widths_are_accepted_exact():
    v = [1.0625, 500.0, -3.0]
    want = ours(_f32(v), "e4m3fn")
    assert F.encode_codes(np.array(v, np.float64), "e4m3fn").tolist() == want.tolist()
    assert F.encode_codes(np.array(v, np.float16), "e4m3fn").tolist() == want.tolist()
    assert F.encode_codes(torch.tensor(v, dtype=torch.bfloat16), "e4m3fn").tolist() == want.tolist()
    assert F.encode_codes(np.float32(1.0), "e4m3fn").shape == ()
    assert F.encode(_f32(v), "e4m3fn").dtype == torch.uint8


# ----------------------------------------------------------------------------------------------------------
# round trip
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "policy"), FORMAT_POLICIES)
def test_round_trip_every_non_nan_code_exact(name, policy):
    """decode → encode → code is the identity on every non-NaN code. (fnuz formats have no -0 code, so the
    -0 → +0 collapse happens only for the fp32 input -0.0, see test_zero_and_fp32_subnormals_flush_exact.)
    Inf codes round-trip only under policy "inf"; under the others they map to the policy's code."""
    codes = np.arange(256)
    v = code_table(name)
    keep = ~np.isnan(v)
    x = v[keep].astype(np.float32)
    got = ours(x, name, policy)
    want = codes[keep].copy()
    inf = np.isinf(x)
    if policy != "inf":
        want[inf] = _policy_code(name, policy, x[inf] < 0)
    assert_codes_equal(x, got, want, f"round trip {name}[{policy}]")
    # torch's cast agrees on the same round trip (its own policy)
    if policy == TORCH_POLICY[name]:
        assert_codes_equal(x, torch_codes(x, name), want, f"torch round trip {name}")
    rt = F.round_to_format(x, name, policy).numpy()
    assert np.array_equal(rt[~inf], x[~inf]) and rt.shape == x.shape


def test_round_to_format_matches_decode_of_encode_exact():
    x = sweep("e4m3fn")[:5000].reshape(50, 100)
    rt = F.round_to_format(x, "e4m3fn")
    assert rt.shape == (50, 100) and rt.dtype == torch.float32
    want = torch.from_numpy(np.array(x)).to(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(rt), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(rt), torch.nan_to_num(want))


# ----------------------------------------------------------------------------------------------------------
# ulp_distance
# ----------------------------------------------------------------------------------------------------------

ULP_CASES = {
    # (a, b, expected steps), hand-computed from the code layout
    "e4m3fn": [
        (0x00, 0x01, 1),    # 0 → smallest subnormal 2^-9
        (0x38, 0x39, 1),    # 1.0 → 1.125
        (0x37, 0x38, 1),    # 0.9375 (largest below 1) → 1.0, across a binade
        (0x7D, 0x7E, 1),    # 416 → 448
        (0x00, 0x80, 0),    # +0 / -0
        (0x80, 0x80, 0),
        (0x01, 0x81, 2),    # +2^-9 → -2^-9: two steps across zero
        (0x38, 0xB8, 112),  # 1.0 is 0x38 = 56 steps from 0, so ±1.0 are 112 apart
        (0x7E, 0xFE, 252),  # ±448: 2·126
        (0x7F, 0x00, -1),   # NaN
        (0x00, 0xFF, -1),
    ],
    "e5m2": [
        (0x3C, 0x3D, 1), (0x7A, 0x7B, 1),
        (0x7B, 0x7C, 1),    # max → +inf is one step
        (0x3C, 0xBC, 120),  # ±1.0: 2·60
        (0x00, 0x80, 0), (0x7C, 0x7D, -1), (0xFE, 0x01, -1),
    ],
    "e4m3fnuz": [
        (0x00, 0x01, 1), (0x7E, 0x7F, 1),
        (0x01, 0x81, 2),    # -2^-10 → 0 → +2^-10 (no -0 code)
        (0x40, 0xC0, 128),  # ±1.0 (bias 8: 1.0 = 0x40 = 64 steps)
        (0x80, 0x00, -1),   # 0x80 is NaN in fnuz
    ],
    "e5m2fnuz": [(0x00, 0x01, 1), (0x7E, 0x7F, 1), (0x01, 0x81, 2), (0x40, 0xC0, 128), (0x80, 0x7F, -1)],
    "e8m0fnu": [(0x7F, 0x80, 1), (0x00, 0xFE, 254), (0x00, 0x00, 0), (0xFF, 0x7F, -1)],  # unsigned
}


@pytest.mark.parametrize("name", FMT_NAMES)
def test_ulp_distance_hand_computed_cases_exact(name):
    cases = ULP_CASES[name]
    a = np.array([c[0] for c in cases], np.uint8)
    b = np.array([c[1] for c in cases], np.uint8)
    want = [c[2] for c in cases]
    assert F.ulp_distance(a, b, name).tolist() == want
    assert F.ulp_distance(b, a, name).tolist() == want  # symmetric


@pytest.mark.parametrize("name", FMT_NAMES)
def test_ulp_distance_all_pairs_match_value_rank_exact(name):
    """Independent definition: the number of distinct representable values (±0 counted once, inf as a value)
    strictly between two codes, plus one — i.e. the difference of their ranks among the sorted values."""
    v = code_table(name)
    vals = np.unique(v[~np.isnan(v)])
    rank = np.where(np.isnan(v), -1, np.searchsorted(vals, np.where(np.isnan(v), 0.0, v)))
    a, b = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    want = np.where((rank[a] < 0) | (rank[b] < 0), -1, np.abs(rank[a] - rank[b]))
    got = F.ulp_distance(a.astype(np.uint8), b.astype(np.uint8), name)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{name}: {len(bad)} pairs differ, e.g. {[tuple(map(hex, p)) for p in bad[:5]]}"


@pytest.mark.parametrize("name, policy", [(n, p) for n, p in FORMAT_POLICIES if n != "e8m0fnu"])
def test_lookup_table_path_equals_direct_encoder_exact(name, policy):
    """Large inputs are encoded through a table built by the direct bit-level encoder; both paths must agree on
    every fp32 bit pattern class: 2^20 uniformly random patterns (all signs, exponents, NaN payloads, subnormals)
    plus every index's extreme low bits (all-zero, only bit 0 — the sticky bit's carry formula at its edge — only
    the highest, and all-one below the round bit). The input spans several table chunks and ends in a partial one."""
    rng = np.random.default_rng(20261129)
    f = F.FORMATS[name]
    shift = 23 - f.man_bits - 1
    tops = np.arange(1 << (32 - shift), dtype=np.uint64) << np.uint64(shift)
    low_ones = np.uint64((1 << shift) - 1)
    patterns = np.concatenate([rng.integers(0, 2**32, 1 << 20, dtype=np.uint64), tops, tops | low_ones,
                               tops | np.uint64(1 << (shift - 1)), tops | np.uint64(1)])
    x = patterns.astype(np.uint32).view(np.float32)
    assert x.size >= F._LUT_MIN_SIZE  # goes through the table
    assert x.size > 2 * F._LUT_CHUNK and x.size % F._LUT_CHUNK != 0  # several chunks, the last one partial
    via_table = F.encode_codes(x, name, policy)
    direct = F._encode_codes_direct(x, f, policy, "nearest_ties_up")
    mismatch = np.flatnonzero(via_table != direct)
    assert mismatch.size == 0, [hex(int(patterns[i])) for i in mismatch[:5]]


def test_bf16_bits_rne_matches_torch_and_ml_dtypes_exact():
    """The oracle's fp32 → bf16 rounding equals two independent peers on every tie class, overflow, subnormals and
    2^20 random fp32 bit patterns; NaN stays NaN (torch keeps payload bits, ml_dtypes and the oracle quiet it)."""
    import ml_dtypes
    from fp8rl.reference.formats import bf16_bits_rne

    rng = np.random.default_rng(11)
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    bits = np.concatenate([hi, hi | 0x8000, (hi | 0x8000) + 1, (hi | 0x8000) - 1,
                           rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)])
    x = bits.view(np.float32)
    ours = bf16_bits_rne(x)
    t = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)
    m = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    assert (ours[~nan] == t[~nan]).all() and (ours[~nan] == m[~nan]).all()
    assert ((ours[nan] & 0x7FFF) > 0x7F80).all()
    # hand-worked: 1 + 2^-8 is the tie between 1 and 1 + 2^-7 → even (1.0); 1 + 3·2^-8 → 1 + 2^-6 (even side up)
    assert bf16_bits_rne(np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8], np.float32)).tolist() == [0x3F80, 0x3F82]
    assert bf16_bits_rne(np.array([3.4028235e38], np.float32)).tolist() == [0x7F80]  # rounds past max → inf
