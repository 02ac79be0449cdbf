"""The correction area's checks against the reference engine: every check passes. (The mutants they kill:
suite/mutants/correction.py, proven by tests/checks/test_mutants.py.)

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
from fp8rl.engines.reference import ReferenceEngine
from hypothesis import settings

CHECK_FUNCS = {name: fn for name, fn in vars(T).items() if name.startswith("test_") and callable(fn)}

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


def test_every_correction_check_function_is_a_registered_check():
    assert {CHECKS[i].function for i in CHECKS if i.startswith("CORR-")} == set(CHECK_FUNCS)


@pytest.mark.parametrize("name", sorted(CHECK_FUNCS))
def test_reference_passes_check(name):
    _call_check(CHECK_FUNCS[name], ReferenceEngine())
