"""Many conformance reports in one engine × check matrix (``fp8rl report merge REPORT... --out DIR``).

The inputs may come from different engines, engine versions or machines (a CI matrix uploads one report.json per
job; the suite does not schedule machines itself). Each report is a **column**, labelled by its engine and version,
with the machine it ran on (CPU model and count, GPUs, torch build) and when. Each check id is a **row**; a
parametrized check's cases are folded into one cell whose outcome is the worst of its cases, in the order

    error > failed > not_run > xpassed > xfailed > passed > skipped

(a failing case is never hidden by passing ones; a stale vendor xfail — ``xpassed`` — outranks a known deviation),
with the per-outcome case counts and the worst case's message kept. A row **differs** when the columns that have it
do not all agree on the outcome: the rows to look at first when a vendor upgrade or a new machine changes something.

Writes ``merge.json`` (columns, rows, cells) and ``merge.html``: self-contained (inline CSS, no script, a
Content-Security-Policy that forbids every external load), the differing rows first, then the full matrix.
"""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: a cell's outcome is the first of these its cases have
SEVERITY: tuple[str, ...] = ("error", "failed", "not_run", "xpassed", "xfailed", "passed", "skipped")
SYMBOL = {"error": "E", "failed": "✗", "not_run": "·", "xpassed": "XP", "xfailed": "xf", "passed": "✓",
          "skipped": "s"}
ABSENT = "absent"


class MergeError(ValueError):
    """An input that is no conformance report (or a path that holds none)."""


@dataclass(frozen=True)
class Column:
    """One report: who ran (engine, version), where (machine), when, and how it ended."""

    key: str
    engine: str
    version: str
    machine: str
    started_at: str
    profile: str
    seed: int | None
    verdict: str
    summary: dict[str, Any]
    source: str
    git_commit: str = ""
    partial: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "engine": self.engine, "version": self.version, "machine": self.machine,
                "started_at": self.started_at, "profile": self.profile, "seed": self.seed, "verdict": self.verdict,
                "summary": self.summary, "source": self.source, "git_commit": self.git_commit,
                "partial": self.partial}


@dataclass(frozen=True)
class Cell:
    outcome: str  # one of SEVERITY, or ABSENT (the report has no such check)
    counts: dict[str, int] = field(default_factory=dict)
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "counts": self.counts, "message": self.message}


@dataclass
class Row:
    check: str
    area: str
    title: str
    cells: dict[str, Cell]  # column key -> cell

    @property
    def differs(self) -> bool:
        """True when the columns that ran this check do not all have the same outcome."""
        return len({c.outcome for c in self.cells.values() if c.outcome != ABSENT}) > 1

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "area": self.area, "title": self.title, "differs": self.differs,
                "cells": {k: c.as_dict() for k, c in self.cells.items()}}


@dataclass
class Merged:
    columns: list[Column]
    rows: list[Row]

    @property
    def differing(self) -> list[Row]:
        return [r for r in self.rows if r.differs]

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "merge", "severity_order": list(SEVERITY), "columns": [c.as_dict() for c in self.columns],
                "rows": [r.as_dict() for r in self.rows], "differing_rows": len(self.differing)}


# ---------------------------------------------------------------------------------------------------------------
# inputs


def find_reports(path: str | Path) -> list[Path]:
    """The report.json files a command-line argument names: the file itself, the report.json in a run directory, or
    every ``**/report.json`` under a folder of runs (e.g. a CI job's downloaded artifacts), sorted."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        if (p / "report.json").is_file():
            return [p / "report.json"]
        found = sorted(q for q in p.rglob("report.json") if q.is_file())
        if found:
            return found
        raise MergeError(f"{str(path)!r}: a directory with no report.json in it or below it")
    raise MergeError(f"{str(path)!r}: expected a report.json, a run directory or a folder of runs; it does not exist")


def machine_of(report: dict[str, Any]) -> str:
    """Where a report ran, in words: GPUs (or the CPU model × logical CPUs), then the torch build."""
    env = report.get("environment") or {}
    gpus = env.get("gpus") or []
    names = [g.get("name", "?") if isinstance(g, dict) else str(g) for g in gpus]
    if names:
        where = ", ".join(f"{n} ×{k}" if k > 1 else n for n, k in Counter(names).items())
    else:
        cpu = env.get("cpu") or env.get("machine") or "unknown CPU"
        where = f"{cpu} ×{env['cpu_count']}" if env.get("cpu_count") else str(cpu)
    torch_v = env.get("torch")
    return f"{where}; torch {torch_v}" if torch_v else where


def _one_line(text: str, limit: int = 200) -> str:
    s = re.sub(r"\s+", " ", (text or "").strip())
    return s if len(s) <= limit else s[: limit - 1].rstrip() + "…"


def fold(cases: list[dict[str, Any]]) -> Cell:
    """One cell from a check's cases (see the module docstring)."""
    counts = Counter(c["outcome"] for c in cases)
    worst = min(counts, key=lambda o: SEVERITY.index(o) if o in SEVERITY else len(SEVERITY))
    message = next((c.get("message") or "" for c in cases if c["outcome"] == worst and c.get("message")), "")
    case = next((c.get("case") for c in cases if c["outcome"] == worst and c.get("case")), "")
    if case and message and len(cases) > 1:
        message = f"[{case}] {message}"
    return Cell(worst, dict(sorted(counts.items(), key=lambda kv: SEVERITY.index(kv[0]) if kv[0] in SEVERITY else 99)),
                _one_line(message))


def merge(reports: list[tuple[str, dict[str, Any]]]) -> Merged:
    """Merge (source, report dict) pairs, in the order given, into one matrix. Raises MergeError for a report that is
    not a conformance report (a mutants report has no per-engine outcomes to compare)."""
    if not reports:
        raise MergeError("reports: expected at least one report.json")
    columns: list[Column] = []
    per_column: list[dict[str, list[dict[str, Any]]]] = []
    meta: dict[str, tuple[str, str]] = {}
    order: list[str] = []
    seen_keys: Counter[str] = Counter()
    for source, rep in reports:
        if rep.get("kind") != "conformance":
            raise MergeError(f"{source}: a {rep.get('kind')!r} report; merge takes conformance reports")
        eng = rep.get("engine") or {}
        env = rep.get("environment") or {}
        machine = machine_of(rep)
        base = f"{eng.get('name', '?')} {eng.get('version', '')}".strip() + f" @ {machine}"
        seen_keys[base] += 1
        key = base if seen_keys[base] == 1 else f"{base} #{seen_keys[base]}"
        summary = rep.get("summary") or {}
        columns.append(Column(key=key, engine=str(eng.get("name", "?")), version=str(eng.get("version", "")),
                              machine=machine, started_at=str(rep.get("started_at", "")),
                              profile=str(rep.get("profile", "")), seed=rep.get("seed"),
                              verdict=str(summary.get("verdict", "")), summary=summary, source=source,
                              git_commit=str(env.get("git_commit") or ""), partial=bool(summary.get("partial"))))
        checks: dict[str, list[dict[str, Any]]] = {}
        for c in rep.get("checks", []):
            cid = str(c["id"])
            checks.setdefault(cid, []).append(c)
            if cid not in meta:
                meta[cid] = (str(c.get("area", "")), str(c.get("title", "")))
                order.append(cid)
        per_column.append(checks)
    area_rank = {a: i for i, a in enumerate(dict.fromkeys(meta[c][0] for c in order))}
    rows = []
    for cid in sorted(order, key=lambda c: (area_rank[meta[c][0]], c)):
        cells = {col.key: (fold(cs[cid]) if cid in cs else Cell(ABSENT)) for col, cs in zip(columns, per_column)}
        rows.append(Row(cid, meta[cid][0], meta[cid][1], cells))
    return Merged(columns, rows)


def load_and_merge(paths: list[str]) -> Merged:
    """``fp8rl report merge``'s inputs: every report the paths name (:func:`find_reports`), validated, merged."""
    from fp8rl.reports import ReportValidationError, load_report

    reports = []
    for path in paths:
        for p in find_reports(path):
            try:
                reports.append((str(p), load_report(p)))
            except (ReportValidationError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise MergeError(f"{p}: {exc}") from None
    return merge(reports)


# ---------------------------------------------------------------------------------------------------------------
# outputs

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#1b1b1b}table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ccc;padding:3px 5px;vertical-align:top}thead th{background:#f2f2f2;position:sticky;top:0}
th.check{text-align:left;font-weight:normal;white-space:nowrap}tr.area th{background:#e9eef7;text-align:left}
td{text-align:center;white-space:nowrap}.passed{background:#e7f6e7}.failed,.error{background:#fbd3d3;font-weight:bold}
.xfailed{background:#fff1cc}.xpassed{background:#ffd9a8;font-weight:bold}.skipped{background:#f4f4f4;color:#666}
.not_run{background:#eee;color:#999}.absent{color:#bbb}small{color:#555}.legend span{padding:1px 6px;margin-right:4px}
details{margin-top:1.5em}summary{cursor:pointer;font-weight:bold}"""


def _cell_html(cell: Cell) -> str:
    e = html.escape
    if cell.outcome == ABSENT:
        return "<td class='absent'>—</td>"
    n = sum(cell.counts.values())
    text = SYMBOL.get(cell.outcome, cell.outcome)
    if n > 1:
        text += f" <small>{cell.counts.get(cell.outcome, 0)}/{n}</small>"
    tip = ", ".join(f"{k} {v}" for k, v in cell.counts.items()) + (f" — {cell.message}" if cell.message else "")
    return f"<td class='{e(cell.outcome)}' title='{e(tip, quote=True)}'>{text}</td>"


def _matrix_html(columns: list[Column], rows: list[Row]) -> str:
    e = html.escape
    out = ["<table><thead><tr><th>check</th>"]
    out += [f"<th>{e(c.engine)}<br><small>{e(c.version)}</small><br><small>{e(c.machine)}</small></th>"
            for c in columns]
    out.append("</tr></thead><tbody>")
    area = None
    for r in rows:
        if r.area != area:
            area = r.area
            out.append(f"<tr class='area'><th colspan='{len(columns) + 1}'>{e(area or '(no area)')}</th></tr>")
        out.append(f"<tr><th class='check' title='{e(r.title, quote=True)}'>{e(r.check)}</th>")
        out += [_cell_html(r.cells[c.key]) for c in columns]
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def to_html(m: Merged) -> str:
    e = html.escape
    title = f"fp8rl conformance across {len(m.columns)} report(s)"
    P = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'">',
         f"<title>{e(title)}</title><style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
         "<p>One column per report.json (engine, version, machine), one row per check; a parametrized check's "
         "cases are folded into one cell, the worst outcome first (" + " &gt; ".join(SEVERITY) + "), with the count "
         "of cases that had it. Hover a cell for its counts and message. From <code>fp8rl report merge</code>.</p>",
         "<p class='legend'>" + "".join(f"<span class='{o}' style='display:inline-block'>{e(SYMBOL[o])} {o}</span>"
                                        for o in SEVERITY) + "<span>— absent from the report</span></p>",
         "<h2>Reports</h2><table><thead><tr><th>#</th><th>engine</th><th>version</th><th>machine</th><th>started</th>"
         "<th>profile / seed</th><th>verdict</th><th>passed</th><th>failed</th><th>error</th><th>skipped</th>"
         "<th>xfailed</th><th>xpassed</th><th>source</th></tr></thead><tbody>"]
    for i, c in enumerate(m.columns, 1):
        s = c.summary
        verdict = c.verdict + (" (partial run)" if c.partial else "")
        P.append(f"<tr><td>{i}</td><td>{e(c.engine)}</td><td>{e(c.version)}</td><td>{e(c.machine)}</td>"
                 f"<td>{e(c.started_at[:19])}</td><td>{e(c.profile)} / {e(str(c.seed))}</td><td>{e(verdict)}</td>"
                 + "".join(f"<td>{int(s.get(k, 0))}</td>" for k in ("passed", "failed", "error", "skipped",
                                                                     "xfailed", "xpassed"))
                 + f"<td><small>{e(c.source)}</small></td></tr>")
    P.append("</tbody></table>")
    diff = m.differing
    P.append(f"<h2>Checks whose outcome differs between reports ({len(diff)})</h2>")
    P.append(_matrix_html(m.columns, diff) if diff else "<p>None: every check has the same outcome in every report "
                                                       "that ran it.</p>")
    P.append(f"<details><summary>All {len(m.rows)} checks</summary>{_matrix_html(m.columns, m.rows)}</details>")
    P.append("</body></html>")
    return "\n".join(P) + "\n"


def summary_lines(m: Merged) -> list[str]:
    """What ``fp8rl report merge`` prints: one line per report, then the differing rows."""
    lines = [f"{len(m.columns)} report(s), {len(m.rows)} checks, {len(m.differing)} differ between reports:"]
    for i, c in enumerate(m.columns, 1):
        s = c.summary
        lines.append(f"  [{i}] {c.key}: {c.verdict}{' (partial)' if c.partial else ''} — passed {s.get('passed', 0)}, "
                     f"failed {s.get('failed', 0)}, error {s.get('error', 0)}, skipped {s.get('skipped', 0)}, "
                     f"xfailed {s.get('xfailed', 0)}, xpassed {s.get('xpassed', 0)}")
    for r in m.differing:
        lines.append(f"  {r.check}: " + "  ".join(f"[{i}] {r.cells[c.key].outcome}"
                                                  for i, c in enumerate(m.columns, 1)))
    return lines


def write(m: Merged, out: str | Path) -> tuple[Path, Path]:
    """merge.json and merge.html in ``out`` (created)."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    j, h = d / "merge.json", d / "merge.html"
    j.write_text(json.dumps(m.as_dict(), indent=2) + "\n")
    h.write_text(to_html(m))
    return j, h


__all__ = ["ABSENT", "SEVERITY", "Cell", "Column", "MergeError", "Merged", "Row", "find_reports", "fold",
           "load_and_merge", "machine_of", "merge", "summary_lines", "to_html", "write"]
