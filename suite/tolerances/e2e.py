"""Tolerances of areas weight_sync and e2e: the measured e2e mismatch budgets (one entry per model × recipe ×
metric, from the data file ``E2E_BUDGETS_FILE``) and rollout self-consistency (log-probs, greedy tokens and
samples against the logits an engine exposes).
"""

from __future__ import annotations

import math

from fp8rl.reference.bounds import UNIT_ROUNDOFF

from ._registry import _register, get

# Weight sync and end-to-end mismatch
#
# Weight sync is checked bit-exactly ('exact') plus 'quant_roundtrip' for the dequantized weights. The e2e budgets
# are empirical: the measured distribution of the reference FP8 emulation per model × recipe × metric, the method
# and each calibration's metadata live in the data file E2E_BUDGETS_FILE (package data of fp8rl), written by
# ``python -m fp8rl.conformance._e2e_calibrate --seeds 10 --write``; this module loads it and registers one entry
# 'e2e.<metric>.<model>.<recipe>' per measured metric (margin rule below).

#: the e2e budgets data file, relative to the fp8rl package
E2E_BUDGETS_FILE = "data/e2e_budgets.json"
E2E_BUDGETS_FORMAT = "fp8rl-e2e-budgets/1"


def load_e2e_budgets(path=None) -> dict:
    """The e2e budgets document (``E2E_BUDGETS_FILE`` of the installed package, or ``path``), validated: format,
    method text, margins, calibration records, and per model/recipe/metric {min, median, max, n} with min ≤
    median ≤ max, finite, and a margin for every metric. ValueError otherwise."""
    import json
    from importlib import resources

    if path is None:
        text = resources.files("fp8rl").joinpath(E2E_BUDGETS_FILE).read_text(encoding="utf-8")
        where = f"fp8rl/{E2E_BUDGETS_FILE}"
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        where = str(path)
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != E2E_BUDGETS_FORMAT:
        raise ValueError(f"{where}: expected format {E2E_BUDGETS_FORMAT!r}, got {doc.get('format')!r}")
    for key in ("method", "margins", "calibrations", "measured"):
        if key not in doc:
            raise ValueError(f"{where}: missing {key!r}")
    margins, cals = doc["margins"], doc["calibrations"]
    for model, recipes in doc["measured"].items():
        for recipe, entry in recipes.items():
            what = f"{where}: measured[{model!r}][{recipe!r}]"
            if entry.get("calibration") not in cals:
                raise ValueError(f"{what}: calibration {entry.get('calibration')!r} is not in 'calibrations'")
            for metric, st in entry.items():
                if metric == "calibration":
                    continue
                if metric not in margins:
                    raise ValueError(f"{what}: no margin for metric {metric!r} (margins: {sorted(margins)})")
                lo, med, hi, n = (st.get(k) for k in ("min", "median", "max", "n"))
                vals = (lo, med, hi)
                if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals) or not lo <= med <= hi \
                        or not (isinstance(n, int) and n > 0):
                    raise ValueError(f"{what}[{metric!r}]: expected finite min ≤ median ≤ max and n > 0, got {st!r}")
    return doc


def e2e_budget_value(metric: str, stats: tuple[float, float, float], margin: float) -> float:
    """Budget (or floor, for ``first_div_mean``) from a measured (min, median, max) and the metric's margin:
    margin·max; 1 + margin·(max − 1) for token_mult_prob_error; margin·min for first_div_mean."""
    lo, _, hi = stats
    if metric == "token_mult_prob_error":
        return 1.0 + margin * (hi - 1.0)
    if metric == "first_div_mean":
        return margin * lo
    return margin * hi


E2E_BUDGETS: dict = load_e2e_budgets()
E2E_MARGINS: dict[str, float] = {k: float(v) for k, v in E2E_BUDGETS["margins"].items()}
#: (model, recipe) → metric → (min, median, max), from E2E_BUDGETS_FILE
E2E_MEASURED: dict[tuple[str, str], dict[str, tuple[float, float, float]]] = {
    (model, recipe): {m: (st["min"], st["median"], st["max"]) for m, st in entry.items() if m != "calibration"}
    for model, recipes in E2E_BUDGETS["measured"].items() for recipe, entry in recipes.items()
}


def _calibration_line(cid: str) -> str:
    c = E2E_BUDGETS["calibrations"][cid]
    return (f"{cid}: {c.get('command')}, {c.get('runs_per_case')} runs per case, torch {c.get('torch')}, "
            f"transformers {c.get('transformers')}, {c.get('date')}")


E2E_MISMATCH = _register(
    "e2e_mismatch",
    E2E_MARGINS["k3_kl"],
    "Mismatch budgets of the e2e checks (value: the k3 KL margin). Per (model, recipe) and metric the budget is "
    "the entry 'e2e.<metric>.<model>.<recipe>': max × 2 (k3_kl), 1 + 2·(max − 1) (token_mult_prob_error), "
    "max × 1.5 (max_abs_dlogp), and the floor min × 0.5 (first_div_mean), over the measured distribution of the "
    f"reference FP8 emulation in fp8rl/{E2E_BUDGETS_FILE}. Recipes: bf16 (incremental BF16 decoding vs the "
    "teacher-forced trainer), fp8-linear (W8A8 128x128/1x128), fp8-linear-ptpc (W8A8 per-channel weights / "
    "per-token activations, vLLM fp8_per_channel), fp8-kv (FP8 KV storage), fp8-all (both + FP8 query), mxfp8 "
    "(every projection MXFP8 e4m3 + E8M0 per 1x32, activations likewise) and nvfp4-experts (the routed experts "
    "NVFP4, activations NVFP4 with a per-input global scale; the rest BF16), docs/microscaling.md. Method "
    "(from the data file): " + E2E_BUDGETS["method"] + " Calibrations: "
    + "; ".join(_calibration_line(c) for c in E2E_BUDGETS["calibrations"]) + ".",
)

for (_model, _recipe), _stats in E2E_MEASURED.items():
    _cal = E2E_BUDGETS["measured"][_model][_recipe]["calibration"]
    for _metric, _s in _stats.items():
        _n = E2E_BUDGETS["measured"][_model][_recipe][_metric]["n"]
        _kind = "floor (the check needs ≥)" if _metric == "first_div_mean" else "budget (the check needs ≤)"
        _register(f"e2e.{_metric}.{_model}.{_recipe}", e2e_budget_value(_metric, _s, E2E_MARGINS[_metric]),
                  f"{_kind} for {_metric} of {_model} under {_recipe}: measured min/median/max "
                  f"{_s[0]:.4g}/{_s[1]:.4g}/{_s[2]:.4g} over {_n} reference-emulation runs (calibration "
                  f"{_calibration_line(_cal)}), margin {E2E_MARGINS[_metric]} (see 'e2e_mismatch'; data: "
                  f"fp8rl/{E2E_BUDGETS_FILE}). False-alarm rate for an engine with the reference emulation's "
                  f"distribution: at most 1/(n + 1) = {1 / (_n + 1):.2%} per run (distribution-free; the margin "
                  "only lowers it); measured 0 false alarms in the 20-seed sweep of the reference engine "
                  "(fp8rl conformance --engine reference --area e2e --seeds 0..19).")


ROLLOUT_LOGPROB_SLACK = _register(
    "rollout_logprob_slack",
    1e-4,
    "Largest positive log-prob a rollout may report (a log-prob is ≤ 0). An engine computes log π(a) = x_a − "
    "logsumexp(x) in fp32; for a near-certain token the exact value is ≈ 0⁻ and the subtraction of two nearly equal "
    "fp32 numbers of magnitude |lse| rounds with error ≤ u32·|lse| = 2^-24·|lse| (6e-6 for |lse| ≤ 100). Value "
    "1e-4: that rounding for |lse| ≤ 1600, far beyond the tiny fixtures' logit range; a log-prob above it (or "
    "non-finite) is an engine error, not a verdict on its numerics.",
)


# Rollout self-consistency (E2E-LOGPROB-001, E2E-ARGMAX-001, E2E-GOF-001): the log-probs, greedy tokens and samples
# an engine reports against the logits it exposes (capability rollout.logits).
ROLLOUT_LOGPROB_FP32 = _register(
    "rollout_logprob_fp32",
    UNIT_ROUNDOFF["float32"],
    "A reported log-prob is the fp32 log-softmax of the logits row ℓ (V entries) at the token t (value: u32 = 2^-24; "
    "the bound is rollout_logprob_fp32_bound). With m = max ℓ, d_i = ℓ_i − m, S = Σ exp(d_i), lse = log S: "
    "fl(d_i) errs by ≤ u·|d_i|; exp (≤ 1 ulp) and the propagated argument error give exp(d_i)(1 + η_i), "
    "|η_i| ≤ (|d_i| + 2)u; summing V positive terms (any order) adds ≤ (V − 1)u relative, so Ŝ = S(1 + σ) with "
    "|σ| ≤ (max|d| + V + 1)u; log adds ≤ 2u·|lse| and the final subtraction d_t − lse ≤ u·(|d_t| + |lse| + "
    "|lp_t|). The other usual implementation, log(softmax(ℓ))[t], has the same terms (p_t = exp(d_t)/Ŝ relative "
    "error (|d_t| + 3)u + |σ|, then a log rounding ≤ 2u·|lp_t|). An engine may report any per-row shift of its "
    "logits (e.g. its log-prob vector): that shift's rounding moves each entry by ≤ u·max|ℓ|, the log-softmax by "
    "≤ 2u·max|ℓ|. Bound (each linear term doubled for slack): u·(2·max|ℓ| + 2·|d_t| + 2·max|d| + V + 8 + "
    "2·|lse| + 2·|lp_t|); ≈ 4e-5 for V = 512 and logits within ±30. The checker's own log-softmax is fp64 "
    "(error ~1e-15). A log-prob computed in BF16 errs by up to 2^-9·|lp| (4e-3 at lp = −2): far outside.",
)


def rollout_logprob_fp32_bound(logits, index=None):
    """Elementwise bound of |reported log-prob − log_softmax(logits)[index]| for fp32 log-softmax evaluation (see
    the entry ``rollout_logprob_fp32``). ``logits``: (..., V) tensor; ``index``: (...) int64 token ids, or None for
    every entry (shape (..., V)). Returns fp64."""
    import torch

    x = logits.to(torch.float64)
    v = x.shape[-1]
    u = UNIT_ROUNDOFF["float32"]
    fin = torch.isfinite(x)  # a −inf entry (a masked token) adds exp(−inf) = 0 exactly and no rounding
    m = torch.where(fin, x, -math.inf).amax(-1, keepdim=True)
    d = x - m
    lse = torch.logsumexp(d, -1, keepdim=True)
    lp = d - lse
    if index is not None:
        d = d.gather(-1, index[..., None].long())
        lp = lp.gather(-1, index[..., None].long())
    spread = torch.where(fin, (x - m).abs(), 0.0).amax(-1, keepdim=True)
    common = 2 * torch.where(fin, x.abs(), 0.0).amax(-1, keepdim=True) + 2 * spread + v + 8 + 2 * lse.abs()
    b = u * (common + 2 * d.abs() + 2 * lp.abs())
    return b.squeeze(-1) if index is not None else b


ROLLOUT_GOF = _register(
    "rollout_gof",
    1e-6,
    "False-alarm rate α of the goodness-of-fit check E2E-GOF-001 (per check case; value: α). Test: for each "
    "sampled token t drawn from a reported row p = softmax(ℓ) (fp64 from the fp32 logits), order the vocabulary by "
    "decreasing p (ties by token id) and take the randomized probability integral transform U = P(tokens before t) "
    "+ W·p_t, W ~ Uniform(0, 1) from the checker's seeded generator. If every token is drawn from its row's "
    "distribution given the past (rows independent), the U are i.i.d. Uniform(0, 1) exactly (discrete PIT with "
    "randomization; sequential draws included, by conditioning on the past), whatever the rows. Statistic: the "
    "Kolmogorov–Smirnov distance D of the n values' empirical CDF from the uniform. Massart's tight "
    "Dvoretzky–Kiefer–Wolfowitz inequality P(D > ε) ≤ 2·exp(−2nε²) (Massart 1990, valid for every n and every "
    "ε ≥ sqrt(ln 2 / 2n)) gives the threshold ε(n, α) = sqrt(ln(2/α) / 2n), plus the total variation between the "
    "engine's sampling distribution and the checker's softmax: fp32 rounding of the log-softmax "
    "(exp(max rollout_logprob_fp32_bound) − 1 per row) and a sampler's own fp32 random numbers (inverse CDF or "
    "exponential race: ≤ V·2^-23), so a correct engine fails with probability ≤ α; the checker's generator is "
    "seeded (run seed), so the verdict is deterministic. rollout_gof_threshold computes it. Draws: the 8 fixed "
    "prompts × 64 copies × 16 new tokens = 8192 (ε = 0.0298 at α = 1e-6, + ≈ 1e-4 of TV allowance). Power: "
    "against an alternative at KS distance D_alt the check fires with probability ≥ 1 − 2·exp(−2n(D_alt − ε)²) "
    "(DKW applied to the alternative: ≥ 0.997 at D_alt = 0.05, ≈ 1 at 0.06). Per-row distances on the tiny "
    "fixtures' first-token rows: 0.15–0.27 for a temperature of 0.7, 0.06–0.10 for 0.9 or 1.1, 0.015–0.11 for "
    "top-k 50 and 0.05 for top-p 0.95. Measured on the check's 8192 draws (reference engine, run seed 0, the "
    "'ks_d' metric): correct sampling 0.005–0.014; temperature 0.7 0.11–0.23 per model (caught on all four); "
    "top-k 50 0.067–0.072 on tiny-qwen3, -qwen3-moe, -qwen2-moe (caught) and 0.026 on tiny-qwen3-tied-odd, whose "
    "tied-embedding distributions are peaked (missed there); one random stream shared by a batch's rows 0.063–0.087 "
    "(0.030 on tiny-qwen3-tied-odd). Over the e2e area's GoF cases (one per model: 4) the family-wise false-alarm "
    "rate is ≤ 4α.",
)


def rollout_gof_threshold(n: int, tv: float = 0.0, alpha: float | None = None) -> float:
    """KS threshold of E2E-GOF-001 for ``n`` i.i.d. PIT values: sqrt(ln(2/α) / 2n) + ``tv`` (the total-variation
    allowance; see ``rollout_gof``); α defaults to the table's value."""
    a = ROLLOUT_GOF.value if alpha is None else float(alpha)
    if not (0 < a < 1) or n < 1:
        raise ValueError(f"alpha/n: expected 0 < alpha < 1 and n ≥ 1, got {a}, {n}")
    return math.sqrt(math.log(2.0 / a) / (2.0 * n)) + float(tv)


def rollout_gof_power(n: int, distance: float, threshold: float) -> float:
    """Lower bound on the probability that the GoF check fires for draws whose PIT CDF is at KS distance
    ``distance`` from the uniform: 1 − 2·exp(−2n(distance − threshold)²) (0 when distance ≤ threshold)."""
    gap = distance - threshold
    return 0.0 if gap <= 0 else max(0.0, 1.0 - 2.0 * math.exp(-2.0 * n * gap * gap))


def e2e_budget(metric: str, model: str, recipe: str) -> float:
    """The e2e budget (or floor, for ``first_div_mean``) of a metric for a tiny model and recipe."""
    return get(f"e2e.{metric}.{model}.{recipe}").value

REFIT_KV_SCALE = _register(
    "refit_kv_scale",
    2.0 ** -9,
    "Relative difference allowed between a KV-cache scale the trainer pushes with a refit (fp32) and the scale the "
    "engine's attention then uses (WSYNC-REFIT-004; value 2^-9): at most one round-to-nearest-even to BF16, as when "
    "the engine holds the scale in a parameter of the model dtype (vLLM creates attn.k_scale/v_scale under the "
    "model's default dtype): 8 significand bits, relative error ≤ 2^-8/2 = 2^-9 for a positive normal scale. The "
    "stored K = fp8(k / s) and its dequantization use the same s, so one rounding of s moves no code's meaning; a "
    "stale scale (the previous step's, or the 1.0 default) is off by the ratio of the two calibrations.",
)
