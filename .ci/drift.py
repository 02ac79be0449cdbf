"""Drift report of ``nox -s upstream``: each tier run from its lock and from the latest allowed versions.

    python .ci/drift.py fp8rl-upstream [TIER ...]

Reads ``<root>/{locked,latest}/<tier>/`` (``freeze.txt``: pip freeze; ``failed.json``: commands that exited
non-zero; ``fp8rl-report*/report.json``: conformance runs; ``pytest-*.xml``: JUnit of the suite's own tests) and
writes ``<root>/drift.md`` and ``drift.json``:

* packages whose version moved (added, removed, changed);
* per conformance run, every check whose outcome changed (``fp8rl.reports.diff``: regressions, improvements,
  xfail changes such as a vendor xfail that now passes, stale vendor entries);
* the suite's own tests whose outcome changed, the ones that pin an upstream behaviour (``upstream_pin``) first;
* commands that failed in one mode only.

Exit status: 0 when nothing but versions moved, 1 otherwise (the nightly job's own failure, never main's).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from fp8rl.reports import load_report
from fp8rl.reports.diff import diff_reports, render_markdown

MODES = ("locked", "latest")


def read_freeze(path: Path) -> dict[str, str]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            name, sep, version = line.partition("==")
            if sep:
                out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def version_moves(old: dict[str, str], new: dict[str, str]) -> list[dict[str, str | None]]:
    return [{"package": p, "locked": old.get(p), "latest": new.get(p)}
            for p in sorted(old.keys() | new.keys()) if old.get(p) != new.get(p)]


def read_junit(tier_dir: Path) -> dict[str, dict[str, str]]:
    """test id → {"outcome", "pin"} over every pytest-*.xml of a tier."""
    out: dict[str, dict[str, str]] = {}
    for xml in sorted(tier_dir.glob("pytest-*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            tid = f"{case.get('classname')}::{case.get('name')}"
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
            pin = ""
            for prop in case.iter("property"):
                if prop.get("name") == "upstream_pin":
                    pin = str(prop.get("value"))
            out[tid] = {"outcome": outcome, "pin": pin}
    return out


def reports(tier_dir: Path) -> dict[str, dict]:
    return {p.parent.name: load_report(p) for p in sorted(tier_dir.glob("fp8rl-report*/report.json"))}


def tier_drift(root: Path, tier: str) -> dict:
    dirs = {m: root / m / tier for m in MODES}
    missing = [str(d) for d in dirs.values() if not d.is_dir()]
    if missing:
        return {"tier": tier, "error": f"not run: {missing}"}
    versions = version_moves(read_freeze(dirs["locked"] / "freeze.txt"), read_freeze(dirs["latest"] / "freeze.txt"))
    rep = {m: reports(d) for m, d in dirs.items()}
    diffs, runs_missing = [], []
    for run in sorted(rep["locked"].keys() | rep["latest"].keys()):
        if run not in rep["locked"] or run not in rep["latest"]:
            runs_missing.append(f"{run}: report only in {'locked' if run in rep['locked'] else 'latest'}")
            continue
        diffs.append(diff_reports(rep["locked"][run], rep["latest"][run]))
    junit = {m: read_junit(d) for m, d in dirs.items()}
    tests = []
    for tid in sorted(junit["locked"].keys() | junit["latest"].keys()):
        a, b = junit["locked"].get(tid), junit["latest"].get(tid)
        if (a or {}).get("outcome") != (b or {}).get("outcome"):
            tests.append({"test": tid, "locked": (a or {}).get("outcome"), "latest": (b or {}).get("outcome"),
                          "pin": (a or b or {}).get("pin", "")})
    tests.sort(key=lambda t: (not t["pin"], t["test"]))
    failed = {m: json.loads((d / "failed.json").read_text()) if (d / "failed.json").is_file() else []
              for m, d in dirs.items()}
    only = {m: sorted(set(failed[m]) - set(failed[o])) for m, o in (("locked", "latest"), ("latest", "locked"))}
    return {"tier": tier, "versions": versions, "check_diffs": [d.as_dict() for d in diffs], "_diffs": diffs,
            "runs_missing": runs_missing, "tests": tests, "failed_only_in": only}


def changed_beyond_versions(t: dict) -> bool:
    return bool(t.get("error") or t["runs_missing"] or t["tests"] or t["failed_only_in"]["locked"]
                or t["failed_only_in"]["latest"] or any(d.changed for d in t["_diffs"]))


def render(tiers: list[dict]) -> str:
    lines = ["# Upstream drift: locked vs latest allowed versions", ""]
    lines.append("| tier | packages moved | checks changed | regressions | own tests changed (pinned) | verdict |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for t in tiers:
        if t.get("error"):
            lines.append(f"| {t['tier']} | — | — | — | — | {t['error']} |")
            continue
        n_changed = sum(len(d.changes) for d in t["_diffs"])
        n_reg = sum(len(d.regressions) for d in t["_diffs"])
        pinned = sum(1 for x in t["tests"] if x["pin"])
        verdict = "changed" if changed_beyond_versions(t) else "versions only" if t["versions"] else "no drift"
        lines.append(f"| {t['tier']} | {len(t['versions'])} | {n_changed} | {n_reg} | {len(t['tests'])} ({pinned}) "
                     f"| {verdict} |")
    for t in tiers:
        if t.get("error"):
            continue
        lines += ["", f"## {t['tier']}", ""]
        if t["versions"]:
            lines += ["| package | locked | latest |", "| --- | --- | --- |"]
            lines += [f"| {v['package']} | {v['locked'] or '—'} | {v['latest'] or '—'} |" for v in t["versions"]]
            lines.append("")
        else:
            lines += ["no package moved", ""]
        changed = [d for d in t["_diffs"] if d.changed]
        lines.append(render_markdown(changed) if changed else "no check outcome changed")
        if t["tests"]:
            lines += ["", "| own test | locked | latest | pins |", "| --- | --- | --- | --- |"]
            lines += [f"| `{x['test']}` | {x['locked'] or '—'} | {x['latest'] or '—'} | {x['pin'] or '—'} |"
                      for x in t["tests"]]
        for mode, cmds in t["failed_only_in"].items():
            for c in cmds:
                lines.append(f"- failed only {mode}: `{c}`")
        for m in t["runs_missing"]:
            lines.append(f"- {m}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    root = Path(argv[0])
    names = argv[1:] or sorted(p.name for p in (root / "locked").iterdir() if p.is_dir())
    tiers = [tier_drift(root, n) for n in names]
    (root / "drift.md").write_text(render(tiers))
    (root / "drift.json").write_text(json.dumps([{k: v for k, v in t.items() if k != "_diffs"} for t in tiers],
                                                indent=2))
    changed = [t["tier"] for t in tiers if changed_beyond_versions(t)]
    print((root / "drift.md").read_text())
    print(f"drift report: {root / 'drift.md'}; " + (f"changed beyond versions: {changed}" if changed
                                                       else "nothing but versions moved"))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
