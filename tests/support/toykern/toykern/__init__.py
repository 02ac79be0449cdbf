"""toykern: a toy FP8 kernel package, standing for a vendor's own kernels in the executed vendor guide
(docs/vendor-guide.md; tests/harness/test_vendor_guide.py writes it beside the guide's adapter and pyproject.toml into
a temporary project outside the repository and installs that project).

Plain PyTorch, nothing of fp8rl: the guide's adapter is what connects the two. Two kernels:

* :func:`group_quant_fp8`: 1×G activation groups along the last dimension, s = max(amax, 1e-10) / 448 in fp32,
  q = RNE(clamp(x / s, ±448)) (vLLM's CUDA per-token-group formula); whole groups only.
* :func:`kv_store_fp8`: a per-tensor FP8 KV-cache write, q = RNE(clamp(x / s, ±448)) with a static fp32 scale s.
"""

from __future__ import annotations

import torch

__version__ = "0.3.1"

FP8_MAX = 448.0


def _e4m3_codes(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


def group_quant_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., K) with K a multiple of ``group`` → (uint8 e4m3fn codes of x's shape, fp32 scales (..., K/group))."""
    if x.shape[-1] % group:
        raise ValueError(f"x: the last dimension must be a multiple of {group}, got shape {tuple(x.shape)}")
    x32 = x.float()
    g = x32.reshape(*x32.shape[:-1], x32.shape[-1] // group, group)
    s = g.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).reshape(x32.shape)
    return _e4m3_codes(q), s


def kv_store_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V ``x`` (any shape, fp32/bf16/fp16) with one fp32 dequant ``scale`` → uint8 e4m3fn codes of x's shape."""
    s = scale.float().reshape(())
    return _e4m3_codes((x.float() / s).clamp(-FP8_MAX, FP8_MAX))
