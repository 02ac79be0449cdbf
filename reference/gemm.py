"""The exact scaled FP8 GEMM and the rigorous error bound of fp32-accumulating implementations.

``y = a @ wᵀ`` for activations ``a`` (M, K) quantized per tensor, per token or in 1×G groups and weights ``w``
(N, K) quantized per tensor, per output channel or in Bn×Bk blocks (Bn rows of w × Bk columns of K), i.e. the
W8A8 linear layer of vLLM/SGLang/TE (``w8a8_triton_block_scaled_mm(A, B, As, Bs)`` with B = w).

Any combination of a-groups and w-blocks is supported, aligned or not: the K axis is cut at every a-group and
every w-block boundary, so each segment has one a-scale per row and one w-scale per row of w.
"""

from __future__ import annotations

import torch
from fp8rl.reference.bounds import gemm_fp32_accum_bound
from fp8rl.reference.formats import ELEMENT_FORMATS, get_format
from fp8rl.reference.quant import QuantizedTensor, expand_scale

__all__ = ["A_KINDS", "W_KINDS", "block_gemm_exact", "gemm_error_bound"]

#: granularity kinds accepted for the activation operand a (M, K) and the weight operand w (N, K)
A_KINDS: tuple[str, ...] = ("tensor", "token", "group")
W_KINDS: tuple[str, ...] = ("tensor", "channel", "block")

_F64 = torch.float64
_LIMB = 16  # bits per limb when an integer partial sum could exceed 2^53
_MAX_SEGMENT = 1 << 16  # segment length cap: limb products < 2^34 and sums < 2^50 stay exact


def _check_operands(a: QuantizedTensor, w: QuantizedTensor) -> tuple[int, int, int]:
    for name, qt, kinds, what in (("a", a, A_KINDS, "activations (M, K)"), ("w", w, W_KINDS, "weights (N, K)")):
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"{name}: expected a QuantizedTensor, got {type(qt).__name__}")
        if qt.codes.dim() != 2:
            raise ValueError(f"{name}: expected 2-D {what}, got shape {qt.shape}")
        if qt.granularity.kind not in kinds:
            hint = " (use Granularity.channel() for per-row weight scales)" if qt.granularity.kind == "token" else ""
            raise ValueError(f"{name}: granularity {qt.granularity.label!r} is not supported for {what}; "
                             f"expected one of {kinds}{hint}")
        if qt.fmt not in ELEMENT_FORMATS:
            raise ValueError(f"{name}: expected an element format {ELEMENT_FORMATS}, got {qt.fmt!r}")
    m, k = a.shape
    n, kw = w.shape
    if k != kw:
        raise ValueError(f"w: K mismatch: a is (M={m}, K={k}) but w is (N={n}, K={kw}); y = a @ wᵀ needs equal K")
    return m, k, n


def _segments(k: int, a: QuantizedTensor, w: QuantizedTensor) -> list[tuple[int, int]]:
    """[k0, k1) ranges on which both operands have a constant scale per row (cut at every group/block edge)."""
    cuts = {0, k}
    if a.granularity.kind == "group":
        cuts.update(range(0, k, a.granularity.size[1]))
    if w.granularity.kind == "block":
        cuts.update(range(0, k, w.granularity.size[1]))
    edges = sorted(cuts)
    out = []
    for k0, k1 in zip(edges[:-1], edges[1:]):
        for s in range(k0, k1, _MAX_SEGMENT):
            out.append((s, min(s + _MAX_SEGMENT, k1)))
    return out


def _grid_exponent(fmt: str) -> int:
    """g such that every value of ``fmt`` is an integer multiple of 2^-g (the smallest subnormal)."""
    f = get_format(fmt)
    return f.man_bits - f.min_exponent


def _int_codes(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, finite): FP8 values as exact integers n = value·2^g in fp64 (non-finite set to 0), and the finite mask."""
    v = qt.values().to(_F64)
    finite = torch.isfinite(v)
    n = torch.where(finite, v, torch.zeros_like(v)) * 2.0 ** _grid_exponent(qt.fmt)
    return n, finite


def _exact_int_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ yᵀ for integer-valued fp64 x (M, L), y (N, L); exact when every partial sum stays below 2^53,
    otherwise each operand is split into 16-bit limbs whose products are summed exactly and combined with at most
    3 fp64 roundings."""
    length = x.shape[1]
    mx = float(x.abs().max()) if x.numel() else 0.0
    my = float(y.abs().max()) if y.numel() else 0.0
    if mx * my * length < 2.0**53:
        return x @ y.T
    base = 2.0**_LIMB
    xh = torch.round(x / base)
    xl = x - xh * base
    yh = torch.round(y / base)
    yl = y - yh * base
    return ((xh @ yh.T) * base * base + (xh @ yl.T) * base) + (xl @ yh.T) * base + xl @ yl.T


def _row_scales(qt: QuantizedTensor, rows: int, k0: int) -> torch.Tensor:
    """fp64 scale of each row of a 2-D operand at column k0."""
    s = qt.scale.to(_F64)
    g = qt.granularity
    if g.kind == "tensor":
        return s.reshape(1).expand(rows)
    if g.kind in ("token", "channel"):
        return s[:, 0]
    if g.kind == "group":
        return s[:, k0 // g.size[1]]
    bn, bk = g.size
    return s[:, k0 // bk].repeat_interleave(bn)[:rows]


def _dequant64(qt: QuantizedTensor) -> torch.Tensor:
    return qt.values().to(_F64) * expand_scale(qt.scale, qt.granularity, qt.shape).to(_F64)


def block_gemm_exact(a: QuantizedTensor, w: QuantizedTensor) -> torch.Tensor:
    """y = dequant(a) @ dequant(w)ᵀ in fp64, exact up to a final fp64 rounding (shape (M, N), float64).

    Exactness argument. Every FP8 value is an integer multiple of 2^-g (g = mantissa bits − min exponent: 9 for
    e4m3fn, 10 e4m3fnuz, 16 e5m2, 17 e5m2fnuz), so q_a·q_w = n_a·n_w·2^-(g_a+g_w) with integers |n| < 2^33. On a
    K-segment where both scales are constant, the partial sum P = Σ n_a·n_w is an integer: it is computed exactly
    by an fp64 matmul when max|n_a|·max|n_w|·len < 2^53 (every partial sum of integers below 2^53 is exact in any
    order — always the case for e4m3 × e4m3 up to 2^17-long segments), otherwise with 16-bit limbs (each limb
    product sum exact, ≤ 3 roundings to combine). Then P·2^-(g_a+g_w)·(s_a·s_w): s_a·s_w is exact in fp64
    (24 × 24 bits, no underflow for fp32 scales), the power of two is exact, the product with P rounds once. Only
    the sum over the nseg segments rounds further, so |y_computed − y| ≤ γ_{nseg+3}(2^-53)·Σ|a_k||w_k|
    (``fp64_gemm_agreement``): ~2^-29 times the error an fp32 accumulator may make.

    Non-finite operands (NaN/inf codes or scales) follow IEEE semantics: the affected rows/columns are taken from a
    plain fp64 matmul of the dequantized operands.
    """
    m, k, n = _check_operands(a, w)
    na, fa = _int_codes(a)
    nw, fw = _int_codes(w)
    grid = 2.0 ** -(_grid_exponent(a.fmt) + _grid_exponent(w.fmt))
    y = torch.zeros(m, n, dtype=_F64)
    for k0, k1 in _segments(k, a, w):
        p = _exact_int_matmul(na[:, k0:k1], nw[:, k0:k1])
        sa = _row_scales(a, m, k0)
        sw = _row_scales(w, n, k0)
        y = y + p * (torch.outer(sa, sw) * grid)
    bad_a = ~fa.all(dim=1) | ~torch.isfinite(expand_scale(a.scale, a.granularity, a.shape)).all(dim=1)
    bad_w = ~fw.all(dim=1) | ~torch.isfinite(expand_scale(w.scale, w.granularity, w.shape)).all(dim=1)
    if bool(bad_a.any() or bad_w.any()):
        plain = _dequant64(a) @ _dequant64(w).T
        mask = bad_a[:, None] | bad_w[None, :]
        y = torch.where(mask, plain, y)
    return y


def _torch_dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(f"out_dtype: expected float32, bfloat16, float16 or float64, got {dtype}")
        return str(dtype).replace("torch.", "")
    raise TypeError(f"out_dtype: expected a torch.dtype, got {type(dtype).__name__}")


def gemm_error_bound(a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype,
                     accum_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rigorous elementwise bound on |y_impl − y_exact| (fp64 (M, N)) for fp32-accumulating implementations.

    Covers ANY implementation that forms each product a_k·w_k with at most c = 3 roundings in ``accum_dtype``
    (dequantize-then-matmul: fl(q_a·s_a), fl(q_w·s_w), their product; per-block-scale kernels: exact code products,
    tile sum × s_a × s_w), accumulates the K terms in ``accum_dtype`` in any order/grouping, and rounds once to
    ``out_dtype``. Derivation (Higham γ_n, :func:`fp8rl.reference.bounds.gamma`):

        acc_err ≤ γ_{K+c}(u_acc)·Σ_k |a_k||w_k| + c·η_acc·Σ_k max(1,|q_a|)·max(1,|q_w|)·max(1,s_a)·max(1,s_w)
        total   ≤ acc_err + u_out·(|y_exact| + acc_err) + η_out/2        (no final term if out = accum dtype)

    η: smallest subnormal (gradual-underflow errors of the multiplications, carried through the remaining
    factors). The formula is :func:`fp8rl.reference.bounds.gemm_fp32_accum_bound` (tolerance ``gemm_fp32_accum``);
    this function computes its inputs from the operands. The bound is inf where the result can overflow ``out_dtype``.
    """
    out_name = _torch_dtype_name(out_dtype)
    acc_name = _torch_dtype_name(accum_dtype)
    m, k, n = _check_operands(a, w)
    y = block_gemm_exact(a, w)
    da = _dequant64(a).abs()
    dw = _dequant64(w).abs()
    sum_abs = da @ dw.T
    ua = a.values().to(_F64).abs().clamp(min=1) * expand_scale(a.scale, a.granularity, a.shape).to(_F64).clamp(min=1)
    uw = w.values().to(_F64).abs().clamp(min=1) * expand_scale(w.scale, w.granularity, w.shape).to(_F64).clamp(min=1)
    mass = ua @ uw.T
    return gemm_fp32_accum_bound(y.abs(), sum_abs, k, out_name, acc_name, mass)
