"""``fp8rl`` command line. Exit codes: :mod:`fp8rl.exitcodes`."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from fp8rl.runner import MUTANT_MATRICES, RUN_PROFILES
from rich.console import Console
from rich.markup import escape
from rich.table import Table

#: the profiles a user picks (``mutants`` is fp8rl mutants' own)
PROFILE_CHOICES = tuple(p for p in RUN_PROFILES if p != "mutants")


def _console() -> Console:
    return Console(stderr=False, highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


# ----------------------------------------------------------------------------------------------------------------
def cmd_engines(args: argparse.Namespace) -> int:
    from fp8rl.capabilities import CAPABILITIES
    from fp8rl.registry import EngineLoadError, available_engines, load_engine

    console = _console()
    rows: list[dict[str, Any]] = []
    names = [n for n, src in available_engines().items() if src != "mutant"] if not args.names else args.names
    for name in names:
        try:
            eng = load_engine(name)
            caps = {k: (v if v is True else str(v)) for k, v in eng.capabilities().items()}
            rows.append({"name": name, "version": eng.version(), "description": own_description(eng),
                         "capabilities": caps, "inherited": inherited_capabilities(eng, caps)})
        except EngineLoadError as exc:
            rows.append({"name": name, "version": "-", "description": "", "capabilities": {}, "error": str(exc)})
    failed = EXIT_USAGE if any("error" in r for r in rows) else EXIT_OK
    if args.json:
        print(json.dumps(rows, indent=2))
        return failed
    for row in rows:
        table = Table(title=escape(f"{row['name']}  ({row['version']})"), title_justify="left", show_lines=False)
        table.add_column("area")
        table.add_column("capability")
        table.add_column("status")
        if "error" in row:
            table.add_row("", "load", f"[red]{escape(str(row['error']))}[/red]")
        declared: dict[str, Any] = row["capabilities"]
        for key, cap in CAPABILITIES.items():  # every key of the table, area by area
            status = declared.get(key)
            shown = ("[yellow]available, inherited from fp8rl's oracle (not a test of this engine)[/yellow]"
                     if status is True and key in row.get("inherited", ()) else
                     "[green]available[/green]" if status is True else "[dim]not declared[/dim]" if status is None
                     else f"[yellow]no:[/yellow] {escape(str(status))}")
            table.add_row(cap.area, key, shown)
        console.print(table)
        if row["description"]:
            console.print(f"  {escape(str(row['description']))}\n")
    return failed


def own_description(engine: Any) -> str:
    """The engine's ``description``, unless it only inherits the oracle's (a ``ReferenceEngine`` subclass that
    sets none must not be listed as "fp8rl's own oracle")."""
    from fp8rl.checks import op_origin

    text = str(getattr(engine, "description", "") or "")
    return "" if op_origin(engine, "description") == "oracle" else text


def inherited_capabilities(engine: Any, caps: dict[str, Any]) -> list[str]:
    """The capabilities the engine declares available whose every op it inherits unchanged from fp8rl's oracle."""
    from fp8rl.capabilities import CAPABILITIES
    from fp8rl.checks import DECLARATIONS, op_origin

    out = []
    for key, status in caps.items():
        cap = CAPABILITIES.get(key)
        if status is not True or cap is None:
            continue
        ops = [op for op in cap.ops if op not in DECLARATIONS and not op.startswith("_") and hasattr(engine, op)]
        if ops and all(op_origin(engine, op) == "oracle" for op in ops):
            out.append(key)
    return out


# ----------------------------------------------------------------------------------------------------------------
_DEFAULT = object()


def _prepare_out(out: Path, console: Console) -> bool:
    """Create the output directory, prove it is writable, and remove the files a previous run left (a stale
    report.json must never be read as this run's)."""
    from fp8rl import journal as J

    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fp8rl-write-probe"
        probe.write_text("ok")
        probe.unlink()
        for name in ("report.json", "report.md", "report.html", "junit.xml", J.JOURNAL_NAME):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / J.TRACE_DIR_NAME, ignore_errors=True)
    except OSError as exc:
        console.print(f"[red]fp8rl: --out: can't write the report to {str(out)!r}: {escape(str(exc))}[/red]")
        return False
    return True


def _check_id_files(args: argparse.Namespace, console: Console) -> bool:
    from fp8rl.vendor_files import parse_id_file

    for opt in ("xfails", "skips"):
        path = getattr(args, opt, None)
        if not path:
            continue
        try:
            parse_id_file(path)
        except Exception as exc:  # noqa: BLE001 - pytest.UsageError: a missing or malformed vendor file
            console.print(f"[red]fp8rl: --{opt}: {escape(str(exc).removeprefix('fp8rl: '))}[/red]")
            return False
    return True


def _supervised_run(engines: list[str], args: argparse.Namespace, out: Path, profile: str, *,
                    extra: list[str] | None = None, areas=_DEFAULT, packaged_xfails: bool = False):
    """Run the checks in a supervised pytest process; returns (the supervisor's record, the reports written or
    rebuilt from the journal, or None with a load error / nothing to report)."""
    from fp8rl.runner import engine_dir, pytest_args, report_from_journal, run_supervised, write_results

    isolation = not getattr(args, "no_isolation", False)
    pa = pytest_args(engines, profile=profile, out_dir=out, seed=args.seed, xfails=getattr(args, "xfails", None),
                     skips=getattr(args, "skips", None), areas=args.area if areas is _DEFAULT else areas,
                     keyword=args.k, workers=args.workers, isolation=isolation, packaged_xfails=packaged_xfails,
                     extra=extra)
    run = run_supervised(pa)
    paths = [out / "report.json"] if len(engines) == 1 else [engine_dir(out, e) / "report.json" for e in engines]
    if all(p.is_file() for p in paths):
        from fp8rl.reports import load_report

        return run, [load_report(p) for p in paths]
    if run.signal_received:
        status, detail = "interrupted", f"{run.signal_received}; the run was stopped"
    else:
        rc = run.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        status, detail = "crashed", f"the pytest process ended without writing its report ({how})"
    reports = report_from_journal(out, status=status, detail=detail, profile=profile, seed=args.seed,
                                  command=sys.argv, isolation=isolation)
    if reports is not None:
        try:
            write_results(reports, out)
        except OSError as exc:
            raise _ReportWriteError(f"can't write the report to {str(out)!r}: {exc}") from exc
    return run, reports


class _ReportWriteError(Exception):
    """The output directory took no report (full, read-only, gone): the run's verdict can't be delivered."""


def _empty_interrupted_report(args: argparse.Namespace, out: Path, signal_name: str) -> list[dict]:
    """The report of a run stopped before it planned a single check: no checks, status interrupted."""
    from datetime import UTC, datetime

    from fp8rl.runner import report_document, write_results

    rep = report_document(kind="conformance", engine={"name": args.engine, "version": "not loaded",
                                                      "capabilities": {}},
                          profile=args.profile, seed=args.seed, started_at=datetime.now(UTC).isoformat(),
                          duration_s=0.0, command=sys.argv, checks=[], warnings=[], sections={},
                          status="interrupted", status_detail=f"{signal_name} before any check was planned")
    try:
        write_results([rep], out)
    except OSError as exc:
        raise _ReportWriteError(f"can't write the report to {str(out)!r}: {exc}") from exc
    return [rep]


def _load_error(out: Path) -> tuple[str, str] | None:
    from fp8rl import journal as J

    for rec in J.read_journal(out / J.JOURNAL_NAME):
        if rec["type"] == "load_error":
            return str(rec["message"]), str(rec.get("traceback", ""))
    return None


def _parse_seeds(text: str) -> list[int]:
    a, sep, b = text.partition("..")
    try:
        lo, hi = int(a), int(b if sep else a)
    except ValueError:
        raise ValueError(f"--seeds: expected A..B (integers, inclusive), got {text!r}") from None
    if hi < lo:
        raise ValueError(f"--seeds: expected A <= B, got {text!r}")
    return list(range(lo, hi + 1))


def cmd_conformance_sweep(args: argparse.Namespace) -> int:
    """``fp8rl conformance --seeds A..B``: one full run per seed (reports in ``<out>/seed-<n>``), then a checks ×
    seeds table: the false-alarm measurement of a correct engine (every cell must be a pass)."""
    from fp8rl.exitcodes import EXIT_INCOMPLETE, VERDICT_EXIT
    from fp8rl.reports.sweep import sweep_table, write_sweep

    console = _console()
    try:
        seeds = _parse_seeds(args.seeds)
    except ValueError as exc:
        console.print(f"[red]fp8rl: {exc}[/red]")
        return EXIT_USAGE
    out = Path(args.out)
    runs: dict[int, dict] = {}
    codes: dict[int, int] = {}
    t0 = time.perf_counter()
    for seed in seeds:
        sub = argparse.Namespace(**{**vars(args), "seeds": None, "seed": seed, "out": str(out / f"seed-{seed}")})
        console.print(f"[bold]== seed {seed} ({len(runs) + 1}/{len(seeds)})[/bold]")
        codes[seed] = cmd_conformance(sub)
        report = out / f"seed-{seed}" / "report.json"
        if report.is_file():
            runs[seed] = json.loads(report.read_text())
        if codes[seed] in (EXIT_USAGE,) or (seed in runs and runs[seed].get("status") == "interrupted"):
            break  # an interrupted sweep stops; what ran is still tabulated
    table = sweep_table(runs)
    paths = write_sweep(table, out, wall_s=time.perf_counter() - t0)
    bad = [row for row in table["rows"] if any(o not in ("passed", "skipped", "xfailed") for o in row["outcomes"])]
    console.print(f"sweep: {len(runs)} of {len(seeds)} seeds, {len(table['rows'])} checks; "
                  f"{len(bad)} check(s) not passing on every seed; {paths['md']}")
    for row in bad[:30]:
        console.print(f"  {escape(row['check'])}: " + ", ".join(f"seed {s}: {o}" for s, o in
                                                                zip(table["seeds"], row["outcomes"])
                                                                if o not in ("passed", "skipped", "xfailed")))
    if len(runs) < len(seeds) or any(c == EXIT_USAGE for c in codes.values()):
        return EXIT_USAGE if any(c == EXIT_USAGE for c in codes.values()) else EXIT_INCOMPLETE
    verdicts = [VERDICT_EXIT[r["summary"]["verdict"]] for r in runs.values()]
    return max(verdicts, key=lambda c: {EXIT_OK: 0, EXIT_INCOMPLETE: 1, EXIT_FAIL: 2}.get(c, 3))


def cmd_conformance(args: argparse.Namespace) -> int:
    from fp8rl.exitcodes import VERDICT_EXIT
    from fp8rl.reports import print_summary

    if getattr(args, "seeds", None):
        return cmd_conformance_sweep(args)
    console = _console()
    if args.no_isolation and args.workers:
        console.print("[red]fp8rl: --no-isolation runs in one process; it can't take -n/--workers[/red]")
        return EXIT_USAGE
    out = Path(args.out)
    if not _check_id_files(args, console) or not _prepare_out(out, console):
        return EXIT_USAGE
    t0 = time.perf_counter()
    extra = ["--fp8rl-timeout", str(args.timeout)] if args.timeout else []
    try:
        run, reports = _supervised_run([args.engine], args, out, args.profile,
                                       packaged_xfails=args.xfails is None, extra=extra)
    except _ReportWriteError as exc:
        console.print(f"[red]fp8rl: {escape(str(exc))}[/red]")
        return EXIT_USAGE
    wall = time.perf_counter() - t0
    load_error = _load_error(out)
    if load_error is not None:
        console.print(f"[red]fp8rl: {escape(load_error[0])}[/red]")
        if args.verbose:
            console.print(escape(load_error[1]))
        return EXIT_USAGE
    if reports is None and run.signal_received:  # stopped before it planned anything: an empty, honest report
        try:
            reports = _empty_interrupted_report(args, out, run.signal_received)
        except _ReportWriteError as exc:
            console.print(f"[red]fp8rl: {escape(str(exc))}[/red]")
            return EXIT_USAGE
    if reports is None:
        rc = run.returncode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"pytest exit {rc}"
        console.print(f"[red]fp8rl: the run ended before any check was planned ({how}; see its output above): "
                      f"the engine could not be loaded, the run could not start, or the output directory stopped taking writes; no report[/red]")
        return EXIT_USAGE
    report = reports[0]
    if report["summary"]["total"] == 0 and report.get("status", "complete") == "complete":
        console.print("[red]fp8rl: no checks ran (selection matched nothing)[/red]")
        return EXIT_USAGE
    print_summary(report, console=console)
    console.print(f"wall time {wall:.1f} s; report: {out}/report.json, report.html, report.md, junit.xml")
    if report.get("status", "complete") == "complete":  # the journal and op traces matter only to a broken run
        from fp8rl import journal as J

        (out / J.JOURNAL_NAME).unlink(missing_ok=True)
        shutil.rmtree(out / J.TRACE_DIR_NAME, ignore_errors=True)
    return VERDICT_EXIT[report["summary"]["verdict"]]


# ----------------------------------------------------------------------------------------------------------------
def _mutant_row(name: str, report: dict) -> dict:
    """One mutant's result: the checks that killed it, and its declared killers that did not (survived)."""
    from fp8rl.mutants import MUTANTS

    m = MUTANTS[name]
    killed_by = sorted({c["id"] for c in report["checks"] if c["outcome"] in ("failed", "error")})
    ran = {c["id"] for c in report["checks"] if c["outcome"] != "skipped"}
    return {"mutant": name, "description": m.description, "area": m.area, "killed": bool(killed_by),
            "killed_by": killed_by, "declared": list(m.kills),
            "survived_declared": sorted(set(m.kills) - set(killed_by)),
            "unknown_declared": sorted(set(m.kills) - {c["id"] for c in report["checks"]}) if ran else [],
            "undeclared_killers": sorted(set(killed_by) - set(m.kills))}


def cmd_mutants(args: argparse.Namespace) -> int:
    from fp8rl.mutants import MUTANTS
    from fp8rl.reports import write_report
    from fp8rl.runner import report_document

    console = _console()
    names = args.only or sorted(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        console.print(f"[red]fp8rl: unknown mutants {unknown}; known: {sorted(MUTANTS)}[/red]")
        return EXIT_USAGE
    if args.area:
        names = [n for n in names if MUTANTS[n].area in args.area]
        if not names:
            console.print(f"[red]fp8rl: no mutant in areas {args.area}[/red]")
            return EXIT_USAGE
    if args.list:
        for n in names:
            console.print(f"{n:32s} [{MUTANTS[n].area}] {escape(MUTANTS[n].description)}  "
                          f"kills: {', '.join(MUTANTS[n].kills)}")
        return EXIT_OK
    out = Path(args.out)
    if not _prepare_out(out, console):
        return EXIT_USAGE
    engines = [f"mutant:{n}" for n in names]
    t0 = time.perf_counter()
    try:
        run, reports = _supervised_run(engines, args, out, "mutants",
                                       areas=None if args.matrix == "declared" else args.area,
                                       extra=["--fp8rl-mutant-matrix", args.matrix])
    except _ReportWriteError as exc:
        console.print(f"[red]fp8rl: {escape(str(exc))}[/red]")
        return EXIT_USAGE
    wall = time.perf_counter() - t0
    if reports is None:
        console.print(f"[red]fp8rl: the mutant run ended before any check was planned (pytest exit "
                      f"{run.returncode}); no report[/red]")
        return EXIT_USAGE
    if any(r.get("status", "complete") != "complete" for r in reports):
        console.print(f"[red]fp8rl: the mutant run did not complete ({reports[0].get('status_detail')}); "
                      "a mutant that was not run can't count as killed[/red]")
    rows = [_mutant_row(n, rep) for n, rep in zip(names, reports)]
    killed = sum(r["killed"] for r in rows)
    broken = [r for r in rows if r["survived_declared"]]
    score = killed / len(rows) if rows else 0.0
    (out / "mutants.json").write_text(json.dumps(rows, indent=2))
    per_check_kills: dict[str, int] = {}
    for r in rows:
        for cid in r["killed_by"]:
            per_check_kills[cid] = per_check_kills.get(cid, 0) + 1
    mutant_checks = [{
        "id": "MUTANT-" + r["mutant"].upper().replace("_", "-"), "area": r["area"], "title": r["description"],
        "nodeid": f"mutant:{r['mutant']}", "case": "",
        "outcome": "passed" if r["killed"] and not r["survived_declared"] else "failed",
        "message": (("killed by " + ", ".join(r["killed_by"])) if r["killed"] else "SURVIVED: no check failed")
        + (f"; SURVIVED its declared killers {', '.join(r['survived_declared'])}" if r["survived_declared"] else ""),
        "duration_s": 0.0, "bound": None, "metrics": {"killed_by": len(r["killed_by"])},
    } for r in rows]
    write_report(report_document(
        kind="mutants", engine={"name": "mutants", "version": _version(), "capabilities": {}}, profile="mutants",
        seed=args.seed, started_at=reports[0]["started_at"], duration_s=wall, command=sys.argv,
        checks=mutant_checks, warnings=[], mutants=rows, mutation_score=score,
        sections={"check_kill_counts": {"title": f"mutants killed per check (matrix {args.matrix})", "table": {
            "columns": ["check", "mutants killed"],
            "rows": [[cid, n] for cid, n in sorted(per_check_kills.items())]}}}), out)
    table = Table(title=f"mutation score {killed}/{len(rows)} = {100 * score:.0f}%  (matrix {args.matrix}, "
                        f"{wall:.1f} s)", title_justify="left")
    for col in ("mutant", "area", "killed", "killed by"):
        table.add_column(col)
    for r in rows:
        kb = ", ".join(r["killed_by"][:4]) + (" …" if len(r["killed_by"]) > 4 else "")
        status = "[green]yes[/green]" if r["killed"] and not r["survived_declared"] else "[red]SURVIVED[/red]"
        table.add_row(r["mutant"], r["area"], status, kb)
    console.print(table)
    for r in broken:
        console.print(f"[red]{r['mutant']} survived declared killers {r['survived_declared']}[/red]")
    new = {cid for r in rows for cid in r["undeclared_killers"]}
    if new and args.matrix != "declared":
        console.print(f"checks that killed a mutant without being declared: {', '.join(sorted(new))}")
    console.print(f"mutants.json and report.* written to {out}")
    return EXIT_OK if killed == len(rows) and not broken else EXIT_FAIL


def cmd_checks(args: argparse.Namespace) -> int:
    from fp8rl import tolerances
    from fp8rl.checks import all_checks
    from fp8rl.mutants import killers_by_check

    CHECKS = all_checks()
    rows = sorted((c for c in CHECKS.values() if not args.area or c.area in args.area), key=lambda c: (c.area, c.id))
    if not rows:
        _console().print(f"[red]fp8rl: --area: no checks in {args.area}; areas: "
                         f"{sorted({c.area for c in CHECKS.values()})}[/red]")
        return EXIT_USAGE
    kills = killers_by_check()
    if args.json:
        print(json.dumps([{"id": c.id, "area": c.area, "title": c.title, "bound": c.bound,
                           "bounds": {b: tolerances.get(b).derivation for b in c.bounds},
                           "requires": list(c.requires), "kills": sorted(kills.get(c.id, []))}
                          for c in rows], indent=2))
        return EXIT_OK
    table = Table(title=f"{len(rows)} conformance checks", title_justify="left")
    for col in ("id", "area", "bound", "kills (mutants)", "spec"):
        table.add_column(col)
    for c in rows:
        table.add_row(escape(c.id), c.area, c.bound, escape(", ".join(sorted(kills.get(c.id, []))) or "—"),
                      escape(c.title))
    _console().print(table)
    return EXIT_OK


def _version() -> str:
    import fp8rl

    return fp8rl.__version__


# ----------------------------------------------------------------------------------------------------------------

class _OnceAction(argparse.Action):
    """Store an option that may be given only once (a repeated ``--engine`` would silently replace the first)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_seen_{self.dest}", False):
            parser.error(f"{option_string}: given more than once; run one engine per invocation (got "
                         f"{getattr(namespace, self.dest)!r} and {values!r})")
        setattr(namespace, f"_seen_{self.dest}", True)
        setattr(namespace, self.dest, values)

def cmd_scaffold(args: argparse.Namespace) -> int:
    from fp8rl.scaffold import ScaffoldError, scaffold_check, scaffold_engine

    console = _console()
    root = Path(args.root)
    if not (root / "suite").is_dir() or not (root / "conformance").is_dir():
        console.print(f"[red]fp8rl: --root: {str(root)!r} is not an fp8rl checkout (no suite/ and conformance/)[/red]")
        return EXIT_USAGE
    try:
        if args.what == "check":
            files = scaffold_check(root, args.area, args.id, title=args.title, bound=args.bound, judged=args.judged,
                                   requires=tuple(args.requires or ()), new_bound_value=args.bound_value)
        else:
            files = scaffold_engine(root, args.name, tier=args.tier)
    except ScaffoldError as exc:
        console.print(f"[red]fp8rl: {escape(str(exc))}[/red]")
        return EXIT_USAGE
    for f in files:
        console.print(f"wrote {f.relative_to(root)}")
    console.print(f"{len(files)} files; next: fill in every TODO (docs/commands.md, the checklist)")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8rl", description="FP8 rollout numerics: conformance, mutants, perf")
    p.add_argument("--version", action="version", version=f"fp8rl {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    sc = sub.add_parser("scaffold", help="write the skeleton of a new check or engine into the files its checklist names")
    scs = sc.add_subparsers(dest="what", required=True)
    scc = scs.add_parser("check", help="a check, its mutant, and its bound if new")
    scc.add_argument("area", help="the area (conformance/test_<area>.py)")
    scc.add_argument("id", help="the check id, AREA-NAME-00N")
    scc.add_argument("--title", default=None, help="its one sentence of spec")
    scc.add_argument("--bound", default="exact", help="the tolerance-table entry it is judged with (default exact)")
    scc.add_argument("--bound-value", type=float, default=None, help="value of a new bound the table lacks")
    scc.add_argument("--judged", choices=["exact", "bound", "stat"], default=None,
                     help="how it is judged: the test function's suffix")
    scc.add_argument("--requires", action="append", default=None, metavar="CAPABILITY",
                     help="a capability key it needs (repeatable)")
    sce = scs.add_parser("engine", help="an engine adapter, its registry line, vendor file, pinned test, tier run")
    sce.add_argument("name", help="the engine's name (lower-case words joined by '-')")
    sce.add_argument("--tier", default=None, help="add its conformance run to this tier of noxfile.py")
    sc.add_argument("--root", default=".", help="the fp8rl checkout to write into (default: the current directory)")
    sc.set_defaults(func=cmd_scaffold)

    e = sub.add_parser("engines", help="list engines, versions and capabilities (with reasons)")
    e.add_argument("names", nargs="*", help="engines to show (default: built-ins and entry points)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_engines)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--seed", type=int, default=0, help="seed of the fixed-case random inputs (default 0)")
        sp.add_argument("--area", action="append", default=None,
                        help="only this area (formats, quantization, gemm, ...); repeatable")
        sp.add_argument("-k", default=None, help="pytest -k expression to select checks")
        sp.add_argument("-n", "--workers", type=int, default=None, help="pytest-xdist workers")

    c = sub.add_parser("conformance", help="run the conformance checks against an engine")
    c.add_argument("--engine", default="torch", action=_OnceAction,
                   help="built-in name, entry point or pkg.module:factory (default torch); one engine per run")
    c.add_argument("--profile", default="ci", choices=PROFILE_CHOICES)
    c.add_argument("--out", default="fp8rl-report", help="report directory (default ./fp8rl-report)")
    c.add_argument("--xfails", default=None, help="vendor xfails file (default: the packaged one for the engine)")
    c.add_argument("--skips", default=None, help="vendor skips file")
    c.add_argument("--no-isolation", action="store_true",
                   help="run the checks in the pytest process itself (faster start; an engine that crashes or "
                        "hangs in C code then ends the run, and the report is rebuilt from the run journal)")
    c.add_argument("-v", "--verbose", action="store_true", help="print the traceback of an engine-load error")
    c.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="every check's timeout in seconds (default: each check's own); a check that runs longer is "
                        "an error (isolated runs end a hung worker, even one stuck in C code)")
    c.add_argument("--seeds", default=None, metavar="A..B",
                   help="run the whole selection once per seed A..B (inclusive) and write a checks × seeds table "
                        "(sweep.json, sweep.md) under --out; exit 1 if any seed's verdict is not conformant")
    common(c)
    c.set_defaults(func=cmd_conformance)

    m = sub.add_parser("mutants", help="run the suite against every fault-injected engine")
    m.add_argument("--out", default="fp8rl-mutants", help="output directory (default ./fp8rl-mutants)")
    m.add_argument("--only", action="append", default=None, help="only this mutant (repeatable)")
    m.add_argument("--list", action="store_true", help="list mutants (with their declared killers) and exit")
    m.add_argument("--matrix", default="declared", choices=MUTANT_MATRICES,
                   help="run each mutant against its declared killers (default: fast, the contract), its area's "
                        "checks (area) or every check (full: slow; finds new killers)")
    common(m)
    m.set_defaults(func=cmd_mutants)

    k = sub.add_parser("checks", help="list every conformance check with its spec sentence and bound")
    k.add_argument("--json", action="store_true")
    k.add_argument("--area", action="append", default=None, metavar="AREA", help="only this area's checks (repeatable)")
    k.set_defaults(func=cmd_checks)

    # commands contributed by other areas: each module defines register(subparsers) (KV drift, perf, ...)
    import importlib

    for module in EXTRA_COMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.register(sub)
    return p


#: modules that add subcommands (imported only if present in this installation)
EXTRA_COMMAND_MODULES = ("fp8rl.kv_cli", "fp8rl.report_cli", "fp8rl.perf.cli", "fp8rl.presets_cli", "fp8rl.parity",
                         "fp8rl.checkpoint_cli", "fp8rl.repro", "fp8rl.claims", "fp8rl.matrix")


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    restore = None
    if raw[:1] and raw[0] in ("conformance", "mutants"):
        from fp8rl.runner import record_early_signals

        restore = record_early_signals()  # a signal during start-up must still end in an honest report
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
        return int(args.func(args))
    finally:
        if restore is not None:  # called in-process (tests, a wrapper): leave no handler and no remembered signal
            restore()


if __name__ == "__main__":
    sys.exit(main())
