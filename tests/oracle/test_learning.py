"""The learning-level oracle (fp8rl.reference.learning): enumeration, the exact policy gradient and the expected
estimator, each against an independent computation (full-sequence forwards, autograd of J itself, Monte Carlo)."""

from __future__ import annotations

import math

import pytest
import torch
from fp8rl import tolerances
from fp8rl.reference import learning as L


@pytest.fixture(scope="module")
def toy():
    return L.toy_fixture(0)


def test_enumeration_and_entries_exact(toy):
    task, _, _, table = toy
    seqs = L.enumerate_sequences(task)
    assert seqs.shape == (task.vocab ** task.horizon, task.horizon)
    assert torch.equal(L.sequence_index(task, seqs), torch.arange(seqs.shape[0]))
    e = L.entry_index(task, seqs)
    assert int(e.max()) + 1 == L.n_entries(task) == table.logp.numel()
    # the same prefix gives the same entry row: every entry of a prefix row is reached
    assert torch.unique(e).numel() == L.n_entries(task)


def test_sequence_logprobs_match_full_forward_bound(toy):
    """Table lookups (one forward per prefix) vs one teacher-forced forward of every whole sequence: the same fp64
    model, so they agree to a few float32 ulps (the model's RMSNorms run in float32)."""
    task, cfg, sd, table = toy
    model = L._fp64_trainer(cfg, sd)
    toks = torch.cat([task.prompt_tensor(table.seqs.shape[0]), table.seqs], 1)
    with torch.no_grad():
        logits = model(input_ids=toks, use_cache=False).logits.double()
    p = len(task.prompt)
    full = torch.log_softmax(logits[:, p - 1:-1], -1).gather(-1, table.seqs[:, :, None]).squeeze(-1)
    err = float((full - table.seq_token_logp()).abs().max())
    assert err <= 64 * tolerances.UNIT_ROUNDOFF["float32"] * float(full.abs().max()), err
    assert abs(float(torch.exp(table.seq_token_logp().sum(-1)).sum()) - 1.0) < 1e-12


def test_true_gradient_matches_autograd_of_J_bound(toy):
    """∇J from the coefficient machinery vs autograd of J(θ) = Σ_s π(s) R(s) itself (one full-sequence forward)."""
    task, cfg, sd, table = toy
    model = L._fp64_trainer(cfg, sd)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    toks = torch.cat([task.prompt_tensor(table.seqs.shape[0]), table.seqs], 1)
    logits = model(input_ids=toks, use_cache=False).logits.double()
    p = len(task.prompt)
    lp = torch.log_softmax(logits[:, p - 1:-1], -1).gather(-1, table.seqs[:, :, None]).squeeze(-1).sum(-1)
    J = (torch.exp(lp) * task.reward(table.seqs)).sum()
    grads = torch.autograd.grad(J, params)
    direct = torch.cat([g.reshape(-1) for g in grads])
    ours = table.vector(L.true_gradient_coefficients(table))
    rel = float((direct - ours).norm() / direct.norm())
    kappa = L.kappa(table, L.true_gradient_coefficients(table))
    assert rel <= tolerances.learning_arith_bound(kappa), (rel, kappa)


def test_sequence_is_unbiased_and_tis_within_analytic_bound(toy):
    """Under synthetic mismatches of growing size: untruncated sequence IS is unbiased, TIS's bias stays within the
    analytic bound (and the bound is not vacuous: it is finite and shrinks with the mismatch)."""
    _, _, _, table = toy
    bounds = []
    for sigma in (0.1, 0.5, 1.0):
        q = L.perturbed_table(table, sigma, seed=3)
        est = L.expected_gradient(table, q, L.oracle_coefficients(table, q, "is"))
        arith = tolerances.learning_arith_bound(L.kappa(table, L.estimator_coefficients(
            table, q, L.oracle_coefficients(table, q, "is"))))
        assert est.bias <= arith, (sigma, est.bias, arith)
        for corr, level in (("token-tis", "token"), ("seq-tis", "sequence")):
            b = L.expected_gradient(table, q, L.oracle_coefficients(table, q, corr)).bias
            bound = L.tis_bias_bound(table, q, level, 2.0)
            assert b <= bound + arith, (sigma, corr, b, bound)
            bounds.append((sigma, corr, bound))
        none = L.expected_gradient(table, q, L.oracle_coefficients(table, q, "none")).bias
        assert none > 100 * arith  # the mismatch is visible without correction
    tok = [b for s, c, b in bounds if c == "token-tis"]
    assert tok == sorted(tok) and math.isfinite(tok[-1])


def test_expected_gradient_matches_monte_carlo_stat(toy):
    """E_q[ĝ] and the variance from the Gram matrix vs a Monte Carlo average of per-sequence gradients drawn from q
    (200 000 draws: the mean's error along ∇J stays within 5 standard errors)."""
    _, _, _, table = toy
    q = L.perturbed_table(table, 0.5, seed=4)
    gamma = L.oracle_coefficients(table, q, "token-tis")
    est = L.expected_gradient(table, q, gamma)
    gen = torch.Generator().manual_seed(7)
    qs = torch.exp(table.seq_token_logp(q).sum(-1))
    idx = torch.multinomial(qs, 200_000, replacement=True, generator=gen)
    gj = table.vector(L.true_gradient_coefficients(table))
    per_entry = table.jac @ gj / float(gj @ gj)
    r = (gamma[idx] * per_entry[table.entries[idx]]).sum(-1)
    exact = float(table.vector(L.estimator_coefficients(table, q, gamma)) @ gj) / float(gj @ gj)
    se = float(r.std()) / math.sqrt(r.numel())
    assert abs(float(r.mean()) - exact) <= 5 * se, (float(r.mean()), exact, se)
    assert est.variance > 0


def test_bad_input_errors():
    with pytest.raises(ValueError, match="vocab"):
        L.ToyTask(vocab=1)
    with pytest.raises(ValueError, match="horizon"):
        L.ToyTask(vocab=16, horizon=6)
    with pytest.raises(ValueError, match="prompt"):
        L.ToyTask(prompt=(9,))
    with pytest.raises(ValueError, match="correction"):
        L.correction_config("bogus")


def test_synthetic_mismatch_decisions_are_unambiguous_bound(toy):
    """LEARN-CORR-001 compares an engine computing in float32 with the float64 oracle: no truncation / IcePop
    decision of its fixed synthetic table lies within 1e-5 (log space) of a threshold, far beyond float32 rounding
    of the log-ratios (≤ 1e-6 here), so a correct engine cannot flip one."""
    _, _, _, table = toy
    q = L.perturbed_table(table, 0.5, seed=1)
    d = table.seq_token_logp() - table.seq_token_logp(q)
    log_caps = torch.log(torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert float((d[..., None] - log_caps).abs().min()) > 1e-5
    assert float((d.sum(-1)[:, None] - log_caps).abs().min()) > 1e-5


@pytest.mark.parametrize("recipe", ("bf16", "fp8-linear", "fp8-linear-ptpc", "fp8-kv", "fp8-all"))
def test_rollout_policy_bias_ordering_bound(toy, recipe):
    """The oracle's own rollout emulation (the reference engine) under every recipe, enumerated: untruncated IS
    removes the mismatch bias to arithmetic level, no correction leaves a visible one (the toy's FP8 and BF16
    mismatch is real), token TIS sits in between. (LEARN-ROLLOUT-001 itself runs in the reference engine's full
    conformance runs of tests/harness and tests/checks/test_coverage.py.)"""
    from fp8rl.engines.reference import ReferenceEngine

    task, cfg, sd, table = toy
    eng = ReferenceEngine()
    h = eng.rollout_init(cfg, sd, recipe)
    q = L.rollout_table(task, lambda toks: eng.rollout_logits(h, toks, 1, greedy=True)[2][:, 0])
    bias = {c: L.expected_gradient(table, q, L.oracle_coefficients(table, q, c)).bias
            for c in ("none", "is", "token-tis")}
    assert bias["is"] < 1e-5 < bias["token-tis"] < bias["none"], (recipe, bias)
