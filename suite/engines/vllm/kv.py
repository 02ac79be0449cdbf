"""Engine ``vllm``, area kv: how fp8rl calls vLLM's FP8 KV cache write and its attention over that cache (vLLM's
CPU_ATTN backend), and the default k/v scales vLLM runs a BF16 checkpoint with:

* ``kv_store``: the real CPU cache write ``torch.ops._C.cpu_attn_reshape_and_cache`` (ISA "vec", the one vLLM picks
  without AMX) into a uint8 paged cache [blocks, H, block, D]; the adapter reads the codes back out of vLLM's
  layout (keys are stored transposed per block and head: [D, block]) and pads D to a multiple of 32 with zeros
  (the kernel requires head_size % 32 == 0; padding does not touch the real elements). Scales are per tensor only
  (the op takes Python floats ``k_scale``/``v_scale``).
* ``kv_attention``: the real CPU attention ``torch.ops._C.cpu_attention_with_kv_cache`` over the FP8 paged cache
  (scheduler metadata from ``get_scheduler_metadata``, the ISA from CPU_ATTN's own ``_get_attn_isa``: "vec" here),
  as ``CPUAttentionBackendImpl.forward`` calls it. The adapter writes the suite's codes into vLLM's layout (the
  inverse of the ``kv_store`` read-out; slots past kv_len keep their bytes, so garbage really sits in vLLM's blocks),
  packs the valid queries varlen (``query_start_loc``; a sequence with no queries is not scheduled and its rows
  are 0), pads D to a multiple of 32 with zeros (the softmax scale stays 1/√D of the real head size) and runs the
  query in fp32 (a model dtype CPU_ATTN supports; a BF16 model's query is BF16). vLLM's CPU attention has no FP8
  query: only k_scale/v_scale enter (Python floats; k_scale is folded into the softmax scale) and Q stays in the
  model dtype: the declared policy says ``quantize_q=False`` and a ``q_scale`` is Unsupported.
* ``kv_forward``: what a vLLM attention layer does with a BF16 checkpoint under ``kv_cache_dtype=fp8*``: the layer
  has no loadable k_scale/v_scale and keeps the defaults ``set_default_quant_scales`` installs
  (``_k_scale_float = _v_scale_float = 1.0``; ``_q_scale`` 1.0, unused on CPU); the real cache write then the real
  attention with those scales. The layer name is ignored (every layer of such a model runs with 1.0; vLLM has no
  per-layer push).

KV-scale calibration and runtime scale updates are unavailable (vLLM has neither; see ``_caps_kv``). The scales a
running ``vllm.LLM`` actually uses: ``fp8rl.engines.vllm.llm.kv_scales_in_use``.
"""

from __future__ import annotations

import functools
import math

import torch
from fp8rl.engine import CapabilityMap, Unsupported, per_tensor_kv_input

from ._common import STAND_IN_PLATFORM, _vllm_config, _vllm_version

#: suite KV format → vLLM ``kv_cache_dtype`` string
KV_DTYPES: dict[str, str] = {"e4m3fn": "fp8_e4m3", "e5m2": "fp8_e5m2"}
_KV_BLOCK = 32  # CPU_ATTN kernel block sizes: multiples of 32


@functools.lru_cache(maxsize=1)
def default_kv_scales() -> tuple[float, float, float]:
    """(q, k, v) scales of a vLLM attention layer whose checkpoint carries none: what vLLM's own
    ``set_default_quant_scales`` (called by ``_init_kv_cache_quant``) installs as the host floats the CPU kernels
    read (``_q_scale_float``, ``_k_scale_float``, ``_v_scale_float``)."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    # torch types Module.__getattr__ as Tensor | Module; vLLM sets these as plain float attributes
    return float(layer._q_scale_float), float(layer._k_scale_float), float(layer._v_scale_float)  # type: ignore[arg-type]


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


class VllmKVMixin:
    """The FP8 KV cache write, FP8-cache attention and default-scale forward of
    :class:`fp8rl.engines.vllm.VllmEngine`."""

    @staticmethod
    def _caps_kv(v: str, p: dict) -> CapabilityMap:
        caps: CapabilityMap = {}
        if p["is_cpu"] and not (p["avx512"] or p["amx"]):
            caps["kv.store"] = f"vllm {v}: FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
        elif not p["is_cpu"]:
            caps["kv.store"] = f"vllm {v}: only the CPU cache write (cpu_attn_reshape_and_cache) is wired"
        else:
            caps["kv.store"] = True
        caps["kv.attention"] = caps["kv.store"]
        caps["kv.forward"] = caps["kv.store"]
        caps["kv.calibrate"] = (f"vllm {v}: no KV-scale calibration: calculate_kv_scales was removed (PR #49389); "
                                "k/v scales come only from a quantized checkpoint's k_scale/v_scale, else 1.0")
        caps["kv.update_scales"] = (
            f"vllm {v}: no runtime recalibration or scale-push API: a BF16 model served with kv_cache_dtype fp8 has "
            "no loadable k_scale/v_scale and runs with the default scale 1.0 (only an INFO log line: 'Using fp8 data "
            "type to store kv cache ... may cause accuracy drop without a proper scaling factor'); a reload keeps "
            "the old scales unless the stream carries *.k_scale/*.v_scale (only for FP8-quant-config models)")
        return caps

    def kv_policy(self, fmt: str, layout: str):
        from fp8rl.reference.kv import KVPolicy

        if fmt not in KV_DTYPES:
            raise Unsupported(f"vllm: no FP8 KV cache in {fmt!r} (kv_cache_dtype fp8/fp8_e4m3/fp8_e5m2 only)")
        if layout != "tensor":
            raise Unsupported(
                f"vllm {_vllm_version()} CPU_ATTN: KV scales are per tensor only (cpu_attn_reshape_and_cache takes "
                f"Python floats k_scale/v_scale); layout {layout!r} (fp8_per_token_head is a Triton/CUDA path) is "
                "not available on CPU")
        # declared as vLLM documents its CPU write (docs/engine-numerics.md §2.7): v = clamp(x·(1/s), ±max), then convert;
        # CPU_ATTN has no FP8 query (Q stays in the model dtype; k_scale is folded into the softmax scale)
        return KVPolicy(fmt=fmt, layout="tensor", quant_op="mul_recip", clamp=True, overflow="saturate",
                        quantize_q=False)

    def kv_store(self, x, scale, *, fmt, layout):
        from fp8rl.reference.kv import KVCache
        from vllm import _custom_ops as ops

        self.kv_policy(fmt, layout)
        x3, s, shape = per_tensor_kv_input(x, scale)
        h, d = shape[-2], shape[-1]
        flat = _pad_last(x3, 32).contiguous()  # [N, H, Dp]
        n, dp = flat.shape[0], flat.shape[-1]
        nb = max(1, math.ceil(n / _KV_BLOCK))
        kv = torch.zeros(nb, h, 2 * _KV_BLOCK, dp, dtype=torch.uint8)
        k_cache, v_cache = kv.chunk(2, dim=2)
        # the value slot of the same write gets the same tensor: the K and V paths are checked against each other
        ops.cpu_attn_reshape_and_cache(flat, flat.clone(), k_cache, v_cache, torch.arange(n, dtype=torch.int64),
                                       "vec", k_scale=float(s), v_scale=float(s), kv_cache_dtype=KV_DTYPES[fmt])
        k_codes = k_cache.contiguous().view(nb, h, dp, _KV_BLOCK).permute(0, 3, 1, 2).reshape(nb * _KV_BLOCK, h, dp)
        v_codes = v_cache.contiguous().permute(0, 2, 1, 3).reshape(nb * _KV_BLOCK, h, dp)
        k_codes, v_codes = k_codes[:n, :, :d], v_codes[:n, :, :d]
        if not torch.equal(k_codes, v_codes):
            from fp8rl.engine import EngineError

            raise EngineError("vllm cpu_attn_reshape_and_cache stored different codes for the same K and V input")
        return KVCache(k_codes.reshape(shape).contiguous(), s.reshape(()), fmt, "tensor")


    @staticmethod
    def _write_paged(codes: torch.Tensor, cache: torch.Tensor, first_block: int, nblocks: int, d: int,
                     keys: bool) -> None:
        """Write one sequence's codes [Tk, H, D] into blocks first_block.. of a CPU_ATTN cache view [nb, H, block,
        Dp] (keys transposed per block and head: [Dp, block]; the inverse of the kv_store read-out)."""
        h, dp = cache.shape[1], cache.shape[3]
        c = torch.zeros(nblocks * _KV_BLOCK, h, dp, dtype=torch.uint8)
        c[: codes.shape[0], :, :d] = codes
        c = c.reshape(nblocks, _KV_BLOCK, h, dp)
        blk = slice(first_block, first_block + nblocks)
        if keys:
            cache[blk] = c.permute(0, 2, 3, 1).contiguous().reshape(nblocks, h, _KV_BLOCK, dp)
        else:
            cache[blk] = c.permute(0, 2, 1, 3)

    def kv_attention(self, q, k_cache, v_cache, *, q_scale=None, causal=True, q_lengths=None, kv_lengths=None,
                     sm_scale=None):
        from fp8rl.reference import kv as kvref
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        for c in (k_cache, v_cache):
            if not isinstance(c, kvref.KVCache):
                raise ValueError(f"kv_attention: expected KVCache operands, got {type(c).__name__}")
            self.kv_policy(c.fmt, c.layout)
        if k_cache.fmt != v_cache.fmt:
            raise Unsupported("vllm: K and V caches share one kv_cache_dtype")
        if q_scale is not None:
            raise Unsupported(f"vllm {_vllm_version()} CPU_ATTN has no FP8 query: Q stays in the model dtype and only "
                              "k_scale/v_scale enter (k_scale folded into the softmax scale); no q_scale input")
        if k_cache.codes.dim() != 4 or q.dim() != 4:
            raise ValueError(f"kv_attention: expected q [B, Tq, Hq, D] and caches [B, Tk, Hkv, D], got "
                             f"{tuple(q.shape)} and {tuple(k_cache.codes.shape)}")
        kv_dtype = KV_DTYPES[k_cache.fmt]
        b, tq, hq, d = q.shape
        tk, hkv = k_cache.codes.shape[1], k_cache.codes.shape[2]
        ql = kvref._lengths(q_lengths, b, tq, "q_lengths")
        kl = kvref._lengths(kv_lengths, b, tk, "kv_lengths")
        kvref.attention_masks(b, tq, tk, causal=causal, q_lengths=ql, kv_lengths=kl)  # validates the lengths
        out = torch.zeros(b, tq, hq, d, dtype=torch.float32)
        reqs = [i for i in range(b) if int(ql[i]) > 0]  # a sequence without queries is not scheduled
        if not reqs:
            return out
        dp = d + (-d) % 32
        per = max(1, math.ceil(tk / _KV_BLOCK))
        kv = torch.zeros(len(reqs) * per, hkv, 2 * _KV_BLOCK, dp, dtype=torch.uint8)
        kc, vc = kv.chunk(2, dim=2)
        for r, i in enumerate(reqs):
            self._write_paged(k_cache.codes[i], kc, r * per, per, d, keys=True)
            self._write_paged(v_cache.codes[i], vc, r * per, per, d, keys=False)
        qdt = torch.float32
        query = torch.cat([_pad_last(q[i, : int(ql[i])].to(torch.float32), 32) for i in reqs]).to(qdt).contiguous()
        o = torch.zeros_like(query)
        qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor([int(ql[i]) for i in reqs]), 0)
        seq = torch.tensor([int(kl[i]) for i in reqs], dtype=torch.int32)
        table = torch.arange(len(reqs) * per, dtype=torch.int32).reshape(len(reqs), per)
        with _vllm_config():
            isa = _get_attn_isa(qdt, _KV_BLOCK, dp, kv_dtype)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(reqs), num_heads=hq, num_kv_heads=hkv, head_dim=dp, seq_lens=seq, dtype=qdt,
                query_start_loc=qsl, causal=bool(causal), sliding_window_size=-1, isa=isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=kv_dtype)
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=kc, value_cache=vc, output=o, query_start_loc=qsl, seq_lens=seq,
                scale=(1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale), causal=bool(causal),
                alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=meta,
                s_aux=None, dynamic_causal=None, k_scale=float(k_cache.scale), v_scale=float(v_cache.scale),
                kv_cache_dtype=kv_dtype)
        for r, i in enumerate(reqs):
            out[i, : int(ql[i])] = o[int(qsl[r]): int(qsl[r + 1]), :, :d].float()
        return out

    def kv_forward(self, layer, q, k, v, *, fmt, layout="tensor", causal=True, q_lengths=None, kv_lengths=None,
                   sm_scale=None):
        from fp8rl.reference import kv as kvref

        self.kv_policy(fmt, layout)
        qs, ks, vs = (torch.tensor(x, dtype=torch.float32) for x in default_kv_scales())
        kc = self.kv_store(k, ks, fmt=fmt, layout=layout)
        vc = self.kv_store(v, vs, fmt=fmt, layout=layout)
        out = self.kv_attention(q, kc, vc, causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths,
                                sm_scale=sm_scale)
        return kvref.KVForward(out, kc, vc, kvref.KVScales.of(qs, ks, vs))


#: the capability keys of this part, as :meth:`VllmKVMixin._caps_kv` declares them (each carries the engine-wide
#: reason when vLLM cannot run here)
CAP_KEYS: tuple[str, ...] = tuple(VllmKVMixin._caps_kv("", STAND_IN_PLATFORM))
