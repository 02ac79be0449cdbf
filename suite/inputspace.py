"""The input space of every engine op: what the protocol lets a caller pass, as classes the suite must exercise.

One declarative model per op (:data:`MODEL`): axes (dtype, layout, rank, size per dimension, special values per
operand, optional arguments, ...) and their classes. Two things follow from it:

* **Coverage, measured.** :class:`fp8rl.checks.GuardedEngine` hands every op call to :func:`classify`, which names
  the classes the call exercises; the plugin sums them per check, and every report carries an op × class coverage
  table (section ``coverage``). ``tests/checks/test_coverage.py`` fails if a class the model lists is never
  exercised by the reference engine at ``--profile ci``.
* **Inputs, derived.** :func:`make_input` builds a tensor of a requested class (a layout, a dtype, a special value
  placed in it) from plain data, so checks ask the model for inputs instead of inventing them one by one (the
  ``*-SPACE-*`` checks walk every class of an op).

An engine that cannot take a class declares it, with the reason, in ``input_limits(op)`` (a map class → reason, as
capabilities are): the checks of that class are skipped with the reason, never passed.

Class names are ``<axis>=<value>`` (``layout=transposed``, ``special.x=nan``, ``arg.causal=false``); a report row is
the op and the class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from fp8rl.reference.quant import GRANULARITY_KINDS

#: sizes around the usual kernel tiles, per dimension
TILES = (64, 128, 256)


@dataclass(frozen=True)
class Axis:
    """One way a call can vary: its name and its classes (each one the suite must exercise at least once)."""

    name: str
    classes: tuple[str, ...]
    description: str = ""

    def keys(self) -> list[str]:
        return [f"{self.name}={c}" for c in self.classes]


@dataclass(frozen=True)
class OpModel:
    op: str
    area: str
    axes: tuple[Axis, ...]
    classify: Callable[[tuple, dict], set[str]]
    description: str = ""

    def classes(self) -> list[str]:
        return [k for a in self.axes for k in a.keys()]


# ----------------------------------------------------------------------------------------------------------------
# classifiers of tensors


def dtype_class(t: torch.Tensor) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(t.dtype, str(t.dtype))


def layout_class(t: torch.Tensor) -> str:
    """contiguous; transposed (the last two dims swapped in memory); sliced (rows contiguous, a row stride wider
    than the row: a view of a wider tensor); strided (the last dim not unit-stride)."""
    if t.is_contiguous():
        return "contiguous"
    if t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) >= t.shape[-2]:
        return "transposed"
    if t.stride(-1) == 1:
        return "sliced"
    return "strided"


def rank_class(t: torch.Tensor) -> str:
    return "1d" if t.dim() <= 1 else "2d" if t.dim() == 2 else "3d+"


def size_class(n: int) -> str:
    """Below a tile (< 64), a tile exactly (64, 128, 256), above (> 256; multiple of 128 or not), or between tiles
    and not a multiple of 64."""
    if n in TILES:
        return f"eq{n}"
    if n < TILES[0]:
        return "lt64"
    if n > TILES[-1]:
        return "gt256" if n % 128 == 0 else "gt256-ragged"
    return "ragged"


SIZE_CLASSES = ("lt64", "eq64", "eq128", "eq256", "ragged", "gt256", "gt256-ragged")
SPECIALS = ("nan", "posinf", "neginf", "negzero", "subnormal", "fp32max")


def special_classes(t: torch.Tensor) -> set[str]:
    """Special values present in a float tensor: nan, ±inf, -0, fp32 subnormals, |x| = FLT_MAX."""
    x = t.detach().float()
    out = set()
    if bool(torch.isnan(x).any()):
        out.add("nan")
    if bool((x == float("inf")).any()):
        out.add("posinf")
    if bool((x == float("-inf")).any()):
        out.add("neginf")
    if bool(((x == 0) & torch.signbit(x)).any()):
        out.add("negzero")
    tiny = torch.finfo(torch.float32).tiny
    if bool(((x != 0) & (x.abs() < tiny)).any()):
        out.add("subnormal")
    if bool((x.abs() == torch.finfo(torch.float32).max).any()):
        out.add("fp32max")
    return out


def code_specials(codes: torch.Tensor, fmt: str) -> set[str]:
    """NaN / inf FP8 codes inside a quantized operand."""
    from fp8rl.reference.formats import decode_codes

    v = torch.from_numpy(decode_codes(codes.detach().cpu().numpy(), fmt))
    out = set()
    if bool(torch.isnan(v).any()):
        out.add("nan-code")
    if bool(torch.isinf(v).any()):
        out.add("inf-code")
    return out


def _tensor_axes(prefix: str, t: torch.Tensor, *, sizes: bool = True) -> set[str]:
    out = {f"dtype.{prefix}={dtype_class(t)}", f"layout.{prefix}={layout_class(t)}", f"rank.{prefix}={rank_class(t)}"}
    if sizes and t.dim() >= 1:
        out.add(f"size.{prefix}.last={size_class(int(t.shape[-1]))}")
        if t.dim() >= 2:
            out.add(f"size.{prefix}.rows={size_class(int(t.shape[:-1].numel()))}")
    out |= {f"special.{prefix}={s}" for s in special_classes(t)}
    return out


def _axes(prefix: str, *, dtypes=("fp32", "bf16", "fp16"), layouts=("contiguous", "transposed", "sliced",
          "strided"), ranks=("1d", "2d", "3d+"), sizes: bool = True, specials=SPECIALS) -> tuple[Axis, ...]:
    axes = [Axis(f"dtype.{prefix}", tuple(dtypes)), Axis(f"layout.{prefix}", tuple(layouts)),
            Axis(f"rank.{prefix}", tuple(ranks))]
    if sizes:
        axes += [Axis(f"size.{prefix}.last", SIZE_CLASSES), Axis(f"size.{prefix}.rows", SIZE_CLASSES)]
    if specials:
        axes.append(Axis(f"special.{prefix}", tuple(specials)))
    return tuple(axes)


# ----------------------------------------------------------------------------------------------------------------
# the per-op models


def _classify_cast(args: tuple, kwargs: dict) -> set[str]:
    x, fmt = args[0], (args[1] if len(args) > 1 else kwargs.get("fmt"))
    return _tensor_axes("x", x) | {f"arg.fmt={fmt}"}


def _classify_round_bf16(args: tuple, kwargs: dict) -> set[str]:
    return _tensor_axes("x", args[0]) - {f"dtype.x={dtype_class(args[0])}"} | {"dtype.x=fp32"}


def _classify_quantize(args: tuple, kwargs: dict) -> set[str]:
    x, g = args[0], (args[1] if len(args) > 1 else kwargs["granularity"])
    out = _tensor_axes("x", x) | {f"arg.kind={g.kind}"}
    if g.kind == "group":
        out.add(f"arg.group_size={'128' if g.size[1] == 128 else 'other'}")
    if g.kind == "block":
        out.add(f"arg.block_size={'128x128' if g.size == (128, 128) else 'other'}")
    return out


def _classify_gemm(args: tuple, kwargs: dict) -> set[str]:
    a, w = args[0], args[1]
    out_dtype = args[2] if len(args) > 2 else kwargs.get("out_dtype")
    m, k = int(a.codes.shape[0]), int(a.codes.shape[-1])
    n = int(w.codes.shape[0])
    out = {f"size.m={size_class(m)}", f"size.n={size_class(n)}", f"size.k={size_class(k)}",
           f"arg.out_dtype={dtype_class(torch.empty(0, dtype=out_dtype))}",
           f"arg.a_kind={a.granularity.kind}", f"arg.w_kind={w.granularity.kind}"}
    out |= {f"special.a={s}" for s in code_specials(a.codes, a.fmt)}
    out |= {f"special.w={s}" for s in code_specials(w.codes, w.fmt)}
    if bool((a.codes == 0).all()) or bool((w.codes == 0).all()):
        out.add("special.operand=all-zero")
    return out


def _classify_kv_store(args: tuple, kwargs: dict) -> set[str]:
    x = args[0]
    return _tensor_axes("x", x, sizes=False) | {f"arg.fmt={kwargs.get('fmt')}", f"arg.layout={kwargs.get('layout')}",
                                                f"size.x.head_dim={size_class(int(x.shape[-1]))}"}


def _classify_kv_attention(args: tuple, kwargs: dict) -> set[str]:
    q, kc = args[0], args[1]
    out = _tensor_axes("q", q, sizes=False)
    out |= {f"arg.fmt={kc.fmt}", f"arg.layout={kc.layout}",
            f"arg.causal={'true' if kwargs.get('causal', True) else 'false'}",
            f"arg.sm_scale={'default' if kwargs.get('sm_scale') is None else 'given'}",
            f"arg.q_scale={'none' if kwargs.get('q_scale') is None else 'given'}",
            f"arg.lengths={'none' if kwargs.get('kv_lengths') is None else 'ragged'}",
            f"arg.gqa={'mha' if q.shape[2] == kc.codes.shape[-2] else 'gqa'}"}
    out |= {f"special.cache={s}" for s in code_specials(kc.codes, kc.fmt)}
    return out


def _classify_correction(args: tuple, kwargs: dict) -> set[str]:
    train, rollout, mask = args[0], args[1], args[2]
    cfg = args[3] if len(args) > 3 else kwargs.get("config")
    out = {f"dtype.logp={dtype_class(train)}", f"layout.logp={layout_class(train)}"}
    masked = mask == 0
    for name, t in (("train", train), ("rollout", rollout)):
        if bool(masked.any()):
            vals = t.detach().float()[masked]
            if bool(torch.isnan(vals).any()):
                out.add(f"special.masked.{name}=nan")
            if bool((vals == float("-inf")).any()):
                out.add(f"special.masked.{name}=neginf")
    out.add(f"arg.rollout_is={getattr(cfg, 'rollout_is', None) or 'none'}")
    out.add(f"arg.rollout_rs={'none' if getattr(cfg, 'rollout_rs', None) is None else 'set'}")
    out.add(f"special.mask={'empty-row' if bool((mask.sum(-1) == 0).any()) else 'no-empty-row'}")
    return out


def _classify_rollout(args: tuple, kwargs: dict) -> set[str]:
    return {f"arg.greedy={'true' if kwargs.get('greedy', True) else 'false'}"}


MODEL: dict[str, OpModel] = {m.op: m for m in (
    OpModel("cast", "formats", (*_axes("x"), Axis("arg.fmt", ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"))),
            _classify_cast, "cast(x, fmt): any float tensor, any shape and layout → uint8 codes of x's shape"),
    OpModel("round_bf16", "formats", (*_axes("x", dtypes=("fp32",), sizes=False),), _classify_round_bf16,
            "round_bf16(x): fp32 → bf16, any shape and layout"),
    OpModel("quantize", "quantization",
            (*_axes("x"), Axis("arg.kind", GRANULARITY_KINDS),
             Axis("arg.group_size", ("128", "other")), Axis("arg.block_size", ("128x128", "other"))),
            _classify_quantize, "quantize(x, granularity): fp32/bf16/fp16 x (2-D; token, group and tensor also "
                                "N-D), any layout, any group/block size"),
    OpModel("block_gemm", "gemm",
            (Axis("size.m", SIZE_CLASSES), Axis("size.n", SIZE_CLASSES), Axis("size.k", SIZE_CLASSES),
             Axis("arg.out_dtype", ("fp32", "bf16")), Axis("arg.a_kind", ("group", "tensor", "token")),
             Axis("arg.w_kind", ("block", "tensor", "channel")),
             Axis("special.a", ("nan-code",)), Axis("special.w", ("nan-code",)),
             Axis("special.operand", ("all-zero",))),
            _classify_gemm, "block_gemm(a, w, out_dtype): any M, N, K (tiles, ragged), NaN codes in an operand"),
    OpModel("kv_store", "kv",
            (*_axes("x", sizes=False, ranks=("3d+",)), Axis("arg.fmt", ("e4m3fn", "e5m2")),
             Axis("arg.layout", ("tensor", "head", "token_head")), Axis("size.x.head_dim", ("lt64", "eq64", "eq128"))),
            _classify_kv_store, "kv_store(x, scale, fmt, layout): K/V [..., T, H, D] in fp32/bf16/fp16, any layout"),
    OpModel("kv_attention", "kv",
            (*_axes("q", sizes=False, ranks=("3d+",), specials=()), Axis("arg.fmt", ("e4m3fn", "e5m2")),
             Axis("arg.layout", ("tensor", "head", "token_head")), Axis("arg.causal", ("true", "false")),
             Axis("arg.sm_scale", ("default", "given")), Axis("arg.q_scale", ("none", "given")),
             Axis("arg.lengths", ("none", "ragged")), Axis("arg.gqa", ("mha", "gqa")),
             Axis("special.cache", ("nan-code",))),
            _classify_kv_attention, "kv_attention(q, caches, ...): every optional argument, GQA, NaN codes in the "
                                    "cache past kv_len"),
    OpModel("rollout_correction", "correction",
            (Axis("dtype.logp", ("fp32", "bf16")), Axis("layout.logp", ("contiguous", "transposed", "sliced")),
             Axis("special.masked.train", ("nan", "neginf")), Axis("special.masked.rollout", ("nan", "neginf")),
             Axis("arg.rollout_is", ("none", "token", "sequence", "geometric")), Axis("arg.rollout_rs", ("none",
                                                                                                         "set")),
             Axis("special.mask", ("empty-row", "no-empty-row"))),
            _classify_correction, "rollout_correction(train_logp, rollout_logp, mask, config): fp32/bf16 log-probs, "
                                  "any layout, NaN/-inf where the mask is 0, empty rows"),
    OpModel("rollout", "e2e",
            (Axis("arg.greedy", ("true", "false")),),
            _classify_rollout, "rollout(handle, prompts, max_new_tokens, greedy, seed)"),
)}


def classify(op: str, args: tuple, kwargs: dict) -> set[str]:
    """The classes of :data:`MODEL` an op call exercises (empty for ops the model does not describe; a classifier
    that fails on a malformed call records nothing: the call's own validation reports it)."""
    model = MODEL.get(op)
    if model is None:
        return set()
    try:
        found = model.classify(args, kwargs)
    except Exception:  # noqa: BLE001 - coverage must never break a check
        return set()
    return found & set(model.classes())


def all_classes(ops: Iterable[str] | None = None) -> dict[str, list[str]]:
    """op → every class its model lists."""
    return {op: MODEL[op].classes() for op in (ops or MODEL)}


# ----------------------------------------------------------------------------------------------------------------
# inputs of a class


def with_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``x`` (2-D or more), laid out in memory as ``layout`` (contiguous / transposed / sliced /
    strided): the result equals ``x`` elementwise; only its strides differ."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":  # a view of a wider tensor: rows contiguous, row stride > row length
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 7, dtype=x.dtype)
        wide[..., 3:3 + x.shape[-1]] = x
        return wide[..., 3:3 + x.shape[-1]]
    if layout == "strided":  # every other element of a twice-as-wide tensor
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    raise ValueError(f"layout: expected one of contiguous, transposed, sliced, strided, got {layout!r}")


SPECIAL_VALUES = {"nan": float("nan"), "posinf": float("inf"), "neginf": float("-inf"), "negzero": -0.0,
                  "subnormal": 1e-40, "fp32max": float(torch.finfo(torch.float32).max)}


def with_specials(x: torch.Tensor, specials: Iterable[str], rng: Any) -> torch.Tensor:
    """``x`` with each special value of ``specials`` written at a few random positions (fp32)."""
    y = x.detach().float().clone().reshape(-1)
    for s in specials:
        idx = torch.from_numpy(rng.choice(y.numel(), size=min(3, y.numel()), replace=False))
        y[idx] = SPECIAL_VALUES[s] * (1 if s in ("nan", "negzero") else float(rng.choice([-1.0, 1.0])) if s in (
            "subnormal", "fp32max") else 1)
    return y.reshape(x.shape)


__all__ = ["MODEL", "SIZE_CLASSES", "SPECIALS", "SPECIAL_VALUES", "Axis", "OpModel", "all_classes", "classify",
           "code_specials", "dtype_class", "layout_class", "rank_class", "size_class", "special_classes",
           "with_layout", "with_specials"]
