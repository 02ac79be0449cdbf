"""Deterministic input sets for conformance checks (edge vectors the engines' own tests never use)."""

from __future__ import annotations

import numpy as np
import torch
from fp8rl.reference.formats import decode_codes, get_format


def cast_sweep(fmt: str) -> torch.Tensor:
    """Every finite value of ``fmt``, every midpoint between neighbours (ties), each ± 1 fp32 ulp, the overflow
    region (max, max + half-ulp tie, beyond), ±inf, NaN, ±0 and fp32 subnormals — as one fp32 vector."""
    f = get_format(fmt)
    vals = decode_codes(np.arange(256), f)
    finite = np.unique(vals[np.isfinite(vals)])
    mids = (finite[:-1] + finite[1:]) / 2  # exact in fp64; representable in fp32 (≤ 5 significant bits)
    top_step = finite[-1] - finite[-2]
    over = np.array([finite[-1] + top_step / 2, finite[-1] + top_step, finite[-1] * 2, 1e6, 3.0e38])
    base = np.concatenate([finite, mids, over, -over]).astype(np.float32)
    up = np.nextafter(base, np.float32(np.inf))
    down = np.nextafter(base, np.float32(-np.inf))
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 1.1754942e-38], dtype=np.float32)
    return torch.from_numpy(np.concatenate([base, up, down, special]).astype(np.float32))


def scaled_normal(rng: np.random.Generator, shape: tuple[int, ...], spread: int = 8) -> torch.Tensor:
    """Gaussian values whose rows/columns span ±``spread`` binades (so groups get very different scales)."""
    x = rng.standard_normal(shape).astype(np.float32)
    mag = np.exp2(rng.integers(-spread, spread + 1, size=shape[-1:] if len(shape) else ())).astype(np.float32)
    rowmag = np.exp2(rng.integers(-spread, spread + 1, size=shape[:-1] + (1,))).astype(np.float32) if len(shape) > 1 else 1
    return torch.from_numpy(x * mag * rowmag)
