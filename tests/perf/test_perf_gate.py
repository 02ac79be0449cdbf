"""Claim and regression gates on synthetic result files with known answers (incl. noisy ones near a bound)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fp8rl.perf import gate as g
from fp8rl.perf import gate_render, stats
from fp8rl.perf import model as pm
from fp8rl.perf.results import new_result, validate

H100 = {"name": "H100-SXM-80GB", "class": "hopper", "device": "NVIDIA H100 80GB HBM3"}
CPU = {"name": None, "class": "cpu", "device": "Intel Xeon"}
LONG = {"batch": 256, "prompt_len": 2048, "gen_len": 20480, "repeats": 0}


def synthetic(log_ratios, *, config="fp8-linear", model="Qwen/Qwen3-8B-Base", engine="vllm", hardware=H100,
              workload=LONG, base_level=1000.0, base_noise=None, invalid=(), kind="rollout", ceilings=None,
              metric="output_tokens_per_s", group="default"):
    """A result whose pair i has throughputs (b_i, b_i · exp(log_ratios[i]))."""
    n = len(log_ratios)
    noise = np.zeros(n) if base_noise is None else np.asarray(base_noise)
    runs = []
    for i, lr in enumerate(log_ratios):
        b = base_level * math.exp(noise[i])
        for j, (cfg, v) in enumerate((("bf16", b), (config, b * math.exp(lr)))):
            runs.append({"group": group, "config": cfg, "repeat": i, "seq": 2 * i + j, "throughput": v,
                         "wall_s": 1.0, "valid": (i, cfg) not in invalid,
                         "problems": ["2 response(s) shorter than gen_len"] if (i, cfg) in invalid else []})
    res = new_result(kind=kind, source="synthetic", engine={"name": engine, "version": "0"},
                     model={"name": model, "path": None}, hardware=hardware, workload=dict(workload, repeats=n),
                     metric=metric, baseline_config="bf16", configs=["bf16", config], runs=runs)
    if ceilings is not None:
        res["ceilings"] = ceilings
    return validate(res)


@pytest.fixture(scope="module")
def claims():
    return g.load_claims()


def run_gate(claims, *results, **kw):
    return g.gate([(f"r{i}.json", r) for i, r in enumerate(results)], claims, **kw)


def rows_for(report, claim_id):
    return [r for r in report.rows if r.claim_id == claim_id]


# ---------------------------------------------------------------------------------------------------------------
# statistics


def test_paired_speedup_point_is_geometric_mean_and_deterministic():
    base = [100.0, 200.0, 400.0, 800.0]
    cand = [110.0, 230.0, 420.0, 880.0]
    e1 = stats.paired_speedup(base, cand, seed=3)
    e2 = stats.paired_speedup(base, cand, seed=3)
    assert e1 == e2
    assert e1.point == pytest.approx(math.exp(np.mean(np.log(np.array(cand) / np.array(base)))))
    assert e1.lo <= e1.point <= e1.hi
    with pytest.raises(ValueError):
        stats.paired_speedup([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        stats.paired_speedup([0.0], [1.0])


def test_bootstrap_ci_covers_more_with_more_noise():
    tight = stats.paired_speedup([1000.0] * 8, [1150 * math.exp(d) for d in np.linspace(-0.005, 0.005, 8)])
    loose = stats.paired_speedup([1000.0] * 8, [1150 * math.exp(d) for d in np.linspace(-0.08, 0.08, 8)])
    assert (tight.hi - tight.lo) < (loose.hi - loose.lo)
    assert tight.lo > 1.14 and loose.lo < 1.12


def test_pairing_cancels_common_drift():
    # throughput drifts ×2 over the run, the FP8/BF16 ratio stays 1.2: paired CI is tight around 1.2
    drift = np.linspace(0, math.log(2), 10)
    res = synthetic([math.log(1.2)] * 10, base_noise=drift)
    e = run_gate([], res).rows[0].estimate
    assert e.point == pytest.approx(1.2) and e.lo == pytest.approx(1.2) and e.hi == pytest.approx(1.2)
    un = stats.unpaired_ratio([r["throughput"] for r in res["runs"][0::2]], [r["throughput"] for r in res["runs"][1::2]])
    assert un.hi - un.lo > 0.2  # without pairing the drift swamps the CI


# ---------------------------------------------------------------------------------------------------------------
# claim verdicts (known answers)


def test_clear_pass(claims):
    res = synthetic(math.log(1.15) + np.array([0.004, -0.003, 0.002, -0.004, 0.001, 0.0, -0.002, 0.002]))
    rep = run_gate(claims, res)
    (row,) = rows_for(rep, "qwen3-8b-fp8-linear")
    assert row.verdict == "PASS" and row.gated
    assert row.estimate.lo > 1.10 and row.ceiling is not None and row.ceiling > 1.2
    assert g.exit_code(rep) == g.EXIT_PASS


def test_clear_fail(claims):
    rep = run_gate(claims, synthetic([math.log(1.05)] * 5))
    (row,) = rows_for(rep, "qwen3-8b-fp8-linear")
    assert row.verdict == "FAIL" and g.exit_code(rep) == g.EXIT_FAIL
    assert "< claim lower 1.1000" in row.reason


def test_noisy_near_boundary_fails_but_precise_passes(claims):
    """True speedup 1.12 (above the 1.10 bound): with ±6% noise on 5 pairs the CI reaches below 1.10 → FAIL
    (the burden of proof is on the measurement); with ±0.5% noise on 10 pairs → PASS."""
    noisy = np.array([-0.06, 0.05, -0.04, 0.07, -0.02])  # mean 0
    rep = run_gate(claims, synthetic(math.log(1.12) + noisy))
    (row,) = rows_for(rep, "qwen3-8b-fp8-linear")
    assert row.estimate.point == pytest.approx(1.12)
    assert row.estimate.lo < 1.10 < row.estimate.hi
    assert row.verdict == "FAIL"
    precise = math.log(1.12) + 0.005 * np.array([1, -1, 0.5, -0.5, 0.2, -0.2, 0.8, -0.8, 0.1, -0.1])
    (row2,) = rows_for(run_gate(claims, synthetic(precise)), "qwen3-8b-fp8-linear")
    assert row2.verdict == "PASS" and row2.estimate.lo > 1.10


def test_noisy_just_below_boundary_fails_even_if_point_above(claims):
    # point 1.105 > 1.10 but the CI's lower end is below → FAIL
    res = synthetic(math.log(1.105) + 0.01 * np.array([1, -1, 2, -2, 0.5, -0.5]))
    (row,) = rows_for(run_gate(claims, res), "qwen3-8b-fp8-linear")
    assert row.estimate.point > 1.10 > row.estimate.lo and row.verdict == "FAIL"


def test_exact_bound_passes(claims):
    res = synthetic([math.log(1100.0) - math.log(1000.0)] * 4)
    (row,) = rows_for(run_gate(claims, res), "qwen3-8b-fp8-linear")
    assert row.estimate.lo == pytest.approx(1.10) and row.verdict == "PASS"


def test_above_ceiling_is_suspect(claims):
    rep = run_gate(claims, synthetic([math.log(3.0)] * 5))  # fp8-linear cannot triple throughput
    (row,) = rows_for(rep, "qwen3-8b-fp8-linear")
    assert row.verdict == "SUSPECT" and "ceiling" in row.reason
    assert g.exit_code(rep) == g.EXIT_SUSPECT


def test_invalid_runs_are_suspect(claims):
    res = synthetic([math.log(1.15)] * 5, invalid={(2, "fp8-linear")})
    (row,) = rows_for(run_gate(claims, res), "qwen3-8b-fp8-linear")
    assert row.verdict == "SUSPECT" and "broke the workload" in row.reason and row.estimate.n == 4


def test_too_few_pairs_is_insufficient(claims):
    rep = run_gate(claims, synthetic([math.log(1.15)] * 2))
    (row,) = rows_for(rep, "qwen3-8b-fp8-linear")
    assert row.verdict == "INSUFFICIENT" and g.exit_code(rep) == g.EXIT_FAIL


def test_moe_and_kv_claims_and_info_claim(claims):
    moe = synthetic(math.log(1.40) + 0.01 * np.array([1, -1, 0, 0.5, -0.5]), model="Qwen3-30B-A3B",
                    workload={"batch": 512, "prompt_len": 1024, "gen_len": 20480})
    (row,) = rows_for(run_gate(claims, moe), "qwen3-30b-a3b-fp8-linear")
    assert row.verdict == "PASS"
    kv = synthetic(math.log(1.38) + 0.01 * np.array([1, -1, 0, 0.5, -0.5]), config="fp8-kv")
    (row,) = rows_for(run_gate(claims, kv), "qwen3-8b-fp8-kv")
    assert row.verdict == "PASS"
    full = synthetic(math.log(1.44) + 0.01 * np.array([1, -1, 0, 0.5, -0.5]), config="fp8-all")
    rep = run_gate(claims, full)
    assert rows_for(rep, "qwen3-8b-fp8-all")[0].verdict == "PASS"
    info = rows_for(rep, "qwen3-8b-fp8-all-nemo-rl")[0]
    assert info.verdict == "INFO" and not info.gated  # 1.44 is below its 1.39..1.57 band? no: reported only
    assert g.exit_code(rep) == g.EXIT_PASS


@pytest.mark.parametrize("change,why", [
    ({"engine": "reference"}, "engine"), ({"hardware": CPU}, "hardware class"),
    ({"model": "Llama-3.1-8B"}, "model"), ({"workload": {"batch": 8, "prompt_len": 16, "gen_len": 64}}, "gen_len"),
])
def test_claims_do_not_apply_outside_their_setting(claims, change, why):
    res = synthetic([math.log(1.15)] * 4, **change)
    rep = run_gate(claims, res)
    assert [r.verdict for r in rep.rows] == ["NO-CLAIM"]
    assert g.exit_code(rep) == g.EXIT_USAGE and g.exit_code(rep, allow_unmatched=True) == g.EXIT_PASS
    c = next(c for c in claims if c.id == "qwen3-8b-fp8-linear")
    ok, reason = c.applies(res, "default", "fp8-linear")
    assert not ok and why in reason


def test_only_claims_filter(claims):
    res = synthetic([math.log(1.15)] * 4)
    rep = run_gate(claims, res, only_claims=["qwen3-8b-fp8-kv"])
    assert [r.verdict for r in rep.rows] == ["NO-CLAIM"]
    with pytest.raises(ValueError, match="unknown claim"):
        run_gate(claims, res, only_claims=["nope"])


def test_gemm_result_with_embedded_ceilings(claims):
    ok = synthetic([math.log(1.7)] * 4, kind="gemm", config="fp8-row", model="gemm", engine="torch",
                   metric="tflops", ceilings={"default": {"fp8-row": 1.97}}, workload={})
    (row,) = rows_for(run_gate(claims, ok), "fp8-rowwise-gemm-not-slower")
    assert row.verdict == "PASS" and row.ceiling == 1.97
    bad = synthetic([math.log(2.6)] * 4, kind="gemm", config="fp8-row", model="gemm", engine="torch",
                    metric="tflops", ceilings={"default": {"fp8-row": 1.97}}, workload={})
    (row,) = rows_for(run_gate(claims, bad), "fp8-rowwise-gemm-not-slower")
    assert row.verdict == "SUSPECT"
    slow = synthetic([math.log(0.8)] * 4, kind="gemm", config="fp8-row", model="gemm", engine="torch",
                     metric="tflops", workload={})
    assert rows_for(run_gate(claims, slow), "fp8-rowwise-gemm-not-slower")[0].verdict == "FAIL"


# ---------------------------------------------------------------------------------------------------------------
# regression gate


def _flat(level, noise):
    return synthetic([0.0] * len(noise), base_level=level, base_noise=np.asarray(noise), hardware=CPU,
                     model="tiny", engine="fake")


def test_regression_gate():
    noise = [0.01, -0.01, 0.005, -0.005, 0.0, 0.0]
    base = _flat(1000.0, noise)
    same = _flat(990.0, noise[::-1])
    slow = _flat(900.0, noise)
    rep = g.gate([("cur.json", same)], [], baseline=("base.json", base), max_regression=0.05)
    assert {r.verdict for r in rep.rows if r.kind == "regression"} == {"PASS"}
    assert g.exit_code(rep) == g.EXIT_PASS
    rep = g.gate([("cur.json", slow)], [], baseline=("base.json", base), max_regression=0.05)
    regs = [r for r in rep.rows if r.kind == "regression"]
    assert len(regs) == 2 and all(r.verdict == "REGRESSED" for r in regs)
    assert regs[0].estimate.point == pytest.approx(0.9, rel=1e-6)
    assert g.exit_code(rep) == g.EXIT_FAIL
    # noisy, point -2% but the CI reaches below -5% → REGRESSED (strict)
    noisy = _flat(980.0, [0.15, -0.15, 0.1, -0.1, 0.05, -0.05])
    rep = g.gate([("cur.json", noisy)], [], baseline=("base.json", base), max_regression=0.05)
    r = [r for r in rep.rows if r.kind == "regression"][0]
    assert r.estimate.point == pytest.approx(0.98, rel=1e-6) and r.estimate.lo < 0.95 and r.verdict == "REGRESSED"



def _not_run(res, why="not timed: over the per-config budget of 900 s"):
    """``res`` as the harness writes a config its per-config budget skipped: no runs, the reason in the workload."""
    cfg = res["configs"][1]
    res = dict(res, runs=[r for r in res["runs"] if r["config"] != cfg],
               workload=dict(res["workload"], skipped_configs={cfg: why}))
    return validate(res)


def test_config_not_run_fails_a_gating_claim_and_is_reported_otherwise(claims):
    measured = synthetic([math.log(1.15)] * 5)
    (row,) = rows_for(run_gate(claims, measured), "qwen3-8b-fp8-linear")
    assert row.verdict == "PASS"
    rep = run_gate(claims, _not_run(measured))
    (row,) = rows_for(rep, "qwen3-8b-fp8-linear")
    assert row.verdict == "NOT-RUN" and row.gated and "900 s" in row.reason
    assert g.overall_verdict(rep) == "FAIL" and g.exit_code(rep) == g.EXIT_FAIL
    # no claim applies (another model): reported, not gated
    rep = run_gate(claims, _not_run(synthetic([0.0] * 5, model="no-such-model")))
    (row,) = rep.rows
    assert row.verdict == "NOT-RUN" and not row.gated and g.overall_verdict(rep) == "NOTHING-GATED"


def test_regression_of_a_config_not_run_is_not_run():
    noise = [0.01, -0.01, 0.005, -0.005, 0.0, 0.0]
    base = _flat(1000.0, noise)
    rep = g.gate([("cur.json", _not_run(_flat(1000.0, noise)))], [], baseline=("base.json", base))
    verdicts = {r.config: r.verdict for r in rep.rows if r.kind == "regression"}
    assert verdicts == {"bf16": "PASS", "fp8-linear": "NOT-RUN"} and g.exit_code(rep) == g.EXIT_FAIL

def test_regression_needs_comparable_files():
    base = _flat(1000.0, [0.0, 0.01, -0.01])
    other = synthetic([0.0] * 3, metric="tflops", kind="gemm", config="fp8-row", hardware=CPU, workload={})
    rep = g.gate([("cur.json", other)], [], baseline=("base.json", base))
    assert not [r for r in rep.rows if r.kind == "regression"] and rep.notes


# ---------------------------------------------------------------------------------------------------------------
# claims file, rendering


def test_claims_file_is_consistent_with_the_model(claims):
    ids = {c.id for c in claims}
    assert {"qwen3-8b-fp8-linear", "qwen3-30b-a3b-fp8-linear", "qwen3-8b-fp8-kv", "qwen3-8b-fp8-all"} <= ids
    for c in claims:
        assert c.source and c.lower <= (c.upper or c.lower)
        if c.kind != "rollout" or c.ceiling_from_result:  # CPU class: ceiling from the result (test_perf_probe.py)
            continue
        pm.load_model_spec(c.model)
        ceiling = g._model_ceiling({"kind": "rollout", "hardware": {}, "baseline_config": c.baseline,
                                    "model": {"name": c.model}}, c, c.config)
        # a measurement inside the published band must never be called SUSPECT
        assert ceiling is not None and ceiling * (1 + c.ceiling_slack) >= c.upper, (c.id, ceiling)


def test_bad_claims_files(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('schema = "fp8rl.perf.claims"\n[[claim]]\nid = "x"\n')
    with pytest.raises(Exception, match="lacks"):
        g.load_claims(p)
    p.write_text("not toml [")
    with pytest.raises(Exception, match="invalid TOML"):
        g.load_claims(p)


def test_markdown_json_and_plot(claims, tmp_path):
    rep = run_gate(claims, synthetic([math.log(1.15)] * 5), synthetic([math.log(3.0)] * 5, config="fp8-kv"))
    md = gate_render.to_markdown(rep)
    assert "| file | model |" in md and "**PASS**" in md and "**SUSPECT**" in md
    paths = gate_render.write_outputs(rep, tmp_path / "gate")
    assert paths["plot"].stat().st_size > 1000
    d = rep.to_dict()
    assert d["verdict"] == "SUSPECT" and d["exit_code"] == g.EXIT_SUSPECT
    assert {r["verdict"] for r in d["rows"]} >= {"PASS", "SUSPECT"}


def test_small_ratios_and_bounds_keep_their_digits_exact():
    """The AMX PTPC claim's floor (0.0024x) and its measured ratio (~0.004x) rendered with fixed decimals read 0.00."""
    assert (gate_render._fmt(0.0024, 2), gate_render._fmt(0.0037283, 3)) == ("0.0024", "0.00373")
    assert (gate_render._fmt(0.046, 2), gate_render._fmt(1.2346, 3), gate_render._fmt(0.0, 2)) == ("0.046", "1.235",
                                                                                                  "0.00")

