"""``fp8rl claims`` (suite/claims.py): the claims ledger of the FP8-RL report — every row names evidence that exists,
the throughput rows are perf/claims.toml's GPU rollout claims, and their status follows the recorded gate reports."""

from __future__ import annotations

import json
import tomllib

import pytest
from fp8rl import claims as L
from fp8rl.cli import build_parser, main

ROOT = L.repo_root()


def _subcommands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")  # noqa: SLF001
    return set(sub.choices)


def test_every_row_names_evidence_that_exists_and_a_real_command():
    rows = L.ledger()
    commands = _subcommands()
    assert {"parity", "perf", "claims"} <= commands
    for r in rows:
        assert r.status in L.STATUSES
        for ev in r.evidence:
            path = ROOT / ev.split("::")[0]
            assert path.is_file(), (r.id, ev)
            if "::" in ev:  # a named test must exist in its file
                assert f"def {ev.split('::')[1]}(" in path.read_text(), (r.id, ev)
        # every fp8rl command the row gives to reproduce it is a registered subcommand
        words = r.reproduce.replace(";", " ").replace("&&", " ").split()
        named = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "fp8rl"]
        assert named and set(named) <= commands, (r.id, r.reproduce)
    measured_text = " ".join(r.measured for r in rows)
    assert "test_validation_paper_kv_capacity_rows_within_3_percent" in measured_text
    assert "def test_validation_paper_kv_capacity_rows_within_3_percent(" in (
        ROOT / "tests/perf/test_perf_model.py").read_text()


def test_ledger_covers_the_report_claims():
    rows = {r.id: r for r in L.ledger()}
    # the throughput rows are exactly the gated GPU rollout claims of perf/claims.toml (read here independently)
    toml = tomllib.loads((ROOT / "perf/claims.toml").read_text())
    gpu = {c["id"] for c in toml["claim"]
           if c["kind"] == "rollout" and c.get("gate", True) and "cpu" not in (
               [c["hardware_class"]] if isinstance(c["hardware_class"], str) else c["hardware_class"])}
    assert {i.split(":", 1)[1] for i in rows if i.startswith("throughput:")} == gpu
    assert "qwen3-8b-fp8-all" in gpu and "44%" in rows["throughput:qwen3-8b-fp8-all"].claim
    assert {"kv-capacity", "parity-with-correction", "degradation-without-correction"} <= set(rows)
    # this checkout records CPU results only: the GPU claims are not measurable here, and no recorded run reports
    # its KV capacity
    recorded = json.loads((ROOT / "perf/results/cpu-vllm-epyc-2026-12-03/gate.json").read_text())
    assert not any(r.get("claim_id") in gpu for r in recorded["rows"])
    assert all(rows[f"throughput:{c}"].status == "not measurable here" for c in gpu)
    assert rows["kv-capacity"].status == "not measurable here"


def _write_gate(d, claim_id, verdict, point):
    d.mkdir(parents=True)
    row = {"kind": "speedup", "model": "Qwen3-8B", "engine": "vllm", "hardware": "H100-SXM-80GB", "group": "g",
           "baseline": "bf16", "config": "fp8-all", "verdict": verdict, "claim_id": claim_id,
           "estimate": {"point": point, "lo": point - 0.02, "hi": point + 0.02, "n": 5}}
    (d / "gate.json").write_text(json.dumps({"schema": "fp8rl.perf.gate", "rows": [row]}))


@pytest.mark.parametrize("verdict,point,status", [("PASS", 1.44, "confirmed"), ("FAIL", 1.10, "refuted")])
def test_status_follows_a_recorded_gpu_gate_row(tmp_path, verdict, point, status):
    _write_gate(tmp_path / "h100-run", "qwen3-8b-fp8-all", verdict, point)
    rows = {r.id: r for r in L.ledger(tmp_path)}
    row = rows["throughput:qwen3-8b-fp8-all"]
    assert row.status == status and f"{point:.3f}×" in row.measured and verdict in row.measured
    assert row.evidence == (str(tmp_path / "h100-run" / "gate.json"),)
    assert rows["throughput:qwen3-8b-fp8-linear"].status == "not measurable here"


def test_kv_capacity_row_reads_recorded_capacities(tmp_path):
    d = tmp_path / "gpu"
    d.mkdir()
    runs = [{"config": "bf16", "kv_capacity_tokens": 249952}, {"config": "fp8-kv", "kv_capacity_tokens": 499904}]
    (d / "r.json").write_text(json.dumps({"schema": "fp8rl.perf.result", "hardware": {"class": "hopper"},
                                          "runs": runs}))
    row = {r.id: r for r in L.ledger(tmp_path)}["kv-capacity"]
    assert row.status == "confirmed" and "2.00×" in row.measured
    runs[1]["kv_capacity_tokens"] = 300000  # 1.2×: not the doubling claimed
    (d / "r.json").write_text(json.dumps({"schema": "fp8rl.perf.result", "runs": runs}))
    assert {r.id: r for r in L.ledger(tmp_path)}["kv-capacity"].status == "refuted"


def test_claims_command_table_json_and_usage(tmp_path, capsys):
    assert main(["claims", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == [r.id for r in L.ledger()]
    assert all(set(r) == {"id", "claim", "source", "status", "measured", "evidence", "reproduce"} for r in rows)
    assert main(["claims"]) == 0
    table = capsys.readouterr().out
    assert "kv-capacity" in table and "not measurable here" in table and "parity-with-correction" in table
    assert main(["claims", "--results", str(tmp_path / "missing")]) == 2
    assert "--results" in capsys.readouterr().err
    with pytest.raises(ValueError, match="status"):
        L.LedgerRow("x", "c", "s", "maybe", "m", ("README.md",), "fp8rl claims")
