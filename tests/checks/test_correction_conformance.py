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


def _param_cases(fn) -> list[dict]:
    """Every case of a ``@pytest.mark.parametrize``d check function (one empty case for a plain one)."""
    cases: list[dict] = [{}]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
        cases = [{**c, **dict(zip(names, v, strict=True))} for c in cases for v in values]
    return cases


def _call_check(fn, engine) -> None:
    params = inspect.signature(fn).parameters
    for i, case in enumerate(_param_cases(fn)):
        kwargs = {"engine": GuardedEngine(engine), **case}
        if "rng" in params:
            kwargs["rng"] = np.random.default_rng(i)
        if "seed" in params:
            kwargs["seed"] = 1000 + i
        fn(**kwargs)


def test_every_correction_check_function_is_a_registered_check():
    assert {CHECKS[i].function for i in CHECKS if i.startswith("CORR-")} == set(CHECK_FUNCS)


@pytest.mark.parametrize("name", sorted(CHECK_FUNCS))
def test_reference_passes_check(name):
    _call_check(CHECK_FUNCS[name], ReferenceEngine())
