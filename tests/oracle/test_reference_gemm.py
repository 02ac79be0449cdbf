"""Tests of the exact scaled FP8 GEMM and of the fp32-accumulation error bound (fp8rl.reference.gemm).

Names say the comparison: ``*_exact`` (bit-exact), ``*_bound`` (within a derived bound of fp8rl.tolerances).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.reference.formats import ELEMENT_FORMATS
from fp8rl.reference.gemm import block_gemm_exact, gemm_error_bound
from fp8rl.reference.presets import PRESETS
from fp8rl.reference.quant import Granularity, QuantizedTensor, quantize
from fp8rl.strategies import fp32_near_fp8, tensors
from hypothesis import given, settings
from hypothesis import strategies as st

f32 = np.float32
_BASE = settings().max_examples
per_case = settings(max_examples=max(6, _BASE // 2))

A_GRANS = [Granularity.tensor(), Granularity.token(), Granularity.group(4), Granularity.group(8),
           Granularity.group(16)]
W_GRANS = [Granularity.tensor(), Granularity.channel(), Granularity.block(4), Granularity.block((4, 8)),
           Granularity.block((8, 16)), Granularity.block((3, 5))]
E4M3 = ("e4m3fn", "e4m3fnuz")


@st.composite
def operands(draw, fmts=ELEMENT_FORMATS, a_grans=A_GRANS, w_grans=W_GRANS, max_k=70, max_mag=None):
    """(a, w): quantized activations (M, K) and weights (N, K) with independent formats and granularities."""
    fa, fw = draw(st.sampled_from(fmts)), draw(st.sampled_from(fmts))
    ga, gw = draw(st.sampled_from(a_grans)), draw(st.sampled_from(w_grans))
    m, n, k = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, max_k))
    xa = draw(tensors((m, k), fp32_near_fp8(fa, max_magnitude=max_mag)), label="a")
    xw = draw(tensors((n, k), fp32_near_fp8(fw, max_magnitude=max_mag)), label="w")
    pa = PRESETS["reference"].for_format(fa)
    pw = PRESETS["reference"].for_format(fw)
    return quantize(xa, ga, pa), quantize(xw, gw, pw)


def _deq64(qt: QuantizedTensor) -> torch.Tensor:
    return qt.dequantize(torch.float64)  # exact: FP8 value (≤ 4 bits) × fp32 scale (24 bits)


def _sum_abs(a, w):
    return _deq64(a).abs() @ _deq64(w).abs().T


def _fraction_gemm(a: QuantizedTensor, w: QuantizedTensor) -> list[list[Fraction]]:
    """Exact rational y = Σ_k (q_a·s_a)(q_w·s_w), independent of the code under test (Python Fractions)."""
    va = [[Fraction(v) for v in row] for row in _deq64(a).tolist()]
    vw = [[Fraction(v) for v in row] for row in _deq64(w).tolist()]
    return [[sum((x * y for x, y in zip(ra, rw)), Fraction(0)) for rw in vw] for ra in va]


# ---------------------------------------------------------------------------------------------------------------
# Exactness of block_gemm_exact


@per_case
@given(ops=operands(max_k=24))
def test_block_gemm_exact_vs_rational_bound(ops):
    a, w = ops
    y = block_gemm_exact(a, w)
    exact = _fraction_gemm(a, w)
    k = a.shape[1]
    # half of the agreement bound is the bound of one fp64 evaluation: γ_{K+3}(2^-53)·Σ|a||w|
    bound = tolerances.fp64_gemm_agreement_bound(_sum_abs(a, w), k) / 2
    for i, row in enumerate(exact):
        for j, v in enumerate(row):
            assert abs(Fraction(y[i, j].item()) - v) <= Fraction(bound[i, j].item())


@per_case
@given(ops=operands(fmts=E4M3, a_grans=A_GRANS[:2], w_grans=W_GRANS[:2], max_k=24))
def test_block_gemm_exact_single_segment_correctly_rounded_exact(ops):
    # One scale segment and e4m3 codes: the integer partial sum is exact (< 2^53) and is multiplied by the exact
    # scale product once, so y must be the correctly rounded exact value.
    a, w = ops
    y = block_gemm_exact(a, w)
    exact = _fraction_gemm(a, w)
    assert y.tolist() == [[float(v) for v in row] for row in exact]


@per_case
@given(ops=operands())
def test_block_gemm_exact_vs_fp64_dequant_matmul_bound(ops):
    a, w = ops
    y = block_gemm_exact(a, w)
    plain = _deq64(a) @ _deq64(w).T
    bound = tolerances.fp64_gemm_agreement_bound(_sum_abs(a, w), a.shape[1])
    assert ((y - plain).abs() <= bound).all()


def test_block_gemm_exact_limb_path_exact():
    # e5m2 max codes: n = 57344·2^16 ≈ 2^31.8, so one product is ≈ 2^63.6 > 2^53 and the 16-bit-limb path runs.
    # All values are 57344 with scale 1 (target 57344 → s = amax/57344 = 1): y = K·57344² exactly (fp64-exact).
    k = 40
    x = torch.full((2, k), 57344.0)
    p = PRESETS["reference"].for_format("e5m2")
    a, w = quantize(x, Granularity.token(), p), quantize(x, Granularity.channel(), p)
    assert a.scale.unique().tolist() == [1.0]
    assert block_gemm_exact(a, w).tolist() == [[k * 57344.0**2] * 2] * 2


def test_block_gemm_all_equal_pow2_exact():
    # a = 2 everywhere (s_a = 2/448 → code 448), w = 0.5 (s_w = 0.5/448 → 448): y = K·2·0.5 = K.
    # With UE8M0 scales: s_a = 2^-7 (2/448 rounded up) and 2/2^-7 = 256; s_w = 2^-9, 0.5/2^-9 = 256: y = K.
    for policy in ("reference", "deepgemm_ue8m0"):
        a = quantize(torch.full((3, 48), 2.0), Granularity.group(16), policy)
        w = quantize(torch.full((5, 48), 0.5), Granularity.block((4, 16)), policy)
        y = block_gemm_exact(a, w)
        want = float(Fraction(_deq64(a)[0, 0].item()) * Fraction(_deq64(w)[0, 0].item()) * 48)
        assert (y == want).all(), policy
        if policy == "deepgemm_ue8m0":
            assert want == 48.0


def test_block_gemm_nonfinite_follows_ieee_exact():
    p = PRESETS["reference"].for_format("e5m2")
    a = quantize(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), Granularity.token(), p)
    w = quantize(torch.tensor([[1.0, -1.0], [0.5, 0.25]]), Granularity.channel(), p)
    codes = a.codes.clone()
    codes[0, 1] = 0x7C  # e5m2 +inf
    a_inf = QuantizedTensor(codes, a.scale, a.granularity, a.policy)
    y = block_gemm_exact(a_inf, w)
    assert y[0].tolist() == [-float("inf"), float("inf")]
    assert torch.isfinite(y[1]).all()
    nan_scale = QuantizedTensor(w.codes, torch.tensor([[float("nan")], [1.0]]), w.granularity, w.policy)
    y2 = block_gemm_exact(a, nan_scale)
    assert torch.isnan(y2[:, 0]).all() and torch.isfinite(y2[:, 1]).all()


# ---------------------------------------------------------------------------------------------------------------
# The fp32 accumulation bound holds for real fp32 implementations


OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@per_case
@given(ops=operands(max_k=300))
def test_fp32_dequant_matmul_within_gemm_bound(out_dtype, ops):
    a, w = ops
    y_impl = (a.dequantize() @ w.dequantize().T).to(out_dtype).double()  # fp32 dequant, fp32 BLAS matmul
    exact = block_gemm_exact(a, w)
    bound = gemm_error_bound(a, w, out_dtype)
    err = (y_impl - exact).abs()
    ok = (err <= bound) | (torch.isinf(y_impl) & torch.isinf(bound))
    assert ok.all(), f"max excess {(err - bound)[~ok].max().item()}"


def _tile_scaled_fp32(a: QuantizedTensor, w: QuantizedTensor, tile: int) -> torch.Tensor:
    """Triton w8a8_block_scaled_mm emulation: per K-tile fp32 dot of FP8 values, × a_s × b_s, += into fp32."""
    k = a.shape[1]
    va, vw = a.values(), w.values()
    sa, sw = a.expanded_scale(), w.expanded_scale()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32)
    for k0 in range(0, k, tile):
        dot = va[:, k0:k0 + tile] @ vw[:, k0:k0 + tile].T
        acc = acc + dot * sa[:, k0:k0 + 1] * sw[:, k0].reshape(1, -1)
    return acc


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@per_case
@given(data=st.data())
def test_tile_scaled_accumulation_within_gemm_bound(out_dtype, data):
    g = data.draw(st.sampled_from([4, 8, 16]), label="tile")
    a_g = Granularity.group(g)
    w_g = Granularity.block((data.draw(st.sampled_from([2, 4, 8])), g))
    a, w = data.draw(operands(a_grans=[a_g], w_grans=[w_g], max_k=200), label="operands")
    y_impl = _tile_scaled_fp32(a, w, g).to(out_dtype).double()
    exact = block_gemm_exact(a, w)
    bound = gemm_error_bound(a, w, out_dtype)
    err = (y_impl - exact).abs()
    assert ((err <= bound) | (torch.isinf(y_impl) & torch.isinf(bound))).all()


@pytest.mark.parametrize("kind", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@per_case
@given(data=st.data())
def test_torch_scaled_mm_within_gemm_bound(kind, out_dtype, data):
    ga, gw = (Granularity.tensor(), Granularity.tensor()) if kind == "tensor" else (Granularity.token(),
                                                                                    Granularity.channel())
    a, w = data.draw(operands(fmts=("e4m3fn",), a_grans=[ga], w_grans=[gw], max_k=128), label="operands")
    sa = a.scale.reshape(()) if kind == "tensor" else a.scale
    sw = w.scale.reshape(()) if kind == "tensor" else w.scale.reshape(1, -1)
    y_impl = torch._scaled_mm(a.codes.view(torch.float8_e4m3fn), w.codes.view(torch.float8_e4m3fn).t(), sa, sw,
                              out_dtype=out_dtype).double()
    exact = block_gemm_exact(a, w)
    assert ((y_impl - exact).abs() <= gemm_error_bound(a, w, out_dtype)).all()


def _round_significand(x: np.ndarray, bits: int) -> np.ndarray:
    """Round float64 values to ``bits`` significant bits, round-to-nearest-even (an accumulator register model)."""
    m, e = np.frexp(x)
    return np.ldexp(np.round(m * 2.0**bits) / 2.0**bits, e)


def test_swamping_low_precision_accumulator_exceeds_gemm_bound():
    # One 128-long K chunk: a = [2^15, 1, 1, ...] quantized per 1×128 group, w = ones per 128×128 block.
    # s_a = fl(2^15/448); 2^15 → code 448, each 1 → 448/2^15 = 7·2^-9 (e4m3 subnormal, exact).  w: code 448.
    # Code products: 448·448 = 200704 once, then 127 × 7·2^-9·448 = 6.125.
    # An accumulator that keeps 14 significant bits (13 mantissa bits; Hopper FP8 WGMMA, DeepSeek-V3 §3.3.2)
    # has spacing 2^(17-13) = 16 at 200704, so every +6.125 rounds away: the sum stays 200704, losing
    # 127·6.125 = 777.875 code units ≈ 127 in y. The fp32 bound allows γ_131(2^-24)·Σ|a||w| ≈ 0.26.
    k = 128
    x = torch.ones(1, k)
    x[0, 0] = 2.0**15
    a = quantize(x, Granularity.group(128), "reference")
    w = quantize(torch.ones(4, k), Granularity.block(128), "reference")
    assert a.codes[0, 0].item() == 0x7E and (a.codes[0, 1:] == 0x07).all() and (w.codes == 0x7E).all()
    exact = block_gemm_exact(a, w)
    bound = gemm_error_bound(a, w, torch.float32)

    prods = (a.values().double()[0, :, None] * w.values().double().T).numpy()  # exact code products (K, N)
    acc14 = np.zeros(prods.shape[1])
    acc32 = np.zeros(prods.shape[1], dtype=f32)
    for p in prods:
        acc14 = _round_significand(acc14 + p, 14)
        acc32 = (acc32 + p.astype(f32)).astype(f32)
    scale = f32(a.scale.item()) * f32(w.scale[0, 0].item())
    y14 = torch.from_numpy((acc14.astype(f32) * scale).astype(np.float64))
    y32 = torch.from_numpy((acc32 * scale).astype(np.float64))
    assert acc14[0] == 200704.0  # every small term swamped
    assert ((y32 - exact[0]).abs() <= bound[0]).all()
    assert ((y14 - exact[0]).abs() > 100 * bound[0]).all()


def test_gemm_bound_hand_computed_exact():
    # a = w = [[1]] (reference: s = fl(1/448), code 448), K = 1, fp32 output:
    # Σ|a||w| = (448·s)² = y; bound = γ_{1+3}(2^-24)·y·eval_slack(1) (no underflow mass term beyond c·η·1).
    one = quantize(torch.ones(1, 1), Granularity.token(), "reference")
    w = quantize(torch.ones(1, 1), Granularity.channel(), "reference")
    y = block_gemm_exact(one, w).item()
    s = float(f32(1) / f32(448))
    assert y == (448 * s) ** 2
    c = int(tolerances.GEMM_FP32_PRODUCT_ROUNDINGS.value)
    want = (tolerances.gamma(1 + c, 2.0**-24) * y + c * 2.0**-149 * 448 * 448) * tolerances.eval_slack(1)
    assert gemm_error_bound(one, w, torch.float32).item() == pytest.approx(want, rel=1e-15)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def _q(shape, g, fmt="e4m3fn"):
    return quantize(torch.ones(shape), g, PRESETS["reference"].for_format(fmt))


BAD = [
    (lambda: block_gemm_exact(_q((2, 8), Granularity.token()), _q((3, 9), Granularity.channel())), ValueError,
     r"w: K mismatch: a is \(M=2, K=8\) but w is \(N=3, K=9\)"),
    (lambda: block_gemm_exact(_q((2, 8), Granularity.block(4)), _q((3, 8), Granularity.channel())), ValueError,
     r"a: granularity 'block4x4' is not supported for activations"),
    (lambda: block_gemm_exact(_q((2, 8), Granularity.token()), _q((3, 8), Granularity.token())), ValueError,
     r"w: granularity 'token' is not supported.*Granularity.channel\(\)"),
    (lambda: block_gemm_exact(_q((2, 2, 8), Granularity.group(4)), _q((3, 8), Granularity.channel())), ValueError,
     r"a: expected 2-D activations \(M, K\), got shape \(2, 2, 8\)"),
    (lambda: block_gemm_exact(torch.ones(2, 2), _q((3, 8), Granularity.channel())), TypeError,
     r"a: expected a QuantizedTensor"),
    (lambda: gemm_error_bound(_q((2, 8), Granularity.token()), _q((3, 8), Granularity.channel()), torch.int32),
     ValueError, r"out_dtype: expected float32, bfloat16, float16 or float64"),
    (lambda: gemm_error_bound(_q((2, 8), Granularity.token()), _q((3, 8), Granularity.channel()), "bf16"),
     TypeError, r"out_dtype: expected a torch.dtype"),
]


@pytest.mark.parametrize("fn,exc,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_raises_exact(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()
