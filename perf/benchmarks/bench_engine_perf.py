"""A real engine's measured FP8/BF16 rollout speedups and the perf model's prediction, as tracked values.

Read from ``cpu_bench.json`` files of runs that already happened (``python -m fp8rl.perf.cpu_bench``; nothing is run
here): the environment variable ``FP8RL_ASV_ENGINE_PERF`` lists them (``os.pathsep``-separated files or folders
holding one; ``nox -s nightly`` sets it to its own vLLM run). One parameter per engine · workload and one per config;
without the variable every benchmark here is skipped. A vendor upgrade that makes FP8 slower shows as a step in
``track_speedup``; a change of the model (or the probed machine) as a step in ``track_predicted``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .common import Benchmark

ENV = "FP8RL_ASV_ENGINE_PERF"
CONFIGS = ["fp8-kv", "fp8-linear-ptpc"]


def _rows() -> dict[tuple[str, str], dict]:
    """(engine · workload, config) -> the cpu_bench row; unreadable paths are left out (give absolute paths: asv
    imports this file from another working directory)."""
    out: dict[tuple[str, str], dict] = {}
    for part in filter(None, os.environ.get(ENV, "").split(os.pathsep)):
        p = Path(part)
        f = p / "cpu_bench.json" if p.is_dir() else p
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if data.get("schema") != "fp8rl.perf.cpu_bench":
            continue
        engine = str(data.get("engine") or "vllm")
        for r in data.get("rows", []):
            out.setdefault((f"{engine} · {r['workload']}", r["config"]), r)
    return out


_SERIES = sorted({k[0] for k in _rows()}) or [f"(no {ENV})"]


class EnginePerf(Benchmark):
    """Measured paired speedup (geometric mean) vs BF16, the model's prediction for the probed machine, and their
    ratio minus one."""

    params = (_SERIES, CONFIGS)
    param_names = ["engine · workload", "config"]

    def setup(self, series, config):
        rows = _rows()
        if (series, config) not in rows:
            raise NotImplementedError(f"{ENV} names no {config} row of {series!r}")
        self.row = rows[(series, config)]

    def track_speedup(self, series, config):
        return self.row["measured"]

    def track_predicted(self, series, config):
        if self.row.get("predicted") is None:
            raise NotImplementedError("no model prediction in this row")
        return self.row["predicted"]

    def track_model_error(self, series, config):
        if self.row.get("model_error") is None:
            raise NotImplementedError("no model prediction in this row")
        return self.row["model_error"]

    track_speedup.unit = "ratio"  # type: ignore[attr-defined]
    track_predicted.unit = "ratio"  # type: ignore[attr-defined]
    track_model_error.unit = "fraction"  # type: ignore[attr-defined]
