"""Shared pieces of the microscaling checks (MXFP8 e4m3/e5m2 and MXFP4 with E8M0 scales per 32 elements, NVFP4 with
E4M3 scales per 16 elements under an fp32 per-tensor global scale; docs/microscaling.md; oracle:
fp8rl.reference.microscaling), which live in the areas ``quantization`` (MX-EXACT/EDGE/SHAPE/PACK/NVFP4/BOUND) and
``gemm`` (MX-GEMM-001).

The engine declares the policy it implements per recipe (``mx_policy(recipe)``: the exponent rule of E8M0 scales,
the order of NVFP4's scale arithmetic); element bytes (packed two per byte for FP4, element 2i in the low nibble),
scale codes and the global scale must then equal the oracle's bit for bit. The round trip and the GEMM are judged
against derived bounds that hold for every policy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8rl.reference import microscaling as mx

RECIPES = pytest.mark.parametrize("recipe", list(mx.RECIPES))
FP4 = pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4"])


def compare_mx(engine, x: torch.Tensor, recipe: str, context: str) -> None:
    policy = engine.mx_policy(recipe)
    got = engine.mx_quantize(x, recipe)
    ref = mx.mx_quantize(x, policy)
    where = f"{context} ({policy.name})"
    assert tuple(got.shape) == ref.shape, f"{where}: shape {tuple(got.shape)}, expected {ref.shape}"
    if ref.global_scale is not None:
        g_got = torch.as_tensor(got.global_scale, dtype=torch.float32).reshape(())
        assert g_got.view(torch.int32) == ref.global_scale.reshape(()).view(torch.int32), \
            f"{where}: global scale {float(g_got)!r}, expected {float(ref.global_scale)!r}"
    assert got.scales.shape == ref.scales.shape, f"{where}: scales shape {tuple(got.scales.shape)}, expected " \
                                                 f"{tuple(ref.scales.shape)}"
    bad = (got.scales != ref.scales).nonzero()
    assert bad.numel() == 0, (f"{where}: {len(bad)} of {ref.scales.numel()} scale codes differ, first at "
                              f"{bad[0].tolist()}: {int(got.scales[tuple(bad[0])])} vs {int(ref.scales[tuple(bad[0])])}")
    assert got.data.shape == ref.data.shape, f"{where}: data shape {tuple(got.data.shape)}, expected " \
                                             f"{tuple(ref.data.shape)}"
    bad = (got.data != ref.data).nonzero()
    assert bad.numel() == 0, (f"{where}: {len(bad)} of {ref.data.numel()} element bytes differ, first at "
                              f"{bad[0].tolist()}: {int(got.data[tuple(bad[0])]):#04x} vs "
                              f"{int(ref.data[tuple(bad[0])]):#04x}")


def mx_shapes(recipe: str) -> list[tuple[int, int]]:
    return [(8, 256), (1, 4096), (33, 64)]


def mx_spread(recipe: str) -> int:
    """Binades the random inputs span per row/column: ±8 for E8M0 scales (range 2^±127); ±3 for NVFP4, whose E4M3
    block scales cover ~2^18 below the tensor amax — blocks beyond it (scale 0) are MX-EDGE-001's edge class."""
    return 3 if mx.get_mx_policy(recipe).two_level else 8


def mx_edge_rows(recipe: str) -> torch.Tensor:
    """Rows of one block each (block 32; NVFP4 pairs of 16-blocks): amaxes on and next to the powers of two where the
    E8M0 rules differ, ties of the element grid at scale 1, an all-zero block, tiny and huge blocks, a block whose
    E8M0 exponent clamps at 2^-127."""
    p = mx.get_mx_policy(recipe)
    t = mx.ELEMENT_MAX[p.elem]
    one = np.float32(1.0)
    ulp_up = np.float32(1 + 2.0**-23)
    top = np.float32(2.0 - 2.0**-23)
    grid_ties = {"e4m3fn": [1.0625, 1.1875, 3.5 * 1.0625, 0.0009765625 * 1.5, 240.0, 208.0],
                 "e5m2": [1.125, 1.375, 2.5 * 1.125, 2.0**-16 * 1.5, 57344.0 * 0.9375, 3.0 * 2.0**-15],
                 "e2m1": [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]}[p.elem]
    rows = []
    for k in (-20, 0, 3, 9):
        for amax in (np.float32(t) * np.float32(2.0**k), np.float32(t) * np.float32(2.0**k) * ulp_up,
                     np.float32(2.0 ** (mx.ELEMENT_EMAX[p.elem] + k)) * top, one * np.float32(2.0**k)):
            r = np.linspace(-1, 1, 32, dtype=np.float32) * np.float32(amax)
            r[5] = amax
            rows.append(r)
    ties = np.zeros(32, dtype=np.float32)
    ties[0] = t
    ties[1:1 + len(grid_ties)] = grid_ties
    ties[16] = t  # NVFP4: the second 16-block also has amax T (scale 1 under a global scale of 448)
    ties[17:17 + len(grid_ties)] = [-v for v in grid_ties]
    rows.append(ties)
    halves = np.linspace(-1, 1, 32, dtype=np.float32) * np.float32(t)
    halves[16:] *= np.float32(2.0**-10)  # NVFP4: the two 16-blocks of a 32-block need different scales
    rows.append(halves)
    rows.append(np.zeros(32, dtype=np.float32))
    rows.append(np.linspace(-1, 1, 32, dtype=np.float32) * np.float32(1e-30))
    rows.append(np.linspace(-1, 1, 32, dtype=np.float32) * np.float32(1e30))
    # a block whose exponent clamps at the bottom of E8M0 (code 0 = 2^-127): amax 2^-125 needs 2^(-125 - emax_elem)
    rows.append(np.linspace(-1, 1, 32, dtype=np.float32) * np.float32(2.0**-125))
    return torch.from_numpy(np.stack(rows))
