"""The weight-sync and e2e conformance areas end to end: reference conformant with its mismatch report section,
the hf engine BF16-only with reasons, and the e2e budgets' data file and calibration command. (The mutants these
areas kill: suite/mutants/weight_sync.py and e2e.py, proven by tests/checks/test_mutants.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

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
    assert {(m, r) for m, rs in doc["measured"].items() for r in rs} == set(E.CASES)
    for model, recipes in doc["measured"].items():
        for recipe, entry in recipes.items():
            assert entry["calibration"] in doc["calibrations"]
            for metric, margin in doc["margins"].items():
                st = entry[metric]
                want = T.e2e_budget_value(metric, (st["min"], st["median"], st["max"]), margin)
                assert T.get(f"e2e.{metric}.{model}.{recipe}").value == want == T.e2e_budget(metric, model, recipe)
    # every case is calibrated on 10 weight seeds x 2 variants x 20 sampling seeds (the held-out design)
    assert {st["n"] for rs in doc["measured"].values() for e in rs.values() for k, st in e.items()
            if k != "calibration"} == {400}


def _fake_samples(models, recipes, n_runs):
    metrics = ("k3_kl", "k1_kl", "token_mult_prob_error", "max_abs_dlogp", "mean_abs_dlogp", "first_div_mean",
               "first_div_min")
    return {(m, r): {k: [0.5 + 0.25 * i + j for j in range(n_runs)] for i, k in enumerate(metrics)}
            for m in models for r in recipes}


def test_calibration_command_writes_the_budgets_file(tmp_path, monkeypatch):
    """`python -m fp8rl.conformance._e2e_calibrate --out PATH` (the writer of --write) round-trips through the
    loader: the re-measured entries with a calibration record, the rest of the installed file (method, margins, other
    entries) kept, and the installed file untouched."""
    import torch
    import transformers
    from fp8rl import tolerances as T
    from fp8rl.conformance import _e2e_calibrate as C

    calls = []

    def fake_calibrate(n_seeds, models, recipes, progress=True, n_sampling=1):
        calls.append((n_seeds, models, recipes))
        return _fake_samples(models, recipes, 2 * n_seeds * n_sampling)

    monkeypatch.setattr(C, "calibrate", fake_calibrate)
    installed = T.load_e2e_budgets()
    out = tmp_path / "budgets.json"
    argv = ["--seeds", "3", "--models", "tiny-qwen3", "--recipes", "fp8-kv", "bf16", "--out", str(out)]
    assert C.main(argv) == 0
    assert calls == [(3, ("tiny-qwen3",), ("fp8-kv", "bf16"))]
    doc = T.load_e2e_budgets(out)
    for recipe in ("fp8-kv", "bf16"):
        entry = doc["measured"]["tiny-qwen3"][recipe]
        assert entry["k3_kl"] == {"min": 0.5, "median": 3.5, "max": 5.5, "n": 6}  # median: sorted[n // 2]
        assert entry["first_div_mean"] == {"min": 1.75, "median": 4.75, "max": 6.75, "n": 6}
        assert set(entry) == {"calibration", *doc["margins"]}  # only the budgeted metrics
        cal = doc["calibrations"][entry["calibration"]]
    assert cal["command"] == "python -m fp8rl.conformance._e2e_calibrate " + " ".join(argv)
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
    from fp8rl.conformance import _e2e_calibrate as C

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
        path.write_text(C.dump_budgets(doc))
        with pytest.raises(ValueError):
            T.load_e2e_budgets(path)
        with pytest.raises(ValueError):
            C.write_budgets(doc, str(tmp_path / f"{what}.json"))
        assert not (tmp_path / f"{what}.json").exists()


@pytest.mark.slow
def test_tiny_real_calibration_round_trips(tmp_path):
    """One real (tiny) calibration run: 1 seed, one model and recipe, through the module's command line."""
    from fp8rl import tolerances as T

    out = tmp_path / "budgets.json"
    r = subprocess.run([sys.executable, "-m", "fp8rl.conformance._e2e_calibrate", "--seeds", "1", "--models", "tiny-qwen3",
                        "--recipes", "bf16", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    entry = T.load_e2e_budgets(out)["measured"]["tiny-qwen3"]["bf16"]
    assert entry["k3_kl"]["n"] == 2 and 0 < entry["k3_kl"]["min"] <= entry["k3_kl"]["max"] < 0.01


def test_reference_is_conformant_and_reports_the_mismatch_table(reference_ci_run):
    returncode, stdout, out = reference_ci_run  # the whole reference run at --profile ci (tests/conftest.py)
    assert returncode == 0, stdout[-3000:]
    rep = _report(out / "report.json")
    # weight_sync: 9 checks (5 state-dict, 4 refit) x the 8 weight-sync fixtures (4 Qwen + 4 other families),
    # 3 microscaling checks x 4 Qwen fixtures x 2 recipes; e2e: 6 checks per (model, recipe) case
    # (24: 5 recipes on each matrix model, mxfp8 on the dense, nvfp4-experts on the MoE, 2 on each variant and on
    # each family fixture rolled out: tiny-llama, tiny-qwen3-moe-fused, tiny-qwen2.5-vl with bf16/fp8-all, the MLA
    # fixture tiny-deepseek-v3 with bf16/fp8-linear) + the GoF check per model (8)
    from fp8rl import fixtures
    from fp8rl.conformance import _e2e as E
    from fp8rl.reference import mx_weight_sync

    assert len(E.CASES) == 24 and len(fixtures.SYNC_MODELS) == 8 and len(fixtures.TINY_MODELS) == 4
    assert E.MODELS == fixtures.TINY_MODELS + ("tiny-llama", "tiny-qwen3-moe-fused", "tiny-deepseek-v3",
                                               "tiny-qwen2.5-vl")
    assert len(mx_weight_sync.MX_SYNC_RECIPES) == 2
    outcomes = Counter(c["outcome"] for c in rep["checks"] if c["area"] in ("weight_sync", "e2e"))
    assert rep["summary"]["verdict"] == "conformant" and outcomes == {"passed": 9 * 8 + 3 * 4 * 2 + 6 * 24 + 8}
    sec = rep["sections"]["mismatch"]
    rows = sec["table"]["rows"]
    assert [(row[0], row[1]) for row in rows] == list(E.CASES)
    assert {(m, r) for m, r in E.CASES if m not in ("tiny-qwen3", "tiny-qwen3-moe")} == \
        {(m, r) for m in ("tiny-qwen2-moe", "tiny-qwen3-tied-odd", "tiny-llama", "tiny-qwen3-moe-fused",
                          "tiny-qwen2.5-vl") for r in ("bf16", "fp8-all")} | \
        {("tiny-deepseek-v3", "bf16"), ("tiny-deepseek-v3", "fp8-linear")}
    k3 = {(row[0], row[1]): row[2] for row in rows}
    for m in ("tiny-qwen3", "tiny-qwen3-moe"):  # FP8 linear layers move the policy far more than BF16 decoding
        assert k3[(m, "fp8-linear")] > 10 * k3[(m, "bf16")] and k3[(m, "fp8-linear-ptpc")] > 10 * k3[(m, "bf16")]
    for m in ("tiny-qwen2-moe", "tiny-qwen3-tied-odd", "tiny-llama", "tiny-qwen3-moe-fused", "tiny-qwen2.5-vl"):
        assert k3[(m, "fp8-all")] > 10 * k3[(m, "bf16")]
    assert k3[("tiny-deepseek-v3", "fp8-linear")] > 10 * k3[("tiny-deepseek-v3", "bf16")]
    # the packed fixture holds tiny-qwen3-moe's weights: its rollouts are the per-expert model's, bit for bit
    assert k3[("tiny-qwen3-moe-fused", "fp8-all")] == k3[("tiny-qwen3-moe", "fp8-all")]
    gof = [c for c in rep["checks"] if c["id"] == "E2E-GOF-001"]
    assert len(gof) == 8 and all(c["metrics"]["ks_d"] < c["metrics"]["ks_threshold"] for c in gof)
    plots = sec["plot"]
    assert len(plots) == 8 and [set(p["series"]) for p in plots] == [set(E.recipes_for(m)) for m in E.MODELS]
    assert all(len(ys) == len(p["x"]) == 20 for p in plots for ys in p["series"].values())
    html = (out / "report.html").read_text()
    assert "FP8 rollout vs BF16 trainer" in html


def test_hf_engine_runs_bf16_and_declares_fp8_unavailable(tmp_path):
    r = _pytest(["--fp8rl-engine", "fp8rl.engines.hf:HFEngine", "--fp8rl-report-dir", str(tmp_path),
                 "-k", "test_weight_sync_names or test_mismatch_budget or (test_update_weights and bf16) or "
                       "(test_greedy_tokens_are_argmax and tiny-qwen3-moe-bf16)"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = _report(tmp_path / "report.json")
    by = {(c["id"], c["case"]): c for c in rep["checks"]}
    # fixed length: transformers' generate() would stop a row at the checkpoint's EOS and pad it with token 0 (not
    # the argmax) unless the adapter clears the model's eos_token_id (7 of 160 greedy tokens on this case)
    assert by[("E2E-ARGMAX-001", "tiny-qwen3-moe-bf16")]["outcome"] == "passed"
    for model in ("tiny-qwen3", "tiny-qwen3-moe"):
        assert by[("E2E-MISMATCH-001", f"{model}-bf16")]["outcome"] == "passed"
        assert by[("E2E-UPDATE-001", f"{model}-bf16")]["outcome"] == "passed"
        for recipe in ("fp8-linear", "fp8-linear-ptpc"):
            c = by[("E2E-MISMATCH-001", f"{model}-{recipe}")]
            assert c["outcome"] == "skipped" and "BF16 only" in c["message"]
        assert by[("WSYNC-NAMES-001", model)]["outcome"] == "skipped"
    assert [row[1] for row in rep["sections"]["mismatch"]["table"]["rows"]] == ["bf16"] * 4


# ----------------------------------------------------------------------------------------------------------------
# the self-consistency checks' instruments (E2E-LOGPROB-001, E2E-ARGMAX-001, E2E-GOF-001) on synthetic rollouts


def _synthetic(n_rows: int, n_new: int, vocab: int, seed: int, temperature: float = 1.0, top_k: int | None = None):
    """A LogitsRollout whose tokens are drawn from softmax(logits / temperature) (optionally top-k truncated) with
    fp32 log-probs of temperature 1: the correct engine at temperature 1 without top-k."""
    import torch
    from fp8rl.conformance import _e2e as E

    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(n_rows, n_new, vocab, generator=g)).to(torch.bfloat16).float()
    w = logits / temperature
    if top_k is not None:
        kth = w.topk(top_k, -1).values[..., -1:]
        w = w.masked_fill(w < kth, -float("inf"))
    tok = torch.multinomial(torch.softmax(w, -1).reshape(-1, vocab), 1, generator=g).reshape(n_rows, n_new)
    lp = torch.log_softmax(logits, -1).gather(-1, tok[..., None]).squeeze(-1)
    tokens = torch.cat([torch.zeros(n_rows, 2, dtype=torch.int64), tok], 1)
    return E.LogitsRollout(tokens, lp, logits, 2)


def test_gof_false_alarm_threshold_and_power_stat():
    """Massart's DKW threshold: sqrt(ln(2/alpha) / 2n) (0.0298 at n = 8192, alpha = 1e-6); correct draws pass with
    room on several seeds, temperature 0.7 and top-50 truncation fail, and the stated power bound follows."""
    import math

    from fp8rl import tolerances as T
    from fp8rl.conformance import _e2e as E

    assert T.rollout_gof_threshold(8192) == pytest.approx(math.sqrt(math.log(2e6) / 16384))
    assert 0.0297 < T.rollout_gof_threshold(8192) < 0.0298
    for seed in range(3):
        r = _synthetic(512, 16, 512, seed)
        eps = T.rollout_gof_threshold(8192, E.gof_tv_allowance(r))
        assert E.gof_tv_allowance(r) < 1e-3 and E.ks_uniform(E.pit_values(r, seed)) < eps / 2
    for kw in ({"temperature": 0.7}, {"top_k": 50}):
        r = _synthetic(512, 16, 512, 5, **kw)
        assert E.ks_uniform(E.pit_values(r, 0)) > T.rollout_gof_threshold(8192, E.gof_tv_allowance(r)), kw
    assert T.rollout_gof_power(8192, 0.06, 0.03) > 0.999 and T.rollout_gof_power(8192, 0.02, 0.03) == 0.0


def test_logprob_bound_holds_for_fp32_and_fails_for_bf16_bound():
    import torch
    from fp8rl import tolerances as T

    r = _synthetic(64, 8, 512, 1)
    from fp8rl.conformance import _e2e as E

    err, bound = E.logprob_excess(r)
    assert bool((err <= bound).all()) and float(bound.max()) < 1e-4
    lp16 = torch.log_softmax(r.logits.to(torch.bfloat16), -1).float().gather(-1, r.new[..., None]).squeeze(-1)
    err16, _ = E.logprob_excess(E.LogitsRollout(r.tokens, lp16, r.logits, 2))
    assert float((err16 > bound).double().mean()) > 0.5
    # a -inf entry (a masked token) does not widen the other tokens' bound, and drawing it is a violation
    x = r.logits.clone()
    x[..., -1] = -float("inf")
    drawn = r.new == x.shape[-1] - 1
    assert bool(drawn.any()) and bool(torch.isfinite(T.rollout_logprob_fp32_bound(x, r.new))[~drawn].all())
    err, bound = E.logprob_excess(E.LogitsRollout(r.tokens, r.logprobs, x, 2))
    assert bool((err > bound)[drawn].all())


def test_argmax_violations_accept_ties_only():
    import torch
    from fp8rl.conformance import _e2e as E

    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 1.0, 1.999, 0.0]]])
    for toks, want in (([1, 0], [False, False]), ([2, 0], [False, False]), ([0, 2], [True, True])):
        r = E.LogitsRollout(torch.tensor([[9, *toks]]), torch.zeros(1, 2), logits, 1)
        assert E.argmax_violations(r).tolist() == [want]
