"""Misbehaving engines for the harness tests (loaded by ``module:factory``)."""

import time

import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference.quant import QuantizedTensor


class Raises(ReferenceEngine):
    name = "raises"

    def cast(self, x, fmt):
        raise RuntimeError("kernel exploded")


class WrongShape(ReferenceEngine):
    name = "wrong-shape"

    def cast(self, x, fmt):
        return super().cast(x, fmt).reshape(-1)[:-1]


class WrongDtype(ReferenceEngine):
    name = "wrong-dtype"

    def cast(self, x, fmt):
        return super().cast(x, fmt).to(torch.int32)


class WrongDtypeForBf16Input(ReferenceEngine):
    """Right on fp32 input (so it loads), wrong dtype on bf16 input: a per-check error."""

    name = "wrong-dtype-bf16-input"

    def cast(self, x, fmt):
        out = super().cast(x, fmt)
        return out.to(torch.int32) if x.dtype == torch.bfloat16 else out


class QuantizeReturnsTuple(ReferenceEngine):
    name = "quantize-returns-tuple"

    def quantize(self, x, granularity):
        q = super().quantize(x, granularity)
        return q.codes, q.scale


class QuantizeFp8Codes(ReferenceEngine):
    name = "quantize-fp8-codes"

    def quantize(self, x, granularity):
        q = super().quantize(x, granularity)
        return QuantizedTensor(q.codes.view(torch.float8_e4m3fn), q.scale, granularity, q.policy)


class WrongSignature(ReferenceEngine):
    name = "wrong-signature"

    def quantize(self, x):  # the protocol's quantize takes (x, granularity)
        raise AssertionError("never called")


class ReturnsNone(ReferenceEngine):
    name = "returns-none"

    def cast(self, x, fmt):
        return None


class NanScale(ReferenceEngine):
    name = "nan-scale"

    def quantize(self, x, granularity):
        q = super().quantize(x, granularity)
        return QuantizedTensor(q.codes, torch.full_like(q.scale, float("nan")), granularity, q.policy)


class Hangs(ReferenceEngine):
    name = "hangs"

    def cast(self, x, fmt):
        time.sleep(3600)


def not_an_engine():
    return object()


def factory_raises():
    raise RuntimeError("cannot open device")


class WithNote(ReferenceEngine):
    """Conformant, but its results rely on something outside the engine (reports must name it)."""

    name = "with-note"

    def instrument_notes(self):
        return ["results rely on shim X (validated by engine Y)"]

    def cast(self, x, fmt):  # its own cast (the oracle's formula, called directly): the run tests this engine's code
        from fp8rl.reference import formats

        return formats.encode(x, fmt, self.cast_overflow(fmt)).reshape(x.shape)


class Bf16WrongDtype(ReferenceEngine):
    name = "bf16-wrong-dtype"

    def round_bf16(self, x):
        return x.to(torch.float16)


class BracketReason(ReferenceEngine):
    name = "bracket-reason"
    description = "a description with [note] in brackets"

    def capabilities(self):
        return {"cast.e4m3fn": "needs pip install '.[extra]'"}


# ---- engines that take their process down, or misbehave at load (the reliability tests) ------------------------


class _CrashesOnE5m2(ReferenceEngine):
    """Conformant, except that ``cast(x, "e5m2")`` dies the way a C extension does: the checks of other formats
    run (and pass) before and after the crash."""

    def _die(self) -> None:
        raise NotImplementedError

    def cast(self, x, fmt):
        if fmt == "e5m2":
            self._die()
        return super().cast(x, fmt)


class Aborts(_CrashesOnE5m2):
    name = "aborts"

    def _die(self):
        import os

        os.abort()  # SIGABRT: a C++ assert, a CUDA illegal-memory-access abort


class Segfaults(_CrashesOnE5m2):
    name = "segfaults"

    def _die(self):
        import ctypes

        ctypes.string_at(0)  # SIGSEGV: a kernel that reads address 0


class HangsInC(_CrashesOnE5m2):
    name = "hangs-in-c"

    def _die(self):
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        while True:  # a C-level hang that ignores the Python-level (signal) timeout: only a thread timeout ends it
            libc.usleep(1_000_000)


class OomKilled(_CrashesOnE5m2):
    """Leaks memory until the OS kills it: allocates, then is SIGKILLed the way the OOM killer ends a process (the
    test does not exhaust the machine's memory)."""

    name = "oom-killed"

    def _die(self):
        import os
        import signal

        hoard = [bytearray(64 << 20) for _ in range(4)]  # 256 MiB leaked
        os.kill(os.getpid(), signal.SIGKILL if hoard else signal.SIGTERM)


class LeaksUntilMemoryError(_CrashesOnE5m2):
    """Leaks until an allocation fails (under the address-space limit the test sets): a Python MemoryError."""

    name = "leaks-until-memory-error"

    def _die(self):
        hoard = []
        while True:
            hoard.append(bytearray(256 << 20))


class CapabilitiesRaise(ReferenceEngine):
    name = "capabilities-raise"

    def capabilities(self):
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")


class NumericsRaise(ReferenceEngine):
    name = "numerics-raise"

    def cast_overflow(self, fmt):
        raise RuntimeError("libfp8.so: cannot open shared object file")


class UnknownCapability(ReferenceEngine):
    name = "unknown-capability"

    def capabilities(self):
        return {**super().capabilities(), "quantize.mxfp9": True}


class WrongDevice(ReferenceEngine):
    name = "wrong-device"

    def cast(self, x, fmt):
        return super().cast(x, fmt).to("meta")


class SlowCast(ReferenceEngine):
    """Conformant but slow: each cast sleeps, so that a signal sent during the run lands mid-check."""

    name = "slow-cast"

    def cast(self, x, fmt):
        time.sleep(1.0)
        return super().cast(x, fmt)
