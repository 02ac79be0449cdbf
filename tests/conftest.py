"""Test-suite configuration: hypothesis profiles (``FP8RL_HYPOTHESIS_PROFILE``; ``ci`` when ``CI`` is set) and the
``upstream_pin`` mark (tests/support/upstream.py), written into each pinned test's JUnit properties."""

import pytest
from fp8rl.strategies import load_profile_from_env

HYPOTHESIS_PROFILE = load_profile_from_env()
pytest_plugins = ("pytester",)  # tests of pytest marks run a pytest in a temporary directory


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "upstream_pin(package, spec, behaviour): the test pins a third-party "
                                       "package's behaviour, verified for versions in spec")


#: the longest tests (wall s measured in CI's test job: -n 3 on 2 cores), started first, in pairs per xdist worker
#: (addopts' --maxschedchunk 2 hands each worker two tests at a time: worker 1 gets the first two, worker 2 the next
#: two, ...), so that none of them starts in the last minutes and holds the run's end (longest-first scheduling)
HEAVY_FIRST = (
    "tests/checks/test_mutants.py::test_every_mutant_is_killed_by_every_declared_killer",  # 175 (2 processes)
    "tests/checks/test_kv_conformance.py::test_reference_and_torch_pass_kv_area",  # 24
    "tests/checks/test_coverage.py::test_reference_run_at_ci_exercises_every_class",  # 140: the shared reference run
    "tests/harness/test_harness.py::test_hanging_engine_times_out_as_error_and_run_continues",  # 29
    "tests/harness/test_reliability.py::test_seed_sweep_writes_a_checks_by_seeds_table",  # 41
    "tests/harness/test_harness.py::test_conformance_torch_passes_or_documented_xfails",  # 34
)


def _run_order(item: pytest.Item) -> tuple[int, int]:
    """Heavy tests first (in HEAVY_FIRST's order), the other readers of the shared reference run last (by then it
    has ended: they don't hold a worker waiting on its lock), everything else in collection order."""
    if item.nodeid in HEAVY_FIRST:
        return 0, HEAVY_FIRST.index(item.nodeid)
    return (2, 0) if "reference_ci_run" in getattr(item, "fixturenames", ()) else (1, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for mark in item.iter_markers("upstream_pin"):
            item.user_properties.append(("upstream_pin", f"{mark.kwargs['package']}{mark.kwargs['spec']}"))
    items.sort(key=_run_order)  # stable: the same order on every xdist worker


@pytest.fixture(scope="session")
def reference_ci_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str):
    """One ``fp8rl conformance --engine reference -n 2`` run (every area, ``--profile ci``; two xdist workers, so
    the coverage section is merged across workers), shared by every test that
    reads its report (the harness's conformant-verdict test and the input-space coverage meta-test): a full
    reference run costs minutes of CPU on CI's two cores, and its outcome doesn't depend on who asked. Under
    pytest-xdist the workers share it through the session's common temp directory, under a file lock.

    Returns ``(returncode, stdout, report_dir)``."""
    import json
    import subprocess
    import sys

    from filelock import FileLock
    from support import REPO_ROOT

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # the directory every worker's basetemp lives in
    out, done = root / "reference-ci-run", root / "reference-ci-run.json"
    with FileLock(str(root / "reference-ci-run.lock")):
        if not done.is_file():
            r = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", "reference",
                                "-n", "2", "--out", str(out)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=1800)
            done.write_text(json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}))
        rec = json.loads(done.read_text())
    return rec["returncode"], rec["stdout"] + rec["stderr"], out
