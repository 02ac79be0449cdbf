"""One table across engines: engine × correction option → conformant / deviation / skipped, from the
report.json files of earlier ``fp8rl conformance`` runs (``fp8rl report compare REPORT... [--unavailable NAME]``).

An *option* is a group of checks (:data:`OPTIONS`, by check id; a check of another area is its own row). A cell
judges the option's checks in that engine's report:

* ``deviation`` — a check failed, errored or is a known deviation (vendor xfail): the cell gives the first such
  check's reason (its xfail reason or failure message), one line;
* ``conformant`` — every check of the option that ran passed (``n/m`` when some were skipped);
* ``skipped`` — every check was skipped: the engine's reason (a missing capability, or the Unsupported message of
  the first option a drawn example asked for that the engine lacks — the check then did not run at all);
* ``—`` — the report has none of the option's checks (another area, or a partial run).

``--unavailable NAME`` adds a column for an engine that cannot run here, every cell ``not run``; the reason its
adapter gives (``fp8rl engines``) is printed once under the table. ``--area`` keeps one area's checks (default
``correction``; ``all`` keeps every check). Writes ``compare.md`` and a self-contained ``compare.html`` (no scripts, no
external resources) and prints the Markdown.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any

#: correction options (rows), each the checks that judge it, in display order
OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("token-level TIS (truncate at U)", ("CORR-TIS-001", "CORR-TIS-004")),
    ("TIS bound under extreme log-probs", ("CORR-TIS-002",)),
    ("sequence-level TIS (product ratio)", ("CORR-TIS-003",)),
    ("token-level IcePop / MIS band [lo, hi]", ("CORR-MIS-001",)),
    ("sequence-level IcePop / MIS band [lo, hi]", ("CORR-MIS-002",)),
    ("MIS with an upper bound only (token / sequence)", ("CORR-SMIS-001",)),
    ("geometric-mean IS", ("CORR-GEO-001",)),
    ("batch normalization of the weights", ("CORR-NORM-001", "CORR-NORM-002")),
    ("rejection sampling k2/k3 (token/seq_sum/seq_mean/seq_max)", ("CORR-RS-001",)),
    ("rejection sampling k1 ratio bounds", ("CORR-RS-002", "CORR-RS-003")),
    ("combined RS options, RS changes the mask only", ("CORR-RS-004", "CORR-RS-005")),
    ("veto (reject a row with any ρ_t < τ)", ("CORR-RS-006",)),
    ("off-policy metrics (KL k1/k3, PPL, χ²)", ("CORR-MET-001",)),
    ("IS metrics (mean, ESS, fractions)", ("CORR-MET-002", "CORR-MET-006")),
    ("RS metrics (masked fractions)", ("CORR-MET-003",)),
    ("probability-space metrics", ("CORR-MET-004", "CORR-MET-005")),
    ("weight min/max/row mean, |δ| mean/max", ("CORR-MET-007",)),
    ("KL estimators unbiased (statistical)", ("CORR-STAT-001",)),
    ("identity, detached weights, invalid inputs", ("CORR-ID-001", "CORR-GRAD-001", "CORR-VAL-001")),
    ("padding and empty rows never contribute", ("CORR-PAD-001", "CORR-PAD-002", "CORR-PAD-003")),
    ("extreme log-probs (beyond the ±20 clamp)", ("CORR-EDGE-001",)),
    ("PPO-clip × w loss", ("CORR-LOSS-001",)),
    ("REINFORCE × w loss", ("CORR-LOSS-002",)),
    ("decoupled PPO: proximal policy approximation", ("CORR-PROX-001",)),
    ("decoupled PPO loss (behaviour weight, proximal clip)", ("CORR-DPPO-001",)),
)

FAILING = ("failed", "error", "xfailed", "xpassed")


@dataclass
class Cell:
    verdict: str  # conformant | deviation | skipped | not run | —
    reason: str = ""
    checks: list[str] = field(default_factory=list)

    def text(self) -> str:
        return f"{self.verdict}: {self.reason}" if self.reason else self.verdict


def one_line(text: str, limit: int = 160) -> str:
    """The first line of a message, without the 'vendor xfail:' prefix, cut at ``limit`` characters."""
    s = (text or "").strip()
    s = s.removeprefix("vendor xfail:").strip()
    s = s.splitlines()[0].strip() if s else ""
    s = re.sub(r"\s+", " ", s)
    return s if len(s) <= limit else s[: limit - 1].rstrip() + "…"


def judge(checks: dict[str, Any], ids: tuple[str, ...]) -> Cell:
    """The cell of one option: ``checks`` maps a check id to its report entry, or to the list of its entries (a
    parametrized check has one per case; any failing case makes the deviation)."""
    present = [e for i in ids if i in checks for e in (checks[i] if isinstance(checks[i], list) else [checks[i]])]
    if not present:
        return Cell("—")
    bad = [c for c in present if c["outcome"] in FAILING]
    if bad:
        c = bad[0]
        kind = "known deviation" if c["outcome"] == "xfailed" else c["outcome"]
        return Cell("deviation", f"{c['id']} ({kind}): {one_line(c.get('message') or '')}", [c["id"] for c in bad])
    ran = [c for c in present if c["outcome"] == "passed"]
    if ran:
        note = "" if len(ran) == len(present) else f"{len(ran)}/{len(present)} ran"
        return Cell("conformant", note, [c["id"] for c in ran])
    skipped = [c for c in present if c["outcome"] == "skipped"]
    if skipped:
        return Cell("skipped", one_line(skipped[0].get("message") or "", 120), [c["id"] for c in skipped])
    return Cell(present[0]["outcome"], "", [c["id"] for c in present])


@dataclass
class Column:
    name: str
    version: str
    cells: dict[str, Cell]
    #: why the engine did not run (``--unavailable``), printed once under the table
    note: str = ""


def column_from_report(report: dict[str, Any], area: str = "correction") -> Column:
    checks: dict[str, list[dict]] = {}
    for c in report.get("checks", []):
        if area == "all" or c.get("area") == area:
            checks.setdefault(c["id"], []).append(c)
    cells = {label: judge(checks, ids) for label, ids in OPTIONS}
    known = {i for _, ids in OPTIONS for i in ids}
    for cid in sorted(set(checks) - known):  # checks of other areas or new ones: their own row
        cells[cid] = judge(checks, (cid,))
    eng = report.get("engine", {})
    return Column(str(eng.get("name", "?")), str(eng.get("version", "")), cells)


def column_unavailable(name: str, version: str, reason: str, rows: list[str]) -> Column:
    note = " ".join(reason.split())
    return Column(name, version, {r: Cell("not run") for r in rows}, note=note.removeprefix("not run: "))


def rows_of(columns: list[Column]) -> list[str]:
    """Row labels in display order: the options, then any other checks; rows no column has data for are dropped."""
    seen: list[str] = [label for label, _ in OPTIONS]
    for col in columns:
        seen += [r for r in col.cells if r not in seen]
    return [r for r in seen if any(col.cells.get(r, Cell("—")).verdict not in ("—", "not run") for col in columns)]


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(columns: list[Column], rows: list[str]) -> str:
    head = "| correction option | " + " | ".join(f"{c.name} ({c.version})" for c in columns) + " |"
    sep = "| --- |" + " --- |" * len(columns)
    lines = ["# Rollout correction across engines", "",
             "Each cell: `conformant`, `deviation` (the check and its reason), `skipped` (the engine's reason) "
             "or `not run`; from `fp8rl report compare`.", "", head, sep]
    for r in rows:
        cells = [_md_escape(c.cells.get(r, Cell("—")).text()) for c in columns]
        lines.append(f"| {_md_escape(r)} | " + " | ".join(cells) + " |")
    counts = []
    for c in columns:
        v = [c.cells.get(r, Cell("—")).verdict for r in rows]
        counts.append("not run" if c.note else f"{c.name}: {v.count('conformant')} conformant, "
                      f"{v.count('deviation')} deviation, {v.count('skipped')} skipped")
    lines += ["", "Totals — " + "; ".join(x for x in counts if x != "not run") + "."]
    lines += [f"\n**{c.name} not run:** {_md_escape(c.note)}" for c in columns if c.note]
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#1b1b1b}table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 6px;vertical-align:top;max-width:28em}th{background:#f2f2f2;position:sticky;top:0}
td.conformant{background:#e7f6e7}td.deviation{background:#fde8e8}td.skipped{background:#f4f4f4;color:#555}
td.notrun{background:#fff5dc;color:#555}b{display:block}"""


def to_html(columns: list[Column], rows: list[str]) -> str:
    e = html.escape
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>Rollout correction across engines</title>",
           f"<style>{_CSS}</style></head><body><h1>Rollout correction across engines</h1>",
           "<p>Each cell: conformant, deviation (the check and its reason), skipped (the engine's reason) or "
           "not run; from <code>fp8rl report compare</code>.</p><table><tr><th>correction option</th>"]
    out += [f"<th>{e(c.name)}<br><small>{e(c.version)}</small></th>" for c in columns]
    out.append("</tr>")
    for r in rows:
        out.append(f"<tr><th style='text-align:left'>{e(r)}</th>")
        for c in columns:
            cell = c.cells.get(r, Cell("—"))
            cls = cell.verdict.replace(" ", "").replace("—", "none")
            out.append(f"<td class='{cls}'><b>{e(cell.verdict)}</b>{e(cell.reason)}</td>")
        out.append("</tr>")
    out.append("</table>")
    out += [f"<p><b>{e(c.name)} not run:</b> {e(c.note)}</p>" for c in columns if c.note]
    out.append("</body></html>")
    return "\n".join(out) + "\n"


__all__ = ["OPTIONS", "Cell", "Column", "column_from_report", "column_unavailable", "judge", "one_line", "rows_of",
           "to_html", "to_markdown"]
