"""compressed-tensors' FP8 float-quantized path behind the engine protocol (engine ``compressed-tensors``).

compressed-tensors 0.20.1 (github.com/vllm-project/compressed-tensors, formerly neuralmagic/compressed-tensors) is
the format llm-compressor writes and vLLM loads. The adapter calls the library's own functions, with these
upstream paths (all under ``src/compressed_tensors/``):

* scale: ``quantization/utils/helpers.py`` ``calculate_qparams(min, max, args)``: s = max(|min|, |max|)/448 in
  the dtype of min/max (the weight's: bf16 weights → bf16 arithmetic), a scale that is exactly 0 replaced by
  ``_get_dtype_eps`` = ``torch.finfo(dtype).eps`` (step 5), zero point 0 (fp8);
* codes: ``quantization/lifecycle/forward.py`` ``quantize(x, scale, zero_point, args, dtype=float8_e4m3fn)``
  (→ ``forward_helpers.py`` ``_process_block`` / ``_process_group`` / ``_apply_quantize_op`` → ``_quantize``:
  q = x/s in x's dtype, q += zero_point, clamp ±448, torch's cast); ``dequantize`` and ``fake_quantize`` of the
  same file are exposed as :meth:`CompressedTensorsEngine.ct_dequantize` / :meth:`ct_fake_quantize` for the
  engine tests;
* min/max: compressed-tensors does not calibrate static weights — llm-compressor's min-max observer does. For
  ``tensor`` and ``group`` the adapter calls compressed-tensors' own reduction ``compute_dynamic_scales_and_zp``
  (``quantization/utils/helpers.py``, its dynamic-activation path: ``aminmax`` over the tensor, ``amin``/``amax``
  over each 1×G group), which then calls ``calculate_qparams``; for ``channel`` (per row) and ``block`` (per
  Bn×Bk tile of the weight zero-padded by compressed-tensors' ``maybe_pad_tensor_for_block_quant``, the padding
  its compressor applies; ``calculate_qparams`` includes 0 in every range, so the padding cannot change a scale)
  the adapter reduces with ``torch.amin``/``amax`` as the min-max observer does, then calls ``calculate_qparams``;
* ``weight_sync``: the BF16 cast of each projection (fp8rl's recipe decides which: routers, shared-expert gates,
  embeddings, norms and ``lm_head`` stay BF16) gets 128×128 block qparams as above and is serialized by
  ``compressors/naive_quantized/base.py`` ``FloatQuantizationCompressor.compress`` (the ``float-quantized``
  compressor: ``weight`` e4m3 codes + ``weight_scale`` in the weight's dtype, zero point dropped). The protocol's
  names are the blockwise convention, so ``<m>.weight_scale`` is returned as ``<m>.weight_scale_inv`` (fp32, exact
  from bf16) — the same dequant multiplier under the name vLLM's ``Fp8Config`` reads;
* ``checkpoint_write``: a compressed-tensors checkpoint (``quant_method: compressed-tensors``, ``format:
  float-quantized``, preset scheme ``FP8_BLOCK``: 128×128 weights, dynamic 1×128 activations) written the way
  llm-compressor writes one: the state dict as a module tree (``torch.nn.Linear`` for every projection, router and
  ``lm_head``), ``quantization/lifecycle/apply.py`` ``apply_quantization_config`` (targets ``Linear``, ignore
  ``lm_head`` and the routers), block qparams as above into each module's ``weight_scale`` /
  ``weight_zero_point``, ``ModelCompressor.from_pretrained_model`` + ``compress_model``
  (``compressors/model_compressors/model_compressor.py``), the compressed state dict saved as safetensors and
  ``ModelCompressor.update_config`` writing ``quantization_config``. fp32 masters are cast to BF16 first.

Declared policy: preset ``compressed_tensors_fp8`` for tensor, channel, group and block (fp8rl.reference.presets;
``zero_amax="scale_dtype_eps"``, ``compute_dtype="input"``). Needs the ``conformance_checkpoint`` environment
(``nox -s conformance_checkpoint --install-only``; the ``conformance_vllm`` one has it too); elsewhere every capability is unavailable with the import error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from fp8rl import capabilities
from fp8rl.engine import CapabilityMap, Engine, Unsupported
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor

CT_VERSION = "0.20.1"
_HINT = "needs the conformance_checkpoint environment (nox -s conformance_checkpoint --install-only)"
POLICY = "compressed_tensors_fp8"
KINDS = ("tensor", "channel", "group", "block")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CompressedTensorsEngine(Engine):
    """compressed-tensors 0.20.1's FP8 (float-quantized) quantizer, compressor and checkpoint writer (CPU)."""

    name = "compressed-tensors"
    description = (f"compressed-tensors {CT_VERSION}: calculate_qparams + quantize (tensor, channel, group, block), "
                   "FloatQuantizationCompressor (weight sync), ModelCompressor (checkpoint writer)")

    def __init__(self) -> None:
        self._ct: dict[str, Any] | None = None
        self._reason: str | None = None
        try:
            import compressed_tensors
            from compressed_tensors.compressors import ModelCompressor
            from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
            from compressed_tensors.quantization import (
                QuantizationArgs,
                QuantizationConfig,
                apply_quantization_config,
                preset_name_to_scheme,
            )
            from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
            from compressed_tensors.quantization.utils.helpers import (
                calculate_qparams,
                compute_dynamic_scales_and_zp,
                maybe_pad_tensor_for_block_quant,
            )

            self._ct = dict(version=compressed_tensors.__version__, args=QuantizationArgs, qparams=calculate_qparams,
                            dynamic_qparams=compute_dynamic_scales_and_zp, pad=maybe_pad_tensor_for_block_quant,
                            quantize=quantize, dequantize=dequantize, fake_quantize=fake_quantize,
                            compressor=FloatQuantizationCompressor, model_compressor=ModelCompressor,
                            config=QuantizationConfig, apply=apply_quantization_config, preset=preset_name_to_scheme)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
            self._reason = f"compressed-tensors does not import ({type(exc).__name__}: {exc}); {_HINT}"

    def version(self) -> str:
        return f"compressed-tensors {self._ct['version']}" if self._ct else "compressed-tensors not installed"

    # -- capabilities ------------------------------------------------------------------------------------------
    def capabilities(self) -> CapabilityMap:
        if self._ct is None:
            return dict.fromkeys(capabilities.CAPABILITIES, self._reason or _HINT)
        caps: CapabilityMap = dict.fromkeys(
            capabilities.CAPABILITIES, "compressed-tensors is a quantization format library: it has no op for this "
                                       "capability (engine vllm runs what it loads)")
        caps.update(dict.fromkeys(capabilities.keys(prefix="cast."),
                                  "compressed-tensors has no cast op of its own (it casts with torch's "
                                  ".to(float8_e4m3fn): engine torch)"))
        caps.update(dict.fromkeys(capabilities.keys(area="gemm"),
                                  "compressed-tensors has no FP8 GEMM (it fake-quantizes; the FP8 GEMMs are vLLM's "
                                  "kernels)"))
        caps.update(dict.fromkeys((f"quantize.{k}" for k in KINDS), True))
        caps["quantize.token"] = ("compressed-tensors' TOKEN strategy is dynamic-activation only and reduces the "
                                  "dims after (batch, seq) of a 3-D activation: a 2-D (M, K) input gets one "
                                  "per-tensor scale (compute_dynamic_scales_and_zp), not one per row")
        caps["quantize_nonfinite"] = True
        caps.update(dict.fromkeys(capabilities.keys(prefix="mx_"),
                                  "compressed-tensors' microscaling recipes: engine compressed-tensors-mx"))
        caps["weight_sync"] = True
        # the adapter picks the quantized names with fp8rl's filter (compressed-tensors selects nn.Linear modules, a
        # state dict has none): what each family exercises here is compressed-tensors' quantizer and compressor
        caps.update(dict.fromkeys(("weight_sync.llama", "weight_sync.mla", "weight_sync.multimodal"), True))
        caps["weight_sync.fused-experts"] = (
            "compressed-tensors quantizes nn.Linear weights (targets ['Linear']); its BLOCK strategy takes 2-D weights: "
            "a packed (E, N, K) expert tensor raises RuntimeError \"shape '[0, 128, 2, 128]' is invalid\" in its "
            "block reshape (0.17.0 and 0.20.1; measured on tiny-qwen3-moe-fused, packed experts must be unfused first)")
        caps["checkpoint.write"] = True
        caps["checkpoint.write_channel"] = True
        caps["checkpoint.load"] = ("compressed-tensors loads only its own format (ModelCompressor.decompress_model "
                                   "under transformers' CompressedTensorsHfQuantizer); the loader checks feed "
                                   "blockwise-FP8 (quant_method fp8) checkpoints")
        caps["checkpoint.score"] = ("compressed-tensors runs no model of its own: the model that loads its files is "
                                    "transformers' (engine hf-fp8, checkpoint.score)")
        caps["checkpoint.attention_scales"] = "compressed-tensors has no FP8 KV cache to run (vLLM's)"
        return caps

    def instrument_notes(self) -> list[str]:
        return ["min/max of channel and block weights: torch.amin/amax per row / per zero-padded tile (llm-compressor's "
                "min-max observer is not installed); compressed-tensors' calculate_qparams, quantize and compressors "
                "do the rest"]

    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind not in KINDS:
            raise Unsupported(f"compressed-tensors: no {kind} strategy for static FP8 quantization here")
        return get_policy(POLICY)

    # -- quantization ------------------------------------------------------------------------------------------
    def _args(self, g: Granularity, *, dynamic: bool = False) -> Any:
        """compressed-tensors' QuantizationArgs of FP8 weights (num_bits 8, type float, symmetric) for ``g``."""
        kw: dict[str, Any] = dict(num_bits=8, type="float", symmetric=True, strategy=g.kind, dynamic=dynamic)
        if g.kind == "group":
            kw["group_size"] = g.size[1]
        elif g.kind == "block":
            kw["block_structure"] = list(g.size)
        return self._ct["args"](**kw)  # type: ignore[index]

    def _qparams(self, x: torch.Tensor, g: Granularity) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """(args, scale, zero point) of ``x`` (its own dtype) for ``g``: min/max per group (see the module
        docstring), then ``calculate_qparams``."""
        ct = self._ct
        assert ct is not None
        if g.kind not in KINDS:
            raise Unsupported(f"compressed-tensors: no static FP8 {g.kind} strategy")
        args = self._args(g)
        if g.kind == "tensor":
            scale, zp = ct["dynamic_qparams"](value=x, args=self._args(g, dynamic=True), module=None)
        elif g.kind == "group":
            if x.shape[-1] % g.size[1]:
                raise Unsupported(f"compressed-tensors' group strategy needs K divisible by the group size "
                                  f"{g.size[1]} (_process_group raises for K = {x.shape[-1]})")
            scale, zp = ct["dynamic_qparams"](value=x, args=self._args(g, dynamic=True), module=None)
        elif g.kind == "channel":
            scale, zp = ct["qparams"](x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True), args)
        else:
            bh, bw = g.size
            xp = ct["pad"](x, (bh, bw))
            tiles = xp.reshape(xp.shape[0] // bh, bh, xp.shape[1] // bw, bw)
            scale, zp = ct["qparams"](tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3)), args)
        return args, scale, zp

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        """``calculate_qparams`` then ``quantize(..., dtype=float8_e4m3fn)`` in x's own dtype (fp32, bf16, fp16);
        the codes are the fp8 tensor's bytes, the scale its exact fp32 value."""
        if self._ct is None:
            raise Unsupported(self._reason or _HINT)
        if x.dtype not in _INPUT_DTYPES:
            raise Unsupported(f"x: dtype {x.dtype}")
        xc = x.detach().to("cpu").contiguous()
        args, scale, zp = self._qparams(xc, granularity)
        q = self._ct["quantize"](xc, scale, zp, args, dtype=torch.float8_e4m3fn)
        s = scale.to(torch.float32).reshape(granularity.scale_shape(tuple(x.shape))).contiguous()
        return QuantizedTensor(q.contiguous().view(torch.uint8), s, granularity, self.scale_policy(granularity.kind))

    def ct_dequantize(self, qt: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        """compressed-tensors' ``dequantize`` of a QuantizedTensor whose scale is held in ``dtype`` (the library
        keeps the scale in the weight's dtype and dequantizes as ``codes.to(scale.dtype) * scale``)."""
        g = qt.granularity
        scale = qt.scale.to(dtype)
        if g.kind == "tensor":
            scale = scale.reshape(1)
        codes = qt.codes.view(torch.float8_e4m3fn)
        return self._ct["dequantize"](codes, scale, None, self._args(g))  # type: ignore[index]

    def ct_fake_quantize(self, x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
        """compressed-tensors' ``fake_quantize`` (its fused quantize → dequantize, ``_quantize_dequantize``) with the
        qparams :meth:`quantize` uses."""
        xc = x.detach().to("cpu").contiguous()
        args, scale, zp = self._qparams(xc, granularity)
        return self._ct["fake_quantize"](xc, scale, zp, args)  # type: ignore[index]

    # -- weight sync -------------------------------------------------------------------------------------------
    def _block_module_state(self, w: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor]]:
        g = Granularity.block(128)
        args, scale, zp = self._qparams(w, g)
        return args, {"weight": w, "weight_scale": scale, "weight_zero_point": zp}

    def weight_sync(self, state_dict: Any) -> dict[str, torch.Tensor]:
        """The float-quantized compressor's output per projection (see the module docstring), scales renamed to
        the protocol's ``*_weight_scale_inv`` as fp32; every other tensor its BF16 cast."""
        if self._ct is None:
            raise Unsupported(self._reason or _HINT)
        from fp8rl.reference import weight_sync as ws

        recipe = ws.WeightSyncRecipe(policy=self.scale_policy("block"))
        scheme = self._ct["preset"]("FP8_BLOCK", ["Linear"])
        out: dict[str, torch.Tensor] = {}
        for name, t in state_dict.items():
            if not ws.is_quantized_name(name, tuple(t.shape), recipe):
                out[name] = t.to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.bfloat16 else t
                continue
            _, module = self._block_module_state(t.detach().to("cpu", torch.bfloat16).contiguous())
            packed = self._ct["compressor"].compress(module, scheme)
            extra = sorted(set(packed) - {"weight", "weight_scale"})
            if extra:
                raise ValueError(f"{name}: the float-quantized compressor returned unexpected entries {extra}")
            out[name] = packed["weight"]
            out[ws.scale_name(name)] = packed["weight_scale"].to(torch.float32)
        return out

    # -- checkpoint writer -------------------------------------------------------------------------------------
    def _module_tree(self, state_dict: dict[str, torch.Tensor], linear: set[str]) -> torch.nn.Module:
        """The state dict as modules: ``torch.nn.Linear`` at every module of ``linear``, every other tensor a
        parameter of a plain module at its path (what ``apply_quantization_config`` matches targets against)."""
        root = torch.nn.Module()

        def at(path: str) -> torch.nn.Module:
            m = root
            for part in path.split(".") if path else ():
                if not hasattr(m, part):
                    m.add_module(part, torch.nn.Module())
                m = getattr(m, part)
            return m

        for name, t in state_dict.items():
            module, _, leaf = name.rpartition(".")
            if module in linear:
                parent, _, child = module.rpartition(".")
                pm = at(parent)
                if not isinstance(getattr(pm, child, None), torch.nn.Linear):
                    w = state_dict[module + ".weight"]
                    pm.add_module(child, torch.nn.Linear(w.shape[1], w.shape[0], bias=f"{module}.bias" in state_dict,
                                                         device="meta"))
                getattr(pm, child)._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
            else:
                at(module).register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
        return root

    def checkpoint_write(self, out_dir: Any, config: Any, state_dict: Any) -> Path:
        """A compressed-tensors FP8_BLOCK checkpoint of ``state_dict`` (BF16, or fp32 masters cast to BF16 first)
        through apply_quantization_config + ModelCompressor (see the module docstring). Returns the directory."""
        return self._write_checkpoint(out_dir, config, state_dict, "FP8_BLOCK", Granularity.block(128))

    def checkpoint_write_channel(self, out_dir: Any, config: Any, state_dict: Any) -> Path:
        """A compressed-tensors FP8_DYNAMIC checkpoint (llm-compressor's most common FP8 scheme: channel-strategy
        weights, one BF16 ``weight_scale`` per output row, dynamic per-token FP8 activations) of ``state_dict``, the
        same way as :meth:`checkpoint_write`. Returns the directory."""
        return self._write_checkpoint(out_dir, config, state_dict, "FP8_DYNAMIC", Granularity.channel())

    def _write_checkpoint(self, out_dir: Any, config: Any, state_dict: Any, preset: str,
                          granularity: Granularity) -> Path:
        """The state dict's BF16 cast as a module tree, compressed-tensors' preset scheme ``preset`` applied to
        every projection (ignore: ``lm_head`` and the routers), the weights' qparams for ``granularity`` (see
        :meth:`_qparams`) installed, ``ModelCompressor`` compressing, its state dict saved and its
        ``update_config`` writing ``quantization_config``."""
        if self._ct is None:
            raise Unsupported(self._reason or _HINT)
        import re

        from fp8rl.reference import weight_sync as ws
        from safetensors.torch import save_file

        ct = self._ct
        sd = {k: (v.detach().to("cpu", torch.bfloat16) if v.is_floating_point() else v.detach().cpu()).contiguous()
              for k, v in state_dict.items()}
        recipe = ws.WeightSyncRecipe(policy=self.scale_policy(granularity.kind))
        quantized = {n[: -len(".weight")] for n, t in sd.items() if ws.is_quantized_name(n, tuple(t.shape), recipe)}
        kept = sorted(n[: -len(".weight")] for n, t in sd.items()
                      if t.dim() == 2 and (n == "lm_head.weight" or re.search(r"(^|\.)mlp\.(gate|shared_expert_gate)"
                                                                              r"\.weight$", n)))
        model = self._module_tree(sd, quantized | set(kept))
        scheme = ct["preset"](preset, ["Linear"])
        ct["apply"](model, ct["config"](config_groups={"group_0": scheme}, ignore=kept))
        for _, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            _, scale, zp = self._qparams(module.weight.data, granularity)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))
        compressor = ct["model_compressor"].from_pretrained_model(model)
        compressor.compress_model(model)
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = {k: v for k, v in dict(config).items() if k != "quantization_config"}
        cfg["torch_dtype"] = "bfloat16"
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        compressor.update_config(str(out))
        return out
