"""Claim and regression gates over perf result files.

For every result file, group and candidate config the gate pairs the candidate's runs with the baseline config's
runs of the same repeat index (they ran back to back), takes the per-pair log speedup ``log(cand/base)``, and
reports the geometric-mean speedup with a bootstrap confidence interval (``scipy.stats.bootstrap``, BCa by
default, fixed seed, so the same file always gives the same verdict).

Verdicts of a speedup row:

``PASS``          a gating claim applies and the CI's lower end ≥ the claim's lower bound
``FAIL``          a gating claim applies and the CI's lower end < the claim's lower bound
``INSUFFICIENT``  a gating claim applies but there are fewer than ``min_pairs`` valid pairs (counts as a failure)
``SUSPECT``       the CI's lower end is above the model's speedup ceiling × (1 + slack), or some runs broke the
                  workload (a response shorter than ``gen_len``: EOS not ignored) — the measurement, not the
                  engine, is in question. Takes precedence over PASS/FAIL.
``INFO``          a non-gating claim applies (reported only)
``NO-CLAIM``      no claim applies (reported only)

Regression rows (``--baseline``): per (group, config) throughput of the current file vs the baseline file, as the
ratio of geometric means with an (unpaired) bootstrap CI. ``PASS`` if the CI's lower end ≥ 1 − max_regression,
else ``REGRESSED`` (the burden of proof is on the new build, as for claims: a noisy run must repeat more).

Exit codes: 0 every gated row passed; 1 a FAIL, INSUFFICIENT or REGRESSED row; 3 no failure but a SUSPECT row;
2 usage error or nothing was gated (no claim applied and no baseline; ``--allow-unmatched`` makes that 0).
"""

from __future__ import annotations

import json
import math
import tomllib
import warnings
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from fp8rl.perf.results import ResultError

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_SUSPECT = 0, 1, 2, 3
DEFAULT_MIN_PAIRS = 3
_REL_EPS = 1e-9  # a CI end equal to a bound (up to float noise) passes

__all__ = ["Claim", "Estimate", "Row", "GateReport", "load_claims", "paired_speedup", "unpaired_ratio",
           "gate", "exit_code", "to_markdown", "plot", "EXIT_PASS", "EXIT_FAIL", "EXIT_USAGE", "EXIT_SUSPECT"]


# ---------------------------------------------------------------------------------------------------------------
# claims


@dataclass(frozen=True)
class Claim:
    id: str
    title: str
    source: str
    kind: str
    model: str
    engine: str
    hardware_class: str | list[str]
    baseline: str
    config: str
    lower: float
    upper: float | None = None
    nominal: float | None = None
    gate: bool = True
    reference_hardware: str | None = None
    ceiling: float | None = None
    ceiling_slack: float = 0.10
    applies_when: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    notes: str = ""

    def applies(self, result: dict, group: str, config: str) -> tuple[bool, str]:
        """(applies, why not)."""
        from fp8rl.perf.model import get_precision, normalize_model_name

        if result["kind"] != self.kind:
            return False, f"kind {result['kind']} != {self.kind}"
        try:
            if get_precision(config).name != get_precision(self.config).name:
                return False, f"config {config} != {self.config}"
        except ValueError:
            if config != self.config:
                return False, f"config {config} != {self.config}"
        base = result["baseline_config"]
        if base != self.baseline and _prec_name(base) != _prec_name(self.baseline):
            return False, f"baseline {base} != {self.baseline}"
        if self.model != "*" and normalize_model_name(result["model"]["name"]) != normalize_model_name(self.model):
            return False, f"model {result['model']['name']} != {self.model}"
        eng = str(result["engine"]["name"]).lower()
        if self.engine != "*" and not eng.startswith(self.engine.lower()):
            return False, f"engine {eng} != {self.engine}"
        hw_cls = (result.get("hardware") or {}).get("class")
        classes = [self.hardware_class] if isinstance(self.hardware_class, str) else list(self.hardware_class)
        if "*" not in classes and (hw_cls or "").lower() not in {c.lower() for c in classes}:
            return False, f"hardware class {hw_cls} not in {classes}"
        wl = result.get("workload") or {}
        for key, bound in self.applies_when.items():
            if not key.startswith(("min_", "max_")):
                continue
            name = key[4:]
            v = wl.get(name)
            if v is None:
                return False, f"workload has no {name} (claim needs {key}={bound})"
            if key.startswith("min_") and v < bound:
                return False, f"workload {name}={v} < {bound}"
            if key.startswith("max_") and v > bound:
                return False, f"workload {name}={v} > {bound}"
        return True, ""


def _prec_name(name: str) -> str:
    from fp8rl.perf.model import get_precision

    try:
        return get_precision(name).name
    except ValueError:
        return name


def load_claims(path: str | Path | None = None) -> list[Claim]:
    """Claims from a TOML file (default: the packaged ``claims.toml``)."""
    if path is None:
        text = (resources.files("fp8rl.perf") / "claims.toml").read_text()
        where = "claims.toml"
    else:
        p = Path(path)
        if not p.is_file():
            raise ResultError(f"--claims: no such file {p}")
        text, where = p.read_text(), str(p)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ResultError(f"{where}: invalid TOML: {exc}") from None
    if data.get("schema") != "fp8rl.perf.claims":
        raise ResultError(f"{where}: not a fp8rl.perf.claims file")
    claims = []
    fields = set(Claim.__dataclass_fields__)
    for i, c in enumerate(data.get("claim", [])):
        missing = {"id", "title", "source", "kind", "model", "engine", "hardware_class", "baseline", "config",
                   "lower"} - set(c)
        if missing:
            raise ResultError(f"{where}: claim #{i} ({c.get('id', '?')}) lacks {sorted(missing)}")
        unknown = set(c) - fields
        if unknown:
            raise ResultError(f"{where}: claim {c['id']} has unknown keys {sorted(unknown)}")
        claim = Claim(**c)
        if claim.upper is not None and claim.upper < claim.lower:
            raise ResultError(f"{where}: claim {claim.id}: upper {claim.upper} < lower {claim.lower}")
        claims.append(claim)
    ids = [c.id for c in claims]
    if len(set(ids)) != len(ids):
        raise ResultError(f"{where}: duplicate claim ids")
    return claims


# ---------------------------------------------------------------------------------------------------------------
# statistics


@dataclass(frozen=True)
class Estimate:
    point: float
    lo: float
    hi: float
    n: int
    confidence: float
    method: str


def _bootstrap_mean_ci(samples: tuple[np.ndarray, ...], statistic, confidence: float, n_resamples: int, seed: int,
                       method: str, paired: bool = False) -> tuple[float, float, str]:
    from scipy import stats

    flat = np.concatenate(samples)
    if np.allclose(flat, flat[0], rtol=0, atol=1e-15) and len(samples) == 1:
        return float(flat[0]), float(flat[0]), "degenerate"
    methods = [method] + (["percentile"] if method.lower() != "percentile" else [])
    for m in methods:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                res = stats.bootstrap(samples, statistic, confidence_level=confidence, n_resamples=n_resamples,
                                      method=m, paired=paired, vectorized=True,
                                      random_state=np.random.default_rng(seed))
            except (ValueError, FloatingPointError):
                continue
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, m
    return float("nan"), float("nan"), "failed"


def paired_speedup(base: list[float] | np.ndarray, cand: list[float] | np.ndarray, confidence: float = 0.95,
                   n_resamples: int = 9999, seed: int = 0, method: str = "BCa") -> Estimate:
    """Geometric-mean speedup cand/base over pairs, with a bootstrap CI (resampling pairs)."""
    b = np.asarray(base, dtype=np.float64)
    c = np.asarray(cand, dtype=np.float64)
    if b.shape != c.shape or b.ndim != 1:
        raise ValueError("paired_speedup: base and cand must be 1-D and the same length")
    if np.any(b <= 0) or np.any(c <= 0):
        raise ValueError("paired_speedup: throughputs must be positive")
    n = len(b)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, confidence, "none")
    d = np.log(c) - np.log(b)
    point = float(np.exp(d.mean()))
    if n < 2:
        return Estimate(point, float("nan"), float("nan"), n, confidence, "none")
    lo, hi, m = _bootstrap_mean_ci((d,), lambda x, axis=-1: np.mean(x, axis=axis), confidence, n_resamples, seed,
                                   method)
    return Estimate(point, math.exp(lo) if math.isfinite(lo) else lo, math.exp(hi) if math.isfinite(hi) else hi, n,
                    confidence, m)


def unpaired_ratio(base: list[float] | np.ndarray, cand: list[float] | np.ndarray, confidence: float = 0.95,
                   n_resamples: int = 9999, seed: int = 0, method: str = "BCa") -> Estimate:
    """Ratio of geometric means cand/base of two independent samples, with a bootstrap CI."""
    lb = np.log(np.asarray(base, dtype=np.float64))
    lc = np.log(np.asarray(cand, dtype=np.float64))
    if len(lb) == 0 or len(lc) == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0, confidence, "none")
    point = float(np.exp(lc.mean() - lb.mean()))
    n = min(len(lb), len(lc))
    if n < 2:
        return Estimate(point, float("nan"), float("nan"), n, confidence, "none")
    if np.ptp(lb) == 0 and np.ptp(lc) == 0:
        return Estimate(point, point, point, n, confidence, "degenerate")

    def stat(x, y, axis=-1):
        return np.mean(y, axis=axis) - np.mean(x, axis=axis)

    lo, hi, m = _bootstrap_mean_ci((lb, lc), stat, confidence, n_resamples, seed, method)
    return Estimate(point, math.exp(lo) if math.isfinite(lo) else lo, math.exp(hi) if math.isfinite(hi) else hi, n,
                    confidence, m)


# ---------------------------------------------------------------------------------------------------------------
# gate


@dataclass
class Row:
    kind: str  # "speedup" | "regression"
    file: str
    model: str
    engine: str
    hardware: str
    group: str
    baseline: str
    config: str
    estimate: Estimate
    verdict: str
    claim_id: str | None = None
    claim_lower: float | None = None
    claim_upper: float | None = None
    ceiling: float | None = None
    ceiling_slack: float | None = None
    reason: str = ""
    gated: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimate"] = asdict(self.estimate)
        return d


@dataclass
class GateReport:
    rows: list[Row]
    confidence: float
    notes: list[str] = field(default_factory=list)

    @property
    def gated_rows(self) -> list[Row]:
        return [r for r in self.rows if r.gated]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "fp8rl.perf.gate", "schema_version": 1, "confidence": self.confidence,
                "exit_code": exit_code(self), "verdict": overall_verdict(self), "notes": self.notes,
                "rows": [r.to_dict() for r in self.rows]}


def _hw_label(result: dict) -> str:
    hw = result.get("hardware") or {}
    return str(hw.get("name") or hw.get("device") or hw.get("class") or "?")


def _runs(result: dict, group: str, config: str) -> dict[int, dict]:
    return {r["repeat"]: r for r in result["runs"] if r["group"] == group and r["config"] == config}


def _groups(result: dict) -> list[str]:
    seen: list[str] = []
    for r in result["runs"]:
        if r["group"] not in seen:
            seen.append(r["group"])
    return seen


def _model_ceiling(result: dict, claim: Claim | None, config: str) -> float | None:
    """The perf model's speedup ceiling for this comparison, or None when it cannot be evaluated."""
    from fp8rl.perf import model as pm

    if result["kind"] != "rollout":
        return None
    hw_name = (result.get("hardware") or {}).get("name")
    try:
        if claim is not None:
            if claim.model == "*":
                return None
            spec = pm.load_model_spec(claim.model)
            hw = pm.load_hardware(hw_name) if hw_name else (
                pm.load_hardware(claim.reference_hardware) if claim.reference_hardware else None)
            w = dict(claim.workload)
        else:
            if not hw_name:
                return None
            mpath = result["model"].get("path")
            spec = pm.load_model_spec(mpath if mpath and Path(mpath).exists() else result["model"]["name"])
            hw = pm.load_hardware(hw_name)
            rw = result.get("workload") or {}
            batch = int(rw.get("batch") or 256)
            w = {"prompt_len": int(rw["prompt_len"]), "gen_len": int(rw["gen_len"]), "max_num_seqs": batch,
                 "num_requests": batch,
                 "gpu_memory_utilization": float(rw.get("gpu_memory_utilization", 0.9))}
        if hw is None:
            return None
        calib = None
        if "calibration_kv_tokens" in w:
            calib = (str(w.pop("calibration_config", "bf16")), int(w.pop("calibration_kv_tokens")))
        w.pop("calibration_config", None)
        wl = pm.Workload(calibration=calib, **w)
        ceil = pm.speedup_ceiling(spec, hw, config, wl, baseline=result["baseline_config"])
    except (ValueError, KeyError, TypeError):
        return None
    return ceil if math.isfinite(ceil) else None


def _ceiling(result: dict, group: str, config: str, claim: Claim | None) -> float | None:
    emb = (result.get("ceilings") or {}).get(group, {}).get(config)
    if emb is not None:
        return float(emb)
    if claim is not None and claim.ceiling is not None:
        return float(claim.ceiling)
    return _model_ceiling(result, claim, config)


def _ge(a: float, b: float) -> bool:
    return a >= b * (1 - _REL_EPS)


def _speedup_rows(result: dict, file: str, claims: list[Claim], *, confidence: float, n_resamples: int, seed: int,
                  method: str, min_pairs: int, default_slack: float, only_claims: set[str] | None) -> list[Row]:
    rows = []
    base_cfg = result["baseline_config"]
    for group in _groups(result):
        base_runs = _runs(result, group, base_cfg)
        for config in result["configs"]:
            if config == base_cfg:
                continue
            cand_runs = _runs(result, group, config)
            if not cand_runs:
                continue
            bad = [r for r in list(base_runs.values()) + list(cand_runs.values()) if not r.get("valid", True)]
            pairs = [(base_runs[i]["throughput"], cand_runs[i]["throughput"]) for i in sorted(cand_runs)
                     if i in base_runs and base_runs[i].get("valid", True) and cand_runs[i].get("valid", True)]
            est = paired_speedup([p[0] for p in pairs], [p[1] for p in pairs], confidence, n_resamples, seed,
                                 method) if pairs else Estimate(float("nan"), float("nan"), float("nan"), 0,
                                                                confidence, "none")
            applicable = []
            for c in claims:
                if only_claims is not None and c.id not in only_claims:
                    continue
                ok, _ = c.applies(result, group, config)
                if ok:
                    applicable.append(c)
            targets: list[Claim | None] = list(applicable) if applicable else [None]
            for claim in targets:
                ceiling = _ceiling(result, group, config, claim)
                slack = claim.ceiling_slack if claim is not None else default_slack
                row = Row(kind="speedup", file=file, model=result["model"]["name"],
                          engine=str(result["engine"]["name"]), hardware=_hw_label(result), group=group,
                          baseline=base_cfg, config=config, estimate=est, verdict="NO-CLAIM",
                          claim_id=claim.id if claim else None, claim_lower=claim.lower if claim else None,
                          claim_upper=claim.upper if claim else None, ceiling=ceiling, ceiling_slack=slack,
                          gated=bool(claim and claim.gate))
                reasons = []
                if claim is None:
                    row.verdict = "NO-CLAIM"
                elif not claim.gate:
                    row.verdict = "INFO"
                elif est.n < min_pairs or not math.isfinite(est.lo):
                    row.verdict = "INSUFFICIENT"
                    reasons.append(f"{est.n} valid pairs (< {min_pairs}) — run more repeats")
                else:
                    row.verdict = "PASS" if _ge(est.lo, claim.lower) else "FAIL"
                    reasons.append(f"CI lower {est.lo:.4f} {'>=' if row.verdict == 'PASS' else '<'} claim lower "
                                   f"{claim.lower:.4f}")
                    if claim.upper is not None and est.lo > claim.upper:
                        reasons.append(f"above the published band (upper {claim.upper})")
                if bad:
                    row.verdict = "SUSPECT"
                    probs = sorted({p for r in bad for p in r.get("problems", [])} or {"invalid run"})
                    reasons.append(f"{len(bad)} run(s) broke the workload: {'; '.join(probs)[:300]}")
                elif ceiling is not None and math.isfinite(est.lo) and est.lo > ceiling * (1 + slack):
                    row.verdict = "SUSPECT"
                    reasons.append(f"CI lower {est.lo:.3f} above the model ceiling {ceiling:.3f} × (1 + {slack:g}) "
                                   f"— check that EOS was ignored and lengths match")
                row.reason = "; ".join(reasons)
                if row.verdict == "SUSPECT" and claim is None:
                    row.gated = True  # a broken measurement is never silently accepted
                rows.append(row)
    return rows


def _regression_rows(result: dict, file: str, baseline: dict, baseline_file: str, *, max_regression: float,
                     confidence: float, n_resamples: int, seed: int, method: str) -> list[Row]:
    rows: list[Row] = []
    if result["kind"] != baseline["kind"] or result["metric"] != baseline["metric"]:
        return rows
    for group in _groups(result):
        for config in result["configs"]:
            cur = [r["throughput"] for r in _runs(result, group, config).values() if r.get("valid", True)]
            old = [r["throughput"] for r in _runs(baseline, group, config).values() if r.get("valid", True)]
            if not cur or not old:
                continue
            est = unpaired_ratio(old, cur, confidence, n_resamples, seed, method)
            floor = 1.0 - max_regression
            if est.n < 2 or not math.isfinite(est.lo):
                verdict, reason = "INSUFFICIENT", "need ≥ 2 valid runs on both sides"
            elif _ge(est.lo, floor):
                verdict, reason = "PASS", f"CI lower {est.lo:.4f} >= {floor:.4f}"
            else:
                verdict, reason = "REGRESSED", f"CI lower {est.lo:.4f} < {floor:.4f} (max regression {max_regression:.1%})"
            rows.append(Row(kind="regression", file=file, model=result["model"]["name"],
                            engine=str(result["engine"]["name"]), hardware=_hw_label(result), group=group,
                            baseline=f"baseline:{Path(baseline_file).name}", config=config, estimate=est,
                            verdict=verdict, claim_lower=floor, reason=reason, gated=True))
    return rows


def gate(results: list[tuple[str, dict]], claims: list[Claim], *, baseline: tuple[str, dict] | None = None,
         max_regression: float = 0.05, confidence: float = 0.95, n_resamples: int = 9999, seed: int = 0,
         method: str = "BCa", min_pairs: int = DEFAULT_MIN_PAIRS, default_slack: float = 0.10,
         only_claims: list[str] | None = None) -> GateReport:
    """Gate ``[(file label, result dict), ...]`` against claims (and a baseline result for regressions)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 <= max_regression < 1:
        raise ValueError(f"max_regression must be in [0, 1), got {max_regression}")
    only = set(only_claims) if only_claims else None
    if only:
        unknown = only - {c.id for c in claims}
        if unknown:
            raise ValueError(f"--claim: unknown claim ids {sorted(unknown)}")
    rows: list[Row] = []
    notes = []
    for label, res in results:
        rows += _speedup_rows(res, label, claims, confidence=confidence, n_resamples=n_resamples, seed=seed,
                              method=method, min_pairs=min_pairs, default_slack=default_slack, only_claims=only)
        if baseline is not None:
            reg = _regression_rows(res, label, baseline[1], baseline[0], max_regression=max_regression,
                                   confidence=confidence, n_resamples=n_resamples, seed=seed, method=method)
            if not reg:
                notes.append(f"{label}: nothing comparable in baseline {baseline[0]} (kind/metric/groups/configs)")
            rows += reg
    return GateReport(rows=rows, confidence=confidence, notes=notes)


def overall_verdict(report: GateReport) -> str:
    gated = report.gated_rows
    if not gated:
        return "NOTHING-GATED"
    verdicts = {r.verdict for r in gated}
    if verdicts & {"FAIL", "INSUFFICIENT", "REGRESSED"}:
        return "FAIL"
    if "SUSPECT" in verdicts:
        return "SUSPECT"
    return "PASS"


def exit_code(report: GateReport, allow_unmatched: bool = False) -> int:
    v = overall_verdict(report)
    return {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL, "SUSPECT": EXIT_SUSPECT,
            "NOTHING-GATED": EXIT_PASS if allow_unmatched else EXIT_USAGE}[v]


# ---------------------------------------------------------------------------------------------------------------
# rendering


def _fmt(x: float | None, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}"


def to_markdown(report: GateReport) -> str:
    pct = f"{report.confidence:.0%}"
    lines = [f"**perf gate: {overall_verdict(report)}** (exit {exit_code(report)}; {pct} bootstrap CIs)", "",
             f"| file | model | engine | hardware | group | comparison | n | ratio | {pct} CI | claim | band | "
             "ceiling | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        e = r.estimate
        band = (f"{_fmt(r.claim_lower, 2)}–{_fmt(r.claim_upper, 2)}" if r.claim_upper is not None
                else (f"≥ {_fmt(r.claim_lower, 2)}" if r.claim_lower is not None else "–"))
        comp = f"{r.config} / {r.baseline}"
        lines.append(f"| {Path(r.file).name} | {r.model} | {r.engine} | {r.hardware} | {r.group} | {comp} | {e.n} | "
                     f"{_fmt(e.point)}× | [{_fmt(e.lo)}, {_fmt(e.hi)}] | {r.claim_id or '–'} | {band} | "
                     f"{_fmt(r.ceiling, 2)} | **{r.verdict}** |")
    reasons = [f"- `{r.claim_id or r.config}` ({Path(r.file).name}, {r.group}): {r.reason}" for r in report.rows
               if r.reason]
    if reasons:
        lines += ["", "Reasons:", *reasons]
    if report.notes:
        lines += ["", "Notes:", *[f"- {n}" for n in report.notes]]
    return "\n".join(lines) + "\n"


def plot(report: GateReport, path: str | Path) -> Path | None:
    """Speedup with CI bars vs the claim band (shaded) vs the model ceiling (red tick), one column per row."""
    rows = [r for r in report.rows if r.kind == "speedup" and math.isfinite(r.estimate.point)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(rows) + 2), 4.2))
    colors = {"PASS": "tab:green", "FAIL": "tab:red", "SUSPECT": "tab:orange", "INSUFFICIENT": "tab:red",
              "INFO": "tab:blue", "NO-CLAIM": "tab:gray"}
    for i, r in enumerate(rows):
        e = r.estimate
        if r.claim_lower is not None:
            top = r.claim_upper if r.claim_upper is not None else r.claim_lower
            ax.add_patch(plt.Rectangle((i - 0.35, r.claim_lower), 0.7, max(top - r.claim_lower, 0.004),
                                       color="tab:green", alpha=0.18, lw=0,
                                       label="claim band" if i == 0 else None))
        if r.ceiling is not None:
            ax.plot([i - 0.35, i + 0.35], [r.ceiling, r.ceiling], color="tab:red", ls="--", lw=1.5,
                    label="model ceiling" if i == 0 else None)
        yerr = None
        if math.isfinite(e.lo) and math.isfinite(e.hi):
            yerr = [[e.point - e.lo], [e.hi - e.point]]
        ax.errorbar([i], [e.point], yerr=yerr, fmt="o", color=colors.get(r.verdict, "k"), capsize=5)
        ax.annotate(r.verdict, (i, e.point), textcoords="offset points", xytext=(8, 0), fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r.claim_id or r.model}\n{r.config}/{r.baseline}\n{Path(r.file).name}:{r.group}"
                        for r in rows], fontsize=6)
    ax.set_ylabel("speedup (× baseline throughput)")
    ax.set_title(f"FP8 speedup, {report.confidence:.0%} bootstrap CI")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_outputs(report: GateReport, out_dir: str | Path) -> dict[str, Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / "gate.json", "markdown": d / "gate.md"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=2, default=float) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    png = plot(report, d / "gate.png")
    if png is not None:
        paths["plot"] = png
    return paths
