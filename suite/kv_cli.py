"""``fp8rl kv-drift``: run the KV-scale drift simulator and print its per-step table (optionally a report dir).

    fp8rl kv-drift                         # default config, oracle FP8 attention, strategy B
    fp8rl kv-drift --strategy A --every 4  # engine-side first-batch scales, recalibrate every 4 steps
    fp8rl kv-drift --engine torch --out kv-drift-report   # through an engine; report.html with the plots

Exit codes: 0 when per-step recalibration holds the bound at every step, 1 when it does not, 2 on a usage or
engine-load error. (Whether *never* recalibrating degrades is reported, not gated: it depends on the config.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE

#: :class:`fp8rl.reference.drift.DriftConfig`'s defaults, restated here so that building the CLI's parser does not
#: import torch (every ``fp8rl`` command builds it; tests/oracle/test_kv_drift.py checks they are DriftConfig's)
DRIFT_DEFAULTS: dict[str, Any] = {"steps": 24, "every_n": 5, "fmt": "e4m3fn", "layout": "tensor", "growth": 0.07,
                                  "grow_steps": 16, "shrink": 0.04, "seed": 0}


def register(subparsers: Any) -> None:
    """Add the ``kv-drift`` subcommand (called by fp8rl.cli for every module in EXTRA_COMMAND_MODULES)."""
    from types import SimpleNamespace

    d = SimpleNamespace(**DRIFT_DEFAULTS)
    p = subparsers.add_parser("kv-drift", help="KV-scale drift simulator: never vs every-step vs every-N "
                                               "recalibration of FP8 Q/K/V scales over RL-like steps")
    p.add_argument("--steps", type=int, default=d.steps, help=f"RL steps (default {d.steps})")
    p.add_argument("--every", type=int, default=d.every_n, help=f"N of the every-N schedule (default {d.every_n})")
    p.add_argument("--strategy", default="B", choices=("A", "B", "C", "engine_first_batch", "trainer_p999", "amax"),
                   help="calibration strategy: A engine-side first batch / (200,200,100), B trainer-side "
                        "1.05·p99.9/448 (default), C amax/448")
    p.add_argument("--fmt", default=d.fmt, choices=("e4m3fn", "e5m2"), help="KV cache format (Q is e4m3fn)")
    p.add_argument("--layout", default=d.layout, choices=("tensor", "head"), help="scale layout (head needs C)")
    p.add_argument("--growth", type=float, default=d.growth, help=f"per-step log growth (default {d.growth})")
    p.add_argument("--grow-steps", type=int, default=d.grow_steps, help=f"growth steps (default {d.grow_steps})")
    p.add_argument("--shrink", type=float, default=d.shrink, help=f"per-step log shrink after (default {d.shrink})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--engine", default=None, help="run FP8 attention through this engine (kv_update_scales + "
                                                  "kv_forward) instead of the oracle")
    p.add_argument("--out", default=None, help="write report.json/.html/.md/junit.xml with the table and plots here")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    p.set_defaults(func=cmd_kv_drift)


def _config(args: argparse.Namespace):
    from fp8rl.reference.drift import DriftConfig

    return DriftConfig(steps=args.steps, every_n=args.every, strategy=args.strategy, fmt=args.fmt, layout=args.layout,
                       growth=args.growth, grow_steps=args.grow_steps, shrink=args.shrink, seed=args.seed)


def cmd_kv_drift(args: argparse.Namespace) -> int:
    from fp8rl.reference import drift
    from rich.console import Console

    console = Console(highlight=False)
    console.width = max(console.width, 140)
    try:
        cfg = _config(args)
    except ValueError as exc:
        console.print(f"[red]fp8rl kv-drift: {exc}[/red]")
        return EXIT_USAGE
    backend = None
    engine_name = "reference"
    if args.engine:
        from fp8rl.registry import EngineLoadError, load_engine

        try:
            eng = load_engine(args.engine)
        except EngineLoadError as exc:
            console.print(f"[red]fp8rl kv-drift: {exc}[/red]")
            return EXIT_USAGE
        missing = [k for k in ("kv.update_scales",) if eng.capabilities().get(k) is not True]
        if missing:
            console.print(f"[red]fp8rl kv-drift: engine {eng.name!r} lacks {missing}: "
                          f"{[eng.capabilities().get(k) for k in missing]}[/red]")
            return EXIT_USAGE
        backend = drift.EngineBackend(eng, cfg.fmt, cfg.layout, "kv-drift")
        engine_name = eng.name
    t0 = time.perf_counter()
    started = datetime.now(UTC).isoformat()
    result = drift.simulate(cfg, backend=backend)
    wall = time.perf_counter() - t0
    holds = result.holds("every-step")
    section = result.to_section(f"KV-scale drift ({engine_name})")
    if args.json:
        print(json.dumps({"summary": result.summary(), "table": section["table"], "config": section["config"],
                          "every_step_holds": holds, "wall_s": wall}, indent=2))
    else:
        _print_tables(console, result, wall)
    if args.out:
        paths = _write_report(result, section, Path(args.out), engine_name, started, wall, args.seed)
        if not args.json:
            console.print(f"report: {paths['html']}")
    return EXIT_OK if holds else EXIT_FAIL


def _print_tables(console: Any, result: Any, wall: float) -> None:
    from rich.table import Table

    names = list(result.schedules)
    table = Table(title=f"KV-scale drift: {result.config.steps} steps, strategy {result.config.strategy}, "
                        f"{result.config.fmt} ({wall:.1f} s)", title_justify="left", pad_edge=False)
    table.add_column("step", justify="right")
    table.add_column("K amax", justify="right")
    for n in names:
        lab = result.label(n)
        for col in ("sat", "attn/b", "lp/b"):
            table.add_column(f"{lab}\n{col}", justify="right")
    table.add_column("fresh\nattn", justify="right")
    table.add_column("fresh\nlp", justify="right")
    for t in range(len(result.fresh)):
        ab, lb = result.attn_bound(t), result.lp_bound(t)
        row = [str(t), f"{result.k_amax[t]:.3g}"]
        for n in names:
            r = result.schedules[n][t]
            mark = "*" if r.recalibrated else ""
            row.append(f"{100 * r.saturation:.2f}%")
            for val, bound in ((r.attn_err, ab), (r.logprob_div, lb)):
                txt = f"{val / bound:.2f}"
                row.append(f"[red]{txt}[/red]" if val > bound else txt + (mark if bound is ab else ""))
        row += [f"{result.fresh[t].attn_err:.3g}", f"{result.fresh[t].logprob_div:.3g}"]
        table.add_row(*row)
    console.print(table)
    console.print(f"sat = saturated fraction of Q/K/V; attn/b, lp/b = attention error and log-prob divergence over "
                  f"their bound (κ_attn={result.kappa_attn:g}, κ_lp={result.kappa_lp:g} × the fresh-amax FP8 "
                  "error, columns fresh); red = over the bound; * = scales recalibrated at this step")
    summ = Table(title="summary", title_justify="left")
    for col in ("schedule", "violating steps", "max saturation", "max attn err", "max lp div", "max KL"):
        summ.add_column(col)
    for name, s in result.summary().items():
        summ.add_row(name, str(s["violations"]), f"{s['max_saturation']:.3%}", f"{s['max_attn_err']:.3g}",
                     f"{s['max_logprob_div']:.3g}", f"{s['max_kl']:.3g}")
    console.print(summ)
    verdict = "[green]holds[/green]" if result.holds("every-step") else "[red]VIOLATES[/red]"
    never = len(result.violations("never")) if "never" in result.schedules else 0
    console.print(f"per-step recalibration {verdict} the bound; never recalibrating violates it at {never} of "
                  f"{len(result.fresh)} steps")


def _write_report(result: Any, section: dict, out: Path, engine_name: str, started: str, wall: float,
                  seed: int) -> dict[str, Path]:
    import fp8rl
    from fp8rl.environment import environment
    from fp8rl.reports import SCHEMA_VERSION, summarize, write_report

    report = {
        "schema_version": SCHEMA_VERSION, "suite": {"name": "fp8rl", "version": fp8rl.__version__},
        "kind": "conformance",
        "engine": {"name": engine_name, "version": fp8rl.__version__, "capabilities": {}},
        "environment": environment(), "profile": "kv-drift", "seed": seed, "started_at": started,
        "duration_s": round(wall, 3), "command": sys.argv, "summary": summarize([]), "checks": [],
        "sections": {"kv_drift": section},
    }
    return write_report(report, out)


__all__ = ["cmd_kv_drift", "register"]
