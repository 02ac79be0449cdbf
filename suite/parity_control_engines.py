"""The rollout engines of fp8rl parity's positive controls (:mod:`fp8rl.parity_controls`): the oracle engine with
its rollout policy's logits perturbed by N(0, σ²) noise, or sampled at temperature T while the temperature-1
log-probs are reported."""

from __future__ import annotations

import math

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference.rollout_hf import RolloutPolicy

__all__ = ["NoisyLogitsEngine", "TemperatureMismatchEngine"]


class _NoisyLogitsPolicy(RolloutPolicy):
    """Samples from softmax(logits + σ·ε), ε ~ N(0, 1) drawn per sampled token from the rollout's generator, and
    reports log_softmax(logits + σ·ε) at the drawn token and those logits: a rollout policy that differs from the
    trainer's by a mismatch of known size, reported consistently (an IS weight could correct it)."""

    sigma: float = 0.0

    def decode_step(self, logits, greedy, generator):
        x = logits.float()
        if not greedy:
            x = x + self.sigma * torch.randn(x.shape, generator=generator, dtype=x.dtype)
        lp = torch.log_softmax(x, dim=-1)
        nxt = lp.argmax(-1) if greedy else torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x


class _TemperatureMismatchPolicy(RolloutPolicy):
    """Samples at temperature ``temperature`` and reports the temperature-1 log-probs and logits: the bug of the
    mutant ``learn-logprobs-wrong-policy`` (fixed there at 1.5; vLLM's ``logprobs_mode="raw_logprobs"``) with the
    temperature as a parameter."""

    temperature: float = 1.5

    def decode_step(self, logits, greedy, generator):
        if greedy:
            return super().decode_step(logits, greedy, generator)
        x = logits.float()
        lp = torch.log_softmax(x, dim=-1)
        nxt = torch.multinomial(torch.softmax(x / self.temperature, dim=-1), 1, generator=generator).squeeze(-1)
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x


class TemperatureMismatchEngine(ReferenceEngine):
    """The reference engine whose sampled rollouts come from temperature T while it reports temperature-1
    log-probs (:class:`_TemperatureMismatchPolicy`)."""

    def __init__(self, temperature: float) -> None:
        if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0
                and temperature != 1):
            raise ValueError(f"temperature: expected a finite number > 0 other than 1, got {temperature!r}")
        super().__init__()
        self.temperature = float(temperature)
        self.name = f"reference+temperature-mismatch(T={self.temperature:g})"

    def _rollout_policy_class(self):
        name = f"TemperatureMismatchPolicy[T={self.temperature!r}]"
        return type(name, (_TemperatureMismatchPolicy,), {"temperature": self.temperature, "__qualname__": name})


class NoisyLogitsEngine(ReferenceEngine):
    """The reference engine whose sampled rollouts add N(0, σ²) noise to the logits (:class:`_NoisyLogitsPolicy`)."""

    def __init__(self, sigma: float) -> None:
        if not (isinstance(sigma, int | float) and math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"sigma: expected a finite number > 0, got {sigma!r}")
        super().__init__()
        self.sigma = float(sigma)
        self.name = f"reference+noise(sigma={self.sigma:g})"

    def _rollout_policy_class(self):
        # the qualified name carries σ: the reference policy's rollout memo is keyed by the policy class's name
        name = f"NoisyLogitsPolicy[sigma={self.sigma!r}]"
        return type(name, (_NoisyLogitsPolicy,), {"sigma": self.sigma, "__qualname__": name})
