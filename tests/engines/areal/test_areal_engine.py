"""The AReaL engine adapter: behaviour without AReaL (base environment), and — where areal is installed (the
``conformance_areal`` nox session) — the adapter's mapping and executable evidence of every recorded finding."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.engines import areal as A
from fp8rl.reference import correction as C
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import pinned

PIN = pinned("areal", "==1.0.4", "AReaL 1.0.4's behaviour-policy correction and proximal approximation")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "areal.xfails"


def test_without_areal_every_capability_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "areal", None)
    eng = A.ArealEngine()
    assert eng.version() == "areal not installed"
    for key in ("rollout_correction", "rollout_correction.proximal", "rollout_correction.decoupled"):
        reason = capability_reason(eng, key)
        assert reason is not None and reason.startswith("areal not installed: pip install"), reason
    with pytest.raises(Unsupported, match="areal not installed"):
        eng.rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), C.CorrectionConfig())


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=41)


@pytest.mark.parametrize("cfg, expected", [
    (C.CorrectionConfig("token", 2.0), dict(level="token", action="clamp", upper=2.0, lower=None)),
    (C.CorrectionConfig("token", "0.5_2.0"), dict(level="token", action="mask", upper=2.0, lower=0.5)),
    (C.CorrectionConfig("token", "0_2.0"), dict(level="token", action="mask", upper=2.0, lower=None)),
    (C.CorrectionConfig("geometric", 3.0), dict(level="sequence", action="clamp", upper=3.0, lower=None)),
    (C.CorrectionConfig("geometric", "0.5_3.0"), dict(level="sequence", action="mask", upper=3.0, lower=0.5)),
])
def test_config_mapping(cfg, expected):
    got = A.areal_config(cfg)
    assert got["metric"] == "ratio" and got["agg"] == "mean"
    assert {k: got[k] for k in expected} == expected


@pytest.mark.parametrize("cfg, match", [
    (C.CorrectionConfig(None), "no mismatch metrics"),
    (C.CorrectionConfig("sequence", 2.0), "geometric mean"),
    (C.CorrectionConfig("token", 2.0, rollout_is_batch_normalize=True), "no batch normalization"),
    (C.CorrectionConfig("token", 2.0, rollout_rs="token_k2", rollout_rs_threshold="1.0"), "no rejection"),
    (C.CorrectionConfig("token", "0.2_0.9"), "upper ≤ 1"),
])
def test_unmapped_options_are_unsupported_with_a_reason(cfg, match):
    with pytest.raises(Unsupported, match=match):
        A.areal_config(cfg)


# ----------------------------------------------------------------------------------------------------------------
# with areal installed: its real functions


@pytest.fixture(scope="module")
def eng():
    pytest.importorskip("areal")
    return A.ArealEngine()


def _batch():
    lr = torch.full((3, 4), -1.0)
    d = torch.tensor([[0.5, -0.25, 0.75, 0.0], [1.5, 0.0, 0.0, 0.0], [-0.5, 0.5, 0.25, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    return lr + d, lr, mask


@PIN
@pytest.mark.parametrize("cfg", [C.CorrectionConfig("token", 2.0), C.CorrectionConfig("token", "0.9_1.5"),
                                 C.CorrectionConfig("geometric", 1.5), C.CorrectionConfig("geometric", "0.9_1.5")])
def test_weights_equal_the_oracle(eng, cfg):
    lo, lr, mask = _batch()
    got = eng.rollout_correction(lo, lr, mask, cfg)
    ref = C.rollout_correction(lo, lr, mask, cfg)
    torch.testing.assert_close(got.weights, ref.weights, rtol=1e-6, atol=0)
    assert torch.equal(got.mask, mask)


@PIN
def test_mask_action_zeroes_areal_mask_but_keeps_the_original_denominator(eng):
    """The adapter reports the input mask for action='mask': AReaL's own mask drops the token, its loss still
    divides by the original count (so the rejected token is IcePop's weight 0, not RS's removal)."""
    lo, lr, mask = _batch()
    cfg = C.CorrectionConfig("token", "0.9_1.5")
    eng.rollout_correction(lo, lr, mask, cfg)
    assert int(eng.last_areal_mask.sum()) < int(mask.sum())
    adv = torch.ones_like(lo)
    full = eng.decoupled_loss(lo.clone(), lo, lr, adv, mask, C.LossConfig(), cfg)
    assert float(full) == pytest.approx(float(C.decoupled_ppo_loss(lo, lo, lr, adv, mask, C.LossConfig(), cfg)),
                                        rel=1e-6)


@PIN
def test_finding_linear_proximal_approximation_floors_at_1e_minus_10(eng):
    """CORR-PROX-001: log(p_arithmetic + 1e-10) — a log-prob −30 comes back as log(e^-30 + 1e-10) ≈ −23.03, even
    where α = 0 (the token was sampled by the proximal policy itself)."""
    lb = torch.tensor([[-30.0, -36.0, -1.0]])
    lt = torch.tensor([[-30.0, -40.0, -1.0]])
    versions = torch.tensor([[3, 3, 3]])  # v_θ = 4: every token from v_prox = 3, α = 0, π_prox = π_behave
    got = eng.proximal_logp(lb, lt, versions, 4, "linear")
    assert float(got[0, 0]) == pytest.approx(math.log(math.exp(-30.0) + 1e-10), abs=1e-5)
    assert float(got[0, 0]) > -23.1 and float(got[0, 1]) > -23.1
    assert float(got[0, 2]) == pytest.approx(-1.0, abs=1e-6)
    torch.testing.assert_close(C.proximal_logp(lb, lt, versions, 4, "linear"), lb)
    torch.testing.assert_close(eng.proximal_logp(lb, lt, versions, 4, "loglinear"), lb)
