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
            "rollout.logits": rollout,
            "rollout.fp8-linear": _FP8_REASON.format(what="W8A8 linear"),
            "rollout.fp8-linear-ptpc": _FP8_REASON.format(what="W8A8 per-channel/per-token linear"),
            "rollout.fp8-kv": _FP8_REASON.format(what="KV-cache"),
            "rollout.fp8-all": _FP8_REASON.format(what="linear/KV-cache/attention"),
            "rollout.mxfp8": _FP8_REASON.format(what="MXFP8 linear"),
            "rollout.nvfp4-experts": _FP8_REASON.format(what="NVFP4 expert"),
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
        # fixed-length rollouts: generate() merges a passed GenerationConfig's unset (None) fields with the model's,
        # so eos_token_id=None there still stops a row at the checkpoint's EOS (token 0) and pads the rest with
        # pad_token_id; clear it on the model itself
        model.generation_config.eos_token_id = None
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
        from fp8rl.reference.rollout import RolloutOutput

        tokens, logprobs, _ = self.rollout_logits(handle, prompts, max_new_tokens, greedy=greedy, seed=seed)
        return RolloutOutput(tokens, logprobs)

    def rollout_logits(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        """``generate(do_sample=not greedy, temperature=1, top_k=0, top_p=1)`` with ``output_scores``: the scores
        are the logits after generate's logits processors — what it sampled from (with these settings none
        applies: the raw logits); log-probs = fp32 log_softmax of them at the tokens. top_k=0 and top_p=1.0 are
        explicit so that a ``generation_config.json`` default (historically top_k=50) cannot truncate sampling, and
        the model's EOS is cleared at load (fixed length: a row that emits EOS goes on decoding)."""
        from fp8rl.reference.rollout import single_thread
        from transformers import GenerationConfig

        sampling = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        gc = GenerationConfig(max_new_tokens=int(max_new_tokens), do_sample=not greedy, eos_token_id=None,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True, **sampling)
        with single_thread(), torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(int(seed))
            out = handle.model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                        generation_config=gc)
        tokens = out.sequences
        new = tokens[:, prompts.shape[1]:]
        logits = torch.stack(out.scores, dim=1).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new[..., None]).squeeze(-1)
        return tokens, logprobs, logits
