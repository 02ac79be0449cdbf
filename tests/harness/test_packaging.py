"""Packaging: the oracle imports with only torch + numpy, and the built wheel works in a fresh venv."""

from __future__ import annotations

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


def test_reference_imports_with_only_torch_and_numpy():
    """Block every non-torch/numpy third-party import, then import and use fp8rl.reference."""
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {HEAVY!r}:
                    raise ImportError('blocked for this test: ' + name)
                return None
        sys.meta_path.insert(0, Block())
        import torch
        import fp8rl.reference as r
        from fp8rl.reference import quant, gemm
        q = quant.quantize(torch.ones(2, 128), quant.Granularity.group(128))
        assert int(q.codes[0, 0]) == 0x7E, q.codes[0, 0]
        print('ok', r.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "ok fp8rl.reference" in out.stdout


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
