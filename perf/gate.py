"""Claim and regression gates over perf result files.

For every result file, group and candidate config the gate pairs the candidate's runs with the baseline config's
runs of the same repeat index (they ran back to back), takes the per-pair log speedup ``log(cand/base)``, and
reports the geometric-mean speedup with a bootstrap confidence interval (``scipy.stats.bootstrap``, BCa by
default, fixed seed, so the same file always gives the same verdict; the statistics are in ``fp8rl.perf.stats``,
the markdown table, plot and output files in ``fp8rl.perf.gate_render``).

Verdicts of a speedup row:

``PASS``          a gating claim applies and the CI's lower end ≥ the claim's lower bound
``FAIL``          a gating claim applies and the CI's lower end < the claim's lower bound
``INSUFFICIENT``  a gating claim applies but there are fewer than ``min_pairs`` valid pairs (counts as a failure)
``SUSPECT``       the CI's lower end is above the model's speedup ceiling × (1 + slack), or some runs broke the
                  workload (a response shorter than ``gen_len``: EOS not ignored) — the measurement, not the
                  engine, is in question. Takes precedence over PASS/FAIL.
``NOT-RUN``       the harness did not time the config: its pilot rollout put it over the per-config time budget
                  (``workload.skipped_configs``); counts as a failure when a gating claim applies (a claim is never
                  certified unmeasured), reported only otherwise
``INFO``          a non-gating claim applies (reported only)
``NO-CLAIM``      no claim applies (reported only)

Regression rows (``--baseline``): per (group, config) throughput of the current file vs the baseline file, as the
ratio of geometric means with an (unpaired) bootstrap CI. ``PASS`` if the CI's lower end ≥ 1 − max_regression,
else ``REGRESSED`` (the burden of proof is on the new build, as for claims: a noisy run must repeat more).

Exit codes: 0 every gated row passed; 1 a FAIL, INSUFFICIENT, NOT-RUN or REGRESSED row; 3 no failure but a SUSPECT row;
2 usage error or nothing was gated (no claim applied and no baseline; ``--allow-unmatched`` makes that 0).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_SUSPECT, EXIT_USAGE  # the one exit-code table
from fp8rl.exitcodes import EXIT_OK as EXIT_PASS
from fp8rl.perf.results import ResultError
from fp8rl.perf.stats import Estimate, paired_speedup, unpaired_ratio

DEFAULT_MIN_PAIRS = 3
_REL_EPS = 1e-9  # a CI end equal to a bound (up to float noise) passes

__all__ = ["Claim", "Row", "GateReport", "load_claims", "gate", "overall_verdict", "exit_code", "EXIT_PASS",
           "EXIT_FAIL", "EXIT_USAGE", "EXIT_SUSPECT"]


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
    #: take the model's ceiling at the result's own model, workload and hardware (its probed file), not at the
    #: claim's model/workload (CPU-class claims: their ceiling is the model's prediction for the measured machine)
    ceiling_from_result: bool = False
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
        if "cpu_amx" in self.applies_when:
            feats = (result.get("hardware") or {}).get("cpu_features")
            if feats is None:
                return False, "the result does not record its CPU's features (claim needs cpu_amx)"
            if ("amx" in feats) != bool(self.applies_when["cpu_amx"]):
                return False, f"CPU AMX {'amx' in feats} (claim measured with cpu_amx={self.applies_when['cpu_amx']})"
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
    #: measured vs the model: point speedup / model ceiling − 1 (None without a ceiling)
    model_error: float | None = None

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
    hw_block = result.get("hardware") or {}
    hw_name = hw_block.get("name")
    hw_file = hw_block.get("file")
    if hw_file and Path(str(hw_file).partition("#")[0]).is_file():
        hw_name = hw_file  # a probed hardware file (fp8rl perf hardware --probe)
    try:
        if claim is not None and not claim.ceiling_from_result:
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


def _guard(ceiling: float, claim: Claim | None) -> float:
    """The upper guard of a measured speedup. For a claim whose ceiling is the model's prediction for the measured
    machine (``ceiling_from_result``, CPU-class claims) a predicted slowdown (< 1) guards at 1: the roofline leaves out
    the fixed per-step cost (scheduler, sampling, Python) that pulls every measured ratio toward 1 on a small model,
    so a predicted slowdown bounds nothing above parity."""
    if claim is not None and claim.ceiling_from_result:
        return max(ceiling, 1.0)
    return ceiling


def _ge(a: float, b: float) -> bool:
    return a >= b * (1 - _REL_EPS)


def _not_run_reason(result: dict, config: str) -> str | None:
    """Why the harness did not time ``config`` (its per-config budget: ``workload.skipped_configs``), or None."""
    return ((result.get("workload") or {}).get("skipped_configs") or {}).get(config)


def _no_estimate(confidence: float) -> Estimate:
    """The estimate of a comparison without a single valid pair."""
    return Estimate(float("nan"), float("nan"), float("nan"), 0, confidence, "none")


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
            not_run = _not_run_reason(result, config)
            if not cand_runs and not not_run:
                continue
            bad = [r for r in list(base_runs.values()) + list(cand_runs.values()) if not r.get("valid", True)]
            pairs = [(base_runs[i]["throughput"], cand_runs[i]["throughput"]) for i in sorted(cand_runs)
                     if i in base_runs and base_runs[i].get("valid", True) and cand_runs[i].get("valid", True)]
            est = paired_speedup([p[0] for p in pairs], [p[1] for p in pairs], confidence, n_resamples, seed,
                                 method) if pairs else _no_estimate(confidence)
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
                          gated=bool(claim and claim.gate),
                          model_error=(est.point / ceiling - 1.0 if ceiling and math.isfinite(est.point) else None))
                reasons = []
                if not_run and not cand_runs:
                    row.verdict = "NOT-RUN"
                    reasons.append(str(not_run))
                elif claim is None:
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
                elif ceiling is not None and math.isfinite(est.lo) and est.lo > _guard(ceiling, claim) * (1 + slack):
                    row.verdict = "SUSPECT"
                    reasons.append(f"CI lower {est.lo:.3f} above the model ceiling {_guard(ceiling, claim):.3f} × "
                                   f"(1 + {slack:g}) — check that EOS was ignored and lengths match")
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
            not_run = _not_run_reason(result, config)
            if not cur and old and not_run:  # the baseline measured it; this run did not: nothing is certified
                rows.append(Row(kind="regression", file=file, model=result["model"]["name"],
                                engine=str(result["engine"]["name"]), hardware=_hw_label(result), group=group,
                                baseline=f"baseline:{Path(baseline_file).name}", config=config,
                                estimate=_no_estimate(confidence),
                                verdict="NOT-RUN", claim_lower=1.0 - max_regression, reason=str(not_run),
                                gated=True))
                continue
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
    if verdicts & {"FAIL", "INSUFFICIENT", "REGRESSED", "NOT-RUN"}:
        return "FAIL"
    if "SUSPECT" in verdicts:
        return "SUSPECT"
    return "PASS"


def exit_code(report: GateReport, allow_unmatched: bool = False) -> int:
    v = overall_verdict(report)
    return {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL, "SUSPECT": EXIT_SUSPECT,
            "NOTHING-GATED": EXIT_PASS if allow_unmatched else EXIT_USAGE}[v]
