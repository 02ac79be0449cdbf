"""Terminal summary of a report (rich)."""

from __future__ import annotations

from typing import Any

from ._plots import check_label, outcomes_by_area
from ._render import first_line
from ._schema import OUTCOMES, verdict_line

_STYLE = {"passed": "green", "failed": "bold red", "error": "bold red", "skipped": "dim",
          "xfailed": "magenta", "xpassed": "bold blue", "not_run": "bold yellow"}
_MAX_LISTED = 30


def print_summary(report: dict, console: Any = None) -> None:
    """Print a per-area outcome table, the verdict line and the failing checks (id + first message line).

    ``console`` is a ``rich.console.Console`` (a default one on stdout when None). User strings are printed
    as plain ``Text``, never interpreted as rich markup.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    checks, s, eng = report["checks"], report["summary"], report["engine"]
    table = Table(title=Text(f"fp8rl {report['kind']} — {eng['name']} {eng['version']}".rstrip()), title_justify="left")
    table.add_column("area")
    for o in OUTCOMES:
        table.add_column(o, justify="right", style=_STYLE[o])
    table.add_column("total", justify="right")
    areas = outcomes_by_area(checks)
    for area, cnt in areas.items():
        table.add_row(Text(area), *(str(cnt.get(o, 0)) for o in OUTCOMES), str(sum(cnt.values())))
    table.add_section()
    table.add_row(Text("all", style="bold"), *(str(s.get(o, 0)) for o in OUTCOMES), str(s["total"]))
    console.print(table)

    style = {"conformant": "bold green", "incomplete": "bold yellow"}.get(s["verdict"], "bold red")
    line = Text("verdict: ", style="bold")
    line.append(verdict_line(report), style=style)
    line.append(f"  ({s['failed']} failed, {s['error']} error, {s['skipped']} skipped, "
                f"{s['xfailed']} xfailed, {s['xpassed']} xpassed"
                + (f", {s['not_run']} not run" if s.get("not_run") else "")
                + f" of {s['total']}; profile {report['profile']}, seed {report['seed']}, "
                f"{report['duration_s']:.1f} s)")
    console.print(line)
    scope = s.get("scope")
    if scope is not None:
        print_scope(scope, console)
    if report["kind"] == "mutants":
        muts = report.get("mutants") or []
        killed = sum(1 for m in muts if m["killed"])
        console.print(Text(f"mutation score: {report['mutation_score']:.1%} ({killed}/{len(muts)} killed)",
                           style="bold"))
        for m in muts:
            if not m["killed"]:
                console.print(Text(f"  survived: {m['mutant']}: {first_line(m['description'])}", style="yellow"))
    bad = [c for c in checks if c["outcome"] in ("failed", "error", "xpassed", "not_run")]
    if bad:
        console.print(Text("failing checks:", style="bold red"))
        for c in bad[:_MAX_LISTED]:
            t = Text("  ")
            t.append(check_label(c), style="bold")
            t.append(f" [{c['outcome']}] ", style=_STYLE[c["outcome"]])
            t.append(first_line(c["message"]))
            console.print(t, overflow="ellipsis", no_wrap=True)
        if len(bad) > _MAX_LISTED:
            console.print(Text(f"  ... and {len(bad) - _MAX_LISTED} more (see report.md)"))


def print_scope(scope: dict, console: Any) -> None:
    """The run's scope under the verdict: cases that ran the engine's own code, the oracle's inherited code, or were
    refused; each untested declared capability with why; each capability with refused cases and the first refusal."""
    from rich.text import Text

    from ._schema import capability_status

    console.print(Text(f"scope: {scope['engine_cases']} cases ran the engine's own code, {scope['oracle_cases']} "
                       f"only the oracle's inherited code (not counted), {scope['refused_cases']} refused by the "
                       "engine", style="bold"))
    for key in scope["untested"]:
        r = scope["capabilities"][key]
        why = capability_status(r).removeprefix("UNTESTED: ")
        if r["refused"] == r["cases"] and r["refusals"]:
            why += f": {r['refusals'][0]}"
        console.print(Text(f"  UNTESTED {key}: {r['cases']} cases, {why}", style="bold yellow"),
                      overflow="ellipsis", no_wrap=True)
    for key, r in scope["capabilities"].items():
        if r["refused"] and key not in scope["untested"]:
            console.print(Text(f"  refused {r['refused']} of {r['cases']} cases of {key}: "
                               f"{r['refusals'][0] if r['refusals'] else ''}", style="yellow"),
                          overflow="ellipsis", no_wrap=True)
