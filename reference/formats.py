"""FP8 formats as data, and a bit-level encoder/decoder that does not use torch's fp8 cast.

Every format is described by its exponent/mantissa widths, bias and special encodings. The encoder works on
the integer bits of fp32 inputs (numpy int64 arithmetic): it rounds the 24-bit fp32 significand to the target
precision with round-to-nearest-even, then applies an explicit overflow policy. The decoder builds values
from the code's fields with exact power-of-two arithmetic in float64.

Overflow policies (what happens to a finite value that rounds above ``max_finite``, and to ±inf):

* ``"saturate"``: clamp to ±max_finite (±inf → ±max). What CUDA ``__NV_SATFINITE`` and torch ≥ 2.12's e4m3fn
  cast do.
* ``"nan"``: produce the format's NaN (what ml_dtypes does for e4m3fn, and torch's fnuz casts).
* ``"inf"``: produce ±inf (IEEE-like; only e5m2 has an infinity).

NaN inputs always encode to NaN (sign preserved where the format has a signed NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import numpy as np
import torch

OverflowPolicy = Literal["saturate", "nan", "inf"]
OVERFLOW_POLICIES: tuple[str, ...] = ("saturate", "nan", "inf")


@dataclass(frozen=True)
class FP8Format:
    """An 8-bit floating-point format.

    value(code) = (-1)^s · 2^(e - bias) · (1 + m / 2^man_bits) for normal codes (exponent field e ≥ 1),
    (-1)^s · 2^(1 - bias) · (m / 2^man_bits) for subnormals (e == 0).
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    has_sign: bool
    has_inf: bool
    # How NaN is encoded: "all_ones" (exp and mantissa all ones, e4m3fn: 0x7F/0xFF), "ieee" (exp all ones and
    # mantissa != 0, e5m2), "neg_zero" (0x80 is the only NaN, fnuz formats), "all_ones_unsigned" (e8m0fnu 0xFF).
    nan_encoding: str
    has_subnormals: bool
    has_zero: bool
    torch_dtype_name: str
    ml_dtypes_name: str

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal number: 1 - bias."""
        return 1 - self.bias if self.has_subnormals else -self.bias  # e8m0: exponent field 0 is 2^-127

    @property
    def max_finite(self) -> float:
        return float(decode_codes(np.array([self.max_finite_code]), self)[0])

    @property
    def max_finite_code(self) -> int:
        """Code of the largest positive finite value."""
        e_max = (1 << self.exp_bits) - 1
        m_max = (1 << self.man_bits) - 1
        if self.nan_encoding == "all_ones":
            e, m = e_max, m_max - 1
        elif self.nan_encoding == "ieee":
            e, m = e_max - 1, m_max
        elif self.nan_encoding == "neg_zero":
            e, m = e_max, m_max
        else:  # e8m0: 0xFE is the largest, 0xFF is NaN
            return 0xFE
        return (e << self.man_bits) | m

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.min_exponent

    @property
    def min_subnormal(self) -> float:
        if not self.has_subnormals:
            return self.min_normal
        return 2.0 ** (self.min_exponent - self.man_bits)

    @property
    def nan_code(self) -> int:
        """The canonical positive NaN code."""
        return {"all_ones": 0x7F, "ieee": 0x7F, "neg_zero": 0x80, "all_ones_unsigned": 0xFF}[self.nan_encoding]

    @property
    def inf_code(self) -> int | None:
        """Code of +inf (None if the format has no infinity)."""
        if not self.has_inf:
            return None
        return ((1 << self.exp_bits) - 1) << self.man_bits

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype_name)

    def allowed_overflow(self) -> tuple[str, ...]:
        return ("saturate", "nan", "inf") if self.has_inf else ("saturate", "nan")


E4M3FN = FP8Format("e4m3fn", 4, 3, 7, True, False, "all_ones", True, True, "float8_e4m3fn", "float8_e4m3fn")
E5M2 = FP8Format("e5m2", 5, 2, 15, True, True, "ieee", True, True, "float8_e5m2", "float8_e5m2")
E4M3FNUZ = FP8Format("e4m3fnuz", 4, 3, 8, True, False, "neg_zero", True, True, "float8_e4m3fnuz", "float8_e4m3fnuz")
E5M2FNUZ = FP8Format("e5m2fnuz", 5, 2, 16, True, False, "neg_zero", True, True, "float8_e5m2fnuz", "float8_e5m2fnuz")
E8M0FNU = FP8Format("e8m0fnu", 8, 0, 127, False, False, "all_ones_unsigned", False, False, "float8_e8m0fnu",
                    "float8_e8m0fnu")

FORMATS: dict[str, FP8Format] = {f.name: f for f in (E4M3FN, E5M2, E4M3FNUZ, E5M2FNUZ, E8M0FNU)}
#: The formats with a sign and a mantissa (what tensors are quantized to; e8m0 is a scale format).
ELEMENT_FORMATS: tuple[str, ...] = ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz")


def get_format(fmt: str | FP8Format) -> FP8Format:
    """Look a format up by name; raises ValueError naming the known formats."""
    if isinstance(fmt, FP8Format):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"fmt: unknown FP8 format {fmt!r}; expected one of {sorted(FORMATS)}") from None


def _as_numpy_f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating-point array or tensor, got dtype {x.dtype}")
        x = x.detach().to("cpu", torch.float32).numpy()
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"x: expected a floating-point array or tensor, got dtype {arr.dtype}")
        arr = arr.astype(np.float32)
    return arr


def decode_codes(codes, fmt: str | FP8Format) -> np.ndarray:
    """Decode uint8 codes to float64 values (NaN for NaN codes, ±inf for inf codes)."""
    f = get_format(fmt)
    c = np.asarray(codes.numpy() if isinstance(codes, torch.Tensor) else codes).astype(np.int64) & 0xFF
    if f.name == "e8m0fnu":
        out = np.ldexp(1.0, (c - f.bias).astype(np.int64))
        return np.where(c == 0xFF, np.nan, out)
    sign_bit = 1 << (f.exp_bits + f.man_bits)
    s = (c & sign_bit) != 0
    e = (c >> f.man_bits) & ((1 << f.exp_bits) - 1)
    m = c & ((1 << f.man_bits) - 1)
    frac = m.astype(np.float64) / float(1 << f.man_bits)
    normal = np.ldexp(1.0 + frac, (e - f.bias).astype(np.int64))
    sub = np.ldexp(frac, np.full_like(e, f.min_exponent))
    mag = np.where(e == 0, sub, normal)
    e_max = (1 << f.exp_bits) - 1
    if f.nan_encoding == "all_ones":
        is_nan = (e == e_max) & (m == (1 << f.man_bits) - 1)
        is_inf = np.zeros_like(is_nan)
    elif f.nan_encoding == "ieee":
        is_nan = (e == e_max) & (m != 0)
        is_inf = (e == e_max) & (m == 0)
    else:  # neg_zero: 0x80 is NaN, no -0
        is_nan = c == 0x80
        is_inf = np.zeros_like(is_nan)
    mag = np.where(is_inf, np.inf, mag)
    val = np.where(s, -mag, mag)
    return np.where(is_nan, np.nan, val)


def decode(codes, fmt: str | FP8Format) -> torch.Tensor:
    """Decode uint8 codes (tensor or array) to a float32 tensor (every FP8 value is exact in fp32)."""
    return torch.from_numpy(decode_codes(codes, fmt).astype(np.float32))


def _round_shift_rne(sig: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """round_to_nearest_even(sig / 2^shift) for non-negative int64 sig and shift ≥ 0 (elementwise)."""
    shift = np.minimum(shift, 62)
    q = sig >> shift
    rem = sig - (q << shift)
    half = np.where(shift > 0, np.left_shift(np.int64(1), np.maximum(shift - 1, 0)), 0)
    up = np.where(shift > 0, (rem > half) | ((rem == half) & ((q & 1) == 1)), False)
    return q + up.astype(np.int64)


def encode_codes(x, fmt: str | FP8Format, overflow: OverflowPolicy = "saturate",
                 e8m0_rounding: Literal["nearest_ties_up", "ceil", "floor"] = "nearest_ties_up") -> np.ndarray:
    """Encode fp32 values to uint8 codes with round-to-nearest-even and the given overflow policy.

    ``x`` is rounded to fp32 first (inputs are fp32/bf16/fp16 in every engine we test). For e8m0fnu (a scale
    format without sign or zero) ``e8m0_rounding`` selects how the significand is rounded: ``nearest_ties_up``
    (torch's cast: 1.5·2^e → 2^(e+1)), ``ceil`` (UE8M0 scales) or ``floor``; zero/negative/tiny inputs map to
    2^-127 (code 0) and the sign is ignored, matching torch. e8m0 ignores ``overflow``: finite values that round
    above 2^127 clamp to 0xFE (2^127; torch gives NaN 0xFF) and ±inf/NaN give 0xFF. Known difference from torch: fp32
    subnormal inputs in [2^-127, 1.5·2^-127) encode to 2^-127 here (the nearest value) and to 2^-126 in torch,
    which rounds the exponent field bitwise.
    """
    f = get_format(fmt)
    _check_overflow(f, overflow)
    a = _as_numpy_f32(x)
    if f.name != "e8m0fnu" and a.size >= _LUT_MIN_SIZE:
        out = np.empty(a.shape, dtype=np.uint8)
        encode_codes_into(np.ascontiguousarray(a).reshape(-1), out.reshape(-1), f.name, overflow)
        return out
    return _encode_codes_direct(a, f, overflow, e8m0_rounding)


def _check_overflow(f: FP8Format, overflow: str) -> None:
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow: expected one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if overflow == "inf" and not f.has_inf:
        raise ValueError(f"overflow: {f.name} has no infinity; use 'saturate' or 'nan'")


#: inputs at least this large go through the lookup table (building a table costs ~16k direct encodes)
_LUT_MIN_SIZE = 1 << 15
#: elements per step of the table path: its index buffers (2 × 512 KiB) stay in cache between the passes
_LUT_CHUNK = 1 << 17
#: table lookups per torch call: at most torch's parallel grain size, so each runs on the calling thread
_GATHER_STEP = 1 << 15


def _lut_shift(f: FP8Format) -> int:
    """Bit position r of the fp32 round bit for a normal result: 23 − man_bits − 1."""
    return 23 - f.man_bits - 1


@cache
def _encode_lut(fmt: str, overflow: str) -> np.ndarray:
    """Code table indexed by i = 2·(b >> r) + sticky, b the fp32 bits, r = :func:`_lut_shift`, sticky = [b mod 2^r ≠ 0].

    The direct encoder's result depends only on the sign, the exponent field, the significand bits down to the
    round bit of a *normal* result (position r = 22 − man_bits), and whether any bit below is set (sticky): for
    subnormal results the rounding position is higher, so its round and sticky bits are functions of the same
    inputs; NaN vs inf and the overflow decision are too. So encoding one representative per index — the index's
    top bits followed by a single set bit when sticky — gives every fp32 input's code exactly. The table is built
    *with* the direct bit-level encoder, so it is the same oracle, only faster (tests compare both paths).
    """
    f = get_format(fmt)
    shift = _lut_shift(f)
    tops = np.arange(1 << (32 - shift), dtype=np.uint64)
    reps = np.empty(tops.size * 2, dtype=np.uint64)
    reps[0::2] = tops << np.uint64(shift)
    reps[1::2] = (tops << np.uint64(shift)) | np.uint64(1)
    values = reps.astype(np.uint32).view(np.float32)
    return _encode_codes_direct(values, f, overflow, "nearest_ties_up")


def encode_codes_into(a: np.ndarray, out: np.ndarray, fmt: str | FP8Format, overflow: OverflowPolicy = "saturate") -> None:
    """Write the codes of the contiguous 1-D fp32 array ``a`` into the uint8 array ``out`` (same length), through the
    table of :func:`_encode_lut`: equal to :func:`encode_codes` for every fp32 bit pattern (not for e8m0fnu).

    With b the fp32 bits as uint32 and r = :func:`_lut_shift`: ``i = 2·(b >> r) + (((b & (2^r − 1)) + 2^r − 1) >> r)``
    — adding 2^r − 1 to the low r bits carries into bit r exactly when one of them is set, so the second term is the
    sticky bit without a comparison; nothing overflows 32 bits (i < 2^31, so it is also a valid int32). ``out =
    table[i]`` (``torch.index_select``). It runs in steps of ``_LUT_CHUNK`` elements so that the index buffers stay
    in cache between the passes (a single pass over 16M elements would re-read them from memory six times).
    """
    f = get_format(fmt)
    if f.name == "e8m0fnu":
        raise ValueError("fmt: the table path encodes element formats; e8m0fnu goes through encode_codes")
    _check_overflow(f, overflow)
    if a.dtype != np.float32 or a.ndim != 1 or not a.flags.c_contiguous:
        raise TypeError(f"a: expected a contiguous 1-D float32 array, got {a.dtype} with shape {a.shape}")
    if out.dtype != np.uint8 or out.shape != a.shape:
        raise TypeError(f"out: expected a uint8 array of shape {a.shape}, got {out.dtype} {out.shape}")
    table = _encode_lut(f.name, overflow)
    table_t = torch.from_numpy(table)
    shift = np.uint32(_lut_shift(f))
    low = np.uint32((1 << int(shift)) - 1)
    bits = a.view(np.uint32)
    n = bits.size
    step = min(_LUT_CHUNK, n)
    index = np.empty(step, dtype=np.uint32)
    sticky = np.empty(step, dtype=np.uint32)
    for start in range(0, n, step):
        b = bits[start:start + step]
        ix, st = index[:b.size], sticky[:b.size]
        np.bitwise_and(b, low, out=st)
        np.add(st, low, out=st)
        np.right_shift(st, shift, out=st)
        np.right_shift(b, shift, out=ix)
        np.left_shift(ix, np.uint32(1), out=ix)
        np.bitwise_or(ix, st, out=ix)
        ixt, ot = torch.from_numpy(ix.view(np.int32)), torch.from_numpy(out[start:start + b.size])
        for k in range(0, b.size, _GATHER_STEP):  # torch's gather takes int32 indexes (np.take converts to int64)
            torch.index_select(table_t, 0, ixt[k:k + _GATHER_STEP], out=ot[k:k + _GATHER_STEP])


def _encode_codes_direct(a: np.ndarray, f: FP8Format, overflow: str, e8m0_rounding: str) -> np.ndarray:
    """The bit-level encoder (see :func:`encode_codes`): integer arithmetic on the fp32 bits."""
    bits = a.view(np.uint32).astype(np.int64)
    sign = (bits >> 31) & 1
    exp_field = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    is_nan = (exp_field == 0xFF) & (man != 0)
    is_inf = (exp_field == 0xFF) & (man == 0)
    # fp32 value = sig · 2^(E - 23) with a 24-bit significand (implicit bit for normals).
    sig = np.where(exp_field == 0, man, man | (1 << 23))
    big_e = np.where(exp_field == 0, -126, exp_field - 127)
    is_zero = sig == 0

    if f.name == "e8m0fnu":
        return _encode_e8m0(sig, big_e, is_nan, is_inf, is_zero, e8m0_rounding)

    # Position of the leading bit of sig (0..23) gives the value's binade: floor(log2|x|) = E - 23 + msb.
    msb = np.where(is_zero, 0, np.floor(np.log2(np.maximum(sig, 1))).astype(np.int64))
    log2_floor = big_e - 23 + msb
    target_e = np.maximum(log2_floor, f.min_exponent)  # binade of the result (subnormal range clamps)
    # quantum of the target = 2^(target_e - man_bits); n = RNE(|x| / quantum) = RNE(sig · 2^(E - 23 - target_e + mb))
    shift = target_e - f.man_bits - (big_e - 23)
    n = np.where(shift >= 0, _round_shift_rne(sig, np.maximum(shift, 0)), sig << np.maximum(-shift, 0))
    # Renormalise if rounding carried into the next binade.
    carry = n >= (1 << (f.man_bits + 1))
    target_e = np.where(carry, target_e + 1, target_e)
    n = np.where(carry, n >> 1, n)
    subnormal = n < (1 << f.man_bits)
    e_field = np.where(subnormal, 0, target_e + f.bias)
    m_field = np.where(subnormal, n, n - (1 << f.man_bits))
    mag_code = (e_field << f.man_bits) | m_field
    mag_code = np.where(n == 0, 0, mag_code)

    max_code = f.max_finite_code
    max_e_field = max_code >> f.man_bits
    overflowed = (e_field > max_e_field) | ((e_field == max_e_field) & (m_field > (max_code & ((1 << f.man_bits) - 1))))
    overflowed = (overflowed & ~is_zero) | is_inf
    sign_shift = f.exp_bits + f.man_bits
    ov_code: int
    if overflow == "saturate":
        ov_code = max_code
    elif overflow == "inf":
        assert f.inf_code is not None  # validated by encode_codes
        ov_code = f.inf_code
    else:
        ov_code = f.nan_code
    code = np.where(overflowed, ov_code, mag_code)
    if f.nan_encoding == "neg_zero":
        # fnuz: no negative zero, NaN is 0x80 (unsigned); a negative value that rounds to 0 becomes +0.
        signed = np.where((code == 0) | (overflowed & (overflow == "nan")), code, code | (sign << sign_shift))
        code = np.where(is_nan, 0x80, signed)
    else:
        code = code | (sign << sign_shift)
        code = np.where(is_nan, f.nan_code | (sign << sign_shift), code)
    return code.astype(np.uint8)


def _encode_e8m0(sig, big_e, is_nan, is_inf, is_zero, rounding) -> np.ndarray:
    msb = np.where(is_zero, 0, np.floor(np.log2(np.maximum(sig, 1))).astype(np.int64))
    e = big_e - 23 + msb  # floor(log2 |x|)
    exact = sig == (np.int64(1) << msb)
    rest = sig - (np.int64(1) << msb)  # significand bits below the leading one
    if rounding == "ceil":
        e = np.where(exact, e, e + 1)
    elif rounding == "nearest_ties_up":
        # round up iff the significand is ≥ 1.5, i.e. the bit right below the leading one is set
        half = np.where(msb > 0, np.left_shift(np.int64(1), np.maximum(msb - 1, 0)), 1 << 62)
        e = np.where(rest >= half, e + 1, e)
    elif rounding != "floor":
        raise ValueError(f"e8m0_rounding: expected 'nearest_ties_up', 'ceil' or 'floor', got {rounding!r}")
    code = np.clip(e + 127, 0, 254)
    # e8m0 has no sign: like torch's cast, the sign bit is ignored (|x| is encoded).
    code = np.where(is_zero, 0, code)
    code = np.where(is_nan | is_inf, 0xFF, code)
    return code.astype(np.uint8)


def encode(x, fmt: str | FP8Format, overflow: OverflowPolicy = "saturate") -> torch.Tensor:
    """Encode to a uint8 code tensor (see :func:`encode_codes`)."""
    return torch.from_numpy(encode_codes(x, fmt, overflow))


def round_to_format(x, fmt: str | FP8Format, overflow: OverflowPolicy = "saturate") -> torch.Tensor:
    """fp32 → nearest representable value of ``fmt`` (as fp32), i.e. decode(encode(x))."""
    return decode(encode_codes(x, fmt, overflow), fmt).reshape(np.shape(_as_numpy_f32(x)))


def bf16_bits_rne(x) -> np.ndarray:
    """fp32 → bfloat16 bit patterns (uint16), round to nearest, ties to even; the IEEE/NVIDIA ``cvt.rn.bf16.f32``.

    bf16 is the top half of fp32, so with b = fp32 bits: ``b' = (b + 0x7FFF + ((b >> 16) & 1)) >> 16`` — adding just
    under half an ulp of the kept part, plus one when the kept part is odd, rounds to nearest with ties to even;
    a carry out of the mantissa moves to the next binade and past the largest finite bf16 lands on ±inf (the
    correct overflow). NaN inputs keep their sign and become the quiet NaN ``0x7FC0`` (a truncated payload could be
    an infinity). Subnormals need nothing special: bf16 and fp32 share the exponent range.
    """
    b = _as_numpy_f32(x).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)
    sign = ((b >> 16) & 0x8000).astype(np.uint32)
    is_nan = (b & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, sign | 0x7FC0, rounded & 0xFFFF).astype(np.uint16)


def codes_to_torch(codes: torch.Tensor, fmt: str | FP8Format) -> torch.Tensor:
    """Reinterpret uint8 codes as the matching torch fp8 dtype (no value change)."""
    return codes.to(torch.uint8).view(get_format(fmt).torch_dtype())


def torch_to_codes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a torch fp8 tensor as uint8 codes."""
    return t.contiguous().view(torch.uint8)


def ulp_distance(a_codes, b_codes, fmt: str | FP8Format) -> np.ndarray:
    """Distance in representable steps between two code arrays of a signed format.

    Codes are mapped to a monotone integer line (sign-magnitude → two's-complement style) so that +0/-0 are
    0 apart and a sign flip across zero counts every step in between. NaN codes give -1.
    """
    f = get_format(fmt)
    sign_shift = f.exp_bits + f.man_bits

    def line(c):
        c = np.asarray(c).astype(np.int64) & 0xFF
        mag = c & ((1 << sign_shift) - 1)
        return np.where((c >> sign_shift) & 1 == 1, -mag, mag)

    a = np.asarray(a_codes)
    b = np.asarray(b_codes)
    d = np.abs(line(a) - line(b))
    nan = np.isnan(decode_codes(a, f)) | np.isnan(decode_codes(b, f))
    return np.where(nan, -1, d)
