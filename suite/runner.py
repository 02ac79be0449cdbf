"""Runs the conformance suite (pytest, in-process) and turns per-check results into reports.

``run_conformance`` is what ``fp8rl conformance`` and ``fp8rl mutants`` call; the pytest plugin calls
``build_report``/``write_results`` at the end of a session.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import fp8rl

#: which checks ``fp8rl mutants`` runs each mutant against (``--fp8rl-mutant-matrix``): its declared killers, its
#: area's checks, or every check
MUTANT_MATRICES = ("declared", "area", "full")


def vendor_file(engine: str, kind: str) -> Path | None:
    """The packaged vendor file ``conformance/vendors/<engine>.<kind>`` (kind: xfails|skips), if any."""
    safe = engine.replace(":", "_")
    try:
        p = resources.files("fp8rl.conformance").joinpath("vendors", f"{safe}.{kind}")
    except ModuleNotFoundError:
        return None
    return Path(str(p)) if p.is_file() else None


def _describe_engine(name: str) -> dict[str, Any]:
    from fp8rl.registry import EngineLoadError, load_engine

    try:
        eng = load_engine(name)
        caps = {k: (v if v is True else str(v)) for k, v in eng.capabilities().items()}
        out = {"name": eng.name if not name.startswith("mutant:") else name, "version": str(eng.version()),
               "capabilities": caps}
        notes = [str(n) for n in eng.instrument_notes()]
        if notes:
            out["notes"] = notes
        return out
    except EngineLoadError as exc:
        return {"name": name, "version": "unloadable", "capabilities": {}, "load_error": str(exc)}


def report_document(*, kind: str, engine: dict[str, Any], profile: str, seed: int, started_at: str,
                    duration_s: float, command: list[str], checks: list[dict], warnings: list[str],
                    sections: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A report dict of the published schema (``fp8rl/reports/report.schema.json``): the envelope every kind of
    run shares, its checks and summary, and ``extra`` top-level fields of that kind (mutants: ``mutants``,
    ``mutation_score``)."""
    from fp8rl.environment import environment
    from fp8rl.reports import SCHEMA_VERSION, summarize

    return {
        "schema_version": SCHEMA_VERSION,
        "suite": {"name": "fp8rl", "version": fp8rl.__version__},
        "kind": kind,
        "engine": engine,
        "environment": environment(),
        "profile": profile,
        "seed": int(seed),
        "started_at": started_at,
        "duration_s": round(float(duration_s), 3),
        "command": [str(c) for c in command],
        "summary": summarize(checks),  # conformant iff no failed/error
        "checks": checks,
        "warnings": list(warnings),
        "sections": sections,
        **extra,
    }


def build_report(results: dict[str, dict[str, Any]], *, engines: list[str], profile: str, seed: int,
                 started_at: str, duration_s: float, command: list[str], warnings: list[str]) -> list[dict]:
    """One report dict (the published schema) per engine, from the plugin's per-node results."""
    from fp8rl.mutants import killers_by_check

    kills = killers_by_check()
    reports = []
    for name in engines:
        checks = []
        sections: dict[str, Any] = {}
        for r in results.values():
            if r["engine"] != name:
                continue
            c = {k: r[k] for k in ("id", "area", "title", "nodeid", "case", "outcome", "message", "bound",
                                   "metrics")}
            c["duration_s"] = round(float(r["duration_s"]), 6)
            c["kills"] = sorted(kills.get(r["id"], []))
            checks.append(c)
            sections.update(r.get("sections", {}))
        checks.sort(key=lambda c: (c["area"], c["id"], c["case"]))
        reports.append(report_document(kind="conformance", engine=_describe_engine(name), profile=profile,
                                       seed=seed, started_at=started_at, duration_s=duration_s, command=command,
                                       checks=checks, warnings=warnings, sections=sections))
    return reports


def engine_dir(out_dir: Path, engine: str) -> Path:
    return out_dir / "engines" / re.sub(r"[^A-Za-z0-9_.-]", "_", engine)


def write_results(reports: list[dict], out_dir: Path) -> list[Path]:
    """Write each engine's report: into ``out_dir`` for a single engine, else ``out_dir/engines/<engine>/``."""
    from fp8rl.reports import write_report

    written = []
    for rep in reports:
        target = out_dir if len(reports) == 1 else engine_dir(out_dir, rep["engine"]["name"])
        target.mkdir(parents=True, exist_ok=True)
        write_report(rep, target)
        written.append(target)
    return written


def pytest_args(engines: list[str], *, profile: str, out_dir: Path, seed: int = 0, xfails: str | None = None,
                skips: str | None = None, areas: list[str] | None = None, keyword: str | None = None,
                workers: int | None = None, extra: list[str] | None = None) -> list[str]:
    args = ["--pyargs", "fp8rl.conformance", "-p", "no:cacheprovider", "-q", "--no-header",
            "-o", "addopts=", "-o", "console_output_style=classic", "-W", "ignore::pytest.PytestAssertRewriteWarning",
            "--fp8rl-profile", profile, "--fp8rl-report-dir", str(out_dir), "--fp8rl-seed", str(seed)]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", "fp8rl.plugin"]
    for e in engines:
        args += ["--fp8rl-engine", e]
    if xfails:
        args += ["--fp8rl-xfails", xfails]
    if skips:
        args += ["--fp8rl-skips", skips]
    kw = []
    if areas:
        kw.append(" or ".join(f"test_{a}" for a in areas))
    if keyword:
        kw.append(keyword)
    if kw:
        args += ["-k", " and ".join(f"({k})" for k in kw)]
    if workers:
        args += ["-n", str(workers)]
    return args + list(extra or [])


def run_pytest(args: list[str]) -> int:
    """Run pytest in-process; returns its exit code."""
    import pytest

    return int(pytest.main(args))

