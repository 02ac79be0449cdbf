"""The one tolerance table of fp8rl.

Every bound used anywhere in the suite (conformance checks, the suite's own tests, perf gates) is defined here,
with its derivation. Nothing else in the code base hard-codes a tolerance: code asks this module by name.

Two kinds of entries:

* constants (``Tolerance``): a number plus the derivation of why that number;
* bound functions: a pure function of the inputs (shapes, magnitudes, formats) returning an elementwise bound,
  whose docstring is the derivation.

Unit roundoff notation: for a binary floating-point format with p significand bits (implicit bit included),
u = 2^-p is the maximal relative error of round-to-nearest; fp32 p = 24, bf16 p = 8, fp16 p = 11, fp64 p = 53.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: unit roundoff (round-to-nearest) of the formats used for accumulation/output
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}
#: smallest positive subnormal of each output/accumulation format (absolute underflow term)
MIN_SUBNORMAL: dict[str, float] = {
    "float64": 2.0**-1074,
    "float32": 2.0**-149,
    "bfloat16": 2.0**-133,
    "float16": 2.0**-24,
}


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


def gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 − n·u) (Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1).

    |Π_{i≤n}(1+δ_i)^{±1} − 1| ≤ γ_n when every |δ_i| ≤ u and n·u < 1. Recursive summation of n terms in a
    format with unit roundoff u, in any order, has |fl(Σx) − Σx| ≤ γ_{n−1}·Σ|x| (Higham eq. 4.4).
    """
    if n * u >= 1:
        return math.inf
    return n * u / (1 - n * u)


# ---------------------------------------------------------------------------------------------------------------
# Exact comparisons (bit-exact checks) — recorded so the table is complete.
EXACT = _register(
    "exact",
    0.0,
    "Bit-exact: the spec fixes the result (an FP8 cast with a declared rounding/overflow policy, codes and scales "
    "given a ScalePolicy). Any difference is a bug or an undeclared policy.",
)

# ---------------------------------------------------------------------------------------------------------------
# Foundation (formats, quantization, GEMM) entries are added below this line.
