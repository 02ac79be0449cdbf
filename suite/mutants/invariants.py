"""Invariant mutants: the reference engine with one bug that no declared-policy comparison is meant to see, but a
universal invariant is (area ``invariants``: finiteness whatever the policy, inputs left untouched, gradient only
into the current log-probs, per-layer state kept per layer).

Each mutant declares the reference engine's numerics and answers like it for fp32 inputs (forward values of the
loss identical), so the invariant is what kills it:

=================================  ==============================================================================
mutant                             bug (where it has happened)
=================================  ==============================================================================
fp16-scale-underflow               a half-precision fast path computes the scale in the input dtype with
                                   max(amax/448, 1e-12): 1e-12 underflows to 0 in fp16, so an all-zero group gets
                                   scale 0 and 0/0 = NaN codes (vLLM ``scaled_quantize`` / SGLang native paths
                                   with ``compute_dtype="input"`` and a 1e-12 amax floor)
kv-store-fp16-nan                  per-token-head KV scales computed in the K/V dtype without the 1e-6 floor: a
                                   zero (token, head) gets scale 0 and 0·(1/0) = NaN codes
quantize-inplace                   the quantizer uses the caller's tensor as scratch: x /= s; clamp_ in place
correction-loss-old-logp-grad      PPO ratio exp(logp − old_logp) and the IS weights not detached: the gradient
                                   flows into the old log-probs, the advantages and the weights
kv-reset-all-layers                a reset (scales=None, "recalibrate on the next batch") flips a model-wide flag:
                                   every layer recalibrates (vLLM's ``calculate_kv_scales`` is a model config)
=================================  ==============================================================================
"""

from __future__ import annotations

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import correction as C
from fp8rl.reference import kv as kvref
from fp8rl.reference.formats import encode_codes
from fp8rl.reference.quant import QuantizedTensor, compute_amax, quantize_with_scale

from ._base import mutant

_HALF = (torch.float16, torch.bfloat16)


@mutant("fp16-scale-underflow", "for fp16/bf16 inputs the scale is computed in the input dtype as "
        "max(amax/448, 1e-12): the 1e-12 floor underflows to 0 in fp16, so an all-zero group gets scale 0 and NaN "
        "codes (declares the reference policy)", kills=("INV-FINITE-001",))
class Fp16ScaleUnderflow(ReferenceEngine):
    def quantize(self, x, granularity):
        if x.dtype not in _HALF:
            return super().quantize(x, granularity)
        policy = self.scale_policy(granularity.kind)
        amax = compute_amax(x, granularity).to(x.dtype)  # exact: the amax is one of x's values
        floor = torch.tensor(1e-12, dtype=x.dtype)  # 0 in fp16
        scale = torch.maximum(amax / policy.max_value, floor).float().contiguous()
        codes = quantize_with_scale(x, scale, granularity, policy)
        return QuantizedTensor(codes, scale, granularity, policy)


@mutant("kv-store-fp16-nan", "for fp16/bf16 K/V the per-token-head scale is amax/max computed in the input dtype "
        "without the 1e-6 floor: a zero (token, head) gets scale 0 and 0·(1/0) = NaN codes", kills=("INV-FINITE-002",))
class KVStoreHalfNaN(ReferenceEngine):
    def kv_store(self, x, scale, *, fmt, layout):
        if layout != "token_head" or x.dtype not in _HALF:
            return super().kv_store(x, scale, fmt=fmt, layout=layout)
        pol = self.kv_policy(fmt, layout)
        s = (x.detach().abs().amax(dim=-1) / pol.fmax).float()  # in x's dtype, no floor
        y = kvref.fp32_scaled(kvref.to_f32(x), kvref.expand_scale(s, layout, tuple(x.shape)), pol.quant_op)
        y = y.clamp(-pol.fmax, pol.fmax)  # NaN stays NaN
        codes = torch.from_numpy(encode_codes(y.contiguous(), fmt, pol.overflow)).reshape(x.shape)
        return kvref.KVCache(codes, s, fmt, layout)


@mutant("quantize-inplace", "quantize writes q = clamp(x/s, ±T) into the caller's tensor (x.div_(s).clamp_(...) "
        "on the input, used as scratch) before the cast; its codes and scales are the reference's",
        kills=("INV-FINITE-001", "INV-INPUT-001"))
class QuantizeInPlace(ReferenceEngine):
    def quantize(self, x, granularity):
        qt = super().quantize(x, granularity)
        t = qt.policy.max_value
        with torch.no_grad():
            x.div_(qt.expanded_scale().to(x.dtype)).clamp_(-t, t)
        return qt


@mutant("correction-loss-old-logp-grad", "the policy loss takes exp(logp − old_logp) and multiplies by the "
        "advantages and the IS weights without detaching them: same loss value, but the gradient flows into "
        "old_logp, advantages and weights", kills=("INV-GRAD-001",))
class CorrectionLossOldLogpGrad(ReferenceEngine):
    def correction_loss(self, logp, old_logp, advantages, mask, weights, config):
        m = mask.detach() != 0
        zero = torch.zeros((), dtype=torch.float64)
        lp = torch.where(m, logp.double(), zero)
        old = torch.where(m, old_logp.double(), zero)  # not detached
        adv = torch.where(m, advantages.double(), zero)  # not detached
        loss = C.ppo_clip_token_loss(lp, old, adv, config) if config.kind == "ppo_clip" else -adv * lp
        if weights is not None:
            loss = loss * torch.where(m, weights.double(), zero)  # not detached
        return C.aggregate(loss, mask, config.agg).to(logp.dtype)


@mutant("kv-reset-all-layers", "kv_update_scales(layer, None) resets every layer (a model-wide 'recalibrate' "
        "flag), so every other layer recalibrates from its next batch", kills=("INV-LAYER-001",))
class KVResetAllLayers(ReferenceEngine):
    def kv_update_scales(self, layer, scales):
        if scales is None:
            layers = self._kv_layers()
            for key in list(layers):
                layers[key] = None
        return super().kv_update_scales(layer, scales)


@mutant("delayed-scaling", "the quantizer declares dynamic scaling but scales each tensor with the amax of the "
        "previous call of the same shape and granularity (delayed scaling, as TransformerEngine's amax history does, "
        "used where the recipe is dynamic): a tensor's codes depend on what was quantized before it",
        kills=("INV-STATE-001",))
class DelayedScaling(ReferenceEngine):
    def __init__(self) -> None:
        super().__init__()
        self._previous: dict[tuple, torch.Tensor] = {}

    def quantize(self, x, granularity):
        policy = self.scale_policy(granularity.kind)
        key = (tuple(x.shape), granularity)
        own = super().quantize(x, granularity).scale
        scale = self._previous.get(key, own)
        self._previous[key] = own
        return QuantizedTensor(quantize_with_scale(x, scale, granularity, policy), scale.clone(), granularity, policy)


__all__ = ["CorrectionLossOldLogpGrad", "Fp16ScaleUnderflow", "KVResetAllLayers", "KVStoreHalfNaN", "QuantizeInPlace",
           "DelayedScaling"]


