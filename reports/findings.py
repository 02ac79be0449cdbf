"""Every finding in one table: ``fp8rl report findings REPORT... --out DIR [--from-xfails]``.

A row per failed, errored or xfailed case of the given reports (engine, version, check, the finding in one line,
the command that writes its standalone reproduction), or, with ``--from-xfails``, a row per entry of every vendor
xfails file fp8rl ships (no report needed; the version from the tier lock that pins the library). Writes
``findings.md`` and a self-contained ``findings.html`` (inline CSS, no script, a Content-Security-Policy that
forbids every external load). Each row's issue for the upstream project: ``fp8rl report upstream``.
"""

from __future__ import annotations

import html
import shlex
from dataclasses import dataclass
from pathlib import Path

from .upstream import Entry, lock_versions, message_line, one_line, upstream_of


@dataclass(frozen=True)
class Finding:
    engine: str
    project: str
    version: str
    check: str
    outcome: str
    finding: str
    repro: str


def findings_from_report(report: dict, report_path: Path) -> list[Finding]:
    """The failed, errored and xfailed cases of one report."""
    from fp8rl.repro import REPRODUCIBLE, case_label

    name = str(report["engine"]["name"])
    out = []
    for c in report["checks"]:
        if c["outcome"] not in REPRODUCIBLE:
            continue
        msg = str(c.get("message", ""))
        reason = msg.removeprefix("vendor xfail: ").split("\n", 1)[0] if msg.startswith("vendor xfail: ") else ""
        text = one_line(reason) if reason else (message_line(msg) or c["outcome"])
        up, _ = upstream_of(name, reason)
        label = case_label(c)
        out.append(Finding(name, up.project if up else "", str(report["engine"].get("version", "")), label,
                           c["outcome"], text,
                           f"fp8rl repro {shlex.quote(str(report_path.parent))} {shlex.quote(label)}"))
    return out


def findings_from_entries(entries: list[Entry], root: Path | None = None) -> list[Finding]:
    """A row per vendor xfails entry (versions from the locks)."""
    out = []
    versions: dict[str, str] = {}
    for e in entries:
        if e.engine not in versions:
            pins, note = lock_versions(e.engine, root)
            versions[e.engine] = "; ".join(pins) or note
        up, _ = upstream_of(e.engine, e.reason, e.header)
        k = e.prefix if e.prefix.count("[") == e.prefix.count("]") else e.prefix.split("[", 1)[0]
        out.append(Finding(e.engine, up.project if up else "", versions[e.engine], e.prefix, "xfail entry",
                           one_line(e.reason),
                           f"fp8rl conformance --engine {e.engine} -k {shlex.quote(k)} --out R && fp8rl repro R "
                           f"'<case>'"))
    return out


COLUMNS = ("engine", "project", "version", "check", "outcome", "finding", "repro")


def to_markdown(rows: list[Finding], title: str) -> str:
    def cell(v: str) -> str:
        return v.replace("|", "\\|").replace("\n", " ")

    lines = [f"# {title}", "", f"{len(rows)} findings.", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(cell(getattr(r, c)) if c != "repro" else f"`{cell(r.repro)}`"
                                       for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def to_html(rows: list[Finding], title: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{'<code>' if c == 'repro' else ''}{html.escape(getattr(r, c))}"
                                    f"{'</code>' if c == 'repro' else ''}</td>" for c in COLUMNS) + "</tr>\n"
                   for r in rows)
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'\">"
            f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:1em}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;"
            "font-size:13px}code{font-size:12px}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{len(rows)} findings.</p><table><tr>{head}</tr>\n{body}</table>"
            "</body></html>\n")


def write(rows: list[Finding], out: str | Path, title: str = "fp8rl findings") -> tuple[Path, Path]:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    md, page = d / "findings.md", d / "findings.html"
    md.write_text(to_markdown(rows, title))
    page.write_text(to_html(rows, title))
    return md, page


__all__ = ["Finding", "findings_from_entries", "findings_from_report", "to_html", "to_markdown", "write"]
