"""Formats mutants: FP8 and bf16 casts with one realistic rounding or overflow bug each (area ``formats``)."""

from __future__ import annotations

import numpy as np
import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import formats
from fp8rl.reference.quant import Granularity, QuantizedTensor, expand_scale, quantize

from ._base import mutant


def _step_toward_zero(codes: np.ndarray, fmt: str) -> np.ndarray:
    """Magnitude of a sign-magnitude code minus one (one representable step toward zero)."""
    f = formats.get_format(fmt)
    sign_bit = 1 << (f.exp_bits + f.man_bits)
    mag = codes.astype(np.int64) & (sign_bit - 1)
    sign = codes.astype(np.int64) & sign_bit
    return (sign | np.maximum(mag - 1, 0)).astype(np.uint8)


class _CastMutant(ReferenceEngine):
    """Reference engine whose cast (and therefore quantize) goes through ``_mutate_cast``."""

    def _mutate_cast(self, x32: np.ndarray, codes: np.ndarray, fmt: str) -> np.ndarray:
        raise NotImplementedError

    def _encode(self, x: torch.Tensor, fmt: str, overflow: formats.OverflowPolicy) -> torch.Tensor:
        x32 = x.detach().float().cpu().numpy()
        codes = formats.encode_codes(x32, fmt, overflow)
        return torch.from_numpy(self._mutate_cast(x32, codes, fmt)).reshape(x.shape)

    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return self._encode(x, fmt, self.cast_overflow(fmt))

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        policy = self.scale_policy(granularity.kind)
        ref = quantize(x, granularity, policy)
        # recompute the codes from x / s through the mutated cast
        target = float(policy.target_max or formats.get_format(policy.fmt).max_finite)
        xs = x.float() / expand_scale(ref.scale, granularity, tuple(x.shape))
        xs = xs.clamp(-target, target) if policy.clamp else xs
        codes = self._encode(xs, policy.fmt, policy.overflow)
        return QuantizedTensor(codes, ref.scale, granularity, policy)


@mutant("truncating-cast", "FP8 cast truncates toward zero instead of rounding to nearest even",
        kills=("CAST-BF16IN-001", "CAST-PROP-001", "CAST-RANDOM-001", "CAST-SWEEP-001"))
class TruncatingCast(_CastMutant):
    def _mutate_cast(self, x32, codes, fmt):
        vals = formats.decode_codes(codes, fmt)
        over = np.abs(vals) > np.abs(x32.astype(np.float64))  # rounded away from zero → step back
        over &= np.isfinite(vals) & np.isfinite(x32)
        return np.where(over, _step_toward_zero(codes, fmt), codes)


@mutant("cast-ties-away", "FP8 cast rounds ties away from zero (roundf) instead of to even",
        kills=("CAST-BF16IN-001", "CAST-SWEEP-001"))
class TiesAwayCast(_CastMutant):
    def _mutate_cast(self, x32, codes, fmt):
        f = formats.get_format(fmt)
        vals = formats.decode_codes(codes, fmt)
        down = np.abs(vals) < np.abs(x32.astype(np.float64))
        nxt = (codes.astype(np.int64) + 1).astype(np.uint8)
        nxt_vals = formats.decode_codes(nxt, fmt)
        tie = down & np.isfinite(nxt_vals) & (np.abs(x32) - np.abs(vals) == np.abs(nxt_vals) - np.abs(x32))
        tie &= np.abs(nxt_vals) <= f.max_finite
        return np.where(tie, nxt, codes)


@mutant("cast-no-saturation", "cast produces NaN on overflow where the engine declares saturation",
        kills=("CAST-BF16IN-001", "CAST-PROP-001", "CAST-RANDOM-001", "CAST-SWEEP-001"))
class NoSaturationCast(_CastMutant):
    def _mutate_cast(self, x32, codes, fmt):
        f = formats.get_format(fmt)
        nan_codes = formats.encode_codes(x32, fmt, "nan")
        over = np.abs(x32) > f.max_finite
        return np.where(over, nan_codes, codes)


@mutant("flush-subnormals", "cast flushes FP8 subnormal results to zero (FTZ)",
        kills=("CAST-BF16IN-001", "CAST-PROP-001", "CAST-RANDOM-001", "CAST-SWEEP-001"))
class FlushSubnormals(_CastMutant):
    def _mutate_cast(self, x32, codes, fmt):
        f = formats.get_format(fmt)
        sign_bit = 1 << (f.exp_bits + f.man_bits)
        exp = (codes.astype(np.int64) >> f.man_bits) & ((1 << f.exp_bits) - 1)
        mag = codes.astype(np.int64) & (sign_bit - 1)
        sub = (exp == 0) & (mag != 0)
        return np.where(sub, (codes.astype(np.int64) & sign_bit).astype(np.uint8), codes)



@mutant("bf16-truncating-round", "fp32 → bf16 drops the low 16 bits (round toward zero) instead of rounding to "
        "nearest even (what an unrounded cast or a bit-shift gives)", kills=("CAST-BF16-001",))
class TruncatingBf16(ReferenceEngine):
    def round_bf16(self, x: torch.Tensor) -> torch.Tensor:
        bits = x.detach().float().cpu().contiguous().numpy().view(np.uint32) >> 16
        nan = np.isnan(x.detach().float().cpu().numpy())
        bits = np.where(nan, bits | 0x40, bits)  # keep NaNs NaN (a bare shift could give ±inf)
        return torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16).reshape(x.shape)


def _as_if_contiguous(x: torch.Tensor) -> torch.Tensor:
    """What a kernel that ignores strides reads: the tensor's memory in order, as if it were contiguous."""
    if x.is_contiguous():
        return x
    flat = torch.as_strided(x, (x.numel(),), (1,), x.storage_offset())
    return flat.reshape(x.shape)


@mutant("cast-ignores-strides", "cast reads its input's memory as if it were contiguous (a kernel that takes a "
        "data pointer and a size but no strides): transposed, sliced and strided inputs get other elements' codes",
        kills=("CAST-SPACE-001",))
class CastIgnoresStrides(ReferenceEngine):
    def cast(self, x, fmt):
        return super().cast(_as_if_contiguous(x), fmt)


@mutant("cast-fp16-through-bf16", "fp16 inputs are first converted to bf16 (a kernel with one 16-bit path): "
        "fp16 values with more than 8 significant bits are rounded twice", kills=("CAST-SPACE-001",))
class CastFp16ThroughBf16(ReferenceEngine):
    def cast(self, x, fmt):
        return super().cast(x.to(torch.bfloat16) if x.dtype == torch.float16 else x, fmt)
