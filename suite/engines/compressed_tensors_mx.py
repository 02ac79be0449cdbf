"""Engine ``compressed-tensors-mx``: compressed-tensors 0.17.0's real microscaling quantizers on a CPU (areas
``quantization``, ``gemm`` and ``weight_sync``, checks MX-*), the format llm-compressor writes and vLLM loads, its own
functions end to end: ``generate_gparam`` (NVFP4 global scale), ``calculate_qparams`` (block scales: MX
``generate_mx_scales`` / NVFP4 ``global_scale · amax/6`` rounded to E4M3, zero scales replaced by the E4M3 eps 0.125),
``quantize`` (``x / (scale / global_scale)``, clamp, round: torch's fp8 cast or ``FP4_E2M1_DATA.cast_to_fp4``) and
``pack_fp4_to_uint8`` (FP4 bytes). Recipes: MXFP8 (e4m3), MXFP4, NVFP4; its MX schemes have no e5m2. Its peer on
vLLM's side: :mod:`fp8rl.engines.vllm_mx`.

Not on CPU at all (docs/microscaling.md): TransformerEngine's MXFP8/NVFP4 quantizers are CUDA kernels
(``transformer_engine`` needs CUDA to import). Needs the ``conformance_vllm`` environment
(``nox -s conformance_vllm --install-only``).
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
_HINT = "needs the conformance_vllm environment (nox -s conformance_vllm --install-only)"


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
