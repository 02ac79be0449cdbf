"""What every part of engine ``vllm`` shares: whether vLLM can run here as it runs on this platform (the reasons
when not), its version, the platform facts the capabilities depend on, and the ``VllmConfig`` vLLM's layers read
while they run."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def vllm_reason() -> str | None:
    """None if vLLM imports, else why not (every capability then carries this reason)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the engine unavailable
        return f"vllm is not importable in this environment ({type(exc).__name__}: {exc}); install the [vllm] extra"
    return None


def _triton_enabled_reason() -> str | None:
    """vLLM as it runs on this platform means Triton disabled: if engine vllm-triton imported vLLM in this process
    with Triton enabled under the interpreter, every vLLM path here would take Triton branches instead."""
    mod = sys.modules.get("fp8rl.engines.vllm_triton")
    if mod is not None and mod.vllm_has_triton_here():
        return ("vllm was imported in this process by engine vllm-triton with Triton enabled under the interpreter; "
                "engine vllm tests vLLM as it runs on this platform (Triton disabled): run it in its own process")
    return None


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


#: a platform as :func:`_platform` describes one, standing in for it where the capability keys are listed without
#: running vLLM (each part's ``CAP_KEYS``): every ``_caps_*`` declares the same keys on every platform, only their
#: values (True or the reason) depend on it
STAND_IN_PLATFORM: dict[str, Any] = {"device": "cpu", "is_cpu": True, "fp8_dtype": torch.float8_e4m3fn,
                                     "avx512": True, "amx": True}


@functools.lru_cache(maxsize=1)
def _platform() -> dict[str, Any]:
    import vllm  # noqa: F401
    from vllm.platforms import current_platform

    out: dict[str, Any] = {"device": str(getattr(current_platform, "device_type", "?"))}
    out["is_cpu"] = bool(current_platform.is_cpu())
    out["fp8_dtype"] = current_platform.fp8_dtype()
    out["avx512"] = bool(torch.cpu._is_avx512_supported())
    out["amx"] = bool(torch.cpu._is_amx_tile_supported())
    return out


@contextlib.contextmanager
def _vllm_config():
    from vllm.config import set_current_vllm_config

    cfg = _default_config()
    with set_current_vllm_config(cfg):
        yield cfg


@functools.lru_cache(maxsize=1)
def _default_config():
    from vllm.config import VllmConfig

    return VllmConfig()
