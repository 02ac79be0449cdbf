"""The nightly vLLM-on-CPU run's design (fp8rl.perf.cpu_bench), checked through the perf model without vLLM: the
generated model is memory-bound in BF16 decode on a probed CPU, the long-context workload is KV-dominated, and the
workloads fit the vLLM adapter's max_model_len (256)."""

from __future__ import annotations

import pytest
from fp8rl.perf import cpu_bench as cb
from fp8rl.perf import model as pm
from fp8rl.perf.probe import probe


@pytest.fixture(scope="module")
def cpu():
    p = probe("cpu", size_mib=16, matmul_n=256, repeats=2, name="t")
    e = p["entry"]
    return pm.Hardware(name="t", cls="cpu", hbm_bytes=e["hbm_bytes"], hbm_bandwidth_Bps=e["hbm_bandwidth_Bps"],
                       bf16_dense_flops=e["bf16_dense_flops"], fp8_dense_flops=e["fp8_dense_flops"])


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
    # batch-4 BF16 decode does 2 FLOP per 2-byte weight per sequence = 4 FLOP/byte: memory-bound wherever the
    # measured matmul rate per byte of bandwidth (the ridge point) is above that (13.8 on the CI machine)
    if cpu.bf16_dense_flops / cpu.hbm_bandwidth_Bps <= 4:
        pytest.skip(f"ridge point {cpu.bf16_dense_flops / cpu.hbm_bandwidth_Bps:.1f} FLOP/byte <= 4 on this machine")
    assert step["bound"] == "memory" and step["weight_bytes_read"] > 4e8


def test_long_context_is_kv_dominated_bound(cpu):
    step = _step("long-context", cpu)
    assert step["kv_bytes_read"] > step["weight_bytes_read"]
    assert _step("tiny", cpu)["kv_bytes_read"] < _step("tiny", cpu)["weight_bytes_read"]


def test_unknown_workload_is_a_usage_error(tmp_path, capsys):
    assert cb.main(["--out", str(tmp_path), "--workloads", "huge"]) == 2
    assert "--workloads" in capsys.readouterr().err
