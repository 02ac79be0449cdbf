"""The learning area's checks on the reference engine, in process (the full ``fp8rl conformance --engine reference``
runs of tests/harness/test_harness.py and tests/checks/test_coverage.py include the area and must be conformant;
the mutants it kills: suite/mutants/learning.py, proven by tests/checks/test_mutants.py)."""

from __future__ import annotations

import pytest
from fp8rl.checks import GuardedEngine
from fp8rl.conformance import test_learning as T
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import learning as L


@pytest.fixture(scope="module")
def engine():
    return GuardedEngine(ReferenceEngine())


@pytest.mark.parametrize("correction", T.CORRECTIONS)
def test_reference_estimator_matches_oracle_on_and_off_policy_bound(engine, correction):
    T.test_on_policy_unbiased_bound(engine, correction)
    T.test_correction_under_mismatch_bound(engine, correction)


@pytest.mark.parametrize("recipe", T.RECIPES)
def test_reference_bias_table_bound(engine, recipe):
    """Every recipe's enumerated rollout policy: untruncated IS removes the mismatch bias to arithmetic level; no
    correction leaves a visible bias (the toy's FP8 and BF16 mismatch is real); token TIS sits in between."""
    _, _, _, table = L.toy_fixture(0)
    q = T.rollout_policy_table(engine, recipe)
    bias = {c: L.expected_gradient(table, q, L.oracle_coefficients(table, q, c)).bias
            for c in ("none", "is", "token-tis")}
    assert bias["is"] < 1e-5 < bias["token-tis"] < bias["none"], (recipe, bias)
    T.test_rollout_policy_gradient_bound(engine, recipe)
