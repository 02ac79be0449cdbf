"""What a mutant is: the reference engine with one realistic bug, and the checks that must kill it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fp8rl.engines.reference import ReferenceEngine


@dataclass(frozen=True)
class Mutant:
    """A fault-injected engine.

    ``area``: the check area whose checks the mutant targets (the name of its module in :mod:`fp8rl.mutants`);
    ``kills``: the ids of the checks that must kill it (each must fail or error on it). ``fp8rl mutants`` runs every
    mutant against exactly these checks; ``fp8rl mutants --matrix area|full`` against more, to find new killers.
    """

    name: str
    description: str
    area: str
    kills: tuple[str, ...]
    factory: Callable[[], ReferenceEngine]


_M = TypeVar("_M", bound=ReferenceEngine)


def mutant(name: str, description: str, *, kills: Sequence[str]) -> Callable[[type[_M]], type[_M]]:
    """Class decorator declaring a mutant: its name (``mutant:<name>`` as an engine), its bug, and its killers.

    The area is the module's name (``fp8rl.mutants.kv`` → ``kv``); :mod:`fp8rl.mutants` collects every decorated
    class of its area modules into ``MUTANTS``."""
    kills = tuple(kills)
    if not kills or not all(isinstance(k, str) and k for k in kills):
        raise ValueError(f"mutant {name!r}: kills: expected the ids of the checks that kill it, got {kills!r}")

    def deco(cls: type[_M]) -> type[_M]:
        cls.name = f"mutant:{name}"
        cls.description = description
        # a marker read from the class's own __dict__ (fp8rl.mutants), not an Engine attribute
        setattr(cls, "fp8rl_mutant", Mutant(name, description, cls.__module__.rsplit(".", 1)[-1], kills, cls))  # noqa: B010
        return cls

    return deco
