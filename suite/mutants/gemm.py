"""GEMM mutants: scaled FP8 and microscaled GEMMs with one realistic accumulation or scale-layout bug each (area
``gemm``)."""

from __future__ import annotations

from dataclasses import replace

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import microscaling as mx
from fp8rl.reference.gemm import block_gemm_exact
from fp8rl.reference.quant import QuantizedTensor

from ._base import mutant


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
        "tensor-core accumulation)", kills=("GEMM-SWAMP-001",))
class Gemm13BitAccum(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        return _chunked_low_precision_dot(a.dequantize().double(), w.dequantize().double(), 13, 128).to(out_dtype)


@mutant("gemm-act-scale-per-tensor", "GEMM applies one activation scale per tensor instead of per 1x128 group",
        kills=("GEMM-BOUND-001", "GEMM-BOUND-002", "GEMM-SWAMP-001"))
class GemmActScalePerTensor(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        s = a.scale.amax()
        a_deq = a.values().double() * s.double()
        return (a_deq @ w.dequantize().double().t()).to(out_dtype)


@mutant("gemm-weight-scale-transposed", "GEMM reads the 128x128 weight-scale grid transposed",
        kills=("GEMM-BOUND-001",))
class GemmWeightScaleTransposed(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        if w.granularity.kind == "block" and w.scale.dim() == 2 and w.scale.shape[0] == w.scale.shape[1]:
            w = QuantizedTensor(w.codes, w.scale.t().contiguous(), w.granularity, w.policy)
        return block_gemm_exact(a, w).to(out_dtype)


@mutant("gemm-bf16-accum", "GEMM accumulates in bf16 instead of fp32", kills=("GEMM-SWAMP-001",))
class GemmBf16Accum(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        return _chunked_low_precision_dot(a.dequantize().double(), w.dequantize().double(), 8, 1 << 30).to(out_dtype)


@mutant("gemm-tile-row-scale", "the GEMM applies the activation scales of the first 16-row tile to every tile "
        "(M > 16 rows get row (i mod 16)'s scale: a tile-index bug that GEMMs of at most 16 rows never see)",
        kills=("GEMM-SPACE-001",))
class GemmTileRowScale(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        m = a.codes.shape[0]
        if m <= 16 or a.scale.shape[0] != m:
            return block_gemm_exact(a, w).to(out_dtype)
        scale = a.scale[torch.arange(m) % 16].contiguous()
        return block_gemm_exact(QuantizedTensor(a.codes, scale, a.granularity, a.policy), w).to(out_dtype)


@mutant("gemm-nan-code-as-zero", "the GEMM decodes an FP8 NaN code as 0 (a lookup table without NaN): the output "
        "stays finite where IEEE arithmetic gives NaN", kills=("GEMM-SPACE-001",))
class GemmNanCodeAsZero(ReferenceEngine):
    def block_gemm(self, a, w, out_dtype):
        def clean(t):
            nan = torch.isnan(t.values())
            return QuantizedTensor(torch.where(nan, torch.zeros_like(t.codes), t.codes), t.scale, t.granularity,
                                   t.policy)

        return block_gemm_exact(clean(a), clean(w)).to(out_dtype)


# ---- microscaled GEMMs (fp8rl.reference.microscaling) ------------------------------------------------------------

@mutant("mx-gemm-no-global-scale", "NVFP4 GEMM that drops the global factor 1/(g_a·g_w) (block scales only)",
        kills=("MX-GEMM-001",))
class GemmNoGlobal(ReferenceEngine):
    def mx_gemm(self, a, w, out_dtype):
        if a.global_scale is None:
            return super().mx_gemm(a, w, out_dtype)
        a1, w1 = replace(a, global_scale=torch.tensor(1.0)), replace(w, global_scale=torch.tensor(1.0))
        return mx.mx_gemm_exact(a1, w1).to(out_dtype)


@mutant("mx-gemm-scale-stride-32", "microscaled GEMM that indexes block scales with a stride of 32 elements where "
        "the format's block is 16 (NVFP4) — MX tensors read their 32-block scale at k // 64 instead",
        kills=("MX-GEMM-001",))
class GemmScaleStride(ReferenceEngine):
    def mx_gemm(self, a, w, out_dtype):
        def deq(q: mx.MXTensor) -> torch.Tensor:
            k = q.shape[-1]
            idx = torch.arange(k) // (2 * q.policy.block)
            return q.element_values() * q.scale_values()[..., idx]

        return (deq(a) @ deq(w).T).to(out_dtype)
