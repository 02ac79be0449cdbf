"""Renderers of a validated report: JUnit XML, Markdown, self-contained HTML; and the atomic writer."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from . import _plots
from ._plots import check_label, err_over_bound, outcomes_by_area
from ._schema import OUTCOMES, as_float, validate, verdict_line

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# characters XML 1.0 cannot carry at all (even escaped)
_XML_INVALID = re.compile("[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_BAD_OUTCOMES = ("failed", "error")


def _counts_text(s: dict) -> str:
    """'144 passed, 0 failed, ... of 213 checks' (not run only when there are some)."""
    parts = [f"{s.get(o, 0)} {o.replace('_', ' ')}" for o in OUTCOMES if o != "not_run" or s.get(o, 0)]
    return f"{', '.join(parts)} of {s['total']} checks"


# ---------------------------------------------------------------------------------------------------------------
# shared helpers


def clean(s: Any) -> str:
    """A user string with ANSI colour codes removed and XML-illegal control characters shown as \\xNN."""
    s = _ANSI.sub("", str(s))
    return _XML_INVALID.sub(lambda m: f"\\x{ord(m.group()):02x}", s)


def first_line(s: Any) -> str:
    for line in clean(s).splitlines():
        if line.strip():
            return line.strip()
    return ""


def _fmt_num(v: Any) -> str:
    f = as_float(v)
    if f is None:
        return str(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if f == 0 or not (1e-3 <= abs(f) < 1e6):
        return f"{f:.3g}"
    return f"{f:.4g}"


def _metrics_brief(m: dict) -> str:
    parts = []
    for k, v in m.items():
        if isinstance(v, dict):
            parts.append(f"{k}=" + "{" + ", ".join(f"{kk}: {_fmt_num(vv)}" for kk, vv in v.items()) + "}")
        elif isinstance(v, list):
            parts.append(f"{k}=[{len(v)} values]")
        else:
            parts.append(f"{k}={_fmt_num(v)}")
    return ", ".join(parts)


def _area_counts(checks: list[dict]) -> dict[str, Counter]:
    return outcomes_by_area(checks)


def _group_by_reason(checks: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for c in checks:
        groups.setdefault(first_line(c["message"]) or "(no reason given)", []).append(c)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def _title(report: dict) -> str:
    e = report["engine"]
    what = "mutation run" if report["kind"] == "mutants" else "conformance report"
    return f"fp8rl {what} — {e['name']} {e['version']}".rstrip()


def _meta_rows(report: dict) -> list[tuple[str, str]]:
    return [
        ("engine", f"{report['engine']['name']} {report['engine']['version']}".rstrip()),
        ("suite", f"{report['suite']['name']} {report['suite']['version']}"),
        ("kind", report["kind"]),
        ("profile", report["profile"]),
        ("seed", str(report["seed"])),
        ("started at", report["started_at"]),
        ("duration", f"{report['duration_s']:.2f} s"),
        ("command", " ".join(report["command"])),
    ] + [("instrument note", n) for n in report["engine"].get("notes", [])]


def _mutation_line(report: dict) -> str:
    muts = report.get("mutants") or []
    killed = sum(1 for m in muts if m["killed"])
    return f"mutation score {report['mutation_score']:.1%} ({killed}/{len(muts)} mutants killed)"


# ---------------------------------------------------------------------------------------------------------------
# JUnit XML


def render_junit(report: dict) -> bytes:
    """JUnit XML: <testsuites> holding one <testsuite>; classname = area, name = id[case].

    failed -> <failure>, error -> <error>, skipped -> <skipped>, xfailed -> <skipped message="xfail: ...">,
    xpassed -> a passing testcase with a <system-out> note, not_run -> <error type="not-run"> (a CI system must not
    read an interrupted run as green). The suite's properties carry the verdict line and the run status.
    """
    s = report["summary"]
    counts = {
        "tests": str(s["total"]),
        "failures": str(s["failed"]),
        "errors": str(s["error"] + s.get("not_run", 0)),
        "skipped": str(s["skipped"] + s["xfailed"]),
        "time": f"{report['duration_s']:.3f}",
    }
    root = ET.Element("testsuites", {"name": "fp8rl", **counts})
    suite = ET.SubElement(
        root,
        "testsuite",
        {"name": clean(f"fp8rl.{report['kind']}.{report['engine']['name']}"), **counts,
         "timestamp": clean(report["started_at"])},
    )
    props = ET.SubElement(suite, "properties")
    for k, v in [
        ("engine", report["engine"]["name"]),
        ("engine_version", report["engine"]["version"]),
        ("suite_version", report["suite"]["version"]),
        ("profile", report["profile"]),
        ("seed", str(report["seed"])),
        ("verdict", s["verdict"]),
        ("verdict_line", verdict_line(report)),
        ("status", report.get("status", "complete")),
    ] + ([("mutation_score", str(report["mutation_score"]))] if report["kind"] == "mutants" else []) + (
        [("scope_engine_cases", str(s["scope"]["engine_cases"])),
         ("scope_oracle_cases", str(s["scope"]["oracle_cases"])),
         ("scope_refused_cases", str(s["scope"]["refused_cases"])),
         ("scope_untested", ", ".join(s["scope"]["untested"]))] if s.get("scope") else []):
        ET.SubElement(props, "property", {"name": k, "value": clean(v)})
    for c in report["checks"]:
        tc = ET.SubElement(
            suite,
            "testcase",
            {"classname": clean(c["area"]), "name": clean(check_label(c)), "time": f"{c['duration_s']:.3f}",
             "file": clean(c["nodeid"].split("::")[0])},
        )
        tc_props = {"title": c["title"], "nodeid": c["nodeid"]}
        if c.get("bound"):
            tc_props["bound"] = c["bound"]
        if c["metrics"]:
            tc_props["metrics"] = json.dumps(c["metrics"], sort_keys=True)
        pe = ET.SubElement(tc, "properties")
        for k, v in tc_props.items():
            ET.SubElement(pe, "property", {"name": k, "value": clean(v)})
        msg, head = clean(c["message"]), first_line(c["message"])[:500]
        o = c["outcome"]
        if o == "failed":
            el = ET.SubElement(tc, "failure", {"message": head, "type": "AssertionError"})
            el.text = msg
        elif o == "error":
            el = ET.SubElement(tc, "error", {"message": head, "type": "error"})
            el.text = msg
        elif o == "skipped":
            el = ET.SubElement(tc, "skipped", {"message": head})
            el.text = msg if msg.strip() != head else None
        elif o == "xfailed":
            ET.SubElement(tc, "skipped", {"message": f"xfail: {head}", "type": "pytest.xfail"})
        elif o == "xpassed":
            out = ET.SubElement(tc, "system-out")
            out.text = f"xpassed: expected to fail but passed. {msg}".rstrip()
        elif o == "not_run":
            el = ET.SubElement(tc, "error", {"message": f"not run: {head}", "type": "not-run"})
            el.text = msg
    ET.indent(root)
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue() + b"\n"


# ---------------------------------------------------------------------------------------------------------------
# Markdown

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#])")


def md(s: Any) -> str:
    """Escape a user string for Markdown text and table cells (pipes, emphasis, links, HTML, newlines)."""
    s = clean(s)
    s = _MD_SPECIAL.sub(r"\\\1", s)
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return s.replace("\r\n", "\n").replace("\n", "<br>")


def md_code(s: Any, table: bool = True) -> str:
    """Inline code span; ``table``: safe inside a GFM table cell (pipes escaped)."""
    s = clean(s).replace("\n", " ")
    if table:
        s = s.replace("|", "\\|")
    run = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (run + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def _md_block(s: Any) -> str:
    s = clean(s).rstrip("\n")
    run = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * max(3, run + 1)
    return f"{fence}text\n{s}\n{fence}"


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(md(h) for h in header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join(str(x) for x in r) + " |")
    return out


def render_markdown(report: dict) -> str:
    s, checks = report["summary"], report["checks"]
    L: list[str] = [f"# {md(_title(report))}", ""]
    L.append(f"**Verdict: {md(verdict_line(report))}** · {_counts_text(s)}")
    if report["kind"] == "mutants":
        L += ["", f"**{_mutation_line(report).capitalize()}**"]
    L += ["", "## Run", ""]
    L += _md_table(["", ""], [[k, md_code(v) if k == "command" else md(v)] for k, v in _meta_rows(report)])

    L += ["", "## Summary", ""]
    L += _md_table([*OUTCOMES, "total", "verdict"], [[*(s.get(o, 0) for o in OUTCOMES), s["total"], s["verdict"]]])

    bad = [c for c in checks if c["outcome"] in _BAD_OUTCOMES]
    L += ["", f"## Failures and errors ({len(bad)})", ""]
    if not bad:
        L.append("None.")
    for c in bad:
        L += [f"### {md(check_label(c))} — {c['outcome']}", ""]
        L.append(f"- area: {md(c['area'])}")
        L.append(f"- spec: {md(c['title'])}")
        L.append(f"- test: {md_code(c['nodeid'], table=False)}")
        if c.get("bound"):
            L.append(f"- bound: {md_code(c['bound'], table=False)}")
        if c["metrics"]:
            L.append(f"- metrics: {md(_metrics_brief(c['metrics']))}")
        L += ["", _md_block(c["message"] or "(no message)"), ""]

    xpassed = [c for c in checks if c["outcome"] == "xpassed"]
    if xpassed:
        L += ["", f"## Unexpectedly passing (xpassed, {len(xpassed)})", ""]
        L += [f"- {md(check_label(c))}: {md(first_line(c['message']))}" for c in xpassed]

    for outcome, heading in (("skipped", "Skipped"), ("xfailed", "Expected failures (xfail)")):
        sel = [c for c in checks if c["outcome"] == outcome]
        if not sel:
            continue
        L += ["", f"## {heading} ({len(sel)})", ""]
        for reason, cs in _group_by_reason(sel).items():
            ids = ", ".join(md(check_label(c)) for c in cs)
            L.append(f"- **{md(reason)}** ({len(cs)}): {ids}")

    L += ["", "## Per area", ""]
    areas = _area_counts(checks)
    L += _md_table(
        ["area", *OUTCOMES, "total"],
        [[md(a), *(cnt.get(o, 0) for o in OUTCOMES), sum(cnt.values())] for a, cnt in areas.items()],
    )

    if report["kind"] == "mutants":
        L += ["", "## Mutants", "", _mutation_line(report).capitalize(), ""]
        L += _md_table(
            ["mutant", "description", "killed", "killed by"],
            [[md_code(m["mutant"]), md(m["description"]), "yes" if m["killed"] else "**NO**",
              md(", ".join(m["killed_by"]))] for m in report["mutants"]],
        )

    for name, sec in (report.get("sections") or {}).items():
        L += ["", f"## {md(sec.get('title') or name)}", ""]
        if sec.get("text"):
            L += [md(sec["text"]), ""]
        table = sec.get("table")
        if table:
            L += _md_table(table["columns"], [[md(_fmt_num(x)) for x in row] for row in table["rows"]]) + [""]
        plots = sec.get("plot")
        if plots:
            n = len(plots) if isinstance(plots, list) else 1
            L.append(f"_{n} plot(s): see report.html._")
        rest = {k: v for k, v in sec.items() if k not in ("title", "text", "table", "plot")}
        if rest:
            L += ["", _md_block(json.dumps(rest, indent=2, sort_keys=True))]

    L += ["", "## Engine capabilities", ""]
    caps = report["engine"]["capabilities"]
    L += _md_table(["capability", "supported"], [[md(k), "yes" if v is True else f"no: {md(v)}"] for k, v in caps.items()])
    L += ["", "## Environment", ""]
    L += _md_table(["", ""], [[md(k), md(v)] for k, v in report["environment"].items()])
    return "\n".join(L).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------------
# HTML

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0 auto;max-width:1180px;
padding:1.2em 1.6em 3em;color:#1d1d1f;background:#fff;line-height:1.45}
h1{font-size:1.55em;margin:.2em 0 .4em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
h3{font-size:1.02em;margin:1.2em 0 .3em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}th,td{border:1px solid #d6d6d6;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
.verdict{display:inline-block;padding:.25em .8em;border-radius:4px;font-weight:700;color:#fff}
.conformant{background:#2e7d32}.non-conformant{background:#c62828}.incomplete{background:#ef6c00}
.o-passed{color:#2e7d32}.o-failed,.o-error{color:#c62828;font-weight:600}.o-skipped{color:#757575}
.o-xfailed{color:#8e24aa}.o-xpassed{color:#1565c0;font-weight:600}.o-not_run{color:#ef6c00;font-weight:600}
pre{background:#f7f7f7;border:1px solid #e2e2e2;padding:.6em;overflow-x:auto;white-space:pre-wrap;font-size:.85em}
code{font-size:.9em;background:#f3f3f3;padding:0 .2em}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}figcaption{font-size:.85em;color:#555}
.note{color:#757575;font-style:italic}.check{border-left:4px solid #c62828;padding-left:.8em;margin:1em 0}
details summary{cursor:pointer;font-weight:600}
"""


def _h(s: Any) -> str:
    return html.escape(clean(s), quote=True)


def _html_table(header: list[str], rows: list[list[str]], numeric_from: int | None = None) -> str:
    th = "".join(f"<th>{_h(h)}</th>" for h in header)
    body = []
    for r in rows:
        tds = []
        for i, cell in enumerate(r):
            cls = ' class="n"' if numeric_from is not None and i >= numeric_from else ""
            tds.append(f"<td{cls}>{cell}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _plot(fn, checks: list[dict]) -> bytes | None | Exception:
    """A plot of the checks, or the exception that stopped it (a plot must never cost the report)."""
    try:
        return fn(checks)
    except Exception as exc:  # noqa: BLE001
        return exc


def _img(png: bytes | None | Exception, alt: str, caption: str, missing_note: str) -> str:
    if isinstance(png, Exception):
        return f'<p class="note">{_h(caption)}: could not be drawn ({_h(type(png).__name__)}: {_h(png)})</p>'
    if png is None:
        return f'<p class="note">{_h(caption)}: {_h(missing_note)}</p>'
    b64 = base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{b64}" alt="{_h(alt)}">'
            f"<figcaption>{_h(caption)}</figcaption></figure>")


def render_html(report: dict, section_plots: list[dict] | None = None) -> str:
    """Self-contained HTML page (inline CSS, base64 PNG plots, a CSP that forbids any external load)."""
    s, checks = report["summary"], report["checks"]
    title = _title(report)
    P: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_h(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_h(title)}</h1>",
        f'<p><span class="verdict {_h(s["verdict"])}">{_h(verdict_line(report))}</span> {_h(_counts_text(s))}</p>',
    ]
    if report["kind"] == "mutants":
        P.append(f"<p><strong>{_h(_mutation_line(report).capitalize())}</strong></p>")
    P.append("<h2>Run</h2>")
    P.append(_html_table(["", ""], [[_h(k), f"<code>{_h(v)}</code>" if k == "command" else _h(v)]
                                    for k, v in _meta_rows(report)]))
    P.append("<h2>Summary</h2>")
    P.append(_html_table([*OUTCOMES, "total"], [[str(s.get(o, 0)) for o in OUTCOMES] + [str(s["total"])]], numeric_from=0))

    P.append("<h2>Plots</h2>")
    P.append(_img(_plot(_plots.plot_err_over_bound, checks), "error over bound per check", "Error / bound per check",
                  "no check reported metrics.err_over_bound (or max_abs_err and bound)"))
    P.append(_img(_plot(_plots.plot_ulp_hist, checks), "ULP distance histogram", "ULP-distance histogram",
                  "no check reported metrics.ulp_hist"))
    P.append(_img(_plot(_plots.plot_outcomes_by_area, checks), "outcomes per area", "Outcomes per area",
                  "no checks"))

    bad = [c for c in checks if c["outcome"] in _BAD_OUTCOMES]
    P.append(f"<h2>Failures and errors ({len(bad)})</h2>")
    if not bad:
        P.append('<p class="note">None.</p>')
    for c in bad:
        items = [f"<li>area: {_h(c['area'])}</li>", f"<li>spec: {_h(c['title'])}</li>",
                 f"<li>test: <code>{_h(c['nodeid'])}</code></li>"]
        if c.get("bound"):
            items.append(f"<li>bound: <code>{_h(c['bound'])}</code></li>")
        if c["metrics"]:
            items.append(f"<li>metrics: {_h(_metrics_brief(c['metrics']))}</li>")
        P.append(f'<div class="check"><h3>{_h(check_label(c))} — <span class="o-{c["outcome"]}">'
                 f'{c["outcome"]}</span></h3><ul>{"".join(items)}</ul><pre>{_h(c["message"] or "(no message)")}</pre></div>')

    xpassed = [c for c in checks if c["outcome"] == "xpassed"]
    if xpassed:
        P.append(f"<h2>Unexpectedly passing (xpassed, {len(xpassed)})</h2><ul>")
        P += [f"<li>{_h(check_label(c))}: {_h(first_line(c['message']))}</li>" for c in xpassed]
        P.append("</ul>")
    for outcome, heading in (("skipped", "Skipped"), ("xfailed", "Expected failures (xfail)")):
        sel = [c for c in checks if c["outcome"] == outcome]
        if sel:
            P.append(f"<h2>{heading} ({len(sel)})</h2><ul>")
            for reason, cs in _group_by_reason(sel).items():
                P.append(f"<li><strong>{_h(reason)}</strong> ({len(cs)}): "
                         f"{_h(', '.join(check_label(c) for c in cs))}</li>")
            P.append("</ul>")

    P.append("<h2>Per area</h2>")
    P.append(_html_table(["area", *OUTCOMES, "total"],
                         [[_h(a), *(str(cnt.get(o, 0)) for o in OUTCOMES), str(sum(cnt.values()))]
                          for a, cnt in _area_counts(checks).items()], numeric_from=1))

    if report["kind"] == "mutants":
        P.append("<h2>Mutants</h2>")
        P.append(f"<p>{_h(_mutation_line(report).capitalize())}</p>")
        P.append(_html_table(["mutant", "description", "killed", "killed by"], [
            [f"<code>{_h(m['mutant'])}</code>", _h(m["description"]),
             '<span class="o-passed">yes</span>' if m["killed"] else '<span class="o-failed">NO</span>',
             _h(", ".join(m["killed_by"]))] for m in report["mutants"]]))

    if section_plots is None:
        section_plots = _plots.render_section_plots(report)
    by_section: dict[str, list[dict]] = {}
    for sp in section_plots:
        by_section.setdefault(sp["section"], []).append(sp)
    for name, sec in (report.get("sections") or {}).items():
        P.append(f'<h2 id="section-{_h(name)}">{_h(sec.get("title") or name)}</h2>')
        if sec.get("text"):
            P.append(f"<p>{_h(sec['text'])}</p>")
        table = sec.get("table")
        if table:
            P.append(_html_table(table["columns"], [[_h(_fmt_num(x)) for x in row] for row in table["rows"]]))
        for sp in by_section.get(name, []):
            P.append(_img(sp["png"], sp["title"], sp["title"], sp["note"] or "no data"))
        rest = {k: v for k, v in sec.items() if k not in ("title", "text", "table", "plot")}
        if rest:
            P.append(f"<details><summary>data</summary><pre>{_h(json.dumps(rest, indent=2, sort_keys=True))}</pre></details>")

    P.append("<h2>All checks</h2><details><summary>"
             f"{len(checks)} checks</summary>")
    rows = []
    for c in checks:
        eob = err_over_bound(c)
        rows.append([_h(c["id"]), _h(c["case"]), _h(c["area"]), f'<span class="o-{c["outcome"]}">{c["outcome"]}</span>',
                     _h(c.get("bound") or ""), "" if eob is None else _h(_fmt_num(eob)), f"{c['duration_s']:.3f}",
                     _h(c["title"])])
    P.append(_html_table(["id", "case", "area", "outcome", "bound", "err/bound", "time (s)", "spec"], rows))
    P.append("</details>")

    P.append("<h2>Engine capabilities</h2>")
    P.append(_html_table(["capability", "supported"], [
        [_h(k), '<span class="o-passed">yes</span>' if v is True else f"no: {_h(v)}"]
        for k, v in report["engine"]["capabilities"].items()]))
    P.append("<h2>Environment</h2>")
    P.append(_html_table(["", ""], [[_h(k), _h(v)] for k, v in report["environment"].items()]))
    P.append("</body></html>")
    return "\n".join(P) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# writing


def _stage(path: Path, data: bytes) -> str:
    """Write ``data`` to a temporary file next to ``path`` (fsynced); returns its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


FILES = {"json": "report.json", "junit": "junit.xml", "md": "report.md", "html": "report.html"}


def write_report(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Validate ``report`` and write report.json, junit.xml, report.md, report.html into ``out_dir``.

    Everything is rendered in memory first; then every file is written to a temporary file in ``out_dir`` and,
    once all four are on disk, each is ``os.replace``d over its target: a reader never sees a partial file, and a
    failure (a full disk) leaves no new artifact. Returns ``{"json": path, "junit": path, "md": path, "html": path}``.
    """
    doc = validate(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    blobs = {
        "json": (json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8"),
        "junit": render_junit(doc),
        "md": render_markdown(doc).encode("utf-8"),
        "html": render_html(doc).encode("utf-8"),
    }
    # every file is staged before any is replaced: a full or failing disk leaves no new artifact at all (never a
    # report.json without its junit.xml), and the error propagates
    staged: dict[str, str] = {}
    try:
        for key, name in FILES.items():
            staged[key] = _stage(out / name, blobs[key])
    except BaseException:
        for tmp in staged.values():
            Path(tmp).unlink(missing_ok=True)
        raise
    paths = {}
    try:
        for key, name in FILES.items():
            os.replace(staged[key], out / name)
            paths[key] = out / name
    finally:
        for tmp in staged.values():  # a replace that failed leaves no temp file behind
            Path(tmp).unlink(missing_ok=True)
    return paths
