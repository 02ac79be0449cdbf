"""fp8rl as a user installs it: the wheel, in a fresh virtual environment, run from a directory outside the repository.

The wheel is built from a copy of the package sources (pyproject.toml's ``package-dir``, with its build backend from
this environment: ``pip wheel --no-deps --no-build-isolation``, as locks/build.in provides it) and installed into a
new virtual environment that sees this environment's packages (torch, pytest, ...) through a directory of links to
them from which fp8rl's own (its editable finder, its dist-info) are left out — so reinstalling torch costs nothing,
and ``fp8rl`` there is the wheel's: its package data (the report schema, the vendor files, the fixtures) and its
entry points, nothing of the working tree. One environment per module (the ``wheel_venv`` fixture).

In it: ``fp8rl conformance --engine torch -k CHECK-ID`` selects exactly that check, and a failing case's reproduce
line (from a mutant engine's report) reruns the same failure from another directory.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from support import REPO_ROOT


def _is_own(name: str) -> bool:
    """An entry of this environment's site-packages the wheel environment must not see: fp8rl's own (its editable
    finder and .pth, its dist-info, a package directory), other .pth files (a path line would not run them anyway)
    and the bytecode cache."""
    return "fp8rl" in name or name.endswith(".pth") or name == "__pycache__"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wheel")
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert pyproject["build-system"]["build-backend"] == "setuptools.build_meta"
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", pyproject["project"]["readme"]):
        shutil.copy(REPO_ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for d in sorted({p.split("/")[0] for p in pyproject["tool"]["setuptools"]["package-dir"].values()}):
        shutil.copytree(REPO_ROOT / d, src / d, ignore=ignore)
    dist = root / "dist"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
              str(src), "-w", str(dist)], cwd=root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = dist.glob("fp8rl-*.whl")

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    base = Path(sysconfig.get_paths()["purelib"])
    shadow = root / "base-packages"  # links to this environment's packages, fp8rl's own left out
    shadow.mkdir()
    for entry in base.iterdir():
        if not _is_own(entry.name):
            (shadow / entry.name).symlink_to(entry)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root)
                .stdout.strip())
    (site / "00-base-packages.pth").write_text(f"{shadow}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    r = _run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], cwd=root, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return {"root": root, "venv": venv, "site": site, "env": env, "cwd": elsewhere, "wheel": wheel}


def fp8rl(w: dict, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The wheel environment's ``fp8rl`` console script (the one pip wrote), run outside the repository."""
    return _run([str(w["venv"] / "bin" / "fp8rl"), *args], cwd=cwd or w["cwd"], env=w["env"])


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_the_wheel_environment_imports_the_installed_fp8rl_exact(wheel_venv):
    """fp8rl, its metadata and its plugin's package data come from the wheel install, not from the repository."""
    code = ("import fp8rl, fp8rl.conformance, importlib.metadata as m, importlib.resources as r; "
            "print(fp8rl.__file__); print(fp8rl.conformance.__file__); "
            "print(m.distribution('fp8rl').locate_file('fp8rl/__init__.py')); "
            "print(len([d for d in m.distributions() if d.metadata['Name'] == 'fp8rl'])); "
            "print(r.files('fp8rl.conformance') / 'vendors')")
    r = _run([str(wheel_venv["venv"] / "bin" / "python"), "-c", code], cwd=wheel_venv["cwd"], env=wheel_venv["env"])
    assert r.returncode == 0, r.stderr[-3000:]
    pkg, conformance, dist_file, n_dists, vendors = r.stdout.split("\n")[:5]
    site = str(wheel_venv["site"])
    for path in (pkg, conformance, dist_file, vendors):
        assert path.startswith(site + os.sep), (path, site)
        assert not path.startswith(str(REPO_ROOT)), path
    assert n_dists == "1"  # the base environment's editable fp8rl is not visible beside it
    packaged = sorted(p.name for p in Path(vendors).iterdir())
    assert packaged and packaged == sorted(p.name for p in (REPO_ROOT / "conformance" / "vendors").iterdir()
                                           if p.suffix in (".xfails", ".skips"))


def test_k_selects_exactly_one_check_from_the_installed_package_exact(wheel_venv):
    out = wheel_venv["root"] / "select"
    r = fp8rl(wheel_venv, "conformance", "--engine", "torch", "-k", "QUANT-EXACT-002", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = report(out)
    checks = rep["checks"]
    assert checks and {c["id"] for c in checks} == {"QUANT-EXACT-002"}
    assert all(c["outcome"] == "passed" for c in checks), [(c["case"], c["outcome"]) for c in checks]
    cmd = rep["command"]
    rootdir = cmd[cmd.index("--rootdir") + 1]  # the checks collected are the wheel's fp8rl.conformance
    assert rootdir.startswith(str(wheel_venv["site"])), rootdir


def test_a_reproduce_line_reruns_the_same_failure_from_the_installed_package_exact(wheel_venv, tmp_path):
    """A mutant engine (``mutant:truncating-cast``, selected by name as ``fp8rl mutants`` does) fails CAST-SWEEP-001;
    the reproduce line at the end of a failed case's message, run as written with the installed ``fp8rl`` from
    another directory, fails exactly that case again with the same message."""
    out = wheel_venv["root"] / "mutant"
    r = fp8rl(wheel_venv, "conformance", "--engine", "mutant:truncating-cast", "-k", "CAST-SWEEP-001",
              "--no-isolation", "--out", str(out))  # one process: the rerun below is the line as written
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    failed = [c for c in report(out)["checks"] if c["outcome"] == "failed"]
    assert failed, r.stdout[-3000:]
    first = failed[0]
    line = first["message"].splitlines()[-1]
    assert line.startswith("[reproduce: ") and line.endswith("]"), line
    argv = shlex.split(line.split("; ", 1)[1][:-1])
    assert argv[:2] == ["fp8rl", "conformance"], argv
    again_out = tmp_path / "again"
    again = fp8rl(wheel_venv, *argv[1:], "--out", str(again_out), cwd=tmp_path)
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    rerun = report(again_out)["checks"]
    assert [(c["id"], c["case"], c["outcome"]) for c in rerun] == [(first["id"], first["case"], "failed")]
    assert rerun[0]["message"].splitlines()[0] == first["message"].splitlines()[0]


REPRO_ENGINE = '''
"""Three mutants of fp8rl in one out-of-tree engine: quantize's scale in bf16, the KV store without its clamp, TIS
weights without truncation."""
from fp8rl.mutants import MUTANTS

Combo = type("Combo", tuple(MUTANTS[n].factory for n in ("bf16-scale", "kv-no-clamp", "corr-no-truncation")),
             {"name": "combo-of-mutants"})
'''
REPRO_CASES = {"quantization": "QUANT-EXACT-001[block]", "kv": "KV-STORE-001[head-e4m3fn]", "correction": "CORR-TIS-001"}


def test_repro_scripts_reproduce_from_the_installed_wheel_exact(wheel_venv, tmp_path):
    """fp8rl repro, installed from the wheel: for a failing case of the quantization, kv and correction areas, the
    folder it writes holds a script that, run by the wheel environment's python from a directory outside the
    repository with only the wheel's fp8rl (and the engine's own module) importable, exits 1 under --check and
    prints the engine's and the oracle's values."""
    pkg = tmp_path / "vendor"
    pkg.mkdir()
    (pkg / "combo_engine.py").write_text(REPRO_ENGINE)
    env = {**wheel_venv["env"], "PYTHONPATH": str(pkg), "FP8RL_HYPOTHESIS_PROFILE": "ci"}
    out = tmp_path / "report"
    fp8 = str(wheel_venv["venv"] / "bin" / "fp8rl")
    r = _run([fp8, "conformance", "--engine", "combo_engine:Combo", "-k", " or ".join(REPRO_CASES.values()),
              "--no-isolation", "--out", str(out)], cwd=pkg, env=env)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    for area, label in REPRO_CASES.items():
        folder = tmp_path / f"repro-{area}"
        made = _run([fp8, "repro", str(out), label, "--out", str(folder)], cwd=tmp_path, env=env)
        assert made.returncode == 0, (label, made.stdout[-3000:] + made.stderr[-3000:])
        assert REPO_ROOT not in folder.resolve().parents
        script = _run([str(wheel_venv["venv"] / "bin" / "python"), "repro.py", "--check"], cwd=folder, env=env)
        assert script.returncode == 1, (label, script.stdout[-3000:] + script.stderr[-3000:])
        text = script.stdout.lower()
        assert "oracle" in text and "engine" in text, (label, script.stdout[-2000:])
        assert str(wheel_venv["site"]) in _run([str(wheel_venv["venv"] / "bin" / "python"), "-c",
                                                "import fp8rl; print(fp8rl.__file__)"], cwd=folder, env=env).stdout
