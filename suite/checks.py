"""Building blocks of conformance checks: the ``@check`` decorator, capability gates, guarded engines, and
comparisons that fail with a reproduction (shapes, seed, first offending indices, expected vs got) and record
metrics (error/bound, ULP histograms) for the report.
"""

from __future__ import annotations

import contextvars
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from fp8rl import capabilities, fixtures, inputspace, journal, tolerances
from fp8rl.engine import ORACLE_CALLS, Engine, EngineError, Unsupported, capability_reason
from fp8rl.reference.formats import decode_codes, ulp_distance
from fp8rl.reference.quant import Granularity, QuantizedTensor
from fp8rl.registry import defining_class

# ----------------------------------------------------------------------------------------------------------------
# check metadata

#: the start of a skip reason that says the engine refused a case of a capability it declares (Unsupported)
REFUSED_PREFIX = "refused by the engine: "


@dataclass(frozen=True)
class CheckSpec:
    id: str
    title: str
    area: str
    #: the tolerance-table entries the check is judged with (``("exact",)`` for bit-exact checks)
    bounds: tuple[str, ...]
    requires: tuple[str, ...]
    module: str
    function: str

    @property
    def bound(self) -> str:
        """The bound names as one string (report.json ``bound``): ``"a"`` or ``"a, b"``."""
        return ", ".join(self.bounds)


#: every check defined (id → spec); ids are unique across the suite
CHECKS: dict[str, CheckSpec] = {}


def all_checks() -> dict[str, CheckSpec]:
    """Every check of the suite (imports each ``fp8rl.conformance.test_*`` module, which declares its checks)."""
    import importlib
    import os
    import pkgutil
    import sys

    import fp8rl.conformance as conf

    # a module pytest already imported under another name (a checkout's 'conformance.test_kv') declared its checks:
    # importing it again as fp8rl.conformance.* would declare each id twice
    loaded = {os.path.realpath(f) for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}
    for mod in pkgutil.iter_modules(conf.__path__):
        if not mod.name.startswith("test_"):
            continue
        path = os.path.realpath(os.path.join(str(mod.module_finder.path), f"{mod.name}.py"))  # type: ignore[union-attr]
        if path not in loaded:
            importlib.import_module(f"fp8rl.conformance.{mod.name}")
    return CHECKS


def area_of_module(module: str) -> str:
    """conformance module name → area: ``fp8rl.conformance.test_quantization`` → ``quantization``."""
    return module.rsplit(".", 1)[-1].removeprefix("test_")


def check(check_id: str, title: str, *, bound: str | Sequence[str] = "exact", requires: Sequence[str] = (),
          timeout: float = 60.0) -> Callable:
    """Declare a conformance check.

    ``check_id`` is stable (e.g. ``QUANT-GROUP-003``); ``title`` is its one sentence of spec; ``bound`` names the
    tolerance-table entry it uses (``exact`` for bit-exact checks), or several when the check is judged with more
    than one; ``requires`` lists capability keys, which may contain ``{param}`` placeholders filled from the test's
    parameters (e.g. ``cast.{fmt}``).
    """
    bounds = (bound,) if isinstance(bound, str) else tuple(bound)
    if not bounds:
        raise ValueError(f"check {check_id}: bound: expected a tolerance name or a non-empty sequence of them")
    for name in bounds:
        tolerances.get(name)  # fail at import if the bound is not in the table

    def deco(fn: Callable) -> Callable:
        spec = CheckSpec(check_id, title, area_of_module(fn.__module__), bounds, tuple(requires), fn.__module__,
                         fn.__name__)
        prev = CHECKS.get(check_id)
        if prev is not None and (prev.module, prev.function) != (spec.module, spec.function):
            raise ValueError(f"check id {check_id!r} used twice: {prev.module}.{prev.function} and "
                             f"{spec.module}.{spec.function}")
        CHECKS[check_id] = spec
        fn = pytest.mark.fp8rl_check(spec=spec)(fn)
        return pytest.mark.timeout(timeout)(fn)

    return deco


def required_capabilities(spec: CheckSpec, params: dict[str, Any]) -> list[str]:
    """The capability keys a check case needs: its ``requires=`` templates filled from the case's parameters,
    each a key of :mod:`fp8rl.capabilities` (ValueError otherwise)."""
    out = []
    for key in spec.requires:
        try:
            filled = key.format(**params)
        except KeyError as exc:
            raise ValueError(f"check {spec.id}: capability {key!r} needs parameter {exc}") from None
        if filled not in capabilities.CAPABILITIES:
            raise ValueError(f"check {spec.id}: requires unknown capability {filled!r}; known: "
                             f"{', '.join(capabilities.CAPABILITIES)}")
        out.append(filled)
    return out


def require(engine: Engine, *keys: str) -> None:
    """Skip the running check (with the engine's reason) unless every capability in ``keys`` is available."""
    record_requires(keys)
    for key in keys:
        reason = capability_reason(engine, key)
        if reason is not None:
            pytest.skip(f"{key}: {reason}")


# ----------------------------------------------------------------------------------------------------------------
# metrics recording: the plugin sets CURRENT_METRICS to a per-test dict during the call phase

CURRENT_METRICS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fp8rl_metrics", default=None)


def record_metrics(**metrics: Any) -> None:
    """Merge metrics into the running check's record (worst error/bound wins; histograms add up)."""
    store = CURRENT_METRICS.get()
    if store is None:
        return
    for key, value in metrics.items():
        if key == "ulp_hist":
            hist = store.setdefault("ulp_hist", {})
            for k, v in value.items():
                hist[k] = hist.get(k, 0) + int(v)
        elif key in ("err_over_bound", "max_abs_err", "mismatch_frac", "max_ulp"):
            value = float(value)
            if key not in store or not (store[key] >= value):
                store[key] = value
        else:
            store[key] = value


def record_coverage(op: str, classes: set[str]) -> None:
    """Add the input classes (fp8rl.inputspace) an op call exercised to the running check's record."""
    store = CURRENT_METRICS.get()
    if store is None or not classes:
        return
    cov = store.setdefault("_coverage", {})
    cov[op] = sorted(set(cov.get(op, ())) | classes)


def record_section(name: str, data: dict) -> None:
    """Attach a report section (e.g. a table + plot spec, see fp8rl.reports) from the running check.

    Sections from all checks of a run are merged into ``report["sections"]`` (later checks overwrite a name).
    """
    store = CURRENT_METRICS.get()
    if store is None:
        return
    store.setdefault("_sections", {})[name] = data


# ----------------------------------------------------------------------------------------------------------------
# guarded engine: turns misbehaviour into EngineError (→ outcome "error")


#: modules whose classes are fp8rl's own oracle: an op an engine inherits unchanged from a class defined here runs
#: the oracle, not the engine (reported as such and not part of the engine's verdict)
ORACLE_MODULES = ("fp8rl.engines.reference", "fp8rl.reference")
#: engine methods that declare numerics or describe the engine (not ops: calling them executes no kernel)
DECLARATIONS = frozenset({"cast_overflow", "scale_policy", "kv_policy", "mx_policy", "capabilities", "version",
                          "input_limits", "instrument_notes", "describe", "checkpoint_layout_reason"})
#: ops whose first argument is the engine's own opaque handle (the engine may change it; it is not the caller's)
HANDLE_OPS = frozenset({"rollout", "rollout_logits", "update_weights"})


def _is_oracle_module(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in ORACLE_MODULES)


def op_origin(engine: Any, op: str) -> str:
    """Whose code ``engine.op`` runs: ``"engine"`` (defined by the engine's own classes), ``"oracle"`` (inherited
    unchanged from a class of fp8rl's oracle, :data:`ORACLE_MODULES`, by an engine that is not the oracle itself)
    or ``"protocol"`` (the protocol's default, which raises Unsupported)."""
    cls = type(engine)
    klass = defining_class(cls, op)
    if klass is None:
        return "engine"  # an instance attribute or __getattr__: the engine's own
    if klass.__module__ == "fp8rl.engine":
        return "protocol"
    if _is_oracle_module(klass.__module__) and not _is_oracle_module(cls.__module__):
        return "oracle"
    return "engine"


#: the running check's record of the engine ops it called (set by the plugin for a check's setup, call and
#: teardown): op → {"engine": n, "oracle": n, "refused": [messages]}
CURRENT_OPS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fp8rl_ops", default=None)


def record_op(op: str, origin: str, refused: str | None = None) -> None:
    """Count one call of ``op`` (its :func:`op_origin`) in the running check's record; ``refused``: the engine
    raised Unsupported with this message."""
    store = CURRENT_OPS.get()
    if store is None or op in DECLARATIONS:
        return
    ops = store.setdefault("ops", {})
    row = ops.setdefault(op, {"engine": 0, "oracle": 0, "refused": []})
    if refused is not None:
        row["refused"].append(refused[:300])
    elif origin in ("engine", "oracle"):
        row[origin] += 1


def record_requires(keys: Sequence[str]) -> None:
    """The capability keys the running check case needs (its ``requires=``, or a ``require()`` in its body)."""
    store = CURRENT_OPS.get()
    if store is not None:
        req = store.setdefault("requires", [])
        req.extend(k for k in keys if k not in req)


class InputMutated(AssertionError):
    """An engine op wrote into a tensor its caller passed (invariant INV-INPUT-001): a failed check."""


def _tensors_in(obj: Any, path: str, depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The tensors a caller hands an op inside ``obj``: tensors, dict values, list/tuple items and the fields of
    the oracle's dataclasses (QuantizedTensor, KVCache, KVScales, MXTensor, ...), three levels deep."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.device.type == "meta":
            return []
        return [(path, obj)]
    if depth >= 3:
        return []
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _tensors_in(v, f"{path}[{k!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += _tensors_in(v, f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type) and \
            _is_oracle_module(type(obj).__module__):
        for f in dataclasses.fields(obj):
            out += _tensors_in(getattr(obj, f.name, None), f"{path}.{f.name}", depth + 1)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def snapshot_inputs(op: str, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(argument path, the caller's tensor, a copy of it) for every tensor handed to ``op``."""
    named: list[tuple[str, Any]] = [(f"argument {i}", a) for i, a in enumerate(args)
                                    if not (i == 0 and op in HANDLE_OPS)]
    named += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    out = []
    for name, value in named:
        for path, t in _tensors_in(value, name):
            out.append((path, t, t.detach().clone()))
    return out


def changed_input(snapshot: list[tuple[str, torch.Tensor, torch.Tensor]]) -> str | None:
    """None if every tensor still holds its bytes, shape and dtype; else where the first change is."""
    for path, t, before in snapshot:
        if t.dtype != before.dtype or tuple(t.shape) != tuple(before.shape):
            return f"{path}: {before.dtype} {tuple(before.shape)} became {t.dtype} {tuple(t.shape)}"
        if t.numel() == 0:
            continue
        a, b = _bytes(before), _bytes(t)
        if not torch.equal(a, b):
            flat = (a.view(-1, before.element_size()) != b.view(-1, before.element_size())).any(dim=1)
            i = int(flat.nonzero()[0, 0])
            idx = tuple(int(v) for v in np.unravel_index(i, tuple(before.shape))) if before.dim() else ()
            old, new = before.reshape(-1)[i].item(), t.detach().reshape(-1)[i].item()
            return (f"{path} (shape {tuple(before.shape)}, {before.dtype}): {int(flat.sum())} element(s) changed, "
                    f"first at {idx}: {old!r} became {new!r}")
    return None


def _capture(op: str, args: tuple, kwargs: dict, **what: Any) -> None:
    """Opt-in, for ``fp8rl repro``: with FP8RL_CAPTURE_DIR set, save the op call's arguments and result or error
    (:mod:`fp8rl.repro_capture`); without it, nothing."""
    if os.environ.get("FP8RL_CAPTURE_DIR"):
        from fp8rl.repro_capture import capture_call

        capture_call(op, args, kwargs, **what)


@dataclass
class GuardedEngine:
    """Wraps an engine; validates every op's output (type, shape, dtype, NaN) and wraps its exceptions."""

    inner: Engine
    #: vocabulary size of each rollout handle (from its HF config), to validate sampled token ids
    _vocab: dict[int, int | None] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.inner.name

    def version(self) -> str:
        return self.inner.version()

    def capabilities(self):
        return self.inner.capabilities()

    def checkpoint_layout_reason(self, layout: str) -> str | None:
        """A declaration, like :meth:`capabilities`, not an op (None means: this layout loads here; see
        fp8rl.engine.checkpoint_layout_reason)."""
        hook = getattr(self.inner, "checkpoint_layout_reason", None)
        return None if hook is None else hook(layout)

    def __getattr__(self, item: str) -> Any:
        # ops added by later areas are guarded generically (exceptions only)
        attr = getattr(self.inner, item)
        if not callable(attr) or item.startswith("_"):
            return attr
        return lambda *a, **k: self._call(item, *a, **k)

    def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        record_coverage(op, inputspace.classify(op, args, kwargs))  # which input classes the suite exercised
        origin = op_origin(self.inner, op)
        snapshot = snapshot_inputs(op, args, kwargs) if op not in DECLARATIONS else []
        journal.enter_op(op)  # if this process dies inside the op, the report names it (fp8rl.journal)
        refused = False
        oracle_calls = ORACLE_CALLS.set(set())
        try:
            out = getattr(self.inner, op)(*args, **kwargs)
        except Unsupported as exc:
            if op in DECLARATIONS:  # a declaration that says "not implemented": skipped with the engine's reason
                pytest.skip(f"{op}: {exc}")
            refused = True
            record_op(op, origin, refused=f"{op}: {exc}")
            pytest.skip(f"{REFUSED_PREFIX}{op}: {exc}")
        except (EngineError, pytest.skip.Exception):
            raise
        except Exception as exc:  # noqa: BLE001 - any engine exception is an engine error
            _capture(op, args, kwargs, error=exc)
            raise EngineError(f"{self.inner.name}.{op} raised {type(exc).__name__}: {exc}") from exc
        finally:
            journal.leave_op()
            delegated = (id(self.inner), op) in (ORACLE_CALLS.get() or ())
            ORACLE_CALLS.reset(oracle_calls)
            if not refused:  # the engine's (or the oracle's) code ran, whatever it returned
                record_op(op, "oracle" if delegated and origin == "engine" and
                          not _is_oracle_module(type(self.inner).__module__) else origin)
        _capture(op, args, kwargs, result=out)
        if out is None:
            raise EngineError(f"{self.inner.name}.{op} returned None")
        changed = changed_input(snapshot)
        if changed is not None:
            raise InputMutated(f"INV-INPUT-001: {self.inner.name}.{op} wrote into its caller's tensor {changed}")
        return out

    def cast_overflow(self, fmt: str) -> str:
        return self._call("cast_overflow", fmt)

    def scale_policy(self, kind: str):
        return self._call("scale_policy", kind)

    def round_bf16(self, x: torch.Tensor) -> torch.Tensor:
        out = self._call("round_bf16", x)
        _expect_tensor(out, f"{self.name}.round_bf16", shape=tuple(x.shape), dtype=torch.bfloat16)
        return out

    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        out = self._call("cast", x, fmt)
        _expect_tensor(out, f"{self.name}.cast", shape=tuple(x.shape), dtype=torch.uint8)
        return out

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        out = self._call("quantize", x, granularity)
        op = f"{self.name}.quantize[{granularity.kind}]"
        if not isinstance(out, QuantizedTensor):
            raise EngineError(f"{op} returned {type(out).__name__}, expected QuantizedTensor")
        _expect_tensor(out.codes, f"{op} codes", shape=tuple(x.shape), dtype=torch.uint8)
        _expect_tensor(out.scale, f"{op} scale", shape=tuple(granularity.scale_shape(tuple(x.shape))),
                       dtype=torch.float32)
        if out.policy.zero_amax != "nan" and bool(torch.isfinite(x).all()) and not bool(torch.isfinite(out.scale).all()):
            bad = (~torch.isfinite(out.scale)).nonzero()[:3].tolist()
            raise EngineError(f"{op} produced non-finite scales for finite input (first at scale index {bad}); "
                              f"declared policy {out.policy.name!r} has a floor")
        return out

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        out = self._call("block_gemm", a, w, out_dtype)
        m, n = a.codes.shape[0], w.codes.shape[0]
        _expect_tensor(out, f"{self.name}.block_gemm", shape=(m, n), dtype=out_dtype)
        if not bool(torch.isfinite(out.float()).all()):
            inputs_finite = all(bool(torch.isfinite(t.dequantize()).all()) for t in (a, w))
            if inputs_finite:
                bad = (~torch.isfinite(out.float())).nonzero()[:3].tolist()
                raise EngineError(f"{self.name}.block_gemm returned non-finite values for finite inputs "
                                  f"(first at {bad})")
        return out


    # -- area kv ---------------------------------------------------------------------------------------------------
    def kv_policy(self, fmt: str, layout: str):
        from fp8rl.reference import kv as kvref

        out = self._call("kv_policy", fmt, layout)
        _expect_type(out, kvref.KVPolicy, f"{self.name}.kv_policy({fmt!r}, {layout!r})")
        return out

    def kv_store(self, x: torch.Tensor, scale: Any, *, fmt: str, layout: str):

        out = self._call("kv_store", x, scale, fmt=fmt, layout=layout)
        _expect_kv_cache(out, f"{self.name}.kv_store[{fmt}, {layout}]", tuple(x.shape))
        return out

    def kv_attention(self, q: torch.Tensor, k_cache: Any, v_cache: Any, **kwargs: Any) -> torch.Tensor:
        out = self._call("kv_attention", q, k_cache, v_cache, **kwargs)
        _expect_float_tensor(out, f"{self.name}.kv_attention", tuple(q.shape))
        return out

    def kv_calibrate(self, captures: Any, strategy: str, **kwargs: Any):
        from fp8rl.reference import kv as kvref

        out = self._call("kv_calibrate", captures, strategy, **kwargs)
        _expect_type(out, kvref.KVScales, f"{self.name}.kv_calibrate[{strategy}]")
        return out

    def kv_update_scales(self, layer: Any, scales: Any) -> str:
        out = self._call("kv_update_scales", layer, scales)
        if out not in ("pushed", "pending"):
            raise EngineError(f"{self.name}.kv_update_scales returned {out!r}, expected 'pushed' or 'pending'")
        return out

    def kv_forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any):
        from fp8rl.reference import kv as kvref

        out = self._call("kv_forward", layer, q, k, v, **kwargs)
        what = f"{self.name}.kv_forward"
        _expect_type(out, kvref.KVForward, what)
        _expect_float_tensor(out.out, f"{what} output", tuple(q.shape))
        _expect_kv_cache(out.k_cache, f"{what} K cache", tuple(k.shape))
        _expect_kv_cache(out.v_cache, f"{what} V cache", tuple(v.shape))
        _expect_type(out.scales, kvref.KVScales, f"{what} scales")
        return out

    # -- area correction -------------------------------------------------------------------------------------------
    def rollout_correction(self, train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                           config: Any):
        out = self._call("rollout_correction", train_logp, rollout_logp, mask, config)
        op = f"{self.name}.rollout_correction"
        shape = tuple(mask.shape)
        for attr in ("weights", "mask", "metrics"):
            if not hasattr(out, attr):
                raise EngineError(f"{op} returned {type(out).__name__} without {attr!r}; expected a CorrectionResult")
        if getattr(config, "rollout_is", None) is None:
            if out.weights is not None:
                raise EngineError(f"{op}: rollout_is=None but weights were returned")
        elif not isinstance(out.weights, torch.Tensor) or tuple(out.weights.shape) != shape:
            raise EngineError(f"{op}: weights must be a {shape} tensor, got "
                              f"{getattr(out.weights, 'shape', out.weights)!r}")
        _expect_tensor(out.mask, f"{op} mask", shape=shape, dtype=mask.dtype)
        if not isinstance(out.metrics, dict):
            raise EngineError(f"{op}: metrics must be a dict, got {type(out.metrics).__name__}")
        return out

    def correction_loss(self, logp: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self._call("correction_loss", logp, *args, **kwargs)
        _expect_float_tensor(out, f"{self.name}.correction_loss", ())
        return out

    # -- areas weight_sync and e2e ---------------------------------------------------------------------------------
    def _synced_dict(self, op: str, *args: Any) -> dict[str, torch.Tensor]:
        """A weight-sync op's output, validated: a dict of str → Tensor."""
        out = self._call(op, *args)
        if not isinstance(out, dict):
            raise EngineError(f"{self.name}.{op} returned {type(out).__name__}, expected a dict")
        bad = [k for k, v in out.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise EngineError(f"{self.name}.{op}: entries that are not str → Tensor: {bad[:3]}")
        return out

    def weight_sync(self, state_dict: Any) -> dict[str, torch.Tensor]:
        return self._synced_dict("weight_sync", state_dict)

    def mx_weight_sync(self, state_dict: Any, recipe: str) -> dict[str, torch.Tensor]:
        return self._synced_dict("mx_weight_sync", state_dict, recipe)

    def checkpoint_score(self, path: Any, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Validated: log-probs (B, T − prompt_len) float32, finite, ≤ ``rollout_logprob_slack``, on the CPU."""
        out = self._call("checkpoint_score", path, tokens, prompt_len)
        what = f"{self.name}.checkpoint_score"
        _expect_tensor(out, what, shape=(tokens.shape[0], tokens.shape[1] - prompt_len), dtype=torch.float32)
        out = out.cpu()
        bad = ~torch.isfinite(out) | (out > tolerances.get("rollout_logprob_slack").value)
        if bool(bad.any()):
            raise EngineError(f"{what}: log-probs must be finite and ≤ 0 (first bad at {bad.nonzero()[:3].tolist()})")
        return out

    def rollout_init(self, config: Any, state_dict: Any, recipe: str) -> Any:
        handle = self._call("rollout_init", config, state_dict, recipe)
        text = fixtures.text_config(config) if isinstance(config, dict) else None  # a VL wrapper's language model
        self._vocab[id(handle)] = int(text["vocab_size"]) if text is not None and "vocab_size" in text else None
        return handle

    def update_weights(self, handle: Any, state_dict: Any) -> Any:
        new = self._call("update_weights", handle, state_dict)
        self._vocab[id(new)] = self._vocab.get(id(handle))
        return new

    def rollout(self, handle: Any, prompts: torch.Tensor, max_new_tokens: int, **kwargs: Any):
        """Validated: (tokens (B, P+N) int64 starting with the prompts, ids inside the vocabulary; logprobs (B, N)
        float32, finite, ≤ ``rollout_logprob_slack``), returned as a tuple on the CPU."""
        out = self._call("rollout", handle, prompts, max_new_tokens, **kwargs)
        what = f"{self.name}.rollout"
        if not isinstance(out, tuple) or len(out) != 2:
            raise EngineError(f"{what}: expected a (tokens, logprobs) tuple, got {type(out).__name__}")
        tokens, logprobs = out
        b, p = prompts.shape
        _expect_tensor(tokens, f"{what} tokens", shape=(b, p + max_new_tokens), dtype=torch.int64)
        _expect_tensor(logprobs, f"{what} logprobs", shape=(b, max_new_tokens), dtype=torch.float32)
        tokens, logprobs = tokens.cpu(), logprobs.cpu()
        if not torch.equal(tokens[:, :p], prompts.cpu()):
            raise EngineError(f"{what}: tokens do not start with the prompts")
        vocab = self._vocab.get(id(handle))
        if vocab is not None and bool(((tokens < 0) | (tokens >= vocab)).any()):
            raise EngineError(f"{what}: token ids outside [0, {vocab})")
        slack = tolerances.get("rollout_logprob_slack").value
        bad = ~torch.isfinite(logprobs) | (logprobs > slack)
        if bool(bad.any()):
            raise EngineError(f"{what}: log-probs must be finite and ≤ 0 (first bad at {bad.nonzero()[:3].tolist()})")
        return tokens, logprobs


def _expect_type(obj: Any, cls: type, what: str) -> None:
    if not isinstance(obj, cls):
        raise EngineError(f"{what}: returned {type(obj).__name__}, expected {cls.__name__}")


def _expect_kv_cache(obj: Any, what: str, shape: tuple[int, ...]) -> None:
    from fp8rl.reference import kv as kvref

    _expect_type(obj, kvref.KVCache, what)
    _expect_tensor(obj.codes, f"{what} codes", shape=shape, dtype=torch.uint8)
    if not isinstance(obj.scale, torch.Tensor):
        raise EngineError(f"{what}: scale is {type(obj.scale).__name__}, expected a torch.Tensor")


def _expect_float_tensor(t: Any, what: str, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise EngineError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    _expect_device(t, what)
    if tuple(t.shape) != shape:
        raise EngineError(f"{what}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise EngineError(f"{what}: expected a floating-point tensor, got {t.dtype}")


#: devices whose tensors hold data the checks can read (a "meta" tensor, say, has none)
DATA_DEVICES = ("cpu", "cuda")


def _expect_device(t: torch.Tensor, what: str) -> None:
    if t.device.type not in DATA_DEVICES:
        raise EngineError(f"{what}: expected a tensor on {' or '.join(DATA_DEVICES)}, got one on {t.device}")


def _expect_tensor(t: Any, what: str, *, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise EngineError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    _expect_device(t, what)
    if tuple(t.shape) != tuple(shape):
        raise EngineError(f"{what}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise EngineError(f"{what}: expected dtype {dtype}, got {t.dtype}")


# ----------------------------------------------------------------------------------------------------------------
# comparisons with reproductions


def _fmt_index(idx: tuple[int, ...]) -> str:
    return "(" + ",".join(str(i) for i in idx) + ")"


def _offenders(mask: np.ndarray, limit: int = 5) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in ix) for ix in np.argwhere(mask)[:limit]]


def assert_codes_equal(got: torch.Tensor, expected: torch.Tensor, fmt: str, *, context: str,
                       inputs: torch.Tensor | None = None) -> None:
    """Bit-exact comparison of FP8 code tensors; records the ULP histogram; fails with a reproduction."""
    g = got.cpu().numpy().astype(np.uint8)
    e = expected.cpu().numpy().astype(np.uint8)
    if g.shape != e.shape:
        raise AssertionError(f"{context}: code shape {g.shape} != expected {e.shape}")
    d = ulp_distance(g, e, fmt)
    diff = g != e
    # NaN codes with different payload/sign compare as different codes on purpose: the format fixes the code.
    n = int(diff.sum())
    # identical codes (NaN codes included) agree: bucket "0"; "nan" counts disagreements involving a NaN code
    same = g == e
    hist = {"0": int(same.sum()), "1": int((~same & (d == 1)).sum()), ">=2": int((~same & (d >= 2)).sum()),
            "nan": int((~same & (d < 0)).sum())}
    record_metrics(ulp_hist=hist, mismatch_frac=n / max(g.size, 1), max_ulp=float(d.max()) if d.size else 0.0)
    if n:
        lines = [f"{context}: {n}/{g.size} codes differ ({fmt}); shape {g.shape}; first offending:"]
        gv, ev = decode_codes(g, fmt), decode_codes(e, fmt)
        xs = inputs.detach().cpu().float().numpy() if inputs is not None else None
        for ix in _offenders(diff):
            x_txt = f" x={xs[ix]!r}" if xs is not None else ""
            lines.append(f"  at {_fmt_index(ix)}:{x_txt} expected 0x{e[ix]:02x} ({ev[ix]!r}) got 0x{g[ix]:02x} "
                         f"({gv[ix]!r}), {d[ix]} ulp")
        raise AssertionError("\n".join(lines))


def assert_tensors_equal(got: torch.Tensor, expected: torch.Tensor, *, context: str) -> None:
    """Bit-exact comparison of float tensors (NaN == NaN); fails with a reproduction."""
    g = got.detach().cpu().double().numpy()
    e = expected.detach().cpu().double().numpy()
    if g.shape != e.shape:
        raise AssertionError(f"{context}: shape {g.shape} != expected {e.shape}")
    same = (g == e) | (np.isnan(g) & np.isnan(e))
    bad = ~same
    record_metrics(mismatch_frac=float(bad.mean()) if bad.size else 0.0)
    if bad.any():
        lines = [f"{context}: {int(bad.sum())}/{g.size} values differ; shape {g.shape}; first offending:"]
        for ix in _offenders(bad):
            lines.append(f"  at {_fmt_index(ix)}: expected {e[ix]!r} got {g[ix]!r}")
        raise AssertionError("\n".join(lines))


def assert_within_bound(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, *,
                        context: str) -> None:
    """|got − expected| ≤ bound elementwise (fp64); records max error and max error/bound; fails with a repro.

    NaN agrees only with NaN: where ``expected`` is NaN the engine must give NaN (and vice versa), whatever the
    bound is there (a bound computed from NaN operands is NaN, and ``err > NaN`` would let anything pass)."""
    g = got.detach().cpu().double()
    e = expected.detach().cpu().double()
    b = torch.as_tensor(bound, dtype=torch.float64).expand_as(e) if not isinstance(bound, torch.Tensor) else \
        bound.detach().cpu().double().expand_as(e)
    if g.shape != e.shape:
        raise AssertionError(f"{context}: shape {tuple(g.shape)} != expected {tuple(e.shape)}")
    err = (g - e).abs()
    both_nan = torch.isnan(g) & torch.isnan(e)
    err = torch.where(both_nan, torch.zeros_like(err), err)
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    b = torch.where(both_nan, torch.zeros_like(b), b)
    b = torch.where(torch.isnan(b), torch.zeros_like(b), b)  # NaN vs a number never passes on a NaN bound
    ratio = torch.where(b > 0, err / b, torch.where(err > 0, torch.full_like(err, math.inf), torch.zeros_like(err)))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    record_metrics(max_abs_err=float(err.max()) if err.numel() else 0.0, err_over_bound=worst)
    bad = (err > b).numpy()
    if bad.any():
        en, gn, bn, errn = e.numpy(), g.numpy(), b.numpy(), err.numpy()
        lines = [f"{context}: {int(bad.sum())}/{bad.size} elements exceed the bound (worst error/bound {worst:.3g}); "
                 f"shape {tuple(e.shape)}; first offending:"]
        for ix in _offenders(bad):
            lines.append(f"  at {_fmt_index(ix)}: expected {en[ix]!r} got {gn[ix]!r} |err| {errn[ix]:.3e} > "
                         f"bound {bn[ix]:.3e}")
        raise AssertionError("\n".join(lines))
