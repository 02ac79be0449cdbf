"""The TRL engine adapter: behaviour without TRL (base environment), and — where trl is installed (the
``conformance_trl`` nox session) — the adapter's mapping and executable evidence of every recorded finding."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.engines import trl as T
from fp8rl.reference import correction as C
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import pinned

PIN = pinned("trl", "==1.16.0", "TRL 1.16.0's GRPO vLLM importance-sampling correction")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "trl.xfails"


def test_without_trl_every_capability_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    eng = T.TrlEngine()
    assert eng.version() == "trl not installed"
    for key in ("rollout_correction", "rollout_correction.loss"):
        reason = capability_reason(eng, key)
        assert reason is not None and reason.startswith("trl not installed: pip install"), reason
    with pytest.raises(Unsupported, match="trl not installed"):
        eng.rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), C.CorrectionConfig())


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=41)


@pytest.mark.parametrize("cfg, expected", [
    (C.CorrectionConfig("token", 2.0), ("token_truncate", None, 2.0)),
    (C.CorrectionConfig("sequence", 3.0), ("sequence_truncate", None, 3.0)),
    (C.CorrectionConfig("token", "0.5_2.0"), ("token_mask", 0.5, 2.0)),
    (C.CorrectionConfig("sequence", "0_3.0"), ("sequence_mask", None, 3.0)),  # TRL's default mode
])
def test_mode_mapping(cfg, expected):
    assert T.trl_mode(cfg) == expected


@pytest.mark.parametrize("cfg, match", [
    (C.CorrectionConfig(None), "only with vllm_importance_sampling_correction"),
    (C.CorrectionConfig("geometric", 2.0), "no geometric"),
    (C.CorrectionConfig("token", 2.0, rollout_is_batch_normalize=True), "no batch normalization"),
    (C.CorrectionConfig("token", 2.0, rollout_rs="token_k2", rollout_rs_threshold="1.0"), "no rejection"),
])
def test_unmapped_options_are_unsupported_with_a_reason(cfg, match):
    with pytest.raises(Unsupported, match=match):
        T.trl_mode(cfg)


# ----------------------------------------------------------------------------------------------------------------
# with trl installed: the real GRPOTrainer._generate_and_score_completions


@pytest.fixture(scope="module")
def eng():
    pytest.importorskip("trl")
    return T.TrlEngine()


def _batch():
    lr = torch.full((4, 4), -1.0)
    d = torch.tensor([[0.5, -0.25, 0.75, 0.0], [0.25, 0.0, 0.0, 0.0], [0.0] * 4, [-0.5, 0.5, 0.25, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    return lr + d, lr, mask


@PIN
@pytest.mark.parametrize("cfg", [C.CorrectionConfig("token", 2.0), C.CorrectionConfig("sequence", 3.0),
                                 C.CorrectionConfig("token", "0.9_1.5"), C.CorrectionConfig("sequence", "0_2.0")])
def test_weights_equal_the_oracle(eng, cfg):
    lo, lr, mask = _batch()
    got = eng.rollout_correction(lo, lr, mask, cfg)
    ref = C.rollout_correction(lo, lr, mask, cfg)
    torch.testing.assert_close(got.weights, ref.weights, rtol=1e-6, atol=0)
    assert torch.equal(got.mask, mask)


@PIN
def test_finding_sequence_ratio_stats_count_empty_rows(eng):
    """CORR-MET-007: sequence modes log min/mean/max over every row's ratio, an empty row's exp(0) = 1 included."""
    lo, lr, mask = _batch()
    cfg = C.CorrectionConfig("sequence", 3.0)
    got = eng.rollout_correction(lo, lr, mask, cfg).metrics
    ref = C.rollout_correction(lo, lr, mask, cfg).metrics
    # valid rows' ratios: e^1 = 2.718, e^0.25 = 1.284, min(e^1.25, 3) = 3; the empty row adds 1.0
    assert ref["is_weight_min"] == pytest.approx(math.exp(0.25))
    assert got["is_weight_min"] == 1.0
    assert got["is_weight_row_mean"] == pytest.approx((math.exp(1.0) + math.exp(0.25) + 3.0 + 1.0) / 4, rel=1e-6)
    assert ref["is_weight_row_mean"] == pytest.approx((math.exp(1.0) + math.exp(0.25) + 3.0) / 3)
    tok = eng.rollout_correction(lo, lr, mask, C.CorrectionConfig("token", 3.0)).metrics
    assert tok["is_weight_min"] == pytest.approx(math.exp(-0.5), rel=1e-6)  # token modes index ratio[mask]


@PIN
def test_finding_all_padding_batch_is_accepted(eng):
    """CORR-VAL-001: every completion empty → no error, zero weights, 0.0 metric defaults."""
    lo, lr, _ = _batch()
    got = eng.rollout_correction(lo, lr, torch.zeros(4, 4), C.CorrectionConfig("token", 2.0))
    assert bool((got.weights == 0).all())
    assert got.metrics["is_weight_mean"] == 0.0 and got.metrics["abs_logp_diff_max"] == 0.0
