"""``triton-interpret``: Triton's own conversions, run by Triton's interpreter on CPU — the instrument, validated.

Engines' Triton FP8 kernels (vLLM, SGLang, veRL) run on CPU only under ``TRITON_INTERPRET=1``. Before any kernel is
judged, this engine measures the instrument itself: tiny ``tl`` kernels whose only non-trivial operation is Triton's
float conversion —

* ``cast``: ``tl.load(x).to(tl.float8e4nv | tl.float8e5)`` for fp32 and bf16 inputs (a bf16 input is loaded as
  bf16 and converted directly, the interpreter's 16-bit path);
* ``round_bf16``: ``tl.load(x_fp32).to(tl.bfloat16)``;
* ``quantize`` (every granularity): one program per scale tile; ``amax = max |x|`` over the tile,
  ``s = max(amax, 1e-10) / 448``, ``q = clamp(x / s, ±448).to(fp8)`` — the ``reference`` preset, with true
  fp32 division (``tl.math.div_rn``), so that the conversion is the only step that can differ from the oracle.

Declared numerics are those of the compiled NVIDIA lowering of the same code: ``.to(fp8)`` is
``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` (round to nearest even, finite overflow and ±inf saturate to ±max, NaN
stays NaN), ``.to(bf16)`` is ``cvt.rn.bf16.f32``. Whatever the interpreter does differently is a finding about the
interpreter (``conformance/vendors/triton-interpret.xfails``), not about any engine.

``triton-interpret-faithful`` runs the same kernels with the ``faithful-downcast`` workaround of
:mod:`fp8rl.engines._triton_interp` installed and must conform with no xfails: that is the test of the workaround
against the oracle, and the reason kernel engines (``sglang``, ``vllm-triton``, ``verl-triton``) may rely on it
(each names it in its reports through ``instrument_notes()``).

The fnuz formats (``tl.float8e4b8``/``float8e5b16``) are AMD-only in compiled Triton and outside the workaround:
capability reasons. Needs ``pip install triton`` (the ``[triton]`` extra); the interpreter is requested before
Triton is imported (a process that already imported Triton for a GPU backend gets a capability reason instead).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from fp8rl.engine import ELEMENT_FORMATS, QUANT_KINDS, CapabilityMap, Engine, Unsupported
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor

from . import _triton_interp as TI

_FORMATS = {"e4m3fn": ("float8e4nv", torch.float8_e4m3fn), "e5m2": ("float8e5", torch.float8_e5m2)}
_EPS = 1e-10


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=1)
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def convert_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def quant_kernel(x_ptr, q_ptr, s_ptr, M, N, n_tiles_n, BM: tl.constexpr, BN: tl.constexpr,
                     PM: tl.constexpr, PN: tl.constexpr, EPS: tl.constexpr, FMAX: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        i = tl.arange(0, PM)
        j = tl.arange(0, PN)
        rows = pm * BM + i
        cols = pn * BN + j
        m = ((i < BM) & (rows < M))[:, None] & ((j < BN) & (cols < N))[None, :]
        ptrs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + ptrs, mask=m, other=0.0)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        s = tl.math.div_rn(tl.maximum(amax, EPS), FMAX)
        q = tl.clamp(tl.math.div_rn(x, s), -FMAX, FMAX)
        tl.store(q_ptr + ptrs, q.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + pm * n_tiles_n + pn, s)

    return {"convert": convert_kernel, "quant": quant_kernel}


class TritonInterpretEngine(Engine):
    name = "triton-interpret"
    description = ("Triton's own fp32/bf16 → fp8 and fp32 → bf16 conversions (tiny tl kernels) as Triton's CPU "
                   "interpreter runs them: validates the instrument before engines' Triton kernels are judged")
    #: conversions mode of :mod:`fp8rl.engines._triton_interp` the kernels run in
    mode = "raw"

    def __init__(self) -> None:
        self._reason = TI.enable_interpreter()

    def version(self) -> str:
        if self._reason:
            return "triton unavailable"
        extra = f", conversions: {TI.WORKAROUND}" if self.mode == "faithful" else ", the interpreter's own conversions"
        return f"triton {TI.triton_version()} interpreter (TRITON_INTERPRET=1{extra})"

    def instrument_notes(self) -> list[str]:
        return [TI.WORKAROUND_NOTE] if self.mode == "faithful" else []

    def capabilities(self) -> CapabilityMap:
        keys = [f"cast.{f}" for f in ELEMENT_FORMATS] + ["cast.bf16"] + [f"quantize.{k}" for k in QUANT_KINDS]
        if self._reason:
            return dict.fromkeys(keys, self._reason)
        caps: CapabilityMap = dict.fromkeys(keys, True)
        for f in ("e4m3fnuz", "e5m2fnuz"):
            caps[f"cast.{f}"] = (f"{f}: Triton's fnuz types (float8e4b8/float8e5b16) are AMD-only in compiled Triton; "
                                 f"without a compiled reference semantics the interpreter is not judged on them, and "
                                 f"the {TI.WORKAROUND} workaround does not cover them")
        for k in ("gemm.block", "gemm.tensor", "gemm.row"):
            caps[k] = ("the instrument engine only exposes conversions and a quantizer; Triton GEMMs are judged "
                       "through the engines that own them (vllm-triton, sglang)")
        return caps

    # -- declared numerics (the compiled NVIDIA lowering) -------------------------------------------------------
    def cast_overflow(self, fmt: str) -> str:
        if fmt not in _FORMATS:
            raise Unsupported(str(self.capabilities().get(f"cast.{fmt}", f"no cast for {fmt}")))
        return "saturate"

    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind not in QUANT_KINDS:
            raise Unsupported(f"triton-interpret: no quantizer for granularity {kind!r}")
        return get_policy("reference")

    # -- ops ---------------------------------------------------------------------------------------------------
    def _run_convert(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self._reason:
            raise Unsupported(self._reason)
        src = x.contiguous().reshape(-1)
        out = torch.empty(src.shape, dtype=out_dtype)
        n = src.numel()
        if n:
            block = min(_next_pow2(n), 1 << 16)
            with TI.conversions(self.mode):
                _kernels()["convert"][(-(-n // block),)](src, out, n, BLOCK=block)
        return out.reshape(x.shape)

    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        if fmt not in _FORMATS:
            raise Unsupported(str(self.capabilities().get(f"cast.{fmt}", f"no cast for {fmt}")))
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.to(torch.float32)
        return self._run_convert(x, _FORMATS[fmt][1]).view(torch.uint8)

    def round_bf16(self, x: torch.Tensor) -> torch.Tensor:
        return self._run_convert(x.to(torch.float32), torch.bfloat16)

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        if self._reason:
            raise Unsupported(self._reason)
        kind = granularity.kind
        x32 = x.to(torch.float32).contiguous()
        shape = tuple(x32.shape)
        if kind in ("channel", "block") and x32.dim() != 2:
            raise ValueError(f"x: {kind} quantization needs a 2-D tensor, got shape {shape}")
        if kind == "tensor":
            x2 = x32.reshape(1, -1)
            bm, bn = 1, max(1, x2.shape[1])
        else:
            x2 = x32.reshape(-1, shape[-1]) if x32.dim() else x32.reshape(1, 1)
            bm, bn = {"token": (1, x2.shape[1]), "channel": (1, x2.shape[1]),
                      "group": (1, granularity.size[1]), "block": granularity.size}[kind]
        m, n = x2.shape
        tm, tn = -(-m // bm), -(-max(n, 1) // bn)
        q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(tm * tn, dtype=torch.float32)
        if x2.numel():
            with TI.conversions(self.mode):
                _kernels()["quant"][(tm, tn)](x2, q, s, m, n, tn, BM=bm, BN=bn, PM=_next_pow2(bm),
                                              PN=_next_pow2(bn), EPS=_EPS, FMAX=448.0)
        if kind == "tensor":
            scale = s.reshape(1)
        elif kind == "block":
            scale = s.reshape(tm, tn)
        else:
            scale = s.reshape(*shape[:-1], tn) if x32.dim() else s.reshape(1)
        return QuantizedTensor(q.view(torch.uint8).reshape(shape), scale, granularity, self.scale_policy(kind))


class TritonInterpretFaithfulEngine(TritonInterpretEngine):
    name = "triton-interpret-faithful"
    description = ("The triton-interpret kernels with fp8rl's faithful-downcast workaround installed (torch casts "
                   "with NVIDIA cvt.rn(.satfinite) semantics in place of the interpreter's conversions): the test "
                   "of the workaround kernel engines rely on")
    mode = "faithful"
