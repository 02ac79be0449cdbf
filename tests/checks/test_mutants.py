"""Mutation testing of the checks: every fault-injected engine must be killed, and every check area must kill
something (a check that kills no mutant is not a check)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fp8rl.mutants import MUTANTS, make_mutant


def test_mutants_are_registered_with_descriptions():
    assert len(MUTANTS) >= 12
    for name, m in MUTANTS.items():
        eng = make_mutant(name)
        assert eng.name == f"mutant:{name}" and m.description and m.area


def test_unknown_mutant_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown mutant 'nope'"):
        make_mutant("nope")


@pytest.mark.slow
def test_fp8rl_mutants_kills_every_mutant(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fp8rl", "mutants", "--out", str(tmp_path), "-n", "2"],
                       capture_output=True, text=True, timeout=1800)
    rows = json.loads((tmp_path / "mutants.json").read_text())
    survivors = [row["mutant"] for row in rows if not row["killed"]]
    assert not survivors, f"surviving mutants: {survivors}\n{r.stdout[-3000:]}"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert {row["mutant"] for row in rows} == set(MUTANTS)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["kind"] == "mutants" and report["mutation_score"] == 1.0
    # every mutant is killed by a check of its own area (not only by a side effect elsewhere)
    listing = subprocess.run([sys.executable, "-m", "fp8rl", "checks", "--json"], capture_output=True, text=True)
    area_of = {c["id"]: c["area"] for c in json.loads(listing.stdout)}
    for row in rows:
        areas = {area_of.get(cid) for cid in row["killed_by"]}
        assert MUTANTS[row["mutant"]].area in areas, (row["mutant"], row["killed_by"])
    # and every area's checks kill at least one mutant
    killing_areas = {area_of[cid] for row in rows for cid in row["killed_by"]}
    assert set(area_of.values()) <= killing_areas, set(area_of.values()) - killing_areas
