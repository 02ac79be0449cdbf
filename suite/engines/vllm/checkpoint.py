"""Engine ``vllm``, area checkpoint: how fp8rl loads FP8 checkpoints with ``vllm.LLM(model=path)``.

vLLM reads both checkpoint formats (``quant_method`` "fp8" and "compressed-tensors"). One such LLM runs at a time
(:class:`CheckpointLLM`), shared by the loader checks of one checkpoint (``checkpoint_load`` then
``checkpoint_score``); another checkpoint stops it first, and a checkpoint whose LLM failed to start is not started
again. ``checkpoint_load`` reads the weights back through each linear layer's own forward (or, for the channel-wise
FP8 kernel, from the layer's codes and scales); ``checkpoint_attention_scales`` starts its own LLM with an FP8 KV
cache and stops it. Which layouts can't load on this machine: ``checkpoint_layout_reason`` (the block layouts need
AMX). docs/checkpoint.md has the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8rl.engine import CapabilityMap, Unsupported

from ._common import _vllm_version
from .llm import generate_scheduled_together
from .pool import kv_cache_bytes, stop_at_exit_too, stop_llm


class VllmCheckpointMixin:
    """Checkpoint loading, scoring and attention scales of :class:`fp8rl.engines.vllm.VllmEngine`."""

    @staticmethod
    def _caps_checkpoint(v: str) -> CapabilityMap:
        # every CPU loads the compressed-tensors channel layout (ChannelWiseTorchFP8ScaledMMLinearKernel); the
        # block layouts need AMX tiles: checkpoint_layout_reason says which layout can't load here
        caps: CapabilityMap = {"checkpoint.load": True, "checkpoint.score": True}
        caps["checkpoint.write"] = f"vllm {v} loads FP8 checkpoints; it has no checkpoint writer"
        caps["checkpoint.attention_scales"] = True
        return caps

    #: the ``quant_method`` of the checkpoints :meth:`checkpoint_load` reads (vLLM loads both formats)
    checkpoint_formats = ("fp8", "compressed-tensors")

    def checkpoint_layout_reason(self, layout: str) -> str | None:
        """Why a checkpoint layout (fp8rl.engine.CHECKPOINT_LAYOUTS) can't load on this machine, or None. The block
        layouts (blockwise FP8, compressed-tensors block strategy) run only through ``CPUFp8BlockScaledMMKernel``,
        which requires AMX tiles; the channel layout runs through ``ChannelWiseTorchFP8ScaledMMLinearKernel`` on any
        CPU; a per-tensor file loads nowhere on CPU (``requantize_with_max_scale`` calls the
        ``_C::static_scaled_fp8_quant`` stub), which is a finding (vllm.xfails), not a skip."""
        amx = _amx_reason()
        if amx is None or layout not in ("fp8", "compressed-tensors"):
            return None
        return (f"vllm {_vllm_version()} on CPU: LLM(model=<block-FP8 checkpoint>) does not start without AMX (measured: "
                f"'CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)'): {amx} "
                "(docs/checkpoint.md)")

    def checkpoint_load(self, path: Any) -> dict[str, Any]:
        """The weights the layers of ``vllm.LLM(model=path)`` compute with, under the checkpoint's names. After
        loading, vLLM's CPU FP8 kernels VNNI-pack the codes (``convert_weight_packed``), so the bytes a layer holds
        are not the file's layout; every linear layer is instead read through its own forward: ``quant_method.apply``
        on the identity I_K gives Wᵀ as the layer's kernel dequantizes and computes it (BF16 out, fp32 accumulation
        of one product per element), split back into the checkpoint's projections by the layer's
        ``logical_widths`` and the model's ``packed_modules_mapping`` (qkv_proj → q/k/v, gate_up_proj → gate/up).
        Other parameters (embeddings, norms, a BF16 lm_head) as held. A MoE model's routed experts are packed for
        the fused-MoE kernel, which applies the activation between its two GEMMs, so no identity read-back exists:
        Unsupported (CKPT-LOAD-005 judges them through the log-probs)."""
        held = _checkpoint_llm(path).collective_rpc(_computed_weights)[0]
        if isinstance(held, str):
            raise Unsupported(held)
        return held

    def checkpoint_score(self, path: Any, tokens: Any, prompt_len: int) -> Any:
        """log π(tokens[:, t] | tokens[:, :t]) for t ≥ ``prompt_len`` under ``vllm.LLM(model=path)``: one request per
        row with ``prompt_logprobs=0`` (the logprob of each prompt token given the ones before it, from the raw
        logits), float32 (B, T − prompt_len)."""
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = _checkpoint_llm(path)
        rows = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in tokens]
        outs = generate_scheduled_together(llm, rows, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                     temperature=0.0))
        lp = torch.empty(tokens.shape[0], tokens.shape[1] - prompt_len, dtype=torch.float32)
        for i, out in enumerate(outs):
            plp = out.prompt_logprobs
            for t in range(prompt_len, tokens.shape[1]):
                lp[i, t - prompt_len] = plp[t][int(tokens[i, t])].logprob
        return lp

    def checkpoint_attention_scales(self, path: Any) -> dict[int, dict[str, float]]:
        """The q/k/v scales each attention layer of ``vllm.LLM(model=path, kv_cache_dtype="fp8")`` uses after
        loading (``_q_scale_float`` / ``_k_scale_float`` / ``_v_scale_float``, set by
        ``BaseKVCacheMethod.process_weights_after_loading``, vllm/model_executor/layers/quantization/kv_cache.py),
        layer index → {'q', 'k', 'v'}. One LLM per call, stopped before returning."""
        import os
        import re

        from vllm import LLM

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                  skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=4, kv_cache_dtype="fp8",
                  kv_cache_memory_bytes=kv_cache_bytes())
        try:
            used = llm.collective_rpc(_attention_scales)[0]
        finally:
            stop_llm(llm)
        out: dict[int, dict[str, float]] = {}
        for name, (q, k, v) in used.items():
            m = re.search(r"layers\.(\d+)\.", name)
            if m:
                out[int(m.group(1))] = {"q": q, "k": k, "v": v}
        return out


#: the capability keys of this part, as :meth:`VllmCheckpointMixin._caps_checkpoint` declares them (each carries
#: the engine-wide reason when vLLM cannot run here)
CAP_KEYS: tuple[str, ...] = tuple(VllmCheckpointMixin._caps_checkpoint(""))


def _amx_reason() -> str | None:
    """None if vLLM's CPU block-FP8 kernel can run here (its ``is_supported``: AMX tiles), else why not."""
    from fp8rl.environment import cpu_features

    if "amx" not in cpu_features():
        return "this CPU has no AMX tiles (torch.cpu._is_amx_tile_supported() is False)"
    return None


@dataclass(frozen=True)
class CheckpointLLM:
    """The ``vllm.LLM`` that checkpoint_load / checkpoint_score last started, and the checkpoint it loaded."""

    #: the running ``vllm.LLM``
    llm: Any
    #: the checkpoint directory, resolved
    path: str
    #: st_mtime_ns of its config.json (a checkpoint rewritten in place is another checkpoint)
    config_mtime_ns: int

    @property
    def key(self) -> tuple[str, int]:
        return self.path, self.config_mtime_ns


#: the one checkpoint LLM that runs now (None: none)
_current: CheckpointLLM | None = None
#: checkpoint key → the error its vllm.LLM start raised (a start that fails costs as much as one that works)
_FAILED: dict[tuple[str, int], str] = {}


def _checkpoint_llm(path: Any) -> Any:
    """``vllm.LLM(model=path)`` (BF16, eager, max_model_len 256), one at a time: the loader checks of one checkpoint
    share it (checkpoint_load then checkpoint_score), another checkpoint stops it first."""
    import os
    from pathlib import Path

    from vllm import LLM

    global _current
    key = (str(Path(path).resolve()), os.stat(Path(path) / "config.json").st_mtime_ns)
    if _current is not None and _current.key == key:
        return _current.llm
    if key in _FAILED:  # a checkpoint whose engine did not start: the same error, without another 40 s start
        raise RuntimeError(f"{_FAILED[key]} (the same checkpoint failed to start vllm.LLM before)")
    if _current is not None:
        stop_llm(_current.llm)
        _current = None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable
    try:
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                  skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=8,
                  kv_cache_memory_bytes=kv_cache_bytes())
    except Exception as exc:
        _FAILED[key] = f"{type(exc).__name__}: {exc}"
        raise
    _current = CheckpointLLM(llm, *key)
    return llm


def _release_at_exit() -> Any:
    """Hand the running checkpoint LLM (or None) to the pool's exit handler and forget it."""
    global _current
    held, _current = _current, None
    return None if held is None else held.llm


stop_at_exit_too(_release_at_exit)


def _channel_weight(mod: Any, n: int) -> Any:
    """A layer's FP8 weight with one scale per output row, as the channel-wise kernel keeps it
    (``process_fp8_weight_channel_strategy``: codes as stored, transposed to (K, N), ``weight_scale`` (N, 1) fp32,
    ``ChannelWiseTorchFP8ScaledMMLinearKernel`` multiplies the GEMM's output by them): codes × scale in fp64, exact
    (4 + 24 significant bits), (N, K). None for any other layer. Such a layer is not read through a forward: its
    GEMM quantizes the identity's rows per token with the scale fl32(1/448), whose 448 · s ≠ 1 pushes every
    product that is exactly half-way between two BF16 values to one side (measured: about 1 % of tiny-qwen3's
    values, all such ties), an artifact of the read-back, not of the weights."""
    import torch

    w, s = getattr(mod, "weight", None), getattr(mod, "weight_scale", None)
    if not (isinstance(w, torch.Tensor) and isinstance(s, torch.Tensor) and w.dtype == torch.float8_e4m3fn
            and w.dim() == 2 and s.numel() == n and tuple(s.shape) in ((n, 1), (n,))):
        return None
    codes = w.t() if getattr(w, "output_dim", 0) == 1 else w
    if codes.shape[0] != n:
        return None
    return codes.double() * s.double().reshape(n, 1)


def _computed_weights(worker) -> dict | str:
    """(in the worker) checkpoint name → the weight each linear layer computes with (``quant_method.apply`` on the
    identity, transposed, split by ``logical_widths`` or, unquantized, ``output_partition_sizes``; a channel-wise
    FP8 layer's codes × scales, exact in fp64:
    :func:`_channel_weight`), every other parameter as held; a message instead when the model has fused-MoE
    experts (no read-back)."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.get_model()
    mapping = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, torch.Tensor] = {}
    read: set[str] = set()
    for name, mod in model.named_modules():
        if hasattr(mod, "w13_weight") or type(mod).__name__ == "FusedMoE":
            return (f"{name}: vLLM's fused-MoE experts are VNNI-packed for the CPU expert kernel "
                    "(prepare_fp8_moe_layer_for_cpu), which applies the activation between its two GEMMs: the "
                    "weights cannot be read back through a forward; CKPT-LOAD-005 judges them by the log-probs")
        # a quantized layer's logical_widths; an unquantized (BF16, e.g. listed in ignore) one has none, and on CPU
        # its weight is removed once packed for the GEMM (dispatch_cpu_unquantized_gemm(remove_weight=True)): it is
        # read through the identity as well, split by its output_partition_sizes (q/k/v, gate/up: tensor parallel 1)
        widths = getattr(mod, "logical_widths", None) or (getattr(mod, "output_partition_sizes", None)
                                                           if isinstance(mod, LinearBase) else None)
        qm = getattr(mod, "quant_method", None)
        if widths is None or qm is None or not hasattr(mod, "input_size_per_partition"):
            continue
        w = _channel_weight(mod, sum(int(n) for n in widths))
        if w is None:
            eye = torch.eye(int(mod.input_size_per_partition), dtype=torch.bfloat16)
            with torch.no_grad():
                w = qm.apply(mod, eye).t().contiguous()
        prefix, _, short = name.rpartition(".")
        parts = mapping.get(short, [short]) if len(widths) > 1 else [short]
        if len(parts) != len(widths):
            return f"{name}: {len(widths)} logical widths but packed_modules_mapping lists {parts}"
        off = 0
        for part, n in zip(parts, widths):
            out[f"{prefix}.{part}.weight" if prefix else f"{part}.weight"] = w[off: off + n].clone()
            off += n
        read.add(name)
    for pname, p in model.named_parameters():
        if pname.rpartition(".")[0] not in read:
            out[pname] = p.detach().clone()
    return out


def _attention_scales(worker) -> dict[str, tuple[float, float, float]]:
    """(in the worker) attention layer name → the (q, k, v) scales it uses (the host floats the CPU kernels read)."""
    out = {}
    for name, mod in worker.model_runner.get_model().named_modules():
        if hasattr(mod, "_k_scale_float"):
            out[name] = (float(mod._q_scale_float), float(mod._k_scale_float), float(mod._v_scale_float))
    return out
