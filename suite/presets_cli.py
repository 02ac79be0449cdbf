"""``fp8rl presets``: every ScalePolicy preset with its formula, provenance and verification status; and the
record of the presets an engine declares, which every conformance report carries (report.json ``engine.presets``).

The presets, their :class:`~fp8rl.reference.presets.Provenance` and :class:`~fp8rl.reference.presets.Verification`
live in :mod:`fp8rl.reference.presets`; this module only shows them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fp8rl.exitcodes import EXIT_OK, EXIT_USAGE


def declared_presets(engine: Any) -> dict[str, dict[str, Any]]:
    """granularity kind → the preset the engine declares for it (name, formula, provenance, verification status),
    for every ``quantize.<kind>`` the engine supports. A policy that is not a preset (or differs from the preset of
    its name) has provenance None and says so."""
    from fp8rl.reference.presets import PRESETS, PROVENANCE, VERIFICATION, formula
    from fp8rl.reference.quant import GRANULARITY_KINDS

    caps = engine.capabilities()
    out: dict[str, dict[str, Any]] = {}
    for kind in GRANULARITY_KINDS:
        if caps.get(f"quantize.{kind}") is not True:
            continue
        try:
            policy = engine.scale_policy(kind)
        except Exception:  # noqa: BLE001 - an engine that declares no policy for a kind has nothing to record
            continue
        name = getattr(policy, "name", None)
        if not isinstance(name, str):
            continue
        if PRESETS.get(name) == policy:
            out[kind] = {"preset": name, "formula": formula(policy), "provenance": PROVENANCE[name].as_dict(),
                         "verification": VERIFICATION[name].status}
        else:
            out[kind] = {"preset": name, "formula": formula(policy), "provenance": None,
                         "verification": "not a preset of fp8rl.reference.presets (the engine's own policy)"}
    return out


def cmd_presets(args: argparse.Namespace) -> int:
    from fp8rl.cli import _console
    from fp8rl.reference.presets import PRESETS, get_policy, preset_record
    from rich.markup import escape
    from rich.table import Table

    names = args.names or list(PRESETS)
    try:
        records = [preset_record(get_policy(n).name) if n in PRESETS else preset_record(n) for n in names]
    except ValueError as exc:
        print(f"fp8rl presets: {exc}")
        return EXIT_USAGE
    if args.json:
        print(json.dumps(records, indent=2))
        return EXIT_OK
    console = _console()
    table = Table(title="fp8rl ScalePolicy presets", show_lines=True)
    for col in ("preset", "formula", "upstream", "status"):
        table.add_column(col, overflow="fold")
    for r in records:
        p = r["provenance"]
        upstream = f"{p['repo']} {p['file']} {p['function']} @ {p['version']} ({p['date']})"
        status = r["verification"]["status"]
        style = "green" if r["verification"]["verified"] else "yellow"
        table.add_row(r["name"], escape(r["formula"]), escape(upstream), f"[{style}]{escape(status)}[/{style}]")
    console.print(table)
    verified = sum(r["verification"]["verified"] for r in records)
    console.print(f"{len(records)} presets: {verified} verified on CPU, {len(records) - verified} not verifiable on CPU")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="ScalePolicy presets: formula, provenance, verification status")
    p.add_argument("names", nargs="*", help="presets to show (default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_presets)
