"""``fp8rl perf hardware --probe`` (fp8rl.perf.probe) and CPU-class gating against a probed machine.

Timing is never asserted (a shared machine): only structure, units and sanity (positive, finite, plausible order),
that the written entry loads in the model, and that the gate uses it for its ceiling."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fp8rl.perf import gate as g
from fp8rl.perf import model as pm
from fp8rl.perf.probe import probe, write_probe
from fp8rl.perf.results import hardware_block

TINY = {"size_mib": 4, "matmul_n": 128, "repeats": 2}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "probe.json"
    p = probe("cpu", name="test-cpu", **TINY)
    write_probe(p, out)
    return p, out


def test_probe_entry_structure_and_units_bound(probed):
    p, out = probed
    e = p["entry"]
    assert p["name"] == "test-cpu" and e["class"] == "cpu" and e["match"]
    m = e["measured"]
    for v in (m["stream"]["copy_Bps"], m["stream"]["triad_Bps"], m["matmul"]["fp32_flops"], m["matmul"]["bf16_flops"],
              e["hbm_bandwidth_Bps"], e["bf16_dense_flops"], e["fp8_dense_flops"]):
        assert isinstance(v, float) and math.isfinite(v) and v > 0
    # bytes/s and FLOP/s, not GB/s or GFLOP/s: any real machine streams > 100 MB/s and multiplies > 10 MFLOP/s
    assert e["hbm_bandwidth_Bps"] > 1e8 and e["bf16_dense_flops"] > 1e7
    assert e["hbm_bandwidth_Bps"] == max(m["stream"]["copy_Bps"], m["stream"]["triad_Bps"])
    assert e["hbm_bytes"] > 2**27 and e["hbm_bytes"] % 1024 == 0
    if m["matmul"]["fp8_supported"]:  # the faster of FP8 and the W8A16 route through the BF16 GEMM
        assert e["fp8_dense_flops"] == max(m["matmul"]["fp8_scaled_mm_flops"], m["matmul"]["bf16_flops"])
        assert ("the bf16 figure, the larger" in e["source"]) == (m["matmul"]["fp8_scaled_mm_flops"]
                                                                   < m["matmul"]["bf16_flops"])
    else:  # unsupported: the reason is recorded and the model gets no FP8 compute gain
        assert m["matmul"]["fp8_reason"] and e["fp8_dense_flops"] == e["bf16_dense_flops"]
    assert m["timer"] == "time.perf_counter" and m["threads"] == torch.get_num_threads()
    doc = json.loads(out.read_text())
    assert doc["schema"] == "fp8rl.perf.hardware" and list(doc["hardware"]) == ["test-cpu"]


def test_probed_file_loads_in_the_model_exact(probed):
    p, out = probed
    hw = pm.load_hardware(str(out))
    e = p["entry"]
    assert (hw.name, hw.cls, hw.hbm_bytes) == ("test-cpu", "cpu", e["hbm_bytes"])
    assert (hw.hbm_bandwidth_Bps, hw.bf16_dense_flops, hw.fp8_dense_flops) == (
        e["hbm_bandwidth_Bps"], e["bf16_dense_flops"], e["fp8_dense_flops"])
    assert pm.load_hardware(f"{out}#test-cpu") == hw
    est = pm.estimate_all(pm.load_model_spec("tiny-qwen3"), hw, pm.Workload(32, 32, 4),
                          ["bf16", "fp8-kv", "fp8-linear-ptpc"])
    assert set(est) == {"bf16", "fp8-kv", "fp8-linear-ptpc"} and all(x.throughput_tok_s > 0 for x in est.values())
    blk = hardware_block(str(out))
    assert blk["name"] == "test-cpu" and blk["class"] == "cpu" and blk["file"] == str(out.resolve())


def test_bad_probe_and_hardware_file_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="size_mib"):
        probe("cpu", size_mib=0)
    with pytest.raises(ValueError, match="device"):
        probe("tpu", **TINY)
    with pytest.raises(ValueError, match="no such file"):
        pm.load_hardware(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="not a usable hardware.json-format file"):
        pm.load_hardware(str(bad))


def test_ptpc_weight_bytes_are_one_fp32_scale_per_row_exact():
    spec = pm.load_model_spec("tiny-qwen3")
    wb = pm.weight_bytes(spec, "fp8-linear-ptpc")
    rows = sum(w.shape[0] * w.count for w in spec.weight_groups() if w.kind in ("linear", "expert") and w.fp8_eligible)
    assert wb["scales"] == rows * 4
    assert pm.get_precision("fp8_linear_ptpc").name == "fp8-linear-ptpc"


def _result(ratios: dict[str, list[float]], hw_file: str, amx: bool = False) -> dict:
    """A synthetic vLLM result on the probed machine, recorded as a CPU without (default) or with AMX tiles."""
    from fp8rl.perf.results import new_result

    hardware = dict(hardware_block(hw_file), cpu_features=["amx"] if amx else [])

    runs = []
    seq = 0
    for i in range(len(next(iter(ratios.values())))):
        for cfg in ["bf16", *ratios]:
            tp = 100.0 if cfg == "bf16" else 100.0 * ratios[cfg][i]
            runs.append({"group": "default", "config": cfg, "repeat": i, "seq": seq, "throughput": tp, "wall_s": 1.0,
                         "tokens": int(tp), "valid": True, "problems": []})
            seq += 1
    return new_result(kind="rollout", source="synthetic", engine={"name": "vllm", "version": "0.32.0"},
                      model={"name": "tiny-qwen3", "path": None}, hardware=hardware,
                      workload={"batch": 4, "prompt_len": 32, "gen_len": 32}, metric="output_tokens_per_s",
                      baseline_config="bf16", configs=["bf16", *ratios], runs=runs)


def test_cpu_claims_gate_against_the_probed_model_bound(probed):
    """The CPU-class claims apply to a vLLM result on a probed CPU; the ceiling is the model's prediction for that
    machine (recomputed here through the model, not copied), the row reports measured vs predicted, a slowdown
    above the floor passes, one below it fails, and a ratio far above parity is SUSPECT."""
    _, out = probed
    claims = g.load_claims()
    hw = pm.load_hardware(str(out))
    wl = pm.Workload(prompt_len=32, gen_len=32, max_num_seqs=4, num_requests=4)
    spec = pm.load_model_spec("tiny-qwen3")
    ok = _result({"fp8-kv": [0.95, 1.0, 1.05, 0.9], "fp8-linear-ptpc": [0.3, 0.35, 0.4, 0.32]}, str(out))
    rep = g.gate([("ok.json", ok)], claims)
    rows = {r.config: r for r in rep.rows}
    for cfg in ("fp8-kv", "fp8-linear-ptpc"):
        r = rows[cfg]
        assert r.claim_id == f"cpu-vllm-{cfg}" and r.gated
        assert r.ceiling == pytest.approx(pm.speedup_ceiling(spec, hw, cfg, wl), rel=1e-12)
        assert r.model_error == pytest.approx(r.estimate.point / r.ceiling - 1, rel=1e-12)
    assert g.overall_verdict(rep) == "PASS"
    slow = _result({"fp8-linear-ptpc": [0.05, 0.06, 0.05, 0.04]}, str(out))
    assert g.overall_verdict(g.gate([("slow.json", slow)], claims)) == "FAIL"
    fast = _result({"fp8-kv": [3.0, 3.1, 2.9, 3.0]}, str(out))
    assert g.overall_verdict(g.gate([("fast.json", fast)], claims)) == "SUSPECT"


def test_cpu_claims_follow_the_kind_of_cpu_exact(probed):
    """The CPU claims are scoped by AMX: on an AMX result the AMD-measured floors do not apply (vLLM's PTPC runs at
    ~0.005x there) and the cpu-amx claim does; a result that records no CPU features matches neither."""
    _, out = probed
    claims = g.load_claims()
    ratios = {"fp8-kv": [0.95, 1.0, 1.05, 0.9], "fp8-linear-ptpc": [0.005, 0.0048, 0.0047, 0.005]}
    rows = {r.config: r for r in g.gate([("amx.json", _result(ratios, str(out), amx=True))], claims).rows}
    assert rows["fp8-linear-ptpc"].claim_id == "cpu-amx-vllm-fp8-linear-ptpc" and rows["fp8-linear-ptpc"].gated
    assert rows["fp8-kv"].claim_id is None
    no_amx = {r.config: r.claim_id for r in g.gate([("e.json", _result(ratios, str(out)))], claims).rows}
    assert no_amx == {"fp8-kv": "cpu-vllm-fp8-kv", "fp8-linear-ptpc": "cpu-vllm-fp8-linear-ptpc"}
    older = _result(ratios, str(out))
    del older["hardware"]["cpu_features"]
    assert {r.claim_id for r in g.gate([("old.json", older)], claims).rows} == {None}


def test_probe_cli_writes_a_loadable_file(tmp_path, capsys):
    from fp8rl.cli import main

    out = tmp_path / "hw.json"
    rc = main(["perf", "hardware", "--probe", "--device", "cpu", "--size-mib", "4", "--matmul-n", "64",
               "--repeats", "1", "--out", str(out)])
    assert rc == 0 and pm.load_hardware(str(out)).cls == "cpu"
    assert "bandwidth" in capsys.readouterr().out


def test_fp8_matmul_size_shrinks_a_slow_fp8_path_exact():
    from fp8rl.perf.probe import fp8_matmul_size

    # a fast path keeps the full size; a slow one (10 ms for 128^3: 2048^3 would take 41 s) is measured at the
    # largest halving whose estimate (cubic in the size) is within the 2 s budget: 512 (0.64 s; 1024 would be 5.1 s)
    assert fp8_matmul_size(1e-5, 128, 2048) == 2048
    assert fp8_matmul_size(0.01, 128, 2048) == 512
    assert fp8_matmul_size(10.0, 128, 2048) == 128  # never below the pilot's size
    assert fp8_matmul_size(0.01, 128, 2048, budget_s=100.0) == 2048
