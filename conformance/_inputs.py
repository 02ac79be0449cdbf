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


def all_bf16() -> torch.Tensor:
    """Every bfloat16 bit pattern (65,536 values: ±0, subnormals, normals, ±inf, NaNs) as a bf16 tensor."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def bf16_sweep() -> torch.Tensor:
    """fp32 inputs for fp32 → bf16 rounding: every finite bf16 value, every exact tie between bf16 neighbours
    (low 16 bits 0x8000, even and odd kept parts), each tie ± 1 fp32 ulp, the largest finite fp32 values (which
    round to ±inf), fp32 subnormals, ±inf and NaNs with payloads only in the dropped bits."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    finite_hi = hi[(hi & 0x7F800000) != 0x7F800000]
    ties = finite_hi | 0x8000
    parts = [finite_hi, ties, ties + 1, ties - 1,
             np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000,
                       0x7FC00000, 0x7F800001, 0xFFC00001], dtype=np.uint32)]
    return torch.from_numpy(np.concatenate(parts).astype(np.uint32).view(np.float32).copy())


def scaled_normal(rng: np.random.Generator, shape: tuple[int, ...], spread: int = 8) -> torch.Tensor:
    """Gaussian values whose rows/columns span ±``spread`` binades (so groups get very different scales)."""
    x = rng.standard_normal(shape).astype(np.float32)
    mag = np.exp2(rng.integers(-spread, spread + 1, size=shape[-1:] if len(shape) else ())).astype(np.float32)
    rowmag = np.exp2(rng.integers(-spread, spread + 1, size=shape[:-1] + (1,))).astype(np.float32) if len(shape) > 1 else 1
    return torch.from_numpy(x * mag * rowmag)
