"""Microscaling mutants: MXFP8/MXFP4/NVFP4 quantizers and GEMMs with one realistic bug each (area
``microscaling``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import microscaling as mx
from fp8rl.reference.formats import decode_codes

from ._base import mutant

_ALL = ("MX-EXACT-001", "MX-EDGE-001", "MX-SHAPE-001")


def _with(q: mx.MXTensor, **kw) -> mx.MXTensor:
    return replace(q, **kw)


@mutant("mx-ceil-for-floor", "E8M0 exponent rounded up (2^ceil(log2(amax/T)), the TE/cuBLAS rule) where the OCP "
        "floor rule is declared", kills=_ALL)
class CeilForFloor(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        p = self.mx_policy(recipe)
        if p.two_level:
            return super().mx_quantize(x, recipe)
        q = mx.mx_quantize(x, replace(p, exp_rounding="ceil"))
        return _with(q, policy=p)


@mutant("mx-e8m0-bias-128", "E8M0 scale stored with bias 128 instead of 127 (the block dequantizes at half scale)",
        kills=_ALL + ("MX-BOUND-001",))
class E8M0Bias(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        q = super().mx_quantize(x, recipe)
        if q.policy.two_level:
            return q
        return _with(q, scales=(q.scales.to(torch.int16) + 1).clamp(max=254).to(torch.uint8))


@mutant("nvfp4-global-scale-forgotten", "NVFP4 block scales computed from amax_b/6 without the global scale g "
        "(g still reported, so the dequant divides by it)",
        kills=("MX-EXACT-001", "MX-NVFP4-001", "MX-BOUND-001", "MX-EDGE-001"))
class GlobalScaleForgotten(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        q = super().mx_quantize(x, recipe)
        if not q.policy.two_level:
            return q
        forgot = _nvfp4_with_global(x, q.policy, torch.tensor(1.0))
        return _with(forgot, global_scale=q.global_scale)


def _nvfp4_with_global(x: torch.Tensor, p: mx.MXPolicy, g: torch.Tensor) -> mx.MXTensor:
    """The NVFP4 pipeline of the oracle with a forced global scale (the bug's quantizer)."""
    xb, k = mx._blocks(x.float(), p.block)
    amax = xb.abs().amax(dim=-1)
    s_raw = torch.clamp(g * (amax / mx.E2M1_MAX), max=mx.E4M3_MAX)
    from fp8rl.reference.formats import encode_codes

    s_codes = torch.from_numpy(encode_codes(s_raw, "e4m3fn", "saturate")).reshape(amax.shape)
    s = torch.from_numpy(decode_codes(s_codes.numpy(), "e4m3fn").astype(np.float32)).reshape(amax.shape)
    y = xb / (s / g).unsqueeze(-1)
    y = torch.where((s == 0).unsqueeze(-1), xb * 0.0, y).clamp(-6.0, 6.0)
    y = y.reshape(*x.shape[:-1], -1)[..., :k]
    codes = torch.from_numpy(mx.encode_e2m1(y)).reshape(y.shape)
    return mx.MXTensor(mx.pack_fp4(codes), s_codes, g, tuple(x.shape), p)


@mutant("fp4-nibble-swap", "packed FP4 with element 2i in the high nibble and 2i+1 in the low nibble",
        kills=("MX-EXACT-001", "MX-PACK-001", "MX-BOUND-001"))
class NibbleSwap(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        q = super().mx_quantize(x, recipe)
        if not q.policy.packed:
            return q
        return _with(q, data=((q.data & 0xF) << 4) | (q.data >> 4))


@mutant("nvfp4-block-32", "NVFP4 scales computed over 32 elements where 16 is meant (each 16-block gets its "
        "32-block's scale; layout unchanged)", kills=("MX-EXACT-001", "MX-EDGE-001"))
class Block32For16(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        p = self.mx_policy(recipe)
        if not p.two_level:
            return super().mx_quantize(x, recipe)
        xb, k = mx._blocks(x.float(), 32)
        amax32 = xb.abs().amax(dim=-1, keepdim=True).expand(*xb.shape[:-1], 2).reshape(*x.shape[:-1], -1)
        # replace every element of a 32-block by itself except one slot per 16-block that carries the 32-amax, so
        # the oracle's 16-block amax equals the 32-block amax (the bug) — then restore the real values' codes
        x16, _ = mx._blocks(x.float(), 16)
        marker = x16.clone()
        n16 = marker.shape[-2]
        marker[..., 0] = torch.where(marker[..., 0] < 0, -1.0, 1.0) * amax32[..., :n16]
        scales = mx.mx_quantize(marker.reshape(*x.shape[:-1], -1)[..., :k], p)
        g = mx.nvfp4_global_scale(x, p.global_op)
        s = torch.from_numpy(decode_codes(scales.scales.numpy(), "e4m3fn").astype(np.float32)).reshape(
            scales.scales.shape)
        y = x16 / (s / g).unsqueeze(-1)
        y = torch.where((s == 0).unsqueeze(-1), x16 * 0.0, y).clamp(-6.0, 6.0)
        y = y.reshape(*x.shape[:-1], -1)[..., :k]
        codes = torch.from_numpy(mx.encode_e2m1(y)).reshape(y.shape)
        return mx.MXTensor(mx.pack_fp4(codes), scales.scales, g, tuple(x.shape), p)


@mutant("e2m1-ties-away", "E2M1 rounding with ties away from zero (0.25 → 0.5, 2.5 → 3) instead of ties to even",
        kills=("MX-EDGE-001",))
class E2M1TiesAway(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        q = super().mx_quantize(x, recipe)
        if not q.policy.packed:
            return q
        # re-round: y = x/S exactly at a tie moves one code away from zero
        s = q.scale_values().repeat_interleave(q.policy.block, dim=-1)[..., : q.shape[-1]]
        y = (x.double() / torch.where(s == 0, torch.ones_like(s), s)).abs()
        codes = q.codes().to(torch.int16)
        mag = codes & 7
        grid = torch.tensor(mx.E2M1_VALUES, dtype=torch.float64)
        val = grid[mag.long()]
        nxt = grid[(mag + 1).clamp(max=7).long()]
        tie = (mag < 7) & ((y - val) == (nxt - y)) & (s != 0)
        codes = torch.where(tie, codes + 1, codes).to(torch.uint8)
        return _with(q, data=mx.pack_fp4(codes))


@mutant("mx-gemm-no-global-scale", "NVFP4 GEMM that drops the global factor 1/(g_a·g_w) (block scales only)",
        kills=("MX-GEMM-001",))
class GemmNoGlobal(ReferenceEngine):
    def mx_gemm(self, a, w, out_dtype):
        if a.global_scale is None:
            return super().mx_gemm(a, w, out_dtype)
        a1, w1 = _with(a, global_scale=torch.tensor(1.0)), _with(w, global_scale=torch.tensor(1.0))
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
