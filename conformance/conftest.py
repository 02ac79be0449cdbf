"""Fixtures of the conformance checks: the engine under test (guarded) and seeded generators."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
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


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """Per-check seed: the run's --fp8rl-seed mixed with the check's node id (stable across runs)."""
    base = request.config.getoption("--fp8rl-seed")
    callspec = getattr(request.node, "callspec", None)
    params = {k: v for k, v in (callspec.params.items() if callspec else ()) if k != "engine_name"}
    key = f"{request.node.module.__name__}::{request.node.originalname}::{sorted(params.items())!r}"
    return (base * 1_000_003 + zlib.crc32(key.encode())) % 2**31


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.fixture
def torch_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
