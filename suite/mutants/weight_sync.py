"""Weight-sync mutants: the per-step BF16 → FP8 weight sync with one realistic bug each (area ``weight_sync``:
the synced checkpoint is wrong)."""

from __future__ import annotations

from fp8rl.engines.reference import ReferenceEngine

from ._base import mutant

_ROUTER = r"(^|\.)mlp\.gate\.weight$"


@mutant("wsync-router-quantized", "weight sync quantizes the MoE router mlp.gate to FP8 (it must stay BF16; "
        "the name filter lost its router exclusion)", kills=("WSYNC-EXCL-001", "WSYNC-NAMES-001"))
class RouterQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(exclude=tuple(p for p in r.exclude if p != _ROUTER), include=r.include + (_ROUTER,))


@mutant("wsync-lm-head-quantized", "weight sync quantizes lm_head to FP8 (it must stay BF16: its logits feed "
        "sampling directly)", kills=("WSYNC-EXCL-001", "WSYNC-NAMES-001"))
class LmHeadQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        head = r"(^|\.)lm_head\."
        return r.with_(exclude=tuple(p for p in r.exclude if p != head), include=r.include + (r"(^|\.)lm_head\.weight$",))


@mutant("wsync-scale-inverse", "weight sync stores the quant multiplier 1/s as *_weight_scale_inv (the name read "
        "literally) instead of the dequant scale s", kills=("WSYNC-BOUND-001", "WSYNC-EXACT-001"))
class ScaleStoredInverse(ReferenceEngine):
    def weight_sync(self, state_dict):
        out = super().weight_sync(state_dict)
        return {k: (1.0 / v.double()).float() if k.endswith("_scale_inv") else v for k, v in out.items()}


@mutant("wsync-block-grid-transposed", "weight sync writes a non-square weight's 128x128 scale grid column-major "
        "into a row-major (ceil(N/128), ceil(K/128)) tensor", kills=("WSYNC-BOUND-001", "WSYNC-EXACT-001"))
class SyncBlockGridTransposed(ReferenceEngine):
    def weight_sync(self, state_dict):
        out = super().weight_sync(state_dict)
        for k, v in out.items():
            if k.endswith("_scale_inv") and v.dim() == 2 and v.shape[0] != v.shape[1]:
                out[k] = v.t().contiguous().reshape(v.shape)
        return out


@mutant("wsync-fp32-direct", "weight sync quantizes the trainer's fp32 master weights directly instead of casting "
        "them to BF16 first (block amax and rounding taken from the fp32 values; the rest still shipped in BF16)",
        kills=("WSYNC-MASTER-001",))
class SyncFP32Direct(ReferenceEngine):
    def weight_sync(self, state_dict):
        import torch
        from fp8rl.reference import weight_sync as ws

        out = ws.quantize_state_dict(state_dict, self._weight_sync_recipe().with_(cast_dtype=torch.float32))
        return {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith(ws.SCALE_SUFFIX) else v
                for k, v in out.items()}


@mutant("wsync-shared-gate-quantized", "weight sync quantizes the shared-expert gate mlp.shared_expert_gate (a "
        "name filter that takes every 2-D 'mlp' weight but the router: it must stay BF16)",
        kills=("WSYNC-EXCL-001", "WSYNC-NAMES-001"))
class SharedGateQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(exclude=tuple(p for p in r.exclude if "shared_expert_gate" not in p),
                       include=r.include + (r"(^|\.)mlp\.shared_expert_gate\.weight$",))


@mutant("wsync-shared-expert-skipped", "weight sync's name filter knows the dense MLP and the routed experts only "
        "(mlp.(gate|up|down)_proj, mlp.experts.<e>.*): the shared expert's projections ship in BF16 and the rollout "
        "runs them unquantized", kills=("WSYNC-EXACT-001", "WSYNC-NAMES-001"))
class SharedExpertSkipped(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(include=(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$",
                                r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$",
                                r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$"))
