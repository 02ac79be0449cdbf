"""The nightly vLLM-on-CPU run's design (fp8rl.perf.cpu_bench), checked through the perf model without vLLM: the
generated model is memory-bound in BF16 decode on a probed CPU, the long-context workload is KV-dominated, and the
workloads fit the vLLM adapter's max_model_len (256)."""

from __future__ import annotations

import pytest
from fp8rl.perf import cpu_bench as cb
from fp8rl.perf import model as pm


@pytest.fixture(scope="module")
def cpu():
    """The CI machine as `fp8rl perf hardware --probe` measured it (perf/README.md, load 2.2) — an input: a probe in a
    test would be too small to leave the caches, and its numbers vary with the machine's load."""
    return pm.Hardware(name="ci-cpu", cls="cpu", hbm_bytes=23 * 2**30, hbm_bandwidth_Bps=30.1e9,
                       bf16_dense_flops=415.3e9, fp8_dense_flops=72.7e9)


def _step(name: str, hw: pm.Hardware) -> dict:
    model, batch, prompt, gen, _ = cb.WORKLOADS[name]
    spec = pm.ModelSpec.from_hf_config(cb.LARGE_CONFIG, name="large") if model == "large" else pm.load_model_spec(model)
    wl = pm.Workload(prompt_len=prompt, gen_len=gen, max_num_seqs=batch, num_requests=batch)
    return pm.estimate(spec, hw, "bf16", wl).step


def test_workloads_fit_the_adapter_and_its_batch_bound():
    for _model, batch, prompt, gen, repeats in cb.WORKLOADS.values():
        assert prompt + gen <= 256 and batch <= 16 and repeats >= 3  # vllm adapter: max_model_len 256, max_num_seqs 16


def test_large_model_decode_is_memory_bound_and_bigger_than_the_caches_bound(cpu):
    spec = pm.ModelSpec.from_hf_config(cb.LARGE_CONFIG, name="large")
    assert 2.0e8 < spec.num_params() < 4.0e8
    step = _step("memory-bound", cpu)
    # batch-4 BF16 decode does 2 FLOP per 2-byte weight per sequence = 4 FLOP/byte, below the machine's ridge point
    # (415.3 / 30.1 = 13.8 FLOP/byte)
    assert step["bound"] == "memory" and step["weight_bytes_read"] > 4e8


def test_long_context_is_kv_dominated_bound(cpu):
    step = _step("long-context", cpu)
    assert step["kv_bytes_read"] > step["weight_bytes_read"]
    assert _step("tiny", cpu)["kv_bytes_read"] < _step("tiny", cpu)["weight_bytes_read"]


def test_unknown_workload_is_a_usage_error(tmp_path, capsys):
    assert cb.main(["--out", str(tmp_path), "--workloads", "huge"]) == 2
    assert "--workloads" in capsys.readouterr().err


def test_asv_engine_perf_tracks_read_the_rows_exact(tmp_path, monkeypatch):
    import importlib
    import json
    import os

    from support import REPO_ROOT

    rows = [{"workload": "tiny", "config": "fp8-kv", "measured": 0.97, "ci": [0.8, 1.1], "predicted": 1.035,
             "model_error": 0.97 / 1.035 - 1, "claim": "cpu-vllm-fp8-kv", "verdict": "PASS"},
            {"workload": "tiny", "config": "fp8-linear-ptpc", "measured": 0.29, "ci": [0.18, 0.38], "predicted": None,
             "model_error": None, "claim": None, "verdict": "NO-CLAIM"}]
    (tmp_path / "cpu_bench.json").write_text(json.dumps({"schema": "fp8rl.perf.cpu_bench", "engine": "vllm",
                                                         "rows": rows}))
    monkeypatch.syspath_prepend(str(REPO_ROOT / "perf"))
    monkeypatch.setenv("FP8RL_ASV_ENGINE_PERF", os.pathsep.join([str(tmp_path), str(tmp_path / "missing.json")]))
    import benchmarks.bench_engine_perf as bp

    bp = importlib.reload(bp)
    assert bp.EnginePerf.params == (["vllm · tiny"], ["fp8-kv", "fp8-linear-ptpc"])
    b = bp.EnginePerf()
    b.setup("vllm · tiny", "fp8-kv")
    assert (b.track_speedup("vllm · tiny", "fp8-kv"), b.track_predicted("vllm · tiny", "fp8-kv"),
            b.track_model_error("vllm · tiny", "fp8-kv")) == (0.97, 1.035, rows[0]["model_error"])
    b.setup("vllm · tiny", "fp8-linear-ptpc")
    with pytest.raises(NotImplementedError):  # asv records a skipped benchmark
        b.track_predicted("vllm · tiny", "fp8-linear-ptpc")
    monkeypatch.delenv("FP8RL_ASV_ENGINE_PERF")
    bp = importlib.reload(bp)
    assert bp.EnginePerf.params[0] == ["(no FP8RL_ASV_ENGINE_PERF)"]
