"""``fp8rl report``: work with report.json files written by earlier runs.

``fp8rl report diff OLD NEW`` lists every check whose outcome changed between two reports (a report.json or the
directory holding it) and exits 1 when one regressed (passed → failed/error, xfailed → error, a check that ran
and is now missing), 0 otherwise: the regression gate of an upgrade.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fp8rl.exitcodes import EXIT_FAIL as EXIT_REGRESSED
from fp8rl.exitcodes import EXIT_OK, EXIT_USAGE


def _load(path: str) -> dict:
    from fp8rl.reports import load_report

    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path!r}: expected a report.json or a directory holding one")
    return load_report(p)


def cmd_diff(args: argparse.Namespace) -> int:
    from fp8rl.reports import ReportValidationError
    from fp8rl.reports.diff import diff_reports, render_markdown

    try:
        old, new = _load(args.old), _load(args.new)
    except (FileNotFoundError, ReportValidationError, json.JSONDecodeError) as exc:
        print(f"fp8rl report diff: {exc}")
        return EXIT_USAGE
    d = diff_reports(old, new)
    if args.json:
        print(json.dumps(d.as_dict(), indent=2))
    else:
        print(render_markdown([d]))
    return EXIT_REGRESSED if d.regressions else EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="compare report.json files of earlier runs")
    rsub = r.add_subparsers(dest="report_command", required=True)
    d = rsub.add_parser("diff", help="checks whose outcome changed between two reports; exit 1 on a regression")
    d.add_argument("old", help="the baseline report.json (or its directory)")
    d.add_argument("new", help="the report.json to judge (or its directory)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=cmd_diff)
