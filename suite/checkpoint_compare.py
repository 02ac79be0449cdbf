"""What a checkpoint loader holds vs what the file says it must hold (area ``checkpoint``, docs/checkpoint.md).

One comparison, two consumers: the conformance loader checks (CKPT-LOAD-001 to -004, which assert on it) and the
cells of ``fp8rl checkpoint-matrix`` (which report it). For every tensor of the file, the loader's held tensor must
equal

* a quantized weight: codes × its scales, computed exactly in fp64 by the oracle's readers
  (fp8rl.reference.checkpoint / checkpoint_ct, either format) and rounded **once** to the dtype held (BF16, fp32 or
  fp64; fp8rl.reference.checkpoint.round_exact);
* any other tensor: the stored tensor, when held in its stored dtype, else the same exact value rounded once.

NaN equals NaN; shapes must match; a held value that is not a floating tensor is a difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HeldComparison", "TensorDifference", "compare_held"]

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
