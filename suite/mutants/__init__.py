"""Fault-injected engines: each one is the reference engine with one realistic bug.

A conformance check that kills no mutant is not a check. Each mutant declares the checks that must kill it
(``@mutant(name, description, kills=(...))``, in the module of its area); ``fp8rl mutants`` runs every mutant
against exactly those checks and fails if one survives a declared killer; ``fp8rl mutants --matrix area`` (the
mutant's whole area) and ``--matrix full`` (every check) find new killers. Mutation score (killed / total) is a
headline number; ``fp8rl checks`` lists, for each check, the mutants it kills.

Each mutant *declares* the same numerics as the reference engine (so it cannot escape by declaring its bug)
and then implements one thing wrong, the way real kernels have gone wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from fp8rl.engines.reference import ReferenceEngine

from . import (
    checkpoint,
    correction,
    e2e,
    formats,
    gemm,
    invariants,
    kv,
    learning,
    quantization,
    weight_sync,
    weight_sync_refit,
)
from ._base import Mutant, mutant

#: the area modules, in report order
AREA_MODULES: tuple[ModuleType, ...] = (formats, quantization, gemm, kv, correction, weight_sync, e2e, checkpoint,
                                        learning, invariants)


def _collect(modules: Iterable[ModuleType]) -> dict[str, Mutant]:
    out: dict[str, Mutant] = {}
    for module in modules:
        for obj in vars(module).values():
            m = getattr(obj, "__dict__", {}).get("fp8rl_mutant")
            if isinstance(m, Mutant) and obj.__module__ == module.__name__:
                if m.name in out:
                    raise ValueError(f"mutant name {m.name!r} declared twice")
                out[m.name] = m
    return dict(sorted(out.items()))


#: every mutant, by name
MUTANTS: dict[str, Mutant] = _collect(AREA_MODULES + (weight_sync_refit,))  # area weight_sync (its docstring)


def make_mutant(name: str) -> ReferenceEngine:
    try:
        return MUTANTS[name].factory()
    except KeyError:
        raise ValueError(f"mutant: unknown mutant {name!r}; known: {sorted(MUTANTS)}") from None


def killers_by_check() -> dict[str, list[str]]:
    """check id → the mutants that declare it as a killer."""
    out: dict[str, list[str]] = {}
    for m in MUTANTS.values():
        for cid in m.kills:
            out.setdefault(cid, []).append(m.name)
    return out


__all__ = ["AREA_MODULES", "MUTANTS", "Mutant", "killers_by_check", "make_mutant", "mutant"]
