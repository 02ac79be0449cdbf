"""Engine registry: built-ins by short name, out-of-tree engines by ``pkg.module:factory`` or entry point.

Security: nothing is imported unless the user names it. Built-ins are a fixed table of lazily imported
factories; ``module:factory`` is imported only when given explicitly; entry points are looked up only in the
``fp8rl.engines`` group and loaded only when their name is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from fp8rl.capabilities import validate_declared
from fp8rl.engine import Engine

ENTRY_POINT_GROUP = "fp8rl.engines"

#: short name → "module:factory" of the built-in engines (imported lazily)
BUILTINS: dict[str, str] = {
    "reference": "fp8rl.engines.reference:ReferenceEngine",
    "torch": "fp8rl.engines.torch:TorchEngine",
    "torch-cuda": "fp8rl.engines.torch:TorchCudaEngine",
    "verl": "fp8rl.engines.verl:VerlEngine",
    "hf": "fp8rl.engines.hf:HFEngine",
    "vllm": "fp8rl.engines.vllm:VllmEngine",
    "vllm-triton": "fp8rl.engines.vllm_triton:VllmTritonEngine",
    "vllm-triton-colmajor": "fp8rl.engines.vllm_triton:VllmTritonColMajorEngine",
    "vllm-triton-ue8m0": "fp8rl.engines.vllm_triton:VllmTritonUe8m0Engine",
    "verl-triton": "fp8rl.engines.verl_triton:VerlTritonEngine",
    "verl-vllm-refit": "fp8rl.engines.verl_vllm_refit:VerlVllmRefitEngine",
    "sglang": "fp8rl.engines.sglang:SglangEngine",
    "triton-interpret": "fp8rl.engines.triton_interpret:TritonInterpretEngine",
    "triton-interpret-faithful": "fp8rl.engines.triton_interpret:TritonInterpretFaithfulEngine",
    "trl": "fp8rl.engines.trl:TrlEngine",
    "areal": "fp8rl.engines.areal:ArealEngine",
    "openrlhf": "fp8rl.engines.openrlhf:OpenRlhfEngine",
    "skyrl": "fp8rl.engines.skyrl:SkyrlEngine",
    "hf-fp8": "fp8rl.engines.hf_fp8:HfFp8Engine",
    "compressed-tensors": "fp8rl.engines.compressed_tensors:CompressedTensorsEngine",
    "compressed-tensors-mx": "fp8rl.engines.compressed_tensors_mx:CompressedTensorsMXEngine",
    "vllm-mx": "fp8rl.engines.vllm_mx:VllmMXEngine",
    "torchao-mx": "fp8rl.engines.torchao_mx:TorchaoMXEngine",
    "torchao": "fp8rl.engines.torchao:TorchaoEngine",
}


class EngineLoadError(Exception):
    """The engine named by the user could not be found or constructed (CLI exit code 2)."""


def _import_factory(spec: str) -> Callable[[], Engine]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EngineLoadError(f"engine: expected 'pkg.module:factory', got {spec!r}")
    import os
    import sys

    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # as `python -m pytest` (a conformance run) imports it
        sys.path.insert(0, cwd)
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
    return load_engine_linted(name)[0]


def load_engine_linted(name: str) -> tuple[Engine, Any]:
    """:func:`load_engine`, and the policy lint (``fp8rl.policy_lint.PolicyLint``) it passed: what a report lists
    of it (deviations, warnings) without linting the engine twice."""
    if not isinstance(name, str) or not name.strip():
        raise EngineLoadError("engine: expected a non-empty engine name or 'pkg.module:factory'")
    name = name.strip()
    if name.startswith("mutant:"):
        from fp8rl import mutants
        from fp8rl.policy_lint import lint_engine

        mut = mutants.make_mutant(name.split(":", 1)[1])
        return mut, lint_engine(mut)  # a mutant is fp8rl's own: loaded as it is, its lint reported only
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
    from fp8rl.policy_lint import lint_engine

    try:
        lint = lint_engine(engine, caps)
    except Exception as exc:  # noqa: BLE001 - declared numerics that raise make the engine unloadable
        raise EngineLoadError(f"engine {name!r}: declared numerics raised {type(exc).__name__}: {exc}") from exc
    if lint.errors:
        raise EngineLoadError(f"engine {name!r} declares a policy that is unsound in its compute dtype (fp8rl "
                              "policy lint): " + "; ".join(lint.errors))
    problems = protocol_mismatches(engine)
    if problems:
        raise EngineLoadError(f"engine {name!r} does not implement the engine protocol (fp8rl.engine): "
                              + "; ".join(problems))
    return engine, lint


def protocol_ops() -> dict[str, Callable]:
    """Every method of the engine protocol (:class:`fp8rl.engine.Engine` and its area mixins), by name."""
    from fp8rl.engine import Engine

    out: dict[str, Callable] = {}
    for klass in reversed(Engine.__mro__):
        if klass.__module__ != "fp8rl.engine":
            continue
        for attr, value in vars(klass).items():
            if callable(value) and not attr.startswith("_"):
                out[attr] = value
    return out


def defining_class(cls: type, attr: str) -> type | None:
    """The class whose body defines ``attr`` for instances of ``cls`` (the first in its MRO), or None: where an
    engine's op comes from (its own class, the oracle it inherits from, or the protocol's default)."""
    return next((klass for klass in cls.__mro__ if attr in vars(klass)), None)


def _call_shapes(fn: Callable) -> list[tuple[list, dict]]:
    """The calls the suite may make of a protocol method (self excluded): with its required arguments only, and
    with every argument (positional parameters positionally, keyword-only ones by name)."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p for p in params if p.kind == p.KEYWORD_ONLY]
    required = ([object() for p in positional if p.default is p.empty],
                {p.name: object() for p in keyword if p.default is p.empty})
    full = ([object() for _ in positional], {p.name: object() for p in keyword})
    return [required, full]


def protocol_mismatches(engine: object) -> list[str]:
    """The engine's methods that can't be called the way the protocol is: for each protocol method the engine
    overrides, whether its signature binds the protocol's calls (:func:`_call_shapes`). One line each, naming the
    method, the protocol's signature and the engine's."""
    import inspect

    problems = []
    cls = type(engine)
    for op, proto in protocol_ops().items():
        owner = defining_class(cls, op)
        impl = vars(owner)[op] if owner is not None else None
        if impl is None or getattr(impl, "__module__", None) == "fp8rl.engine" or not callable(impl):
            continue
        if isinstance(impl, (staticmethod, classmethod)):
            continue
        try:
            sig = inspect.signature(impl)
        except (TypeError, ValueError):
            continue
        for args, kwargs in _call_shapes(proto):
            try:
                sig.bind(object(), *args, **kwargs)
            except TypeError as exc:
                problems.append(f"{cls.__name__}.{op}{sig} can't be called as the protocol's {op}"
                                f"{inspect.signature(proto)} ({exc})")
                break
    return problems


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


def _probe_calls(caps: dict) -> list[tuple[str, tuple, dict, Callable[[Any], str | None]]]:
    """Tiny calls of the ops an engine declares, each with a checker of the returned type (None if right)."""
    import torch
    from fp8rl.reference.kv import KVCache
    from fp8rl.reference.quant import Granularity, QuantizedTensor

    def tensor_of(dtype: torch.dtype) -> Callable[[Any], str | None]:
        def judge(out: Any) -> str | None:
            if not isinstance(out, torch.Tensor):
                return f"returned {type(out).__name__}, expected a {dtype} torch.Tensor"
            return None if out.dtype == dtype else f"returned a {out.dtype} tensor, expected {dtype}"
        return judge

    def quantized(out: Any) -> str | None:
        if not isinstance(out, QuantizedTensor):
            return f"returned {type(out).__name__}, expected fp8rl.reference.quant.QuantizedTensor"
        if not isinstance(out.codes, torch.Tensor) or out.codes.dtype != torch.uint8:
            return (f"returned codes of dtype {getattr(out.codes, 'dtype', type(out.codes).__name__)}, expected "
                    "torch.uint8 (the FP8 bit patterns: e.g. t.view(torch.uint8) of a float8 tensor)")
        if not isinstance(out.scale, torch.Tensor) or out.scale.dtype != torch.float32:
            return f"returned scales of dtype {getattr(out.scale, 'dtype', type(out.scale).__name__)}, expected torch.float32"
        return None

    def kv_cache(out: Any) -> str | None:
        if not isinstance(out, KVCache):
            return f"returned {type(out).__name__}, expected fp8rl.reference.kv.KVCache"
        if not isinstance(out.codes, torch.Tensor) or out.codes.dtype != torch.uint8:
            return f"returned codes of dtype {getattr(out.codes, 'dtype', type(out.codes).__name__)}, expected torch.uint8"
        return None

    x = torch.linspace(-2.0, 2.0, 2 * 128, dtype=torch.float32).reshape(2, 128)
    calls: list[tuple[str, tuple, dict, Callable[[Any], str | None]]] = []
    fmts = [k.split(".", 1)[1] for k, v in caps.items() if v is True and k.startswith("cast.") and k != "cast.bf16"]
    if fmts:
        calls.append(("cast", (x, fmts[0]), {}, tensor_of(torch.uint8)))
    if caps.get("cast.bf16") is True:
        calls.append(("round_bf16", (x,), {}, tensor_of(torch.bfloat16)))
    grans = {"tensor": Granularity.tensor(), "token": Granularity.token(), "channel": Granularity.channel(),
             "group": Granularity.group(128), "block": Granularity.block(128)}
    for kind, g in grans.items():
        if caps.get(f"quantize.{kind}") is True:
            calls.append(("quantize", (x, g), {}, quantized))
    if caps.get("kv.store") is True:
        calls.append(("kv_store", (x.reshape(1, 2, 2, 64), torch.tensor(0.01)), {"fmt": "e4m3fn", "layout": "tensor"},
                      kv_cache))
    return calls


#: how long a load-time probe call may take before it is left to the checks (a hang is theirs to report)
PROBE_TIMEOUT_S = 30.0


def return_type_problems(engine: Engine, caps: dict) -> list[str]:
    """Call each op the engine declares once on a tiny input and check the *type* of what it returns (a tuple instead
    of a QuantizedTensor, float8 codes instead of uint8, ...): a mistake every check of the op would report again. An
    op that raises (Unsupported or anything else) is left to the checks, which report it per case."""
    import threading

    problems: list[str] = []
    wrong_ops: set[str] = set()
    for op, args, kwargs, judge in _probe_calls(caps):
        if op in wrong_ops:
            continue  # one message an op
        box: list[Any] = []

        def call(op: str = op, args: tuple = args, kwargs: dict = kwargs, box: list = box) -> None:
            try:
                box.append(getattr(engine, op)(*args, **kwargs))
            except TypeError as exc:  # the protocol's own types refusing what the engine built
                if _raised_by_protocol_type(exc):
                    box.append(exc)
            except Exception:  # noqa: BLE001 - the checks report an op that raises, case by case
                pass

        worker = threading.Thread(target=call, name=f"fp8rl-probe-{op}", daemon=True)
        worker.start()
        worker.join(PROBE_TIMEOUT_S)  # an op that hangs is left to the checks' timeouts
        if not box:
            continue
        why = (f"built a protocol type wrongly: {type(box[0]).__name__}: {box[0]}" if isinstance(box[0], TypeError)
               else judge(box[0]))
        if why is not None:
            wrong_ops.add(op)
            problems.append(f"{op}{_describe_args(args, kwargs)} {why}")
    return problems


def _raised_by_protocol_type(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the validation of one of the protocol's data types (QuantizedTensor, KVCache,
    ... of fp8rl.reference): the engine built it from the wrong types (e.g. float8 codes instead of uint8)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    return last.name == "__post_init__" and "reference" in last.filename.replace("\\", "/").split("/")[-2:-1]


def _describe_args(args: tuple, kwargs: dict) -> str:
    def one(a: Any) -> str:
        shape = getattr(a, "shape", None)
        return f"<{a.dtype} {tuple(shape)}>" if shape is not None and hasattr(a, "dtype") else repr(a)
    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"
