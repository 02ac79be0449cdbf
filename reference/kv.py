"""FP8 KV cache oracle: quantize-on-store, dequantize-on-load, FP8 attention, Q/K/V scale calibration.

Everything here is a small pure function on CPU tensors. Casts go through the bit-level encoder
:func:`fp8rl.reference.formats.encode_codes` (never torch's fp8 cast); arithmetic that an engine does in fp32 is
emulated exactly (an fp32 division or product is computed in fp64 and rounded once to fp32, which equals the
IEEE fp32 result because 53 ≥ 2·24 + 2); attention is computed in fp64.

Tensor layout ("BTHD"): K and V are ``[..., T, H, D]`` (tokens, KV heads, head dim; vLLM's ``key``/``value``
arguments of ``reshape_and_cache_flash`` are ``[T, H, D]``); Q for attention is ``[B, Tq, Hq, D]`` and the caches
``[B, Tk, Hkv, D]``.

Store formula (vLLM ``reshape_and_cache_flash`` / SGLang ``set_kv_buffer``, docs/engine-numerics.md §2.5, §3.3)::

    y    = x / s            (quant_op "div", vLLM CUDA: cvt_satfinite_rn(float(x) / k_scale))
         = x · fl32(1/s)    (quant_op "mul_recip", vLLM CPU and fp8_per_token_head: x · (1/s))
    code = RNE_fmt(clamp(y, −max, +max))            (clamp=True, or a saturating cast)
    load: x̂ = value(code) · s                        (exact in fp32 and fp64)

Scale layouts (:data:`LAYOUTS`): ``"tensor"`` one scale per tensor per layer (vLLM/SGLang default, scale shape
``()``), ``"head"`` one scale per KV head (shape ``(H,)``), ``"token_head"`` one scale per (token, head)
computed at store time, s = max(fl32(amax / max), floor) with floor 1e-6 (vLLM ``fp8_per_token_head``,
shape ``x.shape[:-1]``).

Calibration strategies (docs/paper-numbers.md §2.3, :data:`STRATEGIES`), inputs are captured post-RoPE (post-QK-norm) Q/K/V:

* (A) ``"engine_first_batch"``: vLLM ``calc_kv_scales`` on the first batch after a reset:
  s_q = fl32(max|q| / 200), s_k = fl32(max|k| / 200), s_v = fl32(max|v| / 100).
* (B) ``"trainer_p999"``: NeMo-RL ``calibrate_qkv_fp8_scales``: per rank, the nearest-rank 99.9th percentile of
  the per-micro-batch amaxes (index round((p/100)·(n−1)) into the sorted list, Python ``round``), the max over
  ranks, then s = fl32(fl64(fl64(amax_p · 1.05) / 448)).
* (C) ``"amax"``: s = fl32(amax / 448) over all captured data (per tensor, or per KV head for layout ``"head"``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import torch
from fp8rl.reference.formats import OverflowPolicy, decode_codes, encode_codes, get_format

#: KV-cache element formats the oracle covers (fnuz variants are ROCm-only and not used by the RL stacks)
KV_FORMATS: tuple[str, ...] = ("e4m3fn", "e5m2")
#: scale layouts: per tensor per layer, per KV head, per (token, KV head)
LAYOUTS: tuple[str, ...] = ("tensor", "head", "token_head")
#: how the store applies the scale: true division, or multiplication by the fp32-rounded reciprocal
QUANT_OPS: tuple[str, ...] = ("div", "mul_recip")
#: vLLM's historical Q/K/V divisors of ``calculate_kv_scales`` (env Q_SCALE_CONSTANT, K_…, V_…)
VLLM_SCALE_CONSTANTS: tuple[float, float, float] = (200.0, 200.0, 100.0)
#: NeMo-RL trainer-side calibration parameters
NEMO_PERCENTILE = 99.9
NEMO_MARGIN = 1.05
#: vLLM fp8_per_token_head scale floor
TOKEN_HEAD_FLOOR = 1e-6
#: strategy names (long name → letter of paper Figure 6 / the issue)
STRATEGIES: dict[str, str] = {"engine_first_batch": "A", "trainer_p999": "B", "amax": "C"}
_STRATEGY_ALIASES = {"A": "engine_first_batch", "B": "trainer_p999", "C": "amax"}


@functools.cache
def fmt_max(fmt: str) -> float:
    """Largest finite value of an element format (cached)."""
    return get_format(fmt).max_finite


class MissingKVScales(ValueError):
    """An FP8 KV layer was used before any scales were set or calibrated (the silent 1.0 default is refused)."""


# ----------------------------------------------------------------------------------------------------------------
# declared numerics


@dataclass(frozen=True)
class KVPolicy:
    """The numerics an engine declares for its FP8 KV cache (so that a check compares like with like).

    Fields (``python -m fp8rl.docs_gen`` makes the field tables of docs/ from this list):

    * ``fmt``: cache element format, ``"e4m3fn"`` or ``"e5m2"`` (:data:`KV_FORMATS`).
    * ``layout``: scale layout (:data:`LAYOUTS`): ``"tensor"`` one scale per tensor per layer (shape ()),
      ``"head"`` one per KV head (shape (H,)), ``"token_head"`` one per (token, head), computed at store time.
    * ``quant_op``: how the store applies the scale: ``"div"`` q = x/s, or ``"mul_recip"`` q = x·fl32(1/s).
    * ``clamp``: clamp x/s to ±max of ``fmt`` before the cast.
    * ``overflow``: what the cast does with values beyond ±max (``"saturate"``, ``"nan"``, ``"inf"``, as ``fmt``
      allows; irrelevant when ``clamp``).
    * ``token_head_floor``: the scale floor of layout ``"token_head"``: s = max(fl32(amax_D / max), floor); finite
      and > 0 (vLLM ``fp8_per_token_head``: 1e-6).
    * ``quantize_q``: FP8 attention quantizes Q per tensor with ``q_scale`` (FA3-style); False: Q stays unquantized
      and the checks pass no ``q_scale``.
    * ``q_fmt``: the element format Q is quantized to when ``quantize_q`` (:data:`KV_FORMATS`).
    * ``q_quant_op``: how Q is quantized: ``"div"`` or ``"mul_recip"`` (vLLM QuantFP8 static: ``"mul_recip"``).
    """

    fmt: str = "e4m3fn"
    layout: str = "tensor"
    quant_op: str = "div"
    clamp: bool = True
    overflow: OverflowPolicy = "saturate"
    token_head_floor: float = TOKEN_HEAD_FLOOR
    quantize_q: bool = True
    q_fmt: str = "e4m3fn"
    q_quant_op: str = "mul_recip"

    def __post_init__(self) -> None:
        _check_choice("fmt", self.fmt, KV_FORMATS)
        _check_choice("q_fmt", self.q_fmt, KV_FORMATS)
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("quant_op", self.quant_op, QUANT_OPS)
        _check_choice("q_quant_op", self.q_quant_op, QUANT_OPS)
        allowed = get_format(self.fmt).allowed_overflow()
        if self.overflow not in allowed:
            raise ValueError(f"overflow: expected one of {allowed} for {self.fmt}, got {self.overflow!r}")
        if not (self.token_head_floor > 0 and math.isfinite(self.token_head_floor)):
            raise ValueError(f"token_head_floor: expected a finite positive number, got {self.token_head_floor!r}")

    @property
    def fmax(self) -> float:
        return fmt_max(self.fmt)

    @property
    def saturates(self) -> bool:
        """True when finite inputs can never produce a NaN/inf code."""
        return self.clamp or self.overflow == "saturate"


def default_policy(fmt: str = "e4m3fn", layout: str = "tensor") -> KVPolicy:
    """The oracle's default numerics: vLLM CUDA for static layouts (x/s, saturating), vLLM fp8_per_token_head
    (x·(1/s), clamp) for ``token_head``; Q quantized with x·(1/s) (vLLM QuantFP8)."""
    return KVPolicy(fmt=fmt, layout=layout, quant_op="mul_recip" if layout == "token_head" else "div")


@dataclass(frozen=True)
class KVCache:
    """FP8 cache contents, what ``kv_store`` returns and ``kv_attention`` reads.

    Fields (``python -m fp8rl.docs_gen`` makes the field tables of docs/ from this list):

    * ``codes``: uint8 FP8 codes of the stored tensor, its shape ([..., T, H, D]); code × scale is the stored value.
    * ``scale``: fp32 dequant scale of the layout's shape: () for ``"tensor"``, (H,) for ``"head"``,
      ``codes.shape[:-1]`` for ``"token_head"``.
    * ``fmt``: the codes' element format, ``"e4m3fn"`` or ``"e5m2"``.
    * ``layout``: the scale layout, ``"tensor"``, ``"head"`` or ``"token_head"``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str
    layout: str

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return dequantize_kv(self, dtype)


@dataclass(frozen=True)
class KVScales:
    """Per-layer Q/K/V dequant scales (fp32). ``q`` is a scalar; ``k``/``v`` are scalars or ``(H,)`` per head."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @staticmethod
    def of(q: Any, k: Any, v: Any) -> KVScales:
        return KVScales(_f32_scale(q, "q"), _f32_scale(k, "k"), _f32_scale(v, "v"))

    @property
    def layout(self) -> str:
        return "tensor" if self.k.dim() == 0 else "head"

    def as_dict(self) -> dict[str, Any]:
        return {n: (t.item() if t.dim() == 0 else t.tolist()) for n, t in (("q", self.q), ("k", self.k), ("v", self.v))}

    def equals(self, other: KVScales) -> bool:
        """Bit-exact equality (shapes and fp32 values)."""
        return all(a.shape == b.shape and bool(torch.equal(a.float(), b.float()))
                   for a, b in ((self.q, other.q), (self.k, other.k), (self.v, other.v)))


@dataclass(frozen=True)
class KVForward:
    """What an engine's model-level KV path returns for one layer call: the attention output, the caches it
    wrote, and the scales it used."""

    out: torch.Tensor
    k_cache: KVCache
    v_cache: KVCache
    scales: KVScales


# ----------------------------------------------------------------------------------------------------------------
# validation helpers


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def _f32_scale(s: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(s)
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{name}: expected a float scale, got dtype {t.dtype}")
    if t.dim() > 1:
        raise ValueError(f"{name}: expected a scalar or a 1-D per-head scale, got shape {tuple(t.shape)}")
    return t.detach().to("cpu", torch.float32).clone()


def _float_tensor(x: Any, name: str, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dims ([..., T, H, D]), got shape {tuple(x.shape)}")
    return x.detach().cpu()


def to_f32(x: torch.Tensor) -> torch.Tensor:
    """The fp32 value an engine stores for an input (bf16/fp16 exact; fp64 rounded to nearest)."""
    return x.detach().to("cpu", torch.float32)


def scale_shape(x_shape: Sequence[int], layout: str) -> tuple[int, ...]:
    """Shape of the scale tensor for a ``[..., T, H, D]`` tensor: () | (H,) | (..., T, H)."""
    _check_choice("layout", layout, LAYOUTS)
    if len(x_shape) < 3:
        raise ValueError(f"x: expected shape [..., T, H, D], got {tuple(x_shape)}")
    if layout == "tensor":
        return ()
    if layout == "head":
        return (int(x_shape[-2]),)
    return tuple(int(n) for n in x_shape[:-1])


def expand_scale(scale: torch.Tensor, layout: str, x_shape: Sequence[int]) -> torch.Tensor:
    """Broadcast a layout-shaped scale to the element shape ``[..., T, H, D]`` (a view)."""
    want = scale_shape(x_shape, layout)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale: layout {layout!r} on x of shape {tuple(x_shape)} needs shape {want}, "
                         f"got {tuple(scale.shape)}")
    if layout == "tensor":
        return scale.reshape([1] * len(x_shape)).expand(*x_shape)
    if layout == "head":
        return scale.reshape(*([1] * (len(x_shape) - 2)), -1, 1).expand(*x_shape)
    return scale.unsqueeze(-1).expand(*x_shape)


# ----------------------------------------------------------------------------------------------------------------
# store / load


def fp32_scaled(x32: torch.Tensor, s32: torch.Tensor, quant_op: str) -> torch.Tensor:
    """The fp32 value y an engine casts: fl32(x / s) ("div") or fl32(x · fl32(1 / s)) ("mul_recip").

    Emulated exactly: fp64 division/product of fp32 operands rounded once to fp32 is the IEEE fp32 result (the
    quotient is correctly rounded through fp64 because 53 ≥ 2·24 + 2; the product of two 24-bit significands is
    exact in fp64). Overflow gives ±inf, s = 0 gives ±inf/NaN, as in fp32 hardware.
    """
    _check_choice("quant_op", quant_op, QUANT_OPS)
    xd, sd = x32.double(), s32.double()
    if quant_op == "div":
        return (xd / sd).float()
    recip = (1.0 / sd).float().double()
    return (xd * recip).float()


def token_head_scales(x: torch.Tensor, fmt: str = "e4m3fn", floor: float = TOKEN_HEAD_FLOOR) -> torch.Tensor:
    """Per-(token, head) dequant scales of layout ``token_head``: s = max(fl32(amax_D(|x|) / max), fl32(floor)).

    (vLLM ``fp8_per_token_head``: ``scale = max(amax / fp8_max, 1e-6)`` in fp32.) Shape ``x.shape[:-1]``.
    """
    x32 = to_f32(_float_tensor(x, "x", 3))
    fmax = fmt_max(fmt)
    amax = x32.abs().amax(dim=-1)
    s = (amax.double() / fmax).float()
    return torch.maximum(s, torch.tensor(floor, dtype=torch.float32))


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float | None, policy: KVPolicy) -> KVCache:
    """Quantize-on-store: ``code = RNE_fmt(clamp(op(x, s), ±max))`` per element (see the module docstring).

    ``x``: ``[..., T, H, D]`` float tensor (rounded to fp32 first, as an engine's fp32 kernel does). ``scale``:
    the layout's dequant scale (shape () for "tensor", (H,) for "head"); must be None for "token_head", whose
    scales are computed here (:func:`token_head_scales`). NaN inputs store the format's NaN; with a saturating
    policy ±inf and out-of-range values store ±max.
    """
    x = _float_tensor(x, "x", 3)
    x32 = to_f32(x)
    if policy.layout == "token_head":
        if scale is not None:
            raise ValueError("scale: layout 'token_head' computes its scales at store time; pass scale=None")
        s = token_head_scales(x32, policy.fmt, policy.token_head_floor)
    else:
        if scale is None:
            raise ValueError(f"scale: layout {policy.layout!r} needs a scale (shape "
                             f"{scale_shape(x.shape, policy.layout)}), got None")
        s = _f32_scale(scale, "scale")
    full = expand_scale(s, policy.layout, tuple(x.shape))
    y = fp32_scaled(x32, full, policy.quant_op)
    if policy.clamp:
        y = y.clamp(-policy.fmax, policy.fmax)  # NaN stays NaN
    codes = torch.from_numpy(encode_codes(y.contiguous(), policy.fmt, policy.overflow)).reshape(x.shape)
    return KVCache(codes, s, policy.fmt, policy.layout)


def dequantize_kv(cache: KVCache, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dequantize-on-load: x̂ = value(code) · s (exact in fp64; exact in fp32 unless it over/underflows fp32)."""
    vals = torch.from_numpy(decode_codes(cache.codes, cache.fmt))
    full = expand_scale(cache.scale, cache.layout, tuple(cache.codes.shape))
    return (vals * full.double()).to(dtype)


def quantize_q(q: torch.Tensor, q_scale: torch.Tensor | float, fmt: str = "e4m3fn",
               quant_op: str = "mul_recip") -> torch.Tensor:
    """FP8 Q of FP8 attention (per-tensor ``q_scale``, clamp, RNE): returns the dequantized Q̂ in fp64."""
    s = _f32_scale(q_scale, "q_scale")
    if s.dim() != 0:
        raise ValueError(f"q_scale: expected a per-tensor scalar, got shape {tuple(s.shape)}")
    q32 = to_f32(_float_tensor(q, "q", 1))
    y = fp32_scaled(q32, s, quant_op).clamp(-fmt_max(fmt), fmt_max(fmt))
    codes = encode_codes(y.contiguous(), fmt, "saturate")
    return torch.from_numpy(decode_codes(codes, fmt)).reshape(q.shape) * float(s)


def clip_threshold(fmt: str) -> float:
    """|y| above which a saturating store clips beyond ordinary rounding: max + ½ ulp(max) (464 for e4m3fn,
    61440 for e5m2). Values in (max, threshold] round to ±max anyway."""
    f = get_format(fmt)
    top = math.floor(math.log2(fmt_max(fmt)))
    return fmt_max(fmt) + 2.0 ** (top - f.man_bits - 1)


def saturation_fraction(x: torch.Tensor, scale: torch.Tensor | float, layout: str = "tensor",
                        fmt: str = "e4m3fn") -> float:
    """Fraction of elements a saturating store clips: |fl32(x / s)| > :func:`clip_threshold` (NaN not counted)."""
    x32 = to_f32(_float_tensor(x, "x", 1))
    s = _f32_scale(scale, "scale")
    full = s if layout == "tensor" else expand_scale(s, layout, tuple(x32.shape))
    y = fp32_scaled(x32, full, "div")
    if y.numel() == 0:
        return 0.0
    return float((y.abs() > clip_threshold(fmt)).double().mean())


def half_ulp_bound(x: torch.Tensor, scale_full: torch.Tensor, fmt: str) -> torch.Tensor:
    """Elementwise bound on |x̂ − x| for an in-range RNE store: max(2^-(m+1)·|x|, 2^(emin−m−1)·s) (fp64)."""
    f = get_format(fmt)
    rel = 2.0 ** -(f.man_bits + 1)
    sub = f.min_subnormal / 2.0
    return torch.maximum(rel * x.double().abs(), sub * scale_full.double())


# ----------------------------------------------------------------------------------------------------------------
# attention


def _lengths(lengths: Any, batch: int, limit: int, name: str) -> torch.Tensor:
    if lengths is None:
        return torch.full((batch,), limit, dtype=torch.int64)
    t = torch.as_tensor(lengths)
    if t.is_floating_point() or t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name}: expected {batch} integer lengths, got {t.dtype} of shape {tuple(t.shape)}")
    t = t.to(torch.int64)
    if bool((t < 0).any()) or bool((t > limit).any()):
        raise ValueError(f"{name}: lengths must lie in [0, {limit}], got {t.tolist()}")
    return t


def attention_masks(batch: int, tq: int, tk: int, *, causal: bool, q_lengths: Any = None,
                    kv_lengths: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(allowed [B, Tq, Tk], query-valid [B, Tq], key-valid [B, Tk]) boolean masks.

    Query row i of batch b is valid iff i < q_len[b]; key j iff j < kv_len[b]. Causal masking is bottom-right
    aligned (the queries are the last q_len of kv_len positions, as in decode/chunked prefill): query i sees key
    j iff j ≤ i + kv_len − q_len. A valid query must see at least one key, so causal needs q_len ≤ kv_len.
    """
    ql = _lengths(q_lengths, batch, tq, "q_lengths")
    kl = _lengths(kv_lengths, batch, tk, "kv_lengths")
    qv = torch.arange(tq).unsqueeze(0) < ql.unsqueeze(1)
    kv = torch.arange(tk).unsqueeze(0) < kl.unsqueeze(1)
    allowed = qv.unsqueeze(2) & kv.unsqueeze(1)
    if causal:
        if bool(((ql > kl) & (ql > 0)).any()):
            raise ValueError(f"q_lengths: causal attention needs q_len ≤ kv_len, got q {ql.tolist()} kv {kl.tolist()}")
        offset = (kl - ql).reshape(batch, 1, 1)
        i = torch.arange(tq).reshape(1, tq, 1)
        j = torch.arange(tk).reshape(1, 1, tk)
        allowed &= j <= i + offset
    else:
        if bool(((kl == 0) & (ql > 0)).any()):
            raise ValueError(f"kv_lengths: a batch with queries has no keys: kv {kl.tolist()}")
    return allowed, qv, kv


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected [B, T, H, D] tensors, got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, tq, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: batch/head_dim of shape {tuple(k.shape)} do not match q's {tuple(q.shape)}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: n_q_heads ({hq}) must be a multiple of n_kv_heads ({hkv}) (GQA)")
    return b, tq, hq, d, int(k.shape[1]), hkv


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ..., q_lengths: Any = ...,
              kv_lengths: Any = ..., sm_scale: float | None = ..., return_probs: Literal[False] = ...) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ..., q_lengths: Any = ...,
              kv_lengths: Any = ..., sm_scale: float | None = ...,
              return_probs: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ..., q_lengths: Any = ...,
              kv_lengths: Any = ..., sm_scale: float | None = ...,
              return_probs: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, q_lengths: Any = None,
              kv_lengths: Any = None, sm_scale: float | None = None,
              return_probs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp64 (the unquantized reference, and the core of :func:`fp8_attention`).

    o[b,i,h,:] = Σ_j p[b,h,i,j] · v[b,j,g(h),:],  p = softmax_j(sm · q[b,i,h,:]·k[b,j,g(h),:]) over allowed j,
    with g(h) = h // (Hq / Hkv) (GQA), sm = 1/√D by default, the masks of :func:`attention_masks`. Rows of
    invalid queries are 0. Keys beyond kv_len are never read (their contents, even NaN, do not matter).
    Returns o [B, Tq, Hq, D] fp64 (and p [B, Hq, Tq, Tk] when ``return_probs``).
    """
    q = _float_tensor(q, "q")
    k = _float_tensor(k, "k")
    v = _float_tensor(v, "v")
    b, tq, hq, d, tk, hkv = _check_qkv(q, k, v)
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    allowed, qvalid, kvalid = attention_masks(b, tq, tk, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
    kmask = kvalid.reshape(b, tk, 1, 1)
    qd = torch.where(qvalid.reshape(b, tq, 1, 1), q.double(), 0.0)
    kd = torch.where(kmask, k.double(), 0.0).repeat_interleave(hq // hkv, dim=2)
    vd = torch.where(kmask, v.double(), 0.0).repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd) * sm
    am = allowed.unsqueeze(1)
    scores = scores.masked_fill(~am, -math.inf)
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m).masked_fill(~am, 0.0)
    denom = e.sum(dim=-1, keepdim=True)
    p = torch.where(denom > 0, e / torch.where(denom > 0, denom, 1.0), torch.zeros_like(e))
    out = torch.einsum("bhij,bjhd->bihd", p, vd)
    out = torch.where(qvalid.reshape(b, tq, 1, 1), out, 0.0)
    return (out, p) if return_probs else out


@overload
def fp8_attention(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, *, q_scale: torch.Tensor | float | None = ...,
                  q_fmt: str = ..., q_quant_op: str = ..., causal: bool = ..., q_lengths: Any = ...,
                  kv_lengths: Any = ..., sm_scale: float | None = ...,
                  return_probs: Literal[False] = ...) -> torch.Tensor: ...
@overload
def fp8_attention(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, *, q_scale: torch.Tensor | float | None = ...,
                  q_fmt: str = ..., q_quant_op: str = ..., causal: bool = ..., q_lengths: Any = ...,
                  kv_lengths: Any = ..., sm_scale: float | None = ...,
                  return_probs: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def fp8_attention(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, *, q_scale: torch.Tensor | float | None = ...,
                  q_fmt: str = ..., q_quant_op: str = ..., causal: bool = ..., q_lengths: Any = ...,
                  kv_lengths: Any = ..., sm_scale: float | None = ...,
                  return_probs: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def fp8_attention(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, *, q_scale: torch.Tensor | float | None = None,
                  q_fmt: str = "e4m3fn", q_quant_op: str = "mul_recip", causal: bool = True, q_lengths: Any = None,
                  kv_lengths: Any = None, sm_scale: float | None = None,
                  return_probs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention oracle: K̂, V̂ dequantized from the caches, Q̂ = quantize_q(q, q_scale) when ``q_scale`` is
    given (else Q in fp32), then :func:`attention` in fp64. Output [B, Tq, Hq, D] fp64."""
    qd = to_f32(_float_tensor(q, "q")).double() if q_scale is None else quantize_q(q, q_scale, q_fmt, q_quant_op)
    return attention(qd, dequantize_kv(k_cache), dequantize_kv(v_cache), causal=causal, q_lengths=q_lengths,
                     kv_lengths=kv_lengths, sm_scale=sm_scale, return_probs=return_probs)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖_F / ‖ref‖_F in fp64 (0 when both are 0; inf when only ref is 0 or got has NaN)."""
    g, r = got.double(), ref.double()
    num = float(torch.linalg.vector_norm(g - r))
    den = float(torch.linalg.vector_norm(r))
    if math.isnan(num):
        return math.inf
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


@dataclass(frozen=True)
class AttentionBoundTerms:
    """Magnitudes the attention bounds in :mod:`fp8rl.tolerances` are built from (all fp64, from the oracle)."""

    score_abs_max: torch.Tensor  # [B, Hq, Tq]: max over allowed j of sm·Σ_d |q_id||k_jd|
    score_span: torch.Tensor  # [B, Hq, Tq]: max_j s_ij − min_j s_ij over allowed j
    weighted_abs_v: torch.Tensor  # [B, Tq, Hq, D]: Σ_j p_ij |v_jd|
    head_dim: int
    n_keys: int


def attention_bound_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                          q_lengths: Any = None, kv_lengths: Any = None,
                          sm_scale: float | None = None) -> AttentionBoundTerms:
    """The data-dependent terms of :func:`fp8rl.tolerances.kv_attention_arith_bound` for operands q, k, v (the
    dequantized FP8 operands when bounding an engine's FP8 attention against :func:`fp8_attention`)."""
    b, tq, hq, d, tk, hkv = _check_qkv(q, k, v)
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    allowed, qvalid, kvalid = attention_masks(b, tq, tk, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
    kmask = kvalid.reshape(b, tk, 1, 1)
    qd = torch.where(qvalid.reshape(b, tq, 1, 1), q.double(), 0.0)
    kd = torch.where(kmask, k.double(), 0.0).repeat_interleave(hq // hkv, dim=2)
    vd = torch.where(kmask, v.double(), 0.0)
    am = allowed.unsqueeze(1)
    abs_scores = torch.einsum("bihd,bjhd->bhij", qd.abs(), kd.abs()) * sm
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd) * sm
    score_abs_max = abs_scores.masked_fill(~am, 0.0).amax(dim=-1)
    hi = scores.masked_fill(~am, -math.inf).amax(dim=-1)
    lo = scores.masked_fill(~am, math.inf).amin(dim=-1)
    span = torch.where(torch.isfinite(hi - lo), hi - lo, torch.zeros_like(hi))
    _, p = attention(q, k, v, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths, sm_scale=sm,
                     return_probs=True)
    wav = torch.einsum("bhij,bjhd->bihd", p, vd.abs().repeat_interleave(hq // hkv, dim=2))
    return AttentionBoundTerms(score_abs_max, span, wav, int(d), int(tk))


def quantization_bound_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dq: torch.Tensor,
                             dk: torch.Tensor, dv: torch.Tensor, causal: bool = True, q_lengths: Any = None,
                             kv_lengths: Any = None, sm_scale: float | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Terms of :func:`fp8rl.tolerances.kv_attention_quant_bound` for unquantized q, k, v and elementwise bounds
    dq, dk, dv on their quantization errors (:func:`half_ulp_bound`): returns

    * eps [B, Hq, Tq]: max over allowed j of sm·Σ_d (dq_d·|k_jd| + (|q_d| + dq_d)·dk_jd)  (|Δscore| bound),
    * pv [B, Tq, Hq, D]: Σ_j p_j |v_jd|,  * pdv [B, Tq, Hq, D]: Σ_j p_j dv_jd  (p: exact unquantized probabilities).
    """
    b, tq, hq, d, tk, hkv = _check_qkv(q, k, v)
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    allowed, qvalid, kvalid = attention_masks(b, tq, tk, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths)
    g = hq // hkv
    qm = qvalid.reshape(b, tq, 1, 1)
    km = kvalid.reshape(b, tk, 1, 1)
    qa = torch.where(qm, q.double().abs(), 0.0)
    dqa = torch.where(qm, dq.double(), 0.0)
    ka = torch.where(km, k.double().abs(), 0.0).repeat_interleave(g, dim=2)
    dka = torch.where(km, dk.double(), 0.0).repeat_interleave(g, dim=2)
    eps = (torch.einsum("bihd,bjhd->bhij", dqa, ka) + torch.einsum("bihd,bjhd->bhij", qa + dqa, dka)) * sm
    eps = eps.masked_fill(~allowed.unsqueeze(1), 0.0).amax(dim=-1)
    _, p = attention(q, k, v, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths, sm_scale=sm,
                     return_probs=True)
    va = torch.where(km, v.double().abs(), 0.0).repeat_interleave(g, dim=2)
    dva = torch.where(km, dv.double(), 0.0).repeat_interleave(g, dim=2)
    return eps, torch.einsum("bhij,bjhd->bihd", p, va), torch.einsum("bhij,bjhd->bihd", p, dva)


# ----------------------------------------------------------------------------------------------------------------
# calibration strategies

Capture = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _amax(t: torch.Tensor, name: str) -> torch.Tensor:
    """max|t| in fp32 (exact; NaN propagates)."""
    return to_f32(_float_tensor(t, name)).abs().amax() if t.numel() else torch.tensor(0.0)


def _head_amax(t: torch.Tensor, name: str) -> torch.Tensor:
    x = to_f32(_float_tensor(t, name, 3))
    return x.abs().amax(dim=tuple(i for i in range(x.dim()) if i != x.dim() - 2))


def _check_captures(captures: Any) -> list[list[Capture]]:
    if not isinstance(captures, Sequence) or not captures:
        raise ValueError("captures: expected a non-empty sequence (ranks) of sequences (micro-batches) of (q, k, v)")
    out = []
    for r, rank in enumerate(captures):
        if not isinstance(rank, Sequence) or not rank:
            raise ValueError(f"captures: rank {r} must be a non-empty sequence of (q, k, v) micro-batches")
        row = []
        for m, mb in enumerate(rank):
            if not isinstance(mb, tuple | list) or len(mb) != 3:
                raise ValueError(f"captures: rank {r} micro-batch {m} must be a (q, k, v) tuple")
            row.append((mb[0], mb[1], mb[2]))
        out.append(row)
    return out


def calibrate_engine_first_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 constants: tuple[float, float, float] = VLLM_SCALE_CONSTANTS) -> KVScales:
    """(A) Engine-side first-batch calibration (vLLM ``calc_kv_scales``, used by verl after every weight sync):

    s_q = fl32(max|q| / C_q), s_k = fl32(max|k| / C_k), s_v = fl32(max|v| / C_v), C = (200, 200, 100) by default
    (fp32 tensor division). No floor: an all-zero batch gives scale 0, as in vLLM.
    """
    cq, ck, cv = (float(c) for c in constants)
    if not all(c > 0 and math.isfinite(c) for c in (cq, ck, cv)):
        raise ValueError(f"constants: expected three finite positive divisors, got {constants!r}")

    def s(t: torch.Tensor, name: str, c: float) -> torch.Tensor:
        return (_amax(t, name).double() / float(np.float32(c))).float()

    return KVScales(s(q, "q", cq), s(k, "k", ck), s(v, "v", cv))


def nearest_rank_percentile(values: Sequence[float], percentile: float) -> float:
    """NeMo-RL's percentile: sorted(values)[clamp(round(p/100 · (n−1)), 0, n−1)] (Python banker's ``round``);
    0.0 for an empty list."""
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile: expected a value in [0, 100], got {percentile!r}")
    if not values:
        return 0.0
    vals = sorted(float(v) for v in values)
    rank = max(0, min(len(vals) - 1, int(round((percentile / 100.0) * (len(vals) - 1)))))
    return vals[rank]


def calibrate_trainer_percentile(captures: Sequence[Sequence[Capture]], percentile: float = NEMO_PERCENTILE,
                                 margin: float = NEMO_MARGIN,
                                 fp8_max: tuple[float, float, float] = (448.0, 448.0, 448.0)) -> KVScales:
    """(B) Trainer-side calibration (NeMo-RL ``calibrate_qkv_fp8_scales``) over ``captures[rank][micro_batch]``:

    amax_mb = max|x| per micro-batch (fp32 → Python float); per rank a_r = nearest_rank_percentile(amax_mb, p);
    a = max_r a_r; s = fl32(fl64(fl64(a · margin) / fp8_max)) for each of q, k, v.
    """
    caps = _check_captures(captures)
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"margin: expected a finite positive factor, got {margin!r}")
    if len(fp8_max) != 3 or not all(m > 0 for m in fp8_max):
        raise ValueError(f"fp8_max: expected three positive maxima (q, k, v), got {fp8_max!r}")
    out = []
    for i, name in enumerate(("q", "k", "v")):
        per_rank = [nearest_rank_percentile([float(_amax(mb[i], name)) for mb in rank], percentile) for rank in caps]
        a = max(per_rank)
        out.append(torch.tensor((a * float(margin)) / float(fp8_max[i]), dtype=torch.float64).float())
    return KVScales(out[0], out[1], out[2])


def calibrate_amax(captures: Sequence[Sequence[Capture]], fp8_max: float = 448.0, layout: str = "tensor",
                   q_fp8_max: float | None = None) -> KVScales:
    """(C) Plain amax calibration over every captured micro-batch of every rank: s = fl32(amax / fp8_max)
    (Q divided by ``q_fp8_max``, default ``fp8_max``).

    ``layout="head"`` gives per-KV-head K and V scales (amax over all but the head axis; q stays per tensor).
    """
    caps = _check_captures(captures)
    _check_choice("layout", layout, ("tensor", "head"))
    if not (fp8_max > 0 and math.isfinite(fp8_max)):
        raise ValueError(f"fp8_max: expected a finite positive number, got {fp8_max!r}")
    qmax = fp8_max if q_fp8_max is None else float(q_fp8_max)
    flat = [mb for rank in caps for mb in rank]

    def red(i: int, name: str, per_head: bool, m: float) -> torch.Tensor:
        if per_head:
            a = torch.stack([_head_amax(mb[i], name) for mb in flat]).amax(dim=0)
        else:
            a = torch.stack([_amax(mb[i], name) for mb in flat]).amax()
        return (a.double() / m).float()

    return KVScales(red(0, "q", False, qmax), red(1, "k", layout == "head", fp8_max),
                    red(2, "v", layout == "head", fp8_max))


def calibrate(captures: Sequence[Sequence[Capture]], strategy: str, *, layout: str = "tensor",
              fmt: str = "e4m3fn", q_fmt: str = "e4m3fn") -> KVScales:
    """Dispatch on a strategy name (``engine_first_batch``/A, ``trainer_p999``/B, ``amax``/C).

    A uses only ``captures[0][0]`` (the first batch the engine sees); B and C use everything. A and B produce
    per-tensor scales (layout "tensor" only); C supports "head". B and C divide K and V by the cache format's
    max (448 for e4m3fn, 57344 for e5m2) and Q by ``q_fmt``'s max (Q is quantized to e4m3fn by FP8 attention).
    """
    name = _STRATEGY_ALIASES.get(strategy, strategy)
    _check_choice("strategy", name, tuple(STRATEGIES))
    caps = _check_captures(captures)
    fmax = fmt_max(fmt)
    qmax = fmt_max(q_fmt)
    if name != "amax" and layout != "tensor":
        raise ValueError(f"layout: strategy {name!r} produces per-tensor scales only, got layout {layout!r}")
    if name == "engine_first_batch":
        q, k, v = caps[0][0]
        return calibrate_engine_first_batch(q, k, v)
    if name == "trainer_p999":
        return calibrate_trainer_percentile(caps, fp8_max=(qmax, fmax, fmax))
    return calibrate_amax(caps, fmax, layout, q_fp8_max=qmax)


def strategy_name(strategy: str) -> str:
    """Canonical long name of a strategy given its long name or letter."""
    name = _STRATEGY_ALIASES.get(strategy, strategy)
    _check_choice("strategy", name, tuple(STRATEGIES))
    return name


__all__ = [
    "KV_FORMATS", "LAYOUTS", "QUANT_OPS", "STRATEGIES", "VLLM_SCALE_CONSTANTS", "AttentionBoundTerms", "KVCache",
    "KVForward", "KVPolicy", "KVScales", "MissingKVScales", "attention", "attention_bound_terms", "attention_masks",
    "calibrate", "calibrate_amax", "calibrate_engine_first_batch", "calibrate_trainer_percentile",
    "default_policy", "dequantize_kv", "expand_scale", "fp8_attention", "fp32_scaled", "half_ulp_bound",
    "nearest_rank_percentile", "quantization_bound_terms", "quantize_kv", "quantize_q", "relative_error",
    "saturation_fraction", "scale_shape", "strategy_name", "to_f32", "token_head_scales",
]
