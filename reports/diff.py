"""Outcome changes between two conformance reports of the same checks (``fp8rl report diff OLD NEW``).

The regression gate for an upgrade ("vLLM 0.32 → 0.33", "ml_dtypes 0.6 → 0.7"): every check whose outcome changed,
classified as

* **regression**: the new outcome is ``failed`` or ``error`` and the old one was neither (passed → failed,
  xfailed → error, skipped → failed, ...), or a check that ran before is missing now;
* **improvement**: the old outcome was ``failed``/``error`` and the new one is not;
* **xfail**: a known deviation changed (``xfailed → xpassed``: the vendor fixed it or the entry is stale;
  ``xpassed → xfailed``: it came back);
* **other**: any other change (passed → skipped, a new check, ...).

Checks are matched by ``id[case]``. Stale vendor-file entries (the report's warnings) are compared too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

BAD = frozenset({"failed", "error"})


def check_key(check: dict[str, Any]) -> str:
    """``ID[case]`` (or ``ID``): how a check is matched across reports."""
    return f"{check['id']}[{check['case']}]" if check.get("case") else str(check["id"])


@dataclass(frozen=True)
class Change:
    key: str
    old: str | None  # None: not in the old report
    new: str | None  # None: not in the new report
    kind: str  # regression | improvement | xfail | other
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.key, "old": self.old, "new": self.new, "kind": self.kind, "message": self.message}


@dataclass
class ReportDiff:
    old_label: str
    new_label: str
    changes: list[Change] = field(default_factory=list)
    unchanged: int = 0
    stale_xfails_added: list[str] = field(default_factory=list)
    stale_xfails_removed: list[str] = field(default_factory=list)
    verdicts: tuple[str, str] = ("", "")

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.kind == "regression"]

    @property
    def changed(self) -> bool:
        return bool(self.changes or self.stale_xfails_added or self.stale_xfails_removed)

    def as_dict(self) -> dict[str, Any]:
        return {"old": self.old_label, "new": self.new_label, "verdicts": list(self.verdicts),
                "unchanged": self.unchanged, "regressions": len(self.regressions),
                "changes": [c.as_dict() for c in self.changes],
                "stale_xfails_added": self.stale_xfails_added, "stale_xfails_removed": self.stale_xfails_removed}


def classify(old: str | None, new: str | None) -> str:
    """The kind of an outcome change (see the module docstring)."""
    if new is None:
        return "regression" if old not in (None, "skipped") else "other"
    if new in BAD and old not in BAD:
        return "regression"
    if old in BAD and new not in BAD:
        return "improvement"
    if {old, new} == {"xfailed", "xpassed"}:
        return "xfail"
    return "other"


def _label(report: dict[str, Any]) -> str:
    eng = report.get("engine", {})
    return f"{eng.get('name', '?')} {eng.get('version', '?')}"


def _stale(report: dict[str, Any]) -> set[str]:
    return {w for w in report.get("warnings", []) if "matches no collected check" in w}


def diff_reports(old: dict[str, Any], new: dict[str, Any]) -> ReportDiff:
    """Every check whose outcome differs between ``old`` and ``new`` (report dicts of the published schema)."""
    a = {check_key(c): c for c in old.get("checks", [])}
    b = {check_key(c): c for c in new.get("checks", [])}
    out = ReportDiff(_label(old), _label(new),
                     verdicts=(str(old.get("summary", {}).get("verdict", "")),
                               str(new.get("summary", {}).get("verdict", ""))))
    for key in sorted(a.keys() | b.keys()):
        o = a[key]["outcome"] if key in a else None
        n = b[key]["outcome"] if key in b else None
        if o == n:
            out.unchanged += 1
            continue
        msg = str((b.get(key) or a.get(key) or {}).get("message", "")).split("\n", 1)[0][:300]
        out.changes.append(Change(key, o, n, classify(o, n), msg))
    stale_a, stale_b = _stale(old), _stale(new)
    out.stale_xfails_added = sorted(stale_b - stale_a)
    out.stale_xfails_removed = sorted(stale_a - stale_b)
    return out


def render_markdown(diffs: Iterable[ReportDiff]) -> str:
    """One Markdown section per diff: counts, then a table of every change (regressions first)."""
    order = {"regression": 0, "improvement": 1, "xfail": 2, "other": 3}
    lines: list[str] = []
    for d in diffs:
        lines.append(f"### {d.old_label} → {d.new_label}")
        lines.append("")
        lines.append(f"verdict {d.verdicts[0] or '?'} → {d.verdicts[1] or '?'}; {len(d.changes)} changed "
                     f"({len(d.regressions)} regressions), {d.unchanged} unchanged")
        lines.append("")
        if d.changes:
            lines.append("| kind | check | old | new | message |")
            lines.append("| --- | --- | --- | --- | --- |")
            for c in sorted(d.changes, key=lambda c: (order[c.kind], c.key)):
                msg = c.message.replace("|", "\\|")
                lines.append(f"| {c.kind} | `{c.key}` | {c.old or '—'} | {c.new or '—'} | {msg} |")
            lines.append("")
        for title, items in (("new stale vendor entries", d.stale_xfails_added),
                             ("stale vendor entries gone", d.stale_xfails_removed)):
            if items:
                lines.append(f"{title}:")
                lines.extend(f"- {w}" for w in items)
                lines.append("")
    return "\n".join(lines)
