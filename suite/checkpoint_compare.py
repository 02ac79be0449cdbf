"""What a checkpoint loader holds vs what the file says it must hold (area ``checkpoint``, docs/checkpoint.md).

Two comparisons, each with two consumers that assert on it (conformance) or report it (``fp8rl checkpoint-matrix``).

:func:`compare_held`, the loader's side (CKPT-LOAD-001 to -004, the matrix's cells): for every tensor of the file,
the loader's held tensor must equal

* a quantized weight: codes × its scales, computed exactly in fp64 by the oracle's readers
  (fp8rl.reference.checkpoint / checkpoint_ct, either format) and rounded **once** to the dtype held (BF16, fp32 or
  fp64; fp8rl.reference.checkpoint.round_exact);
* any other tensor: the stored tensor, when held in its stored dtype, else the same exact value rounded once.

NaN equals NaN; shapes must match; a held value that is not a floating tensor is a difference.

:func:`compare_roundtrip`, the writer's side (CKPT-WRITE-006, the matrix's file column, WSYNC-BOUND-001's
statement for a file): every FP8 weight of the file, dequantized exactly, within the quantization round-trip bound
(``quant_roundtrip``) of the model's BF16 weight; every other weight the BF16 weight unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HeldComparison", "RoundtripComparison", "RoundtripExcess", "TensorDifference", "compare_held",
           "compare_roundtrip"]

_HELD_DTYPES = ("bfloat16", "float32", "float64")


@dataclass(frozen=True)
class TensorDifference:
    """One held tensor that is not what the file says: ``problem`` (wrong shape / not a floating tensor) or
    ``values_differ`` of ``numel`` values, the first at ``first`` (held ``got`` vs required ``want``), the largest
    |held − exact| ``max_abs_err``."""

    name: str
    shape: tuple[int, ...]
    numel: int
    values_differ: int = 0
    first: tuple[int, ...] = ()
    got: float = 0.0
    want: float = 0.0
    max_abs_err: float = 0.0
    problem: str = ""

    def text(self) -> str:
        if self.problem:
            return f"{self.name}: {self.problem}"
        return (f"{self.name} {self.shape}: {self.values_differ}/{self.numel} values differ (first at {self.first}: "
                f"{self.got!r} vs {self.want!r}; max |held - exact| {self.max_abs_err:.3g})")


@dataclass
class HeldComparison:
    """The comparison of a loader's held tensors with a checkpoint: ``invalid`` (the file itself is not a valid FP8
    checkpoint: the reader's message), the file's names not held (``missing``) and held names the file does not
    have (``extra``), and every :class:`TensorDifference`. ``values`` / ``tensors``: how many were compared."""

    invalid: str = ""
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    differences: list[TensorDifference] = field(default_factory=list)
    values: int = 0
    tensors: int = 0

    @property
    def values_differ(self) -> int:
        return sum(d.values_differ for d in self.differences)

    @property
    def max_abs_err(self) -> float:
        return max((d.max_abs_err for d in self.differences), default=0.0)


def compare_held(held: Mapping[str, Any], path: str | Path) -> HeldComparison:
    """``held`` (checkpoint name → the tensor a loader holds) vs the checkpoint at ``path`` (see the module
    docstring). Pure: reads the file, never raises for what the loader holds."""
    import numpy as np
    import torch
    from fp8rl.reference import checkpoint as ck
    from fp8rl.reference import checkpoint_ct as cct

    config, tensors = ck.read_checkpoint(path)
    try:
        want64 = cct.dequantize_any(config, tensors, dtype=torch.float64)
        suffix = cct.scale_suffix_any(config)
    except ck.CheckpointError as exc:
        what = "compressed-tensors FP8" if cct.is_compressed_tensors(config) else "FP8"
        return HeldComparison(invalid=f"not a valid {what} checkpoint: {exc}")
    out = HeldComparison(missing=sorted(set(want64) - set(held)), extra=sorted(set(held) - set(want64)))
    for name, w in want64.items():
        if name not in held:
            continue
        h = held[name]
        shape = tuple(int(n) for n in w.shape)
        out.tensors += 1
        out.values += w.numel()
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != shape:
            got = f"{h.dtype} {tuple(h.shape)}" if isinstance(h, torch.Tensor) else type(h).__name__
            out.differences.append(TensorDifference(name, shape, w.numel(), problem=f"held as {got}, expected "
                                                                                     f"shape {shape}"))
            continue
        if name in tensors and tensors[name].dtype == h.dtype and name + suffix not in tensors:
            want = tensors[name]  # stored as is
        elif str(h.dtype).removeprefix("torch.") in _HELD_DTYPES:
            want = ck.round_exact(w, h.dtype)
        else:
            out.differences.append(TensorDifference(name, shape, w.numel(),
                                                    problem=f"held as {h.dtype}, expected a floating dtype"))
            continue
        g_np, w_np = h.detach().double().numpy(), want.detach().double().numpy()
        diff = ~((g_np == w_np) | (np.isnan(g_np) & np.isnan(w_np)))
        n = int(diff.sum())
        if n:
            idx = tuple(int(i) for i in np.argwhere(diff)[0])
            out.differences.append(TensorDifference(
                name, shape, w.numel(), values_differ=n, first=idx, got=float(g_np[idx]), want=float(w_np[idx]),
                max_abs_err=float(np.nanmax(np.abs(g_np - w.double().numpy())[diff]))))
    return out


@dataclass(frozen=True)
class RoundtripExcess:
    """One FP8 weight of a file against its BF16 weight: ``over`` of its ``numel`` elements exceed the round-trip
    bound, the largest error/bound ``worst``, the largest |err| of an element over the bound ``max_err``."""

    name: str
    shape: tuple[int, ...]
    numel: int
    over: int
    worst: float
    max_err: float


@dataclass
class RoundtripComparison:
    """A file against the BF16 weights it was written from: ``problems`` (a weight the file lacks, a kept weight
    that changed), one :class:`RoundtripExcess` per FP8 weight (``weights``), ``elements`` of them compared."""

    problems: list[str] = field(default_factory=list)
    weights: list[RoundtripExcess] = field(default_factory=list)
    elements: int = 0

    @property
    def over(self) -> list[RoundtripExcess]:
        """The FP8 weights with an element over the bound."""
        return [w for w in self.weights if w.over]

    @property
    def worst(self) -> float:
        return max((w.worst for w in self.weights), default=0.0)


def compare_roundtrip(config: Mapping[str, Any], tensors: Mapping[str, Any],
                      state_dict: Mapping[str, Any]) -> RoundtripComparison:
    """The file (``config``, ``tensors``: either format) vs the BF16 ``state_dict`` it was written from (see the
    module docstring). An invalid file raises fp8rl.reference.checkpoint.CheckpointError from the oracle's reader."""
    import math

    import torch
    from fp8rl import tolerances
    from fp8rl.reference import checkpoint_ct as cct

    pairs = cct.fp8_weights_any(config, tensors)
    got = cct.dequantize_any(config, tensors, dtype=torch.float64)
    fmts = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2"}
    out = RoundtripComparison()
    for name, x in state_dict.items():
        if name not in got:
            out.problems.append(f"{name}: missing")
            continue
        if name not in pairs:
            if not torch.equal(got[name].double(), x.double()):
                out.problems.append(f"{name}: not the BF16 weight")
            continue
        codes, scale = pairs[name]
        err = (got[name] - x.double()).abs()
        bound = tolerances.quant_roundtrip_bound(x.abs(), scale, fmts[codes.dtype]).double()
        ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, torch.full_like(err, math.inf),
                                                                torch.zeros_like(err)))
        over = ratio > 1
        out.elements += x.numel()
        out.weights.append(RoundtripExcess(name, tuple(int(n) for n in x.shape), x.numel(), int(over.sum()),
                                           float(ratio.max()) if ratio.numel() else 0.0,
                                           float(err[over].max()) if over.any() else 0.0))
    return out
