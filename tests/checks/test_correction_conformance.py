"""The correction area's checks against the reference engine (all pass) and the correction mutants (each killed).

The check functions are called directly (they are plain functions carrying pytest marks) with a GuardedEngine,
under the ``mutants`` hypothesis profile (derandomized, 25 examples), which is restored afterwards.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from fp8rl import strategies
from fp8rl.checks import CHECKS, GuardedEngine
from fp8rl.conformance import test_correction as T
from fp8rl.engine import EngineError
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.mutants import MUTANTS, make_mutant
from hypothesis import settings

CHECK_FUNCS = {name: fn for name, fn in vars(T).items() if name.startswith("test_") and callable(fn)}

#: mutant → one check that must kill it (the full kill matrix is in the lead's report)
KILLERS = {
    "corr-inverted-ratio": "test_token_tis_bound",
    "corr-no-truncation": "test_tis_bound",
    "corr-two-sided-clamp": "test_tis_no_lower_truncation",
    "corr-padding-in-means": "test_offpolicy_metrics",
    "corr-seq-sum-of-ratios": "test_sequence_tis_bound",
    "corr-weights-not-detached": "test_weights_detached",
    "corr-no-safety-clamp": "test_extreme_values",
    "corr-k3-wrong-sign": "test_offpolicy_metrics",
    "corr-rs-on-weights": "test_rs_masks_only",
    "corr-batch-norm-padding": "test_token_batch_norm_bound",
}


@pytest.fixture(autouse=True)
def _mutants_profile():
    prev = settings.default
    threads = T.torch.get_num_threads()
    T.torch.set_num_threads(1)  # tiny tensors: intra-op threads only add contention
    strategies.load_profile("mutants")
    yield
    T.torch.set_num_threads(threads)
    settings.register_profile("_fp8rl_restore", prev)
    settings.load_profile("_fp8rl_restore")


def _call_check(fn, engine) -> None:
    kwargs = {"engine": GuardedEngine(engine)}
    if "rng" in inspect.signature(fn).parameters:
        kwargs["rng"] = np.random.default_rng(0)
    fn(**kwargs)


def test_every_correction_mutant_has_a_killer():
    corr = {n for n, m in MUTANTS.items() if m.area == "correction"}
    assert corr == set(KILLERS)
    assert {CHECKS[i].function for i in CHECKS if i.startswith("CORR-")} == set(CHECK_FUNCS)


@pytest.mark.parametrize("name", sorted(CHECK_FUNCS))
def test_reference_passes_check(name):
    _call_check(CHECK_FUNCS[name], ReferenceEngine())


@pytest.mark.parametrize("mutant", sorted(KILLERS))
def test_mutant_killed(mutant):
    with pytest.raises((AssertionError, EngineError)):
        _call_check(CHECK_FUNCS[KILLERS[mutant]], make_mutant(mutant))
