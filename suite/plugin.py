"""pytest plugin (entry point ``pytest11: fp8rl``): runs the conformance checks against an engine and reports.

Options: ``--fp8rl-engine NAME`` (repeatable: several engines are run side by side, one fixture instance per
engine and xdist worker), ``--fp8rl-profile {ci,full,nightly,mutants}``, ``--fp8rl-xfails FILE``,
``--fp8rl-skips FILE``, ``--fp8rl-seed N``, ``--fp8rl-report-dir DIR``.

The plugin is inert for test items that are not fp8rl checks, so having fp8rl installed does not change anybody
else's pytest run. Outcomes: an assertion failure is ``failed``; an engine that raises, returns the wrong
shape/dtype/None/NaN or times out is ``error``; missing capabilities are ``skipped`` with the engine's reason.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fp8rl.checks import CURRENT_METRICS, CheckSpec
from fp8rl.engine import EngineError
from fp8rl.runner import MUTANT_MATRICES
from fp8rl.strategies import RUN_PROFILES as PROFILES  # run profile → hypothesis profile

DEFAULT_ENGINE = "reference"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fp8rl", "fp8rl conformance")
    group.addoption("--fp8rl-engine", action="append", default=None, metavar="NAME",
                    help="engine under test: built-in name, mutant:<name>, entry point, or pkg.module:factory "
                         "(repeatable)")
    group.addoption("--fp8rl-profile", default=None, choices=sorted(PROFILES),
                    help="check depth: ci (derandomized, fast), full, nightly (10x examples), mutants (no shrink)")
    group.addoption("--fp8rl-xfails", default=None, metavar="FILE", help="vendor xfails file (id prefix # reason)")
    group.addoption("--fp8rl-skips", default=None, metavar="FILE", help="vendor skips file (id prefix # reason)")
    group.addoption("--fp8rl-seed", default=0, type=int, help="seed of the fixed-case random inputs")
    group.addoption("--fp8rl-report-dir", default=None, metavar="DIR", help="write report.json/junit/md/html here")
    group.addoption("--fp8rl-gpu-per-worker", action="store_true",
                    help="under pytest-xdist, pin each worker to one GPU (CUDA_VISIBLE_DEVICES = worker mod #GPUs)")
    group.addoption("--fp8rl-mutant-matrix", default="declared", choices=list(MUTANT_MATRICES),
                    help="mutant engines run against: the checks each mutant declares as its killers (declared, "
                         "the default), its area's checks (area), or every check (full)")
    group.addoption("--fp8rl-threads", default=1, type=int, metavar="N",
                    help="torch intra-op CPU threads during a conformance run (default 1: checks use small "
                         "tensors, and xdist provides the parallelism)")
    group.addoption("--fp8rl-timeout", default=None, type=float, metavar="S",
                    help="override every check's timeout (seconds); a check that runs longer is an error")


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else the devices ``nvidia-smi -L`` lists."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_for_worker(worker_id: str, gpus: list[str]) -> str | None:
    """xdist worker id ("gw3") → the GPU it is pinned to (round robin), or None without GPUs."""
    if not gpus or not worker_id.startswith("gw"):
        return None
    return gpus[int(worker_id[2:]) % len(gpus)]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fp8rl_check(spec): an fp8rl conformance check (set by @check)")
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker and config.getoption("--fp8rl-gpu-per-worker"):
        gpu = gpu_for_worker(worker, visible_gpus())
        if gpu is not None:  # before any engine touches CUDA in this worker
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    profile = config.getoption("--fp8rl-profile")
    if profile or config.getoption("--fp8rl-engine"):
        import torch

        torch.set_num_threads(max(1, config.getoption("--fp8rl-threads")))
    if profile:
        from fp8rl import strategies

        strategies.register_profiles()
        strategies.load_profile(PROFILES[profile])
    config._fp8rl_state = _RunState(config)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------------------------
# vendor xfail / skip files


def parse_id_file(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Parse a vendor file: one check-id prefix per line, then ``# reason``. Blank/comment lines are ignored.

    A line without a reason is an error: every xfail/skip must say why.
    """
    entries = []
    p = Path(path)
    if not p.is_file():
        raise pytest.UsageError(f"fp8rl: id file {str(p)!r} does not exist")
    for lineno, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        prefix, sep, reason = line.partition("#")
        prefix, reason = prefix.strip(), reason.strip()
        if not sep or not reason:
            raise pytest.UsageError(f"fp8rl: {p}:{lineno}: entry {prefix!r} has no '# reason'")
        entries.append((prefix, reason))
    return entries


def _item_engine(item: pytest.Item, config: pytest.Config) -> str:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "engine_name" in callspec.params:
        return str(callspec.params["engine_name"])
    return engine_names(config)[0]


def _deselect_for_mutants(config: pytest.Config, items: list[pytest.Item], checks: list, matrix: str) -> list:
    """For a mutant engine keep only the checks the matrix selects: its declared killers (``declared``) or its
    area's checks (``area``); other engines keep every check."""
    from fp8rl.mutants import MUTANTS

    def wanted(name: str, spec: CheckSpec) -> bool:
        mut = MUTANTS.get(name.split(":", 1)[1]) if name.startswith("mutant:") else None
        if mut is None:
            return True
        return spec.id in mut.kills if matrix == "declared" else spec.area == mut.area

    keep, drop = [], []
    for it, spec in checks:
        (keep if wanted(_item_engine(it, config), spec) else drop).append((it, spec))
    if drop:
        dropped = {id(it) for it, _ in drop}
        config.hook.pytest_deselected(items=[it for it, _ in drop])
        items[:] = [it for it in items if id(it) not in dropped]
    return keep


def _item_spec(item: pytest.Item) -> CheckSpec | None:
    mark = item.get_closest_marker("fp8rl_check")
    return mark.kwargs["spec"] if mark else None


def _matches(prefix: str, spec: CheckSpec, item: pytest.Item) -> bool:
    return spec.id.startswith(prefix) or item.nodeid.startswith(prefix) or f"{spec.id}[{_case(item)}]".startswith(prefix)


def _case(item: pytest.Item) -> str:
    """The check's parameter id, without the engine parameter of multi-engine runs."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ""
    case = callspec.id
    if "engine_name" in callspec.params:
        engine_id = f"engine={callspec.params['engine_name']}"
        parts = case.split(engine_id, 1)
        case = "-".join(p.strip("-") for p in parts if p.strip("-"))
    return case


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    checks = [(it, _item_spec(it)) for it in items]
    checks = [(it, s) for it, s in checks if s is not None]
    if not checks:
        return
    matrix = config.getoption("--fp8rl-mutant-matrix")
    if matrix != "full":
        checks = _deselect_for_mutants(config, items, checks, matrix)
    state: _RunState = config._fp8rl_state  # type: ignore[attr-defined]
    for opt, marker in (("--fp8rl-xfails", "xfail"), ("--fp8rl-skips", "skip")):
        path = config.getoption(opt)
        if not path:
            continue
        for prefix, reason in parse_id_file(path):
            hit = False
            for it, spec in checks:
                if _matches(prefix, spec, it):
                    hit = True
                    if marker == "xfail":
                        it.add_marker(pytest.mark.xfail(reason=f"vendor xfail: {reason}", strict=False))
                    else:
                        it.add_marker(pytest.mark.skip(reason=f"vendor skip: {reason}"))
            if not hit:
                msg = f"fp8rl: {opt[8:]} entry {prefix!r} matches no collected check (stale entry?)"
                warnings.warn(msg, stacklevel=1)
                state.warnings.append(msg)
    timeout = config.getoption("--fp8rl-timeout")
    for it, spec in checks:
        if timeout:
            it.add_marker(pytest.mark.timeout(timeout), append=False)
        it.user_properties.append(("fp8rl_check", {"id": spec.id, "area": spec.area, "title": spec.title,
                                                   "bound": spec.bound, "case": _case(it),
                                                   "engine": _item_engine(it, config)}))


# ----------------------------------------------------------------------------------------------------------------
# engines: parametrize the `engine` fixture over every --fp8rl-engine given


def engine_names(config: pytest.Config) -> list[str]:
    return config.getoption("--fp8rl-engine") or [DEFAULT_ENGINE]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine" in metafunc.fixturenames and metafunc.definition.get_closest_marker("fp8rl_check"):
        names = engine_names(metafunc.config)
        if len(names) > 1:
            metafunc.parametrize("engine_name", names, scope="session", ids=[f"engine={n}" for n in names])


# ----------------------------------------------------------------------------------------------------------------
# outcome classification and metrics


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if _item_spec(item) is None:
        yield
        return
    metrics: dict = {}
    token = CURRENT_METRICS.set(metrics)
    try:
        yield
    finally:
        CURRENT_METRICS.reset(token)
        if metrics:
            item.user_properties.append(("fp8rl_metrics", metrics))


def _is_engine_error(exc: BaseException) -> bool:
    if isinstance(exc, EngineError):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_engine_error(e) or not isinstance(e, AssertionError) for e in exc.exceptions)
    if isinstance(exc, AssertionError):
        return False
    if isinstance(exc, pytest.fail.Exception):
        return "Timeout" in str(exc)
    return True  # any other exception inside a check (engine or harness) is an error, not a verdict


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if _item_spec(item) is None or call.excinfo is None or call.when != "call":
        return
    if report.failed and _is_engine_error(call.excinfo.value):
        report.user_properties.append(("fp8rl_outcome", "error"))


# ----------------------------------------------------------------------------------------------------------------
# collecting results and writing the report


class _RunState:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self.started_at = datetime.now(UTC).isoformat()
        self.warnings: list[str] = []

    def record(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        meta = props.get("fp8rl_check")
        if meta is None:
            return
        entry = self.results.setdefault(report.nodeid, {
            **meta, "nodeid": report.nodeid, "outcome": "passed", "message": "", "duration_s": 0.0,
            "metrics": {}})
        entry["duration_s"] += float(report.duration)
        if "fp8rl_metrics" in props:
            metrics = dict(props["fp8rl_metrics"])
            entry["sections"] = metrics.pop("_sections", {})
            entry["metrics"] = metrics
        wasxfail = getattr(report, "wasxfail", None)
        if report.when == "setup":
            if report.skipped:
                entry["outcome"], entry["message"] = "skipped", _skip_reason(report)
            elif report.failed:
                entry["outcome"], entry["message"] = "error", _message(report)
        elif report.when == "call":
            if report.skipped and wasxfail is not None:
                entry["outcome"], entry["message"] = "xfailed", f"{wasxfail}\n{_message(report)}".strip()
            elif report.skipped:
                entry["outcome"], entry["message"] = "skipped", _skip_reason(report)
            elif report.passed and wasxfail is not None:
                entry["outcome"], entry["message"] = "xpassed", str(wasxfail)
            elif report.failed:
                entry["outcome"] = props.get("fp8rl_outcome", "failed")
                entry["message"] = _message(report)
                if "fp8rl_seed" in props:
                    entry["message"] += (f"\n[reproduce: seed {props['fp8rl_seed']} (run seed "
                                         f"{self.config.getoption('--fp8rl-seed')}); pytest {report.nodeid}]")
        elif report.when == "teardown" and report.failed and entry["outcome"] == "passed":
            entry["outcome"], entry["message"] = "error", _message(report)


def _skip_reason(report: pytest.TestReport) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = report.longreprtext or ""
    # keep the assertion message (our repro) and the tail of the traceback, bounded in size
    if crash is not None and crash.message:
        msg = crash.message
        if len(msg) < 200 and "\nE   " in text:
            msg = "\n".join(line[4:] for line in text.splitlines() if line.startswith("E   "))
        return msg[:4000]
    return text[-4000:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    state = _STATE.get("state")
    if state is not None:
        state.record(report)


_STATE: dict[str, _RunState] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _STATE["state"] = session.config._fp8rl_state  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # xdist worker: the controller writes the report
        return
    state: _RunState | None = _STATE.pop("state", None)
    out_dir = config.getoption("--fp8rl-report-dir")
    if state is None or not out_dir:
        return
    from fp8rl.runner import build_report, write_results

    report = build_report(state.results, engines=engine_names(config),
                          profile=config.getoption("--fp8rl-profile") or "ci",
                          seed=config.getoption("--fp8rl-seed"), started_at=state.started_at,
                          duration_s=time.time() - state.started, command=sys.argv,
                          warnings=state.warnings)
    write_results(report, Path(out_dir))


__all__ = ["PROFILES", "engine_names", "parse_id_file"]
