"""End-to-end mutants: a running rollout policy with one realistic bug each (area ``e2e``): weight updates, and the
sampler / reported log-probs (the self-consistency checks)."""

from __future__ import annotations

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference.rollout_hf import RolloutPolicy

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


# -- rollout self-consistency (E2E-LOGPROB-001, E2E-ARGMAX-001, E2E-GOF-001): a sampler or log-prob bug each; the
#    policies below change RolloutPolicy.decode_step only (the model numerics stay the oracle's)


class _HotSampler(RolloutPolicy):
    def decode_step(self, logits, greedy, generator):
        if greedy:
            return super().decode_step(logits, greedy, generator)
        x = logits.float()
        lp = torch.log_softmax(x, dim=-1)
        nxt = torch.multinomial(torch.softmax(x / 0.7, dim=-1), 1, generator=generator).squeeze(-1)
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x


@mutant("e2e-sample-temperature", "the sampler draws at temperature 0.7 (a generation_config default leaking into "
        "sampling) while the log-probs and logits it reports are those of temperature 1", kills=("E2E-GOF-001",))
class SampleTemperature(ReferenceEngine):
    def _rollout_policy_class(self):
        return _HotSampler


class _TopKSampler(RolloutPolicy):
    TOP_K = 50

    def decode_step(self, logits, greedy, generator):
        if greedy:
            return super().decode_step(logits, greedy, generator)
        x = logits.float()
        lp = torch.log_softmax(x, dim=-1)
        top = x.topk(self.TOP_K, dim=-1)
        pick = torch.multinomial(torch.softmax(top.values, dim=-1), 1, generator=generator)
        nxt = top.indices.gather(-1, pick).squeeze(-1)
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x


@mutant("e2e-sample-top-k", "tokens are sampled from the top-50 truncated distribution (transformers' historical "
        "default top_k=50) while the reported log-probs and logits are the full distribution's",
        kills=("E2E-GOF-001",))
class SampleTopK(ReferenceEngine):
    def _rollout_policy_class(self):
        return _TopKSampler


class _SharedStreamSampler(RolloutPolicy):
    def decode_step(self, logits, greedy, generator):
        if greedy:
            return super().decode_step(logits, greedy, generator)
        x = logits.float()
        lp = torch.log_softmax(x, dim=-1)
        u = torch.rand((), generator=generator, dtype=torch.float64)  # one draw for every row of the batch
        cdf = lp.double().exp().cumsum(-1)
        nxt = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].expand(-1, 1).contiguous()).squeeze(-1)
        nxt = nxt.clamp_max(x.shape[-1] - 1)
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x


@mutant("e2e-shared-random-stream", "every row of a batch samples with the same random stream (one seed per batch "
        "handed to every request): the copies of a prompt in a GRPO group get identical responses",
        kills=("E2E-GOF-001",))
class SharedRandomStream(ReferenceEngine):
    def _rollout_policy_class(self):
        return _SharedStreamSampler


class _FP8ArgmaxPolicy(RolloutPolicy):
    def decode_step(self, logits, greedy, generator):
        if not greedy:
            return super().decode_step(logits, greedy, generator)
        x = logits.float()
        lp = torch.log_softmax(x, dim=-1)
        x8 = x.to(torch.float8_e4m3fn).float()  # logits read from an FP8 buffer
        nxt = x.shape[-1] - 1 - x8.flip(-1).argmax(-1)  # ties (which the rounding creates) to the last token id
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x


@mutant("e2e-greedy-not-argmax", "greedy decoding takes the argmax of the logits rounded to FP8 e4m3 (a sampler "
        "reading an FP8 logits buffer) and breaks the ties that rounding creates toward the last token id: on "
        "near-ties the second-best token wins", kills=("E2E-ARGMAX-001",))
class GreedyNotArgmax(ReferenceEngine):
    def _rollout_policy_class(self):
        return _FP8ArgmaxPolicy


class _BF16LogprobPolicy(RolloutPolicy):
    def decode_step(self, logits, greedy, generator):
        nxt, _, x = super().decode_step(logits, greedy, generator)
        lp16 = torch.log_softmax(x.to(torch.bfloat16), dim=-1)  # the log-softmax evaluated in BF16
        return nxt, lp16.gather(-1, nxt[:, None]).squeeze(-1).float(), x


@mutant("e2e-logprob-bf16", "the reported log-probs are a log-softmax evaluated in BF16 (the logits' dtype) "
        "instead of fp32; tokens are drawn from the fp32 distribution", kills=("E2E-LOGPROB-001",))
class LogprobBF16(ReferenceEngine):
    def _rollout_policy_class(self):
        return _BF16LogprobPolicy
