"""fp8rl.reports: the JSON Schema of a run's results and the writers of its artifacts.

Public API
----------
``schema() -> dict``
    The report JSON Schema (draft 2020-12), shipped as package data ``fp8rl/reports/report.schema.json``.
``validate(report) -> dict``
    Schema + consistency check (summary counts agree with checks, verdict "conformant" needs no failed/error
    check, plot series and table rows have the right lengths). Returns the JSON-normal form of the report
    (numpy scalars -> numbers, NaN/±inf -> "nan"/"inf"/"-inf"); raises :class:`ReportValidationError` whose
    message lists the JSON path (``$.checks[3].outcome``) and reason of each violation.
``summarize(checks) -> dict``
    The ``summary`` object for a list of checks (verdict: conformant iff failed == error == 0).
``write_report(report, out_dir) -> dict[str, Path]``
    Validates, then atomically (temp file in out_dir + os.replace) writes report.json, junit.xml, report.md,
    report.html; returns ``{"json", "junit", "md", "html"}`` -> path.
``load_report(path) -> dict``
    Read and validate a report.json.
``print_summary(report, console=None)``
    rich table per area + verdict line + failing check ids with the first line of their message.
``render_section_plots(report) -> list[dict]``
    Render the plots of ``report["sections"]`` (see below); used by the HTML writer.

Report layout: see report.schema.json (required: schema_version "1.0", suite, kind "conformance"|"mutants",
engine{name, version, capabilities{key: true | "reason"}}, environment, profile, seed, started_at, duration_s,
command, summary, checks[]; kind "mutants" adds mutants[] and mutation_score in [0, 1]).

Check metrics the writers understand (all optional, all free-form otherwise):
``err_over_bound`` (else ``max_abs_err`` / ``bound``) -> the error-vs-bound plot; ``ulp_hist``
{"0": n, "1": n, ">=2": n} -> summed into the ULP histogram. Non-finite values may be given as floats
(they are stored as the strings "nan", "inf", "-inf").

Sections contract (the extension point for later areas)
-------------------------------------------------------
``report["sections"]`` maps a section name (e.g. ``"kv_drift"``, ``"mismatch"``) to an object. The writers
give each section its own heading, in dict order, after the per-area/mutants tables, and understand these
keys (every other key is kept in report.json and shown as a collapsed JSON block in HTML / code block in MD):

* ``"title"``: heading (default: the section name);
* ``"text"``: a paragraph of plain text (escaped, never interpreted as HTML/Markdown);
* ``"table"``: ``{"columns": [str, ...], "rows": [[cell, ...], ...]}``, one cell per column; numbers are
  formatted with 4 significant digits; rendered in report.md and report.html;
* ``"plot"``: one plot spec or a list of them, rendered (HTML only; report.md says "see report.html") by
  :func:`render_section_plots`::

      {"type": "lines",                      # the only type so far
       "title": str, "xlabel": str, "ylabel": str,
       "x": [number | str, ...],             # strings -> categorical axis
       "series": {name: [number | null | "nan" | "inf", ...], ...},   # each len(x); null/nan = gap
       "yscale": "linear" | "log" | "symlog",                          # optional
       "hlines": [{"y": number, "label": str}, ...]}                   # optional, e.g. a bound

  A spec with no finite value renders as a "no data" note; a spec that fails to render becomes a note with
  the error, never a failed report.
"""

from ._console import print_summary
from ._plots import render_section_plots
from ._render import render_html, render_junit, render_markdown, write_report
from ._schema import (
    OUTCOMES,
    SCHEMA_VERSION,
    ReportValidationError,
    load_report,
    schema,
    summarize,
    to_jsonable,
    validate,
    verdict_line,
)

__all__ = [
    "OUTCOMES",
    "SCHEMA_VERSION",
    "ReportValidationError",
    "load_report",
    "print_summary",
    "render_html",
    "render_junit",
    "render_markdown",
    "render_section_plots",
    "schema",
    "summarize",
    "to_jsonable",
    "validate",
    "verdict_line",
    "write_report",
]
