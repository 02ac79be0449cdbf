"""Real microscaling quantizers that run on a CPU, behind the engine protocol (areas ``quantization``
and ``gemm``, checks MX-*).

* ``compressed-tensors-mx``: compressed-tensors 0.17.0 (the format llm-compressor writes and vLLM loads), its own
  functions end to end: ``generate_gparam`` (NVFP4 global scale), ``calculate_qparams`` (block scales: MX
  ``generate_mx_scales`` / NVFP4 ``global_scale · amax/6`` rounded to E4M3, zero scales replaced by the E4M3 eps
  0.125), ``quantize`` (``x / (scale / global_scale)``, clamp, round: torch's fp8 cast or ``FP4_E2M1_DATA.cast_to_fp4``)
  and ``pack_fp4_to_uint8`` (FP4 bytes). Recipes: MXFP8 (e4m3), MXFP4, NVFP4; its MX schemes have no e5m2.
* ``vllm-mx``: vLLM 0.32.0's CPU paths: ``mxfp8_e4m3_quantize`` (on CPU: ``_mxfp8_e4m3_quantize_torch``) and
  ``dequant_mxfp8_to_bf16`` for MXFP8; ``ref_nvfp4_quant`` (the NVFP4 emulation quantizer) and
  ``dequantize_to_dtype`` (its emulation dequantizer, ``swizzle=False``) for NVFP4. vLLM's packing kernels
  (``scaled_fp4_quant``) and every MX/NVFP4 GEMM (CUTLASS, FlashInfer, Marlin) are CUDA-only; ``ref_nvfp4_quant``
  returns FP4 *values*, which the adapter turns into codes and packs low nibble first — the layout vLLM's
  ``break_fp4_bytes`` reads (the adapter checks its own bytes with it). The NVFP4 global scale is an input in
  vLLM (a checkpoint's ``input_global_scale``/``weight_global_scale``, which compressed-tensors writes as 448·6/amax):
  the adapter passes that formula's fp32 value, computed as compressed-tensors does (fl(fl(1/amax)·2688)).

Not on CPU at all (docs/microscaling.md): TransformerEngine's MXFP8/NVFP4 quantizers are CUDA kernels
(``transformer_engine`` needs CUDA to import); torchao's MX/NVFP4 tensors are not installed in any tier.
Both adapters need the ``conformance_vllm`` environment (``nox -s conformance_vllm --install-only``).
"""

from __future__ import annotations

from typing import Any

import torch
from fp8rl import capabilities
from fp8rl.capabilities import MX_RECIPES, MX_SYNC_RECIPES
from fp8rl.engine import CapabilityMap, Engine, Unsupported
from fp8rl.reference import microscaling as mx
from fp8rl.reference import mx_weight_sync as mxws

CT_VERSION = "0.17.0"
VLLM_VERSION = "0.32.0"
_HINT = "needs the conformance_vllm environment (nox -s conformance_vllm --install-only)"


def _codes_from_fp4_values(v: torch.Tensor) -> torch.Tensor:
    """FP4 grid values (fp32) → 4-bit codes: exact lookups (every input is a grid value)."""
    mag = v.abs()
    grid = torch.tensor(mx.E2M1_VALUES)
    idx = (mag.unsqueeze(-1) == grid).to(torch.uint8).argmax(dim=-1).to(torch.uint8)
    if not bool((grid[idx.long()] == mag).all()):
        raise ValueError("values: not on the E2M1 grid")
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


class CompressedTensorsMXEngine(Engine):
    """compressed-tensors 0.17.0's MXFP8, MXFP4 and NVFP4 quantizers (CPU)."""

    name = "compressed-tensors-mx"
    description = (f"compressed-tensors {CT_VERSION}: generate_gparam, calculate_qparams, quantize, "
                   "pack_fp4_to_uint8 (MXFP8 e4m3, MXFP4, NVFP4)")
    POLICIES = {"mxfp8_e4m3": "ct_mxfp8", "mxfp4": "ct_mxfp4", "nvfp4": "ct_nvfp4"}

    def __init__(self) -> None:
        self._ct: Any = None
        self._reason: str | None = None
        try:
            import compressed_tensors
            from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor
            from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
            from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
            from compressed_tensors.quantization import QuantizationScheme, quant_scheme
            from compressed_tensors.quantization.lifecycle.forward import quantize
            from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

            # FP4_E2M1_DATA.cast_to_fp4 is decorated with @torch.compile: on CPU inductor compiles it per shape
            # (~40 s per run); eager runs the same comparisons and assignments, exactly (instrument_notes says so)
            torch._dynamo.config.disable = True
            self._ct = dict(version=compressed_tensors.__version__, pack=pack_fp4_to_uint8, quantize=quantize,
                            qparams=calculate_qparams, gparam=generate_gparam, schemes=quant_scheme,
                            compressors={"mxfp8_e4m3": MXFP8QuantizationCompressor, "nvfp4": NVFP4PackedCompressor},
                            scheme_cls=QuantizationScheme)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
            self._reason = f"compressed-tensors does not import ({type(exc).__name__}: {exc}); {_HINT}"

    def version(self) -> str:
        return f"compressed-tensors {self._ct['version']}" if self._ct else "compressed-tensors not installed"

    def instrument_notes(self) -> list[str]:
        return ["torch.compile disabled (torch._dynamo.config.disable): compressed-tensors' @torch.compile "
                "cast_to_fp4 runs eagerly — the same elementwise comparisons and assignments, no inductor codegen"]

    def capabilities(self) -> CapabilityMap:
        if self._ct is None:
            return dict.fromkeys(capabilities.keys(prefix="mx_"), self._reason or _HINT)
        caps: CapabilityMap = {f"mx_gemm.{r}": "compressed-tensors has no microscaled GEMM (it fake-quantizes; "
                                                "the GEMMs are vLLM's CUDA kernels)" for r in MX_RECIPES}
        for r in MX_RECIPES:
            caps[f"mx_quantize.{r}"] = True if r in self.POLICIES else \
                "compressed-tensors' MX schemes (MXFP8, MXFP4) use E4M3 and E2M1 elements only, no e5m2"
        caps["mx_quantize.nondivisible"] = ("not run: the adapter hands compressed-tensors whole groups only "
                                            "(its group strategy warns on a ragged last group, strategy_cdiv)")
        caps.update(dict.fromkeys((f"mx_weight_sync.{r}" for r in MX_SYNC_RECIPES), True))
        return caps

    def mx_policy(self, recipe: str) -> mx.MXPolicy:
        if recipe not in self.POLICIES:
            raise Unsupported(f"compressed-tensors has no {recipe} scheme")
        return mx.MX_PRESETS[self.POLICIES[recipe]]

    def _args(self, recipe: str) -> Any:
        return getattr(self._ct["schemes"], {"mxfp8_e4m3": "MXFP8", "mxfp4": "MXFP4", "nvfp4": "NVFP4"}[recipe])[
            "weights"]

    def _calibrate(self, xf: torch.Tensor, recipe: str) -> tuple[Any, Any, Any, Any]:
        """compressed-tensors' calibration of a 2-D fp32 weight: ``generate_gparam`` over the tensor (NVFP4), then
        ``calculate_qparams`` from each 1×B group's min/max → (args, scale, zero point, global scale or None)."""
        p = self.mx_policy(recipe)
        if xf.dim() != 2 or xf.shape[-1] % p.block:
            raise Unsupported(f"compressed-tensors groups: expected 2-D x with K a multiple of {p.block}, got "
                              f"{tuple(xf.shape)}")
        ct = self._ct
        args = self._args(recipe)
        rows, k = xf.shape
        groups = xf.reshape(rows, k // p.block, p.block)
        mins, maxs = groups.amin(dim=-1), groups.amax(dim=-1)
        g = ct["gparam"](xf.amin(), xf.amax()).reshape(()) if p.two_level else None
        scale, zp = ct["qparams"](mins, maxs, args, global_scale=g)
        return args, scale, zp, g

    def mx_quantize(self, x: torch.Tensor, recipe: str) -> mx.MXTensor:
        """``calculate_qparams`` per group (min/max of each 1×B group), ``quantize`` (compressed-tensors), codes from
        the returned grid values (FP8: a lossless view; FP4: ``pack_fp4_to_uint8``)."""
        p = self.mx_policy(recipe)
        ct = self._ct
        xf = x.detach().to(torch.float32)
        args, scale, zp, g = self._calibrate(xf, recipe)
        vals = ct["quantize"](xf, scale, zp, args, global_scale=g)
        if p.two_level:
            scales = scale.to(torch.float8_e4m3fn).view(torch.uint8)
        else:  # MX scales: calculate_qparams returns 2^(code − 127) as floats
            scales = (torch.log2(scale.to(torch.float64)) + 127).round().to(torch.uint8)
        if p.packed:
            data = ct["pack"](vals.to(torch.float32))
        else:
            data = vals.to(torch.float8_e4m3fn).view(torch.uint8)
        return mx.MXTensor(data.contiguous(), scales.contiguous(), None if g is None else g.to(torch.float32),
                           tuple(x.shape), p)

    def mx_weight_sync(self, state_dict: Any, recipe: str) -> dict[str, torch.Tensor]:
        """compressed-tensors writes the synced tensors: the recipe's weights (which ones is fp8rl's recipe,
        fp8rl.reference.mx_weight_sync: compressed-tensors knows no RL recipe), each cast to BF16, calibrated as
        :meth:`mx_quantize` does (``generate_gparam``, ``calculate_qparams``) and serialized by compressed-tensors'
        own compressors — ``MXFP8QuantizationCompressor.compress`` (``weight`` e4m3 + ``weight_scale`` as E8M0
        exponents, ``compress_mx_scale``) and ``NVFP4PackedCompressor.compress`` (``weight_packed`` by
        ``pack_fp4_to_uint8``, ``weight_scale`` e4m3, ``weight_global_scale``): names, dtypes, packing and scale
        storage are compressed-tensors'. Every other tensor: its BF16 cast."""
        r = mxws.get_mx_sync_recipe(recipe)
        self.mx_policy(r.mx_recipe)
        ct = self._ct
        compressor = ct["compressors"][r.mx_recipe]
        scheme = None
        out: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            if not r.quantizes(name, tuple(t.shape)):
                out[name] = t.to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.bfloat16 else t
                continue
            w = t.detach().to("cpu", torch.bfloat16)
            args, scale, zp, g = self._calibrate(w.float(), r.mx_recipe)
            scheme = scheme or ct["scheme_cls"](targets=["Linear"], weights=args)
            module = {"weight": w.float(), "weight_scale": scale, "weight_zero_point": zp}
            if g is not None:
                module["weight_global_scale"] = g.reshape(1).to(torch.float32)
            prefix = name[: -len(".weight")]
            for k, v in compressor.compress(module, scheme).items():
                out[f"{prefix}.{k}"] = v
        return out


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
