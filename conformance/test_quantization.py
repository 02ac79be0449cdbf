"""Area ``quantization``: per-tensor, per-token, per-channel, 1×G group and B×B block quantizers.

The engine declares the ScalePolicy it implements per granularity (eps floor, power-of-two rounding, divide vs
multiply, clamp); codes and scales must then equal the oracle's bit for bit. Policy-independent properties
(round-trip error bound, finite scales for all-zero blocks) are checked too.

The microscaling recipes are quantizers too and are checked here (MX-*; conformance/_mx.py, docs/microscaling.md):
MXFP8 e4m3/e5m2 and MXFP4 with E8M0 scales per 32 elements, NVFP4 with E4M3 scales per 16 elements under an fp32
per-tensor global scale. Element bytes (packed FP4), scale codes and the global scale are bit-exact under the
engine's declared ``mx_policy(recipe)``; the round trip is within ``mx_roundtrip``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.checks import assert_codes_equal, assert_tensors_equal, assert_within_bound, check, require
from fp8rl.diagnose import diagnose_quantize
from fp8rl.reference import microscaling as mx
from fp8rl.reference.formats import decode_codes
from fp8rl.reference.quant import Granularity, quantize
from hypothesis import given
from hypothesis import strategies as st

from . import _space as S
from ._inputs import scaled_normal
from ._mx import FP4, RECIPES, compare_mx, mx_edge_rows, mx_shapes, mx_spread

#: granularity kind → (granularity, shapes: divisible, non-divisible, one row, huge K)
CASES = {
    "tensor": (Granularity.tensor(), [(64, 256), (3, 100), (1, 4096)]),
    "token": (Granularity.token(), [(64, 256), (5, 130), (1, 4096)]),
    "channel": (Granularity.channel(), [(128, 256), (96, 200), (1, 4096)]),
    "group": (Granularity.group(128), [(32, 512), (5, 320), (1, 4096), (4, 1000)]),
    "block": (Granularity.block(128), [(256, 256), (200, 328), (1, 4096), (384, 128)]),
}
KINDS = pytest.mark.parametrize("kind", list(CASES))


def _diagnosis(x: torch.Tensor, g: Granularity, got, policy) -> str:
    """"\n" + what the engine's output matches instead of the declared policy's (fp8rl.diagnose); "" while
    hypothesis shrinks a failing example (only its final, reported run is diagnosed). A diagnosis that fails
    says so in one line: it never replaces the comparison's own message."""
    try:
        from hypothesis.control import current_build_context, currently_in_test_context

        if currently_in_test_context() and not current_build_context().is_final:
            return ""
    except Exception:  # an unknown hypothesis API: diagnose
        pass
    try:
        return "\n" + diagnose_quantize(x, g, got.codes, got.scale, policy)
    except Exception as exc:  # a diagnosis bug must not hide the failure
        return f"\ndiagnosis: unavailable ({type(exc).__name__}: {exc})"


@contextlib.contextmanager
def _diagnosed(x: torch.Tensor, g: Granularity, got, policy):
    """Re-raise a failed scale/code comparison under the declared policy with the diagnosis appended."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}{_diagnosis(x, g, got, policy)}") from None


def _compare(engine, x: torch.Tensor, g: Granularity, context: str) -> None:
    got = engine.quantize(x, g)
    policy = engine.scale_policy(g.kind)
    ref = quantize(x, g, policy)
    with _diagnosed(x, g, got, policy):
        assert_tensors_equal(got.scale, ref.scale, context=f"{context}: scales ({policy.name})")
        assert_codes_equal(got.codes, ref.codes, policy.fmt, context=f"{context}: codes ({policy.name})", inputs=x)


@KINDS
@check("QUANT-EXACT-001", "On seeded Gaussian inputs spanning ±8 binades per row/column (divisible, "
       "non-divisible, one-row and K=4096 shapes) scales and codes equal the oracle's under the engine's declared "
       "policy.", requires=["quantize.{kind}"])
def test_quantize_random_exact(engine, kind, rng):
    g, shapes = CASES[kind]
    for shape in shapes:
        _compare(engine, scaled_normal(rng, shape), g, f"quantize[{kind}] {shape}")


@KINDS
@check("QUANT-EXACT-002", "On a large input (64×4096) where x/s and x·(1/s) differ in ~0.04% of elements, "
       "codes equal the oracle's under the declared quant op.", requires=["quantize.{kind}"])
def test_quantize_divide_vs_multiply_exact(engine, kind, rng):
    g = CASES[kind][0]
    x = torch.from_numpy(rng.standard_normal((64, 4096)).astype(np.float32) * 3.0).to(torch.bfloat16).float()
    _compare(engine, x, g, f"quantize[{kind}] 64x4096")


@KINDS
@check("QUANT-EDGE-001", "An all-zero tensor, row, group or block gets a finite positive scale and all-zero "
       "codes, and the other blocks are unaffected.", requires=["quantize.{kind}"])
def test_quantize_zero_block_exact(engine, kind, rng):
    g, shapes = CASES[kind]
    for shape in shapes[:2]:
        x = scaled_normal(rng, shape)
        x_zero = torch.zeros(shape)
        _compare(engine, x_zero, g, f"quantize[{kind}] all-zero {shape}")
        got = engine.quantize(x_zero, g)
        assert bool((got.scale > 0).all() & torch.isfinite(got.scale).all()), \
            f"quantize[{kind}] all-zero {shape}: scales not finite positive: {got.scale.flatten()[:4].tolist()}"
        # zero the first group/block/row only
        x_part = x.clone()
        x_part[: (g.size[0] if kind == "block" else 1), : (g.size[1] if kind in ("group", "block") else None)] = 0
        _compare(engine, x_part, g, f"quantize[{kind}] first block zeroed {shape}")


@KINDS
@check("QUANT-EDGE-002", "Edge inputs give the oracle's scales and codes: values at ±max·scale, subnormal-only "
       "blocks (|x| ~ 1e-30), mixed huge/tiny blocks, and a non-divisible edge whose largest element is its last "
       "column.", requires=["quantize.{kind}"])
def test_quantize_edge_values_exact(engine, kind, rng):
    g, shapes = CASES[kind]
    shape = shapes[1]
    tiny = scaled_normal(rng, shape) * 1e-30
    _compare(engine, tiny, g, f"quantize[{kind}] tiny {shape}")
    mixed = scaled_normal(rng, shape)
    mixed[..., ::7] *= 1e20
    _compare(engine, mixed, g, f"quantize[{kind}] mixed {shape}")
    edge = scaled_normal(rng, shape)
    edge[..., -1] = edge.abs().amax() * 4  # the edge group's/block's max sits in its last column
    _compare(engine, edge, g, f"quantize[{kind}] edge max in last column {shape}")
    signs = torch.tensor([[448.0, -448.0, 1.0, -1.0] * 32] * 2)
    _compare(engine, signs, g, f"quantize[{kind}] ±448")


@KINDS
@check("QUANT-EDGE-003", "A group holding +inf, -inf or NaN gets the oracle's scale and codes under the declared "
       "policy (e.g. DeepGEMM's UE8M0 clamps an inf/NaN amax's exponent to 2^127), and the other groups are "
       "unaffected.", requires=["quantize.{kind}", "quantize_nonfinite"])
def test_quantize_nonfinite_exact(engine, kind, rng):
    g, shapes = CASES[kind]
    shape = shapes[1]
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = scaled_normal(rng, shape)
        x[0, 0] = bad
        got = engine.quantize(x, g)
        policy = engine.scale_policy(g.kind)
        ref = quantize(x, g, policy)
        context = f"quantize[{kind}] {bad} in the first group {shape}"
        with _diagnosed(x, g, got, policy):
            assert_tensors_equal(got.scale, ref.scale, context=f"{context}: scales ({policy.name})")
            # a NaN's sign bit comes from the vector unit that produced it, not from the policy: NaN codes are
            # one code
            assert_codes_equal(_nan_as_one(got.codes, policy.fmt), _nan_as_one(ref.codes, policy.fmt), policy.fmt,
                               context=f"{context}: codes ({policy.name})", inputs=x)


def _nan_as_one(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    nan = torch.from_numpy(np.isnan(decode_codes(codes.cpu().numpy(), fmt))).reshape(codes.shape)
    return torch.where(nan, torch.full_like(codes, 0x80 if "fnuz" in fmt else 0x7F), codes)


@KINDS
@check("QUANT-PROP-001", "For hypothesis-drawn tensors (subnormals, huge values, repeated values, zeros) scales "
       "and codes equal the oracle's under the declared policy.", requires=["quantize.{kind}"])
def test_quantize_property_exact(engine, kind):
    g = CASES[kind][0]
    block = g.size[0] if kind == "block" else 1
    width = g.size[1] if kind in ("group", "block") else 16

    @given(st.integers(1, 3), st.integers(1, 3), st.integers(0, width - 1),
           st.sampled_from([1e-30, 1e-6, 1.0, 300.0, 1e6, 1e30]), st.integers(0, 2**32 - 1))
    def inner(rows_blocks, col_blocks, col_extra, magnitude, data_seed):
        r = np.random.default_rng(data_seed)
        rows = rows_blocks * block if kind == "block" else rows_blocks
        shape = (rows, col_blocks * width + col_extra)
        x = torch.from_numpy((r.standard_normal(shape) * magnitude).astype(np.float32))
        x[r.random(shape) < 0.1] = 0.0
        _compare(engine, x, g, f"quantize[{kind}] hypothesis {shape} magnitude {magnitude:g} seed {data_seed}")

    inner()


@KINDS
@check("QUANT-BOUND-001", "Dequantized values are within the derived round-trip bound of the input: "
       "max(2^-(m+1)·|x|, ½·min_subnormal·s) per element, for every input in range.",
       bound="quant_roundtrip", requires=["quantize.{kind}"])
def test_quantize_roundtrip_bound(engine, kind, rng):
    g, shapes = CASES[kind]
    for shape in shapes:
        x = scaled_normal(rng, shape)
        got = engine.quantize(x, g)
        deq = got.dequantize()
        bound = tolerances.quant_roundtrip_bound(x.abs(), got.expanded_scale(), got.fmt)
        assert_within_bound(deq, x, bound, context=f"quantize[{kind}] round trip {shape}")


# ---------------------------------------------------------------------------------------------------------------
# the input space of quantize (fp8rl.inputspace)

#: kinds that accept inputs of any rank (token/group/tensor act on the last dim); channel and block are 2-D
_ND_KINDS = ("tensor", "token", "group")
_NONFINITE = ("special.x=nan", "special.x=posinf", "special.x=neginf")


def _space_cases() -> list:
    cases = []
    for kind in CASES:
        for cls in S.classes("quantize", ("dtype.", "layout.", "rank.", "size.", "special.")):
            if cls.startswith("rank.") and cls != "rank.x=2d" and kind not in _ND_KINDS:
                continue
            cases.append((kind, cls))
    cases += [("group", "arg.group_size=other"), ("block", "arg.block_size=other")]
    return cases


#: the granularity a quantize SPACE case uses: the usual one, or another group / block size
_OTHER = {"arg.group_size=other": Granularity.group(64), "arg.block_size=other": Granularity.block((128, 64))}


@pytest.mark.parametrize(("kind", "cls"), _space_cases())
@check("QUANT-SPACE-001", "For every class of the quantize input space — fp32/bf16/fp16 inputs; contiguous, "
       "transposed, sliced and strided layouts; 1-D and batched 3-D inputs where the granularity allows them; "
       "sizes below, at and above the 64/128/256 tiles and ragged; -0, fp32 subnormals, ±FLT_MAX (and NaN/±inf "
       "where the engine declares non-finite groups); group sizes and block shapes other than 128 — scales and "
       "codes equal the oracle's under the declared policy.", requires=["quantize.{kind}"])
def test_quantize_input_space_exact(engine, kind, cls, rng):
    S.skip_if_limited(engine, "quantize", cls)
    if cls in _NONFINITE:
        require(engine, "quantize_nonfinite")
    g = _OTHER.get(cls, CASES[kind][0])
    x = S.tensor_of_class(cls, rng, rows=(160 if kind == "block" and not cls.startswith("size.") else None))
    got = engine.quantize(x, g)
    policy = engine.scale_policy(g.kind)
    ref = quantize(x.contiguous(), g, policy)
    context = f"quantize[{g.label}] {cls} {tuple(x.shape)} {x.dtype}"
    with _diagnosed(x.contiguous(), g, got, policy):
        assert_tensors_equal(got.scale, ref.scale, context=f"{context}: scales ({policy.name})")
        assert_codes_equal(_nan_as_one(got.codes, policy.fmt), _nan_as_one(ref.codes, policy.fmt), policy.fmt,
                           context=f"{context}: codes ({policy.name})", inputs=x.float().contiguous())


# ---- microscaling recipes: MXFP8 (e4m3/e5m2), MXFP4, NVFP4 (conformance/_mx.py, docs/microscaling.md) -------------

@RECIPES
@check("MX-EXACT-001", "On seeded Gaussian inputs spanning ±8 binades per row and column (NVFP4: ±3, within its "
       "E4M3 scale range; divisible shapes, one row of K=4096) element bytes, scale codes and the NVFP4 global scale "
       "equal the oracle's under the engine's declared mx_policy.", requires=["mx_quantize.{recipe}"])
def test_mx_quantize_random_exact(engine, recipe, rng):
    for shape in mx_shapes(recipe):
        compare_mx(engine, scaled_normal(rng, shape, mx_spread(recipe)), recipe, f"mx_quantize[{recipe}] {shape}")


@RECIPES
@check("MX-EDGE-001", "Edge blocks give the oracle's bytes and scales: amax at T·2^k, one fp32 ulp above it and at "
       "the top of a binade (where floor, ceil and fp32-log2 exponent rules disagree), element-grid ties at scale 1, "
       "16-element halves 2^10 apart, an all-zero block, 1e-30 and 1e30 blocks, a 2^-125 block (its E8M0 exponent "
       "clamps at 2^-127: the elements must be divided by the stored 2^-127).", requires=["mx_quantize.{recipe}"])
def test_mx_quantize_edge_exact(engine, recipe):
    rows = mx_edge_rows(recipe)
    # NVFP4's global scale depends on the tensor amax: the tie row (amax T = 6 → g = 448, scale 1) is checked alone
    compare_mx(engine, rows[-6:-5], recipe, f"mx_quantize[{recipe}] element-grid ties")
    for i in range(rows.shape[0]):
        compare_mx(engine, rows[i:i + 1], recipe, f"mx_quantize[{recipe}] edge row {i}")
    compare_mx(engine, rows, recipe, f"mx_quantize[{recipe}] all edge rows together")


@RECIPES
@check("MX-SHAPE-001", "A last dimension that is not a multiple of the block (or is odd, for packed FP4) gives the "
       "oracle's bytes and scales: the edge block holds the real elements only (zero padding), FP4 pads a zero "
       "nibble.", requires=["mx_quantize.{recipe}", "mx_quantize.nondivisible"])
def test_mx_quantize_nondivisible_exact(engine, recipe, rng):
    for shape in [(3, 100), (2, 33), (5, 1), (4, 47)]:
        x = scaled_normal(rng, shape)
        x[..., -1] = x.abs().amax() * 2  # the edge block's max sits in its last (real) column
        compare_mx(engine, x, recipe, f"mx_quantize[{recipe}] {shape}")


@FP4
@check("MX-PACK-001", "Packed FP4 stores element 2i in the low nibble and 2i+1 in the high nibble of byte i "
       "(torch float4_e2m1fn_x2, compressed-tensors, vLLM): on a row whose neighbours all differ the bytes equal "
       "the oracle's.", requires=["mx_quantize.{recipe}"])
def test_fp4_packing_exact(engine, recipe):
    vals = torch.tensor([6.0, 0.5, -1.0, 4.0, 1.5, -6.0, 0.0, 3.0] * 4)
    compare_mx(engine, vals.reshape(1, -1), recipe, f"mx_quantize[{recipe}] alternating pairs")


@check("MX-NVFP4-001", "NVFP4's per-tensor global scale is g = 448·6/amax (fp32) and is applied: scaling a tensor "
       "by 2^±20 leaves block-scale codes and element bytes unchanged and divides g by the same power of two; both "
       "equal the oracle's.", requires=["mx_quantize.nvfp4"])
def test_nvfp4_global_scale_exact(engine, rng):
    x = scaled_normal(rng, (8, 128), mx_spread("nvfp4"))
    base = engine.mx_quantize(x, "nvfp4")
    for k in (-20, 20):
        xs = x * 2.0**k
        compare_mx(engine, xs, "nvfp4", f"mx_quantize[nvfp4] x·2^{k}")
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
