"""Rollout throughput harness: fixed-length generation, warm-up, interleaved paired repeats.

Engine interface
----------------
The harness needs the capability ``rollout`` (``engine.capabilities()["rollout"] is True``) and calls exactly one
method::

    engine.rollout(model, prompts, *, config, max_new_tokens, ignore_eos=True, seed=0)

``model``
    the ``--model`` argument as given (a model directory or a name the engine understands).
``prompts``
    ``list[list[int]]``: token ids, identical for every config (drawn once from ``seed``).
``config``
    a precision config: ``bf16``, ``fp8-linear``, ``fp8-kv`` or ``fp8-all`` (see :mod:`fp8rl.perf.model`).
    An engine that supports only some configs declares ``rollout.<config>`` capabilities (True or the reason);
    when none is declared every config is assumed available.
``max_new_tokens``, ``ignore_eos``
    generate exactly ``max_new_tokens`` tokens per prompt: with ``ignore_eos=True`` the engine must not stop early.
    A response of another length marks the run invalid (the gate then calls the comparison SUSPECT).
returns
    the generated ids per prompt (``list[list[int]]``), or a mapping/object with ``tokens`` (that list) and an
    optional ``stats`` mapping: ``kv_capacity_tokens`` (the engine's KV-cache size), ``peak_memory_bytes`` (device
    memory, when the engine measures it itself, e.g. in a worker process).

Engines that pay a start-up cost per config (``vllm.LLM()``) should keep one instance per (model, config) and
start it on first use; the warm-up calls absorb that cost. Timing is host wall-clock around the call
(``torch.cuda.synchronize()`` first when CUDA is initialised in this process).

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
from fp8rl.perf.results import environment, hardware_block, new_result

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
    try:
        caps = engine.capabilities()
    except Exception as exc:  # noqa: BLE001
        return f"engine {getattr(engine, 'name', '?')!r}: capabilities() raised {type(exc).__name__}: {exc}"
    status = caps.get("rollout")
    name = getattr(engine, "name", "?")
    if status is not True:
        if status in (None, False):
            return f"engine {name!r} does not declare capability 'rollout'"
        return f"engine {name!r} lacks capability 'rollout': {status}"
    if not callable(getattr(engine, "rollout", None)):
        return f"engine {name!r} declares 'rollout' but has no rollout() method"
    for cfg in configs or []:
        st = caps.get(f"rollout.{cfg}")
        if st is not None and st is not True:
            return f"engine {name!r} cannot roll out config {cfg!r}: {st if st is not False else 'not supported'}"
    return None


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` ids in [min(3, vocab-1), vocab): the same for every config."""
    rng = np.random.default_rng(seed)
    lo = min(3, vocab_size - 1)
    return rng.integers(lo, vocab_size, size=(batch, prompt_len)).tolist()


def _model_info(model: str, model_name: str | None) -> tuple[str, int | None]:
    import json

    p = Path(model)
    cfg = p / "config.json" if p.is_dir() else (p if p.is_file() and p.suffix == ".json" else None)
    vocab = None
    name = model_name
    if cfg is not None and cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
            vocab = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
            name = name or data.get("_name_or_path") or None
        except (OSError, ValueError):
            pass
    return name or (p.name if p.name else str(model)), vocab


def _unpack(out: Any) -> tuple[list[list[int]], dict]:
    if isinstance(out, dict):
        return list(out.get("tokens") or []), dict(out.get("stats") or {})
    if hasattr(out, "tokens"):
        return list(out.tokens), dict(getattr(out, "stats", None) or {})
    return list(out), {}


def _check_lengths(tokens: list[list[int]], batch: int, gen_len: int) -> list[str]:
    problems = []
    if len(tokens) != batch:
        problems.append(f"{len(tokens)} responses for {batch} prompts")
    lens = [len(t) for t in tokens]
    short = [n for n in lens if n < gen_len]
    long = [n for n in lens if n > gen_len]
    if short:
        problems.append(f"{len(short)} response(s) shorter than gen_len={gen_len} (min {min(short)}): EOS not ignored?")
    if long:
        problems.append(f"{len(long)} response(s) longer than gen_len={gen_len} (max {max(long)})")
    return problems


def run_benchmark(engine: Any, *, model: str, configs: list[str], batch: int, prompt_len: int, gen_len: int,
                  repeats: int, warmup: int = 1, seed: int = 0, order: str = "interleaved",
                  vocab_size: int | None = None, model_name: str | None = None, hardware: str | None = None,
                  command: list[str] | None = None,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark and return a result dict (schema ``fp8rl.perf.result``, kind ``rollout``).

    ``configs[0]`` is the baseline. ``progress(label)`` is called after every call to the engine.
    Raises :class:`RolloutUnavailable` when the engine cannot run it, ValueError for bad arguments.
    """
    from fp8rl.perf.model import get_precision

    if not configs:
        raise ValueError("configs: give at least one config")
    canon = []
    for c in configs:
        canon.append(get_precision(c).name)
    if len(set(canon)) != len(canon):
        raise ValueError(f"configs: duplicates in {configs}")
    for nm, v, lo in (("batch", batch, 1), ("prompt_len", prompt_len, 1), ("gen_len", gen_len, 1),
                      ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{nm}: expected an integer >= {lo}, got {v!r}")
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    reason = rollout_reason(engine, canon)
    if reason is not None:
        raise RolloutUnavailable(reason)

    name, cfg_vocab = _model_info(model, model_name)
    vocab = int(vocab_size or cfg_vocab or 1000)
    prompts = make_prompts(batch, prompt_len, vocab, seed)
    mem = _PeakMemory()

    def call(cfg: str) -> tuple[list[list[int]], dict, float, int | None]:
        mem.start()
        t0 = time.perf_counter()
        out = engine.rollout(model, prompts, config=cfg, max_new_tokens=gen_len, ignore_eos=True, seed=seed)
        mem.sync()
        wall = time.perf_counter() - t0
        toks, stats = _unpack(out)
        return toks, stats, wall, mem.peak()

    for cfg in canon:
        for _ in range(warmup):
            call(cfg)
            if progress:
                progress(f"warm-up {cfg}")
    runs = []
    seq = 0
    for i in range(repeats):
        round_order = canon if order == "interleaved" or i % 2 == 0 else list(reversed(canon))
        for cfg in round_order:
            toks, stats, wall, peak = call(cfg)
            problems = _check_lengths(toks, batch, gen_len)
            ntok = sum(len(t) for t in toks)
            runs.append({
                "group": "default", "config": cfg, "repeat": i, "seq": seq, "throughput": ntok / wall if wall > 0
                else 0.0, "wall_s": wall, "tokens": ntok,
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
                "seed": seed, "order": order, "ignore_eos": True, "vocab_size": vocab}
    engine_info = {"name": str(getattr(engine, "name", "?")), "version": _version(engine)}
    result = new_result(kind="rollout", source="fp8rl perf run", engine=engine_info,
                        model={"name": name, "path": str(model)}, hardware=hardware_block(hardware),
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
