"""End-to-end mutants: a running rollout policy with one realistic weight-update bug each (area ``e2e``)."""

from __future__ import annotations

from fp8rl.engines.reference import ReferenceEngine

from ._base import mutant


@mutant("e2e-stale-weights", "update_weights is acknowledged but the rollout keeps serving the previous step's "
        "weights", kills=("E2E-UPDATE-001",))
class StaleWeights(ReferenceEngine):
    def update_weights(self, handle, state_dict):
        return handle


@mutant("e2e-stale-kv-scales", "after a weight update the FP8 KV-cache scales are not recalibrated: the rollout "
        "keeps the previous step's q/k/v scales", kills=("E2E-UPDATE-001",))
class StaleKVScales(ReferenceEngine):
    def update_weights(self, handle, state_dict):
        synced = self.weight_sync(state_dict) if handle.recipe.synced_weights else None
        handle.update_weights(state_dict, synced=synced, recalibrate_kv=False)
        return handle
