"""Area ``e2e``: FP8 rollouts of tiny Qwen3 models vs the BF16 trainer (docs/paper-numbers.md §1.3–1.5, §3.4).

The engine generates from fixed prompts under each numerics recipe (``bf16``, ``fp8-linear``, ``fp8-linear-ptpc``,
``fp8-kv``, ``fp8-all``); the trainer oracle (transformers, BF16, teacher-forced) scores the same tokens. The
mismatch — k3 KL, token_mult_prob_error, max |Δlogp|, first divergence of greedy decoding — must stay within
budgets set from the measured distribution of the reference FP8 emulation with margins (``fp8rl.tolerances``,
entries ``e2e.*``, registered from the data file ``fp8rl/data/e2e_budgets.json`` that
``python -m fp8rl.conformance._e2e_calibrate --seeds 10 --write`` writes).
After ``update_weights`` the rollout must follow the new weights, including freshly calibrated FP8 KV scales.
The report gets a ``mismatch`` section: the table per model and recipe and a plot of |Δlogp| along the sequence.
The architecture-variant fixtures (``tiny-qwen2-moe``: shared expert + gate, no QK-norm, q/k/v biases;
``tiny-qwen3-tied-odd``: tied embeddings, no projection dimension a multiple of 128) run the ``bf16`` and ``fp8-all``
recipes.

Self-consistency (capability ``rollout.logits``: the engine exposes the logits it sampled from): the log-probs it
reports are the fp32 log-softmax of those logits at the token; greedy tokens are maximal in their row; sampled
tokens follow softmax(logits) (a goodness-of-fit test with a stated false-alarm rate). They need no trainer: they
judge the engine against itself.
"""

from __future__ import annotations

import pytest
import torch
from fp8rl import fixtures, tolerances
from fp8rl.checks import check, record_metrics, record_section
from fp8rl.reference import rollout as R

from . import _e2e as E

CASES = pytest.mark.parametrize("model,recipe", E.CASES)
#: the goodness-of-fit cases: every model, BF16 (the sampler is the engine's, whatever the numerics recipe)
GOF_CASES = pytest.mark.parametrize("model,recipe", [(m, "bf16") for m in E.MODELS])


def _record(res: E.CaseResult) -> None:
    m = res.metrics
    record_metrics(k3_kl=m["k3_kl"], token_mult_prob_error=m["token_mult_prob_error"],
                   max_dlogp=m["max_abs_dlogp"], mean_dlogp=m["mean_abs_dlogp"], first_div_mean=m["first_div_mean"],
                   err_over_bound=max(m[k] / E.budget(k, res.model, res.recipe) for k in E.METRICS
                                      if k != "token_mult_prob_error"))


@CASES
@check("E2E-MISMATCH-001", "Sampled rollouts (8 fixed prompts x 20 tokens, temperature 1): the engine's "
       "log-probs vs the BF16 trainer's on the same tokens have k3 KL, token_mult_prob_error and max |dlogp| "
       "within the recipe's budget (measured reference-emulation distribution x margin).",
       bound="e2e_mismatch", requires=["rollout.{recipe}"], timeout=600)
def test_mismatch_budget_stat(engine, model, recipe, run_seed):
    E.require_model(engine, model)
    section = E.mismatch_section(engine, run_seed)  # every case of the section (the engine may start them together)
    res = E.cached_case(engine, model, recipe, run_seed=run_seed)
    record_section("mismatch", section)
    _record(res)
    bad = E.within_budget(res)
    assert not bad, f"mismatch over budget: {'; '.join(bad)}\n  {E.fmt_case(res)}"


@CASES
@check("E2E-GREEDY-001", "Greedy rollouts of the fixed prompts stay on the BF16 trainer's greedy continuation "
       "for at least the recipe's floor of tokens on average (first divergence position).",
       bound="e2e_mismatch", requires=["rollout.{recipe}"], timeout=600)
def test_greedy_first_divergence_stat(engine, model, recipe, run_seed):
    E.require_model(engine, model)
    section = E.mismatch_section(engine, run_seed)
    res = E.cached_case(engine, model, recipe, run_seed=run_seed)
    record_section("mismatch", section)
    floor = E.budget("first_div_mean", model, recipe)
    record_metrics(first_div_mean=res.metrics["first_div_mean"], first_div_min=res.metrics["first_div_min"])
    assert res.metrics["first_div_mean"] >= floor, (
        f"greedy rollouts leave the trainer's greedy path after {res.metrics['first_div_mean']:.3g} tokens on "
        f"average (floor {floor:.3g})\n  {E.fmt_case(res)}")


@CASES
@check("E2E-LOGITS-001", "rollout_logits returns the same tokens and log-probs as rollout for the same prompts, "
       "length, mode and seed (greedy and sampled, bit for bit): the logits it exposes are those of the rollout.",
       requires=["rollout.{recipe}", "rollout.logits"], timeout=600)
def test_rollout_logits_reproduce_rollout_exact(engine, model, recipe, run_seed):
    E.require_model(engine, model)
    lc = E.logits_case(engine, model, recipe, run_seed=run_seed)
    bad = []
    for mode, got, (tok, lp) in (("greedy", lc.greedy, lc.rollout_greedy), ("sampled", lc.sampled, lc.rollout_sampled)):
        if not torch.equal(got.tokens, tok):
            diff = (got.tokens != tok).nonzero()
            bad.append(f"{mode}: {len(diff)} tokens differ (first at (row, position) {diff[0].tolist()})")
        elif not torch.equal(got.logprobs.view(torch.int32), lp.view(torch.int32)):
            d = (got.logprobs.double() - lp.double()).abs()
            bad.append(f"{mode}: {int((d > 0).sum())} log-probs differ (max |diff| {float(d.max()):.3g})")
    record_metrics(mismatch_frac=float(len(bad)) / 2)
    assert not bad, f"{model} {recipe}: rollout_logits is not the rollout: " + "; ".join(bad)


@CASES
@check("E2E-LOGPROB-001", "Every log-prob a rollout reports (greedy and sampled, 8 prompts x 20 tokens) is the fp32 "
       "log-softmax, at the token, of the logits the engine drew that token from, within the fp32 evaluation "
       "bound: no other temperature, no BF16 log-softmax, no stale logits.", bound="rollout_logprob_fp32",
       requires=["rollout.{recipe}", "rollout.logits"], timeout=600)
def test_rollout_logprobs_are_log_softmax_bound(engine, model, recipe, run_seed):
    E.require_model(engine, model)
    lc = E.logits_case(engine, model, recipe, run_seed=run_seed)
    msgs, worst = [], 0.0
    for mode, r in (("greedy", lc.greedy), ("sampled", lc.sampled)):
        err, bound = E.logprob_excess(r)
        ratio = err / bound.clamp_min(1e-300)
        worst = max(worst, float(ratio.max()))
        over = ~(err <= bound)
        if bool(over.any()):
            i = int(ratio.reshape(-1).argmax())
            b, t = divmod(i, ratio.shape[1])
            want = float(torch.log_softmax(r.logits[b, t].double(), -1)[r.new[b, t]])
            msgs.append(f"{mode}: {int(over.sum())}/{over.numel()} log-probs off (worst at row {b}, token {t}: "
                        f"reported {float(r.logprobs[b, t]):.7g}, log_softmax {want:.7g}, |diff| "
                        f"{float(err[b, t]):.3g} > bound {float(bound[b, t]):.3g})")
    record_metrics(err_over_bound=worst)
    assert not msgs, f"{model} {recipe}: reported log-probs are not the fp32 log-softmax of the logits: " + \
        "; ".join(msgs)


@CASES
@check("E2E-ARGMAX-001", "Every greedy token is a maximal entry of the logits row it was chosen from (8 prompts x "
       "20 tokens; ties: any of the tied maxima, compared exactly in the reported fp32 values).",
       requires=["rollout.{recipe}", "rollout.logits"], timeout=600)
def test_greedy_tokens_are_argmax_exact(engine, model, recipe, run_seed):
    E.require_model(engine, model)
    r = E.logits_case(engine, model, recipe, run_seed=run_seed).greedy
    bad = E.argmax_violations(r)
    record_metrics(mismatch_frac=float(bad.double().mean()))
    if bool(bad.any()):
        b, t = bad.nonzero()[0].tolist()
        row = r.logits[b, t]
        top2 = row.topk(2)
        raise AssertionError(
            f"{model} {recipe}: {int(bad.sum())}/{bad.numel()} greedy tokens are not the argmax of their logits "
            f"(first at row {b}, token {t}: chose {int(r.new[b, t])} with logit {float(row[r.new[b, t]]):.7g}, "
            f"max {float(top2.values[0]):.7g} at {int(top2.indices[0])}, second {float(top2.values[1]):.7g})")


@GOF_CASES
@check("E2E-GOF-001", "Sampled tokens follow the distribution the engine reports: over 8192 draws (the 8 fixed "
       "prompts x 64 copies in one batch, 16 tokens each, temperature 1), the randomized probability integral "
       "transforms under the reported softmax(logits) pass a Kolmogorov-Smirnov test against Uniform(0, 1) at "
       "false-alarm rate 1e-6 (DKW bound): no hidden temperature, top-k/top-p truncation or shared random streams "
       "across a group.", bound="rollout_gof", requires=["rollout.{recipe}", "rollout.logits"], timeout=600)
def test_samples_follow_reported_distribution_stat(engine, model, recipe, run_seed):
    E.require_model(engine, model)
    r = E.gof_rollout(engine, model, recipe, run_seed=run_seed)
    u = E.pit_values(r, seed=0x5EED + int(run_seed))
    d = E.ks_uniform(u)
    n = u.numel()
    eps = tolerances.rollout_gof_threshold(n, E.gof_tv_allowance(r))
    record_metrics(ks_d=d, ks_threshold=eps, err_over_bound=d / eps)
    assert d <= eps, (
        f"{model} {recipe}: sampled tokens do not follow the reported distribution: KS distance of the {n} PIT "
        f"values from uniform {d:.4f} > {eps:.4f} (false-alarm rate {tolerances.get('rollout_gof').value:g}); mean "
        f"PIT {float(u.mean()):.4f} (0.5 expected; < 0.5: mass moved to likely tokens, e.g. a lower temperature or "
        f"top-k/top-p truncation)")


# E2E-UPDATE-001 is defined last on purpose: it leaves each (model, recipe) LLM on the step-1 weights, and an engine
# whose in-place reload is partial (vLLM on CPU: MoE experts, a tied LM head) gets a fresh LLM for the next check
# that needs the step-0 weights (vllm/llm.py); defined before the other checks, it cost vLLM's CI run ~3 min of
# restarts. Checks run in definition order within a module (pytest), so nothing after it needs step 0.
@CASES
@check("E2E-UPDATE-001", "After a rollout on step-0 weights and update_weights(step-1 weights), sampled "
       "rollouts follow the NEW policy: their mismatch vs the BF16 trainer at step 1 is within budget and smaller "
       "than vs step 0. The update grows K/V 8x, so FP8 KV scales must be recalibrated (or pushed).",
       bound="e2e_mismatch", requires=["rollout.{recipe}", "update_weights"], timeout=600)
def test_update_weights_follow_new_policy_stat(engine, model, recipe, run_seed):
    E.require_model(engine, model)
    m0, m1 = fixtures.tiny_model(model, "base"), fixtures.tiny_model(model, "update")
    p, plen = E.prompts(), E.prompt_len()
    handle = engine.rollout_init(m0.config, m0.state_dict, recipe)
    seed = E.sampling_seed(run_seed)
    engine.rollout(handle, p, E.N_NEW, greedy=True, seed=seed)  # step 0 (output validated by the guard)
    handle = engine.update_weights(handle, m1.state_dict)
    tokens, lp = engine.rollout(handle, p, E.N_NEW, greedy=False, seed=seed + 1)
    new = R.mismatch_metrics(lp, E.oracle(model, "update").score(tokens, plen))
    old = R.mismatch_metrics(lp, E.oracle(model, "base").score(tokens, plen))
    res = E.CaseResult(model, "update", recipe, {**new, "first_div_mean": float("nan"), "first_div_min": 0.0}, [], [])
    record_metrics(k3_kl=new["k3_kl"], k3_kl_vs_step0=old["k3_kl"], token_mult_prob_error=new["token_mult_prob_error"],
                   max_dlogp=new["max_abs_dlogp"])
    bad = E.within_budget(res)
    assert not bad and new["mean_abs_dlogp"] < old["mean_abs_dlogp"], (
        f"after update_weights the rollout does not follow the new policy: vs step 1 {'; '.join(bad) or 'within budget'}"
        f" (mean |dlogp| {new['mean_abs_dlogp']:.3g}); vs step 0 k3 KL {old['k3_kl']:.3g}, mean |dlogp| "
        f"{old['mean_abs_dlogp']:.3g}\n  {E.fmt_case(res)}")
