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


class Bf16WrongDtype(ReferenceEngine):
    name = "bf16-wrong-dtype"

    def round_bf16(self, x):
        return x.to(torch.float16)


class BracketReason(ReferenceEngine):
    name = "bracket-reason"
    description = "a description with [note] in brackets"

    def capabilities(self):
        return {"cast.e4m3fn": "needs pip install '.[extra]'"}
