"""The analytic perf model: cost of an estimate, and tracked predictions (a change in them is a model change)."""

from __future__ import annotations

from .common import Benchmark


class PerfModel(Benchmark):
    params = (["qwen3-8b", "qwen3-30b-a3b"], ["fp8-linear", "fp8-kv", "fp8-all"])
    param_names = ["model", "config"]

    def setup(self, model, config):
        from fp8rl.perf import model as pm

        self.pm = pm
        self.spec = pm.load_model_spec(model)
        self.hw = pm.load_hardware("H100-SXM-80GB")
        prompt = 2048 if model == "qwen3-8b" else 1024
        self.wl = pm.Workload(prompt_len=prompt, gen_len=20480, gpu_memory_utilization=0.9)

    def time_estimate_all(self, model, config):
        self.pm.estimate_all(self.spec, self.hw, self.wl)

    def track_speedup_ceiling(self, model, config):
        return self.pm.speedup_ceiling(self.spec, self.hw, config, self.wl)

    track_speedup_ceiling.unit = "ratio"  # type: ignore[attr-defined]

    def track_kv_capacity_ratio(self, model, config):
        budget = self.pm.memory_budget(self.hw, 0.9)
        base = self.pm.kv_capacity_tokens(self.spec, "bf16", budget)
        return self.pm.kv_capacity_tokens(self.spec, config, budget) / max(base, 1)

    track_kv_capacity_ratio.unit = "ratio"  # type: ignore[attr-defined]
