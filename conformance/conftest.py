"""Fixtures of the conformance checks: the engine under test (guarded) and seeded generators."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from fp8rl.checks import GuardedEngine
from fp8rl.plugin import engine_names
from fp8rl.registry import load_engine


@pytest.fixture(scope="session")
def engine_name(request: pytest.FixtureRequest) -> str:
    return engine_names(request.config)[0]


@pytest.fixture(scope="session")
def engine(engine_name: str) -> GuardedEngine:
    """The engine under test, wrapped so that misbehaviour becomes an ``error`` outcome."""
    return GuardedEngine(load_engine(engine_name))


@pytest.fixture(autouse=True)
def seed(request: pytest.FixtureRequest) -> int:
    """Per-check seed: the run's --fp8rl-seed mixed with the check's node id (stable across runs)."""
    base = request.config.getoption("--fp8rl-seed")
    callspec = getattr(request.node, "callspec", None)
    params = {k: v for k, v in (callspec.params.items() if callspec else ()) if k != "engine_name"}
    key = f"{request.node.module.__name__}::{request.node.originalname}::{sorted(params.items())!r}"
    value = (base * 1_000_003 + zlib.crc32(key.encode())) % 2**31
    request.node.user_properties.append(("fp8rl_seed", value))  # reported with failures, for reproduction
    return value


@pytest.fixture
def run_seed(request: pytest.FixtureRequest) -> int:
    """The run's own seed (--fp8rl-seed), for randomness several checks must share (e2e sampling seeds)."""
    return int(request.config.getoption("--fp8rl-seed"))


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _require_capabilities(request: pytest.FixtureRequest) -> None:
    """Skip a check, with the engine's own reason, unless the engine declares every capability the check
    ``requires=`` (its templates filled from the case's parameters)."""
    spec = getattr(request.node.get_closest_marker("fp8rl_check"), "kwargs", {}).get("spec")
    if spec is None or not spec.requires:
        return
    from fp8rl.checks import require, required_capabilities

    callspec = getattr(request.node, "callspec", None)
    require(request.getfixturevalue("engine"), *required_capabilities(spec, dict(callspec.params) if callspec else {}))


@pytest.fixture(autouse=True)
def _prune_mutant_matrix(request: pytest.FixtureRequest) -> None:
    """In ``fp8rl mutants`` runs, skip a check for a mutant that overrides none of the engine methods the check
    calls (the ops of its required capabilities, :mod:`fp8rl.capabilities`): a deterministic mutant then returns
    exactly the reference engine's answers, and the reference engine is conformant (asserted by the suite's own
    tests). Mutants that override ``__init__`` (e.g. change declared policies) are never pruned."""
    if request.config.getoption("--fp8rl-profile") != "mutants":
        return
    spec = getattr(request.node.get_closest_marker("fp8rl_check"), "kwargs", {}).get("spec")
    name = request.getfixturevalue("engine_name")
    if spec is None or not name.startswith("mutant:") or not spec.requires:
        return
    from fp8rl.capabilities import ops_of
    from fp8rl.checks import required_capabilities
    from fp8rl.engines.reference import ReferenceEngine

    cls = type(request.getfixturevalue("engine").inner)
    if not issubclass(cls, ReferenceEngine) or cls.__init__ is not ReferenceEngine.__init__:
        return
    callspec = getattr(request.node, "callspec", None)
    methods = ops_of(required_capabilities(spec, dict(callspec.params) if callspec else {}))
    if methods is not None and all(getattr(cls, m, None) is getattr(ReferenceEngine, m, None) for m in methods):
        pytest.skip(f"not exercised: {name} overrides none of {sorted(methods)} (reference answers)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the cases that load the same checkpoint next to each other: a module lists, in ``SAME_CHECKPOINT_CHECKS``,
    the check functions whose cases with equal parameters (the same callspec id) load the same file, and each such
    case is moved right after the first one of its id. A loader engine keeps the last checkpoint it started (vLLM:
    25-80 s a start on 2 CPU cores), so CKPT-LOAD-005[x] then reuses CKPT-LOAD-001[x]'s start. Every other item keeps
    its place; the order within a group is the collection order."""
    first: dict[tuple[str, str], int] = {}
    keys: list[tuple[int, int]] = []
    for i, it in enumerate(items):
        module = getattr(it, "module", None)
        group = getattr(module, "SAME_CHECKPOINT_CHECKS", ())
        fn = getattr(getattr(it, "function", None), "__name__", None)
        callspec = getattr(it, "callspec", None)
        if fn in group and callspec is not None:
            keys.append((first.setdefault((getattr(module, "__name__", ""), callspec.id), i), i))
        else:
            keys.append((i, i))
    if first:
        items[:] = [it for _, it in sorted(zip(keys, items), key=lambda pair: pair[0])]
