"""PyTorch's own FP8: ``.to(float8_*)`` casts, a quantizer written with plain torch ops, and ``torch._scaled_mm``.

This engine shares no code with the oracle: its casts are torch's C++ conversions and its quantizer is a few
torch ops (amax → scale → divide → clamp → cast), the way a framework would write it.

Declared numerics (torch 2.13):

* casts: e4m3fn saturates (±inf → ±448, torch ≥ 2.12), e5m2 overflows to ±inf, the fnuz formats give NaN;
* quantize: the ``reference`` policy (amax floored at 1e-10, s = amax/448, q = clamp(x/s, ±448) then cast);
* GEMM: ``torch._scaled_mm`` for per-tensor and row-wise scaling; block-wise (1×128 × 128×128) is emulated by
  dequantizing to fp32 and one fp32 matmul, because torch rejects block-wise scaling on CPU
  ("Invalid scaling configuration"); on CUDA ``TorchCudaEngine`` uses the device's kernels.
"""

from __future__ import annotations

import math

import torch
from fp8rl.engine import ELEMENT_FORMATS, GEMM_KINDS, QUANT_KINDS, CapabilityMap, Engine, Unsupported
from fp8rl.reference.quant import Granularity, QuantizedTensor, ScalePolicy, get_policy

_TORCH_FP8 = {
    "e4m3fn": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e4m3fnuz": "float8_e4m3fnuz",
    "e5m2fnuz": "float8_e5m2fnuz",
}
_CAST_OVERFLOW = {"e4m3fn": "saturate", "e5m2": "inf", "e4m3fnuz": "nan", "e5m2fnuz": "nan"}
_EPS = 1e-10
_FP8_MAX = 448.0


def _torch_dtype(fmt: str) -> torch.dtype:
    if fmt not in _TORCH_FP8:
        raise Unsupported(f"torch has no dtype for fmt {fmt!r}")
    return getattr(torch, _TORCH_FP8[fmt])


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


class TorchEngine(Engine):
    """PyTorch-native FP8 on the CPU (or another device via ``device``)."""

    name = "torch"
    description = "PyTorch's own FP8 casts, a plain-torch quantizer and torch._scaled_mm"
    device = "cpu"

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def _device_reason(self) -> str | None:
        return None

    def capabilities(self) -> CapabilityMap:
        reason = self._device_reason()
        if reason:
            keys = [f"cast.{f}" for f in ELEMENT_FORMATS] + [f"quantize.{k}" for k in QUANT_KINDS]
            keys += [f"gemm.{k}" for k in GEMM_KINDS]
            return dict.fromkeys(keys, reason)
        caps: CapabilityMap = {}
        for f, dt in _TORCH_FP8.items():
            caps[f"cast.{f}"] = True if hasattr(torch, dt) else f"torch {torch.__version__} has no torch.{dt}"
        caps.update({f"quantize.{k}": True for k in QUANT_KINDS})
        caps["gemm.tensor"] = True
        caps["gemm.row"] = True
        caps["gemm.block"] = True
        caps.update(self._caps_kv())
        return caps

    def _caps_kv(self) -> CapabilityMap:
        return {}

    def cast_overflow(self, fmt: str) -> str:
        return _CAST_OVERFLOW[fmt]

    def scale_policy(self, kind: str) -> ScalePolicy:
        return get_policy("reference")

    # -- ops -----------------------------------------------------------------------------------------------
    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return x.to(self.device, torch.float32).to(_torch_dtype(fmt)).view(torch.uint8).cpu()

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        x32 = x.to(self.device, torch.float32)
        kind = granularity.kind
        if kind == "tensor":
            amax = x32.abs().amax().reshape(1)
            scale = amax.clamp(min=_EPS) / _FP8_MAX
            full = scale
        elif kind in ("token", "channel"):
            amax = x32.abs().amax(dim=-1, keepdim=True)
            scale = amax.clamp(min=_EPS) / _FP8_MAX
            full = scale
        elif kind == "group":
            g = granularity.size[1]
            k = x32.shape[-1]
            xp = _pad_last(x32, g)
            grouped = xp.reshape(*xp.shape[:-1], xp.shape[-1] // g, g)
            amax = grouped.abs().amax(dim=-1)
            scale = amax.clamp(min=_EPS) / _FP8_MAX
            full = scale.repeat_interleave(g, dim=-1)[..., :k]
        elif kind == "block":
            if x32.dim() != 2:
                raise Unsupported(f"block quantization needs a 2-D tensor, got shape {tuple(x32.shape)}")
            bm, bn = granularity.size
            m, n = x32.shape
            mb, nb = math.ceil(m / bm), math.ceil(n / bn)
            xp = torch.nn.functional.pad(x32, (0, nb * bn - n, 0, mb * bm - m))
            blocks = xp.reshape(mb, bm, nb, bn)
            amax = blocks.abs().amax(dim=(1, 3))
            scale = amax.clamp(min=_EPS) / _FP8_MAX
            full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:m, :n]
        else:
            raise Unsupported(f"unknown granularity kind {kind!r}")
        q = (x32 / full).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedTensor(q.view(torch.uint8).cpu(), scale.cpu(), granularity, self.scale_policy(kind))

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        ka, kw = a.granularity.kind, w.granularity.kind
        a8 = a.codes.to(self.device).view(_torch_dtype(a.fmt))
        w8 = w.codes.to(self.device).view(_torch_dtype(w.fmt))
        if ka == "tensor" and kw == "tensor":
            out = torch._scaled_mm(a8, w8.t(), scale_a=a.scale.reshape(()).to(self.device),
                                   scale_b=w.scale.reshape(()).to(self.device), out_dtype=out_dtype)
            return out.cpu()
        if ka == "token" and kw == "channel":
            out = torch._scaled_mm(a8, w8.t(), scale_a=a.scale.reshape(-1, 1).contiguous().to(self.device),
                                   scale_b=w.scale.reshape(1, -1).contiguous().to(self.device), out_dtype=out_dtype)
            return out.cpu()
        # block-wise: emulate (torch has no CPU block-scaled GEMM): dequantize in fp32, one fp32 matmul
        a32 = a8.float() * _expand(a.scale.to(self.device), a.granularity, a.codes.shape)
        w32 = w8.float() * _expand(w.scale.to(self.device), w.granularity, w.codes.shape)
        return (a32 @ w32.t()).to(out_dtype).cpu()

    # -- area kv (BEGIN kv section; only the KV area edits between these markers) --------------------------------
    # -- END kv section ---------------------------------------------------------------------------------------------


def _expand(scale: torch.Tensor, g: Granularity, shape: torch.Size) -> torch.Tensor:
    m, k = shape
    if g.kind == "tensor":
        return scale.reshape(1, 1).expand(m, k)
    if g.kind in ("token", "channel"):
        return scale.reshape(m, 1).expand(m, k)
    if g.kind == "group":
        return scale.reshape(m, -1).repeat_interleave(g.size[1], 1)[:, :k]
    bm, bn = g.size
    return scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:m, :k]


class TorchCudaEngine(TorchEngine):
    """The torch engine on a CUDA device; every capability says why when there is none."""

    name = "torch-cuda"
    description = "PyTorch FP8 on CUDA (casts, quantizer, _scaled_mm incl. block-wise on SM90+)"
    device = "cuda"

    def _device_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        return None

    def version(self) -> str:
        if torch.cuda.is_available():
            return f"torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name()}"
        return f"torch {torch.__version__} (no CUDA device)"
