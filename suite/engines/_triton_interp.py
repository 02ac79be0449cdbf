"""Triton's interpreter (``TRITON_INTERPRET=1``) as the instrument that runs engines' Triton FP8 kernels on CPU.

The interpreter is not the compiled GPU path. Its float conversions are its own numpy code
(``triton.runtime.interpreter._convert_float``, triton 3.9.0), and the ``triton-interpret`` engine measures them
against the oracle (findings in ``conformance/vendors/triton-interpret.xfails``). Measured on triton 3.9.0:

* fp32 → fp8 (``x.to(tl.float8e4nv)`` / ``tl.float8e5``, RTNE requested): rounds half *up* on the first cut-off bit
  only (no ties-to-even, no sticky bits); a round-up that carries out of the mantissa is OR-ed into the exponent
  field, so it lands on 2^e or 2^(e-1) depending on the exponent's low bit (31.6 → 16 instead of 32); no
  saturation or overflow handling (500 → 256 in e4m3fn, +inf → 256); NaN → a finite value (384); results that
  fall into the subnormal range are truncated.
* fp32 → bf16 (``x.to(tl.bfloat16)``): the rounding mode is dropped (``cast_impl`` passes ``None``), i.e. the
  conversion truncates (round toward zero) where the GPU's ``cvt.rn.bf16.f32`` rounds to nearest even.
* fp8 e4m3fn → fp32 (``.to(tl.float32)``, and inside ``tl.dot``): the NaN codes 0x7f/0xff decode to ±480 (the bits
  read as plain e4m3, without the fn format's NaN rule) where the GPU and torch give NaN. Up-conversions are outside
  the workaround below, so a kernel fed a NaN code computes with 480 (the SGLang gemm's NaN-code xfails).

**Workaround ``faithful-downcast``** (explicit, opt-in per op, named in every report that relies on it through
:data:`WORKAROUND_NOTE`): float → float *down*-conversions to bf16 / fp16 / fp8 e4m3fn / fp8 e5m2 with RTNE (or an
unspecified mode) are computed by torch's casts with the semantics of the NVIDIA lowering instead —
round-to-nearest-even, and for fp8 ``satfinite`` (finite overflow and ±inf → ±max finite, NaN → NaN) as in
``cvt.rn.satfinite.e4m3x2.f32`` / ``.e5m2x2.f32``. Other conversions (up-casts, RTZ, fnuz formats) keep the
interpreter's code. The ``triton-interpret-faithful`` engine runs the suite's cast and quantization checks with the
workaround installed and must conform with no xfails; that is the test of the workaround against the oracle.

Usage by a kernel engine: call :func:`enable_interpreter` before the engine's Triton code is imported (``@triton.jit``
decides at decoration time whether to build an interpreted function), then run each kernel inside
``with conversions("faithful"):`` and add :data:`WORKAROUND_NOTE` to the engine's ``instrument_notes()``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

#: name of the workaround (reports, capability reasons, engine versions)
WORKAROUND = "faithful-downcast"
WORKAROUND_NOTE = (
    "Triton interpreter with fp8rl's 'faithful-downcast' workaround: float down-conversions to bf16/fp16/fp8 e4m3fn/"
    "e5m2 (RTNE) are computed by torch casts with the NVIDIA cvt.rn(.satfinite) semantics instead of the "
    "interpreter's _convert_float (which rounds ties up, drops the mantissa carry, does not saturate and truncates "
    "fp32->bf16); validated by the triton-interpret-faithful engine against the oracle")

_MODES = ("raw", "faithful")
_state: dict[str, Any] = {"mode": "raw", "installed": False, "original": None}


def triton_reason() -> str | None:
    """None if ``triton`` is installed (found without importing it: importing decides interpreter vs compiled)."""
    import importlib.util

    if "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return None
    return "triton is not installed in this environment; pip install triton (fp8rl's [triton] extra)"


def _import_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the instrument unavailable
        return f"triton is not importable in this environment ({type(exc).__name__}: {exc})"
    return None


def enable_interpreter() -> str | None:
    """Ask for the interpreter (``TRITON_INTERPRET=1``) before Triton kernels are defined.

    Returns None when the interpreter is (or will be) active, else the reason why not: triton missing, or
    ``TRITON_INTERPRET`` explicitly set to something else, or triton already imported without it (kernels
    already decorated for a GPU backend would fail with "0 active drivers" on CPU).
    """
    reason = None if "triton" in sys.modules else _env_reason()
    if reason:
        return reason
    reason = triton_reason()
    if reason:
        return reason
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    reason = _import_reason()
    if reason:
        return reason
    if not interpreter_active():
        return ("triton was imported before the interpreter was requested (TRITON_INTERPRET is not 1); run with "
                "TRITON_INTERPRET=1 or in a fresh process")
    return None


def _env_reason() -> str | None:
    v = os.environ.get("TRITON_INTERPRET")
    if v not in (None, "", "1", "true", "True", "TRUE", "on", "yes"):
        return f"TRITON_INTERPRET={v!r} asks for the compiled backend; the CPU tier needs TRITON_INTERPRET=1"
    return None


def interpreter_active() -> bool:
    """True if Triton kernels decorated from now on run in the interpreter."""
    try:
        import triton
    except Exception:  # noqa: BLE001
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "") in ("1", "true", "True", "on", "yes")


def triton_version() -> str:
    import triton

    return str(getattr(triton, "__version__", "?"))


@functools.lru_cache(maxsize=1)
def _dtype_map() -> dict[Any, Any]:
    import torch
    import triton.language as tl

    return {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float32: torch.float32,
            tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}


def _faithful_convert(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
    """fp32/fp16/bf16 → bf16/fp16/fp8 (RTNE or unspecified) with NVIDIA semantics; anything else: the original."""
    import numpy as np
    import torch
    from triton._C.libtriton import ir as _ir

    original = _state["original"]
    dm = _dtype_map()
    src, dst = dm.get(input_dtype), dm.get(output_dtype)
    rtne = rounding_mode is None or rounding_mode == _ir.ROUNDING_MODE.RTNE
    down = (src is not None and dst is not None and input_dtype.primitive_bitwidth > output_dtype.primitive_bitwidth)
    if _state["mode"] != "faithful" or not (down and rtne):
        return original(input, input_dtype, output_dtype, rounding_mode)
    assert src is not None and dst is not None  # `down` holds only for dtypes both in the map
    same_width = {16: np.int16, 32: np.int32}[input_dtype.primitive_bitwidth]  # reinterpret the bits, no copy
    t = torch.from_numpy(np.ascontiguousarray(input).view(same_width)).view(src).to(torch.float32)
    if dst in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = float(torch.finfo(dst).max)
        t = torch.where(t.isnan(), t, t.clamp(-fmax, fmax))  # satfinite: ±inf and finite overflow → ±max
        out = t.to(dst).view(torch.uint8).numpy()
    else:
        out = t.to(dst).view(torch.int16).numpy().view(np.uint16)
    return out.reshape(np.shape(input))


def install() -> None:
    """Install the dispatcher in place of the interpreter's ``_convert_float`` (idempotent; mode stays as set)."""
    if _state["installed"]:
        return
    from triton.runtime import interpreter

    _state["original"] = interpreter._convert_float
    interpreter._convert_float = _faithful_convert
    _state["installed"] = True


@contextlib.contextmanager
def conversions(mode: str) -> Iterator[None]:
    """Run the enclosed kernels with the interpreter's own conversions (``"raw"``) or the ``faithful-downcast``
    workaround (``"faithful"``)."""
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {_MODES}, got {mode!r}")
    install()
    old = _state["mode"]
    _state["mode"] = mode
    try:
        yield
    finally:
        _state["mode"] = old
