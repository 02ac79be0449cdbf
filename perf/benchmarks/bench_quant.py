"""Oracle casts and quantizers per recipe (ScalePolicy preset × granularity), and the veRL-style reference path."""

from __future__ import annotations

import torch

from .common import Benchmark, activations, granularity, sqnr_db, weight

RECIPES = ["reference", "verl_torch", "deepgemm_block", "te_blockwise_pow2", "vllm_cuda_group", "sglang_group"]
GRANULARITIES = ["block128", "group128", "token", "tensor"]


class Cast(Benchmark):
    """fp32 → FP8 codes: the oracle's bit-level encoder vs torch's own cast (the speed the oracle competes with)."""

    params = (["e4m3fn", "e5m2"], [65536, 1048576])
    param_names = ["fmt", "n"]

    def setup(self, fmt, n):
        from fp8rl.reference import formats

        self.formats = formats
        self.x = weight(n // 1024, 1024).reshape(-1) * 2000.0
        self.dtype = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]

    def time_oracle_encode(self, fmt, n):
        self.formats.encode(self.x, fmt, "saturate")

    def time_torch_cast(self, fmt, n):
        self.x.to(self.dtype)


class QuantizeRecipe(Benchmark):
    """fp8rl.reference.quant.quantize of a 512×1024 fp32 tensor per recipe and granularity."""

    params = (RECIPES, GRANULARITIES)
    param_names = ["recipe", "granularity"]

    def setup(self, recipe, gran):
        from fp8rl.reference import quant

        self.quant = quant
        self.policy = quant.get_policy(recipe)
        self.g = granularity(gran)
        self.x = activations(512, 1024) if gran in ("group128", "token") else weight(512, 1024)

    def time_quantize(self, recipe, gran):
        self.quant.quantize(self.x, self.g, self.policy)

    def track_sqnr(self, recipe, gran):
        qt = self.quant.quantize(self.x, self.g, self.policy)
        return sqnr_db(self.x, qt.dequantize())

    track_sqnr.unit = "dB"  # type: ignore[attr-defined]


class BlockQuantize4096(Benchmark):
    """The suite-speed target: 128×128 block quantization of a 4096×4096 fp32 weight, oracle vs veRL-style torch."""

    timeout = 300
    repeat = (1, 3, 60.0)

    def setup(self):
        from fp8rl.perf.suite_speed import oracle_blockwise, verl_style_blockwise

        self.oracle, self.verl = oracle_blockwise, verl_style_blockwise
        self.x = weight(4096, 4096)

    def time_oracle(self):
        self.oracle(self.x)

    def time_verl_style(self):
        self.verl(self.x)

    def track_ratio_oracle_over_verl(self):
        """Median oracle time / median veRL-style time, 5 interleaved repeats in this process (what
        ``python -m fp8rl.perf.suite_speed`` prints; target ≤ 0.5)."""
        from fp8rl.perf.suite_speed import measure_quantizers

        return measure_quantizers(4096, repeats=5)["ratio_oracle_over_verl"]

    track_ratio_oracle_over_verl.unit = "ratio"  # type: ignore[attr-defined]
