"""A version matrix (``fp8rl matrix``) as files: ``matrix.json`` validated against ``matrix.schema.json`` and
``matrix.html``, a heat map: one row per finding (then one for all other checks), one column per version, each
cell coloured by its outcome; a version bisection did not run shows the outcome its neighbours imply, hatched.
The page is self-contained (inline CSS, no script, a Content-Security-Policy that forbids every external load).
"""

from __future__ import annotations

import functools
import html
import json
from pathlib import Path
from typing import Any

SCHEMA = Path(__file__).with_name("matrix.schema.json")
LABEL = {"passed": "pass", "failed": "FAIL", "xfailed": "xfail", "not_applicable": "n/a", "crashed": "crash",
         "timed_out": "timeout", "not_installable": "no install", "absent": "—", "not_run": "·"}


@functools.lru_cache(maxsize=1)
def _validator():
    from jsonschema import Draft202012Validator

    s = json.loads(SCHEMA.read_text())
    Draft202012Validator.check_schema(s)
    return Draft202012Validator(s)


def validate(matrix: dict[str, Any]) -> None:
    """Raise ValueError naming the first place ``matrix`` breaks matrix.schema.json."""
    from jsonschema.exceptions import best_match

    err = best_match(_validator().iter_errors(matrix))
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise ValueError(f"not an fp8rl matrix.json (matrix.schema.json): at {where}: {err.message}")


def load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    p = p / "matrix.json" if p.is_dir() else p
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    validate(m)
    return m


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#1b1b1b}table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ccc;padding:3px 6px;vertical-align:top}thead th{background:#f2f2f2}
th.row{text-align:left;font-weight:normal;white-space:nowrap}td{text-align:center;white-space:nowrap}
.passed{background:#cdeccd}.failed{background:#f4a6a6;font-weight:bold}.xfailed{background:#f7c98b}
.not_applicable{background:#ececec;color:#666}.crashed{background:#c9a3d9}.timed_out{background:#b7b7e8}
.not_installable{background:#d9d9d9;color:#555}.absent{color:#bbb}.not_run{color:#999}
.inf-bad{background:repeating-linear-gradient(45deg,#fbe3c4,#fbe3c4 4px,#fff 4px,#fff 8px)}
.inf-good{background:repeating-linear-gradient(45deg,#e3f4e3,#e3f4e3 4px,#fff 4px,#fff 8px)}
td.fix{font-size:11px;text-align:left}small{color:#555}.legend span{padding:1px 6px;margin-right:4px}"""


def _td(value: dict[str, Any]) -> str:
    e = html.escape
    o = value.get("outcome", "absent")
    inferred = value.get("inferred", "")
    cls = f"{o} inf-{inferred}" if o == "not_run" and inferred else o
    text = LABEL.get(o, o)
    if o == "not_run" and inferred:
        text = f"({'bad' if inferred == 'bad' else 'ok'})"
    if value.get("counts"):
        text += " <small>" + ", ".join(f"{k} {v}" for k, v in value["counts"].items()) + "</small>"
    tip = o + (f" — {value['message']}" if value.get("message") else "")
    if o == "not_run":
        tip = "not run (bisection did not need it)" + (f"; its neighbours imply: {inferred}" if inferred else "")
    return f"<td class='{e(cls)}' title='{e(tip, quote=True)}'>{text}</td>"


def to_html(m: dict[str, Any]) -> str:
    e = html.escape
    vs = m["versions"]
    title = f"fp8rl version matrix: {m['package']} {vs[0]}..{vs[-1]}" + (f" (tier {m['tier']})" if m["tier"] else "")
    runs = ", ".join(f"<code>fp8rl conformance {e(' '.join(r['args']))}</code>" for r in m["runs"]) or \
        f"<code>{e(m.get('cell_command', ''))}</code>"
    b = m["bisection"]
    P = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'">',
         f"<title>{e(title)}</title><style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>",
         f"<p>Each column is one version of <b>{e(m['package'])}</b> installed from the tier's lock with that "
         f"version alone changed{' (locked: ' + e(m['locked_version']) + ')' if m.get('locked_version') else ''}; "
         f"each cell ran {runs}. Mode: {e(m['mode'])}; {b['cells_run']} of {b['cells_total']} versions run "
         f"({e(m.get('executor', ''))}, {e(m['created'])}).</p>",
         f"<p><small>Bisection assumes: {e(b['assumption'])}. Non-monotone findings: "
         f"{e(', '.join(b['non_monotone']) or 'none')}.</small></p>",
         "<p class='legend'>" + "".join(f"<span class='{o}'>{e(LABEL[o])} {o.replace('_', ' ')}</span>"
                                        for o in LABEL) + "<span class='inf-bad'>(bad) not run, implied bad</span>"
         "<span class='inf-good'>(ok) not run, implied good</span></p>",
         "<table><thead><tr><th>finding</th>" + "".join(f"<th>{e(v)}</th>" for v in vs)
         + "<th>first bad</th><th>first fixed</th></tr>",
         "<tr><th class='row'><small>cell</small></th>"
         + "".join(f"<th class='{e(c['status'])}' title='{e(c.get('reason', ''), quote=True)}'><small>"
                   f"{e(c['status'].replace('_', ' '))}{' ' + str(c['wall_s']) + ' s' if c.get('wall_s') else ''}"
                   "</small></th>" for c in m["cells"]) + "<th></th><th></th></tr></thead><tbody>"]
    for r in m["rows"]:
        P.append(f"<tr><th class='row'>{e(r['key'])}{'' if r['monotone'] else ' <b>(non-monotone)</b>'}</th>"
                 + "".join(_td(r["cells"][v]) for v in vs)
                 + f"<td class='fix'>{e(r.get('first_bad_note') or str(r['first_bad']))}</td>"
                 f"<td class='fix'>{e(r.get('first_fixed_note') or '—')}</td></tr>")
    o = m["other"]
    P.append(f"<tr><th class='row'><i>{e(o['key'])}</i></th>" + "".join(_td(o["cells"][v]) for v in vs)
             + "<td></td><td></td></tr></tbody></table>")
    if not m["rows"]:
        P.append("<p>No finding: no check failed or was xfailed in any version that ran.</p>")
    P.append("</body></html>")
    return "\n".join(P) + "\n"


def summary_lines(m: dict[str, Any]) -> list[str]:
    vs = m["versions"]
    width = max([len(r["key"]) for r in m["rows"]] + [len(m["other"]["key"]), 7])
    col = max(max(len(v) for v in vs), 15)
    lines = [f"{'':{width}}  " + "  ".join(f"{v:>{col}}" for v in vs) + "  first bad / first fixed",
             f"{'(cell)':{width}}  " + "  ".join(f"{c['status'].replace('_', ' '):>{col}}" for c in m["cells"])]

    def val(c: dict[str, Any]) -> str:
        if c["outcome"] == "not_run":
            return f"({c['inferred']})" if c.get("inferred") else LABEL["not_run"]
        return LABEL.get(c["outcome"], c["outcome"])

    for r in m["rows"]:
        lines.append(f"{r['key']:{width}}  " + "  ".join(f"{val(r['cells'][v]):>{col}}" for v in vs)
                     + f"  {r['first_bad_note']} / {r['first_fixed_note'] or '—'}"
                     + ("" if r["monotone"] else "  [non-monotone]"))
    o = m["other"]
    lines.append(f"{o['key']:{width}}  " + "  ".join(f"{val(o['cells'][v]):>{col}}" for v in vs))
    b = m["bisection"]
    lines.append(f"{b['cells_run']} of {b['cells_total']} versions run ({m['mode']})")
    return lines


def write(m: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """matrix.json (validated) and matrix.html in ``out`` (created)."""
    validate(m)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    j, h = d / "matrix.json", d / "matrix.html"
    j.write_text(json.dumps(m, indent=2) + "\n")
    h.write_text(to_html(m))
    return j, h


def changing_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``m`` whose finding changes class inside its versions: fixed at some version, or first bad at a
    version after the oldest."""
    return [r for r in m["rows"] if r["first_fixed"] or (r["first_bad"] and r["first_bad"] != m["versions"][0])]


def findings_by_version(matrices: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One JSON over many matrices (``(name, matrix)``): per library, its versions and each finding's outcome per
    version with its first bad / first fixed release, the cells' statuses, and where the matrix came from."""
    libs = []
    for name, m in matrices:
        libs.append({
            "name": name, "tier": m["tier"], "package": m["package"], "locked_version": m.get("locked_version", ""),
            "created": m["created"], "mode": m["mode"], "versions": m["versions"],
            "cells": {c["version"]: c["status"] for c in m["cells"]},
            "findings": [{"key": r["key"], "outcomes": {v: r["cells"][v]["outcome"] for v in m["versions"]},
                          "first_bad": r["first_bad"], "first_fixed": r["first_fixed"],
                          "first_bad_note": r.get("first_bad_note", ""), "first_fixed_note": r.get("first_fixed_note", ""),
                          "monotone": r["monotone"]} for r in m["rows"]],
            "changes": [r["key"] for r in changing_rows(m)],
        })
    return {"kind": "fp8rl-findings-by-version", "format": 1, "libraries": libs}


def index_html(matrices: list[tuple[str, dict[str, Any]]], links: dict[str, str] | None = None) -> str:
    """The "findings by version" page: per library a compact heat map (findings × versions) with first bad / first
    fixed, linking each library's full matrix page (``links``: name → relative href)."""
    e = html.escape
    P = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
         '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'">',
         f"<title>fp8rl: findings by version</title><style>{_CSS}</style></head><body>",
         "<h1>Findings by upstream version</h1>",
         "<p>Each table is one <code>fp8rl matrix</code> run: a library's releases as columns (each installed in its "
         "tier's lock with that version alone changed), the tier's findings as rows. Rows that change class across "
         "the versions are the ones to read: a finding introduced or fixed, with the release that did it.</p>",
         "<p class='legend'>" + "".join(f"<span class='{o}'>{e(LABEL[o])} {o.replace('_', ' ')}</span>" for o in LABEL)
         + "</p>"]
    for name, m in matrices:
        vs = m["versions"]
        href = (links or {}).get(name)
        head = f"{e(m['package'])} (tier {e(m['tier'])}{', locked ' + e(m['locked_version']) if m.get('locked_version') else ''})"
        P.append(f"<h2 id='{e(name)}'>{head}" + (f" <small><a href='{e(href)}'>full matrix</a></small>" if href else "")
                 + "</h2>")
        changed = changing_rows(m)
        P.append(f"<p>{len(m['rows'])} findings, {len(changed)} changing across {vs[0]} … {vs[-1]}; "
                 f"{m['bisection']['cells_run']} of {len(vs)} versions run ({e(m['mode'])}, {e(m['created'])}).</p>")
        P.append("<table><thead><tr><th>finding</th>" + "".join(f"<th>{e(v)}</th>" for v in vs)
                 + "<th>first bad</th><th>first fixed</th></tr></thead><tbody>")
        for r in sorted(m["rows"], key=lambda r: (r not in changed, r["key"])):
            P.append(f"<tr><th class='row'>{e(r['key'])}</th>" + "".join(_td(r["cells"][v]) for v in vs)
                     + f"<td class='fix'>{e(r.get('first_bad_note') or str(r['first_bad']))}</td>"
                     f"<td class='fix'>{e(r.get('first_fixed_note') or '—')}</td></tr>")
        o = m["other"]
        P.append(f"<tr><th class='row'><i>{e(o['key'])}</i></th>" + "".join(_td(o["cells"][v]) for v in vs)
                 + "<td></td><td></td></tr></tbody></table>")
    P.append("</body></html>")
    return "\n".join(P) + "\n"


__all__ = ["LABEL", "SCHEMA", "changing_rows", "findings_by_version", "index_html", "load", "summary_lines", "to_html", "validate",
           "write"]
