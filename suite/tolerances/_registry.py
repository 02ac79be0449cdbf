"""The registry of the tolerance table: :class:`Tolerance`, the table ``TOLERANCES`` (in registration order:
the package imports the area modules in a fixed order, which is the table's order), ``_register`` (called
by each area module at import) and :func:`get`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """A named bound and its derivation."""

    name: str
    value: float
    derivation: str

    def __float__(self) -> float:
        return self.value


TOLERANCES: dict[str, Tolerance] = {}


def _register(name: str, value: float, derivation: str) -> Tolerance:
    if name in TOLERANCES:
        raise ValueError(f"tolerance {name!r} defined twice")
    t = Tolerance(name, float(value), derivation)
    TOLERANCES[name] = t
    return t


def get(name: str) -> Tolerance:
    """Look a tolerance up by name (KeyError lists the known names)."""
    try:
        return TOLERANCES[name]
    except KeyError:
        raise KeyError(f"unknown tolerance {name!r}; known: {sorted(TOLERANCES)}") from None
