"""The kill matrix: every mutant declares the checks that must kill it (``@mutant(..., kills=...)``), and one run of
``fp8rl mutants`` (each mutant against exactly its declared killers) proves every declaration. A mutant that
survives a declared killer fails; so does a declared check id that does not exist."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from fp8rl.checks import all_checks
from fp8rl.cli import main
from fp8rl.mutants import AREA_MODULES, MUTANTS, killers_by_check, make_mutant


@pytest.fixture(scope="module")
def checks() -> dict:
    return all_checks()


def test_mutants_are_registered_with_descriptions_and_areas():
    assert len(MUTANTS) >= 40
    areas = {m.__name__.rsplit(".", 1)[-1] for m in AREA_MODULES}
    for name, m in MUTANTS.items():
        eng = make_mutant(name)
        assert eng.name == f"mutant:{name}" and m.description and m.area in areas and m.kills


def test_unknown_mutant_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown mutant 'nope'"):
        make_mutant("nope")


def test_declared_killers_exist_and_every_area_kills(checks):
    unknown = {(n, cid) for n, m in MUTANTS.items() for cid in m.kills if cid not in checks}
    assert not unknown, f"mutants declare killers that are not check ids: {sorted(unknown)}"
    # every area's checks kill at least one mutant, and each mutant is killed by a check of its own area
    killing_areas = {checks[cid].area for cid in killers_by_check()}
    assert {spec.area for spec in checks.values()} <= killing_areas
    for name, m in MUTANTS.items():
        assert m.area in {checks[cid].area for cid in m.kills}, (name, m.kills)


def test_kill_matrix_is_shown_per_check(checks, capsys):
    assert main(["checks", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    by_check = killers_by_check()
    for cid, row in rows.items():
        assert row["kills"] == sorted(by_check.get(cid, [])), cid
    assert sum(len(r["kills"]) for r in rows.values()) == sum(len(m.kills) for m in MUTANTS.values())


def test_every_mutant_is_killed_by_every_declared_killer(tmp_path):
    """The generic kill-matrix test: ``fp8rl mutants`` (matrix ``declared``) on every mutant."""
    r = subprocess.run([sys.executable, "-m", "fp8rl", "mutants", "--out", str(tmp_path), "-n", "2"],
                       capture_output=True, text=True, timeout=1800)
    rows = {row["mutant"]: row for row in json.loads((tmp_path / "mutants.json").read_text())}
    assert set(rows) == set(MUTANTS)
    survivors = {n: row["survived_declared"] for n, row in rows.items() if row["survived_declared"]}
    assert not survivors, f"mutants that survived declared killers: {survivors}\n{r.stdout[-3000:]}"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["kind"] == "mutants" and report["mutation_score"] == 1.0
    assert Counter(c["outcome"] for c in report["checks"]) == Counter({"passed": len(MUTANTS)})
