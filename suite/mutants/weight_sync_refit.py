"""Refit mutants (area ``weight_sync``, capability ``weight_sync.refit``): the reference engine's refit with one
realistic bug each — what goes wrong when a trainer re-quantizes the policy every step and loads it into a live FP8
inference model. Registered by :mod:`fp8rl.mutants` under the area ``weight_sync`` (their checks' area)."""

from __future__ import annotations

import dataclasses
import re

import torch
from fp8rl.engines.reference import ReferenceEngine

from ._base import mutant

AREA = "weight_sync"


def _weight_sync_area(cls):
    """The mutant's area is its checks' (``weight_sync``), not this module's name."""
    cls.fp8rl_mutant = dataclasses.replace(cls.__dict__["fp8rl_mutant"], area=AREA)
    return cls


def _first_refit_values(engine, slot: str, config, out: dict, pick) -> dict:
    """``out`` with the tensors ``pick(name, tensor)`` selects as the first refit of ``config`` returned them: what a
    load path that does not reach those parameters leaves in the live model."""
    first = engine.__dict__.setdefault(slot, {})
    kept = first.setdefault(repr(sorted(config.items())), {n: t for n, t in out.items() if pick(n, t)})
    return {n: kept.get(n, t) for n, t in out.items()}


@_weight_sync_area
@mutant("refit-stale-scale", "refit loads each step's FP8 codes but keeps the block scales of the first refit (a "
        "scale parameter the load path does not reach, e.g. a *_weight_scale_inv renamed by the kernel's "
        "post-processing, stays at its first value)", kills=("WSYNC-REFIT-001",))
class RefitStaleScale(ReferenceEngine):
    def refit(self, config, state_dict):
        return _first_refit_values(self, "_first_scales", config, super().refit(config, state_dict),
                                   lambda n, t: n.endswith("_scale_inv"))


@_weight_sync_area
@mutant("refit-cast-not-quantized", "refit casts the o_proj weights to float8_e4m3fn (saturating .to(), no block "
        "scale computed) and keeps the previous scale, instead of quantizing them", kills=("WSYNC-REFIT-001",))
class RefitCastNotQuantized(ReferenceEngine):
    def refit(self, config, state_dict):
        out = super().refit(config, state_dict)
        if state_dict is not None:
            for n, t in state_dict.items():
                if re.search(r"\.o_proj\.weight$", n) and n in out:
                    out[n] = t.detach().to(torch.bfloat16).float().clamp(-448, 448).to(torch.float8_e4m3fn)
        return out


@_weight_sync_area
@mutant("refit-skips-down-proj", "refit's name filter misses the MLP down projections (a family's projections "
        "matched by a pattern of the fused names only, gate_up_proj): they are loaded in BF16, unquantized",
        kills=("WSYNC-REFIT-001",))
class RefitSkipsDownProj(ReferenceEngine):
    def _weight_sync_recipe(self):
        r = super()._weight_sync_recipe()
        return r.with_(exclude=r.exclude + (r"\.down_proj\.weight$",))


@_weight_sync_area
@mutant("refit-half-updated", "refit writes the step's tensors into the live model one by one as they stream in and "
        "raises at the first one that does not fit, leaving the tensors before it updated (a half-updated policy)",
        kills=("WSYNC-REFIT-002",))
class RefitHalfUpdated(ReferenceEngine):
    def refit(self, config, state_dict):
        import json

        if state_dict is None:
            return super().refit(config, None)
        key = json.dumps(config, sort_keys=True, default=str)
        live = self._refit_live().get(key)
        if live is None:
            return super().refit(config, state_dict)
        for n, t in self.weight_sync(state_dict).items():
            if n not in live or live[n].shape != t.shape or live[n].dtype != t.dtype:
                raise ValueError(f"refit: {n} {tuple(t.shape)} does not fit the live model")
            live[n] = t
        return {n: t.clone() for n, t in live.items()}


@_weight_sync_area
@mutant("refit-keeps-previous-step", "refit keeps each step's synced tensors after loading them (a staging buffer "
        "or the replaced parameters held in a list that is never cleared): the engine's memory grows by one "
        "quantized model per RL step", kills=("WSYNC-REFIT-003",))
class RefitKeepsPreviousStep(ReferenceEngine):
    def refit(self, config, state_dict):
        out = super().refit(config, state_dict)
        if state_dict is not None:
            self.__dict__.setdefault("_refit_staged", []).append({n: t.clone() for n, t in out.items()})
        return out


@_weight_sync_area
@mutant("refit-kv-scales-not-reset", "refit loads each step's weights but not the KV-cache scales the step pushes: "
        "the attention keeps the scales of the first refit (a scale parameter freed after the first load, so the "
        "loader silently skips the name), as if the trainer never recalibrated", kills=("WSYNC-REFIT-004",))
class RefitKVScalesNotReset(ReferenceEngine):
    def refit(self, config, state_dict):
        from fp8rl.reference import weight_sync as ws

        return _first_refit_values(self, "_first_kv_scales", config, super().refit(config, state_dict),
                                   lambda n, t: ws.is_kv_cache_scale(n, tuple(t.shape)))
