"""Runs the conformance suite (pytest, in-process) and turns per-check results into reports.

``run_conformance`` is what ``fp8rl conformance`` and ``fp8rl mutants`` call; the pytest plugin calls
``build_report``/``write_results`` at the end of a session.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import fp8rl

SCHEMA_VERSION = "1.0"


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


def build_report(results: dict[str, dict[str, Any]], *, engines: list[str], profile: str, seed: int,
                 started_at: str, duration_s: float, command: list[str], warnings: list[str]) -> list[dict]:
    """One report dict (the published schema) per engine, from the plugin's per-node results."""
    from fp8rl.plugin import environment
    from fp8rl.reports import summarize

    env = environment()
    reports = []
    for name in engines:
        checks = []
        for r in results.values():
            if r["engine"] != name:
                continue
            c = {k: r[k] for k in ("id", "area", "title", "nodeid", "case", "outcome", "message", "bound",
                                   "metrics")}
            c["duration_s"] = round(float(r["duration_s"]), 6)
            checks.append(c)
        checks.sort(key=lambda c: (c["area"], c["id"], c["case"]))
        sections: dict[str, Any] = {}
        for r in results.values():
            if r["engine"] == name:
                sections.update(r.get("sections", {}))
        reports.append({
            "schema_version": SCHEMA_VERSION,
            "suite": {"name": "fp8rl", "version": fp8rl.__version__},
            "kind": "conformance",
            "engine": _describe_engine(name),
            "environment": env,
            "profile": profile,
            "seed": int(seed),
            "started_at": started_at,
            "duration_s": round(duration_s, 3),
            "command": [str(c) for c in command],
            "summary": summarize(checks),  # fp8rl.reports.summarize: conformant iff no failed/error
            "checks": checks,
            "warnings": list(warnings),
            "sections": sections,
        })
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


def load_report(path: Path) -> dict:
    return json.loads(Path(path).read_text())
