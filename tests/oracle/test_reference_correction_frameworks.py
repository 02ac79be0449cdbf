"""The correction oracle's extensions for other RL frameworks' options (reference/correction.py): IS bands with a
lower bound 0 (MIS with an upper bound only), weight extremes and |δ| metrics, decoupled PPO's proximal policy and
loss — against values computed by hand here."""

from __future__ import annotations

import math

import pytest
import torch
from fp8rl.reference import correction as C


def test_mis_upper_only_band():
    cfg = C.CorrectionConfig("sequence", "0_3")
    assert cfg.is_bounds == (0.0, 3.0) and cfg.icepop and cfg.is_lower == 0.0
    assert C.CorrectionConfig("token", (0, 2.0)).is_bounds == (0.0, 2.0)
    lr = torch.full((3, 2), -1.0)
    lo = lr + torch.tensor([[-2.5, -2.5], [1.0, 1.0], [0.25, 0.0]])  # Π ρ = e^-5 (kept), e^2 > 3 (0), e^0.25
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    res = C.rollout_correction(lo, lr, mask, cfg)
    want = torch.tensor([[math.exp(-5)] * 2, [0.0, 0.0], [math.exp(0.25), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(res.weights.double(), want, rtol=1e-6, atol=0)
    assert torch.equal(res.mask, mask)
    assert res.metrics["is_fraction_low"] == 0.0  # no lower bound: nothing is "below"
    with pytest.raises(ValueError, match="rollout_is_threshold lower bound"):
        C.CorrectionConfig("token", "-1_3")


def test_weight_extremes_and_logp_diff_metrics():
    lr = torch.full((3, 3), -1.0)
    lo = lr + torch.tensor([[0.5, -0.5, 9.0], [1.0, 7.0, 7.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # padding δ = 9, 7 never read
    m = C.rollout_correction(lo, lr, mask, C.CorrectionConfig("token", 2.0)).metrics
    assert m["is_weight_min"] == pytest.approx(math.exp(-0.5))
    assert m["is_weight_max"] == pytest.approx(2.0)  # e^1 truncated at U = 2
    assert m["is_weight_row_mean"] == pytest.approx(((math.exp(0.5) + math.exp(-0.5)) / 2 + 2.0) / 2)
    assert m["abs_logp_diff_mean"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert m["abs_logp_diff_max"] == pytest.approx(1.0)


def test_proximal_alpha_and_logp():
    versions = torch.tensor([[3, 2, 0, -1, 4]])
    torch.testing.assert_close(C.proximal_alpha(versions, 4),
                               torch.tensor([[0.0, 0.5, 0.75, 0.0, 0.0]], dtype=torch.float64))
    lb = torch.tensor([[-2.0, -2.0, -2.0, -2.0, -300.0]], dtype=torch.float64)
    lt = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -300.0]], dtype=torch.float64)
    v = torch.tensor([[2, 2, 0, -1, 2]])  # α = ½, ½, ¾, 0, ½
    ll = C.proximal_logp(lb, lt, v, 4, "loglinear")
    torch.testing.assert_close(ll, torch.tensor([[-1.5, -1.5, -1.25, -2.0, -300.0]], dtype=torch.float64))
    lin = C.proximal_logp(lb, lt, v, 4, "linear")
    half = math.log(0.5 * math.exp(-2) + 0.5 * math.exp(-1))
    torch.testing.assert_close(lin, torch.tensor([[half, half, math.log(0.25 * math.exp(-2) + 0.75 * math.exp(-1)),
                                                   -2.0, -300.0]], dtype=torch.float64))
    torch.testing.assert_close(C.proximal_logp(lb, lt, v, 4, "rollout"), lb)
    with pytest.raises(ValueError, match="method: unknown proximal approximation"):
        C.proximal_logp(lb, lt, v, 4, "cubic")
    with pytest.raises(TypeError, match="current_version: expected an int"):
        C.proximal_alpha(v, 4.0)


def test_decoupled_ppo_loss_by_hand():
    # one row, 3 valid tokens + 1 padding; A = 1; π_θ = π_prox on tokens 0, 2 and e^0.5·π_prox on token 1
    prox = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    behave = prox - torch.tensor([[math.log(4.0), 0.0, -math.log(2.0), 0.0]], dtype=torch.float64)  # ρ = 4, 1, ½
    logp = prox + torch.tensor([[0.0, 0.5, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.ones(1, 4, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    lcfg = C.LossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    # PPO-clip with A = 1: ℓ = −min(r, clip(r)) = −1, −1.28, −1; TIS U = 2 weights 2, 1, ½
    x = logp.clone().requires_grad_(True)
    loss = C.decoupled_ppo_loss(x, prox, behave, adv, mask, lcfg, C.CorrectionConfig("token", 2.0))
    assert float(loss.detach()) == pytest.approx((2 * -1.0 + 1 * -1.28 + 0.5 * -1.0) / 3)
    (g,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g, torch.tensor([[-2.0 / 3, 0.0, -0.5 / 3, 0.0]], dtype=torch.float64))  # clipped
    # IcePop [0.9, 3]: ρ = 4 and ½ zeroed, still counted in the denominator 3
    ice = C.decoupled_ppo_loss(logp, prox, behave, adv, mask, lcfg, C.CorrectionConfig("token", "0.9_3.0"))
    assert float(ice) == pytest.approx(-1.28 / 3)
    with pytest.raises(ValueError, match="decoupled PPO is defined for kind='ppo_clip', agg='token-mean'"):
        C.decoupled_ppo_loss(logp, prox, behave, adv, mask, C.LossConfig(kind="reinforce"),
                             C.CorrectionConfig("token", 2.0))
