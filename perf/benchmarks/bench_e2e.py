"""End-to-end tracks: tiny-model FP8/BF16 rollout throughput ratio and mismatch KL per recipe.

They need an engine with the ``rollout`` capability (``FP8RL_BENCH_ENGINE``, default ``reference``) and a tiny
model (``FP8RL_BENCH_MODEL``, default ``tiny-qwen3``); until the e2e area provides them they are skipped
(NotImplementedError in setup, which asv records as "n/a").
"""

from __future__ import annotations

import os

from .common import Benchmark


def _engine_and_model():
    from fp8rl.perf.harness import rollout_reason
    from fp8rl.registry import EngineLoadError, load_engine

    name = os.environ.get("FP8RL_BENCH_ENGINE", "reference")
    try:
        eng = load_engine(name)
    except EngineLoadError as exc:
        raise NotImplementedError(str(exc)) from None
    reason = rollout_reason(eng, ["bf16", "fp8-linear", "fp8-kv", "fp8-all"])
    if reason:
        raise NotImplementedError(reason)
    return eng, os.environ.get("FP8RL_BENCH_MODEL", "tiny-qwen3")


class TinyRollout(Benchmark):
    params = (["fp8-linear", "fp8-kv", "fp8-all"],)
    param_names = ["config"]
    timeout = 600

    def setup(self, config):
        self.engine, self.model = _engine_and_model()

    def track_throughput_ratio(self, config):
        from fp8rl.perf.gate import paired_speedup
        from fp8rl.perf.harness import run_benchmark

        res = run_benchmark(self.engine, model=self.model, configs=["bf16", config], batch=4, prompt_len=32,
                            gen_len=32, repeats=5, warmup=1)
        base = [r["throughput"] for r in res["runs"] if r["config"] == "bf16"]
        cand = [r["throughput"] for r in res["runs"] if r["config"] == config]
        return paired_speedup(base, cand).point

    track_throughput_ratio.unit = "ratio"

    def track_mismatch_kl(self, config):
        fn = getattr(self.engine, "mismatch_kl", None)
        if fn is None:
            raise NotImplementedError("engine has no mismatch_kl() (e2e area pending)")
        return float(fn(self.model, config))

    track_mismatch_kl.unit = "nats/token"
