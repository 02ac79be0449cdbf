"""Inputs of the ``*-SPACE-*`` checks, derived from the input-space model (:mod:`fp8rl.inputspace`): for an op and
one of its classes, a tensor that exhibits that class (and plain, contiguous fp32 data on every other axis).

Each SPACE check is parametrized by the classes of one op's model, so a class an engine mishandles fails by name
(``CAST-SPACE-001[e4m3fn-layout.x=strided]``), and a class an engine declares it cannot take
(``engine.input_limits(op)``) is skipped with the engine's reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8rl.inputspace import MODEL, SIZE_CLASSES, with_layout, with_specials

from ._inputs import spanning_values

#: a representative size of each size class
SIZE_OF = {"lt64": 40, "eq64": 64, "eq128": 128, "eq256": 256, "ragged": 200, "gt256": 384, "gt256-ragged": 300}
assert set(SIZE_OF) == set(SIZE_CLASSES)
#: the default shape of an input whose class does not fix it: ragged both ways (not a tile multiple)
DEFAULT_ROWS, DEFAULT_COLS = 24, 200


def classes(op: str, prefix: tuple[str, ...] = ()) -> list[str]:
    """The classes of ``op``'s model (those starting with one of ``prefix``, if given)."""
    return [c for c in MODEL[op].classes() if not prefix or c.startswith(prefix)]


def skip_if_limited(engine, op: str, cls: str) -> None:
    """Skip (with the engine's reason) a class the engine declares it cannot take."""
    reason = engine.input_limits(op).get(cls)
    if reason:
        pytest.skip(f"{op} {cls}: {reason}")


def shape_for(cls: str) -> tuple[int, int]:
    """(rows, cols) of a 2-D input: a size class fixes its own dimension, the other stays the default."""
    axis, _, value = cls.partition("=")
    if axis.endswith(".last"):
        return DEFAULT_ROWS, SIZE_OF[value]
    if axis.endswith(".rows"):
        return SIZE_OF[value], 16
    return DEFAULT_ROWS, DEFAULT_COLS


def tensor_of_class(cls: str, rng: np.random.Generator, *, fmt: str | None = None, rows: int | None = None,
                    cols: int | None = None, leading: tuple[int, ...] = ()) -> torch.Tensor:
    """A float tensor of class ``cls`` (one of ``dtype.x=…``, ``layout.x=…``, ``rank.x=…``, ``size.x.*=…``,
    ``special.x=…``): the class's own property, default data otherwise. ``leading`` prepends batch dimensions."""
    axis, _, value = cls.partition("=")
    r, c = shape_for(cls)
    r, c = rows or r, cols or c
    x = spanning_values(rng, (*leading, r, c), fmt)
    if axis.startswith("special."):
        x = with_specials(x, [value], rng)
    if axis.startswith("dtype."):
        x = x.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[value])
        if value == "fp16":  # keep every value finite in fp16 (its max is 65504)
            x = torch.nan_to_num(x.float().clamp(-6e4, 6e4)).to(torch.float16)
    if axis.startswith("rank."):
        x = x.reshape(-1) if value == "1d" else x.reshape(2, -1, c) if value == "3d+" else x
    if axis.startswith("layout."):
        x = with_layout(x, value)
    return x


__all__ = ["DEFAULT_COLS", "DEFAULT_ROWS", "SIZE_OF", "classes", "shape_for", "skip_if_limited", "tensor_of_class"]
