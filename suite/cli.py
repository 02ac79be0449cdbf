"""``fp8rl`` command line. Exit codes: :mod:`fp8rl.exitcodes`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from fp8rl.runner import MUTANT_MATRICES
from fp8rl.strategies import RUN_PROFILES
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
    rows = []
    names = [n for n, src in available_engines().items() if src != "mutant"] if not args.names else args.names
    for name in names:
        try:
            eng = load_engine(name)
            rows.append({"name": name, "version": eng.version(), "description": getattr(eng, "description", ""),
                         "capabilities": {k: (v if v is True else str(v)) for k, v in eng.capabilities().items()}})
        except EngineLoadError as exc:
            rows.append({"name": name, "version": "-", "description": "", "capabilities": {}, "error": str(exc)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for row in rows:
        table = Table(title=escape(f"{row['name']}  ({row['version']})"), title_justify="left", show_lines=False)
        table.add_column("area")
        table.add_column("capability")
        table.add_column("status")
        if "error" in row:
            table.add_row("", "load", f"[red]{escape(str(row['error']))}[/red]")
        for key, cap in CAPABILITIES.items():  # every key of the table, area by area
            status = row["capabilities"].get(key)
            shown = ("[green]available[/green]" if status is True else "[dim]not declared[/dim]" if status is None
                     else f"[yellow]no:[/yellow] {escape(str(status))}")
            table.add_row(cap.area, key, shown)
        console.print(table)
        if row["description"]:
            console.print(f"  {escape(row['description'])}\n")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------------------------
_DEFAULT = object()


def _run(engines: list[str], args: argparse.Namespace, out: Path, profile: str, *, areas=_DEFAULT,
         extra: list[str] | None = None) -> int:
    from fp8rl.runner import pytest_args, run_pytest

    pa = pytest_args(engines, profile=profile, out_dir=out, seed=args.seed, xfails=getattr(args, "xfails", None),
                     skips=getattr(args, "skips", None), areas=args.area if areas is _DEFAULT else areas,
                     keyword=args.k, workers=args.workers, extra=extra)
    return run_pytest(pa)


def cmd_conformance(args: argparse.Namespace) -> int:
    from fp8rl.registry import EngineLoadError, load_engine
    from fp8rl.reports import load_report, print_summary
    from fp8rl.runner import vendor_file

    console = _console()
    try:
        eng = load_engine(args.engine)
    except EngineLoadError as exc:
        console.print(f"[red]fp8rl: {exc}[/red]")
        return EXIT_USAGE
    if args.xfails is None:
        vf = vendor_file(eng.name, "xfails")
        if vf is not None:
            args.xfails = str(vf)
            console.print(f"fp8rl: using the packaged vendor xfails file {vf}")
    for opt in ("xfails", "skips"):
        path = getattr(args, opt)
        if path and not Path(path).is_file():
            console.print(f"[red]fp8rl: --{opt}: file {path!r} does not exist[/red]")
            return EXIT_USAGE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stale = out / "report.json"
    if stale.exists():
        stale.unlink()
    t0 = time.perf_counter()
    code = _run([args.engine], args, out, args.profile)
    wall = time.perf_counter() - t0
    if code in (2, 3, 4) and not stale.exists():
        console.print(f"[red]fp8rl: pytest exited with {code} (interrupted/internal/usage error); no report[/red]")
        return EXIT_USAGE
    if not stale.exists():
        console.print(f"[red]fp8rl: no report was written to {out} (pytest exit {code})[/red]")
        return EXIT_USAGE
    report = load_report(stale)
    if report["summary"]["total"] == 0:
        console.print("[red]fp8rl: no checks ran (selection matched nothing)[/red]")
        return EXIT_USAGE
    print_summary(report, console=console)
    console.print(f"wall time {wall:.1f} s; report: {out}/report.json, report.html, report.md, junit.xml")
    return EXIT_OK if report["summary"]["verdict"] == "conformant" else EXIT_FAIL


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
    from fp8rl.reports import load_report, write_report
    from fp8rl.runner import engine_dir, report_document

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
    out.mkdir(parents=True, exist_ok=True)
    engines = [f"mutant:{n}" for n in names]
    t0 = time.perf_counter()
    code = _run(engines, args, out, "mutants", areas=None if args.matrix == "declared" else args.area,
                extra=["--fp8rl-mutant-matrix", args.matrix])
    wall = time.perf_counter() - t0
    rows, reports = [], []
    for n, e in zip(names, engines):
        path = engine_dir(out, e) / "report.json" if len(engines) > 1 else out / "report.json"
        if not path.exists():
            console.print(f"[red]fp8rl: no report for {e} (pytest exit {code})[/red]")
            return EXIT_USAGE
        reports.append(load_report(path))
        rows.append(_mutant_row(n, reports[-1]))
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
    rows = sorted(CHECKS.values(), key=lambda c: (c.area, c.id))
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

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8rl", description="FP8 rollout numerics: conformance, mutants, perf")
    p.add_argument("--version", action="version", version=f"fp8rl {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

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
EXTRA_COMMAND_MODULES = ("fp8rl.kv_cli", "fp8rl.report_cli", "fp8rl.perf.cli")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
