"""Runs the conformance suite (pytest in a supervised child process, :func:`run_supervised`) and turns per-check
results into reports.

``pytest_args`` and ``run_supervised`` are what ``fp8rl conformance`` and ``fp8rl mutants`` call (through
``fp8rl.cli``); the pytest plugin calls ``build_report``/``write_results`` at the end of a session, and
``report_from_journal`` rebuilds the reports of a run whose pytest process died.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fp8rl

#: fp8rl's run profiles (``--profile`` / ``--fp8rl-profile``) → the hypothesis profile each loads
#: (:mod:`fp8rl.strategies` registers them)
RUN_PROFILES: dict[str, str] = {"ci": "ci", "full": "dev", "nightly": "nightly", "mutants": "mutants"}
#: which checks ``fp8rl mutants`` runs each mutant against (``--fp8rl-mutant-matrix``): its declared killers, its
#: area's checks, or every check
MUTANT_MATRICES = ("declared", "area", "full")


def describe_engine(name: str) -> dict[str, Any]:
    """Load the engine ``name`` and describe it for a report (name, version, capabilities, instrument notes).

    Raises :class:`fp8rl.registry.EngineLoadError` (or whatever the engine raises in ``instrument_notes``) when
    the engine can't be loaded: the caller turns that into exit 2."""
    from fp8rl.registry import load_engine_linted

    eng, lint = load_engine_linted(name)  # its lint errors make it fail; what is left is accepted, and reported
    caps = {k: (v if v is True else str(v)) for k, v in eng.capabilities().items()}
    from fp8rl.registry import EngineLoadError, return_type_problems

    wrong = return_type_problems(eng, caps)
    if wrong:
        raise EngineLoadError(f"engine {name!r}: an op returns the wrong type (a tiny call at load): " + "; ".join(wrong))
    out: dict[str, Any] = {"name": eng.name if not name.startswith("mutant:") else name,
                           "version": str(eng.version()), "capabilities": caps}
    if lint.deviations:
        out["deviations"] = [dict(d) for d in lint.deviations]
    if lint.warnings:
        out["policy_warnings"] = list(lint.warnings)
    notes = [str(n) for n in eng.instrument_notes()]
    if notes:
        out["notes"] = notes
    from fp8rl.presets_cli import declared_presets

    presets = declared_presets(eng)  # the provenance of each ScalePolicy preset the engine declares
    if presets:
        out["presets"] = presets
    from fp8rl.inputspace import MODEL

    limits = {op: dict(eng.input_limits(op)) for op in MODEL} if hasattr(eng, "input_limits") else {}
    limits = {op: v for op, v in limits.items() if v}
    if limits:
        out["input_limits"] = limits  # the input classes the engine declares it cannot take, with reasons
    return out


def coverage_section(exercised: dict[str, dict[str, set[str]]], limits: dict[str, dict[str, str]],
                     areas: set[str]) -> dict[str, Any]:
    """The op × input-class coverage table of a report (fp8rl.inputspace): for every class of every op of the run's
    areas, the checks that exercised it, or that none did (with the engine's reason when it declares the class
    unsupported)."""
    from fp8rl.inputspace import MODEL

    rows = []
    n_total = n_hit = 0
    for op, model in MODEL.items():
        if model.area not in areas:
            continue
        for cls in model.classes():
            ids = sorted(exercised.get(op, {}).get(cls, set()))
            reason = limits.get(op, {}).get(cls)
            status = "exercised" if ids else f"unsupported: {reason}" if reason else "NOT EXERCISED"
            n_total += 1
            n_hit += bool(ids)
            rows.append([op, cls, len(ids), ", ".join(ids[:6]) + (" …" if len(ids) > 6 else ""), status])
    text = (f"{n_hit} of {n_total} input classes of the ops these areas call were exercised (fp8rl.inputspace: "
            "dtype, layout, rank, sizes around the 64/128/256 tiles, special values in every operand, optional "
            "arguments).")
    return {"title": "input-space coverage (op × class)", "text": text, "exercised": n_hit, "classes": n_total,
            "table": {"columns": ["op", "class", "checks", "check ids", "status"], "rows": rows}}


def case_scope(result: dict[str, Any]) -> dict[str, Any]:
    """A check case's scope fields (report.json ``requires``, ``exercised``, ``refused``) from the plugin's record of
    the ops it called: ``exercised`` is ``engine`` if one op ran the engine's own code, ``oracle`` if every op it
    called was inherited from fp8rl's oracle, ``none`` if it called none."""
    ops = result.get("ops") or {}
    if "ops" not in result and "requires" not in result:
        return {}  # a result recorded without op tracking (an old journal): no claim either way
    n_engine = sum(int(row.get("engine", 0)) for row in ops.values())
    n_oracle = sum(int(row.get("oracle", 0)) for row in ops.values())
    return {"requires": sorted(result.get("requires") or []),
            "exercised": "engine" if n_engine else "oracle" if n_oracle else "none",
            "refused": bool(result.get("refused"))}


def scope_section(scope: dict[str, Any]) -> dict[str, Any]:
    """The report section "scope" of :func:`fp8rl.reports._schema.scope_of`'s result: per capability the engine
    declares available and this run had cases of, how many cases ran the engine's own code, how many only the
    oracle's inherited code, how many the engine refused."""
    from fp8rl.reports._schema import capability_status

    rows = [[key, r["cases"], r["engine"], r["oracle"], r["refused"], capability_status(r), " | ".join(r["refusals"])]
            for key, r in scope["capabilities"].items()]
    text = (f"{scope['engine_cases']} cases ran the engine's own code; {scope['oracle_cases']} ran only code it "
            f"inherits from fp8rl's oracle (reported, not part of its verdict); {scope['refused_cases']} were refused "
            "by the engine (Unsupported for a capability it declares). A declared capability none of whose cases ran "
            "the engine's own code makes the verdict incomplete.")
    return {"title": "scope: what ran the engine's own code", "text": text,
            "table": {"columns": ["capability", "cases", "engine code", "oracle (inherited)", "refused", "status",
                                  "refusals"], "rows": rows}}


def deviations_section(desc: dict[str, Any]) -> dict[str, Any]:
    """The report section "declared deviations from single rounding" (fp8rl.policy_lint): each declared policy that
    rounds twice, the extra error it allows, and the lint's warnings. The checks judge the engine under these
    declarations; this section says what they cost."""
    rows = [[d.get("kind", ""), d.get("policy", ""), f"{d.get('field')}={d.get('value')!r}",
             ", ".join(d.get("dtypes", [])), d.get("what", ""), d.get("extra_error", "")]
            for d in desc.get("deviations", [])]
    text = ("The engine declares numerics that round x/s twice (to the input dtype, then to FP8). The checks accept "
            "them as declared; each row states the extra error such a declaration allows.")
    if desc.get("policy_warnings"):
        text += " Policy lint warnings: " + " | ".join(desc["policy_warnings"])
    return {"title": "declared deviations from single rounding", "text": text,
            "table": {"columns": ["kind", "policy", "declared", "input dtypes", "what", "extra error"], "rows": rows}}


def report_document(*, kind: str, engine: dict[str, Any], profile: str, seed: int, started_at: str,
                    duration_s: float, command: list[str], checks: list[dict], warnings: list[str],
                    sections: dict[str, Any], scope: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A report dict of the published schema (``fp8rl/reports/report.schema.json``): the envelope every kind of
    run shares, its checks and summary, and ``extra`` top-level fields of that kind (mutants: ``mutants``,
    ``mutation_score``). ``scope``: the checks' scope (``scope_of``) if the caller computed it for a section."""
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
        "summary": summarize(checks, status=extra.get("status", "complete"), partial=bool(extra.get("selection")),
                             capabilities=engine.get("capabilities") if kind == "conformance" else None,
                             scope=scope),
        "checks": checks,
        "warnings": list(warnings),
        "sections": sections,
        **extra,
    }


def build_report(results: dict[str, dict[str, Any]], *, engines: list[str], profile: str, seed: int,
                 started_at: str, duration_s: float, command: list[str], warnings: list[str],
                 descriptions: dict[str, dict[str, Any]] | None = None, status: str = "complete",
                 status_detail: str | None = None, selection: dict[str, Any] | None = None) -> list[dict]:
    """One report dict (the published schema) per engine, from the plugin's per-node results.

    ``descriptions``: engine name → :func:`describe_engine` (loaded now for the names it lacks); ``status``:
    complete / interrupted / crashed (``status_detail`` says why); ``selection``: the --area / -k restriction of a
    partial run."""
    from fp8rl.mutants import killers_by_check
    from fp8rl.reports._schema import scope_of

    kills = killers_by_check()
    reports = []
    for name in engines:
        checks = []
        sections: dict[str, Any] = {}
        exercised: dict[str, dict[str, set[str]]] = {}
        for r in results.values():
            if r["engine"] != name:
                continue
            c = {k: r[k] for k in ("id", "area", "title", "nodeid", "case", "outcome", "message", "bound",
                                   "metrics")}
            c["duration_s"] = round(float(r["duration_s"]), 6)
            c["kills"] = sorted(kills.get(r["id"], []))
            c.update(case_scope(r))
            checks.append(c)
            sections.update(r.get("sections", {}))
            for op, classes in (r.get("coverage") or {}).items():
                for cls in classes:
                    exercised.setdefault(op, {}).setdefault(cls, set()).add(r["id"])
        checks.sort(key=lambda c: (c["area"], c["id"], c["case"]))
        desc = (descriptions or {}).get(name) or describe_engine(name)
        sections["coverage"] = coverage_section(exercised, desc.get("input_limits", {}), {c["area"] for c in checks})
        scope = scope_of(checks, desc.get("capabilities", {}))
        if scope is not None:
            sections["scope"] = scope_section(scope)
        if desc.get("deviations") or desc.get("policy_warnings"):
            sections["declared_deviations"] = deviations_section(desc)
        extra: dict[str, Any] = {"status": status}
        if status_detail:
            extra["status_detail"] = status_detail
        if selection:
            extra["selection"] = selection
        reports.append(report_document(kind="conformance", engine=desc, profile=profile, seed=seed,
                                       started_at=started_at, duration_s=duration_s, command=command,
                                       checks=checks, warnings=warnings, sections=sections, scope=scope, **extra))
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


#: xdist replaces a crashed worker at most this many times in one run (each crash is one check's ``error``)
MAX_WORKER_RESTARTS = 1000


def conformance_package_dir() -> Path:
    """The directory of the ``fp8rl.conformance`` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("fp8rl.conformance")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("fp8rl.conformance is not importable: is fp8rl installed?")
    return Path(next(iter(spec.submodule_search_locations)))


def pytest_args(engines: list[str], *, profile: str, out_dir: Path, seed: int = 0, xfails: str | None = None,
                skips: str | None = None, areas: list[str] | None = None, keyword: str | None = None,
                workers: int | None = None, isolation: bool = True, packaged_xfails: bool = False,
                extra: list[str] | None = None) -> list[str]:
    """The pytest command line of a conformance run.

    ``isolation`` (the default): the checks run in pytest-xdist worker processes (``workers``, default 1), so a
    crash, abort or C-level hang takes down a worker, not the run: the check becomes ``error`` and a fresh worker
    continues (timeouts use pytest-timeout's thread method, which ends a hung worker). ``isolation=False`` runs the
    checks in the pytest process itself (faster start; a crash then ends the run, and the supervisor rebuilds
    the report from the journal)."""
    # -qq: pytest prints no summary line of its own (it counts an engine error as "failed", a refusal as "skipped"):
    # the one set of counts on screen is fp8rl's table
    # the run's pytest reads no configuration of the directory it is started from: no ini file (-c devnull), its
    # rootdir is the package holding the checks (node ids read test_*.py::…, installed or editable), and no
    # conftest.py is discovered (a user's project conftest, or this repository's tests/conftest.py, must not change a
    # conformance run): the checks' own conftest is loaded as a plugin
    args = ["--pyargs", "fp8rl.conformance", "-c", os.devnull, "--rootdir", str(conformance_package_dir()),
            "--noconftest", "-p", "fp8rl.conformance.conftest", "-p", "no:cacheprovider", "-qq", "--no-header",
            "-o", "addopts=", "-o", "console_output_style=classic", "-W", "ignore::pytest.PytestAssertRewriteWarning",
            "--fp8rl-profile", profile, "--fp8rl-report-dir", str(out_dir), "--fp8rl-seed", str(seed),
            f"--hypothesis-seed={seed}"]  # the hypothesis checks' examples follow the run seed (strategies.seed_profile)
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        args += ["-p", "fp8rl.plugin", "-p", "pytest_timeout"] + (["-p", "xdist.plugin"] if isolation else [])
    for e in engines:
        args += ["--fp8rl-engine", e]
    if xfails:
        args += ["--fp8rl-xfails", xfails]
    elif packaged_xfails:
        args += ["--fp8rl-packaged-xfails"]
    if skips:
        args += ["--fp8rl-skips", skips]
    for a in areas or ():
        args += ["--fp8rl-area", a]
    if keyword:
        args += ["-k", keyword]
    if isolation:
        args += ["-n", str(workers or 1), "--max-worker-restart", str(MAX_WORKER_RESTARTS), "--timeout-method",
                 "thread"]
    else:
        args += ["-p", "no:xdist"]
    return args + list(extra or [])


@dataclass
class SupervisedRun:
    """How the pytest process of a run ended: its exit code (negative: the signal that killed it), and the signal
    the supervisor received (SIGINT/SIGTERM), if any."""

    returncode: int
    signal_received: str | None = None
    killed: bool = False


#: signals a command received before its supervised run started (``fp8rl.cli.main`` records them from its first
#: moment, so that a SIGTERM during start-up still ends in an honest report, not a killed process)
EARLY_SIGNALS: list[str] = []


def record_early_signals() -> Callable[[], None]:
    """Install SIGINT/SIGTERM handlers that only remember the signal (see :data:`EARLY_SIGNALS`); returns the call
    that puts the previous handlers back and forgets the remembered signals (``fp8rl.cli.main`` calls it when the
    command returns, so an in-process caller's later commands start clean)."""
    import signal

    def remember(signum: int, frame: object) -> None:
        EARLY_SIGNALS.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, remember) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        EARLY_SIGNALS.clear()

    return restore


def run_supervised(args: list[str], *, grace_s: float = 30.0) -> SupervisedRun:
    """Run pytest in a child process (its own session, so a terminal's Ctrl-C reaches only this supervisor) and
    supervise it: SIGINT/SIGTERM received here are passed on (the run stops and writes an interrupted report); a
    child that has not ended ``grace_s`` seconds later is killed with its whole process group."""
    import signal
    import subprocess
    import sys
    import time

    from fp8rl.plugin import SUPERVISED_ENV

    if EARLY_SIGNALS:  # stopped before it started
        return SupervisedRun(1, EARLY_SIGNALS[0])
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], start_new_session=True,
                            env={**os.environ, SUPERVISED_ENV: "1"})
    received: list[str] = []

    def forward(signum: int, frame: object) -> None:
        if not received:
            received.append(signal.Signals(signum).name)
            try:
                proc.send_signal(signum)  # the run stops as it would on that signal (and says which)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    killed = False
    try:
        deadline = None
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline and not killed:
                killed = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not killed:  # the child's own workers (xdist) must not outlive it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return SupervisedRun(rc, received[0] if received else None, killed)


def report_from_journal(out_dir: Path, *, status: str, detail: str, profile: str, seed: int,
                        command: list[str], isolation: bool) -> list[dict] | None:
    """Rebuild the reports of a run whose pytest process died without writing them, from its journal: finished
    checks as they ended; the check that was running as ``error`` (the engine code ran in that process, so its
    death is the engine's: signal and op named) unless the run was interrupted (then ``not_run``); every other
    planned check ``not_run``. None when the journal has no plan (the run died before collecting its checks)."""
    from fp8rl import journal as J

    planned: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    running: set[str] = set()
    engines: list[str] = []
    descriptions: dict[str, dict[str, Any]] = {}
    started_at = None
    selection = None
    for rec in J.read_journal(out_dir / J.JOURNAL_NAME):
        kind = rec["type"]
        if kind == "run":
            engines = list(rec["engines"])
            started_at = started_at or rec["t"]
            selection = rec.get("selection")
        elif kind == "engines":
            descriptions = rec["descriptions"]
        elif kind == "planned":
            planned.update(rec["checks"])
        elif kind == "start":
            running.add(rec["nodeid"])
        elif kind == "result":
            e = {k: v for k, v in rec.items() if k not in ("type", "t")}
            results[e["nodeid"]] = e
            running.discard(e["nodeid"])
    if not planned:
        return None
    import time
    from datetime import UTC, datetime

    final: dict[str, dict[str, Any]] = {}
    for nodeid, meta in planned.items():
        if nodeid in results:
            final[nodeid] = results[nodeid]
            continue
        e = {**meta, "nodeid": nodeid, "outcome": "not_run", "message": f"not run: {detail}", "duration_s": 0.0,
             "metrics": {}}
        if nodeid in running and status == "crashed":
            process = "main" if not isolation else "?"
            why = J.describe_death(out_dir / J.TRACE_DIR_NAME, process, timeout_s=meta.get("timeout_s"))
            e["outcome"] = "error"
            e["message"] = f"the run's process died while running this check ({detail}; {why})"
        elif nodeid in running:
            e["message"] = f"not run: {detail} (it was running)"
        final[nodeid] = e
    t0 = float(started_at or time.time())
    return build_report(final, engines=engines, descriptions=descriptions, profile=profile, seed=seed,
                        started_at=datetime.fromtimestamp(t0, UTC).isoformat(), duration_s=time.time() - t0,
                        command=command, warnings=[f"report rebuilt from the run journal: {detail}"],
                        status=status, status_detail=detail, selection=selection)
