"""Weight-sync and end-to-end mutants: the reference engine with one realistic weight-sync or rollout bug each.

Areas ``weight_sync`` (the synced checkpoint is wrong) and ``e2e`` (the running rollout policy is wrong). Imported
by :mod:`fp8rl.mutants` (and by the weight-sync / e2e conformance modules) so that they register with ``@mutant``.
"""

from __future__ import annotations

from fp8rl.engines.reference import ReferenceEngine
from fp8rl.mutants import mutant

_ROUTER = r"(^|\.)mlp\.gate\.weight$"


@mutant("wsync-router-quantized", "weight sync quantizes the MoE router mlp.gate to FP8 (it must stay BF16; "
        "the name filter lost its router exclusion)", "weight_sync")
class RouterQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(exclude=tuple(p for p in r.exclude if p != _ROUTER), include=r.include + (_ROUTER,))


@mutant("wsync-lm-head-quantized", "weight sync quantizes lm_head to FP8 (it must stay BF16: its logits feed "
        "sampling directly)", "weight_sync")
class LmHeadQuantized(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        head = r"(^|\.)lm_head\."
        return r.with_(exclude=tuple(p for p in r.exclude if p != head), include=r.include + (r"(^|\.)lm_head\.weight$",))


@mutant("wsync-scale-inverse", "weight sync stores the quant multiplier 1/s as *_weight_scale_inv (the name read "
        "literally) instead of the dequant scale s", "weight_sync")
class ScaleStoredInverse(ReferenceEngine):
    def weight_sync(self, state_dict):
        out = super().weight_sync(state_dict)
        return {k: (1.0 / v.double()).float() if k.endswith("_scale_inv") else v for k, v in out.items()}


@mutant("wsync-block-grid-transposed", "weight sync writes a non-square weight's 128x128 scale grid column-major "
        "into a row-major (ceil(N/128), ceil(K/128)) tensor", "weight_sync")
class SyncBlockGridTransposed(ReferenceEngine):
    def weight_sync(self, state_dict):
        out = super().weight_sync(state_dict)
        for k, v in out.items():
            if k.endswith("_scale_inv") and v.dim() == 2 and v.shape[0] != v.shape[1]:
                out[k] = v.t().contiguous().reshape(v.shape)
        return out


@mutant("e2e-stale-weights", "update_weights is acknowledged but the rollout keeps serving the previous step's "
        "weights", "e2e")
class StaleWeights(ReferenceEngine):
    def update_weights(self, handle, state_dict):
        return handle


@mutant("e2e-stale-kv-scales", "after a weight update the FP8 KV-cache scales are not recalibrated: the rollout "
        "keeps the previous step's q/k/v scales", "e2e")
class StaleKVScales(ReferenceEngine):
    def update_weights(self, handle, state_dict):
        synced = self.weight_sync(state_dict) if handle.recipe.synced_weights else None
        handle.update_weights(state_dict, synced=synced, recalibrate_kv=False)
        return handle


__all__ = ["LmHeadQuantized", "RouterQuantized", "ScaleStoredInverse", "StaleKVScales", "StaleWeights",
           "SyncBlockGridTransposed"]
