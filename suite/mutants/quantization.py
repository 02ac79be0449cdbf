"""Quantization mutants: scaled-FP8 and microscaling (MXFP8/MXFP4/NVFP4) quantizers with one realistic scale or
layout bug each (area ``quantization``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import microscaling as mx
from fp8rl.reference.formats import decode_codes, encode_codes
from fp8rl.reference.quant import (
    GRANULARITY_KINDS,
    Granularity,
    QuantizedTensor,
    compute_amax,
    quantize,
    quantize_with_scale,
    round_scale_pow2,
    scale_from_amax,
)

from ._base import mutant


@mutant("missing-eps", "scale computed without the eps floor: an all-zero block gives a 0/NaN scale",
        kills=("QUANT-EDGE-001", "QUANT-EDGE-002", "QUANT-PROP-001"))
class MissingEps(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        buggy = replace(policy, floor="none", zero_amax="nan")
        qt = quantize(x, granularity, buggy)
        return QuantizedTensor(qt.codes, qt.scale, granularity, policy)


@mutant("per-tensor-scale", "one per-tensor scale used where per-group/per-block scales are required",
        kills=("QUANT-EDGE-001", "QUANT-EDGE-002", "QUANT-EXACT-001", "QUANT-EXACT-002", "QUANT-PROP-001"))
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
        kills=("QUANT-BOUND-001", "QUANT-EDGE-001", "QUANT-EDGE-002", "QUANT-EXACT-001"))
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
        kills=("QUANT-EDGE-002",))
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


@mutant("pow2-round-down", "power-of-two (UE8M0) scale rounded down instead of up",
        kills=("QUANT-EDGE-001", "QUANT-EDGE-002", "QUANT-EXACT-001", "QUANT-EXACT-002", "QUANT-PROP-001"))
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


@mutant("mul-recip-not-div", "quantizes with x·(1/s) where the declared policy divides x/s",
        kills=("QUANT-EXACT-002",))
class MulRecipNotDiv(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        qt = quantize(x, granularity, replace(policy, quant_op="mul_recip"))
        return QuantizedTensor(qt.codes, qt.scale, granularity, policy)


@mutant("scale-as-multiplier", "returns the quant multiplier 1/s where the dequant scale s is specified",
        kills=("QUANT-BOUND-001", "QUANT-EDGE-001", "QUANT-EDGE-002", "QUANT-EXACT-001", "QUANT-EXACT-002",
               "QUANT-PROP-001"))
class ScaleAsMultiplier(ReferenceEngine):
    def quantize(self, x, granularity):
        qt = super().quantize(x, granularity)
        return QuantizedTensor(qt.codes, (1.0 / qt.scale.double()).float(), granularity, qt.policy)


@mutant("bf16-scale", "scale computed in the input dtype (bf16) instead of fp32",
        kills=("QUANT-EDGE-001", "QUANT-EDGE-002", "QUANT-EXACT-001", "QUANT-EXACT-002"))
class Bf16Scale(ReferenceEngine):
    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        s = scale_from_amax(compute_amax(x, granularity), policy).to(torch.bfloat16).float()
        codes = quantize_with_scale(x, s, granularity, policy)
        return QuantizedTensor(codes, s, granularity, policy)


# ---------------------------------------------------------------------------------------------------------------
# Stale presets: an engine that implements a preset which differs from the truth in one field. Each is the kind of
# drift the peers tier (tests/engines/<tier>/test_peers_*.py) exists to catch in the presets themselves; here the
# quantization checks must catch it in an engine. ``PRESET_MUTATIONS`` names them (truth preset, field, the mutated
# quantizer), and the peers tests show the battery tells each one apart from the upstream code.


def _exponent_passthrough(x, granularity, policy):
    """DeepGEMM UE8M0 without the exponent clamp at 254: an inf/NaN scale passes through ceil_to_ue8m0 (fp8rl's
    oracle before this was fixed)."""
    amax = compute_amax(x, granularity)
    raw = scale_from_amax(amax, replace(policy, pow2="none"))
    s = torch.where(torch.isfinite(raw), round_scale_pow2(raw, policy.pow2), raw)
    codes = quantize_with_scale(x, s, granularity, policy, amax=amax)
    return QuantizedTensor(codes, s, granularity, policy)


def _with(**fields):
    def q(x, granularity, policy):
        qt = quantize(x, granularity, replace(policy, name=f"{policy.name}-mutated", **fields))
        return QuantizedTensor(qt.codes, qt.scale, granularity, policy)
    return q


#: mutant name → (the true preset, the field that differs, quantize(x, granularity, true_policy) of the mutation)
PRESET_MUTATIONS = {
    "preset-floor-value": ("deepseek_ref_2025_08", "eps: 1e-10 instead of 1e-4", _with(eps=1e-10)),
    "preset-clamp-order": ("vllm_native_group_ue8m0_0_32", "floor_order: floor then pow2 instead of pow2 then floor",
                           _with(floor_order="floor_then_pow2")),
    "preset-exponent-clamp": ("deepgemm_ue8m0", "ceil_to_ue8m0 without the exponent clamp at 254 (inf/NaN scales "
                              "pass through)", _exponent_passthrough),
    "preset-reciprocal-rounding": ("vllm_scaled_quantize", "multiplier_op: fl(448/amax) instead of "
                                   "fl(fl(1/amax)·448)", _with(multiplier_op="div")),
}


class _PresetMutant(ReferenceEngine):
    mutation = ""

    def __init__(self):
        truth = PRESET_MUTATIONS[self.mutation][0]
        super().__init__(dict.fromkeys(GRANULARITY_KINDS, truth))

    def quantize(self, x, granularity):
        return PRESET_MUTATIONS[self.mutation][2](x, granularity, self.scale_policy(granularity.kind))


@mutant("preset-floor-value", "declares deepseek_ref_2025_08 (amax floor 1e-4) but floors amax at 1e-10 (the value "
        "of another preset)", kills=("QUANT-EDGE-001", "QUANT-EDGE-002"))
class PresetFloorValue(_PresetMutant):
    mutation = "preset-floor-value"


@mutant("preset-clamp-order", "declares vllm_native_group_ue8m0_0_32 (power of two, then the 1/(448·512) floor) but "
        "floors first (vLLM 0.33.0's order)", kills=("QUANT-EDGE-001", "QUANT-EDGE-002"))
class PresetClampOrder(_PresetMutant):
    mutation = "preset-clamp-order"


@mutant("preset-exponent-clamp", "declares deepgemm_ue8m0 but lets an inf/NaN scale through ceil_to_ue8m0 instead of "
        "clamping the exponent to 254 (2^127)", kills=("QUANT-EDGE-003",))
class PresetExponentClamp(_PresetMutant):
    mutation = "preset-exponent-clamp"


@mutant("preset-reciprocal-rounding", "declares vllm_scaled_quantize (m = reciprocal(amax)·448, two roundings) but "
        "divides 448/amax once", kills=("QUANT-EXACT-001", "QUANT-EXACT-002"))
class PresetReciprocalRounding(_PresetMutant):
    mutation = "preset-reciprocal-rounding"


@mutant("group-size-hardcoded", "the group quantizer always uses 1x128 groups, whatever group size it is given "
        "(a kernel compiled for one GROUP_SIZE)", kills=("QUANT-SPACE-001",))
class GroupSizeHardcoded(ReferenceEngine):
    def quantize(self, x, granularity):
        if granularity.kind != "group" or granularity.size[1] == 128:
            return super().quantize(x, granularity)
        qt = super().quantize(x, Granularity.group(128))
        scale = qt.scale.repeat_interleave(128 // granularity.size[1] or 1, dim=-1)
        scale = scale[..., : granularity.scale_shape(tuple(x.shape))[-1]]
        return QuantizedTensor(qt.codes, scale.contiguous(), granularity, qt.policy)


@mutant("block-square-only", "the block quantizer uses Bm x Bm tiles for a Bm x Bn block (a kernel that takes one "
        "BLOCK_SIZE)", kills=("QUANT-SPACE-001",))
class BlockSquareOnly(ReferenceEngine):
    def quantize(self, x, granularity):
        bm, bn = granularity.size
        if granularity.kind != "block" or bm == bn:
            return super().quantize(x, granularity)
        policy = self.scale_policy("block")
        square = Granularity.block(bm)
        s = scale_from_amax(compute_amax(x, square), policy)
        want = granularity.scale_shape(tuple(x.shape))
        s = s.repeat_interleave(max(bm // bn, 1), dim=1)[:, : want[1]].contiguous()
        codes = quantize_with_scale(x, s, granularity, policy)
        return QuantizedTensor(codes, s, granularity, policy)


@mutant("token-quant-flattens-batch", "per-token quantization of a batched (3-D) input takes one scale per batch "
        "entry instead of one per token (amax over the wrong dims)", kills=("QUANT-SPACE-001",))
class TokenQuantFlattensBatch(ReferenceEngine):
    def quantize(self, x, granularity):
        if granularity.kind != "token" or x.dim() < 3:
            return super().quantize(x, granularity)
        policy = self.scale_policy("token")
        amax = x.float().abs().amax(dim=tuple(range(1, x.dim())), keepdim=True).expand(*x.shape[:-1], 1)
        s = scale_from_amax(amax.contiguous(), policy)
        codes = quantize_with_scale(x, s, granularity, policy)
        return QuantizedTensor(codes, s, granularity, policy)


# ---- microscaling quantizers (MXFP8, MXFP4, NVFP4: fp8rl.reference.microscaling) ------------------------------

_MX_ALL = ("MX-EXACT-001", "MX-EDGE-001", "MX-SHAPE-001")


def _mx_with(q: mx.MXTensor, **kw) -> mx.MXTensor:
    return replace(q, **kw)


@mutant("mx-ceil-for-floor", "E8M0 exponent rounded up (2^ceil(log2(amax/T)), the TE/cuBLAS rule) where the OCP "
        "floor rule is declared", kills=_MX_ALL)
class CeilForFloor(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        p = self.mx_policy(recipe)
        if p.two_level:
            return super().mx_quantize(x, recipe)
        q = mx.mx_quantize(x, replace(p, exp_rounding="ceil"))
        return _mx_with(q, policy=p)


@mutant("mx-e8m0-bias-128", "E8M0 scale stored with bias 128 instead of 127 (the block dequantizes at half scale)",
        kills=_MX_ALL + ("MX-BOUND-001",))
class E8M0Bias(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        q = super().mx_quantize(x, recipe)
        if q.policy.two_level:
            return q
        return _mx_with(q, scales=(q.scales.to(torch.int16) + 1).clamp(max=254).to(torch.uint8))


@mutant("nvfp4-global-scale-forgotten", "NVFP4 block scales computed from amax_b/6 without the global scale g "
        "(g still reported, so the dequant divides by it)",
        kills=("MX-EXACT-001", "MX-NVFP4-001", "MX-BOUND-001", "MX-EDGE-001"))
class GlobalScaleForgotten(ReferenceEngine):
    def mx_quantize(self, x, recipe):
        q = super().mx_quantize(x, recipe)
        if not q.policy.two_level:
            return q
        forgot = _nvfp4_with_global(x, q.policy, torch.tensor(1.0))
        return _mx_with(forgot, global_scale=q.global_scale)


def _nvfp4_with_global(x: torch.Tensor, p: mx.MXPolicy, g: torch.Tensor) -> mx.MXTensor:
    """The NVFP4 pipeline of the oracle with a forced global scale (the bug's quantizer)."""
    xb, k = mx._blocks(x.float(), p.block)
    amax = xb.abs().amax(dim=-1)
    s_raw = torch.clamp(g * (amax / mx.E2M1_MAX), max=mx.E4M3_MAX)
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
        return _mx_with(q, data=((q.data & 0xF) << 4) | (q.data >> 4))


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
        return _mx_with(q, data=mx.pack_fp4(codes))
