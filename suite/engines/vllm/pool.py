"""Engine ``vllm``: the process-wide pool of ``vllm.LLM`` instances the rollouts run on.

One ``vllm.LLM`` (one engine-core process, ~25 s to start on CPU) per (model configuration, LLM keyword arguments)
per process, shared by every check, each started from a temporary HF checkpoint of the weights it should hold
(:class:`PooledLLM` is one such entry). At most :func:`max_live_llms` run at once: starting one beyond that stops
the least recently used, which keeps its key, weights and keyword arguments and starts again, with the weights it
last held, when a handle uses it (:func:`live_llm`). Several threads asking for one key at once (the e2e area's
``prestart_rollouts``) start it once: the others wait for that start. At exit every engine core is stopped together
(:func:`_shutdown_all`), with the ``vllm.LLM`` other parts of the adapter hold (:func:`stop_at_exit_too`).

What the rollouts do with a pooled LLM (which recipe, reloading other weights in place) is ``llm.py``'s.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the pool's key of an LLM: (model configuration as sorted JSON, LLM keyword arguments as sorted JSON)
PoolKey = tuple[str, str]


@dataclass(eq=False)  # compared by identity: a handle keeps its entry; the pool may drop it for a fresh one
class PooledLLM:
    """One ``vllm.LLM`` of the pool and what it needs to start again after a stop."""

    #: the pool's key (:data:`PoolKey`)
    key: PoolKey
    #: the model configuration (config.json) the LLM is started with
    config: dict
    #: the ``vllm.LLM`` keyword arguments of its recipe (``kv_cache_dtype``, ``quantization``, ...)
    llm_kwargs: dict
    #: the weights the LLM holds; a restart after a stop writes and loads them
    state_dict: Any
    #: ``fp8rl.fixtures.digest_state_dict`` of :attr:`state_dict`
    digest: str
    #: the running ``vllm.LLM``; None before its first start and while stopped to make room
    llm: Any = None
    #: the temporary checkpoint directory the running LLM was started from ("" while none)
    checkpoint_dir: str = ""

    def holds(self, state_dict: Any, digest: str) -> None:
        """Record that the LLM now holds ``state_dict`` (a restart after a stop loads it)."""
        self.state_dict, self.digest = state_dict, digest


#: key → entry, least recently used first
_LLMS: OrderedDict[PoolKey, PooledLLM] = OrderedDict()
_LLM_LOCK = threading.Lock()
#: key → Event set when the start in progress of that key's LLM ends (however it ends)
_STARTING: dict[PoolKey, threading.Event] = {}
#: whether :func:`_shutdown_all` is registered with atexit (on the first start)
_ATEXIT: list[bool] = []
#: callables that hand over, and forget, a ``vllm.LLM`` another part of the adapter holds (None: none), stopped
#: with the pool's at exit
_ALSO_AT_EXIT: list[Callable[[], Any]] = []


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


def acquire(key: PoolKey, config: dict, llm_kwargs: dict, state_dict: Any, digest: str) -> tuple[PooledLLM, bool]:
    """The pool's entry of ``key`` and whether this call started it (then holding ``state_dict``). A key not in
    the pool is started by the first caller; callers that ask while it starts wait for that start and get its
    entry, or, when it failed, start it themselves (and raise its error). An entry that is in the pool is returned
    as it is: it may be stopped (``llm`` None) or hold other weights; the caller decides."""
    with _LLM_LOCK:
        entry = _LLMS.get(key)
        pending = _STARTING.get(key)
        owner = entry is None and pending is None
        if owner:
            pending = _STARTING[key] = threading.Event()
    if owner:
        entry = PooledLLM(key=key, config=dict(config), llm_kwargs=llm_kwargs, state_dict=state_dict, digest=digest)
        _start_owned(entry)
        return entry, True
    if entry is None:
        assert pending is not None  # not the owner and not in the pool: a start is in progress
        pending.wait()
        entry = _LLMS.get(key)
        if entry is None:  # that start failed: start (and raise) here
            return acquire(key, config, llm_kwargs, state_dict, digest)
    return entry, False


def discard(entry: PooledLLM) -> None:
    """Take ``entry`` out of the pool (if it is still the pool's entry of its key) and stop its LLM."""
    with _LLM_LOCK:
        if _LLMS.get(entry.key) is entry:
            _LLMS.pop(entry.key)
    stop_llm(entry.llm, entry.checkpoint_dir)


def live_llm(entry: PooledLLM) -> Any:
    """The running ``vllm.LLM`` of a handle's entry, started again (with the weights it last held) if it was stopped
    to make room; marks it the most recently used."""
    key = entry.key
    if entry.llm is None:
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
    return entry.llm


def running() -> list[PooledLLM]:
    """The entries whose LLM runs now, least recently used first (the caller holds ``_LLM_LOCK`` or reads a
    snapshot)."""
    return [e for e in list(_LLMS.values()) if e.llm is not None]


def stop_llm(llm: Any, checkpoint_dir: str = "") -> None:
    """Stop one ``vllm.LLM``'s engine-core process (None: nothing to stop) and remove the checkpoint directory it
    was started from ("" : none)."""
    import shutil

    if llm is not None:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
    if checkpoint_dir:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)


def stop_all() -> None:
    """Take every entry out of the pool and stop its LLM, one after the other (frees the memory between
    workloads, ``fp8rl.perf.cpu_bench``)."""
    for key, entry in list(_LLMS.items()):
        _LLMS.pop(key, None)
        stop_llm(entry.llm, entry.checkpoint_dir)


def stop_at_exit_too(release: Callable[[], Any]) -> None:
    """Have :func:`_shutdown_all` also stop the ``vllm.LLM`` that ``release()`` hands over (and forgets), or
    nothing when it returns None."""
    _ALSO_AT_EXIT.append(release)


def _make_room() -> None:
    """Stop the least recently used running LLMs until one more may start (the caller's start is registered in
    ``_STARTING``); a stopped entry keeps its key, weights and keyword arguments and starts again when used."""
    stopped: list[tuple[Any, str]] = []
    with _LLM_LOCK:
        live = running()
        while live and len(live) + len(_STARTING) > max_live_llms():
            victim = live.pop(0)
            stopped.append((victim.llm, victim.checkpoint_dir))  # stopped below, outside the lock
            victim.llm, victim.checkpoint_dir = None, ""
    for llm, checkpoint_dir in stopped:
        stop_llm(llm, checkpoint_dir)


def _start_into(entry: PooledLLM) -> None:
    """Start the LLM of ``entry`` (its config, weights and keyword arguments) and register it as the most recently
    used."""
    import tempfile

    from fp8rl.reference.weight_sync import write_hf_checkpoint
    from vllm import LLM

    _make_room()
    d = tempfile.mkdtemp(prefix="fp8rl-vllm-")
    write_hf_checkpoint(d, entry.config, entry.state_dict, fp8=False)
    with _LLM_LOCK:
        if not _ATEXIT:
            import atexit

            atexit.register(_shutdown_all)
            _ATEXIT.append(True)
    llm = LLM(model=d, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
              skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=16,
              max_logprobs=-1, kv_cache_memory_bytes=kv_cache_bytes(), **entry.llm_kwargs)
    with _LLM_LOCK:
        entry.llm, entry.checkpoint_dir = llm, d
        _LLMS[entry.key] = entry
        _LLMS.move_to_end(entry.key)


def _start_owned(entry: PooledLLM) -> None:
    """:func:`_start_into` for a caller that registered the entry's key in ``_STARTING``: the threads waiting on
    that start are released however it ends."""
    try:
        _start_into(entry)
    finally:
        with _LLM_LOCK:
            _STARTING.pop(entry.key).set()


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
    to_stop = [(e.llm, e.checkpoint_dir) for e in list(_LLMS.values())]
    to_stop += [(llm, "") for llm in (release() for release in _ALSO_AT_EXIT) if llm is not None]
    threads = [threading.Thread(target=stop_llm, args=args, daemon=True) for args in to_stop]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    _LLMS.clear()
