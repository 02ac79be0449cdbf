"""The checks × seeds table of a seed sweep (``fp8rl conformance --seeds A..B``).

A correct engine must pass every check at every seed: a cell that is not ``passed``/``skipped``/``xfailed`` is a
false alarm of the suite (or a real, seed-dependent finding) and is listed first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .diff import check_key

_OK = ("passed", "skipped", "xfailed")
_SHORT = {"passed": ".", "skipped": "s", "xfailed": "x", "xpassed": "X", "failed": "F", "error": "E",
          "not_run": "-"}


def sweep_table(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``{"seeds": [...], "rows": [{"check", "outcomes": [per seed]}], "verdicts": {seed: verdict}}``; rows that
    did not pass on every seed first."""
    seeds = sorted(runs)
    keys: dict[str, dict[int, str]] = {}
    for seed in seeds:
        for c in runs[seed]["checks"]:
            keys.setdefault(check_key(c), {})[seed] = c["outcome"]
    rows = [{"check": k, "outcomes": [by_seed.get(s, "not_run") for s in seeds]} for k, by_seed in keys.items()]
    rows.sort(key=lambda r: (all(o in _OK for o in r["outcomes"]), r["check"]))
    return {"seeds": seeds, "rows": rows,
            "verdicts": {str(s): runs[s]["summary"]["verdict"] for s in seeds},
            "engine": next(iter(runs.values()))["engine"] if runs else {},
            "profile": next(iter(runs.values()))["profile"] if runs else None}


def write_sweep(table: dict[str, Any], out_dir: Path, *, wall_s: float) -> dict[str, Path]:
    """``sweep.json`` and ``sweep.md`` (a compact grid: . passed, s skipped, x xfailed, F failed, E error, - not run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = table["seeds"]
    bad = [r for r in table["rows"] if any(o not in _OK for o in r["outcomes"])]
    false_alarms = sum(1 for r in table["rows"] for o in r["outcomes"] if o not in _OK)
    lines = [f"# Seed sweep: {table['engine'].get('name', '?')} {table['engine'].get('version', '')}", "",
             f"seeds {seeds[0] if seeds else '-'}..{seeds[-1] if seeds else '-'} ({len(seeds)}), profile "
             f"{table['profile']}, {len(table['rows'])} checks, {false_alarms} cell(s) not passing, "
             f"{len(bad)} check(s) affected; wall {wall_s:.0f} s", "",
             "verdicts: " + ", ".join(f"{s}: {v}" for s, v in table["verdicts"].items()), "",
             "| check | " + " | ".join(str(s) for s in seeds) + " |",
             "| --- | " + " | ".join("---" for _ in seeds) + " |"]
    lines += [f"| `{r['check']}` | " + " | ".join(_SHORT.get(o, o) for o in r["outcomes"]) + " |"
              for r in table["rows"]]
    paths = {"json": out_dir / "sweep.json", "md": out_dir / "sweep.md"}
    paths["json"].write_text(json.dumps({**table, "wall_s": round(wall_s, 1), "cells_not_passing": false_alarms},
                                        indent=2))
    paths["md"].write_text("\n".join(lines) + "\n")
    return paths


__all__ = ["sweep_table", "write_sweep"]
