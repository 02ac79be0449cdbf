"""Packaging: the oracle imports with only torch + numpy, and the built wheel works in a fresh venv."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest
from support import REPO_ROOT

ROOT = REPO_ROOT
HEAVY = ["pytest", "hypothesis", "jsonschema", "rich", "matplotlib", "scipy", "ml_dtypes", "transformers",
         "safetensors", "_pytest"]


#: the oracle's HF-transformers glue (needs transformers + safetensors to run); every other module needs torch + numpy
HF_GLUE = "rollout_hf"


def _oracle_modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "reference").glob("*.py") if p.stem not in ("__init__", HF_GLUE))


def test_reference_imports_with_only_torch_and_numpy():
    """Block every non-torch/numpy third-party import, then import every oracle module but the HF glue and use
    fp8rl.reference."""
    modules = _oracle_modules()
    assert {"bounds", "formats", "gemm", "policy", "presets", "quant", "rollout"} <= set(modules)
    code = textwrap.dedent(f"""
        import importlib
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {HEAVY!r}:
                    raise ImportError('blocked for this test: ' + name)
                return None
        sys.meta_path.insert(0, Block())
        import torch
        import fp8rl.reference as r
        for m in {modules!r}:
            importlib.import_module('fp8rl.reference.' + m)
        from fp8rl.reference import quant, gemm
        q = quant.quantize(torch.ones(2, 128), quant.Granularity.group(128))
        assert int(q.codes[0, 0]) == 0x7E, q.codes[0, 0]
        print('ok', r.__name__, len({modules!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert f"ok fp8rl.reference {len(modules)}" in out.stdout


def test_hf_glue_imports_transformers_only_inside_functions():
    """rollout_hf needs transformers to build and run models, but imports it (and safetensors) only inside
    functions, so ``transformers_reason()`` can report a missing install instead of an ImportError."""
    tree = ast.parse((ROOT / "reference" / f"{HF_GLUE}.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in HEAVY], names


def _fp8rl_imports(source: str, package: str = "fp8rl.reference") -> list[tuple[int, str]]:
    """(line, module) for every fp8rl module ``source`` imports, wherever the import statement is (module level, in
    a function, under ``if``/``try``): ``import fp8rl.x``, ``from fp8rl.x import y``, ``from fp8rl import x`` (→
    ``fp8rl.x``), relative imports resolved against ``package``, and ``importlib.import_module``/``__import__`` of
    a string constant."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod in ("fp8rl", "fp8rl.reference") or (node.level and not node.module):
                found += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, mod))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return [(line, m) for line, m in found if m == "fp8rl" or m.startswith("fp8rl.")]


def _is_oracle(module: str) -> bool:
    return module == "fp8rl.reference" or module.startswith("fp8rl.reference.")


def test_import_checker_sees_lazy_relative_and_dynamic_imports():
    src = textwrap.dedent("""
        from fp8rl.reference.formats import get_format
        from . import kv
        def f():
            from fp8rl import tolerances
            import fp8rl.checks
            from .. import engine
            from ..registry import load_engine
            importlib.import_module("fp8rl.strategies")
    """)
    bad = sorted(m for _, m in _fp8rl_imports(src) if not _is_oracle(m))
    assert bad == ["fp8rl.checks", "fp8rl.engine", "fp8rl.registry", "fp8rl.strategies", "fp8rl.tolerances"]
    assert {m for _, m in _fp8rl_imports(src) if _is_oracle(m)} == {"fp8rl.reference.formats", "fp8rl.reference.kv"}


def test_reference_imports_nothing_from_the_harness():
    """Arrows point one way: every module of the oracle (reference/*.py) imports only fp8rl.reference.* from fp8rl,
    lazy imports inside functions included. Bound formulas the oracle needs live in fp8rl.reference.bounds."""
    modules = sorted((ROOT / "reference").glob("*.py"))
    assert len(modules) > 5
    bad = [f"reference/{p.name}:{line} imports {m}" for p in modules
           for line, m in _fp8rl_imports(p.read_text(), "fp8rl.reference") if not _is_oracle(m)]
    assert not bad, "fp8rl.reference must not import the harness:\n" + "\n".join(bad)


@pytest.mark.slow
def test_wheel_installs_and_imports_in_fresh_venv(tmp_path):
    """Build the wheel, install it (no deps) into a new venv that sees torch/numpy from this environment via a
    .pth file, and import every subpackage from the wheel (not from the source tree)."""
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(dist.glob("fp8rl-*.whl"))
    assert len(wheels) == 1
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels[0])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # expose this environment's third-party packages (torch, numpy, ...) without its editable fp8rl finder
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    Path(site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = textwrap.dedent("""
        import fp8rl, fp8rl.reference, fp8rl.conformance, fp8rl.perf, fp8rl.reports, fp8rl.fixtures, fp8rl.engines
        from importlib import resources
        assert '/venv/' in fp8rl.__file__ and '/venv/' in fp8rl.reference.__file__, (fp8rl.__file__, fp8rl.reference.__file__)
        assert resources.files('fp8rl.reports').joinpath('report.schema.json').is_file()
        from fp8rl.registry import load_engine
        e = load_engine('reference')
        print('ok', fp8rl.__version__, sorted(e.capabilities())[:2])
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok ")
    # the CLI entry point from the wheel runs
    r = subprocess.run([str(env_dir / "bin" / "fp8rl"), "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "fp8rl" in r.stdout, r.stderr
