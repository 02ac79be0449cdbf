"""GEMM: the oracle's block-GEMM emulation and torch's FP8 scaled_mm on CPU at small rollout-like shapes."""

from __future__ import annotations

import torch

from .common import Benchmark, activations, weight


class BlockGemmOracle(Benchmark):
    """fp8rl.reference.gemm.block_gemm_exact: 1×128 activations × 128×128 weights, exact fp64 emulation."""

    params = ([16, 128], [512, 1024])
    param_names = ["M", "NK"]

    def setup(self, m, nk):
        try:
            from fp8rl.reference.gemm import block_gemm_exact
        except ImportError as exc:
            raise NotImplementedError(f"fp8rl.reference.gemm not available: {exc}") from None
        from fp8rl.reference.quant import Granularity, quantize

        self.fn = block_gemm_exact
        self.a = quantize(activations(m, nk), Granularity.group(128))
        self.w = quantize(weight(nk, nk), Granularity.block(128))

    def time_block_gemm_exact(self, m, nk):
        self.fn(self.a, self.w)


class TorchFp8Gemm(Benchmark):
    """torch._scaled_mm row-wise (per-token × per-channel) vs a bf16 matmul and a dequantize-then-matmul emulation."""

    params = ([16, 128], [1024])
    param_names = ["M", "NK"]

    def setup(self, m, nk):
        fp8 = torch.float8_e4m3fn
        x, w = activations(m, nk), weight(nk, nk)
        self.xs = (x.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
        self.ws = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
        self.xq = (x / self.xs).to(fp8)
        self.wq = (w / self.ws).to(fp8)
        self.ws_t = self.ws.t().contiguous()
        self.xb, self.wb = x.to(torch.bfloat16), w.to(torch.bfloat16)

    def time_scaled_mm_rowwise(self, m, nk):
        torch._scaled_mm(self.xq, self.wq.t(), scale_a=self.xs, scale_b=self.ws_t, out_dtype=torch.bfloat16)

    def time_bf16_matmul(self, m, nk):
        self.xb @ self.wb.t()

    def time_dequant_matmul_fp32(self, m, nk):
        (self.xq.float() * self.xs) @ (self.wq.float() * self.ws).t()
