"""The oracle as an engine.

``ReferenceEngine`` answers every op with :mod:`fp8rl.reference`. It is also the base class for the
"bring your kernel" path: subclass it, override the op you have a kernel for, and declare the policy your kernel
implements; every other op keeps the oracle's answer::

    class MyEngine(ReferenceEngine):
        name = "my-engine"
        def scale_policy(self, kind):
            return get_policy("vllm_cuda_group") if kind == "group" else super().scale_policy(kind)
        def quantize(self, x, granularity):
            if granularity.kind != "group":
                return super().quantize(x, granularity)
            codes, scale = my_kernel(x, granularity.size[1])
            return QuantizedTensor(codes, scale, granularity, self.scale_policy("group"))
"""

from __future__ import annotations

import fp8rl
import torch
from fp8rl.engine import ELEMENT_FORMATS, GEMM_KINDS, QUANT_KINDS, CapabilityMap, Engine
from fp8rl.reference import formats
from fp8rl.reference.gemm import block_gemm_exact
from fp8rl.reference.quant import Granularity, QuantizedTensor, ScalePolicy, get_policy, quantize


class ReferenceEngine(Engine):
    """The oracle (plain PyTorch/numpy, fp32/fp64 math) exposed through the engine protocol."""

    name = "reference"
    description = "fp8rl's own oracle (bit-level casts, explicit ScalePolicy quantizers, exact fp64 block GEMM)"

    #: overflow policy of cast() per format (the CUDA SATFINITE convention for every format)
    CAST_OVERFLOW: dict[str, str] = {f: "saturate" for f in ELEMENT_FORMATS}

    def __init__(self, policies: dict[str, str | ScalePolicy] | None = None) -> None:
        base: dict[str, str | ScalePolicy] = {k: "reference" for k in QUANT_KINDS}
        if policies:
            unknown = set(policies) - set(QUANT_KINDS)
            if unknown:
                raise ValueError(f"policies: unknown granularity kinds {sorted(unknown)}; expected {QUANT_KINDS}")
            base.update(policies)
        self._policies = {k: get_policy(v) for k, v in base.items()}

    def version(self) -> str:
        return f"fp8rl {fp8rl.__version__}"

    def capabilities(self) -> CapabilityMap:
        caps: CapabilityMap = {f"cast.{f}": True for f in ELEMENT_FORMATS}
        caps.update({f"quantize.{k}": True for k in QUANT_KINDS})
        caps.update({f"gemm.{k}": True for k in GEMM_KINDS})
        caps.update(self._caps_kv())
        caps.update(self._caps_correction())
        caps.update(self._caps_e2e())
        return caps

    def cast_overflow(self, fmt: str) -> str:
        return self.CAST_OVERFLOW[formats.get_format(fmt).name]

    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind not in self._policies:
            raise ValueError(f"kind: expected one of {QUANT_KINDS}, got {kind!r}")
        return self._policies[kind]

    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return formats.encode(x, fmt, self.cast_overflow(fmt)).reshape(x.shape)

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        return quantize(x, granularity, self.scale_policy(granularity.kind))

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        return block_gemm_exact(a, w).to(out_dtype)

    # -- area kv (BEGIN kv section; only the KV area edits between these markers) --------------------------------
    def _caps_kv(self) -> CapabilityMap:
        return {}

    # -- END kv section ---------------------------------------------------------------------------------------------

    # -- area correction (BEGIN correction section) -----------------------------------------------------------------
    def _caps_correction(self) -> CapabilityMap:
        return {}

    # -- END correction section -------------------------------------------------------------------------------------

    # -- area weight_sync / e2e (BEGIN e2e section) -----------------------------------------------------------------
    def _caps_e2e(self) -> CapabilityMap:
        return {}

    # -- END e2e section --------------------------------------------------------------------------------------------
