"""The weight-sync and e2e conformance areas end to end: reference conformant with its mismatch report section,
the hf engine BF16-only with reasons, and the e2e budgets' data file and calibration command. (The mutants these
areas kill: suite/mutants/weight_sync.py and e2e.py, proven by tests/checks/test_mutants.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RECIPES = ("bf16", "fp8-linear", "fp8-linear-ptpc", "fp8-kv", "fp8-all")


def _pytest(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "fp8rl.conformance", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=", "-W", "ignore::pytest.PytestAssertRewriteWarning", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _report(path) -> dict:
    return json.loads(path.read_text())


def test_budgets_file_is_package_data_and_registers_every_budget():
    """The measured distribution lives in the data file fp8rl/data/e2e_budgets.json (declared package data); every
    model × recipe × metric of it is a table entry e2e.<metric>.<model>.<recipe> with the margin rule's value."""
    import fnmatch
    import tomllib
    from importlib import resources

    from fp8rl import tolerances as T
    from fp8rl.conformance import _e2e as E
    from support import REPO_ROOT

    assert resources.files("fp8rl").joinpath(T.E2E_BUDGETS_FILE).is_file()
    pkg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fp8rl"]
    assert any(fnmatch.fnmatch(T.E2E_BUDGETS_FILE, pat) for pat in pkg), pkg
    doc = T.load_e2e_budgets()
    assert doc["method"] and "--write" in doc["method"] and "--write" in T.get("e2e_mismatch").derivation
    assert {(m, r) for m, rs in doc["measured"].items() for r in rs} == {(m, r) for m in E.MODELS for r in E.RECIPES}
    for model, recipes in doc["measured"].items():
        for recipe, entry in recipes.items():
            assert entry["calibration"] in doc["calibrations"]
            for metric, margin in doc["margins"].items():
                st = entry[metric]
                want = T.e2e_budget_value(metric, (st["min"], st["median"], st["max"]), margin)
                assert T.get(f"e2e.{metric}.{model}.{recipe}").value == want == T.e2e_budget(metric, model, recipe)
    assert T.E2E_MEASURED[("tiny-qwen3", "fp8-linear")]["k3_kl"] == (0.01022, 0.01769, 0.03046)
    assert T.get("e2e.k3_kl.tiny-qwen3.fp8-linear").value == 2.0 * 0.03046


def _fake_samples(models, recipes, n_runs):
    metrics = ("k3_kl", "k1_kl", "token_mult_prob_error", "max_abs_dlogp", "mean_abs_dlogp", "first_div_mean",
               "first_div_min")
    return {(m, r): {k: [0.5 + 0.25 * i + j for j in range(n_runs)] for i, k in enumerate(metrics)}
            for m in models for r in recipes}


def test_calibration_command_writes_the_budgets_file(tmp_path, monkeypatch):
    """`python -m fp8rl.conformance._e2e --out PATH` (the writer of --write) round-trips through the loader: the
    re-measured entries with a calibration record, the rest of the installed file (method, margins, other
    entries) kept, and the installed file untouched."""
    import torch
    import transformers
    from fp8rl import tolerances as T
    from fp8rl.conformance import _e2e as E

    calls = []

    def fake_calibrate(n_seeds, models, recipes, progress=True, n_sampling=1):
        calls.append((n_seeds, models, recipes))
        return _fake_samples(models, recipes, 2 * n_seeds * n_sampling)

    monkeypatch.setattr(E, "calibrate", fake_calibrate)
    installed = T.load_e2e_budgets()
    out = tmp_path / "budgets.json"
    argv = ["--seeds", "3", "--models", "tiny-qwen3", "--recipes", "fp8-kv", "bf16", "--out", str(out)]
    assert E.main(argv) == 0
    assert calls == [(3, ("tiny-qwen3",), ("fp8-kv", "bf16"))]
    doc = T.load_e2e_budgets(out)
    for recipe in ("fp8-kv", "bf16"):
        entry = doc["measured"]["tiny-qwen3"][recipe]
        assert entry["k3_kl"] == {"min": 0.5, "median": 3.5, "max": 5.5, "n": 6}  # median: sorted[n // 2]
        assert entry["first_div_mean"] == {"min": 1.75, "median": 4.75, "max": 6.75, "n": 6}
        assert set(entry) == {"calibration", *doc["margins"]}  # only the budgeted metrics
        cal = doc["calibrations"][entry["calibration"]]
    assert cal["command"] == "python -m fp8rl.conformance._e2e " + " ".join(argv)
    assert (cal["n_seeds"], cal["runs_per_case"], cal["models"], cal["recipes"]) == (3, 6, ["tiny-qwen3"],
                                                                                   ["fp8-kv", "bf16"])
    assert (cal["torch"], cal["transformers"]) == (torch.__version__, transformers.__version__) and cal["date"]
    for key in ("method", "margins", "margin_rules"):
        assert doc[key] == installed[key]
    assert doc["measured"]["tiny-qwen3-moe"] == installed["measured"]["tiny-qwen3-moe"]
    assert doc["measured"]["tiny-qwen3"]["fp8-linear"] == installed["measured"]["tiny-qwen3"]["fp8-linear"]
    assert set(doc["calibrations"]) == set(installed["calibrations"]) | {doc["measured"]["tiny-qwen3"]["bf16"][
        "calibration"]}
    assert T.load_e2e_budgets() == installed
    # what the table would register from it
    st = doc["measured"]["tiny-qwen3"]["fp8-kv"]["token_mult_prob_error"]
    assert T.e2e_budget_value("token_mult_prob_error", (st["min"], st["median"], st["max"]), 2.0) == 1 + 2 * (6.0 - 1)


def test_budgets_loader_rejects_inconsistent_files(tmp_path):
    import copy

    from fp8rl import tolerances as T
    from fp8rl.conformance import _e2e as E

    good = T.load_e2e_budgets()
    bad_cases = {
        "min > max": lambda d: d["measured"]["tiny-qwen3"]["bf16"]["k3_kl"].update(min=1.0, max=0.5),
        "no margin": lambda d: d["measured"]["tiny-qwen3"]["bf16"].update(k1_kl={"min": 0, "median": 0, "max": 0,
                                                                                    "n": 1}),
        "unknown calibration": lambda d: d["measured"]["tiny-qwen3"]["bf16"].update(calibration="nope"),
        "format": lambda d: d.update(format="other/1"),
    }
    for what, edit in bad_cases.items():
        doc = copy.deepcopy(good)
        edit(doc)
        path = tmp_path / "bad.json"
        path.write_text(E.dump_budgets(doc))
        with pytest.raises(ValueError):
            T.load_e2e_budgets(path)
        with pytest.raises(ValueError):
            E.write_budgets(doc, str(tmp_path / f"{what}.json"))
        assert not (tmp_path / f"{what}.json").exists()


@pytest.mark.slow
def test_tiny_real_calibration_round_trips(tmp_path):
    """One real (tiny) calibration run: 1 seed, one model and recipe, through the module's command line."""
    from fp8rl import tolerances as T

    out = tmp_path / "budgets.json"
    r = subprocess.run([sys.executable, "-m", "fp8rl.conformance._e2e", "--seeds", "1", "--models", "tiny-qwen3",
                        "--recipes", "bf16", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    entry = T.load_e2e_budgets(out)["measured"]["tiny-qwen3"]["bf16"]
    assert entry["k3_kl"]["n"] == 2 and 0 < entry["k3_kl"]["min"] <= entry["k3_kl"]["max"] < 0.01


def test_reference_is_conformant_and_reports_the_mismatch_table(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", "reference", "--area", "weight_sync",
                        "--area", "e2e", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = _report(tmp_path / "report.json")
    assert rep["summary"]["verdict"] == "conformant" and rep["summary"]["total"] == 38
    assert {c["area"] for c in rep["checks"]} == {"weight_sync", "e2e"}
    sec = rep["sections"]["mismatch"]
    rows = sec["table"]["rows"]
    assert [(row[0], row[1]) for row in rows] == [(m, r) for m in ("tiny-qwen3", "tiny-qwen3-moe")
                                                 for r in RECIPES]
    k3 = {(row[0], row[1]): row[2] for row in rows}
    for m in ("tiny-qwen3", "tiny-qwen3-moe"):  # FP8 linear layers move the policy far more than BF16 decoding
        assert k3[(m, "fp8-linear")] > 10 * k3[(m, "bf16")] and k3[(m, "fp8-linear-ptpc")] > 10 * k3[(m, "bf16")]
    plots = sec["plot"]
    assert len(plots) == 2 and all(set(p["series"]) == set(RECIPES) for p in plots)
    assert all(len(ys) == len(p["x"]) == 20 for p in plots for ys in p["series"].values())
    html = (tmp_path / "report.html").read_text()
    assert "FP8 rollout vs BF16 trainer" in html


def test_hf_engine_runs_bf16_and_declares_fp8_unavailable(tmp_path):
    r = _pytest(["--fp8rl-engine", "fp8rl.engines.hf:HFEngine", "--fp8rl-report-dir", str(tmp_path),
                 "-k", "test_weight_sync_names or test_mismatch_budget or (test_update_weights and bf16)"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = _report(tmp_path / "report.json")
    by = {(c["id"], c["case"]): c for c in rep["checks"]}
    for model in ("tiny-qwen3", "tiny-qwen3-moe"):
        assert by[("E2E-MISMATCH-001", f"{model}-bf16")]["outcome"] == "passed"
        assert by[("E2E-UPDATE-001", f"{model}-bf16")]["outcome"] == "passed"
        for recipe in ("fp8-linear", "fp8-linear-ptpc"):
            c = by[("E2E-MISMATCH-001", f"{model}-{recipe}")]
            assert c["outcome"] == "skipped" and "BF16 only" in c["message"]
        assert by[("WSYNC-NAMES-001", model)]["outcome"] == "skipped"
    assert [row[1] for row in rep["sections"]["mismatch"]["table"]["rows"]] == ["bf16", "bf16"]
