"""Area ``learning``: does the policy gradient the trainer computes from an engine's rollouts, with its rollout
correction, equal the BF16/fp32 trainer's true policy gradient? (docs/learning-parity.md)

The toy policy (:mod:`fp8rl.reference.learning`: a 1-layer Qwen3, vocabulary 8, 3-token responses after a 2-token
prompt, reward = token sum divisible by 3) is small enough to enumerate: its 512 responses give ∇J exactly, and the
expected gradient E_q[ĝ] of any estimator under any rollout policy q, with its bias ‖E ĝ − ∇J‖/‖∇J‖, its cosine
with ∇J and its variance. The estimator is REINFORCE with a constant baseline, A = R − E_π[R], weighted by the
rollout correction (none, sequence IS, token TIS, sequence TIS, IcePop, rejection sampling).

* LEARN-ONPOL-001 / LEARN-CORR-001 judge the engine's *trainer-side* ops (``rollout_correction``,
  ``correction_loss``) composed into the estimator, on-policy and under a synthetic mismatch of known size.
* LEARN-ROLLOUT-001 enumerates the engine's own π_rollout under each numerics recipe (a one-token rollout after
  every prefix, the logits it samples from: ``rollout.logits``) and reports the bias table per correction with
  the oracle's correction; IS must stay unbiased, TIS within its analytic truncation bias.
* LEARN-SAMPLE-001 draws real sampled rollouts and corrects them with the log-probs the engine *reports*: an engine
  that reports the log-probs of another distribution than it sampled from gives a biased "corrected" gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from fp8rl import tolerances
from fp8rl.checks import check, record_metrics, record_section
from fp8rl.reference import learning as L
from fp8rl.reference.correction import LossConfig

CORRECTIONS = tuple(L.CORRECTIONS)
RECIPES = ("bf16", "fp8-linear", "fp8-linear-ptpc", "fp8-kv", "fp8-all")
#: the synthetic mismatch of LEARN-CORR-001: σ of the per-entry logit noise (log-ratios up to ≈ ±1: TIS truncates)
SYNTH_SIGMA = 0.5
#: sampled rollouts of LEARN-SAMPLE-001
SAMPLES = 4096
LOSS = LossConfig(kind="reinforce", agg="seq-mean-token-sum")
#: corrections unbiased in exact arithmetic under any full-support mismatch
UNBIASED = ("is",)
TIS = {"token-tis": ("token", 2.0), "seq-tis": ("sequence", 2.0)}


def _fixture():
    return L.toy_fixture(0)


def engine_gamma(engine, table: L.GradientTable, q_table: torch.Tensor, correction: str) -> torch.Tensor:
    """Per-token coefficients γ_t(s) (N, H) of the estimator built from the engine's ops: its rollout correction
    (weights, mask) of the enumerated batch and its REINFORCE loss (``seq-mean-token-sum``), differentiated with
    respect to the log-probs; the batch normaliser (the number of valid rows) is taken out, so γ is the
    per-sequence estimator's coefficient."""
    train = table.seq_token_logp().to(torch.float32)
    roll = table.seq_token_logp(q_table).to(torch.float32)
    mask = torch.ones_like(train)
    res = engine.rollout_correction(train, roll, mask, L.correction_config(correction))
    adv = L.advantages(table)[:, None].expand_as(train).to(torch.float32)
    logp = table.seq_token_logp().clone().requires_grad_(True)
    loss = engine.correction_loss(logp, logp.detach(), adv, res.mask, res.weights, LOSS)
    (g,) = torch.autograd.grad(loss, logp)
    rows = int((res.mask != 0).any(-1).sum())
    return -g.double() * max(rows, 1)


def _judge(table, q_table, gamma, correction: str) -> tuple[L.Estimate, float, float]:
    """(estimate, arithmetic bound, analytic bound or 0) of one estimator."""
    est = L.expected_gradient(table, q_table, gamma)
    arith = tolerances.learning_arith_bound(L.kappa(table, L.estimator_coefficients(table, q_table, gamma)))
    analytic = 0.0
    if correction in TIS:
        level, cap = TIS[correction]
        analytic = tolerances.LEARNING_TIS_BIAS.value * L.tis_bias_bound(table, q_table, level, cap)
    return est, arith, analytic


@pytest.mark.parametrize("correction", CORRECTIONS)
@check("LEARN-ONPOL-001", "On-policy rollouts (π_rollout = π_train): the expected policy-gradient estimate built from "
       "the engine's rollout correction and REINFORCE loss equals the true ∇J of the enumerable toy policy for every "
       "correction (none, IS, token/sequence TIS, IcePop, RS), within the arithmetic bound.",
       bound="learning_grad_arith", requires=["rollout_correction", "rollout_correction.loss"])
def test_on_policy_unbiased_bound(engine, correction):
    _, _, _, table = _fixture()
    gamma = engine_gamma(engine, table, table.logp, correction)
    est, arith, _ = _judge(table, table.logp, gamma, correction)
    record_metrics(bias=est.bias, cosine=est.cosine, err_over_bound=est.bias / arith)
    assert est.bias <= arith, (f"{correction}: on-policy relative gradient bias {est.bias:.3e} > arithmetic bound "
                               f"{arith:.3e} (cosine {est.cosine:.6f})")


@pytest.mark.parametrize("correction", CORRECTIONS)
@check("LEARN-CORR-001", "Under a synthetic mismatch of known size (trainer logits + N(0, 0.5²) noise), the expected "
       "estimate built from the engine's correction and loss equals the oracle's expected estimate for the same "
       "correction (within the arithmetic bound); untruncated sequence IS is unbiased and token/sequence TIS stay "
       "within their analytic truncation bias.",
       bound=("learning_grad_arith", "learning_tis_bias"), requires=["rollout_correction", "rollout_correction.loss"])
def test_correction_under_mismatch_bound(engine, correction):
    _, _, _, table = _fixture()
    q = L.perturbed_table(table, SYNTH_SIGMA, seed=1)
    gamma = engine_gamma(engine, table, q, correction)
    est, arith, analytic = _judge(table, q, gamma, correction)
    want = L.oracle_coefficients(table, q, correction)
    diff = table.vector(L.estimator_coefficients(table, q, gamma) - L.estimator_coefficients(table, q, want))
    rel = float(diff.norm()) / est.grad_norm
    record_metrics(bias=est.bias, cosine=est.cosine, err_over_bound=rel / arith)
    bad = []
    if rel > arith:
        bad.append(f"expected estimate differs from the oracle's by {rel:.3e} (relative to ‖∇J‖) > {arith:.3e}")
    if correction in UNBIASED and est.bias > arith:
        bad.append(f"untruncated IS is biased: {est.bias:.3e} > {arith:.3e}")
    if correction in TIS and est.bias > analytic + arith:
        bad.append(f"bias {est.bias:.3e} > analytic truncation bound {analytic:.3e} + {arith:.3e}")
    assert not bad, f"{correction}: " + "; ".join(bad)


# ----------------------------------------------------------------------------------------------------------------
# the engine's own rollout policy

_HANDLES: dict[tuple[int, str], object] = {}


_PRESTARTED: set[int] = set()


def _prestart(engine) -> None:
    """The engine's optional ``prestart_rollouts`` hook (conformance/_e2e.py ``prestart``), once per engine: start the
    toy policy under every recipe it supports at once (vLLM: one ``vllm.LLM`` process each, ~20–50 s to start)."""
    hook = getattr(getattr(engine, "inner", engine), "prestart_rollouts", None)
    if hook is None or id(engine) in _PRESTARTED:
        return
    _PRESTARTED.add(id(engine))
    from fp8rl.checks import capability_reason

    _, cfg, sd, _ = _fixture()
    try:
        hook([(cfg, sd, r) for r in RECIPES if capability_reason(engine, f"rollout.{r}") is None])
    except Exception:  # noqa: BLE001, S110 - each case reports its own failure from rollout_init
        pass


def _handle(engine, recipe: str):
    key = (id(engine), recipe)
    if key not in _HANDLES:
        _prestart(engine)
        _, cfg, sd, _ = _fixture()
        _HANDLES[key] = engine.rollout_init(cfg, sd, recipe)
    return _HANDLES[key]


def rollout_policy_table(engine, recipe: str) -> torch.Tensor:
    """π_rollout's entry table: the logits of a one-token rollout after every prefix (the distribution the engine
    samples that token from), log-softmaxed in float64."""
    task, _, _, _ = _fixture()
    h = _handle(engine, recipe)
    return L.rollout_table(task, lambda toks: engine.rollout_logits(h, toks, 1, greedy=True)[2][:, 0])


_BIAS_TABLE: dict[str, dict[str, dict[str, float]]] = {}


@pytest.mark.parametrize("recipe", RECIPES)
@check("LEARN-ROLLOUT-001", "The engine's rollout policy under the recipe, enumerated (the logits it samples from "
       "after every prefix), has full support; with it the oracle's untruncated sequence IS gives ∇J within the "
       "arithmetic bound and token/sequence TIS stay within their analytic truncation bias; the bias, cosine and "
       "variance of every correction are reported.",
       bound=("learning_grad_arith", "learning_tis_bias"), requires=["rollout.{recipe}", "rollout.logits"],
       timeout=600)
def test_rollout_policy_gradient_bound(engine, recipe):
    _, _, _, table = _fixture()
    q = rollout_policy_table(engine, recipe)
    assert torch.isfinite(q).all(), f"{recipe}: π_rollout has zero-probability entries (no full support)"
    sums = torch.exp(q).reshape(-1, table.task.vocab).sum(-1)
    assert (sums - 1).abs().max() < 1e-12, f"{recipe}: π_rollout rows do not sum to 1 ({sums})"
    rows, bad = {}, []
    for corr in CORRECTIONS:
        gamma = L.oracle_coefficients(table, q, corr)
        est, arith, analytic = _judge(table, q, gamma, corr)
        rows[corr] = {**est.as_dict(), "analytic_bound": analytic}
        if corr in UNBIASED and est.bias > arith:
            bad.append(f"{corr}: bias {est.bias:.3e} > {arith:.3e}")
        if corr in TIS and est.bias > analytic + arith:
            bad.append(f"{corr}: bias {est.bias:.3e} > analytic {analytic:.3e} + {arith:.3e}")
    dlogp = float((q - table.logp).abs().max())
    _BIAS_TABLE[recipe] = rows
    record_metrics(max_dlogp=dlogp, bias_none=rows["none"]["bias"], bias_token_tis=rows["token-tis"]["bias"],
                   bias_is=rows["is"]["bias"])
    record_section("learning", {"title": "Learning-level parity: relative policy-gradient bias per recipe x correction "
                                         "(toy policy, exact enumeration)",
                                "bias": {r: {c: v["bias"] for c, v in t.items()} for r, t in _BIAS_TABLE.items()},
                                "cosine": {r: {c: v["cosine"] for c, v in t.items()} for r, t in _BIAS_TABLE.items()},
                                "variance": {r: {c: v["variance"] for c, v in t.items()}
                                             for r, t in _BIAS_TABLE.items()},
                                "analytic_bound": {r: {c: v["analytic_bound"] for c, v in t.items() if c in TIS}
                                                   for r, t in _BIAS_TABLE.items()}})
    assert not bad, f"{recipe}: " + "; ".join(bad)


@pytest.mark.parametrize("recipe", RECIPES)
@check("LEARN-SAMPLE-001", "Sampled rollouts (4096 x 3 tokens, temperature 1) corrected by sequence IS with the "
       "log-probs the engine reports give an unbiased gradient: the mean projection of the corrected estimate on "
       "∇J is 1 within the z-test threshold (false-alarm rate 1e-6).",
       bound="learning_sample_z", requires=["rollout.{recipe}"], timeout=600)
def test_sampled_corrected_gradient_stat(engine, recipe, run_seed):
    task, _, _, table = _fixture()
    h = _handle(engine, recipe)
    out = engine.rollout(h, task.prompt_tensor(SAMPLES), task.horizon, greedy=False, seed=run_seed)
    tokens, reported = out[0], out[1]
    resp = tokens[:, len(task.prompt):]
    idx = L.sequence_index(task, resp)
    train = table.seq_token_logp()[idx]
    rho = torch.exp(train.sum(-1) - reported.double().sum(-1))
    r = rho * L.advantages(table)[idx] * L.projections(table)[idx]
    mean, sd = float(r.mean()), float(r.std())
    z = (mean - 1.0) / (sd / math.sqrt(SAMPLES))
    thr = tolerances.LEARNING_SAMPLE_Z.value
    record_metrics(projection_mean=mean, z=z, err_over_bound=abs(z) / thr)
    assert abs(z) <= thr, (f"{recipe}: IS-corrected gradient from the reported log-probs is biased: mean projection "
                           f"on ∇J {mean:.4f} (expected 1), z = {z:.2f}, threshold {thr}")
