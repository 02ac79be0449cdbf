"""Capture of engine op calls for ``fp8rl repro``: each call's arguments and result as safetensors + JSON.

Opt-in: when the environment variable :data:`CAPTURE_ENV` names a directory, the guarded engine of a conformance
run (:class:`fp8rl.checks.GuardedEngine`) hands every op call to :func:`capture_call`, which writes
``<dir>/<pid>-<n>.json`` (the op, the check running it, every non-tensor argument, the error if it raised) and
``<dir>/<pid>-<n>.safetensors`` (every tensor of the arguments and of the result). Nothing else reads or writes
the directory; a run without the variable captures nothing.

The encoding (:func:`encode` / :func:`decode`) keeps the structure of the arguments: tensors (by name in the
safetensors file, with their dtype, shape and original strides), ``None``/bool/int/str, floats (non-finite ones
spelled out), torch dtypes, lists, tuples, dicts, paths, and the dataclasses of fp8rl's own modules (a
``Granularity``, ``QuantizedTensor``, ``KVCache``, ``CorrectionConfig``, ...) by their ``module:class`` and init
fields. Anything else is kept as its ``repr`` only (an "opaque" value the repro says it can't rebuild). Decoding
rebuilds dataclasses only from ``fp8rl.*`` modules: a capture file can't make the reader import anything else.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: names the capture directory; set by ``fp8rl repro`` for the conformance run it starts
CAPTURE_ENV = "FP8RL_CAPTURE_DIR"
#: a tensor argument larger than this is not stored (its place says so): a repro is about small inputs
MAX_TENSOR_BYTES = 256 * 2**20
#: a process stops capturing after this many bytes of tensors (a long hypothesis run must not fill the disk)
MAX_PROCESS_BYTES = 2 * 2**30

_counter = itertools.count()
_written = [0]


def capture_dir() -> Path | None:
    """The capture directory named by :data:`CAPTURE_ENV`, or None (capture off)."""
    value = os.environ.get(CAPTURE_ENV)
    return Path(value) if value else None


class Opaque(dict):
    """A captured value the capture could not encode (kept as ``{"__opaque__": type, "repr": ...}``)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"capture: unknown torch dtype {name!r}")
    return dt


def encode(obj: Any, tensors: dict[str, torch.Tensor], key: str, depth: int = 0) -> Any:
    """A JSON value for ``obj``; its tensors are added to ``tensors`` under names starting with ``key``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        meta: dict[str, Any] = {"__tensor__": key, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                                "stride": list(t.stride()) if t.layout == torch.strided else None,
                                "contiguous": bool(t.is_contiguous()) if t.layout == torch.strided else False,
                                "device": str(t.device), "requires_grad": bool(obj.requires_grad)}
        nbytes = t.numel() * t.element_size()
        if t.layout != torch.strided or t.device.type == "meta" or nbytes > MAX_TENSOR_BYTES:
            meta["__tensor__"] = None
            meta["omitted"] = f"not stored ({t.layout}, {t.device}, {nbytes} bytes)"
        else:
            tensors[key] = t.cpu().contiguous().clone()
        return meta
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": _dtype_name(obj)}
    if isinstance(obj, os.PathLike):
        return {"__path__": os.fspath(obj)}
    if depth > 8:
        return {"__opaque__": type(obj).__name__, "repr": repr(obj)[:300]}
    if isinstance(obj, (list, tuple)):
        items = [encode(v, tensors, f"{key}.{i}", depth + 1) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        return {"__dict__": [[encode(k, tensors, f"{key}.k{i}", depth + 1), encode(v, tensors, f"{key}.{i}", depth + 1)]
                             for i, (k, v) in enumerate(obj.items())]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and type(obj).__module__.startswith("fp8rl."):
        cls = type(obj)
        fields = {f.name: encode(getattr(obj, f.name), tensors, f"{key}.{f.name}", depth + 1)
                  for f in dataclasses.fields(obj) if f.init}
        return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    return {"__opaque__": f"{type(obj).__module__}.{type(obj).__qualname__}", "repr": repr(obj)[:300]}


def _class(spec: str) -> type:
    module, _, qualname = spec.partition(":")
    if not module.startswith("fp8rl."):
        raise ValueError(f"capture: refusing to rebuild {spec!r}: only fp8rl's own dataclasses are rebuilt")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def restore_layout(t: torch.Tensor, stride: list[int] | None) -> torch.Tensor:
    """``t`` (contiguous) with the original strides when they were a permutation of a dense layout (a transpose);
    otherwise ``t`` as it is."""
    if not stride or t.dim() < 2 or list(t.stride()) == list(stride):
        return t
    order = sorted(range(t.dim()), key=lambda d: (-stride[d], d))  # outermost dimension first
    dense = torch.empty([t.shape[d] for d in order], dtype=t.dtype).permute(
        [order.index(d) for d in range(t.dim())])
    if list(dense.stride()) != list(stride):
        return t
    dense.copy_(t)
    return dense


def decode(value: Any, tensors: dict[str, torch.Tensor], *, layout: bool = True) -> Any:
    """The object :func:`encode` encoded (tensors from ``tensors``; ``layout``: restore transposed layouts)."""
    if isinstance(value, list):
        return [decode(v, tensors, layout=layout) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        name = value["__tensor__"]
        if name is None:
            return Opaque({"__opaque__": "tensor", "repr": value.get("omitted", "not stored")})
        t = tensors[name]
        t = restore_layout(t, value.get("stride")) if layout else t
        if value.get("requires_grad") and t.is_floating_point():
            t = t.clone().requires_grad_(True)
        return t
    if "__float__" in value:
        return float(value["__float__"])
    if "__dtype__" in value:
        return _dtype(value["__dtype__"])
    if "__path__" in value:
        return Path(value["__path__"])
    if "__tuple__" in value:
        return tuple(decode(v, tensors, layout=layout) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode(k, tensors, layout=layout): decode(v, tensors, layout=layout) for k, v in value["__dict__"]}
    if "__dataclass__" in value:
        cls = _class(value["__dataclass__"])
        return cls(**{k: decode(v, tensors, layout=layout) for k, v in value["fields"].items()})
    if "__opaque__" in value:
        return Opaque(value)
    raise ValueError(f"capture: unknown encoded value with keys {sorted(value)}")


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def save_call(path_stem: Path, op: str, args: tuple, kwargs: dict, *, result: Any = None, error: str | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write one op call as ``<stem>.json`` + ``<stem>.safetensors``; returns the JSON document."""
    tensors: dict[str, torch.Tensor] = {}
    doc: dict[str, Any] = {"op": op, "args": encode(tuple(args), tensors, "args")["__tuple__"],
                           "kwargs": {k: encode(v, tensors, f"kwargs.{k}") for k, v in kwargs.items()},
                           "result": encode(result, tensors, "result") if error is None else None,
                           "error": error}
    doc.update(extra or {})
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    _save_tensors(tensors, path_stem.with_suffix(".safetensors"))
    path_stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    return doc


def capture_call(op: str, args: tuple, kwargs: dict, *, result: Any = None, error: BaseException | None = None) -> None:
    """Save one guarded op call into the capture directory (a no-op without :data:`CAPTURE_ENV`). Never raises:
    a capture problem is written next to the call instead, so the conformance run itself is not changed."""
    where = capture_dir()
    if where is None or _written[0] > MAX_PROCESS_BYTES:
        return
    n = next(_counter)
    stem = where / f"{os.getpid()}-{n:06d}"
    extra = {"index": n, "pid": os.getpid(), "check": os.environ.get("PYTEST_CURRENT_TEST", "")}
    try:
        save_call(stem, op, args, kwargs, result=result,
                  error=None if error is None else f"{type(error).__name__}: {error}", extra=extra)
        _written[0] += stem.with_suffix(".safetensors").stat().st_size
    except Exception as exc:  # noqa: BLE001 - a capture must never change the run it observes
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".failed").write_text(f"{op}: {type(exc).__name__}: {exc}")


@dataclass
class Call:
    """One captured op call, decoded."""

    op: str
    args: tuple
    kwargs: dict
    result: Any
    error: str | None
    check: str
    stem: Path
    doc: dict


def load_call(stem: Path) -> Call:
    """The call saved at ``stem`` (``<stem>.json`` + ``<stem>.safetensors``)."""
    from safetensors.torch import load_file

    doc = json.loads(stem.with_suffix(".json").read_text())
    st = stem.with_suffix(".safetensors")
    tensors = load_file(str(st)) if st.is_file() else {}
    args = tuple(decode(a, tensors) for a in doc["args"])
    kwargs = {k: decode(v, tensors) for k, v in doc["kwargs"].items()}
    return Call(doc["op"], args, kwargs, decode(doc.get("result"), tensors), doc.get("error"), doc.get("check", ""),
                stem, doc)


def iter_calls(directory: Path) -> Iterator[Call]:
    """Every call captured in ``directory``, in the order they were made (per process)."""
    stems = sorted(p.with_suffix("") for p in Path(directory).glob("*.json"))
    for stem in sorted(stems, key=lambda s: (s.name.split("-")[0], s.name)):
        yield load_call(stem)


__all__ = ["CAPTURE_ENV", "Call", "Opaque", "capture_call", "capture_dir", "decode", "encode", "iter_calls",
           "load_call", "restore_layout", "save_call"]
