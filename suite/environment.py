"""What every fp8rl result records about the machine it ran on: CPU/GPU model, driver, library and engine versions.

One function, :func:`environment`, used by conformance reports (``report.json`` ``environment``), the KV-drift
report and perf results. The conformance schema requires ``python``, ``torch``, ``numpy``, ``platform``,
``device`` and ``cpu``; the rest is context for reading a number later.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform's processor/machine string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """The CPU features that change which kernels CPU engines run: ``amx`` where the CPU has AMX tiles (vLLM's CPU
    attention and FP8 GEMMs take AMX code paths there; findings scoped ``[when cpu:amx]`` in vendor files). Empty
    without torch."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return []
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return ["amx"] if probe is not None and probe() else []


def _nvidia_smi() -> list[dict[str, str]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            rows.append({"name": parts[0], "driver": parts[1], "memory_total": parts[2]})
    return rows


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]  # the checkout (editable installs)
    if not (root / ".git").exists() or not shutil.which("git"):
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment(engine: Any = None) -> dict[str, Any]:
    """Everything needed to interpret a number later: CPU/GPU model, driver, library and engine versions."""
    import numpy

    env: dict[str, Any] = {
        "python": sys.version.split()[0], "implementation": platform.python_implementation(),
        "platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_model(),
        "cpu_count": os.cpu_count(), "numpy": numpy.__version__,
    }
    try:
        env["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        env["memory_bytes"] = None
    try:
        import scipy

        env["scipy"] = scipy.__version__
    except ImportError:  # pragma: no cover
        env["scipy"] = None
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["torch_threads"] = torch.get_num_threads()
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["cpu_features"] = cpu_features()
        gpus = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append({"name": p.name, "total_memory": p.total_memory,
                             "capability": f"{p.major}.{p.minor}"})
        env["gpus"] = gpus
    except ImportError:  # pragma: no cover
        env["torch"] = None
        env["gpus"] = []
    smi = _nvidia_smi()
    env["nvidia_smi"] = smi
    env["driver"] = smi[0]["driver"] if smi else None
    try:
        import fp8rl

        env["fp8rl"] = fp8rl.__version__
    except Exception:  # noqa: BLE001  # pragma: no cover
        env["fp8rl"] = None
    env["git_commit"] = _git_commit()
    env["env_vars"] = {k: v for k, v in sorted(os.environ.items())
                       if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
                       or k.startswith(("VLLM_", "FP8RL_"))}
    env["device"] = f"cuda: {env['gpus'][0]['name']}" if env.get("gpus") else "cpu"
    if engine is not None:
        env["engine"] = {"name": getattr(engine, "name", "?"), "version": _safe_version(engine)}
    return env


def _safe_version(engine: Any) -> str | None:
    try:
        return str(engine.version())
    except Exception:  # noqa: BLE001 - a broken version() must not lose a benchmark
        return None


__all__ = ["cpu_features", "cpu_model", "environment"]
