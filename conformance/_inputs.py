"""The conformance checks' value generators, one module for the concern "which numbers a check feeds an engine".

Deterministic edge sets (every code of a format with its ties and neighbours, every bf16 value) and the seeded
random generators (values spanning many binades, K/V whose heads and tokens need different scales). The other input
concerns live in one module each: the input-space classes an op can receive (``fp8rl.inputspace``: the model;
``conformance/_space.py``: a tensor of a class), hypothesis strategies (``fp8rl.strategies``: formats and
quantization; ``fp8rl.strategies_correction``: log-prob batches and correction configs) and the microscaling
recipes' inputs (``conformance/_mx.py``)."""

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


def spanning_values(rng: np.random.Generator, shape: tuple[int, ...], fmt: str | None = None, spread: int = 6) -> torch.Tensor:
    """Gaussian fp32 values spanning ``±spread`` binades around 1 (or the format's range when ``fmt`` is given)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if fmt is None:
        mag = np.exp2(rng.integers(-spread, spread + 1, size=shape)).astype(np.float32)
    else:
        f = get_format(fmt)
        lo, hi = int(np.log2(f.min_subnormal)) - 2, int(np.log2(f.max_finite)) + 2
        mag = np.exp2(rng.integers(lo, hi, size=shape)).astype(np.float32)
    return torch.from_numpy(x * mag)


def kv_tensor(rng: np.random.Generator, shape: tuple[int, ...], spread: int = 6) -> torch.Tensor:
    """Gaussian K/V [..., T, H, D] whose heads span ±``spread`` binades and whose tokens vary by 8×, so that
    per-tensor, per-head and per-token-head scales all differ."""
    x = rng.standard_normal(shape).astype(np.float32)
    head = np.exp2(rng.integers(-spread, spread + 1, size=(shape[-2], 1))).astype(np.float32)
    tok = np.exp2(rng.uniform(-1.5, 1.5, size=shape[:-2] + (1, 1))).astype(np.float32)
    return torch.from_numpy(x * head * tok)
