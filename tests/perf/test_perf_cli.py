"""``fp8rl perf ...`` end to end (in-process through fp8rl.cli.main), the GPU check's CPU path and the suite-speed
script. Exit codes: 0 ok/pass, 1 fail, 2 usage/unavailable/nothing gated, 3 suspect."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8rl.cli import main
from support import REPO_ROOT

ROOT = REPO_ROOT


def run(*argv: str) -> int:
    return main(list(argv))


@pytest.fixture
def ckpt(tmp_path):
    """A minimal checkpoint directory (the fake engines ignore the weights)."""
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 40, "_name_or_path": "fake/tiny"}))
    save_file({"w": torch.zeros(1, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
    return str(d)


def _vllm(path: Path, tps: float) -> str:
    """A `vllm bench throughput --output-json` file of 1536 requests of 2048 + 20480 tokens at ``tps`` tokens/s."""
    total = 1536 * (2048 + 20480)
    path.write_text(json.dumps({"elapsed_time": total / tps, "num_requests": 1536, "total_num_tokens": total,
                                "requests_per_second": 1536 * tps / total, "tokens_per_second": tps}))
    return str(path)


def _ingest(tmp_path: Path, ratios: list[float], name: str = "r.json", config: str = "fp8-linear") -> str:
    base = [_vllm(tmp_path / f"{name}.b{i}.json", 1000.0 * (1 + 0.01 * i)) for i in range(len(ratios))]
    cand = [_vllm(tmp_path / f"{name}.c{i}.json", 1000.0 * (1 + 0.01 * i) * r) for i, r in enumerate(ratios)]
    out = tmp_path / name
    assert run("perf", "ingest", "--run", "bf16", *base, "--run", config, *cand, "--model-name", "Qwen/Qwen3-8B-Base",
               "--hardware", "H100-SXM-80GB", "--prompt-len", "2048", "--gen-len", "20480", "--out", str(out)) == 0
    return str(out)


# ---------------------------------------------------------------------------------------------------------------
# model


def test_perf_model_json_reproduces_paper_rows(capsys):
    assert run("perf", "model", "--model", "Qwen3-8B", "--hardware", "H100-SXM-80GB", "--workload", "2048:20480",
               "--calibrate", "bf16:249952", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    cap = {k: v["kv_capacity_tokens"] for k, v in d["configs"].items()}
    assert cap["bf16"] == 249_952
    assert abs(cap["fp8-linear"] / 299_344 - 1) < 0.03 and abs(cap["fp8-all"] / 598_672 - 1) < 0.03
    assert d["configs"]["fp8-all"]["ratio_vs_bf16"] > d["configs"]["fp8-linear"]["ratio_vs_bf16"] > 1


def test_perf_model_table_and_errors(capsys, tmp_path):
    assert run("perf", "model", "--model", "Qwen/Qwen3-30B-A3B", "--hardware", "H200", "--prompt-len", "1024",
               "--gen-len", "4096", "--configs", "fp8-linear") == 0
    out = capsys.readouterr().out
    assert "KV capacity" in out and "fp8-linear" in out and "bf16" in out
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}))
    assert run("perf", "model", "--model", str(cfg), "--hardware", "B200", "--json") == 0
    assert run("perf", "model", "--model", "no-such-model") == 2
    assert run("perf", "model", "--model", "Qwen3-8B", "--hardware", "TPUv9") == 2
    assert run("perf", "model", "--model", "Qwen3-8B", "--workload", "1:2:3:4") == 2
    assert "fp8rl perf" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# run


def test_perf_run_with_fake_engine(tmp_path, ckpt, capsys):
    out = tmp_path / "res.json"
    code = run("perf", "run", "--engine", "test_perf_harness:make_fake", "--model", ckpt, "--configs",
               "bf16,fp8-kv,fp8-all", "--batch", "2", "--prompt-len", "3", "--gen-len", "5", "--repeats", "3",
               "--out", str(out), "--no-progress")
    assert code == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["model"]["name"] == "fake/tiny" and res["configs"] == ["bf16", "fp8-kv", "fp8-all"]
    assert len(res["runs"]) == 9 and res["command"]
    out_text = capsys.readouterr().out
    assert "median tok/s" in out_text and "fp8-all" in out_text
    # nothing to gate on a CPU fake run: exit 2, or 0 with --allow-unmatched
    assert run("perf", "gate", str(out)) == 2
    assert run("perf", "gate", str(out), "--allow-unmatched", "--out", str(tmp_path / "g")) == 0
    assert (tmp_path / "g" / "gate.md").exists() and (tmp_path / "g" / "gate.json").exists()
    # regression vs itself passes. The unpaired bootstrap CI of a ratio of 3 wall-clock samples vs themselves lies
    # within [min/max, max/min] of the samples; on a loaded 2-core machine one fake run can take 3x another (a 60%
    # floor failed once under load), so the floor is 95%: it fails only if runs differ 20-fold
    assert run("perf", "gate", str(out), "--baseline", str(out), "--max-regression", "95%") == 0


def test_perf_run_capability_missing_and_broken_workload(tmp_path, ckpt, capsys):
    assert run("perf", "run", "--engine", "test_perf_harness:make_no_rollout", "--model", ckpt,
               "--out", str(tmp_path / "x.json")) == 2
    assert "not implemented by this engine" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    assert run("perf", "run", "--engine", "no.such.module:factory", "--model", ckpt) == 2
    out = tmp_path / "eos.json"
    assert run("perf", "run", "--engine", "test_perf_harness:make_eos_fake", "--model", ckpt, "--configs",
               "bf16,fp8-kv", "--repeats", "3", "--gen-len", "6", "--out", str(out)) == 1
    assert "shorter than gen_len" in capsys.readouterr().out
    # the gate calls a broken measurement SUSPECT even without a claim
    assert run("perf", "gate", str(out)) == 3
    assert run("perf", "run", "--engine", "test_perf_harness:make_fake", "--model", ckpt, "--configs",
               "bf16,int4") == 2


def test_perf_run_reference_engine_tiny_model(tmp_path, capsys):
    """The real e2e rollout ops of the reference engine on the tiny Qwen3 fixture (CPU)."""
    from fp8rl.perf.harness import rollout_reason
    from fp8rl.registry import load_engine

    reason = rollout_reason(load_engine("reference"), ["bf16", "fp8-kv"])
    if reason:
        pytest.skip(reason)
    out = tmp_path / "ref.json"
    code = run("perf", "run", "--engine", "reference", "--model", "tiny-qwen3", "--configs", "bf16,fp8-kv",
               "--batch", "2", "--prompt-len", "8", "--gen-len", "4", "--repeats", "2", "--warmup", "1",
               "--out", str(out), "--no-progress")
    assert code == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert all(r["valid"] and r["tokens"] == 8 for r in res["runs"])
    assert res["engine"]["name"] == "reference" and res["model"]["name"] == "tiny-qwen3"


# ---------------------------------------------------------------------------------------------------------------
# ingest + gate


def test_ingest_and_gate_verdicts(tmp_path, capsys):
    ok = _ingest(tmp_path, [1.15, 1.152, 1.148, 1.151, 1.149], "ok.json")
    assert run("perf", "gate", ok, "--out", str(tmp_path / "gate")) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and "qwen3-8b-fp8-linear" in text
    assert (tmp_path / "gate" / "gate.png").stat().st_size > 1000
    md = (tmp_path / "gate" / "gate.md").read_text()
    assert "| ok.json |" in md and "**PASS**" in md
    fail = _ingest(tmp_path, [1.05, 1.06, 1.04, 1.05], "fail.json")
    assert run("perf", "gate", fail) == 1
    suspect = _ingest(tmp_path, [3.0, 3.1, 2.9, 3.0], "suspect.json")
    capsys.readouterr()
    assert run("perf", "gate", suspect, "--json") == 3
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "SUSPECT" and d["exit_code"] == 3
    # both files: a FAIL dominates a SUSPECT
    assert run("perf", "gate", ok, fail, suspect) == 1
    # regression: fail.json's fp8-linear is 9% slower than ok.json's
    assert run("perf", "gate", fail, "--baseline", ok, "--max-regression", "5%", "--claim",
               "qwen3-8b-fp8-kv") == 1


def test_gate_usage_errors(tmp_path, capsys):
    raw = _vllm(tmp_path / "raw.json", 1000.0)
    assert run("perf", "gate", raw) == 2
    assert "perf ingest" in capsys.readouterr().err
    assert run("perf", "gate", str(tmp_path / "missing.json")) == 2
    ok = _ingest(tmp_path, [1.15] * 3)
    assert run("perf", "gate", ok, "--max-regression", "150%") == 2
    assert run("perf", "gate", ok, "--claims", str(tmp_path / "nope.toml")) == 2
    assert run("perf", "gate", ok, "--claim", "no-such-claim") == 2
    assert run("perf", "ingest", "--model-name", "m", "--out", str(tmp_path / "o.json")) == 2


def test_claims_and_hardware_listings(capsys):
    assert run("perf", "claims", "--json") == 0
    claims = json.loads(capsys.readouterr().out)
    assert {c["id"] for c in claims} >= {"qwen3-8b-fp8-linear", "qwen3-30b-a3b-fp8-linear"}
    assert run("perf", "claims") == 0
    capsys.readouterr()
    assert run("perf", "hardware", "--json") == 0
    hw = json.loads(capsys.readouterr().out)
    assert {h["name"] for h in hw} == {"H100-SXM-80GB", "H200", "B200", "GB200"}
    assert run("perf", "hardware") == 0


def test_perf_is_registered_in_the_installed_cli():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "fp8rl", "perf", "--help"], capture_output=True, text=True, env=env,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    for sub in ("model", "run", "ingest", "gate", "claims", "hardware"):
        assert sub in p.stdout


# ---------------------------------------------------------------------------------------------------------------
# GPU check (CPU path) and suite speed


def test_gpu_check_skips_cleanly_without_cuda(capsys, tmp_path):
    from fp8rl.perf import gpu_check

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the skip path is not taken")
    assert gpu_check.main(["--out", str(tmp_path / "gc")]) == 0
    assert "skipped" in capsys.readouterr().out
    assert not (tmp_path / "gc").exists()


def test_gpu_check_force_cpu_writes_gate_readable_json(tmp_path, capsys):
    from fp8rl.perf import gpu_check
    from fp8rl.perf.results import load_result

    out = tmp_path / "gc"
    assert gpu_check.main(["--force-cpu", "--shapes", "tiny", "--repeats", "3", "--iters", "1", "--warmup", "0",
                           "--skip-probe", "--out", str(out)]) == 0
    res = load_result(out / "gemm.json")
    assert res["kind"] == "gemm" and res["metric"] == "tflops" and "fp8-row" in res["configs"]
    summary = json.loads((out / "gpu_check.json").read_text())
    for d in summary["gemm"].values():
        assert d["rel_error_vs_bf16"]["fp8-row"] < 0.1  # the FP8 GEMM computes the right thing
        assert "fp8-block" in d["unavailable"]  # block-wise scaled_mm is rejected on CPU
    assert run("perf", "gate", str(out / "gemm.json"), "--allow-unmatched") == 0
    # on a hopper the derived GEMM claim applies; the embedded ceilings are used
    res["hardware"] = {"name": "H200", "class": "hopper", "device": "NVIDIA H200"}
    res["ceilings"] = {g: {"fp8-row": 1.9} for g in {r["group"] for r in res["runs"]}}
    from fp8rl.perf import gate as g

    rep = g.gate([("gemm.json", res)], g.load_claims())
    assert {r.claim_id for r in rep.rows} == {"fp8-rowwise-gemm-not-slower"}
    assert all(r.ceiling == 1.9 for r in rep.rows)


def test_suite_speed_runs_and_oracle_matches_verl_bit_for_bit(capsys):
    from fp8rl.perf import suite_speed

    assert suite_speed.main(["--size", "200", "--repeats", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["quantize"]
    assert d["verl_torch_policy_code_mismatches"] == 0 and d["verl_torch_policy_scale_mismatches"] == 0
    assert math.isfinite(d["ratio_oracle_over_verl"])
    x = torch.randn(130, 260) * 3
    x[:128, :128] = 0  # an all-zero block: veRL's torch path gives scale 1
    q, s = suite_speed.verl_style_blockwise(x)
    assert q.shape == x.shape and s.shape == (2, 3) and s[0, 0] == 1.0


@pytest.mark.parametrize("argv, name", [(["--repeats", "0"], "--repeats"), (["--size", "0"], "--size")])
def test_suite_speed_bad_arguments_name_themselves(argv, name, capsys):
    from fp8rl.perf import suite_speed

    with pytest.raises(SystemExit) as exc:
        suite_speed.main(argv)
    assert exc.value.code == 2 and name in capsys.readouterr().err
