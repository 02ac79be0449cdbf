"""torchao's MX formats behind the engine protocol (area ``quantization``, checks MX-*): engine ``torchao-mx``.

pytorch/ao ``torchao/prototype/mx_formats/mx_tensor.py`` ``to_mx`` (torchao 0.18.0), the quantizer behind its
``MXTensor`` (MX training and inference recipes), run on the CPU as it ships: ``ScaleCalculationMode.FLOOR`` (its
default, the OCP MX v1.0 rule: the E8M0 exponent from the fp32 exponent bits of the block amax minus the element's
emax), elements ``x / 2^e`` clamped to ±max and cast by torch (FP8) or ``f32_to_f4_unpacked`` + ``pack_uint4`` (FP4,
element 2i in the low nibble). Declared presets: the oracle's ``ocp_mxfp8_e4m3``, ``ocp_mxfp8_e5m2``, ``ocp_mxfp4``.

What it does not run, with the reasons in ``capabilities()``: NVFP4 (``NVFP4Tensor``/``nvfp4_quantize`` keep the
dequant-direction per-tensor scale amax/2688 and clamp block scales below at E4M3's smallest normal 2^-6 — no
oracle preset models that arithmetic yet), ragged K (``to_mx`` asserts K % 32 == 0), the MX GEMM and a weight sync.
Installed in the ``conformance_checkpoint`` environment (``nox -s conformance_checkpoint --install-only``; extra
``checkpoint``).
"""

from __future__ import annotations

from typing import Any

import torch
from fp8rl import capabilities
from fp8rl.capabilities import MX_RECIPES, MX_SYNC_RECIPES
from fp8rl.engine import CapabilityMap, Engine, Unsupported, import_failure
from fp8rl.reference import microscaling as mx

TORCHAO_VERSION = "0.18.0"
_HINT = ("needs torchao (the conformance_checkpoint environment: nox -s conformance_checkpoint --install-only; "
         "extra 'checkpoint')")
_ELEM = {"mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2", "mxfp4": "float4_e2m1fn_x2"}


class TorchaoMXEngine(Engine):
    """torchao 0.18.0's ``to_mx`` (MXFP8 e4m3/e5m2, MXFP4) under ``ScaleCalculationMode.FLOOR``."""

    name = "torchao-mx"
    description = f"torchao {TORCHAO_VERSION}: prototype.mx_formats to_mx, ScaleCalculationMode.FLOOR (MXFP8, MXFP4)"
    POLICIES = {"mxfp8_e4m3": "ocp_mxfp8_e4m3", "mxfp8_e5m2": "ocp_mxfp8_e5m2", "mxfp4": "ocp_mxfp4"}

    def __init__(self) -> None:
        self._to_mx: Any = None
        self._mode: Any = None
        self._version = ""
        self._reason = import_failure("torchao.prototype.mx_formats.mx_tensor", _HINT)
        if self._reason is None:
            try:
                import torchao
                from torchao.prototype.mx_formats.config import ScaleCalculationMode
                from torchao.prototype.mx_formats.mx_tensor import to_mx
            except Exception as exc:  # noqa: BLE001 - any import failure makes the engine unavailable
                self._reason = f"torchao does not import ({type(exc).__name__}: {exc}); {_HINT}"
            else:
                self._to_mx, self._mode, self._version = to_mx, ScaleCalculationMode.FLOOR, torchao.__version__

    def version(self) -> str:
        return f"torchao {self._version}" if self._to_mx else "torchao not installed"

    def capabilities(self) -> CapabilityMap:
        if self._to_mx is None:
            return dict.fromkeys(capabilities.keys(prefix="mx_"), self._reason or _HINT)
        caps: CapabilityMap = {}
        for r in MX_RECIPES:
            caps[f"mx_quantize.{r}"] = True if r in self.POLICIES else (
                "torchao's NVFP4 (NVFP4Tensor, nvfp4_quantize) keeps the dequant-direction per-tensor scale amax/2688 "
                "and clamps block scales below at E4M3's smallest normal 2^-6; no oracle preset models that "
                "arithmetic yet (the oracle's NVFP4 policies are compressed-tensors' and vLLM's)")
            caps[f"mx_gemm.{r}"] = ("not wired: torchao's MX GEMM on CPU is its emulated path (KernelPreference."
                                    "EMULATED: dequantize, then torch.mm); the CUDA paths are cuBLAS/CUTLASS kernels")
        caps["mx_quantize.nondivisible"] = "torchao's to_mx asserts that the last dimension is a multiple of the block"
        caps.update(dict.fromkeys((f"mx_weight_sync.{r}" for r in MX_SYNC_RECIPES),
                                  "torchao quantizes modules in place (quantize_); it writes no synced state dict"))
        return caps

    def mx_policy(self, recipe: str) -> mx.MXPolicy:
        if recipe not in self.POLICIES:
            raise Unsupported(f"torchao-mx runs no {recipe}")
        return mx.MX_PRESETS[self.POLICIES[recipe]]

    def mx_quantize(self, x: torch.Tensor, recipe: str) -> mx.MXTensor:
        """``to_mx(x, elem_dtype, 32, FLOOR)`` → (E8M0 scales as uint8 codes, element bytes; FP4 packed by torchao)."""
        p = self.mx_policy(recipe)
        if x.dim() < 1 or x.shape[-1] % p.block:
            raise Unsupported(f"to_mx: the last dimension must be a multiple of {p.block}, got {tuple(x.shape)}")
        xf = x.detach().to(torch.float32).contiguous()
        scale, data = self._to_mx(xf, getattr(torch, _ELEM[recipe]), p.block, self._mode)
        return mx.MXTensor(data.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(
            *x.shape[:-1], -1), None, tuple(x.shape), p)
