"""Schema loading, JSON normalisation and validation of fp8rl reports."""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from importlib import resources
from typing import Any

OUTCOMES: tuple[str, ...] = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "not_run")
#: 1.1: outcome not_run, summary not_run/known_deviations/partial, verdict "incomplete", top-level status/selection
SCHEMA_VERSION = "1.1"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_MAX_LISTED = 8


class ReportValidationError(ValueError):
    """A report does not conform to report.schema.json (or is internally inconsistent).

    ``errors`` lists ``"<json path>: <message>"`` strings, most relevant first.
    """

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        shown = self.errors[:_MAX_LISTED]
        more = len(self.errors) - len(shown)
        lines = "\n".join(f"  - {e}" for e in shown)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(f"invalid fp8rl report ({len(self.errors)} problem(s)):\n{lines}{tail}")


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    return resources.files(__package__).joinpath("report.schema.json").read_text(encoding="utf-8")


def schema() -> dict:
    """The report JSON Schema (draft 2020-12), loaded from the package data ``report.schema.json``.

    A fresh copy each call, so callers may mutate it.
    """
    return json.loads(_schema_text())


@functools.lru_cache(maxsize=1)
def _validator():
    from jsonschema import Draft202012Validator

    s = schema()
    Draft202012Validator.check_schema(s)
    return Draft202012Validator(s)


def to_jsonable(obj: Any) -> Any:
    """Normalise a report (or any part) to what ``json.dumps(..., allow_nan=False)`` accepts.

    numpy/torch scalars -> Python numbers, tuples -> lists, non-finite floats -> "nan" / "inf" / "-inf".
    """
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return float(obj)
    item = getattr(obj, "item", None)  # numpy generic / 0-d array / torch scalar tensor
    if callable(item):
        try:
            return to_jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return to_jsonable(tolist())
    return obj  # left for the schema to reject with a path


def as_float(v: Any) -> float | None:
    """A metric / plot value as float (non-finite tokens decoded), None when it is not numeric."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return _NONFINITE.get(v)
    return None


def _path(parts) -> str:
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _consistency(report: dict) -> list[str]:
    """Checks JSON Schema cannot express: summary counts agree with the checks, verdict, plot shapes."""
    errs: list[str] = []
    checks = report["checks"]
    summary = report["summary"]
    counts = Counter(c["outcome"] for c in checks)
    for o in OUTCOMES:
        if summary.get(o, 0) != counts.get(o, 0):
            errs.append(f"$.summary.{o}: is {summary.get(o, 0)} but {counts.get(o, 0)} check(s) have outcome {o!r}")
    if summary["total"] != len(checks):
        errs.append(f"$.summary.total: is {summary['total']} but there are {len(checks)} check(s)")
    if summary["verdict"] == "conformant" and (summary["failed"] or summary["error"]):
        errs.append("$.summary.verdict: 'conformant' with failed or error checks")
    scope = summary.get("scope")
    if summary["verdict"] == "conformant" and scope is not None and (scope["untested"] or not scope["engine_cases"]):
        errs.append("$.summary.verdict: 'conformant' with declared capabilities the engine's own code was not tested "
                    f"on ({', '.join(scope['untested']) or 'no case ran engine code'})")
    if summary["verdict"] == "conformant" and (summary.get("not_run", 0)
                                               or (not checks and report.get("status", "complete") != "complete")):
        errs.append("$.summary.verdict: 'conformant' with checks that did not run")
    for name, sec in (report.get("sections") or {}).items():
        plots = sec.get("plot")
        plots = plots if isinstance(plots, list) else ([plots] if plots is not None else [])
        for i, p in enumerate(plots):
            where = f"$.sections.{name}.plot" + (f"[{i}]" if isinstance(sec["plot"], list) else "")
            for sname, ys in p["series"].items():
                if len(ys) != len(p["x"]):
                    errs.append(f"{where}.series.{sname}: {len(ys)} values but x has {len(p['x'])}")
        table = sec.get("table")
        if table is not None:
            for i, row in enumerate(table["rows"]):
                if len(row) != len(table["columns"]):
                    errs.append(
                        f"$.sections.{name}.table.rows[{i}]: {len(row)} cells but {len(table['columns'])} columns"
                    )
    return errs


def _doc_order(err) -> tuple:
    return ([(p, "") if isinstance(p, int) else (-1, str(p)) for p in err.absolute_path], str(err.validator))


def validate(report: dict) -> dict:
    """Validate ``report`` against report.schema.json plus consistency rules; return its JSON-normal form.

    The report is first normalised with :func:`to_jsonable` (so numpy scalars and NaN/inf metrics are fine).
    Consistency rules: summary.<outcome> equals the number of checks with that outcome, summary.total equals
    len(checks), verdict "conformant" needs failed == error == 0, plot series have len(x) values and table
    rows have one cell per column.

    Raises :class:`ReportValidationError` listing the JSON path and message of each violation.
    """
    from jsonschema.exceptions import best_match

    doc = to_jsonable(report)
    # document order (path, then keyword) so "the first violations" are the first ones in the file
    errors = sorted(_validator().iter_errors(doc), key=_doc_order)
    if errors:
        msgs = []
        for e in errors:
            best = best_match([e])  # descends into oneOf/anyOf to the most specific reason
            msg = f"{_path(best.absolute_path)}: {best.message}"
            if msg not in msgs:
                msgs.append(msg)
        raise ReportValidationError(msgs)
    errs = _consistency(doc)
    if errs:
        raise ReportValidationError(errs)
    return doc


#: how many distinct refusal messages a capability's scope row keeps
_MAX_REFUSALS = 3


def scope_of(checks: list[dict], capabilities: dict[str, Any]) -> dict | None:
    """What a conformance run exercised of the engine's own code, from its checks' ``requires`` / ``exercised`` /
    ``refused`` fields (None for a report whose checks lack them: written before op tracking, or a mutants report).

    A case is *eligible* for the capabilities it requires when the engine declares every one of them available.
    Per capability: ``cases`` (eligible cases), ``engine`` (of those, cases that ran the engine's own code),
    ``oracle`` (cases that ran only code inherited from fp8rl's oracle), ``refused`` (cases the engine refused with
    Unsupported) and the first refusal messages. ``untested``: capabilities with eligible cases of which none ran
    the engine's own code; ``inherited``: those of them whose cases ran the oracle's code instead."""
    if not checks or not any("exercised" in c for c in checks):
        return None
    declared = {k for k, v in (capabilities or {}).items() if v is True}
    caps: dict[str, dict[str, Any]] = {}
    engine_cases = oracle_cases = refused_cases = 0
    for c in checks:
        ran = c.get("exercised", "none")
        engine_cases += ran == "engine"
        oracle_cases += ran == "oracle"
        req = list(c.get("requires") or [])
        if not all(k in declared for k in req):
            continue  # skipped for a capability the engine does not declare: not a case of the others either
        refused = bool(c.get("refused"))
        refused_cases += refused
        for key in req:
            row = caps.setdefault(key, {"cases": 0, "engine": 0, "oracle": 0, "refused": 0, "refusals": []})
            row["cases"] += 1
            if ran in ("engine", "oracle"):
                row[ran] += 1
            if refused:
                row["refused"] += 1
                msg = first_refusal(c.get("message", ""))
                if msg not in row["refusals"] and len(row["refusals"]) < _MAX_REFUSALS:
                    row["refusals"].append(msg)
    untested = sorted(k for k, r in caps.items() if r["engine"] == 0)
    return {"engine_cases": engine_cases, "oracle_cases": oracle_cases, "refused_cases": refused_cases,
            "untested": untested, "inherited": [k for k in untested if caps[k]["oracle"] > 0],
            "capabilities": dict(sorted(caps.items()))}


def capability_status(row: dict) -> str:
    """One capability row of :func:`scope_of` in words, the same in every rendering (report section, console):
    ``tested`` when a case ran the engine's own code, else ``UNTESTED: <why>``."""
    if row["engine"]:
        return "tested"
    if row["oracle"]:
        return "UNTESTED: inherited from the oracle"
    if row["refused"] == row["cases"]:
        return "UNTESTED: every case refused"
    return "UNTESTED: no case ran the engine's own code"


def first_refusal(message: str) -> str:
    """The engine's refusal text of a refused case's skip message (one line, bounded)."""
    line = (message or "").splitlines()[0] if message else ""
    return line.removeprefix("refused by the engine: ")[:200]


def summarize(checks: list[dict], *, status: str = "complete", partial: bool = False,
              capabilities: dict[str, Any] | None = None, scope: dict | None = None) -> dict:
    """The ``summary`` object for a list of checks.

    Verdict: ``non-conformant`` if a check failed or errored (a failure is a failure, however the run ended); else
    ``incomplete`` if a planned check did not run, or nothing was planned before the run stopped (``status``), or —
    for a conformance run with op tracking (``capabilities`` given and checks carrying ``exercised``) — no case ran
    the engine's own code, or a capability the engine declares available ran none of its cases on the engine's own
    code (``scope.untested``: refused, inherited from the oracle, or skipped); else ``conformant``.
    ``known_deviations`` counts the vendor-xfailed checks; ``partial`` marks a run restricted by --area / -k.
    ``scope``: :func:`scope_of` of these checks when the caller computed it already (it is not computed again)."""
    counts = Counter(c["outcome"] for c in checks)
    s: dict[str, Any] = {o: counts.get(o, 0) for o in OUTCOMES}
    s["total"] = len(checks)
    s["known_deviations"] = s["xfailed"]
    s["partial"] = bool(partial)
    if scope is None and capabilities is not None:
        scope = scope_of(checks, capabilities)
    if scope is not None:
        s["scope"] = scope
    if s["failed"] or s["error"]:
        s["verdict"] = "non-conformant"
    elif s["not_run"] or (status != "complete" and not checks):
        s["verdict"] = "incomplete"  # a signal after the last check (while reporting) costs nothing
    elif scope is not None and (scope["untested"] or not scope["engine_cases"]):
        s["verdict"] = "incomplete"  # no certificate without testing
    else:
        s["verdict"] = "conformant"
    return s


def verdict_line(report: dict) -> str:
    """The verdict as a reader of a certificate should see it: ``CONFORMANT``, ``CONFORMANT with 15 known
    deviations``, ``NON-CONFORMANT``, ``INCOMPLETE (interrupted: 157 of 213 checks did not run)``, plus
    ``· partial run (areas: kv)`` for a restricted selection."""
    s = report["summary"]
    text = s["verdict"].upper()
    if s["verdict"] == "conformant" and s.get("known_deviations"):
        n = s["known_deviations"]
        text += f" with {n} known deviation{'s' if n != 1 else ''}"
    status = report.get("status", "complete")
    scope = s.get("scope")
    if status != "complete" or s.get("not_run"):
        text += f" ({status}: {s.get('not_run', 0)} of {s['total']} checks did not run)"
    elif s["verdict"] == "incomplete" and scope is not None:
        if not scope["engine_cases"]:
            text += " (untested: no check ran the engine's own code)"
        else:
            n = len(scope["untested"])
            text += (f" (untested: {n} declared capabilit{'y' if n == 1 else 'ies'} ran no case of the engine's own "
                     f"code: {', '.join(scope['untested'][:6])}{' …' if n > 6 else ''})")
    if scope is not None and scope["oracle_cases"]:
        text += f" · {scope['oracle_cases']} cases ran only the oracle's inherited code (not counted)"
    if scope is not None and scope["refused_cases"]:
        text += f" · {scope['refused_cases']} cases refused by the engine"
    if s.get("partial"):
        sel = report.get("selection") or {}
        what = []
        if sel.get("areas"):
            what.append(f"areas: {', '.join(sel['areas'])}")
        if sel.get("keyword"):
            what.append(f"-k {sel['keyword']!r}")
        text += f" · partial run ({'; '.join(what) or 'selection'})"
    return text


def load_report(path) -> dict:
    """Read a report.json and validate it."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return validate(doc)
