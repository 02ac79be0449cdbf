"""Conformance outcomes per engine as tracked values, so that a vendor regression shows as a step on the dashboard.

The values are read from report.json files of runs that already happened (nothing is run here): the environment
variable ``FP8RL_ASV_REPORTS`` lists them (``os.pathsep``-separated report.json files, run directories or folders
searched for them; ``nox -s nightly`` sets it to its own conformance runs). One parameter per engine name (a new
engine version is the same series, so its effect is a step); without the variable every benchmark here is skipped.
"""

from __future__ import annotations

import os

from .common import Benchmark

ENV = "FP8RL_ASV_REPORTS"


def series_name(rep: dict, taken: dict) -> str:
    """The dashboard series of a report: its engine's name, or, when a report of that engine with other areas was
    found first (vLLM's tier runs its rollout areas and its op areas as two runs), ``name[area+area]``."""
    name = str(rep["engine"]["name"])
    if name not in taken:
        return name
    areas = (rep.get("selection") or {}).get("areas") or []
    return f"{name}[{'+'.join(areas) or 'all'}]"


def _reports() -> dict[str, dict]:
    """series (:func:`series_name`) -> its report (the first one found for that series). A path that holds no valid
    report is left out (its engine's benchmarks are then skipped) rather than breaking the discovery of every other
    benchmark; give absolute paths: asv imports this file from another working directory."""
    spec = os.environ.get(ENV, "")
    out: dict[str, dict] = {}
    if not spec:
        return out
    from fp8rl.reports import load_report
    from fp8rl.reports.merge import find_reports

    for part in filter(None, spec.split(os.pathsep)):
        try:
            paths = find_reports(part)
        except ValueError:
            continue
        for path in paths:
            try:
                rep = load_report(path)
            except ValueError:  # ReportValidationError, JSONDecodeError
                continue
            if rep.get("kind") == "conformance":
                out.setdefault(series_name(rep, out), rep)
    return out


_ENGINES = sorted(_reports()) or ["(no FP8RL_ASV_REPORTS)"]


class Conformance(Benchmark):
    """Counts of the engine's report summary and the run's wall time (``duration_s``)."""

    params = _ENGINES
    param_names = ["engine"]

    def setup(self, engine):
        reports = _reports()
        if engine not in reports:
            raise NotImplementedError(f"{ENV} names no report of engine {engine!r}")
        self.report = reports[engine]

    def track_passed(self, engine):
        return self.report["summary"]["passed"]

    def track_xfailed(self, engine):
        """Known deviations (vendor xfails) that still deviate."""
        return self.report["summary"]["xfailed"]

    def track_failed_or_error(self, engine):
        return self.report["summary"]["failed"] + self.report["summary"]["error"]

    def track_skipped(self, engine):
        return self.report["summary"]["skipped"]

    def track_wall_s(self, engine):
        return self.report["duration_s"]

    track_passed.unit = "checks"  # type: ignore[attr-defined]
    track_xfailed.unit = "checks"  # type: ignore[attr-defined]
    track_failed_or_error.unit = "checks"  # type: ignore[attr-defined]
    track_skipped.unit = "checks"  # type: ignore[attr-defined]
    track_wall_s.unit = "seconds"  # type: ignore[attr-defined]


MISMATCH_CHECK = "E2E-MISMATCH-001"


def _mismatch() -> dict[tuple[str, str], float]:
    """(series, case) -> k3 KL of the engine's rollouts against the BF16 trainer, from each report's
    E2E-MISMATCH-001 cases (case = "<model>-<recipe>"; the e2e area's own measurement: 8 prompts x 20 sampled tokens)
    that ran (passed, failed or xfailed) and recorded it."""
    out: dict[tuple[str, str], float] = {}
    for series, rep in _reports().items():
        for c in rep.get("checks", []):
            k3 = (c.get("metrics") or {}).get("k3_kl")
            if c.get("id") == MISMATCH_CHECK and c.get("outcome") in ("passed", "failed", "xfailed") \
                    and isinstance(k3, (int, float)):
                out[(series, str(c.get("case")))] = float(k3)
    return out


_MISMATCH = _mismatch()
_MISMATCH_SERIES = sorted({s for s, _ in _MISMATCH}) or ["(no FP8RL_ASV_REPORTS)"]
_MISMATCH_CASES = sorted({c for _, c in _MISMATCH}) or ["(none)"]


class Mismatch(Benchmark):
    """k3 KL(π_rollout ‖ π_bf16-trainer) per engine and e2e case (model-recipe), as its conformance run measured it:
    a real engine's train-inference mismatch next to the oracle's, so a kernel change that widens it is a step."""

    params = (_MISMATCH_SERIES, _MISMATCH_CASES)
    param_names = ["engine", "case"]

    def setup(self, engine, case):
        if (engine, case) not in _mismatch():
            raise NotImplementedError(f"{ENV} names no {MISMATCH_CHECK}[{case}] measurement of {engine!r}")

    def track_k3_kl(self, engine, case):
        return _mismatch()[(engine, case)]

    track_k3_kl.unit = "nats/token"  # type: ignore[attr-defined]
