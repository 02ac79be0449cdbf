"""End-to-end tracks on the tiny fixture models: FP8/BF16 rollout throughput ratio and mismatch KL per recipe.

Engine: ``FP8RL_BENCH_ENGINE`` (default ``reference``), which must have the ``rollout`` capability; otherwise every
benchmark here is skipped (NotImplementedError in setup, recorded by asv as n/a). Each parameter combination starts
a fresh process (transformers import, weight sync), so this file takes ~1–2 min: leave it out of CI smokes.
"""

from __future__ import annotations

import os

from .common import Benchmark

MODELS = ["tiny-qwen3", "tiny-qwen3-moe"]
RECIPES = ["fp8-linear", "fp8-kv", "fp8-all"]


def _engine(recipes):
    from fp8rl.perf.harness import rollout_reason
    from fp8rl.registry import EngineLoadError, load_engine

    name = os.environ.get("FP8RL_BENCH_ENGINE", "reference")
    try:
        eng = load_engine(name)
    except EngineLoadError as exc:
        raise NotImplementedError(str(exc)) from None
    reason = rollout_reason(eng, list(recipes))
    if reason:
        raise NotImplementedError(reason)
    return eng


class TinyRolloutThroughput(Benchmark):
    """Paired speedup (geometric mean of 5 interleaved pairs) of a recipe over BF16, batch 4, 32 + 32 tokens."""

    params = (["tiny-qwen3"], RECIPES)
    param_names = ["model", "recipe"]
    timeout = 600

    def setup(self, model, recipe):
        self.engine = _engine(["bf16", recipe])

    def track_throughput_ratio(self, model, recipe):
        from fp8rl.perf.harness import run_benchmark
        from fp8rl.perf.stats import paired_speedup

        res = run_benchmark(self.engine, model=model, configs=["bf16", recipe], batch=4, prompt_len=32, gen_len=32,
                            repeats=5, warmup=1)
        base = [r["throughput"] for r in res["runs"] if r["config"] == "bf16"]
        cand = [r["throughput"] for r in res["runs"] if r["config"] == recipe]
        return paired_speedup(base, cand).point

    track_throughput_ratio.unit = "ratio"  # type: ignore[attr-defined]


class TinyRolloutMismatch(Benchmark):
    """k3 KL(π_rollout ‖ π_bf16-trainer) of sampled rollouts, per recipe (the e2e conformance measurement)."""

    params = (MODELS, RECIPES)
    param_names = ["model", "recipe"]
    timeout = 600

    def setup(self, model, recipe):
        self.engine = _engine([recipe])
        try:
            from fp8rl.conformance import _e2e
        except ImportError as exc:
            raise NotImplementedError(f"e2e measurement not available: {exc}") from None
        self.measure = _e2e.measure

    def track_k3_kl(self, model, recipe):
        return self.measure(self.engine, model, recipe).metrics["k3_kl"]

    track_k3_kl.unit = "nats/token"  # type: ignore[attr-defined]
