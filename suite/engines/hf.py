"""``hf``: Hugging Face transformers as a BF16 rollout engine.

The model is written to a temporary checkpoint directory and loaded with ``from_pretrained`` (transformers' own
checkpoint conversion, e.g. the fused MoE expert tensors of transformers ≥ 5), with its default attention (sdpa)
and expert kernels, and rollouts come from ``generate()`` with a dynamic KV cache — an implementation independent
of the oracle's decode loop, so the ``bf16`` mismatch checks measure real BF16 train–inference mismatch.
transformers has no FP8 rollout path: the FP8 recipes and weight sync are declared unavailable with reasons.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from fp8rl.engine import CapabilityMap, Engine, Unsupported

_FP8_REASON = ("transformers runs the policy in BF16 only: no FP8 {what} path (use the reference engine or a "
               "serving engine for FP8 rollouts)")


class HFHandle:
    """A loaded transformers model (the rollout policy)."""

    def __init__(self, model: Any, config: dict) -> None:
        self.model = model
        self.config = config


class HFEngine(Engine):
    name = "hf"
    description = "Hugging Face transformers (BF16): from_pretrained + generate() with a dynamic KV cache"

    def version(self) -> str:
        try:
            import transformers
        except ImportError:
            return "transformers not installed"
        return f"transformers {transformers.__version__}"

    def capabilities(self) -> CapabilityMap:
        from fp8rl.reference.rollout_hf import transformers_reason

        reason = transformers_reason()
        rollout: bool | str = True if reason is None else reason
        return {
            "weight_sync": _FP8_REASON.format(what="weight-sync (blockwise FP8 quantization)"),
            "rollout": rollout,
            "update_weights": rollout,
            "rollout.bf16": rollout,
            "rollout.fp8-linear": _FP8_REASON.format(what="W8A8 linear"),
            "rollout.fp8-linear-ptpc": _FP8_REASON.format(what="W8A8 per-channel/per-token linear"),
            "rollout.fp8-kv": _FP8_REASON.format(what="KV-cache"),
            "rollout.fp8-all": _FP8_REASON.format(what="linear/KV-cache/attention"),
        }

    # -- model loading ---------------------------------------------------------------------------------------
    @staticmethod
    def _load(config: dict, state_dict: Any):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from fp8rl.reference.weight_sync import write_hf_checkpoint
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            with tempfile.TemporaryDirectory(prefix="fp8rl-hf-") as d:
                write_hf_checkpoint(d, config, state_dict, fp8=False)
                model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, local_files_only=True)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        model.eval().requires_grad_(False)
        return model

    def rollout_init(self, config, state_dict, recipe):
        if recipe != "bf16":
            raise Unsupported(self.capabilities().get(f"rollout.{recipe}", f"unknown recipe {recipe!r}"))
        from fp8rl.reference.rollout import single_thread

        with single_thread():
            return HFHandle(self._load(dict(config), state_dict), dict(config))

    def update_weights(self, handle, state_dict):
        from fp8rl.reference.rollout import single_thread

        with single_thread():
            handle.model = self._load(handle.config, state_dict)
        return handle

    def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        from fp8rl.reference.rollout import RolloutOutput, single_thread
        from transformers import GenerationConfig

        gc = GenerationConfig(max_new_tokens=int(max_new_tokens), do_sample=not greedy, temperature=1.0,
                              eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
        with single_thread(), torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(int(seed))
            out = handle.model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                        generation_config=gc)
        tokens = out.sequences
        new = tokens[:, prompts.shape[1]:]
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        return RolloutOutput(tokens, logprobs)
