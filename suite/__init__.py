"""fp8rl: the independent referee for FP8 rollout numerics in LLM RL (engines, checks, mutants, perf, reports)."""

__version__ = "0.1.0"
