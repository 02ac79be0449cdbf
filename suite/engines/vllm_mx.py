"""Engine ``vllm-mx``: vLLM 0.32.0's CPU microscaling paths (areas ``quantization`` and ``gemm``, checks MX-*):
``mxfp8_e4m3_quantize`` (on CPU: ``_mxfp8_e4m3_quantize_torch``) and ``dequant_mxfp8_to_bf16`` for MXFP8;
``ref_nvfp4_quant`` (the NVFP4 emulation quantizer) and ``dequantize_to_dtype`` (its emulation dequantizer,
``swizzle=False``) for NVFP4. vLLM's packing kernels (``scaled_fp4_quant``) and every MX/NVFP4 GEMM (CUTLASS,
FlashInfer, Marlin) are CUDA-only; ``ref_nvfp4_quant`` returns FP4 *values*, which the adapter turns into codes and
packs low nibble first — the layout vLLM's ``break_fp4_bytes`` reads (the adapter checks its own bytes with it). The
NVFP4 global scale is an input in vLLM (a checkpoint's ``input_global_scale``/``weight_global_scale``, which
compressed-tensors writes as 448·6/amax): the adapter passes that formula's fp32 value, computed as
compressed-tensors does (fl(fl(1/amax)·2688)). Its peer: :mod:`fp8rl.engines.compressed_tensors_mx`. Needs the
``conformance_vllm`` environment (``nox -s conformance_vllm --install-only``).
"""

from __future__ import annotations

from typing import Any

import torch
from fp8rl import capabilities
from fp8rl.capabilities import MX_RECIPES, MX_SYNC_RECIPES
from fp8rl.engine import CapabilityMap, Engine, Unsupported
from fp8rl.engines.compressed_tensors_mx import _HINT
from fp8rl.reference import microscaling as mx

VLLM_VERSION = "0.32.0"


def _codes_from_fp4_values(v: torch.Tensor) -> torch.Tensor:
    """FP4 grid values (fp32) → 4-bit codes: exact lookups (every input is a grid value)."""
    mag = v.abs()
    grid = torch.tensor(mx.E2M1_VALUES)
    idx = (mag.unsqueeze(-1) == grid).to(torch.uint8).argmax(dim=-1).to(torch.uint8)
    if not bool((grid[idx.long()] == mag).all()):
        raise ValueError("values: not on the E2M1 grid")
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


class VllmMXEngine(Engine):
    """vLLM 0.32.0's CPU MXFP8 quantizer and NVFP4 emulation (quantizer + dequantize-then-matmul GEMM)."""

    name = "vllm-mx"
    description = (f"vLLM {VLLM_VERSION} CPU paths: mxfp8_e4m3_quantize (torch), dequant_mxfp8_to_bf16, "
                   "ref_nvfp4_quant, dequantize_to_dtype")
    POLICIES = {"mxfp8_e4m3": "vllm_mxfp8_torch", "nvfp4": "vllm_nvfp4_ref"}

    def __init__(self) -> None:
        self._v: Any = None
        self._reason: str | None = None
        try:
            import vllm
            from vllm.model_executor.layers.quantization.utils import mxfp8_utils, nvfp4_emulation_utils

            self._v = dict(version=vllm.__version__, mx8=mxfp8_utils, nv=nvfp4_emulation_utils)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
            self._reason = f"vllm does not import ({type(exc).__name__}: {exc}); {_HINT}"

    def version(self) -> str:
        return f"vllm {self._v['version']}" if self._v else "vllm not installed"

    def capabilities(self) -> CapabilityMap:
        if self._v is None:
            return dict.fromkeys(capabilities.keys(prefix="mx_"), self._reason or _HINT)
        caps: CapabilityMap = {}
        for r in MX_RECIPES:
            ok = r in self.POLICIES
            caps[f"mx_quantize.{r}"] = True if ok else \
                f"vLLM's {r} quantizers are CUDA/ROCm kernels (no CPU path)"
            caps[f"mx_gemm.{r}"] = True if ok else f"vLLM's {r} GEMMs are CUDA/ROCm kernels (no CPU emulation)"
        caps["mx_quantize.nondivisible"] = ("vLLM asserts K % 32 == 0 (MXFP8) and reshapes into whole 16-blocks "
                                            "(NVFP4): ragged shapes are rejected")
        caps.update(dict.fromkeys((f"mx_weight_sync.{r}" for r in MX_SYNC_RECIPES),
                                  "vLLM loads a synced checkpoint (its compressed-tensors schemes' weight loaders need a "
                                  "model built on a CUDA/ROCm platform); it writes none: engine compressed-tensors-mx"))
        return caps

    def mx_policy(self, recipe: str) -> mx.MXPolicy:
        if recipe not in self.POLICIES:
            raise Unsupported(f"vLLM has no CPU {recipe} path")
        return mx.MX_PRESETS[self.POLICIES[recipe]]

    def mx_quantize(self, x: torch.Tensor, recipe: str) -> mx.MXTensor:
        p = self.mx_policy(recipe)
        if x.dim() != 2 or x.shape[-1] % p.block:
            raise Unsupported(f"vLLM: expected 2-D x with K a multiple of {p.block}, got {tuple(x.shape)}")
        xf = x.detach().to(torch.float32)
        if recipe == "mxfp8_e4m3":
            q, s = self._v["mx8"].mxfp8_e4m3_quantize(xf)
            return mx.MXTensor(q.view(torch.uint8).contiguous(), s.contiguous(), None, tuple(x.shape), p)
        g = mx.nvfp4_global_scale(xf, p.global_op)  # compressed-tensors' 448·6/amax: what a vLLM checkpoint carries
        vals, scale = self._v["nv"].ref_nvfp4_quant(xf, g.reshape(1), 16)
        codes = _codes_from_fp4_values(vals)
        data = mx.pack_fp4(codes)
        back = self._v["nv"].break_fp4_bytes(data, torch.float32)
        if not torch.equal(back.abs(), vals.abs()):
            raise ValueError("vllm-mx: break_fp4_bytes does not read back the packed values (layout mismatch)")
        scales = scale.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape[0], -1)
        return mx.MXTensor(data, scales.contiguous(), g, tuple(x.shape), p)

    def mx_gemm(self, a: mx.MXTensor, w: mx.MXTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """vLLM's own dequantizers (``dequant_mxfp8_to_bf16``; NVFP4 ``dequantize_to_dtype`` with the decode global
        scale 1/g, as vLLM stores it after loading), then ``torch.matmul`` in fp32 and one rounding to out_dtype."""
        if a.policy.two_level != w.policy.two_level or a.policy.elem != w.policy.elem:
            raise Unsupported("mixed recipes")
        if a.policy.two_level:
            def deq(q: mx.MXTensor) -> torch.Tensor:
                if q.global_scale is None:
                    raise ValueError("w: an NVFP4 operand needs its global scale")
                inv = (1.0 / q.global_scale.to(torch.float32)).reshape(())
                return self._v["nv"].dequantize_to_dtype(q.data, q.scales.view(torch.float8_e4m3fn), inv,
                                                         torch.float32, 16, swizzle=False)
        elif a.policy.elem == "e4m3fn":
            def deq(q: mx.MXTensor) -> torch.Tensor:
                return self._v["mx8"].dequant_mxfp8_to_bf16(q.data.view(torch.float8_e4m3fn), q.scales).float()
        else:
            raise Unsupported(f"vLLM has no CPU {a.policy.name} GEMM")
        return (deq(a) @ deq(w).T).to(out_dtype)
