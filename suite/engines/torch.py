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
from fp8rl import capabilities
from fp8rl.engine import CapabilityMap, Engine, Unsupported
from fp8rl.reference.policy import OverflowPolicy, ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor

_TORCH_FP8 = {
    "e4m3fn": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e4m3fnuz": "float8_e4m3fnuz",
    "e5m2fnuz": "float8_e5m2fnuz",
}
_CAST_OVERFLOW: dict[str, OverflowPolicy] = {"e4m3fn": "saturate", "e5m2": "inf", "e4m3fnuz": "nan", "e5m2fnuz": "nan"}
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
            return {k: reason for area in ("formats", "quantization", "gemm") for k in capabilities.keys(area)}
        caps: CapabilityMap = {}
        for f, dt in _TORCH_FP8.items():
            caps[f"cast.{f}"] = True if hasattr(torch, dt) else f"torch {torch.__version__} has no torch.{dt}"
        caps["cast.bf16"] = True
        caps.update(capabilities.all_of("quantization"))
        caps.update(capabilities.all_of("gemm"))
        caps.update(dict.fromkeys(capabilities.keys(prefix="mx_"),
                                  f"torch {torch.__version__} has the MX dtypes (float8_e8m0fnu, float4_e2m1fn_x2) but "
                                  "no microscaling quantizer or GEMM on CPU (engines compressed-tensors-mx, vllm-mx)"))
        sdpa = hasattr(torch.nn.functional, "scaled_dot_product_attention")
        caps.update(capabilities.all_of("kv", True if sdpa else f"torch {torch.__version__} has no "
                                                                "scaled_dot_product_attention"))
        return caps

    def cast_overflow(self, fmt: str) -> OverflowPolicy:
        return _CAST_OVERFLOW[fmt]

    def scale_policy(self, kind: str) -> ScalePolicy:
        return get_policy("reference")

    # -- ops -----------------------------------------------------------------------------------------------
    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return x.to(self.device, torch.float32).to(_torch_dtype(fmt)).view(torch.uint8).cpu()

    def round_bf16(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, torch.float32).to(torch.bfloat16).cpu()

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

    # -- area kv ---------------------------------------------------------------------------------------------------
    # A framework-style FP8 KV cache written with torch ops only (no oracle code): store y = x / s (x · (1/s) for
    # per-token-head scales), clamp to ±max, torch's fp8 cast; load codes.view(fp8).float() · s; attention =
    # torch.nn.functional.scaled_dot_product_attention in fp32 (enable_gqa) on the dequantized operands, Q
    # quantized per tensor as vLLM's QuantFP8 does (x · (1/s_q), clamp, cast to e4m3fn).
    _KV_FORMATS = ("e4m3fn", "e5m2")
    _KV_LAYOUTS = ("tensor", "head", "token_head")
    _KV_CONSTANTS = (200.0, 200.0, 100.0)  # vLLM Q/K/V_SCALE_CONSTANT

    def kv_policy(self, fmt: str, layout: str):
        from fp8rl.reference.kv import KVPolicy

        if fmt not in self._KV_FORMATS:
            raise Unsupported(f"no FP8 KV cache in {fmt!r} (supported: {self._KV_FORMATS})")
        if layout not in self._KV_LAYOUTS:
            raise ValueError(f"layout: expected one of {self._KV_LAYOUTS}, got {layout!r}")
        return KVPolicy(fmt=fmt, layout=layout, quant_op="mul_recip" if layout == "token_head" else "div",
                        clamp=True, overflow=_CAST_OVERFLOW[fmt], token_head_floor=1e-6, quantize_q=True,
                        q_fmt="e4m3fn", q_quant_op="mul_recip")

    def kv_store(self, x, scale, *, fmt, layout):
        from fp8rl.reference.kv import KVCache

        self.kv_policy(fmt, layout)
        dt = _torch_dtype(fmt)
        fmax = float(torch.finfo(dt).max)
        x32 = x.to(self.device, torch.float32)
        if x32.dim() < 3:
            raise ValueError(f"x: expected [..., T, H, D], got shape {tuple(x32.shape)}")
        if layout == "token_head":
            if scale is not None:
                raise ValueError("scale: layout 'token_head' computes its scales; pass None")
            s = (x32.abs().amax(dim=-1) / fmax).clamp(min=1e-6)
            y = x32 * (1.0 / s).unsqueeze(-1)
        else:
            if scale is None:
                raise ValueError(f"scale: layout {layout!r} needs a scale")
            s = torch.as_tensor(scale).to(self.device, torch.float32)
            want = () if layout == "tensor" else (x32.shape[-2],)
            if tuple(s.shape) != want:
                raise ValueError(f"scale: expected shape {want} for layout {layout!r}, got {tuple(s.shape)}")
            y = x32 / (s if layout == "tensor" else s.unsqueeze(-1))
        codes = y.clamp(-fmax, fmax).to(dt).view(torch.uint8)
        return KVCache(codes.cpu(), s.cpu(), fmt, layout)

    def _kv_load(self, cache) -> torch.Tensor:
        vals = cache.codes.to(self.device).view(_torch_dtype(cache.fmt)).float()
        s = cache.scale.to(self.device, torch.float32)
        if cache.layout == "token_head":
            return vals * s.unsqueeze(-1)
        return vals * (s if cache.layout == "tensor" else s.unsqueeze(-1))

    def kv_attention(self, q, k_cache, v_cache, *, q_scale=None, causal=True, q_lengths=None, kv_lengths=None,
                     sm_scale=None):
        dev = self.device
        q32 = q.to(dev, torch.float32)
        if q_scale is not None:
            qs = torch.as_tensor(q_scale).to(dev, torch.float32)
            q8 = (q32 * (1.0 / qs)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            q32 = q8.float() * qs
        k = self._kv_load(k_cache)
        v = self._kv_load(v_cache)
        b, tq, hq, d = q32.shape
        tk, hkv = k.shape[1], k.shape[2]
        ql = torch.full((b,), tq) if q_lengths is None else torch.as_tensor(q_lengths).long()
        kl = torch.full((b,), tk) if kv_lengths is None else torch.as_tensor(kv_lengths).long()
        ql, kl = ql.to(dev), kl.to(dev)
        qi = torch.arange(tq, device=dev)
        kj = torch.arange(tk, device=dev)
        q_ok = qi[None, :] < ql[:, None]  # [B, Tq]
        k_ok = kj[None, :] < kl[:, None]  # [B, Tk]
        mask = q_ok[:, :, None] & k_ok[:, None, :]
        if causal:
            mask &= kj[None, None, :] <= qi[None, :, None] + (kl - ql)[:, None, None]
        # never read beyond kv_len (slots there may hold any bytes, NaN included); padded query rows → 0
        k = torch.where(k_ok[:, :, None, None], k, 0.0)
        v = torch.where(k_ok[:, :, None, None], v, 0.0)
        q32 = torch.where(q_ok[:, :, None, None], q32, 0.0)
        out = torch.nn.functional.scaled_dot_product_attention(
            q32.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
            scale=(1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale), enable_gqa=hq != hkv)
        out = out.transpose(1, 2)
        return torch.where(q_ok[:, :, None, None], out, 0.0).cpu()

    @staticmethod
    def _kv_amax(t: torch.Tensor, per_head: bool = False) -> torch.Tensor:
        a = t.float().abs()
        if per_head:
            return a.transpose(-2, 0).reshape(a.shape[-2], -1).amax(dim=1)
        return a.amax()

    def kv_calibrate(self, captures, strategy, *, layout="tensor", fmt="e4m3fn"):
        from fp8rl.reference.kv import KVScales

        name = {"A": "engine_first_batch", "B": "trainer_p999", "C": "amax"}.get(strategy, strategy)
        fmax = float(torch.finfo(_torch_dtype(fmt)).max)
        if name == "engine_first_batch":
            if layout != "tensor":
                raise ValueError("layout: strategy A gives per-tensor scales")
            q, k, v = captures[0][0]
            c = [torch.tensor(x, dtype=torch.float32) for x in self._KV_CONSTANTS]
            return KVScales(self._kv_amax(q) / c[0], self._kv_amax(k) / c[1], self._kv_amax(v) / c[2])
        if name == "trainer_p999":
            if layout != "tensor":
                raise ValueError("layout: strategy B gives per-tensor scales")
            out = []
            for i, m in enumerate((448.0, fmax, fmax)):
                best = 0.0
                for rank in captures:
                    vals = sorted(float(self._kv_amax(mb[i])) for mb in rank)
                    idx = max(0, min(len(vals) - 1, int(round((99.9 / 100.0) * (len(vals) - 1)))))
                    best = max(best, vals[idx])
                out.append(torch.tensor(best * 1.05 / m, dtype=torch.float32))
            return KVScales(*out)
        if name == "amax":
            flat = [mb for rank in captures for mb in rank]
            per_head = layout == "head"
            res = []
            for i, m in enumerate((448.0, fmax, fmax)):
                a = torch.stack([self._kv_amax(mb[i], per_head and i > 0) for mb in flat]).amax(dim=0)
                res.append(a / m)
            return KVScales(*res)
        raise ValueError(f"strategy: unknown {strategy!r}; expected engine_first_batch/A, trainer_p999/B, amax/C")

    def kv_update_scales(self, layer, scales):
        from fp8rl.reference.kv import KVScales

        state = self.__dict__.setdefault("_kv_state", {})
        if scales is None:
            state[layer] = None
            return "pending"
        if not isinstance(scales, KVScales):
            raise ValueError(f"scales: expected a KVScales or None, got {type(scales).__name__}")
        state[layer] = KVScales(*(torch.as_tensor(t).to(torch.float32).clone() for t in (scales.q, scales.k, scales.v)))
        return "pushed"

    def kv_forward(self, layer, q, k, v, *, fmt, layout="tensor", causal=True, q_lengths=None, kv_lengths=None,
                   sm_scale=None):
        from fp8rl.reference.kv import KVForward, MissingKVScales

        state = self.__dict__.setdefault("_kv_state", {})
        if layer not in state:
            raise MissingKVScales(f"layer {layer!r}: no KV scales set; refusing the default 1.0")
        if state[layer] is None:
            state[layer] = self.kv_calibrate([[(q, k, v)]], "engine_first_batch", fmt=fmt)
        s = state[layer]
        dyn = layout == "token_head"
        kc = self.kv_store(k, None if dyn else s.k, fmt=fmt, layout=layout)
        vc = self.kv_store(v, None if dyn else s.v, fmt=fmt, layout=layout)
        out = self.kv_attention(q, kc, vc, q_scale=s.q, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                sm_scale=sm_scale)
        return KVForward(out, kc, vc, s)



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
