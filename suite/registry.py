"""Engine registry: built-ins by short name, out-of-tree engines by ``pkg.module:factory`` or entry point.

Security: nothing is imported unless the user names it. Built-ins are a fixed table of lazily imported
factories; ``module:factory`` is imported only when given explicitly; entry points are looked up only in the
``fp8rl.engines`` group and loaded only when their name is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from fp8rl.capabilities import validate_declared
from fp8rl.engine import Engine

ENTRY_POINT_GROUP = "fp8rl.engines"

#: short name → "module:factory" of the built-in engines (imported lazily)
BUILTINS: dict[str, str] = {
    "reference": "fp8rl.engines.reference:ReferenceEngine",
    "torch": "fp8rl.engines.torch_native:TorchEngine",
    "torch-cuda": "fp8rl.engines.torch_native:TorchCudaEngine",
    "verl": "fp8rl.engines.verl:VerlEngine",
    "hf": "fp8rl.engines.hf:HFEngine",
    "vllm": "fp8rl.engines.vllm:VllmEngine",
    "vllm-triton": "fp8rl.engines.vllm_triton:VllmTritonEngine",
    "vllm-triton-colmajor": "fp8rl.engines.vllm_triton:VllmTritonColMajorEngine",
    "vllm-triton-ue8m0": "fp8rl.engines.vllm_triton:VllmTritonUe8m0Engine",
    "verl-triton": "fp8rl.engines.verl:VerlTritonEngine",
    "sglang": "fp8rl.engines.sglang:SglangEngine",
    "triton-interpret": "fp8rl.engines.triton_interpret:TritonInterpretEngine",
    "triton-interpret-faithful": "fp8rl.engines.triton_interpret:TritonInterpretFaithfulEngine",
    "trl": "fp8rl.engines.trl:TrlEngine",
    "areal": "fp8rl.engines.areal:ArealEngine",
    "openrlhf": "fp8rl.engines.openrlhf:OpenRlhfEngine",
    "skyrl": "fp8rl.engines.skyrl:SkyrlEngine",
    "hf-fp8": "fp8rl.engines.checkpoint_hf:HfFp8Engine",
    "compressed-tensors": "fp8rl.engines.compressed_tensors:CompressedTensorsEngine",
    "compressed-tensors-mx": "fp8rl.engines.mx_peers:CompressedTensorsMXEngine",
    "vllm-mx": "fp8rl.engines.mx_peers:VllmMXEngine",
    "torchao-mx": "fp8rl.engines.torchao_mx:TorchaoMXEngine",
    "torchao": "fp8rl.engines.torchao_float8:TorchaoEngine",
}


class EngineLoadError(Exception):
    """The engine named by the user could not be found or constructed (CLI exit code 2)."""


def _import_factory(spec: str) -> Callable[[], Engine]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EngineLoadError(f"engine: expected 'pkg.module:factory', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - report any import failure as a load error
        raise EngineLoadError(f"engine {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EngineLoadError(f"engine {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise EngineLoadError(f"engine {spec!r}: {attr!r} is not callable")
    return obj  # type: ignore[return-value]


def _entry_point_names() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_engines() -> dict[str, str]:
    """Name → source ("builtin", "mutant", or "entry point <value>") of every engine that can be named."""
    from fp8rl import mutants

    out = {name: "builtin" for name in BUILTINS}
    out.update({f"mutant:{m}": "mutant" for m in mutants.MUTANTS})
    for name, ep in _entry_point_names().items():
        out.setdefault(name, f"entry point {getattr(ep, 'value', '?')}")
    return out


def load_engine(name: str) -> Engine:
    """Construct the engine called ``name``: a built-in, ``mutant:<name>``, an entry point, or ``module:factory``."""
    if not isinstance(name, str) or not name.strip():
        raise EngineLoadError("engine: expected a non-empty engine name or 'pkg.module:factory'")
    name = name.strip()
    if name.startswith("mutant:"):
        from fp8rl import mutants

        return mutants.make_mutant(name.split(":", 1)[1])
    if name in BUILTINS:
        factory = _import_factory(BUILTINS[name])
    elif ":" in name:
        factory = _import_factory(name)
    else:
        eps = _entry_point_names()
        if name not in eps:
            known = ", ".join(sorted(available_engines()))
            raise EngineLoadError(f"engine: unknown engine {name!r}; known: {known}; or give 'pkg.module:factory'")
        try:
            factory = eps[name].load()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001
            raise EngineLoadError(f"engine {name!r}: entry point failed to load: {exc}") from exc
    try:
        engine = factory()
    except Exception as exc:  # noqa: BLE001
        raise EngineLoadError(f"engine {name!r}: factory raised {type(exc).__name__}: {exc}") from exc
    for attr in ("name", "capabilities", "version"):
        if not hasattr(engine, attr):
            raise EngineLoadError(f"engine {name!r}: object {engine!r} lacks {attr!r}; expected an fp8rl Engine")
    for what in ("version", "capabilities"):
        try:
            value = getattr(engine, what)()
        except Exception as exc:  # noqa: BLE001 - a broken engine is a load error, not a verdict
            raise EngineLoadError(f"engine {name!r}: {what}() raised {type(exc).__name__}: {exc}") from exc
        if what == "capabilities":
            try:
                caps = validate_declared(name, value)
            except ValueError as exc:
                raise EngineLoadError(str(exc)) from None
    _check_declared_numerics(name, engine, caps)
    return engine


def _check_declared_numerics(name: str, engine: Engine, caps: dict) -> None:
    """The numerics an engine declares for what it says it can do must be readable: ``cast_overflow(fmt)`` for
    ``cast.<fmt>``, ``scale_policy(kind)`` for ``quantize.<kind>``, ``kv_policy(fmt, layout)`` for the KV area
    (Unsupported is an answer; any other exception is a load error)."""
    from fp8rl.engine import Unsupported

    calls: list[tuple[str, tuple[str, ...]]] = []
    for key, status in caps.items():
        if status is not True:
            continue
        family, _, arg = key.partition(".")
        if family == "cast" and arg != "bf16":
            calls.append(("cast_overflow", (arg,)))
        elif family == "quantize":
            calls.append(("scale_policy", (arg,)))
    if any(k.startswith("kv.") and v is True for k, v in caps.items()):
        calls += [("kv_policy", (fmt, layout)) for fmt in ("e4m3fn", "e5m2") for layout in ("tensor", "head",
                                                                                               "token_head")]
    for op, args in calls:
        try:
            getattr(engine, op)(*args)
        except Unsupported:
            continue
        except Exception as exc:  # noqa: BLE001 - declared numerics that raise make the engine unloadable
            raise EngineLoadError(f"engine {name!r}: declared numerics {op}{args!r} raised "
                                  f"{type(exc).__name__}: {exc}") from exc
