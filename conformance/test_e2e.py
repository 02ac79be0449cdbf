"""Area ``e2e``: FP8 rollouts of tiny Qwen3 models vs the BF16 trainer (docs/paper-numbers.md §1.3–1.5, §3.4).

The engine generates from fixed prompts under each numerics recipe (``bf16``, ``fp8-linear``, ``fp8-linear-ptpc``,
``fp8-kv``, ``fp8-all``); the trainer oracle (transformers, BF16, teacher-forced) scores the same tokens. The
mismatch — k3 KL, token_mult_prob_error, max |Δlogp|, first divergence of greedy decoding — must stay within
budgets set from the measured distribution of the reference FP8 emulation with margins (``fp8rl.tolerances``,
entries ``e2e.*``, registered from the data file ``fp8rl/data/e2e_budgets.json`` that
``python -m fp8rl.conformance._e2e --seeds 10 --write`` writes).
After ``update_weights`` the rollout must follow the new weights, including freshly calibrated FP8 KV scales.
The report gets a ``mismatch`` section: the table per model and recipe and a plot of |Δlogp| along the sequence.
"""

from __future__ import annotations

import pytest
from fp8rl import fixtures
from fp8rl.checks import check, record_metrics, record_section
from fp8rl.reference import rollout as R

from . import _e2e as E

CASES = pytest.mark.parametrize("model,recipe", [(m, r) for m in E.MODELS for r in E.RECIPES])


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
def test_mismatch_budget(engine, model, recipe, run_seed):
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
def test_greedy_first_divergence(engine, model, recipe, run_seed):
    section = E.mismatch_section(engine, run_seed)
    res = E.cached_case(engine, model, recipe, run_seed=run_seed)
    record_section("mismatch", section)
    floor = E.budget("first_div_mean", model, recipe)
    record_metrics(first_div_mean=res.metrics["first_div_mean"], first_div_min=res.metrics["first_div_min"])
    assert res.metrics["first_div_mean"] >= floor, (
        f"greedy rollouts leave the trainer's greedy path after {res.metrics['first_div_mean']:.3g} tokens on "
        f"average (floor {floor:.3g})\n  {E.fmt_case(res)}")


@CASES
@check("E2E-UPDATE-001", "After a rollout on step-0 weights and update_weights(step-1 weights), sampled "
       "rollouts follow the NEW policy: their mismatch vs the BF16 trainer at step 1 is within budget and smaller "
       "than vs step 0. The update grows K/V 8x, so FP8 KV scales must be recalibrated (or pushed).",
       bound="e2e_mismatch", requires=["rollout.{recipe}", "update_weights"], timeout=600)
def test_update_weights_follow_new_policy(engine, model, recipe, run_seed):
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
