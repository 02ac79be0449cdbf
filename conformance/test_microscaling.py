"""Area ``microscaling``: MXFP8 (e4m3/e5m2) and MXFP4 with E8M0 scales per 32 elements, NVFP4 with E4M3 scales per
16 elements under an fp32 per-tensor global scale (docs/microscaling.md; oracle: fp8rl.reference.microscaling).

The engine declares the policy it implements per recipe (``mx_policy(recipe)``: the exponent rule of E8M0 scales,
the order of NVFP4's scale arithmetic); element bytes (packed two per byte for FP4, element 2i in the low nibble),
scale codes and the global scale must then equal the oracle's bit for bit. The round trip and the GEMM are judged
against derived bounds that hold for every policy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.checks import check
from fp8rl.reference import microscaling as mx

from ._inputs import scaled_normal

RECIPES = pytest.mark.parametrize("recipe", list(mx.RECIPES))
FP4 = pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4"])


def _compare(engine, x: torch.Tensor, recipe: str, context: str) -> None:
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


def _shapes(recipe: str) -> list[tuple[int, int]]:
    return [(8, 256), (1, 4096), (33, 64)]


def _spread(recipe: str) -> int:
    """Binades the random inputs span per row/column: ±8 for E8M0 scales (range 2^±127); ±3 for NVFP4, whose E4M3
    block scales cover ~2^18 below the tensor amax — blocks beyond it (scale 0) are MX-EDGE-001's edge class."""
    return 3 if mx.get_mx_policy(recipe).two_level else 8


@RECIPES
@check("MX-EXACT-001", "On seeded Gaussian inputs spanning ±8 binades per row and column (NVFP4: ±3, within its "
       "E4M3 scale range; divisible shapes, one row of K=4096) element bytes, scale codes and the NVFP4 global scale "
       "equal the oracle's under the engine's declared mx_policy.", requires=["mx_quantize.{recipe}"])
def test_mx_quantize_random_exact(engine, recipe, rng):
    for shape in _shapes(recipe):
        _compare(engine, scaled_normal(rng, shape, _spread(recipe)), recipe, f"mx_quantize[{recipe}] {shape}")


def _edge_rows(recipe: str) -> torch.Tensor:
    """Rows of one block each (block 32; NVFP4 pairs of 16-blocks): amaxes on and next to the powers of two where the
    E8M0 rules differ, ties of the element grid at scale 1, an all-zero block, tiny and huge blocks."""
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
    return torch.from_numpy(np.stack(rows))


@RECIPES
@check("MX-EDGE-001", "Edge blocks give the oracle's bytes and scales: amax at T·2^k, one fp32 ulp above it and at "
       "the top of a binade (where floor, ceil and fp32-log2 exponent rules disagree), element-grid ties at scale 1, "
       "16-element halves 2^10 apart, an all-zero block, 1e-30 and 1e30 blocks.", requires=["mx_quantize.{recipe}"])
def test_mx_quantize_edge_exact(engine, recipe):
    rows = _edge_rows(recipe)
    # NVFP4's global scale depends on the tensor amax: the tie row (amax T = 6 → g = 448, scale 1) is checked alone
    _compare(engine, rows[-5:-4], recipe, f"mx_quantize[{recipe}] element-grid ties")
    for i in range(rows.shape[0]):
        _compare(engine, rows[i:i + 1], recipe, f"mx_quantize[{recipe}] edge row {i}")
    _compare(engine, rows, recipe, f"mx_quantize[{recipe}] all edge rows together")


@RECIPES
@check("MX-SHAPE-001", "A last dimension that is not a multiple of the block (or is odd, for packed FP4) gives the "
       "oracle's bytes and scales: the edge block holds the real elements only (zero padding), FP4 pads a zero "
       "nibble.", requires=["mx_quantize.{recipe}", "mx_quantize.nondivisible"])
def test_mx_quantize_nondivisible_exact(engine, recipe, rng):
    for shape in [(3, 100), (2, 33), (5, 1), (4, 47)]:
        x = scaled_normal(rng, shape)
        x[..., -1] = x.abs().amax() * 2  # the edge block's max sits in its last (real) column
        _compare(engine, x, recipe, f"mx_quantize[{recipe}] {shape}")


@FP4
@check("MX-PACK-001", "Packed FP4 stores element 2i in the low nibble and 2i+1 in the high nibble of byte i "
       "(torch float4_e2m1fn_x2, compressed-tensors, vLLM): on a row whose neighbours all differ the bytes equal "
       "the oracle's.", requires=["mx_quantize.{recipe}"])
def test_fp4_packing_exact(engine, recipe):
    vals = torch.tensor([6.0, 0.5, -1.0, 4.0, 1.5, -6.0, 0.0, 3.0] * 4)
    _compare(engine, vals.reshape(1, -1), recipe, f"mx_quantize[{recipe}] alternating pairs")


@check("MX-NVFP4-001", "NVFP4's per-tensor global scale is g = 448·6/amax (fp32) and is applied: scaling a tensor "
       "by 2^±20 leaves block-scale codes and element bytes unchanged and divides g by the same power of two; both "
       "equal the oracle's.", requires=["mx_quantize.nvfp4"])
def test_nvfp4_global_scale_exact(engine, rng):
    x = scaled_normal(rng, (8, 128), _spread("nvfp4"))
    base = engine.mx_quantize(x, "nvfp4")
    for k in (-20, 20):
        xs = x * 2.0**k
        _compare(engine, xs, "nvfp4", f"mx_quantize[nvfp4] x·2^{k}")
        got = engine.mx_quantize(xs, "nvfp4")
        assert torch.equal(got.scales, base.scales) and torch.equal(got.data, base.data), \
            f"mx_quantize[nvfp4] x·2^{k}: scales/codes changed with a power-of-two rescale of the whole tensor"
        ratio = float(base.global_scale) / float(got.global_scale)
        assert ratio == 2.0**k, f"mx_quantize[nvfp4] x·2^{k}: g ratio {ratio}, expected 2^{k}"


@RECIPES
@check("MX-BOUND-001", "Dequantizing the engine's own output (its bytes, scales and global scale, decoded by the "
       "format definitions) reproduces x within the derived round-trip bound, whatever the declared policy.",
       bound="mx_roundtrip", requires=["mx_quantize.{recipe}"])
def test_mx_roundtrip_bound(engine, recipe, rng):
    for shape in [(16, 256), (4, 96)]:
        x = scaled_normal(rng, shape)
        got = engine.mx_quantize(x, recipe)
        q = mx.MXTensor(got.data, got.scales, got.global_scale, tuple(x.shape), engine.mx_policy(recipe))
        err = (mx.dequantize_mx(q) - x.double()).abs()
        bound = tolerances.mx_roundtrip_bound(q, x)
        excess = err - bound
        worst = int(excess.argmax())
        assert bool((excess <= 0).all()), (
            f"mx_roundtrip[{recipe}] {shape}: {int((excess > 0).sum())} of {x.numel()} elements beyond the bound, "
            f"worst x={float(x.flatten()[worst])!r} err={float(err.flatten()[worst]):.4g} "
            f"bound={float(bound.flatten()[worst]):.4g}")


@RECIPES
@check("MX-GEMM-001", "y = a @ wᵀ of two microscaled operands (NVFP4: two-level scales, the global factor "
       "1/(g_a·g_w) included) is within the derived fp32-accumulation bound of the exact product, for K = 64, 1024 "
       "and (engines that take ragged shapes) a K that is not a multiple of the block.", bound="mx_gemm_fp32", requires=["mx_gemm.{recipe}"])
def test_mx_gemm_bound(engine, recipe, rng):
    policy = engine.mx_policy(recipe)
    shapes = [(4, 8, 64), (3, 5, 1024)]
    if engine.capabilities().get("mx_quantize.nondivisible") is True:
        shapes.append((2, 3, 48 if policy.block == 32 else 40))
    for m, n, k in shapes:
        a = mx.mx_quantize(scaled_normal(rng, (m, k)), policy)
        w = mx.mx_quantize(scaled_normal(rng, (n, k)) * 1e-3, policy)
        for out_dtype in (torch.float32, torch.bfloat16):
            y = engine.mx_gemm(a, w, out_dtype)
            assert y.shape == (m, n) and y.dtype == out_dtype, \
                f"mx_gemm[{recipe}]: got {tuple(y.shape)} {y.dtype}, expected ({m}, {n}) {out_dtype}"
            err = (y.double() - mx.mx_gemm_exact(a, w)).abs()
            bound = mx.mx_gemm_error_bound(a, w, out_dtype)
            assert bool((err <= bound).all()), (
                f"mx_gemm[{recipe}] ({m},{k})×({n},{k})ᵀ → {out_dtype}: max err {float(err.max()):.4g}, "
                f"{int((err > bound).sum())} of {err.numel()} outputs beyond the bound (max bound "
                f"{float(bound.max()):.4g})")
