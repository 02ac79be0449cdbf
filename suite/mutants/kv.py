"""KV-cache mutants: the reference engine with one realistic FP8 KV-cache bug each (area ``kv``).

Each mutant keeps the reference engine's *declared* numerics (``kv_policy``), so it cannot escape a check by
declaring its bug. Where each bug class has happened:

=========================  ============================================================================
mutant                     bug (where it has happened)
=========================  ============================================================================
kv-stale-scales            scales never recalibrated after a weight update (vLLM computes them once;
                           verl had to reset ``calculate_kv_scales`` every step; stale host copies)
kv-scale-one               default scale 1.0 (BF16 checkpoint + ``--kv-cache-dtype fp8``: no loadable
                           k/v/q scale parameters, pushed scales silently dropped)
kv-q-scale-ignored         FP8 attention quantizes Q with q_scale but never applies the q descale
kv-per-tensor-scale        per-head layout stored with one per-tensor scale (engines that accept
                           per-tensor scalars only reduce per-head checkpoint scales with max)
kv-no-clamp                store casts x/s without clamp or saturating convert (SGLang
                           ``set_kv_buffer`` relies on the torch cast: NaN in e4m3fn before torch 2.12,
                           inf in e5m2)
kv-truncating-store        store truncates x/s toward zero instead of round-to-nearest-even
kv-swapped-vk-constants    engine-side calibration divides K by V's constant (100) and V by K's (200)
kv-p999-as-max             trainer-side calibration takes the max of the micro-batch amaxes instead of
                           the 99.9th percentile (one outlier batch sets the scale)
kv-head-amax-pooled        per-head amax calibration pools all heads (one amax broadcast to every head)
kv-reads-past-kv-len       attention multiplies masked-out cache slots by p = 0, so NaN garbage past
                           kv_len poisons the sequence (torch SDPA with a bool mask does exactly this)
=========================  ============================================================================

The checks that kill each one are declared with the mutant (``kills=``); ``fp8rl checks`` shows them per check.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import kv as kvref
from fp8rl.reference.formats import decode_codes, encode_codes, get_format

from ._base import mutant


@mutant("kv-stale-scales", "KV scales never recalibrated: after a layer's first scales (pushed or calibrated), "
        "later pushes and resets are accepted but ignored (step-0 scales kept)",
        kills=("KV-DRIFT-001", "KV-UPDATE-001", "KV-UPDATE-002"))
class KVStaleScales(ReferenceEngine):
    def kv_update_scales(self, layer, scales):
        layers = self._kv_layers()
        if layers.get(layer) is not None:
            return "pending" if scales is None else "pushed"
        return super().kv_update_scales(layer, scales)


@mutant("kv-scale-one", "FP8 KV layer runs with the default scale 1.0 for Q, K and V: pushed scales are silently "
        "dropped and a never-calibrated layer is not refused",
        kills=("KV-DEFAULT-001", "KV-UPDATE-001", "KV-UPDATE-002"))
class KVScaleOne(ReferenceEngine):
    def _kv_current_scales(self, layer, q, k, v, layout):
        shape = (int(k.shape[-2]),) if layout == "head" else ()
        return kvref.KVScales.of(1.0, torch.ones(shape), torch.ones(shape))


@mutant("kv-q-scale-ignored", "FP8 attention quantizes Q with q_scale but never applies the q descale (scores "
        "scaled by 1/q_scale)", kills=("KV-ATTN-001", "KV-ATTN-003", "KV-UPDATE-001", "KV-UPDATE-002"))
class KVQScaleIgnored(ReferenceEngine):
    def kv_attention(self, q, k_cache, v_cache, *, q_scale=None, causal=True, q_lengths=None, kv_lengths=None,
                     sm_scale=None):
        if q_scale is None:
            return super().kv_attention(q, k_cache, v_cache, causal=causal, q_lengths=q_lengths,
                                        kv_lengths=kv_lengths, sm_scale=sm_scale)
        pol = self.kv_policy(k_cache.fmt, k_cache.layout)
        q_fp8_values = kvref.quantize_q(q, q_scale, pol.q_fmt, pol.q_quant_op) / float(torch.as_tensor(q_scale))
        out = kvref.attention(q_fp8_values, k_cache.dequantize(), v_cache.dequantize(), causal=causal,
                              q_lengths=q_lengths, kv_lengths=kv_lengths, sm_scale=sm_scale)
        return out.float()


@mutant("kv-per-tensor-scale", "per-head KV scales reduced to one per-tensor scale (their max) in the store",
        kills=("KV-STORE-001", "KV-STORE-002", "KV-STORE-003", "KV-STORE-005", "KV-UPDATE-001"))
class KVPerTensorScale(ReferenceEngine):
    def kv_store(self, x, scale, *, fmt, layout):
        if layout != "head" or scale is None:
            return super().kv_store(x, scale, fmt=fmt, layout=layout)
        s = torch.as_tensor(scale, dtype=torch.float32)
        one = s.max().expand(s.shape).clone()
        cache = kvref.quantize_kv(x, one, self.kv_policy(fmt, layout))
        return kvref.KVCache(cache.codes, one, fmt, layout)


@mutant("kv-no-clamp", "KV store casts x/s without clamping while declaring saturation: overflow becomes NaN "
        "(e4m3fn) or inf (e5m2)",
        kills=("KV-STORE-001", "KV-STORE-002", "KV-STORE-003", "KV-STORE-004", "KV-STORE-005"))
class KVNoClamp(ReferenceEngine):
    def kv_store(self, x, scale, *, fmt, layout):
        declared = self.kv_policy(fmt, layout)
        raw = replace(declared, clamp=False, overflow="nan" if fmt == "e4m3fn" else "inf")
        cache = kvref.quantize_kv(x, scale, raw)
        return kvref.KVCache(cache.codes, cache.scale, fmt, layout)


def _truncate_toward_zero(y: np.ndarray, codes: np.ndarray, fmt: str) -> np.ndarray:
    f = get_format(fmt)
    vals = decode_codes(codes, fmt)
    over = (np.abs(vals) > np.abs(y.astype(np.float64))) & np.isfinite(vals) & np.isfinite(y)
    sign_bit = 1 << (f.exp_bits + f.man_bits)
    mag = codes.astype(np.int64) & (sign_bit - 1)
    stepped = ((codes.astype(np.int64) & sign_bit) | np.maximum(mag - 1, 0)).astype(np.uint8)
    return np.where(over, stepped, codes)


@mutant("kv-truncating-store", "KV store rounds x/s toward zero (truncation) instead of to nearest even",
        kills=("KV-STORE-001", "KV-STORE-002", "KV-STORE-004", "KV-STORE-005", "KV-UPDATE-001", "KV-UPDATE-002"))
class KVTruncatingStore(ReferenceEngine):
    def kv_store(self, x, scale, *, fmt, layout):
        pol = self.kv_policy(fmt, layout)
        ref = kvref.quantize_kv(x, scale, pol)
        full = kvref.expand_scale(ref.scale, layout, tuple(x.shape))
        y = kvref.fp32_scaled(kvref.to_f32(x), full, pol.quant_op).clamp(-pol.fmax, pol.fmax).contiguous().numpy()
        codes = _truncate_toward_zero(y, encode_codes(y, fmt, pol.overflow), fmt)
        return kvref.KVCache(torch.from_numpy(codes).reshape(x.shape), ref.scale, fmt, layout)


_SWAPPED = (kvref.VLLM_SCALE_CONSTANTS[0], kvref.VLLM_SCALE_CONSTANTS[2], kvref.VLLM_SCALE_CONSTANTS[1])


@mutant("kv-swapped-vk-constants", "engine-side (first-batch) calibration divides K by V's constant 100 and V by "
        "K's constant 200", kills=("KV-CAL-001", "KV-UPDATE-002"))
class KVSwappedConstants(ReferenceEngine):
    def kv_calibrate(self, captures, strategy, *, layout="tensor", fmt="e4m3fn"):
        if kvref.strategy_name(strategy) != "engine_first_batch":
            return super().kv_calibrate(captures, strategy, layout=layout, fmt=fmt)
        q, k, v = captures[0][0]
        return kvref.calibrate_engine_first_batch(q, k, v, constants=_SWAPPED)

    def _kv_current_scales(self, layer, q, k, v, layout):
        layers = self._kv_layers()
        if layers.get(layer, 0) is None:
            layers[layer] = kvref.calibrate_engine_first_batch(q, k, v, constants=_SWAPPED)
        return super()._kv_current_scales(layer, q, k, v, layout)


@mutant("kv-p999-as-max", "trainer-side (B) calibration uses the max of the per-micro-batch amaxes instead of "
        "their 99.9th percentile", kills=("KV-CAL-002",))
class KVP999AsMax(ReferenceEngine):
    def kv_calibrate(self, captures, strategy, *, layout="tensor", fmt="e4m3fn"):
        if kvref.strategy_name(strategy) != "trainer_p999":
            return super().kv_calibrate(captures, strategy, layout=layout, fmt=fmt)
        fmax = get_format(fmt).max_finite
        return kvref.calibrate_trainer_percentile(captures, percentile=100.0, fp8_max=(448.0, fmax, fmax))


@mutant("kv-head-amax-pooled", "per-head amax calibration (C, layout head) pools all heads: one amax broadcast "
        "to every head", kills=("KV-CAL-003",))
class KVHeadAmaxPooled(ReferenceEngine):
    def kv_calibrate(self, captures, strategy, *, layout="tensor", fmt="e4m3fn"):
        if layout != "head":
            return super().kv_calibrate(captures, strategy, layout=layout, fmt=fmt)
        s = super().kv_calibrate(captures, strategy, layout=layout, fmt=fmt)
        return kvref.KVScales(s.q, s.k.max().expand(s.k.shape).clone(), s.v.max().expand(s.v.shape).clone())


@mutant("kv-reads-past-kv-len", "FP8 attention masks slots past kv_len with p = 0 but still multiplies their "
        "contents, so NaN garbage there poisons the sequence", kills=("KV-ATTN-002",))
class KVReadsPastKVLen(ReferenceEngine):
    def kv_attention(self, q, k_cache, v_cache, *, q_scale=None, causal=True, q_lengths=None, kv_lengths=None,
                     sm_scale=None):
        out = super().kv_attention(q, k_cache, v_cache, q_scale=q_scale, causal=causal, q_lengths=q_lengths,
                                   kv_lengths=kv_lengths, sm_scale=sm_scale)
        if kv_lengths is None:
            return out
        k, v = k_cache.dequantize(), v_cache.dequantize()
        for b, n in enumerate(torch.as_tensor(kv_lengths).tolist()):
            if not bool(torch.isfinite(k[b, n:]).all() & torch.isfinite(v[b, n:]).all()):
                out[b] = float("nan")  # 0 · NaN = NaN in every row of the sequence
        return out


__all__ = ["KVHeadAmaxPooled", "KVNoClamp", "KVP999AsMax", "KVReadsPastKVLen", "KVPerTensorScale", "KVQScaleIgnored", "KVScaleOne", "KVStaleScales",
           "KVSwappedConstants", "KVTruncatingStore"]


@mutant("kv-attention-ignores-sm-scale", "FP8 attention always scales the scores by 1/sqrt(D) and ignores the "
        "sm_scale it is given", kills=("KV-SPACE-002",))
class KVAttentionIgnoresSmScale(ReferenceEngine):
    def kv_attention(self, q, k_cache, v_cache, *, q_scale=None, causal=True, q_lengths=None, kv_lengths=None,
                     sm_scale=None):
        return super().kv_attention(q, k_cache, v_cache, q_scale=q_scale, causal=causal, q_lengths=q_lengths,
                                    kv_lengths=kv_lengths, sm_scale=None)


@mutant("kv-store-ignores-strides", "the KV store reads K/V memory as if it were contiguous [T, H, D] (a cache "
        "write kernel without strides): a transposed or sliced K/V is stored scrambled", kills=("KV-SPACE-001",))
class KVStoreIgnoresStrides(ReferenceEngine):
    def kv_store(self, x, scale, *, fmt, layout):
        if not x.is_contiguous():
            x = torch.as_strided(x, (x.numel(),), (1,), x.storage_offset()).reshape(x.shape)
        return super().kv_store(x, scale, fmt=fmt, layout=layout)
