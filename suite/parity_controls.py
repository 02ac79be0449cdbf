"""Positive controls of ``fp8rl parity``: conditions built to be wrong, which the parity verdict must call
"does not match BF16" (docs/learning-parity.md, "Positive controls"). Each is compared with the bf16 baseline.

``--control inverted-ratio``  rollouts with injected logit noise σ (``--sigma``, one value, default 1), corrected by
                              untruncated sequence IS with the ratio inverted: w = π_rollout/π_train, the trainer's
                              correction op being the one of the mutant ``learn-inverted-ratio``.
``--control wrong-policy``    rollouts sampled at temperature T (``--temperature``, default 3) whose reported
                              log-probs are the temperature-1 ones: the bug of the mutant
                              ``learn-logprobs-wrong-policy`` (vLLM's ``raw_logprobs``; fixed at T = 1.5 there) with
                              T as a parameter; bf16 recipe, the command's ``--correction`` (which cannot see it).
``--control noise``           rollouts sampled from the engine's bf16 logits + N(0, σ²) noise (fresh per sampled
                              token, reported consistently: the log-probs are those of the noisy distribution the
                              token was drawn from), no correction; one condition per σ of ``--sigma`` (a sweep,
                              default 0.5,1,2,4,8).

A comma-separated ``--sigma``/``--temperature`` is a sweep: parity.json's ``control.smallest_detected`` is the
smallest value parity called "does not match". The controls run on the reference engine (they test the parity
check, not an engine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: the engines of the controls live in :mod:`fp8rl.parity_control_engines` (torch, the oracle engine): this module is
#: imported by ``fp8rl --help``, which must not load torch; ``parity_controls.NoisyLogitsEngine`` still works (lazily)
_ENGINES = ("NoisyLogitsEngine", "TemperatureMismatchEngine")


def __getattr__(name: str) -> Any:
    if name in _ENGINES:
        from fp8rl import parity_control_engines

        return getattr(parity_control_engines, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONTROLS", "DEFAULTS", "PARAMETER", "Condition",
           "control_conditions", "parse_values"]

#: control name → what it breaks (the help text and parity.json)
CONTROLS = {
    "inverted-ratio": "untruncated sequence IS with the ratio inverted (w = pi_rollout/pi_train, mutant "
                      "learn-inverted-ratio) on rollouts with injected logit noise sigma",
    "wrong-policy": "log-probs of another policy than the one sampled: temperature-T sampling, temperature-1 "
                    "log-probs reported (mutant learn-logprobs-wrong-policy's bug), bf16 recipe",
    "noise": "rollouts from the bf16 logits + N(0, sigma^2) noise, no correction (one condition per sigma)",
}

#: the strength a control takes (its option without the dashes) and the values when the option is not given: the
#: inverted-ratio control's one σ, the noise control's σ sweep, the wrong-policy control's temperature(s)
PARAMETER = {"inverted-ratio": "sigma", "noise": "sigma", "wrong-policy": "temperature"}
DEFAULTS = {"inverted-ratio": (1.0,), "noise": (0.5, 1.0, 2.0, 4.0, 8.0), "wrong-policy": (3.0,)}


@dataclass(frozen=True)
class Condition:
    """One training condition of a parity run: its name, the rollout recipe and correction, and (controls) the
    rollout engine and the trainer's correction op that replace the command's engine and the oracle's."""

    name: str
    recipe: str
    correction: str
    engine: Any = None
    correct: Callable | None = None
    strength: float | None = None  #: the control's σ or temperature


def parse_values(option: str, text: str) -> tuple[float, ...]:
    """``--sigma 0.5,1,2`` → (0.5, 1.0, 2.0): finite, > 0, distinct; a clear error naming the option."""
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated numbers > 0 (e.g. 0.5,1,2), got {text!r}") from None
    if not vals or any(not (math.isfinite(v) and v > 0) for v in vals):
        raise ValueError(f"{option}: expected comma-separated finite numbers > 0, got {text!r}")
    if len(set(vals)) != len(vals):
        raise ValueError(f"{option}: expected distinct values, got {text!r}")
    return vals


def control_conditions(control: str, correction: str, values: Sequence[float] | None = None) -> list[Condition]:
    """The conditions of a control, each compared with the bf16 baseline, one per value of its strength
    (:data:`PARAMETER`; None: :data:`DEFAULTS`). The inverted-ratio control takes one σ and inverts untruncated
    sequence IS (``is``) whatever ``correction`` is: a cap (TIS, U = 2) bounds the inverted weights too and hides
    the bug at these σ (docs/learning-parity.md); the wrong-policy control applies ``correction``, which sees no
    mismatch in the reported log-probs."""
    from fp8rl.mutants import make_mutant
    from fp8rl.parity_control_engines import NoisyLogitsEngine, TemperatureMismatchEngine

    if control not in CONTROLS:
        raise ValueError(f"--control: expected one of {sorted(CONTROLS)}, got {control!r}")
    vals = tuple(values) if values else DEFAULTS[control]
    if control == "wrong-policy":
        if any(v == 1 for v in vals):
            raise ValueError("--temperature: expected values other than 1 (temperature 1 is the reported policy)")
        return [Condition(f"bf16+{correction} [wrong-policy T={t:g}]", "bf16", correction,
                          engine=TemperatureMismatchEngine(t), strength=t) for t in sorted(vals)]
    if control == "inverted-ratio":
        if len(vals) != 1:
            raise ValueError(f"--sigma: the inverted-ratio control takes one sigma, got {len(vals)}")
        inverted = make_mutant("learn-inverted-ratio")
        return [Condition(f"bf16+noise({vals[0]:g})+is [inverted-ratio]", "bf16", "is",
                          engine=NoisyLogitsEngine(vals[0]), correct=inverted.rollout_correction, strength=vals[0])]
    return [Condition(f"bf16+noise({v:g})+none", "bf16", "none", engine=NoisyLogitsEngine(v), strength=v)
            for v in sorted(vals)]
