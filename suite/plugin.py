"""pytest plugin (entry point ``pytest11: fp8rl``): runs the conformance checks against an engine and reports.

Options: ``--fp8rl-engine NAME`` (repeatable: several engines are run side by side, one fixture instance per
engine and xdist worker), ``--fp8rl-profile {ci,full,nightly,mutants}``, ``--fp8rl-xfails FILE``,
``--fp8rl-skips FILE``, ``--fp8rl-seed N``, ``--fp8rl-report-dir DIR``.

The plugin is inert for test items that are not fp8rl checks, so having fp8rl installed does not change anybody
else's pytest run. Outcomes: an assertion failure is ``failed``; an engine that raises, returns the wrong
shape/dtype/None/NaN or times out is ``error``; missing capabilities are ``skipped`` with the engine's reason.

A run is only as good as its end: with ``--fp8rl-report-dir`` the controller journals every planned, started and
finished check (:mod:`fp8rl.journal`); SIGINT and SIGTERM end the run promptly with a report whose ``status`` is
``interrupted`` and whose unfinished checks are ``not_run`` (never passed); under pytest-xdist a worker that dies
(abort, segfault, SIGKILL, a thread-method timeout) turns the check it was running into ``error`` naming the
signal and the engine op, and a fresh worker goes on. ``fp8rl conformance`` runs isolated by default (one xdist
worker) and supervises the whole pytest process (:mod:`fp8rl.runner`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fp8rl import journal as J
from fp8rl.checks import CURRENT_METRICS, CURRENT_OPS, REFUSED_PREFIX, CheckSpec
from fp8rl.engine import EngineError
from fp8rl.runner import MUTANT_MATRICES
from fp8rl.runner import RUN_PROFILES as PROFILES  # run profile → hypothesis profile
from fp8rl.vendor_files import entry_applies, entry_is_stale, matches, parse_id_file

DEFAULT_ENGINE = "reference"
#: set by ``fp8rl conformance`` in the pytest process it supervises
SUPERVISED_ENV = "FP8RL_SUPERVISED"


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
    group.addoption("--fp8rl-area", action="append", default=None, metavar="AREA",
                    help="only the checks of this area (repeatable); the report says the run is partial")
    group.addoption("--fp8rl-packaged-xfails", action="store_true",
                    help="without --fp8rl-xfails, use the vendor xfails file fp8rl ships for the engine, if any")


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else the devices ``nvidia-smi -L`` lists."""
    environ: Mapping[str, str] = os.environ if env is None else env
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
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
    fp8rl_run = bool(config.getoption("--fp8rl-profile") or config.getoption("--fp8rl-engine"))
    if fp8rl_run and worker:
        # the controller decides how a run ends: a worker ignores SIGINT/SIGTERM (the controller tears it down)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    elif fp8rl_run and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)  # SIGTERM ends the run like SIGINT: report, status interrupted
        if config.getoption("--fp8rl-report-dir"):
            trace = Path(config.getoption("--fp8rl-report-dir")) / J.TRACE_DIR_NAME
            os.environ[J.TRACE_ENV] = str(trace)  # inherited by xdist workers spawned after this
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
        strategies.seed_profile(int(config.getoption("--fp8rl-seed")))
    config._fp8rl_state = _RunState(config)  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------------------------
# vendor xfail / skip files: fp8rl.vendor_files


def _item_engine(item: pytest.Item, config: pytest.Config) -> str:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "engine_name" in callspec.params:
        return str(callspec.params["engine_name"])
    return engine_names(config)[0]


def _deselect_for_mutants(config: pytest.Config, items: list[pytest.Item], checks: list, matrix: str) -> list:
    """For a mutant engine keep only the checks the matrix selects: its declared killers (``declared``) or its
    area's checks (``area``); other engines keep every check."""
    from fp8rl.mutants import MUTANTS

    def wanted(it: pytest.Item, spec: CheckSpec) -> bool:
        name = _item_engine(it, config)
        mut = MUTANTS.get(name.split(":", 1)[1]) if name.startswith("mutant:") else None
        if mut is None:
            return True
        return spec.id in mut.kills if matrix == "declared" else spec.area == mut.area

    return _deselect(config, items, checks, wanted)


def _item_spec(item: pytest.Item) -> CheckSpec | None:
    mark = item.get_closest_marker("fp8rl_check")
    return mark.kwargs["spec"] if mark else None


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
    specs = [(it, _item_spec(it)) for it in items]
    checks: list[tuple[pytest.Item, CheckSpec]] = [(it, s) for it, s in specs if s is not None]
    if not checks:
        return
    matrix = config.getoption("--fp8rl-mutant-matrix")
    if matrix != "full":
        checks = _deselect_for_mutants(config, items, checks, matrix)
    areas = config.getoption("--fp8rl-area")
    if areas:
        checks = _deselect(config, items, checks, lambda it, spec: spec.area in areas)
    state: _RunState = config._fp8rl_state  # type: ignore[attr-defined]
    run_ids = {spec.id for _, spec in checks}
    known: list[set[str]] = []

    def _known_ids() -> set[str]:  # every check of the suite, imported once and only if an entry matched nothing
        if not known:
            from fp8rl.checks import all_checks

            known.append(set(all_checks()))
        return known[0]

    for opt, kind in (("--fp8rl-xfails", "xfail"), ("--fp8rl-skips", "skip")):
        # a packaged vendor file the controller resolved reaches an xdist worker through its workerinput
        path = config.getoption(opt) or getattr(config, "workerinput", {}).get(f"fp8rl_{kind}s")
        if not path:
            continue
        for prefix, reason in parse_id_file(path):
            if not entry_applies(reason, f"{path}: {prefix}"):
                continue  # scoped to machines this one is not (e.g. [when cpu:amx])
            hit = False
            for it, spec in checks:
                if matches(prefix, spec.id, it.nodeid, _case(it)):
                    hit = True
                    if kind == "xfail":
                        it.add_marker(pytest.mark.xfail(reason=f"vendor xfail: {reason}", strict=False))
                    else:
                        it.add_marker(pytest.mark.skip(reason=f"vendor skip: {reason}"))
            if not hit and entry_is_stale(prefix, [it.nodeid for it, _ in checks], _known_ids(), run_ids):
                msg = f"fp8rl: {opt[8:]} entry {prefix!r} matches no collected check (stale entry?)"
                warnings.warn(msg, stacklevel=1)
                state.warnings.append(msg)
    timeout = config.getoption("--fp8rl-timeout")
    for it, spec in checks:
        if timeout:
            it.add_marker(pytest.mark.timeout(timeout), append=False)
        tmark = it.get_closest_marker("timeout")
        meta = {"id": spec.id, "area": spec.area, "title": spec.title, "bound": spec.bound, "case": _case(it),
                "engine": _item_engine(it, config),
                "timeout_s": float(tmark.args[0]) if tmark and tmark.args else None}
        it.user_properties.append(("fp8rl_check", meta))


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """A check answers to its id and to ``ID[case]`` in ``-k`` (``fp8rl conformance -k QUANT-EXACT-002`` or
    ``-k 'KV-SPACE-001[dtype.x=fp16]'``), not only to its test function's name."""
    spec = _item_spec(item)
    if spec is not None:
        item.extra_keyword_matches.add(spec.id)
        case = _case(item)
        if case:
            item.extra_keyword_matches.add(f"{spec.id}[{case}]")


def _deselect(config: pytest.Config, items: list[pytest.Item], checks: list, keep_if) -> list:
    keep = [(it, spec) for it, spec in checks if keep_if(it, spec)]
    kept = {id(it) for it, _ in keep}
    drop = [it for it, _ in checks if id(it) not in kept]
    if drop:
        config.hook.pytest_deselected(items=drop)
        dropped = {id(d) for d in drop}
        items[:] = [it for it in items if id(it) not in dropped]
    return keep


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """The plan: every check left after all selection (-k, --fp8rl-area, the mutant matrix). In-process the
    controller journals it; an xdist worker hands it (with the metadata) to the controller through the trace
    directory, before xdist reports the collection: the controller then knows every check the run should have."""
    config = session.config
    state: _RunState | None = getattr(config, "_fp8rl_state", None)
    if state is None:
        return
    for it in session.items:
        props: dict[str, Any] = dict(it.user_properties)
        if props.get("fp8rl_check") is not None:
            state.planned[it.nodeid] = props["fp8rl_check"]
    worker = getattr(config, "workerinput", {}).get("workerid")
    if not worker:
        if state.journal is not None:
            state.journal.write("planned", checks=state.planned)
        return
    trace = os.environ.get(J.TRACE_ENV)
    if not trace:
        return
    path = Path(trace) / f"planned.{worker}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"planned": state.planned, "warnings": state.warnings}))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# engines: parametrize the `engine` fixture over every --fp8rl-engine given


def engine_names(config: pytest.Config) -> list[str]:
    return config.getoption("--fp8rl-engine") or [DEFAULT_ENGINE]


def _engines_for(spec: CheckSpec, names: list[str], matrix: str) -> list[str]:
    """The engines a check is generated for: every engine, except mutants the mutant matrix leaves out (a run over
    all mutants would otherwise collect every check once per mutant: 60,000 items, minutes of collection)."""
    from fp8rl.mutants import MUTANTS

    def wanted(name: str) -> bool:
        mut = MUTANTS.get(name.split(":", 1)[1]) if name.startswith("mutant:") else None
        if mut is None or matrix == "full":
            return True
        return spec.id in mut.kills if matrix == "declared" else spec.area == mut.area

    return [n for n in names if wanted(n)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    mark = metafunc.definition.get_closest_marker("fp8rl_check")
    if "engine" in metafunc.fixturenames and mark:
        names = engine_names(metafunc.config)
        if len(names) > 1:
            kept = _engines_for(mark.kwargs["spec"], names, metafunc.config.getoption("--fp8rl-mutant-matrix"))
            if not kept:  # no engine of this run takes the check: one deselected placeholder instead of none
                kept = names[:1]
            metafunc.parametrize("engine_name", kept, scope="session", ids=[f"engine={n}" for n in kept])


# ----------------------------------------------------------------------------------------------------------------
# outcome classification and metrics


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Record, for every phase of a check (its fixtures included), the engine ops it called, whose code each ran
    (the engine's own or the oracle's it inherits, :func:`fp8rl.checks.op_origin`), the cases the engine refused,
    and the capabilities the case needs: the report's scope (which declared capabilities the engine's own code was
    tested on) is built from them."""
    if _item_spec(item) is None:
        yield
        return
    store: dict = {}
    item.user_properties.append(("fp8rl_scope", store))
    token = CURRENT_OPS.set(store)
    try:
        yield
    finally:
        CURRENT_OPS.reset(token)


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


#: (mutant engine, check id) pairs this process has seen fail: the check kills the mutant
_KILLED: set[tuple[str, str]] = set()


def _mutant_kill_key(item: pytest.Item) -> tuple[str, str] | None:
    """(mutant, check id) in a kill-matrix run (``fp8rl mutants``: profile ``mutants``); None otherwise (a
    conformance run of a mutant engine reports every case)."""
    spec = _item_spec(item)
    if spec is None or item.config.getoption("--fp8rl-profile") != "mutants":
        return None
    name = _item_engine(item, item.config)
    return (name, spec.id) if name.startswith("mutant:") else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In a kill-matrix run a mutant is killed by a check as soon as one of the check's cases fails; the check's
    remaining cases on that mutant are skipped (they can't change the kill matrix, and they dominate its time)."""
    key = _mutant_kill_key(item)
    if key is not None and key in _KILLED:
        pytest.skip(f"{key[1]} already killed {key[0]} (an earlier case failed); the remaining cases can't change "
                    "the kill matrix")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if _item_spec(item) is None or call.excinfo is None or call.when != "call":
        return
    if report.failed:
        key = _mutant_kill_key(item)
        if key is not None:
            _KILLED.add(key)
    if report.failed and _is_engine_error(call.excinfo.value):
        report.user_properties.append(("fp8rl_outcome", "error"))


# ----------------------------------------------------------------------------------------------------------------
# collecting results and writing the report


class _RunState:
    """What the controller knows about the run: planned checks, results, engines, how the run ended."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        #: nodeid → check metadata of every check the run planned (in-process collection or the workers')
        self.planned: dict[str, dict[str, Any]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self.started_at = datetime.now(UTC).isoformat()
        self.warnings: list[str] = []
        #: engine name as given → the engine's description (name, version, capabilities, notes)
        self.engines: dict[str, dict[str, Any]] = {}
        #: why the run stopped early ("SIGINT", "SIGTERM", "maximum crashed workers reached", ...), or None
        self.interrupted: str | None = None
        self.crashed: str | None = None
        self.load_error: str | None = None
        self.journal: J.Journal | None = None
        self.trace_dir: Path | None = None

    def entry(self, nodeid: str, meta: dict[str, Any]) -> dict[str, Any]:
        return self.results.setdefault(nodeid, {
            **meta, "nodeid": nodeid, "outcome": "not_run", "message": "", "duration_s": 0.0, "metrics": {},
            "done": False})

    def finish(self, entry: dict[str, Any]) -> None:
        if not entry["done"]:
            entry["done"] = True
            if self.journal is not None:
                self.journal.write("result", **{k: v for k, v in entry.items() if k != "done"})

    def record(self, report: pytest.TestReport) -> None:
        props: dict[str, Any] = dict(report.user_properties)
        meta = props.get("fp8rl_check") or self.planned.get(report.nodeid)
        if meta is None:
            return
        entry = self.entry(report.nodeid, meta)
        entry["duration_s"] += float(report.duration or 0.0)
        scope = props.get("fp8rl_scope")
        if isinstance(scope, dict):
            entry["ops"] = {op: dict(row) for op, row in (scope.get("ops") or {}).items()}
            entry["requires"] = list(scope.get("requires") or [])
        if "fp8rl_metrics" in props:
            metrics = dict(props["fp8rl_metrics"])
            entry["sections"] = metrics.pop("_sections", {})
            entry["coverage"] = metrics.pop("_coverage", {})
            entry["metrics"] = metrics
        wasxfail = getattr(report, "wasxfail", None)
        if report.when == "???":  # xdist: the worker running this check died
            node = getattr(report, "node", None)
            worker = getattr(getattr(node, "gateway", None), "id", "?")
            if self.interrupted:  # the run was being stopped: the check did not finish, it did not fail
                entry["outcome"], entry["message"] = "not_run", f"interrupted ({self.interrupted}) while running"
            else:
                why = J.describe_death(self.trace_dir, worker, timeout_s=meta.get("timeout_s"))
                entry["outcome"] = "error"
                entry["message"] = (f"the worker process running this check died ({why}); a fresh worker ran the "
                                    f"remaining checks")
            self.finish(entry)
        elif report.when == "setup":
            if report.skipped:
                entry["outcome"], entry["message"] = "skipped", _skip_reason(report)
                entry["refused"] = entry["message"].startswith(REFUSED_PREFIX)
            elif report.failed:
                entry["outcome"], entry["message"] = "error", _message(report)
        elif report.when == "call":
            if report.skipped and wasxfail is not None:
                entry["outcome"], entry["message"] = "xfailed", f"{wasxfail}\n{_message(report)}".strip()
            elif report.skipped:
                entry["outcome"], entry["message"] = "skipped", _skip_reason(report)
                entry["refused"] = entry["message"].startswith(REFUSED_PREFIX)
            elif report.passed and wasxfail is not None:
                entry["outcome"], entry["message"] = "xpassed", str(wasxfail)
            elif report.passed:
                entry["outcome"] = "passed"
            elif report.failed:
                entry["outcome"] = props.get("fp8rl_outcome", "failed")
                entry["message"] = _message(report)
                if "fp8rl_seed" in props:
                    label = f"{entry['id']}[{entry['case']}]" if entry.get("case") else entry["id"]
                    entry["message"] += (f"\n[reproduce: seed {props['fp8rl_seed']} (run seed "
                                         f"{self.config.getoption('--fp8rl-seed')}); fp8rl conformance --engine "
                                         f"{entry['engine']} -k '{label}' --seed "
                                         f"{self.config.getoption('--fp8rl-seed')}]")
        elif report.when == "teardown":
            if report.failed and entry["outcome"] == "passed":
                entry["outcome"], entry["message"] = "error", _message(report)
            self.finish(entry)

    def final_results(self) -> dict[str, dict[str, Any]]:
        """Every planned check with its outcome; one that never finished is ``not_run`` (never passed)."""
        out: dict[str, dict[str, Any]] = {}
        for nodeid, meta in self.planned.items():
            e = dict(self.results.get(nodeid) or self.entry(nodeid, meta))
            if not e["done"]:
                reason = self.interrupted or self.crashed or "the run ended before this check"
                started = e["outcome"] != "not_run" or e["duration_s"] > 0
                e["outcome"] = "not_run"
                e["message"] = f"not run: {reason}" + (" (it was running)" if started else "")
            out[nodeid] = e
        for nodeid, e in self.results.items():  # results the plan did not know of (defensive: never dropped)
            out.setdefault(nodeid, e)
        return out

    @property
    def status(self) -> str:
        return "interrupted" if self.interrupted else "crashed" if self.crashed else "complete"


def _terminate(signum: int, frame: Any) -> None:
    """SIGINT/SIGTERM in the controller: remember why, then stop the run the way Ctrl-C does."""
    state = _STATE.get("state")
    name = signal.Signals(signum).name
    if state is not None and not state.interrupted:
        state.interrupted = name
        J.kill_traced_processes(state.trace_dir)  # end the workers now: their running checks become not_run
    raise KeyboardInterrupt(name)


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


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    state = _STATE.get("state")
    if state is None:
        return
    J.set_current_node(nodeid)  # the op trace of this process names the check
    if state.journal is not None and nodeid in state.planned:
        state.journal.write("start", nodeid=nodeid)


_STATE: dict[str, _RunState] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Controller: open the journal, load and describe every engine (a load failure ends the run with exit 2 and a
    journal record), resolve the packaged vendor xfails file before xdist hands the options to its workers."""
    config = session.config
    state: _RunState = config._fp8rl_state  # type: ignore[attr-defined]
    _STATE["state"] = state
    if not (config.getoption("--fp8rl-profile") or config.getoption("--fp8rl-engine")):
        return
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker or not getattr(config.option, "numprocesses", None):
        # the processes that run engine code trace the op they are in (after pytest's own faulthandler setup)
        J.start_trace(worker or "main")
    if worker:
        return
    signal.signal(signal.SIGINT, _terminate)
    out_dir = config.getoption("--fp8rl-report-dir")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state.trace_dir = out / J.TRACE_DIR_NAME
        state.trace_dir.mkdir(exist_ok=True)
        state.journal = J.Journal(out / J.JOURNAL_NAME)
        areas, keyword = config.getoption("--fp8rl-area"), config.getoption("keyword") or None
        state.journal.write("run", engines=engine_names(config), pid=os.getpid(),
                            selection={"areas": areas, "keyword": keyword} if (areas or keyword) else None)
    from fp8rl.runner import describe_engine
    from fp8rl.vendor_files import packaged_vendor_file

    for name in engine_names(config):
        try:
            state.engines[name] = describe_engine(name)
        except Exception as exc:  # noqa: BLE001 - any failure to load is a load error (exit 2), not a verdict
            state.load_error = f"{exc}" if type(exc).__name__ == "EngineLoadError" else \
                f"engine {name!r}: {type(exc).__name__}: {exc}"
            if state.journal is not None:
                state.journal.write("load_error", engine=name, message=state.load_error,
                                    traceback=traceback.format_exc())
            from fp8rl.exitcodes import EXIT_USAGE

            if os.environ.get(SUPERVISED_ENV):  # fp8rl conformance prints the one line (traceback with -v)
                if state.journal is not None:
                    state.journal.close()
                os._exit(EXIT_USAGE)
            pytest.exit(f"fp8rl: {state.load_error}", returncode=EXIT_USAGE)
    if state.journal is not None:
        state.journal.write("engines", descriptions=state.engines)
    if config.getoption("--fp8rl-packaged-xfails") and not config.getoption("--fp8rl-xfails"):
        files = {packaged_vendor_file(d["name"], "xfails") for d in state.engines.values()}
        if len(files) == 1 and None not in files:
            config.option.fp8rl_xfails = str(files.pop())


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the plugin must also load without xdist
def pytest_configure_node(node: Any) -> None:
    """Controller: hand each worker the vendor xfails file resolved at session start (workers parse only the
    command line, which does not name a packaged file)."""
    path = node.config.getoption("--fp8rl-xfails")
    if path:
        node.workerinput["fp8rl_xfails"] = str(path)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the plugin must also load without xdist
def pytest_xdist_node_collection_finished(node: Any, ids: Any) -> None:
    """Controller: the planned checks (with metadata) and vendor-file warnings a worker collected."""
    state = _STATE.get("state")
    if state is None or state.trace_dir is None or state.planned:
        return
    path = state.trace_dir / f"planned.{node.gateway.id}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    state.planned.update({nid: meta for nid, meta in data["planned"].items() if nid in set(ids)})
    for w in data.get("warnings", []):
        if w not in state.warnings:
            state.warnings.append(w)
    if state.journal is not None:
        state.journal.write("planned", checks=state.planned)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # xdist worker: the controller writes the report
        return
    state: _RunState | None = _STATE.pop("state", None)
    out_dir = config.getoption("--fp8rl-report-dir")
    if state is None or not out_dir or state.load_error:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED and not state.interrupted:
        state.interrupted = "KeyboardInterrupt"
    xdist_summary = getattr(config.pluginmanager.getplugin("dsession"), "_summary_report", None)
    if xdist_summary and not state.interrupted:
        state.crashed = f"xdist: {xdist_summary}"
    from fp8rl.runner import build_report, write_results

    areas = config.getoption("--fp8rl-area")
    keyword = config.getoption("keyword") or None
    report = build_report(state.final_results(), engines=engine_names(config), descriptions=state.engines,
                          profile=config.getoption("--fp8rl-profile") or "ci",
                          seed=config.getoption("--fp8rl-seed"), started_at=state.started_at,
                          duration_s=time.time() - state.started, command=sys.argv,
                          warnings=state.warnings, status=state.status,
                          status_detail=(state.interrupted or state.crashed or "")
                          + (" before any check was planned" if state.status != "complete" and not state.planned
                             else "") or None,
                          selection={"areas": areas, "keyword": keyword} if (areas or keyword) else None)
    write_results(report, Path(out_dir))
    if state.journal is not None:
        state.journal.write("report_written", status=state.status)
        state.journal.close()


__all__ = ["PROFILES", "engine_names"]
