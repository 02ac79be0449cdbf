"""Learning-level mutants: the reference engine with one bug each that leaves the numerics alone but biases the
policy gradient the trainer computes from its rollouts (area ``learning``, docs/learning-parity.md)."""

from __future__ import annotations

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import correction as C
from fp8rl.reference.rollout_hf import RolloutPolicy

from ._base import mutant


@mutant("learn-inverted-ratio", "IS weights applied with the ratio inverted: w = π_rollout/π_train, so the "
        "'corrected' gradient doubles the mismatch bias instead of removing it",
        kills=("LEARN-CORR-001",))
class LearnInvertedRatio(ReferenceEngine):
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        return C.rollout_correction(rollout_logp, train_logp, mask, config)


class _RawLogprobSampler(RolloutPolicy):
    """Samples at temperature 1.5 but reports the raw (temperature-1) log-probs and logits: vLLM's default
    ``logprobs_mode='raw_logprobs'`` (vllm/config/model.py ``ModelConfig.logprobs_mode``, vLLM 0.32.0) returns the
    model's log-probs before the sampler's temperature."""

    def decode_step(self, logits, greedy, generator):
        if greedy:
            return super().decode_step(logits, greedy, generator)
        x = logits.float()
        lp = torch.log_softmax(x, dim=-1)
        nxt = torch.multinomial(torch.softmax(x / 1.5, dim=-1), 1, generator=generator).squeeze(-1)
        return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), x


@mutant("learn-logprobs-wrong-policy", "rollout log-probs are those of another policy than the one sampled from: "
        "sampling at temperature 1.5, reporting the raw temperature-1 log-probs (vLLM V1's raw_logprobs default)",
        kills=("LEARN-SAMPLE-001",))
class LearnLogprobsWrongPolicy(ReferenceEngine):
    def _rollout_policy_class(self):
        return _RawLogprobSampler


@mutant("learn-is-before-adv-norm", "the IS weights are folded into the advantages and the advantage normalisation "
        "(whitening over the batch) runs after the correction, instead of weighting the per-token loss of the "
        "already normalised advantages: the whitening rescales and re-centres the corrected advantages",
        kills=("LEARN-ONPOL-001", "LEARN-CORR-001"))
class LearnIsBeforeAdvNorm(ReferenceEngine):
    def correction_loss(self, logp, old_logp, advantages, mask, weights, config):
        m = mask.detach() != 0
        adv = advantages.detach().double()
        if weights is not None:
            adv = adv * weights.detach().double()
        vals = adv[m]
        adv = torch.where(m, (adv - vals.mean()) / vals.std().clamp_min(1e-12), 0.0)
        return C.policy_loss(logp, old_logp, adv, mask, None, config).to(logp.dtype)


class _TopKSampler(RolloutPolicy):
    """Samples from the top-4 tokens only and reports that truncated distribution consistently (log-probs and
    logits, the others at −inf): a rollout policy without full support."""

    def decode_step(self, logits, greedy, generator):
        x = logits.float()
        kth = x.topk(4, dim=-1).values[:, -1:]
        x = torch.where(x >= kth, x, torch.tensor(float("-inf")))
        return super().decode_step(x, greedy, generator)


@mutant("learn-topk-no-support", "rollouts sample with top-k = 4 (a sampling default left on): π_rollout gives the "
        "other tokens probability 0, where no importance weight can correct, so even untruncated IS is biased",
        kills=("LEARN-ROLLOUT-001", "LEARN-SAMPLE-001"))
class LearnTopKNoSupport(ReferenceEngine):
    def _rollout_policy_class(self):
        return _TopKSampler
