"""torchao's float8 (the ``Float8Tensor`` workflow) behind the engine protocol: engine ``torchao``.

pytorch/ao, torchao 0.18.0, run on the CPU as it ships (in the ``conformance_checkpoint`` environment, extra ``checkpoint``):

* ``cast(x, fmt)`` (e4m3fn, e5m2, e4m3fnuz, e5m2fnuz): ``torchao/float8/float8_utils.py`` ``to_fp8_saturated`` —
  clamp to ±finfo(fmt).max, then torch's cast (declared overflow policy ``saturate``).
* ``quantize(x, g)``: ``torchao/quantization/quantize_/workflows/float8/float8_tensor.py`` ``Float8Tensor.from_hp``'s
  torch path, i.e. ``torchao/quantization/quant_primitives.py`` ``_choose_scale_float8`` (s = amax/448, no eps) and
  ``_quantize_affine_float8`` (q = clamp(fl32(x)/s), cast): tensor → ``Float8Tensor.from_hp(x, PerTensor())``;
  token → ``Float8Tensor.from_hp(x, PerRow())``; channel → ``quantize_(nn.Linear, Float8WeightOnlyConfig(
  granularity=PerRow()))`` (``torchao/quantization/quant_api.py``), the weight the module then holds; group →
  ``Float8Tensor.from_hp(x, PerGroup(G))``; block → ``Float8Tensor.from_hp(x, PerBlock([Bm, Bn]))``. The engine
  returns the Float8Tensor's ``qdata`` (as uint8 codes) and ``scale`` (fp32 dequant multipliers). Declared preset:
  ``torchao_float8`` for every kind.
* ``checkpoint_write``: the same ``Float8Tensor.from_hp(w, PerBlock([128, 128]))`` on each projection, in the
  DeepSeek-V3 ``weight_scale_inv`` file layout of fp8rl's writer (names, exclusions, ``quantization_config``:
  ``fp8rl.reference.weight_sync.quantize_state_dict`` with torchao as its block quantizer; torchao has no writer of
  that format of its own). The BF16 weight goes to torchao as it is (a BF16 model quantized with torchao: the scale in
  bf16, the quotient in fp32); the glue, named by :meth:`TorchaoEngine.instrument_notes`: each weight is zero-padded
  to multiples of 128 (cropped after).

What it does not run, with the reasons in ``capabilities()``: the blockwise prototypes (``prototype/
blockwise_fp8_training/kernels.py`` imports Triton at module level; ``kernel/blockwise_quantization.py``
``fp8_blockwise_*_quant`` / ``blockwise_fp8_gemm`` raise "unsupported without triton"), the GEMMs, a weight sync,
the KV cache, rollouts. Inputs it cannot take: non-divisible group/block shapes (``PerGroup`` /
``PerBlock`` assert divisibility; the op raises Unsupported). bf16/fp16 inputs run: torchao computes their scale in
the input dtype and the quotient in fp32, the preset's ``compute_dtype="scale_input"`` (docs/torchao.md).
"""

from __future__ import annotations

from typing import Any

import torch
from fp8rl import capabilities
from fp8rl.capabilities import ELEMENT_FORMATS, QUANT_KINDS
from fp8rl.engine import CapabilityMap, Engine, Unsupported, import_failure
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor

TORCHAO_VERSION = "0.18.0"
PRESET = "torchao_float8"
_HINT = ("needs torchao (the conformance_checkpoint environment: nox -s conformance_checkpoint --install-only; "
         "extra 'checkpoint')")
_FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e4m3fnuz": torch.float8_e4m3fnuz,
        "e5m2fnuz": torch.float8_e5m2fnuz}
_TRITON = "torchao's {what} is a Triton kernel (torchao/{path}); this CPU environment has no Triton ({err})"
_NOT_TORCHAO = ("torchao has no {what}")


class TorchaoEngine(Engine):
    """torchao 0.18.0 float8: ``to_fp8_saturated``, ``Float8Tensor.from_hp`` (PerTensor, PerRow, PerGroup, PerBlock),
    ``Float8WeightOnlyConfig``; blockwise checkpoints through ``Float8Tensor.from_hp(PerBlock([128, 128]))``."""

    name = "torchao"
    description = (f"torchao {TORCHAO_VERSION} float8: Float8Tensor.from_hp (PerTensor/PerRow/PerGroup/PerBlock, "
                   "_choose_scale_float8 + _quantize_affine_float8), Float8WeightOnlyConfig, to_fp8_saturated")

    def __init__(self) -> None:
        self._api: dict[str, Any] = {}
        self._version = ""
        self._reason = import_failure("torchao.quantization.quantize_.workflows.float8.float8_tensor", _HINT)
        if self._reason is None:
            try:
                import torchao
                from torchao.float8.float8_utils import to_fp8_saturated
                from torchao.quantization import Float8WeightOnlyConfig, quantize_
                from torchao.quantization.granularity import PerBlock, PerGroup, PerRow, PerTensor
                from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor
            except Exception as exc:  # noqa: BLE001 - any import failure makes the engine unavailable
                self._reason = f"torchao does not import ({type(exc).__name__}: {exc}); {_HINT}"
            else:
                self._version = torchao.__version__
                self._api = {"to_fp8_saturated": to_fp8_saturated, "Float8Tensor": Float8Tensor,
                             "quantize_": quantize_, "Float8WeightOnlyConfig": Float8WeightOnlyConfig,
                             "PerTensor": PerTensor, "PerRow": PerRow, "PerGroup": PerGroup, "PerBlock": PerBlock}

    # -- identity ------------------------------------------------------------------------------------------------
    def version(self) -> str:
        return f"torchao {self._version}" if self._api else "torchao not installed"

    def instrument_notes(self) -> list[str]:
        return ["checkpoint_write zero-pads each weight to multiples of 128 for PerBlock([128, 128]) (torchao "
                "asserts divisibility) and crops codes and scales back: a zero never raises a block's amax, so each "
                "partial edge tile gets torchao's formula on its real elements",
                "checkpoint_write uses fp8rl's DeepSeek-V3 file layout and quantization_config "
                "(fp8rl.reference.weight_sync / checkpoint): torchao writes no such checkpoint itself"]

    def _triton_reason(self) -> str:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return str(exc)
        return "Triton is installed but these kernels are not wired"

    def capabilities(self) -> CapabilityMap:
        if not self._api:
            reason = self._reason or _HINT
            return dict.fromkeys(capabilities.CAPABILITIES, reason)
        err = self._triton_reason()
        caps: CapabilityMap = {}
        for key in capabilities.CAPABILITIES:
            caps[key] = "not part of torchao's float8 workflow"
        for f in ELEMENT_FORMATS:
            caps[f"cast.{f}"] = True
        caps["cast.bf16"] = _NOT_TORCHAO.format(what="fp32 → bf16 rounding of its own (it is torch's .to(bfloat16))")
        for k in QUANT_KINDS:
            caps[f"quantize.{k}"] = True
        caps["quantize_nonfinite"] = True
        caps["gemm.block"] = _TRITON.format(what="blockwise_fp8_gemm (Float8Tensor's 1x128 x 128x128 linear)",
                                            path="kernel/blockwise_quantization.py", err=err)
        for k in ("tensor", "row"):
            caps[f"gemm.{k}"] = ("not wired: torchao's per-tensor / row-wise Float8Tensor linear is "
                                 "addmm_float8_unwrapped_inference (torchao/float8/inference.py), i.e. torch._scaled_mm "
                                 "itself, which the 'torch' engine's gemm checks judge on this CPU")
        kv = _NOT_TORCHAO.format(what="FP8 KV cache (its float8 workflow quantizes linear weights and activations)")
        for k in capabilities.keys("kv"):
            caps[k] = kv
        corr = _NOT_TORCHAO.format(what="rollout correction (it is a quantization library, not an RL trainer)")
        for k in capabilities.keys("correction") + capabilities.keys("learning"):
            caps[k] = corr
        caps["weight_sync"] = ("torchao has no weight sync: quantize_ swaps nn.Linear weights for Float8Tensors in "
                               "place; its blockwise-FP8 weights are judged as a checkpoint writer (checkpoint.write)")
        roll = _NOT_TORCHAO.format(what="rollout engine (generation is the model's own forward; not wired)")
        for k in capabilities.keys("e2e"):
            caps[k] = roll
        caps["checkpoint.write"] = True
        caps["checkpoint.load"] = _NOT_TORCHAO.format(
            what="loader of DeepSeek-V3 weight_scale_inv checkpoints (its own format is a pickled Float8Tensor "
                 "state dict / safetensors with torchao metadata)")
        caps["checkpoint.score"] = _NOT_TORCHAO.format(what="loader of DeepSeek-V3 weight_scale_inv checkpoints, "
                                                            "so no loaded model to score with")
        caps["checkpoint.attention_scales"] = _NOT_TORCHAO.format(what="FP8 KV cache")
        for k in capabilities.keys(prefix="mx_"):
            caps[k] = "torchao's microscaling formats (prototype.mx_formats to_mx) are the 'torchao-mx' engine"
        return caps

    # -- declared numerics ---------------------------------------------------------------------------------------
    def cast_overflow(self, fmt: str) -> str:
        if fmt not in _FP8:
            raise Unsupported(f"torchao casts to no {fmt}")
        return "saturate"

    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind not in QUANT_KINDS:
            raise ValueError(f"kind: expected one of {', '.join(QUANT_KINDS)}, got {kind!r}")
        return get_policy(PRESET)

    # -- ops -----------------------------------------------------------------------------------------------------
    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """``to_fp8_saturated(x, fp8 dtype)`` as uint8 codes."""
        if fmt not in _FP8:
            raise Unsupported(f"torchao casts to no {fmt}")
        return self._api["to_fp8_saturated"](x, _FP8[fmt]).view(torch.uint8).reshape(x.shape)

    def _granularity(self, x: torch.Tensor, g: Granularity) -> Any:
        a = self._api
        if g.kind == "tensor":
            return a["PerTensor"]()
        if g.kind in ("token", "channel"):
            return a["PerRow"]()
        if g.kind == "group":
            if x.shape[-1] % g.size[1]:
                raise Unsupported(f"torchao's PerGroup({g.size[1]}) asserts that the last dimension is a multiple of "
                                  f"the group size (get_block_size), got shape {tuple(x.shape)}")
            return a["PerGroup"](g.size[1])
        bm, bn = g.size
        if x.shape[0] % bm or x.shape[1] % bn:
            raise Unsupported(f"torchao's PerBlock([{bm}, {bn}]) asserts that the shape is a multiple of the block "
                              f"(get_block_size), got shape {tuple(x.shape)}")
        return a["PerBlock"]([bm, bn])

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        """``Float8Tensor.from_hp`` (channel: ``quantize_`` with ``Float8WeightOnlyConfig(PerRow())``) → (qdata as
        uint8 codes, fp32 scale in the protocol's shape)."""
        g = granularity
        shape = g.check_shape(tuple(x.shape))
        gran = self._granularity(x, g)
        if g.kind == "channel":
            t = self._weight_only(x, gran)
        else:
            t = self._api["Float8Tensor"].from_hp(x.detach(), float8_dtype=torch.float8_e4m3fn, granularity=gran)
        codes = t.qdata.contiguous().view(torch.uint8).reshape(shape)
        scale = t.scale.detach().to(torch.float32).contiguous().reshape(g.scale_shape(shape))
        return QuantizedTensor(codes, scale, g, get_policy(PRESET))

    def _weight_only(self, w: torch.Tensor, gran: Any) -> Any:
        """The Float8Tensor an ``nn.Linear`` holding ``w`` (N, K) holds after ``quantize_(module,
        Float8WeightOnlyConfig(granularity=gran))``."""
        n, k = w.shape
        lin = torch.nn.Linear(k, n, bias=False, dtype=w.dtype)
        with torch.no_grad():
            lin.weight = torch.nn.Parameter(w.detach(), requires_grad=False)
        cfg = self._api["Float8WeightOnlyConfig"](weight_dtype=torch.float8_e4m3fn, granularity=gran,
                                                  set_inductor_config=False)
        self._api["quantize_"](lin, cfg)
        return lin.weight

    # -- area checkpoint ------------------------------------------------------------------------------------------
    def _block_quantize(self, w: torch.Tensor, g: Granularity) -> QuantizedTensor:
        """The writer's block quantizer: ``Float8Tensor.from_hp(w, PerBlock([Bm, Bn]))`` of the BF16 weight (in its own
        dtype: the scale is bf16 arithmetic, the preset's compute_dtype="scale_input") zero-padded to multiples of
        the block (instrument_notes), codes and scales cropped back."""
        bm, bn = g.size
        n, k = w.shape
        pn, pk = -(-n // bm) * bm, -(-k // bn) * bn
        padded = torch.zeros(pn, pk, dtype=w.dtype)
        padded[:n, :k] = w.detach()
        t = self._api["Float8Tensor"].from_hp(padded, float8_dtype=torch.float8_e4m3fn,
                                              granularity=self._api["PerBlock"]([bm, bn]))
        codes = t.qdata.view(torch.uint8)[:n, :k].contiguous()
        scale = t.scale.detach().to(torch.float32).reshape(pn // bm, pk // bn).contiguous()
        return QuantizedTensor(codes, scale, g, get_policy(PRESET))

    def checkpoint_write(self, out_dir: Any, config: Any, state_dict: Any) -> Any:
        """A blockwise-FP8 checkpoint (128×128, ``*_weight_scale_inv``) whose codes and scales are torchao's."""
        from fp8rl.reference import checkpoint as ck
        from fp8rl.reference import weight_sync as ws

        spec = ck.CheckpointSpec(policy=get_policy(PRESET))
        tensors = ws.quantize_state_dict(state_dict, spec.recipe(), quantize_fn=self._block_quantize)
        return ck.write_tensors(out_dir, config, tensors, ck.quantization_config(spec, ck.ignored_modules(state_dict,
                                                                                                         spec)))
