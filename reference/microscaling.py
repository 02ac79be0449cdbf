"""Microscaling formats: FP4 (E2M1), OCP MX block scaling (MXFP8, MXFP4) and NVFP4's two-level scales.

Pure functions, amax → scale → cast, each formula in its docstring; needs only torch and numpy (through
:mod:`fp8rl.reference.formats`), imports nothing from the harness.

**E2M1** (FP4, OCP MX v1.0 §5.3.3): 1 sign, 2 exponent (bias 1), 1 mantissa bit; no inf, no NaN. Magnitudes by code
0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6. A 4-bit code is ``s<<3 | e<<1 | m``. :func:`encode_e2m1` rounds to nearest,
ties to even, and saturates at ±6: with q the quantum of |x|'s binade on the E2M1 grid (0.5 below 2, 1 in [2, 4),
2 from 4), ``RNE(|x|/q)·q`` is exact in float64 (|x| is an fp32 number, q a power of two) and ``np.rint`` rounds
ties to even. NaN input raises (E2M1 has no NaN; the quantizers below never cast a NaN).

**Packed FP4** (:func:`pack_fp4`): two codes per byte, element 2i in the low nibble and 2i+1 in the high nibble
(torch ``float4_e2m1fn_x2``, compressed-tensors ``pack_fp4_to_uint8``, vLLM ``break_fp4_bytes``); an odd last
dimension is padded with a zero code.

**MX block scaling** (OCP Microscaling Formats v1.0, §6.3): 1×B blocks along the last dimension (B = 32), one
E8M0 scale X = 2^e per block, elements P = cast(x / X) with saturation to the element's max normal. The exponent
rule is the policy's ``exp_rounding`` (``e_max``: the exponent of the element's largest normal, 8 for e4m3fn, 15 for
e5m2, 2 for e2m1; T its max normal, 448, 57344, 6):

* ``"floor"`` (the OCP spec): e = floor(log2 amax) − e_max from the fp32 bits of amax (exact; subnormal amax too).
  amax/2^e ∈ [2^e_max, 2^(e_max+1)): values above T saturate (e4m3: up to 511.9 → 448).
* ``"ceil"``: r = fl(amax/T) (``ratio_op="div"``) or fl(amax·fl(1/T)) (``"mul_recip"``), e = exponent of r rounded
  up on its fp32 bits (e_r + (mantissa ≠ 0); a subnormal r: its binade, rounded up the same way). Nothing
  saturates, but a block may lose the top binade of the element grid.
* ``"ceil_log2"``: e = ceil(fl(log2(fl(amax/T)))) with torch's fp32 log2 and amax clamped to the fp32 tiny 2^-126
  first (vLLM ``_mxfp8_e4m3_quantize_torch``): fl(log2 r) rounds to the integer k for r a few ulps above 2^k, so e
  can be one below "ceil" and |x/X| can exceed T by < 2^-16 relative (then RNE gives T).
* ``"pow2_175"``: amax rounded to a power of two by adding 2^-2 to its significand and truncating (amax →
  2^(k+1) iff its significand is ≥ 1.75), e = log2 of that − e_max (compressed-tensors ``round_to_power_2`` +
  ``generate_mx_scales``). For e4m3 (T = 1.75·2^8) it equals "ceil" except at amax = 1.75·2^k exactly (one
  binade up); for e2m1 (T = 1.5·2^2) blocks with significand in [1.5, 1.75) exceed T and saturate (up to 7 → 6).

e is clamped to [−127, 127] (E8M0 codes 0..254); an all-zero block gets e = −127 (code 0) under every rule.
Elements: q = fl(x / 2^e) (fp32 division by a power of two), then the RNE cast with saturation.

**NVFP4** (two-level scaling): a per-tensor fp32 global encode scale g = fl(2688/amax_t) (``global_op="div"``) or
fl(fl(1/amax_t)·2688) (``"recip_mul"``: torch's ``python_float / tensor``, which is ``tensor.reciprocal() * float``;
compressed-tensors ``generate_gparam``), 2688 = 448·6, and 1 when amax_t = 0 or g is not finite; a per-16-element E4M3 block scale s = e4m3(min(fl(g·r6), 448)) with r6 = fl(amax_b/6)
(``scale_op="div6"``) or fl(amax_b·fl(1/6)) (``"mul_recip6"``), and E2M1 elements q = RNE(clamp(y, −6, 6)) with
y = fl(x / fl(s/g)) (``quant_op="div_decoded"``), fl(x·fl(1/fl(s·fl(1/g)))) (``"recip_decoded"``). A block whose
scale rounds to 0 gets zero element codes with x's sign (−0 for negative x: what compressed-tensors, whose scale
becomes its eps 0.125, and vLLM, whose reciprocal becomes 1e-8, both produce). Dequantized value: code · s / g.

Non-finite inputs are not modelled: :func:`mx_quantize` raises on NaN/inf (the OCP spec sets a block's scale to
NaN; implementations differ and the checks give finite inputs only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from fp8rl.reference.bounds import MAX_FINITE, MIN_SUBNORMAL, UNIT_ROUNDOFF, dtype_name, eval_slack, gamma
from fp8rl.reference.formats import decode_codes, encode_codes

__all__ = [
    "E2M1_MAX", "E2M1_VALUES", "ELEMENT_EMAX", "ELEMENT_MAX", "MX_GEMM_PRODUCT_ROUNDINGS", "MX_PRESETS", "MXPolicy",
    "MXTensor", "RECIPES", "decode_e2m1", "dequantize_mx", "e8m0_exponent", "encode_e2m1", "get_mx_policy",
    "mx_gemm_error_bound", "mx_gemm_exact", "mx_quantize", "nvfp4_global_scale", "pack_fp4", "unpack_fp4",
]

#: E2M1 magnitude of each 3-bit magnitude code
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
#: exponent of the largest normal (OCP MX emax_elem) and the max normal T of each element format
ELEMENT_EMAX: dict[str, int] = {"e4m3fn": 8, "e5m2": 15, "e2m1": 2}
ELEMENT_MAX: dict[str, float] = {"e4m3fn": 448.0, "e5m2": 57344.0, "e2m1": 6.0}
E4M3_MAX = 448.0

ExpRounding = Literal["floor", "ceil", "ceil_log2", "pow2_175"]


# ---------------------------------------------------------------------------------------------------------------
# E2M1 and packing


def _f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating-point tensor, got dtype {x.dtype}")
        return x.detach().to("cpu", torch.float32).numpy()
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"x: expected a floating-point array, got dtype {a.dtype}")
    return a.astype(np.float32)


def encode_e2m1(x) -> np.ndarray:
    """fp32 values → 4-bit E2M1 codes (uint8 0..15): round to nearest, ties to even, saturating at ±6.

    ``q = 0.5`` for |x| < 2, 1 for 2 ≤ |x| < 4, 2 from 4; magnitude = min(rint(|x|/q)·q, 6) — rint rounds ties to
    even, and an even multiple of q is the code with mantissa 0 (e.g. 0.25 → 0, 0.75 → 1, 2.5 → 2, 5 → 4). −0 and
    negative values that round to 0 keep the sign bit (code 8), as ml_dtypes and torch do. Raises on NaN.
    """
    a = _f32(x).astype(np.float64)
    if np.isnan(a).any():
        raise ValueError("x: E2M1 has no NaN encoding; got NaN input")
    mag = np.abs(a)
    q = np.where(mag < 2.0, 0.5, np.where(mag < 4.0, 1.0, 2.0))
    r = np.minimum(np.rint(mag / q) * q, E2M1_MAX)
    # magnitude → code: 0,0.5,1,1.5 → 0..3 (2r); 2,3 → 4,5 (r+2); 4 → 6, 6 → 7 (r/2+4)
    code = np.where(r < 2.0, 2.0 * r, np.where(r < 4.0, r + 2.0, r / 2.0 + 4.0)).astype(np.uint8)
    return (code | (np.signbit(a).astype(np.uint8) << 3)).astype(np.uint8)


def decode_e2m1(codes) -> np.ndarray:
    """4-bit E2M1 codes (uint8, high bits ignored) → float64 values."""
    c = np.asarray(codes.numpy() if isinstance(codes, torch.Tensor) else codes).astype(np.int64) & 0xF
    mag = np.asarray(E2M1_VALUES, dtype=np.float64)[c & 7]
    return np.where(c & 8, -mag, mag)


def pack_fp4(codes) -> torch.Tensor:
    """(…, K) 4-bit codes → (…, ceil(K/2)) uint8: byte i = codes[2i] | codes[2i+1] << 4 (odd K: a zero code pads)."""
    c = torch.as_tensor(codes).to(torch.uint8) & 0xF
    if c.dim() == 0:
        raise ValueError("codes: expected at least one dimension")
    if c.shape[-1] % 2:
        c = torch.cat([c, torch.zeros(*c.shape[:-1], 1, dtype=torch.uint8)], dim=-1)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """(…, ceil(K/2)) uint8 → (…, K) 4-bit codes (the inverse of :func:`pack_fp4`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected uint8 bytes, got {packed.dtype}")
    if packed.shape[-1] != (k + 1) // 2:
        raise ValueError(f"k: packed has {packed.shape[-1]} bytes per row, expected ceil({k}/2) = {(k + 1) // 2}")
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    return out[..., :k].contiguous()


# ---------------------------------------------------------------------------------------------------------------
# policies


@dataclass(frozen=True)
class MXPolicy:
    """Every numerical choice of a microscaling quantizer (formulas: the module docstring).

    Fields (``python -m fp8rl.docs_gen`` makes the field tables of docs/ from this list):

    * ``name``: the policy's name (a key of :data:`MX_PRESETS` for fp8rl's own).
    * ``elem``: element format, ``"e4m3fn"``, ``"e5m2"`` or ``"e2m1"`` (FP4).
    * ``block``: elements per scale along the last dimension (32 for MX, 16 for NVFP4).
    * ``scale_fmt``: ``"e8m0fnu"`` (MX: a power-of-two scale 2^e by the rule ``exp_rounding`` with ``ratio_op``) or
      ``"e4m3fn"`` (NVFP4: an E4M3 block scale under a per-tensor fp32 global scale, by ``scale_op``, ``quant_op``
      and ``global_op``; needs ``elem="e2m1"``).
    * ``exp_rounding``: the MX exponent rule: ``"floor"`` (OCP spec: e = floor(log2 amax) − e_max), ``"ceil"`` (the
      exponent of r = amax/T rounded up on its fp32 bits), ``"ceil_log2"`` (ceil of torch's fp32 log2 of r, vLLM),
      ``"pow2_175"`` (amax rounded to a power of two at significand 1.75, compressed-tensors).
    * ``ratio_op``: r = fl(amax/T) (``"div"``) or fl(amax·fl(1/T)) (``"mul_recip"``), for ``exp_rounding="ceil"``.
    * ``scale_op``: NVFP4 block scale from r6 = fl(amax_b/6) (``"div6"``) or fl(amax_b·fl(1/6)) (``"mul_recip6"``).
    * ``quant_op``: NVFP4 elements y = fl(x / fl(s/g)) (``"div_decoded"``) or fl(x·fl(1/fl(s·fl(1/g))))
      (``"recip_decoded"``).
    * ``global_op``: NVFP4 global scale g = fl(2688/amax_t) (``"div"``) or fl(fl(1/amax_t)·2688) (``"recip_mul"``).
    * ``provenance``: where the rule comes from (repo, path, function, version) and how it was verified; not
      compared.
    """

    name: str
    elem: str
    block: int
    scale_fmt: Literal["e8m0fnu", "e4m3fn"] = "e8m0fnu"
    exp_rounding: ExpRounding = "floor"
    ratio_op: Literal["div", "mul_recip"] = "div"
    scale_op: Literal["div6", "mul_recip6"] = "div6"
    quant_op: Literal["div_decoded", "recip_decoded"] = "div_decoded"
    global_op: Literal["div", "recip_mul"] = "div"
    provenance: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.elem not in ELEMENT_MAX:
            raise ValueError(f"elem: expected one of {sorted(ELEMENT_MAX)}, got {self.elem!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block <= 0:
            raise ValueError(f"block: expected a positive int, got {self.block!r}")
        if self.scale_fmt not in ("e8m0fnu", "e4m3fn"):
            raise ValueError(f"scale_fmt: expected 'e8m0fnu' or 'e4m3fn', got {self.scale_fmt!r}")
        if self.exp_rounding not in ("floor", "ceil", "ceil_log2", "pow2_175"):
            raise ValueError("exp_rounding: expected 'floor', 'ceil', 'ceil_log2' or 'pow2_175', got "
                             f"{self.exp_rounding!r}")
        if self.ratio_op not in ("div", "mul_recip"):
            raise ValueError(f"ratio_op: expected 'div' or 'mul_recip', got {self.ratio_op!r}")
        if self.scale_op not in ("div6", "mul_recip6"):
            raise ValueError(f"scale_op: expected 'div6' or 'mul_recip6', got {self.scale_op!r}")
        if self.global_op not in ("div", "recip_mul"):
            raise ValueError(f"global_op: expected 'div' or 'recip_mul', got {self.global_op!r}")
        if self.quant_op not in ("div_decoded", "recip_decoded"):
            raise ValueError(f"quant_op: expected 'div_decoded' or 'recip_decoded', got {self.quant_op!r}")
        if self.scale_fmt == "e4m3fn" and self.elem != "e2m1":
            raise ValueError(f"scale_fmt: E4M3 block scales (NVFP4) need elem='e2m1', got {self.elem!r}")

    @property
    def two_level(self) -> bool:
        """NVFP4: E4M3 block scales under a per-tensor fp32 global scale."""
        return self.scale_fmt == "e4m3fn"

    @property
    def packed(self) -> bool:
        """Elements stored two per byte (FP4)."""
        return self.elem == "e2m1"


_OCP = "OCP Microscaling Formats (MX) v1.0 spec §6.3 (opencompute.org, 2023-09): X = 2^(floor(log2 amax) − emax_elem)"
MX_PRESETS: dict[str, MXPolicy] = {p.name: p for p in (
    MXPolicy("ocp_mxfp8_e4m3", "e4m3fn", 32, exp_rounding="floor", provenance=_OCP + "; also torchao "
             "prototype/mx_formats ScaleCalculationMode.FLOOR (the default; read, not run: torchao is not installed "
             "here). Verified: hand-computed cases and peers ml_dtypes float8_e8m0fnu (tests/oracle)."),
    MXPolicy("ocp_mxfp8_e5m2", "e5m2", 32, exp_rounding="floor", provenance=_OCP + " (element e5m2, emax 15)."),
    MXPolicy("ocp_mxfp4", "e2m1", 32, exp_rounding="floor", provenance=_OCP + " (element e2m1, emax 2)."),
    MXPolicy("te_mxfp8", "e4m3fn", 32, exp_rounding="ceil", ratio_op="mul_recip",
             provenance="NVIDIA/TransformerEngine transformer_engine/common/util (float_to_e8m0: round the fp32 "
             "ratio up to a power of two; cast kernels pass amax · max_norm_rcp), docs/features/low_precision_"
             "training/mxfp8/mxfp8.rst ('exponent = float_to_e8m0(amax / max_norm)'), TE 2.x. Read, not run: the "
             "kernels are CUDA-only."),
    MXPolicy("vllm_mxfp8_torch", "e4m3fn", 32, exp_rounding="ceil_log2", ratio_op="div",
             provenance="vllm-project/vllm vllm/model_executor/layers/quantization/utils/mxfp8_utils.py "
             "_mxfp8_e4m3_quantize_torch (v0.32.0): ceil(log2(amax.clamp(min=tiny) / 448)) + 127, clamp [0, 254]. "
             "Read; run on CPU in .nox/conformance_vllm where available."),
    MXPolicy("ct_mxfp8", "e4m3fn", 32, exp_rounding="pow2_175",
             provenance="neuralmagic/compressed-tensors quantization/utils/mxfp_utils.py round_to_power_2 + "
             "generate_mx_scales (v0.17.0, scheme MXFP8): 127 + floor(log2(round_to_power_2(amax))) − 8. Run on CPU "
             "(engine compressed-tensors-mx)."),
    MXPolicy("ct_mxfp4", "e2m1", 32, exp_rounding="pow2_175",
             provenance="neuralmagic/compressed-tensors quantization/utils/mxfp_utils.py (v0.17.0, scheme MXFP4): "
             "as ct_mxfp8 with offset 2. Run on CPU (engine compressed-tensors-mx)."),
    MXPolicy("ct_nvfp4", "e2m1", 16, scale_fmt="e4m3fn", scale_op="div6", quant_op="div_decoded",
             global_op="recip_mul",
             provenance="neuralmagic/compressed-tensors quantization/utils/helpers.py calculate_qparams + "
             "generate_gparam, quantization/lifecycle/forward_helpers.py _quantize (v0.17.0): g = 448·6/amax_t "
             "(a Python float over a tensor: fl(fl(1/amax_t)·2688)), s = e4m3(g · amax_b/6), x / (s/g). Run on CPU "
             "(engine compressed-tensors-mx)."),
    MXPolicy("vllm_nvfp4_ref", "e2m1", 16, scale_fmt="e4m3fn", scale_op="mul_recip6", quant_op="recip_decoded",
             global_op="recip_mul",
             provenance="vllm-project/vllm vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py "
             "ref_nvfp4_quant (v0.32.0): s = e4m3(clamp(g · (amax_b · (1/6)))), x · 1/(s · 1/g); g is an input (a "
             "checkpoint's, written by compressed-tensors: recip_mul). Run on CPU (engine vllm-mx)."),
)}
#: the four recipes the checks exercise → the oracle's (reference engine's) policy
RECIPES: dict[str, str] = {"mxfp8_e4m3": "ocp_mxfp8_e4m3", "mxfp8_e5m2": "ocp_mxfp8_e5m2", "mxfp4": "ocp_mxfp4",
                           "nvfp4": "ct_nvfp4"}


def get_mx_policy(name: str | MXPolicy) -> MXPolicy:
    """A preset by name (a recipe name gives the oracle's policy for it); ValueError names the known ones."""
    if isinstance(name, MXPolicy):
        return name
    if name in RECIPES:
        name = RECIPES[name]
    try:
        return MX_PRESETS[name]
    except KeyError:
        raise ValueError(f"policy: unknown microscaling preset {name!r}; known: {sorted(MX_PRESETS)} or recipes "
                         f"{sorted(RECIPES)}") from None


# ---------------------------------------------------------------------------------------------------------------
# scales


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """(…, K) → (…, nb, block) zero-padded fp32 view and K (the edge block holds only real elements: zero padding
    does not change its amax)."""
    k = x.shape[-1]
    nb = -(-k // block)
    pad = nb * block - k
    xf = x.to(torch.float32)
    if pad:
        xf = torch.cat([xf, torch.zeros(*xf.shape[:-1], pad, dtype=torch.float32)], dim=-1)
    return xf.reshape(*x.shape[:-1], nb, block), k


def _fp32_binade(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(floor(log2 a), is_pow2) for finite a > 0 in fp32, from the bits (subnormals included)."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.int64)
    ef = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    sub_msb = np.floor(np.log2(np.maximum(man, 1))).astype(np.int64)  # leading bit of a subnormal's mantissa
    e = np.where(ef == 0, -149 + sub_msb, ef - 127)
    pow2 = np.where(ef == 0, man == (np.int64(1) << sub_msb), man == 0)
    return e, pow2


def e8m0_exponent(amax: torch.Tensor, policy: MXPolicy) -> torch.Tensor:
    """The MX block exponent e (int64, clamped to [−127, 127]) of each block amax (fp32, finite, ≥ 0)."""
    t = ELEMENT_MAX[policy.elem]
    a = amax.to(torch.float32)
    zero = (a == 0).numpy()
    if policy.exp_rounding == "floor":
        fl, _ = _fp32_binade(np.where(zero, 1.0, a.numpy()))
        e = fl - ELEMENT_EMAX[policy.elem]
    elif policy.exp_rounding == "ceil":
        r = a / t if policy.ratio_op == "div" else a * torch.tensor(1.0 / t, dtype=torch.float32)
        rn = r.numpy()
        fl, pow2 = _fp32_binade(np.where(rn == 0, 1.0, rn))
        e = np.where(pow2, fl, fl + 1)
        zero = zero | (rn == 0)  # amax > 0 whose ratio underflows to 0: 2^-127 covers it
    elif policy.exp_rounding == "pow2_175":
        an = np.where(zero, 1.0, a.numpy()).astype(np.float32)
        bits = an.view(np.uint32).astype(np.int64)
        ef = (bits >> 23) & 0xFF
        up = ((bits & 0x7FFFFF) >= 0x600000) & (ef > 0)  # significand ≥ 1.75 (normal amax)
        fl, _ = _fp32_binade(an)
        e = fl + up - ELEMENT_EMAX[policy.elem]
    else:  # ceil_log2
        r = a.clamp(min=2.0**-126) / t
        e = torch.ceil(torch.log2(r)).to(torch.int64).numpy()
        zero = np.zeros_like(zero)  # the clamp makes every block take the formula
    e = np.where(zero, -127, e)
    return torch.from_numpy(np.clip(e, -127, 127).astype(np.int64))


def nvfp4_global_scale(x: torch.Tensor, op: str = "div") -> torch.Tensor:
    """g = fl(2688 / amax_t) (``op="div"``) or fl(fl(1/amax_t)·2688) (``"recip_mul"``) as a 0-d fp32 tensor (the
    encode-direction global scale); 1 when amax_t = 0 or g is not finite (compressed-tensors ``generate_gparam``'s
    fallback)."""
    amax = x.detach().to(torch.float32).abs().amax()
    t = torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32)
    if op == "div":
        g = t / amax
    elif op == "recip_mul":
        g = (1.0 / amax) * t
    else:
        raise ValueError(f"op: expected 'div' or 'recip_mul', got {op!r}")
    return torch.where(torch.isfinite(g), g, torch.ones_like(g))


# ---------------------------------------------------------------------------------------------------------------
# quantized tensors


@dataclass(frozen=True)
class MXTensor:
    """A microscaled tensor as engines store it.

    ``data``: uint8 — FP8 codes (…, K), or packed FP4 bytes (…, ceil(K/2)) (:func:`pack_fp4`); ``scales``: uint8
    codes (…, ceil(K/B)) — E8M0 (value 2^(code−127)) or E4M3; ``global_scale``: the fp32 encode-direction global
    scale g (NVFP4; dequant divides by it), None for MX; ``shape``: the logical shape; ``policy``: the declared
    policy.
    """

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    shape: tuple[int, ...]
    policy: MXPolicy

    def codes(self) -> torch.Tensor:
        """Element codes (…, K): FP8 codes, or FP4 codes unpacked."""
        return unpack_fp4(self.data, self.shape[-1]) if self.policy.packed else self.data

    def scale_values(self) -> torch.Tensor:
        """The decoded block scales (fp64), divided by the global scale for NVFP4 (the dequant multiplier)."""
        s = torch.from_numpy(decode_codes(self.scales.numpy(), self.policy.scale_fmt))
        if self.global_scale is not None:
            s = s / float(self.global_scale)
        return s

    def element_values(self) -> torch.Tensor:
        """Element values (fp64) before scaling."""
        c = self.codes().numpy()
        v = decode_e2m1(c) if self.policy.elem == "e2m1" else decode_codes(c, self.policy.elem)
        return torch.from_numpy(np.asarray(v, dtype=np.float64)).reshape(self.shape)


def mx_quantize(x: torch.Tensor, policy: str | MXPolicy) -> MXTensor:
    """Quantize ``x`` (…, K) (fp32/bf16/fp16, finite) under ``policy``: blocks of ``policy.block`` along the last dim
    (the edge block holds the real elements only), scales and element codes by the module docstring's formulas."""
    p = get_mx_policy(policy)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"x: expected a floating-point tensor with at least 1 dim, got {type(x).__name__} "
                         f"{getattr(x, 'dtype', '')}")
    xf = x.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("x: microscaling quantizers are modelled for finite inputs only (NaN/inf given)")
    xb, k = _blocks(xf, p.block)
    amax = xb.abs().amax(dim=-1)
    g = None
    if p.two_level:
        g = nvfp4_global_scale(xf, p.global_op)
        r6 = amax / E2M1_MAX if p.scale_op == "div6" else amax * torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)
        s_raw = torch.clamp(g * r6, max=E4M3_MAX)
        s_codes = torch.from_numpy(encode_codes(s_raw, "e4m3fn", "saturate")).reshape(amax.shape)
        s = torch.from_numpy(decode_codes(s_codes.numpy(), "e4m3fn").astype(np.float32)).reshape(amax.shape)
        if p.quant_op == "div_decoded":
            y = xb / (s / g).unsqueeze(-1)
        else:
            y = xb * (1.0 / (s * (1.0 / g))).unsqueeze(-1)
        y = torch.where((s == 0).unsqueeze(-1), xb * 0.0, y)  # a zero scale: signed zeros (x·0 keeps the sign)
        y = torch.clamp(y, -E2M1_MAX, E2M1_MAX)
        scales = s_codes
    else:
        e = e8m0_exponent(amax, p)
        y = xb / torch.exp2(e.to(torch.float32)).unsqueeze(-1)
        scales = (e + 127).to(torch.uint8)
    y = y.reshape(*xf.shape[:-1], -1)[..., :k]
    if p.elem == "e2m1":
        codes = torch.from_numpy(encode_e2m1(y)).reshape(y.shape)
        data = pack_fp4(codes)
    else:
        data = torch.from_numpy(encode_codes(y.contiguous(), p.elem, "saturate")).reshape(y.shape)
    return MXTensor(data, scales.contiguous(), g, tuple(xf.shape), p)


def dequantize_mx(q: MXTensor) -> torch.Tensor:
    """Exact dequantized values (fp64): element value · block scale (÷ g for NVFP4)."""
    v = q.element_values()
    s = q.scale_values().repeat_interleave(q.policy.block, dim=-1)[..., : q.shape[-1]]
    return v * s


# ---------------------------------------------------------------------------------------------------------------
# GEMM


#: c: roundings one product term of a two-level-scaled (NVFP4) GEMM may undergo before it enters the K-sum
#: (dequantize-then-matmul: fl(1/g), fl(s·(1/g)), fl(q·S) per operand and the product; tolerance
#: ``mx_gemm_product_roundings``)
MX_GEMM_PRODUCT_ROUNDINGS = 7


def mx_gemm_exact(a: MXTensor, w: MXTensor) -> torch.Tensor:
    """y = a @ wᵀ of the exactly dequantized operands in fp64 (a: (M, K), w: (N, K))."""
    if len(a.shape) != 2 or len(w.shape) != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"w: y = a @ wᵀ needs 2-D operands with equal K, got a {a.shape} and w {w.shape}")
    return dequantize_mx(a) @ dequantize_mx(w).T


def mx_gemm_error_bound(a: MXTensor, w: MXTensor, out_dtype=torch.float32) -> torch.Tensor:
    """Elementwise bound on |y_impl − y_exact| for a microscaled GEMM with fp32 accumulation (``mx_gemm_fp32``).

    Every product term ã_k·w̃_k reaches the fp32 accumulator with at most c = 7 roundings
    (:data:`MX_GEMM_PRODUCT_ROUNDINGS`; a block-scaled tensor-core kernel needs fewer: E2M1·E2M1 and E4M3·E4M3 /
    E8M0·E8M0 products are exact, and the global factor α = 1/(g_a·g_w) costs ≤ 3), the K terms are summed in fp32
    in any order and grouping, the result is rounded once to ``out_dtype``; as for ``gemm_fp32_accum``:

        acc_err ≤ γ_{K+c}(2^-24)·Σ_k |ã_k||w̃_k| + c·η32·Σ_k max(1,|q_a|)·max(1,|q_w|)·max(1,S_a)·max(1,S_w)
        total   = (acc_err + u_out·(|y| + acc_err) + η_out/2)·eval_slack(K)

    with S the dequant block scale (s/g for NVFP4, 2^e for MX), q the element value; inf where the result can
    overflow.
    """
    k = a.shape[1]
    out = dtype_name(out_dtype)
    c = MX_GEMM_PRODUCT_ROUNDINGS
    da, dw = dequantize_mx(a), dequantize_mx(w)
    y = (da @ dw.T).abs()
    s = da.abs() @ dw.abs().T

    def mass(q: MXTensor) -> torch.Tensor:
        sv = q.scale_values().repeat_interleave(q.policy.block, dim=-1)[..., : q.shape[-1]]
        return q.element_values().abs().clamp(min=1.0) * sv.abs().clamp(min=1.0)

    under = mass(a) @ mass(w).T
    u = UNIT_ROUNDOFF["float32"]
    acc_err = gamma(k + c, u) * s + c * MIN_SUBNORMAL["float32"] * under
    total = acc_err + UNIT_ROUNDOFF[out] * (y + acc_err) + MIN_SUBNORMAL[out] / 2 if out != "float32" else acc_err
    total = total * eval_slack(k)
    overflow = (y + acc_err) >= min(MAX_FINITE[out], MAX_FINITE["float32"])
    return torch.where(overflow, torch.full_like(total, math.inf), total)
