"""Fixed, seeded benchmark data (append only: never change an existing dataset, or history stops comparing)."""

from __future__ import annotations

import timeit
from functools import cache

import torch

SEED = 20260126  # arXiv v1 date of the paper


@cache
def weight(rows: int, cols: int, seed: int = SEED) -> torch.Tensor:
    """A Gaussian fp32 "weight" with std 0.02 (LLM-like)."""
    g = torch.Generator().manual_seed(seed + rows * 7919 + cols)
    return torch.randn(rows, cols, generator=g, dtype=torch.float32) * 0.02


@cache
def activations(rows: int, cols: int, seed: int = SEED + 1) -> torch.Tensor:
    """Gaussian activations with a few outlier channels (x20), as LLM activations have."""
    g = torch.Generator().manual_seed(seed + rows * 104729 + cols)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float32)
    x[:, :: max(1, cols // 8)] *= 20.0
    return x


class Benchmark:
    """Base: wall-clock timer (torch ops are multi-threaded; asv's default process_time would sum thread time)."""

    timer = timeit.default_timer
    timeout = 120
    number = 1
    repeat = (1, 5, 20.0)


def granularity(label: str):
    from fp8rl.reference.quant import Granularity

    return {"block128": Granularity.block(128), "group128": Granularity.group(128), "token": Granularity.token(),
            "channel": Granularity.channel(), "tensor": Granularity.tensor()}[label]


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    err = (x.double() - y.double()).pow(2).sum()
    sig = x.double().pow(2).sum()
    return float(10 * torch.log10(sig / err.clamp(min=1e-300)))
