"""Fault-injected engines: each one is the reference engine with one realistic bug.

A conformance check that kills no mutant is not a check; ``fp8rl mutants`` runs the suite against every
mutant and reports which checks killed it. Mutation score (killed / total) is a headline number.

Each mutant *declares* the same numerics as the reference engine (so it cannot escape by declaring its bug)
and then implements one thing wrong, the way real kernels have gone wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import formats
from fp8rl.reference.gemm import block_gemm_exact
from fp8rl.reference.quant import (
    Granularity,
    QuantizedTensor,
    compute_amax,
    expand_scale,
    get_policy,
    quantize,
    quantize_with_scale,
    scale_from_amax,
)


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    area: str
    factory: Callable[[], ReferenceEngine]


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, description: str, area: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        cls.name = f"mutant:{name}"
        cls.description = description
        MUTANTS[name] = Mutant(name, description, area, cls)
        return cls

    return deco


def make_mutant(name: str) -> ReferenceEngine:
    try:
        return MUTANTS[name].factory()
    except KeyError:
        raise ValueError(f"mutant: unknown mutant {name!r}; known: {sorted(MUTANTS)}") from None


# ----------------------------------------------------------------------------------------------------------------
# helpers shared by the cast mutants: a code-level transform applied after the oracle's cast


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

    def _encode(self, x: torch.Tensor, fmt: str, overflow: str) -> torch.Tensor:
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


@mutant("truncating-cast", "FP8 cast truncates toward zero instead of rounding to nearest even", "formats")
class TruncatingCast(_CastMutant):
    def _mutate_cast(self, x32, codes, fmt):
        vals = formats.decode_codes(codes, fmt)
        over = np.abs(vals) > np.abs(x32.astype(np.float64))  # rounded away from zero → step back
        over &= np.isfinite(vals) & np.isfinite(x32)
        return np.where(over, _step_toward_zero(codes, fmt), codes)


@mutant("cast-ties-away", "FP8 cast rounds ties away from zero (roundf) instead of to even", "formats")
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


@mutant("cast-no-saturation", "cast produces NaN on overflow where the engine declares saturation", "formats")
class NoSaturationCast(_CastMutant):
    def _mutate_cast(self, x32, codes, fmt):
        f = formats.get_format(fmt)
        nan_codes = formats.encode_codes(x32, fmt, "nan")
        over = np.abs(x32) > f.max_finite
        return np.where(over, nan_codes, codes)


@mutant("flush-subnormals", "cast flushes FP8 subnormal results to zero (FTZ)", "formats")
class FlushSubnormals(_CastMutant):
    def _mutate_cast(self, x32, codes, fmt):
        f = formats.get_format(fmt)
        sign_bit = 1 << (f.exp_bits + f.man_bits)
        exp = (codes.astype(np.int64) >> f.man_bits) & ((1 << f.exp_bits) - 1)
        mag = codes.astype(np.int64) & (sign_bit - 1)
        sub = (exp == 0) & (mag != 0)
        return np.where(sub, (codes.astype(np.int64) & sign_bit).astype(np.uint8), codes)


# ----------------------------------------------------------------------------------------------------------------
# quantization mutants


@mutant("bf16-truncating-round", "fp32 → bf16 drops the low 16 bits (round toward zero) instead of rounding to "
        "nearest even (what an unrounded cast or a bit-shift gives)", "formats")
class TruncatingBf16(ReferenceEngine):
    def round_bf16(self, x: torch.Tensor) -> torch.Tensor:
        bits = x.detach().float().cpu().contiguous().numpy().view(np.uint32) >> 16
        nan = np.isnan(x.detach().float().cpu().numpy())
        bits = np.where(nan, bits | 0x40, bits)  # keep NaNs NaN (a bare shift could give ±inf)
        return torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy()).view(torch.bfloat16).reshape(x.shape)


@mutant("missing-eps", "scale computed without the eps floor: an all-zero block gives a 0/NaN scale", "quantization")
class MissingEps(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        buggy = replace(policy, floor="none", zero_amax="nan")
        qt = quantize(x, granularity, buggy)
        return QuantizedTensor(qt.codes, qt.scale, granularity, policy)


@mutant("per-tensor-scale", "one per-tensor scale used where per-group/per-block scales are required",
        "quantization")
class PerTensorScale(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        amax = compute_amax(x, Granularity.tensor())
        s = scale_from_amax(amax, policy)
        shape = tuple(granularity.scale_shape(tuple(x.shape)))
        scale = s.reshape(()).expand(shape).contiguous()
        codes = quantize_with_scale(x, scale, granularity, policy)
        return QuantizedTensor(codes, scale, granularity, policy)


@mutant("transposed-block-grid", "128x128 block-scale grid stored transposed (row/column-major confusion)",
        "quantization")
class TransposedBlockGrid(ReferenceEngine):
    def quantize(self, x, granularity):
        qt = super().quantize(x, granularity)
        if granularity.kind != "block" or qt.scale.dim() != 2:
            return qt
        s = qt.scale
        if s.shape[0] == s.shape[1]:
            s = s.t().contiguous()
        else:  # non-square grid: a kernel reading it column-major sees the same memory with swapped strides
            s = s.t().contiguous().reshape(s.shape)
        return QuantizedTensor(qt.codes, s, granularity, qt.policy)


@mutant("edge-off-by-one", "amax of a partial edge group/block misses its last column (off-by-one)",
        "quantization")
class EdgeOffByOne(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        if granularity.kind not in ("group", "block"):
            return super().quantize(x, granularity)
        k = x.shape[-1]
        step = granularity.size[1]
        if k % step == 0:
            return super().quantize(x, granularity)
        # the edge chunk is read as if it were one element shorter
        x_amax = x.clone()
        x_amax[..., k - 1] = 0
        scale = scale_from_amax(compute_amax(x_amax, granularity), policy)
        codes = quantize_with_scale(x, scale, granularity, policy)
        return QuantizedTensor(codes, scale, granularity, policy)


@mutant("pow2-round-down", "power-of-two (UE8M0) scale rounded down instead of up", "quantization")
class Pow2RoundDown(ReferenceEngine):
    def __init__(self):
        super().__init__({"group": "deepgemm_ue8m0", "block": "deepgemm_ue8m0"})

    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        if policy.pow2 == "none":
            return super().quantize(x, granularity)
        plain = replace(policy, pow2="none")
        s = scale_from_amax(compute_amax(x, granularity), plain)
        mant, exp = torch.frexp(s)  # s = mant · 2^exp, mant in [0.5, 1)
        s_down = torch.ldexp(torch.ones_like(s), exp - 1)  # largest power of two ≤ s
        codes = quantize_with_scale(x, s_down, granularity, policy)
        return QuantizedTensor(codes, s_down, granularity, policy)


@mutant("mul-recip-not-div", "quantizes with x·(1/s) where the declared policy divides x/s", "quantization")
class MulRecipNotDiv(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        qt = quantize(x, granularity, replace(policy, quant_op="mul_recip"))
        return QuantizedTensor(qt.codes, qt.scale, granularity, policy)


@mutant("scale-as-multiplier", "returns the quant multiplier 1/s where the dequant scale s is specified",
        "quantization")
class ScaleAsMultiplier(ReferenceEngine):
    def quantize(self, x, granularity):
        qt = super().quantize(x, granularity)
        return QuantizedTensor(qt.codes, (1.0 / qt.scale.double()).float(), granularity, qt.policy)


@mutant("bf16-scale", "scale computed in the input dtype (bf16) instead of fp32", "quantization")
class Bf16Scale(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        s = scale_from_amax(compute_amax(x, granularity), policy).to(torch.bfloat16).float()
        codes = quantize_with_scale(x, s, granularity, policy)
        return QuantizedTensor(codes, s, granularity, policy)


# ----------------------------------------------------------------------------------------------------------------
# GEMM mutants


def _chunked_low_precision_dot(a: torch.Tensor, w: torch.Tensor, mant_bits: int, chunk: int) -> torch.Tensor:
    """Σ_k a_k·w_k accumulated sequentially with a ``mant_bits``-bit significand inside each K chunk, then
    promoted to fp64 between chunks (the Hopper FP8 tensor-core accumulation bug class)."""

    def round_sig(t: torch.Tensor) -> torch.Tensor:
        m, e = torch.frexp(t)
        scale = float(2**mant_bits)
        return torch.ldexp(torch.round(m * scale) / scale, e)

    m_rows, k = a.shape
    out = torch.zeros(m_rows, w.shape[0], dtype=torch.float64)
    for start in range(0, k, chunk):
        acc = torch.zeros_like(out)
        for kk in range(start, min(start + chunk, k)):
            acc = round_sig(acc + a[:, kk : kk + 1] * w[:, kk].unsqueeze(0))
        out += acc
    return out


@mutant("gemm-13bit-accum", "block GEMM accumulates each 128-K chunk with a 13-bit significand (Hopper FP8 "
        "tensor-core accumulation)", "gemm")
class Gemm13BitAccum(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        return _chunked_low_precision_dot(a.dequantize().double(), w.dequantize().double(), 13, 128).to(out_dtype)


@mutant("gemm-act-scale-per-tensor", "GEMM applies one activation scale per tensor instead of per 1x128 group",
        "gemm")
class GemmActScalePerTensor(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        s = a.scale.amax()
        a_deq = a.values().double() * s.double()
        return (a_deq @ w.dequantize().double().t()).to(out_dtype)


@mutant("gemm-weight-scale-transposed", "GEMM reads the 128x128 weight-scale grid transposed", "gemm")
class GemmWeightScaleTransposed(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        if w.granularity.kind == "block" and w.scale.dim() == 2 and w.scale.shape[0] == w.scale.shape[1]:
            w = QuantizedTensor(w.codes, w.scale.t().contiguous(), w.granularity, w.policy)
        return block_gemm_exact(a, w).to(out_dtype)


@mutant("gemm-bf16-accum", "GEMM accumulates in bf16 instead of fp32", "gemm")
class GemmBf16Accum(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        return _chunked_low_precision_dot(a.dequantize().double(), w.dequantize().double(), 8, 1 << 30).to(out_dtype)


__all__ = ["MUTANTS", "Mutant", "get_policy", "make_mutant", "mutant"]

# the other areas' mutants register themselves on import (they use `mutant` above, hence the late imports)
from fp8rl import mutants_correction, mutants_e2e, mutants_kv  # noqa: E402,F401
