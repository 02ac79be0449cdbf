"""What a run leaves behind while it runs, so that a crash or a kill can't lose or falsify its results.

* The **journal** (``<out>/run.journal.jsonl``, one JSON object per line, flushed after each): the checks the run
  planned, each check as it starts and as it ends with its result, a load error, an interruption. ``fp8rl
  conformance`` supervises the pytest process; when that process dies without writing its report (a segfault or
  abort in ``--no-isolation`` mode, SIGKILL, a thread-method timeout's ``os._exit``), the supervisor builds the
  report from the journal: finished checks as they ended, the running one as ``error`` (with the engine op it was
  in), the rest as ``not_run``.
* The **op trace** (``<out>/.trace/<process>.op`` and ``.fault``): every process that runs engine code records the
  engine op it is inside (GuardedEngine) and points :mod:`faulthandler` at a file, so that a worker that dies can
  be described: which op, for how long, and which fatal signal.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JOURNAL_NAME = "run.journal.jsonl"
TRACE_DIR_NAME = ".trace"
#: environment variable naming the trace directory (set by the plugin for the processes that run engine code)
TRACE_ENV = "FP8RL_TRACE_DIR"


class Journal:
    """Append-only JSON-lines log of a run (each record flushed to the OS at once)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, kind: str, **data: Any) -> None:
        from fp8rl.reports import to_jsonable

        self._fh.write(json.dumps({"type": kind, "t": time.time(), **to_jsonable(data)}, allow_nan=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_journal(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a journal (a torn last line, from a process killed mid-write, is skipped)."""
    p = Path(path)
    if not p.is_file():
        return
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


# ----------------------------------------------------------------------------------------------------------------
# op trace: which engine op a process is in, and how it died


class OpTrace:
    """Per-process breadcrumb of the engine op being run (a tiny file rewritten in place at each op entry)."""

    def __init__(self, trace_dir: Path, process: str) -> None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        (trace_dir / f"{process}.pid").write_text(str(os.getpid()))
        self._fd = os.open(trace_dir / f"{process}.op", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fault = (trace_dir / f"{process}.fault").open("w")
        faulthandler.enable(file=self._fault, all_threads=True)
        self.trace_dir = trace_dir

    def close(self) -> None:
        """Stop writing here (a later run in the same process traces into its own directory)."""
        faulthandler.disable()
        os.close(self._fd)
        self._fault.close()

    def enter(self, op: str, nodeid: str = "", test_start: float | None = None) -> None:
        data = json.dumps({"op": op, "nodeid": nodeid, "t": time.time(), "t_test": test_start}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def leave(self) -> None:
        os.ftruncate(self._fd, 0)


_TRACE: dict[str, OpTrace | None] = {}
_CURRENT_NODE: dict[str, Any] = {"nodeid": "", "t": None}


def start_trace(process: str) -> None:
    """Start this process's op trace if the run asked for one (``FP8RL_TRACE_DIR``). A process that runs several
    conformance runs in turn (``--no-isolation`` runs called in-process) traces each into its own run's directory:
    the trace of an earlier run is closed, never reused (its breadcrumbs would describe the wrong run)."""
    d = os.environ.get(TRACE_ENV)
    old = _TRACE.get("trace")
    if not d or (old is not None and old.trace_dir == Path(d)):
        return
    if old is not None:
        old.close()
    _TRACE["trace"] = OpTrace(Path(d), process)


def set_current_node(nodeid: str) -> None:
    """Called when a check starts (before its setup: pytest-timeout's timer covers setup too)."""
    _CURRENT_NODE["nodeid"] = nodeid
    _CURRENT_NODE["t"] = time.time()


def enter_op(op: str) -> None:
    t = _TRACE.get("trace")
    if t is not None:
        t.enter(op, _CURRENT_NODE["nodeid"], _CURRENT_NODE["t"])


def leave_op() -> None:
    t = _TRACE.get("trace")
    if t is not None:
        t.leave()


_FATAL = ("Segmentation fault", "Aborted", "Bus error", "Floating-point exception", "Illegal instruction")


def kill_traced_processes(trace_dir: Path | None) -> int:
    """SIGKILL every other process that traced itself in ``trace_dir`` (the xdist workers of an interrupted run:
    they hold no results, and a worker stuck in an engine op would otherwise delay the interrupted report).
    Returns how many were signalled."""
    import signal

    n = 0
    for pid_file in (trace_dir.glob("*.pid") if trace_dir is not None and trace_dir.is_dir() else ()):
        try:
            pid = int(pid_file.read_text())
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
                n += 1
        except (OSError, ValueError):
            continue
    return n


def oom_kills() -> int | None:
    """The kernel's count of OOM kills on this machine (``oom_kill`` of /proc/vmstat, Linux ≥ 4.13); None where it
    cannot be read."""
    try:
        with open("/proc/vmstat", encoding="ascii") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


#: the OOM-kill count when the supervising process imported this module (the start of its run)
OOM_KILLS_AT_START = oom_kills()


def _oom_evidence() -> str:
    """What /proc/vmstat says about OOM kills since :data:`OOM_KILLS_AT_START` (empty where unreadable)."""
    now = oom_kills()
    if now is None or OOM_KILLS_AT_START is None:
        return ""
    n = now - OOM_KILLS_AT_START
    if n > 0:
        return (f"the kernel's OOM killer killed {n} process{'es' if n > 1 else ''} on this machine since the run "
                "started (/proc/vmstat oom_kill; not necessarily this one)")
    return "no OOM kill on this machine since the run started (/proc/vmstat oom_kill unchanged)"


def describe_death(trace_dir: Path | None, process: str, *, timeout_s: float | None = None) -> str:
    """Why a process that ran engine code died, from its trace files: the fatal signal faulthandler saw (or none:
    SIGKILL, e.g. the OOM killer, or an ``os._exit``), and the engine op it was in and for how long."""
    if trace_dir is None:
        return "no trace"
    parts = []
    fault = trace_dir / f"{process}.fault"
    text = fault.read_text(errors="replace") if fault.is_file() else ""
    fatal = next((f for f in _FATAL if f"Fatal Python error: {f}" in text), None)
    op_file = trace_dir / f"{process}.op"
    raw = op_file.read_text() if op_file.is_file() else ""
    op, elapsed, in_check = None, 0.0, 0.0
    try:
        rec = json.loads(raw) if raw else None
        if rec:
            now = time.time()
            op, elapsed = str(rec["op"]), now - float(rec["t"])
            in_check = now - float(rec["t_test"]) if rec.get("t_test") is not None else elapsed
    except (json.JSONDecodeError, KeyError, ValueError, TypeError):
        pass
    # pytest-timeout's timer starts with the check (its setup included), a moment before the check's start is
    # recorded here; the op itself may have started seconds later on a loaded machine (slow setup)
    hung = op is not None and timeout_s is not None and in_check >= 0.9 * timeout_s
    if fatal:
        parts.append(f"fatal signal: {fatal}")
    elif hung:
        parts.append(f"hung past the check timeout ({timeout_s:g} s) and was ended")
    else:
        parts.append("no fatal-signal report (killed with SIGKILL, e.g. by the OOM killer, or it exited)")
    parts.append(f"inside engine op {op!r} for {elapsed:.1f} s" if op else "not inside an engine op")
    if not fatal and not hung and (oom := _oom_evidence()):
        parts.append(oom)
    return "; ".join(parts)


__all__ = ["JOURNAL_NAME", "OOM_KILLS_AT_START", "TRACE_DIR_NAME", "TRACE_ENV", "Journal", "OpTrace", "describe_death",
           "enter_op", "kill_traced_processes", "leave_op", "oom_kills", "read_journal", "set_current_node",
           "start_trace"]
