"""A vendor's out-of-tree adapter, written the way a new user writes one from README and docs/ (tests of the verdict's
scope, tests/harness/test_verdict_scope.py). Its three kernels are plain PyTorch, nothing of fp8rl's oracle:

* ``block_quant``: 128×128 weight blocks, s = max(amax/448, 1e-12) computed in the input dtype (the vendor's bug: in
  fp16, 1e-12 underflows to 0, so an all-zero block gets scale 0 and NaN codes);
* ``group_quant``: 1×128 activation groups, s = max(amax, 1e-10)/448 in fp32, q = clamp(x/s) (vLLM's CUDA formula);
* ``kv_store_head``: a per-head FP8 KV store, q = clamp(x/s_h).

The test copies this file into a directory outside the repository and runs ``fp8rl`` there.
"""

from __future__ import annotations

import torch
from fp8rl.engine import Engine, Unsupported
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference.kv import KVCache, KVPolicy
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import QuantizedTensor

FP8_MAX = 448.0


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


def group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """1×G groups along the last dimension (a ragged last group holds the real elements only)."""
    x32 = x.float()
    k = x32.shape[-1]
    n = -(-k // group)
    pad = torch.nn.functional.pad(x32, (0, n * group - k))
    g = pad.reshape(*x32.shape[:-1], n, group)
    amax = g.abs().amax(dim=-1)
    s = torch.clamp(amax, min=1e-10) / FP8_MAX
    q = torch.clamp(g / s.unsqueeze(-1), -FP8_MAX, FP8_MAX).reshape(*x32.shape[:-1], n * group)[..., :k]
    return _codes(q), s


def block_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128 blocks of a 2-D weight; the scale is computed in the input dtype (the vendor's kernel)."""
    if x.dim() != 2:
        raise Unsupported(f"block_quant takes 2-D weights, got {tuple(x.shape)}")
    m, k = x.shape
    bm, bk = -(-m // block), -(-k // block)
    scale = torch.empty(bm, bk, dtype=torch.float32)
    codes = torch.empty(m, k, dtype=torch.uint8)
    for i in range(bm):
        for j in range(bk):
            t = x[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = t.abs().amax()
            s = torch.clamp(amax / FP8_MAX, min=1e-12)  # in x's dtype: fp16 rounds 1e-12 to 0
            q = torch.clamp(t / s, -FP8_MAX, FP8_MAX)
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = _codes(q.float())
            scale[i, j] = s.float()
    return codes, scale


def kv_store_head(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., T, H, D] with one scale per head H."""
    return _codes(torch.clamp(x.float() / scale.float().reshape(-1, 1), -FP8_MAX, FP8_MAX))


#: the block quantizer's numerics written as an fp8rl policy: what the vendor declares first
ACME_BLOCK_INPUT_DTYPE = ScalePolicy("acme-block", floor="scale", eps=1e-12, compute_dtype="input")


class AcmeEngine(Engine):
    """The adapter as first written: ``quantize`` compares the Granularity object to a string, so every call is
    refused (Unsupported), and no line of the vendor's kernels runs."""

    name = "acme"

    def version(self) -> str:
        return "acme-kernels 0.1"

    def capabilities(self):
        return {"quantize.block": True, "quantize.group": True}

    def scale_policy(self, kind: str) -> ScalePolicy:
        return get_policy("vllm_cuda_group") if kind == "group" else get_policy("reference")

    def quantize(self, x, granularity):
        if granularity == "group":  # the bug: a Granularity is never equal to a string
            codes, s = group_quant(x, 128)
        elif granularity == "block":
            codes, s = block_quant(x, 128)
        else:
            raise Unsupported(f"acme has no {granularity} quantizer")
        return QuantizedTensor(codes, s, granularity, self.scale_policy(granularity.kind))


class AcmeFixed(AcmeEngine):
    """The same adapter with the dispatch fixed, declaring only its group quantizer (which is right)."""

    name = "acme-fixed"

    def capabilities(self):
        return {"quantize.group": True}

    def quantize(self, x, granularity):
        if granularity.kind != "group" or granularity.size != (1, 128):
            raise Unsupported(f"acme quantizes 1x128 groups only, got {granularity}")
        codes, s = group_quant(x, 128)
        return QuantizedTensor(codes, s, granularity, self.scale_policy("group"))


class AcmeBlockDeclared(AcmeFixed):
    """The block quantizer, its input-dtype scale declared honestly (eps 1e-12 in the input dtype): the policy
    lint refuses the declaration at load (1e-12 is 0 in fp16)."""

    name = "acme-block-declared"

    def capabilities(self):
        return {"quantize.block": True}

    def scale_policy(self, kind):
        return ACME_BLOCK_INPUT_DTYPE

    def quantize(self, x, granularity):
        codes, s = block_quant(x, granularity.size[1])
        return QuantizedTensor(codes, s, granularity, self.scale_policy("block"))


class AcmeBlockFp32Declared(AcmeBlockDeclared):
    """The block quantizer declaring fp8rl's fp32 reference policy: whatever it declares, an all-zero fp16 block
    gets scale 0 and NaN codes, which the universal invariant INV-FINITE-001 fails."""

    name = "acme-block-fp32"

    def scale_policy(self, kind):
        return get_policy("reference")


class AcmeKV(Engine):
    """The per-head KV store."""

    name = "acme-kv"

    def capabilities(self):
        return {"kv.store": True}

    def kv_policy(self, fmt, layout):
        if fmt != "e4m3fn" or layout != "head":
            raise Unsupported("acme stores e4m3fn per-head KV only")
        return KVPolicy(fmt="e4m3fn", layout="head")

    def kv_store(self, x, scale, *, fmt, layout):
        if fmt != "e4m3fn" or layout != "head":
            raise Unsupported("acme stores e4m3fn per-head KV only")
        return KVCache(kv_store_head(x, scale), scale.float(), fmt, layout)


class ReadmeLiteral(ReferenceEngine):
    """README's old "bring your kernel" example followed literally: a ReferenceEngine subclass overriding one op,
    inheriting every other op and capability from the oracle."""

    name = "readme-literal"

    def scale_policy(self, kind):
        return get_policy("vllm_cuda_group") if kind == "group" else super().scale_policy(kind)

    def quantize(self, x, granularity):
        if granularity.kind != "group" or granularity.size != (1, 128):
            return super().quantize(x, granularity)
        codes, s = group_quant(x, 128)
        return QuantizedTensor(codes, s, granularity, self.scale_policy("group"))
