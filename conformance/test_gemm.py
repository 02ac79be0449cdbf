"""Area ``gemm``: W8A8 GEMM of quantized operands against the exact (fp64) oracle, within the derived bound for
an fp32-accumulating implementation rounding to the output dtype.

Operands are quantized by the oracle (not by the engine), so the GEMM is judged on its own. MX-GEMM-001 does the same
for the microscaling recipes (E8M0 or two-level NVFP4 scales) within ``mx_gemm_fp32`` (docs/microscaling.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8rl.checks import assert_within_bound, check
from fp8rl.reference import microscaling as mx
from fp8rl.reference.gemm import block_gemm_exact, gemm_error_bound
from fp8rl.reference.quant import Granularity, quantize

from . import _space as S
from ._inputs import scaled_normal
from ._mx import RECIPES

OUT_DTYPES = pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
#: (M, K, N): aligned, N not a multiple of 128, one row, K not a multiple of 128, square block grid
SHAPES = [(16, 256, 256), (7, 384, 200), (1, 512, 128), (5, 320, 136), (4, 256, 256)]
OPERANDS = {
    "block": (Granularity.group(128), Granularity.block(128)),
    "tensor": (Granularity.tensor(), Granularity.tensor()),
    "row": (Granularity.token(), Granularity.channel()),
}


def _operands(kind: str, rng: np.random.Generator, m: int, k: int, n: int):
    ga, gw = OPERANDS[kind]
    a = quantize(scaled_normal(rng, (m, k), spread=4), ga, "reference")
    w = quantize(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05), gw, "reference")
    return a, w


def _check(engine, a, w, out_dtype, context):
    got = engine.block_gemm(a, w, out_dtype)
    exact = block_gemm_exact(a, w)
    bound = gemm_error_bound(a, w, out_dtype)
    assert_within_bound(got, exact, bound, context=context)


@OUT_DTYPES
@pytest.mark.parametrize("kind", list(OPERANDS))
@check("GEMM-BOUND-001", "y = A_q·s_a · (W_q·s_w)ᵀ is within the derived fp32-accumulation + output-rounding "
       "bound of the exact fp64 result, for aligned and non-aligned M, K, N.", bound="gemm_fp32_accum",
       requires=["gemm.{kind}"])
def test_gemm_random_bound(engine, kind, out_dtype, rng):
    for m, k, n in SHAPES:
        a, w = _operands(kind, rng, m, k, n)
        _check(engine, a, w, out_dtype, f"gemm[{kind}] M={m} K={k} N={n} out={out_dtype}")


@OUT_DTYPES
@pytest.mark.parametrize("kind", list(OPERANDS))
@check("GEMM-BOUND-002", "A huge-K GEMM (K = 4096, 2 rows) stays within the derived bound.",
       bound="gemm_fp32_accum", requires=["gemm.{kind}"])
def test_gemm_huge_k_bound(engine, kind, out_dtype, rng):
    a, w = _operands(kind, rng, 2, 4096, 128)
    _check(engine, a, w, out_dtype, f"gemm[{kind}] M=2 K=4096 N=128 out={out_dtype}")


@pytest.mark.parametrize("kind", list(OPERANDS))
@check("GEMM-SWAMP-001", "Swamping: one large product followed by many small ones in the same 128-K chunk "
       "(a = [2^15, 1, 1, …]) is accumulated to within the fp32 bound — low-precision accumulators lose the small "
       "terms.", bound="gemm_fp32_accum", requires=["gemm.{kind}"])
def test_gemm_swamping_bound(engine, kind):
    k, n = 256, 128
    ga, gw = OPERANDS[kind]
    # The first element is the group's amax (scale 2^15/448); the ones quantize to the e4m3 subnormal 7·2^-9, so the
    # products are 2^14 and ~0.5: a significand of ≤ 14 bits at 2^14 has an ulp ≥ 2 and drops every 0.5.
    x = torch.ones(2, k)
    x[:, 0] = 2.0**15
    x[1, 128] = 2.0**15
    a = quantize(x, ga, "reference")
    w = quantize(torch.ones(n, k) * 0.5, gw, "reference")
    _check(engine, a, w, torch.float32, f"gemm[{kind}] swamping K={k}")


@check("GEMM-ZERO-001", "All-zero operands and all-zero blocks give exactly zero output.",
       bound="exact", requires=["gemm.block"])
def test_gemm_zero_exact(engine, rng):
    ga, gw = OPERANDS["block"]
    x = scaled_normal(rng, (4, 256))
    x[:, :128] = 0
    w = torch.from_numpy(rng.standard_normal((256, 256)).astype(np.float32))
    w[:, 128:] = 0
    a, wq = quantize(x, ga, "reference"), quantize(w, gw, "reference")
    got = engine.block_gemm(a, wq, torch.float32)
    assert_within_bound(got, torch.zeros(4, 256, dtype=torch.float64), 0.0, context="gemm[block] disjoint zeros")


# ---------------------------------------------------------------------------------------------------------------
# the input space of block_gemm (fp8rl.inputspace): M, N, K around the tiles (M > 16 rows), the output dtype,
# NaN codes inside an operand, all-zero operands

_GEMM_CLASSES = [c for c in S.classes("block_gemm") if not c.startswith(("arg.a_kind", "arg.w_kind"))]


def _space_operands(kind: str, cls: str, rng: np.random.Generator):
    axis, _, value = cls.partition("=")
    dims = {"m": 24, "n": 136, "k": 200}
    if axis.startswith("size."):
        dims[axis.split(".")[1]] = S.SIZE_OF[value]
    a, w = _operands(kind, rng, dims["m"], dims["k"], dims["n"])
    if cls == "special.a=nan-code" or cls == "special.w=nan-code":
        t = a if cls.startswith("special.a") else w
        codes = t.codes.clone()
        codes[1, 3] = 0x7F  # the e4m3fn NaN code: IEEE says every output that reads it is NaN
        t = type(t)(codes, t.scale, t.granularity, t.policy)
        a, w = (t, w) if cls.startswith("special.a") else (a, t)
    if cls == "special.operand=all-zero":
        a = type(a)(torch.zeros_like(a.codes), a.scale, a.granularity, a.policy)
    return a, w


@pytest.mark.parametrize("kind", list(OPERANDS))
@pytest.mark.parametrize("cls", _GEMM_CLASSES)
@check("GEMM-SPACE-001", "For every class of the block_gemm input space — M, N and K below, at and above the "
       "64/128/256 tiles and ragged (M up to 384 rows), fp32 and bf16 outputs, a NaN code inside either operand "
       "(its row or column of the output is NaN, the rest within the bound), an all-zero operand — the output is "
       "within the derived fp32-accumulation bound of the exact result.", bound="gemm_fp32_accum",
       requires=["gemm.{kind}"])
def test_gemm_input_space_bound(engine, kind, cls, rng):
    S.skip_if_limited(engine, "block_gemm", cls)
    a, w = _space_operands(kind, cls, rng)
    out_dtype = torch.bfloat16 if cls == "arg.out_dtype=bf16" else torch.float32
    _check(engine, a, w, out_dtype, f"gemm[{kind}] {cls} M={a.codes.shape[0]} K={a.codes.shape[1]} "
                                    f"N={w.codes.shape[0]} out={out_dtype}")


# ---- microscaling recipes: the two-level-scale GEMM (conformance/_mx.py, docs/microscaling.md) ---------------------

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
