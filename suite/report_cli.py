"""``fp8rl report``: work with report.json files written by earlier runs.

``fp8rl report diff OLD NEW`` lists every check whose outcome changed between two reports (a report.json or the
directory holding it) and exits 1 when one regressed (passed → failed/error, xfailed → error, a check that ran
and is now missing), 0 otherwise: the regression gate of an upgrade.

``fp8rl report compare REPORT... [--unavailable NAME] [--out DIR]`` renders one engine × correction-option table
(:mod:`fp8rl.reports.compare`) as compare.md and a self-contained compare.html; ``--area all`` keeps every check.

``fp8rl report merge REPORT... --out DIR`` puts many report.json files (engines, versions, machines; a directory is
searched for them) into one engine × check matrix (:mod:`fp8rl.reports.merge`): merge.json and a self-contained
merge.html, the checks whose outcome differs between reports first.

``fp8rl report upstream REPORT CHECK-ID[case] [--out FILE]`` writes the Markdown issue for the upstream project of
one failed, errored or xfailed case (:mod:`fp8rl.reports.upstream`); ``fp8rl report findings REPORT... --out DIR``
(or ``--from-xfails``: every entry of fp8rl's vendor xfails files, no report needed) writes findings.md and
findings.html (:mod:`fp8rl.reports.findings`).
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


def cmd_compare(args: argparse.Namespace) -> int:
    from fp8rl.reports import ReportValidationError
    from fp8rl.reports import compare as K

    columns = []
    for path in args.reports:
        try:
            columns.append(K.column_from_report(_load(path), args.area))
        except (FileNotFoundError, ReportValidationError, json.JSONDecodeError) as exc:
            print(f"fp8rl report compare: {exc}")
            return EXIT_USAGE
    rows = K.rows_of(columns)
    for name in args.unavailable:
        from fp8rl.engine import capability_reason
        from fp8rl.registry import EngineLoadError, load_engine

        try:
            eng = load_engine(name)
        except EngineLoadError as exc:
            print(f"fp8rl report compare: --unavailable {name}: {exc}")
            return EXIT_USAGE
        reason = capability_reason(eng, "rollout_correction") or "available here: run it and pass its report"
        columns.append(K.column_unavailable(eng.name, eng.version(), reason, rows))
    if not columns:
        print("fp8rl report compare: expected at least one report.json (or --unavailable NAME)")
        return EXIT_USAGE
    md = K.to_markdown(columns, rows)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(md)
        (out / "compare.html").write_text(K.to_html(columns, rows))
    except OSError as exc:
        print(f"fp8rl report compare: --out {args.out}: {exc}")
        return EXIT_USAGE
    print(md)
    print(f"written: {out / 'compare.md'}, {out / 'compare.html'}")
    return EXIT_OK


def cmd_merge(args: argparse.Namespace) -> int:
    from fp8rl.reports import merge as M

    try:
        merged = M.load_and_merge(args.reports)
    except M.MergeError as exc:
        print(f"fp8rl report merge: {exc}")
        return EXIT_USAGE
    try:
        written = M.write(merged, args.out)
    except OSError as exc:
        print(f"fp8rl report merge: --out {args.out}: {exc}")
        return EXIT_USAGE
    print("\n".join(M.summary_lines(merged)))
    print(f"written: {written[0]}, {written[1]}")
    return EXIT_OK


def _write_text(path: str | None, text: str, what: str) -> int:
    if path is None:
        print(text)
        return EXIT_OK
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as exc:
        print(f"fp8rl report {what}: --out {path}: {exc}")
        return EXIT_USAGE
    print(f"written: {path}")
    return EXIT_OK


def cmd_upstream(args: argparse.Namespace) -> int:
    from fp8rl.reports import ReportValidationError
    from fp8rl.reports.upstream import issue_from_report
    from fp8rl.repro import ReproError

    try:
        p = Path(args.report)
        p = p / "report.json" if p.is_dir() else p
        report = _load(args.report)
        if args.repro is not None and not Path(args.repro).is_dir():
            raise ReproError(f"--repro: expected the folder fp8rl repro wrote, got {args.repro!r}")
        issue = issue_from_report(report, p, args.case, repro_dir=Path(args.repro) if args.repro else None)
    except (FileNotFoundError, ReportValidationError, json.JSONDecodeError, ReproError) as exc:
        print(f"fp8rl report upstream: {exc}")
        return EXIT_USAGE
    return _write_text(args.out, issue.markdown(), "upstream")


def cmd_findings(args: argparse.Namespace) -> int:
    from fp8rl.reports import ReportValidationError
    from fp8rl.reports import findings as F
    from fp8rl.reports.upstream import all_entries

    if not args.reports and not args.from_xfails:
        print("fp8rl report findings: expected at least one report.json (or its directory), or --from-xfails")
        return EXIT_USAGE
    from fp8rl.reports.merge import MergeError, find_reports

    rows = []
    for path in args.reports:
        try:
            for p in find_reports(path):  # a report, a run directory, or a folder of runs (the nightly's)
                rows += F.findings_from_report(_load(str(p)), p)
        except (MergeError, FileNotFoundError, ReportValidationError, json.JSONDecodeError) as exc:
            print(f"fp8rl report findings: {exc}")
            return EXIT_USAGE
    if args.from_xfails:  # an entry a report already shows as a case (same engine, case under its prefix) is not repeated
        seen = [(r.engine, r.check) for r in rows]
        rows += [e for e in F.findings_from_entries(all_entries())
                 if not any(eng == e.engine and check.startswith(e.check) for eng, check in seen)]
    try:
        md, page = F.write(rows, args.out)
    except OSError as exc:
        print(f"fp8rl report findings: --out {args.out}: {exc}")
        return EXIT_USAGE
    print(f"{len(rows)} findings; written: {md}, {page}")
    return EXIT_OK


def cmd_versions(args: argparse.Namespace) -> int:
    """The "findings by version" page over matrices: index.html + findings-by-version.json, each matrix's own page
    copied beside them."""
    from pathlib import Path

    from fp8rl.reports import matrix as R

    matrices: list[tuple[str, dict]] = []
    links: dict[str, str] = {}
    out = Path(args.out)
    try:
        paths = [Path(p) / "matrix.json" if Path(p).is_dir() else Path(p) for p in args.matrices]
        for p in paths:
            m = R.load(p)
            name = p.parent.name if p.name == "matrix.json" else p.stem
            if name in links:
                name = f"{name}-{len(links)}"
            matrices.append((name, m))
            links[name] = f"{name}.html"
    except (OSError, ValueError) as exc:
        print(f"fp8rl report versions: {exc}")
        return EXIT_USAGE
    doc = R.findings_by_version(matrices)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, m in matrices:
            (out / links[name]).write_text(R.to_html(m))
        (out / "index.html").write_text(R.index_html(matrices, links))
        (out / "findings-by-version.json").write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        print(f"fp8rl report versions: --out {args.out}: {exc}")
        return EXIT_USAGE
    changes = sum(len(lib["changes"]) for lib in doc["libraries"])
    print(f"{len(matrices)} matrices, {changes} findings that change across versions; written: {out / 'index.html'}, "
          f"{out / 'findings-by-version.json'}")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="compare report.json files of earlier runs")
    rsub = r.add_subparsers(dest="report_command", required=True)
    d = rsub.add_parser("diff", help="checks whose outcome changed between two reports; exit 1 on a regression")
    d.add_argument("old", help="the baseline report.json (or its directory)")
    d.add_argument("new", help="the report.json to judge (or its directory)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=cmd_diff)
    c = rsub.add_parser("compare", help="engine × correction option table (conformant / deviation / not supported) "
                                        "from several reports; writes compare.md and compare.html")
    c.add_argument("reports", nargs="*", help="report.json files (or their directories), one column each")
    c.add_argument("--unavailable", action="append", default=[], metavar="NAME",
                   help="an engine that cannot run here: a column of 'not run' with its adapter's reason")
    c.add_argument("--area", default="correction", help="the area whose checks are rows ('all': every check)")
    c.add_argument("--out", default="fp8rl-compare", help="directory for compare.md / compare.html")
    c.set_defaults(func=cmd_compare)
    m = rsub.add_parser("merge", help="one engine × check matrix from many reports (engines, versions, machines); "
                                      "writes merge.json and merge.html")
    m.add_argument("reports", nargs="+", help="report.json files, run directories, or folders searched for them")
    m.add_argument("--out", default="fp8rl-merge", help="directory for merge.json / merge.html")
    m.set_defaults(func=cmd_merge)
    u = rsub.add_parser("upstream", help="the Markdown issue for the upstream project of one failed or xfailed case")
    u.add_argument("report", help="report.json (or its directory)")
    u.add_argument("case", help="CHECK-ID[case] of a failed, error or xfailed case")
    u.add_argument("--out", default=None, metavar="FILE", help="write the issue here (default: print it)")
    u.add_argument("--repro", default=None, metavar="DIR",
                   help="the repro folder to attach (default: <report dir>/repro/<case> if fp8rl repro wrote it)")
    u.set_defaults(func=cmd_upstream)
    f = rsub.add_parser("findings", help="findings.md / findings.html: every xfailed or failed case of the reports "
                                         "(engine, version, check, finding, repro command)")
    f.add_argument("reports", nargs="*", help="report.json files, run directories, or folders searched for them")
    f.add_argument("--from-xfails", action="store_true",
                   help="also list every entry of every vendor xfails file fp8rl ships (no report needed)")
    f.add_argument("--out", default="fp8rl-findings", help="directory for findings.md / findings.html")
    f.set_defaults(func=cmd_findings)
    v = rsub.add_parser("versions", help="the 'findings by version' page over fp8rl matrix runs: index.html (a heat "
                                         "map per library) and findings-by-version.json")
    v.add_argument("matrices", nargs="+", help="matrix.json files or the folders holding them")
    v.add_argument("--out", default="fp8rl-versions", help="directory for index.html / findings-by-version.json")
    v.set_defaults(func=cmd_versions)
