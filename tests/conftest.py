"""Test-suite configuration: hypothesis profiles (``FP8RL_HYPOTHESIS_PROFILE``; ``ci`` when ``CI`` is set) and the
``upstream_pin`` mark (tests/support/upstream.py), written into each pinned test's JUnit properties."""

import pytest
from fp8rl.strategies import load_profile_from_env

HYPOTHESIS_PROFILE = load_profile_from_env()
pytest_plugins = ("pytester",)  # tests of pytest marks run a pytest in a temporary directory


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "upstream_pin(package, spec, behaviour): the test pins a third-party "
                                       "package's behaviour, verified for versions in spec")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for mark in item.iter_markers("upstream_pin"):
            item.user_properties.append(("upstream_pin", f"{mark.kwargs['package']}{mark.kwargs['spec']}"))


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
