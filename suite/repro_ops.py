"""Per-op comparison, explanation and shrinking for ``fp8rl repro`` (and the ``repro.py`` scripts it writes).

For each supported op, an ``explain_<op>`` function takes the op's inputs, the engine's declared numerics, the
engine's result and fp8rl's oracle result, and returns an :class:`Explanation`: how many elements disagree and, for
the first ones, every intermediate value (quantize: the group's amax, the scale as amax/T and the engine's, x/s in
fp32 and rounded to 16-bit dtypes, the expected and actual code and its decoded value). A :class:`Handler` per op
ties it together for the repro command: run the engine and the oracle on captured arguments, and propose smaller
inputs (the failing row, block, head or token, then the fewest elements the op allows) that may still disagree.

Judgement is the check's: codes and masks bit-exact, IS weights within ``corr_weight``, metrics within
``corr_metric`` (fp8rl.tolerances). Nothing here changes what a check decides; it only explains one op call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: elements explained by default
DEFAULT_LIMIT = 5


@dataclass
class Explanation:
    """What one op call shows: ``n_bad`` disagreeing elements (codes, scales, weights, mask entries, metrics) out
    of ``total``; ``first``: the index of the first disagreeing element of the op's main input (None if only a
    per-group or per-batch value disagrees); ``lines``: the printout."""

    op: str
    n_bad: int
    total: int
    first: tuple[int, ...] | None
    lines: list[str] = field(default_factory=list)
    #: an op-specific anchor for shrinking (quantize: the scale-group index of the first disagreement)
    anchor: Any = None

    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Candidate:
    """A smaller input for the same op: its arguments and which slice of the original it is."""

    args: tuple
    kwargs: dict
    description: str


def _f(v: float) -> str:
    """A float as repr, plus its fp32 hex bits when finite and nonzero (the bits are what a kernel sees)."""
    v = float(v)
    if math.isnan(v) or math.isinf(v) or v == 0.0:
        return repr(v)
    bits = int(np.array(v, dtype=np.float32).view(np.uint32))
    return f"{v!r} (fp32 0x{bits:08x})"


def _r16(v: float) -> str:
    """``v`` (an fp32 value) rounded to nearest even in bf16 and in fp16."""
    t = torch.tensor(float(v), dtype=torch.float32)
    return f"bf16 {float(t.to(torch.bfloat16))!r}, fp16 {float(t.to(torch.float16))!r}"


def _code(code: int, fmt: str) -> str:
    from fp8rl.reference.formats import decode_codes

    val = float(decode_codes(np.array([code], dtype=np.uint8), fmt)[0])
    return f"0x{int(code):02x} ({val!r})"


def _ix(ix: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in ix) + ")"


def _first_indices(mask: torch.Tensor, limit: int) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in row) for row in mask.nonzero()[:limit].tolist()]


def _same_codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.to(torch.uint8) == b.to(torch.uint8)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.detach().double(), b.detach().double()
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


# ----------------------------------------------------------------------------------------------------------------
# quantize


def group_index(g: Any, ix: tuple[int, ...]) -> tuple[int, ...]:
    """The scale index of element ``ix`` under granularity ``g`` (fp8rl.reference.quant.Granularity)."""
    if g.kind == "tensor":
        return (0,)
    if g.kind in ("token", "channel"):
        return (*ix[:-1], 0)
    if g.kind == "group":
        return (*ix[:-1], ix[-1] // g.size[1])
    return (ix[0] // g.size[0], ix[1] // g.size[1])


def group_slices(g: Any, gi: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The slices of the input that scale group ``gi`` covers."""
    if g.kind == "tensor":
        return tuple(slice(0, n) for n in shape)
    if g.kind in ("token", "channel"):
        return (*(slice(i, i + 1) for i in gi[:-1]), slice(0, shape[-1]))
    if g.kind == "group":
        G = g.size[1]
        return (*(slice(i, i + 1) for i in gi[:-1]), slice(gi[-1] * G, min((gi[-1] + 1) * G, shape[-1])))
    bm, bn = g.size
    return (slice(gi[0] * bm, min((gi[0] + 1) * bm, shape[0])), slice(gi[1] * bn, min((gi[1] + 1) * bn, shape[1])))


def _amax_index(x: torch.Tensor, sl: tuple[slice, ...]) -> tuple[int, ...]:
    """The index (in x) of the group's amax element (a NaN first, as a NaN amax comes from it)."""
    part = x[sl].detach().float().abs()
    flat = part.reshape(-1)
    nan = torch.isnan(flat).nonzero()
    k = int(nan[0, 0]) if nan.numel() else int(torch.argmax(torch.nan_to_num(flat, posinf=math.inf)))
    local = np.unravel_index(k, tuple(part.shape))
    return tuple(int(s.start) + int(i) for s, i in zip(sl, local, strict=True))


def _policy_line(policy: Any) -> str:
    return (f"declared policy {policy.name!r}: fmt {policy.fmt}, T {policy.max_value!r}, floor {policy.floor} eps "
            f"{policy.eps!r}, pow2 {policy.pow2}, scale_op {policy.scale_op}, quant_op {policy.quant_op}, clamp "
            f"{policy.clamp}, zero_amax {policy.zero_amax}, compute_dtype {policy.compute_dtype}")


def explain_quantize(x: torch.Tensor, granularity: Any, policy: Any, got: Any, expected: Any, *,
                     limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's quantize(x, granularity) with the oracle's under the declared ``policy``."""
    g = granularity
    shape = tuple(x.shape)
    fmt = policy.fmt
    T = float(policy.max_value)
    lines = [f"quantize[{g.label}] of x {shape} {str(x.dtype).removeprefix('torch.')}; {_policy_line(policy)}"]
    gs, es = got.scale.detach().cpu().float(), expected.scale.detach().cpu().float()
    bad_scale = ~_same_floats(gs, es) if gs.shape == es.shape else torch.ones(es.shape, dtype=torch.bool)
    gc, ec = got.codes.detach().cpu(), expected.codes.detach().cpu()
    bad_code = ~_same_codes(gc, ec) if gc.shape == ec.shape else torch.ones(ec.shape, dtype=torch.bool)
    n_scale, n_code = int(bad_scale.sum()), int(bad_code.sum())
    lines.append(f"scales: {n_scale} of {es.numel()} differ; codes: {n_code} of {ec.numel()} differ")
    if gs.shape != es.shape or gc.shape != ec.shape:
        lines.append(f"shapes differ: engine scale {tuple(gs.shape)} codes {tuple(gc.shape)}, oracle scale "
                     f"{tuple(es.shape)} codes {tuple(ec.shape)}")
        return Explanation("quantize", max(n_scale + n_code, 1), es.numel() + ec.numel(), None, lines)
    xf = x.detach().cpu().float()
    first = _first_indices(bad_code, 1)
    scale_first = _first_indices(bad_scale, 1)
    anchor = group_index(g, first[0]) if first else (scale_first[0] if scale_first else None)
    shown_groups: list[tuple[int, ...]] = []

    def group_lines(gi: tuple[int, ...]) -> list[str]:
        sl = group_slices(g, gi, shape)
        ai = _amax_index(xf, sl)
        amax = float(xf[sl].abs().max())
        plain = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(T, dtype=torch.float32))
        mark = "" if bool(_same_floats(gs[gi], es[gi])) else "   <-- differs"
        return [f"scale group {_ix(gi)} = x{_ix(tuple(s.start for s in sl))}..{_ix(tuple(s.stop - 1 for s in sl))}: "
                f"amax {_f(amax)} at {_ix(ai)}",
                f"  amax/{T:g} in fp32 = {_f(plain)}  (rounded: {_r16(plain)})",
                f"  scale: oracle {_f(float(es[gi]))}, engine {_f(float(gs[gi]))}{mark}"]

    for gi in _first_indices(bad_scale, limit):
        shown_groups.append(gi)
        lines += group_lines(gi)
    dec = {}
    for ix in _first_indices(bad_code, limit):
        gi = group_index(g, ix)
        if gi not in shown_groups:
            shown_groups.append(gi)
            lines += group_lines(gi)
        xv = float(xf[ix])
        so, se = float(es[gi]), float(gs[gi])
        q_o = float(torch.tensor(xv, dtype=torch.float32) / torch.tensor(so, dtype=torch.float32))
        q_e = float(torch.tensor(xv, dtype=torch.float32) / torch.tensor(se, dtype=torch.float32))
        lines.append(f"element {_ix(ix)} (scale group {_ix(gi)}): x = {_f(xv)} ({str(x.dtype).removeprefix('torch.')})")
        lines.append(f"  x/s with the oracle's scale: fp32 {_f(q_o)}; rounded: {_r16(q_o)}")
        if se != so or (math.isnan(se) != math.isnan(so)):
            lines.append(f"  x/s with the engine's scale: fp32 {_f(q_e)}; rounded: {_r16(q_e)}")
        if policy.quant_op == "mul_recip":
            r = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(so, dtype=torch.float32))
            lines.append(f"  x*(1/s) (declared quant_op mul_recip): 1/s = {_f(r)}, product fp32 "
                         f"{_f(float(torch.tensor(xv, dtype=torch.float32) * torch.tensor(r, dtype=torch.float32)))}")
        from fp8rl.reference.formats import decode_codes

        ecode, gcode = int(ec[ix]), int(gc[ix])
        dec[ix] = (float(decode_codes(np.array([ecode], dtype=np.uint8), fmt)[0]),
                   float(decode_codes(np.array([gcode], dtype=np.uint8), fmt)[0]))
        lines.append(f"  expected code {_code(ecode, fmt)} x scale = {dec[ix][0] * so!r}; "
                     f"engine code {_code(gcode, fmt)} x engine scale = {dec[ix][1] * se!r}")
    if n_scale + n_code:
        try:
            from fp8rl.diagnose import diagnose_quantize

            lines.append(diagnose_quantize(x, g, got.codes, got.scale, policy))
        except Exception as exc:  # noqa: BLE001 - the diagnosis is an extra; its failure never hides the numbers
            lines.append(f"diagnosis: unavailable ({type(exc).__name__}: {exc})")
    return Explanation("quantize", n_scale + n_code, es.numel() + ec.numel(), first[0] if first else None, lines,
                       anchor)


class QuantizeHandler:
    op = "quantize"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        from fp8rl.reference.quant import quantize

        x, g = args[0], args[1]
        got = engine.quantize(x, g) if got is None else got
        policy = engine.scale_policy(g.kind)
        return explain_quantize(x, g, policy, got, quantize(x, g, policy), limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        import dataclasses

        return {"scale_policy": dataclasses.asdict(engine.scale_policy(args[1].kind))}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        x, g = args[0], args[1]
        shape = tuple(x.shape)
        if ex.anchor is None or x.dim() < 1:
            return []
        gi = tuple(ex.anchor)
        sl = group_slices(g, gi, shape)
        ai = _amax_index(x, sl)
        dtype = str(x.dtype).removeprefix("torch.")
        out = []
        pick = [ai] if ex.first is None or tuple(ex.first) == ai else [tuple(ex.first), ai]
        vals = torch.stack([x.detach()[ix] for ix in pick]).reshape(1, len(pick)).contiguous()
        what = ("the first differing element x" + _ix(pick[0]) + " and the amax element x" + _ix(ai)
                if len(pick) == 2 else "the amax element x" + _ix(ai))
        out.append(Candidate((vals, g), {}, f"{what} of scale group {_ix(gi)} of the original {shape} {dtype} x, "
                                            f"as a {tuple(vals.shape)} tensor (same amax, so the same scale)"))
        if g.kind != "tensor":
            part = x.detach()[sl].contiguous()
            lo, hi = tuple(s.start for s in sl), tuple(s.stop for s in sl)
            out.append(Candidate((part, g), {}, f"x[{', '.join(f'{a}:{b}' for a, b in zip(lo, hi, strict=True))}] of "
                                                f"the original {shape} {dtype} x: scale group {_ix(gi)}, the first "
                                                f"that differs"))
        return out


# ----------------------------------------------------------------------------------------------------------------
# cast (formats)


def explain_cast(x: torch.Tensor, fmt: str, overflow: str, got: torch.Tensor, expected: torch.Tensor, *,
                 limit: int = DEFAULT_LIMIT) -> Explanation:
    bad = ~_same_codes(got.cpu(), expected.cpu())
    n = int(bad.sum())
    lines = [f"cast of x {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')} to {fmt} (declared overflow "
             f"{overflow}): {n} of {expected.numel()} codes differ"]
    xf = x.detach().cpu().float()
    first = _first_indices(bad, limit)
    for ix in first:
        lines.append(f"element {_ix(ix)}: x = {_f(float(xf[ix]))}; expected {_code(int(expected[ix]), fmt)}, engine "
                     f"{_code(int(got[ix]), fmt)}")
    return Explanation("cast", n, expected.numel(), first[0] if first else None, lines)


class CastHandler:
    op = "cast"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        from fp8rl.reference.formats import encode

        x, fmt = args[0], args[1]
        got = engine.cast(x, fmt) if got is None else got
        overflow = engine.cast_overflow(fmt)
        return explain_cast(x, fmt, overflow, got, encode(x, fmt, overflow).reshape(x.shape), limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        return {"cast_overflow": engine.cast_overflow(args[1])}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        x, fmt = args[0], args[1]
        if ex.first is None:
            return []
        one = x.detach()[ex.first].reshape(1).contiguous()
        return [Candidate((one, fmt), {}, f"element x{_ix(ex.first)} of the original {tuple(x.shape)} x, as a (1,) "
                                          "tensor")]


# ----------------------------------------------------------------------------------------------------------------
# kv_store


def explain_kv_store(x: torch.Tensor, scale: Any, policy: Any, got: Any, expected: Any, *,
                     limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's kv_store(x, scale) with the oracle's quantize_kv under the declared KVPolicy."""
    from fp8rl.reference import kv as kvref

    fmt = policy.fmt
    shape = tuple(x.shape)
    lines = [f"kv_store of x {shape} ([..., T, H, D]) {str(x.dtype).removeprefix('torch.')}, layout {policy.layout}; "
             f"declared KV policy: fmt {fmt}, quant_op {policy.quant_op}, clamp {policy.clamp}, overflow "
             f"{policy.overflow}, token_head_floor {policy.token_head_floor!r}"]
    gs, es = got.scale.detach().cpu().float(), expected.scale.detach().cpu().float()
    gc, ec = got.codes.detach().cpu(), expected.codes.detach().cpu()
    if gs.shape != es.shape or gc.shape != ec.shape:
        lines.append(f"shapes differ: engine scale {tuple(gs.shape)} codes {tuple(gc.shape)}, oracle scale "
                     f"{tuple(es.shape)} codes {tuple(ec.shape)}")
        return Explanation("kv_store", 1, es.numel() + ec.numel(), None, lines)
    bad_scale = ~_same_floats(gs, es)
    bad_code = ~_same_codes(gc, ec)
    n_scale, n_code = int(bad_scale.sum()), int(bad_code.sum())
    lines.append(f"scales: {n_scale} of {es.numel()} differ; codes: {n_code} of {ec.numel()} differ")
    e_full = kvref.expand_scale(es, policy.layout, shape)
    g_full = kvref.expand_scale(gs, policy.layout, shape)
    xf = x.detach().cpu().float()
    first = _first_indices(bad_code, limit)
    if not first and n_scale:
        si = _first_indices(bad_scale, 1)[0]
        lines.append(f"scale {_ix(si)}: oracle {_f(float(es[si]))}, engine {_f(float(gs[si]))}")
    for ix in first:
        xv, so, se = float(xf[ix]), float(e_full[ix]), float(g_full[ix])
        t, h = ix[-3], ix[-2]
        lines.append(f"element {_ix(ix)} (token {t}, head {h}, d {ix[-1]}): x = {_f(xv)}")
        if policy.layout == "token_head":
            amax = float(xf[ix[:-1]].abs().max())
            lines.append(f"  amax over D = {_f(amax)}; amax/{policy.fmax:g} fp32 = "
                         f"{_f(float(torch.tensor(amax) / torch.tensor(policy.fmax, dtype=torch.float32)))}")
        lines.append(f"  scale at this element: oracle {_f(so)}, engine's stored {_f(se)}")
        y = kvref.fp32_scaled(torch.tensor([xv], dtype=torch.float32), torch.tensor([so], dtype=torch.float32),
                              policy.quant_op)
        yd = float(torch.tensor(xv, dtype=torch.float32) / torch.tensor(so, dtype=torch.float32))
        ym = float(torch.tensor(xv, dtype=torch.float32) * (1 / torch.tensor(so, dtype=torch.float32)))
        lines.append(f"  x/s fp32 {_f(yd)}; x*(1/s) fp32 {_f(ym)}; declared ({policy.quant_op}) {_f(float(y[0]))}; "
                     f"rounded: {_r16(float(y[0]))}")
        lines.append(f"  |y| vs the format's max {policy.fmax:g}: {'beyond' if abs(float(y[0])) > policy.fmax else 'within'}"
                     f" (clamp declared {policy.clamp})")
        lines.append(f"  expected code {_code(int(ec[ix]), fmt)}, engine code {_code(int(gc[ix]), fmt)}")
    return Explanation("kv_store", n_scale + n_code, es.numel() + ec.numel(), first[0] if first else None, lines)


class KVStoreHandler:
    op = "kv_store"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        from fp8rl.reference import kv as kvref

        x, scale = args[0], args[1]
        fmt, layout = kwargs["fmt"], kwargs["layout"]
        got = engine.kv_store(x, scale, fmt=fmt, layout=layout) if got is None else got
        policy = engine.kv_policy(fmt, layout)
        return explain_kv_store(x, scale, policy, got, kvref.quantize_kv(x, scale, policy), limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        import dataclasses

        return {"kv_policy": dataclasses.asdict(engine.kv_policy(kwargs["fmt"], kwargs["layout"]))}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        x, scale = args[0], args[1]
        if ex.first is None:
            return []
        ix = tuple(ex.first)
        shape = tuple(x.shape)
        lead = tuple(slice(i, i + 1) for i in ix[:-3])
        t, h, d = ix[-3:]
        layout = kwargs["layout"]

        def sc(hs: slice) -> Any:
            if layout == "head" and isinstance(scale, torch.Tensor):
                return scale.detach()[hs].contiguous()
            return scale

        def desc(sl: tuple[slice, ...], what: str) -> str:
            return (f"x[{', '.join(f'{s.start}:{s.stop}' for s in sl)}] of the original {shape} x ({what})"
                    + ("; scale sliced to the same heads" if layout == "head" else ""))

        out = []
        if layout == "token_head":  # the scale comes from the amax over D: keep the element and the amax element
            row = x.detach()[(*ix[:-1],)].float().abs()
            a = int(torch.argmax(torch.nan_to_num(row, nan=math.inf)))
            pick = sorted({d, a})
            sl = (*lead, slice(t, t + 1), slice(h, h + 1))
            vals = x.detach()[sl][..., pick].contiguous()
            out.append(Candidate((vals, None), dict(kwargs),
                                 f"elements d={pick} of token {t}, head {h} of the original {shape} x (the first "
                                 "differing element and the amax element over D: the same per-(token, head) scale)"))
            sl = (*lead, slice(t, t + 1), slice(h, h + 1), slice(0, shape[-1]))
            out.append(Candidate((x.detach()[sl].contiguous(), None), dict(kwargs), desc(sl, "the failing token and head")))
            return out
        sl = (*lead, slice(t, t + 1), slice(h, h + 1), slice(d, d + 1))
        out.append(Candidate((x.detach()[sl].contiguous(), sc(slice(h, h + 1))), dict(kwargs),
                             desc(sl, "the first differing element alone")))
        sl = (*lead, slice(t, t + 1), slice(0, shape[-2]), slice(d, d + 1))
        out.append(Candidate((x.detach()[sl].contiguous(), sc(slice(0, shape[-2]))), dict(kwargs),
                             desc(sl, "that element of the failing token in every head")))
        sl = (*lead, slice(t, t + 1), slice(h, h + 1), slice(0, shape[-1]))
        out.append(Candidate((x.detach()[sl].contiguous(), sc(slice(h, h + 1))), dict(kwargs),
                             desc(sl, "the failing token and head")))
        return out


# ----------------------------------------------------------------------------------------------------------------
# rollout_correction


def _corr_bounds(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, config: Any,
                 expected: Any) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(the elementwise corr_weight bound on |w_engine − w_oracle| or None without IS, the corr_metric bound per
    metric), as the correction checks derive them."""
    from fp8rl import tolerances
    from fp8rl.reference import correction as C

    m = mask != 0
    delta = C.log_ratio(train_logp, rollout_logp, mask)
    w_bound = None
    w = factor = None
    if config.rollout_is is not None:
        log_err = tolerances.corr_log_weight_err(delta.abs(), m, config.rollout_is)
        counts = (int(m.sum()), mask.shape[0]) if config.rollout_is_batch_normalize else None
        rel = tolerances.corr_weight_rel_bound(log_err, counts)
        w_ref, _, factor = C.is_weights(delta, m, config)
        w_bound = rel * w_ref
        w = w_ref * factor if factor is not None else w_ref
    M, L, n = tolerances.corr_metric_magnitudes(train_logp, rollout_logp, m, C.SAFETY_BOUND, w, factor)
    bounds = {k: tolerances.corr_metric_bound(tolerances.corr_metric_magnitude(M, k, float(v)), n, L)
              for k, v in expected.metrics.items()}
    return w_bound, bounds


def explain_rollout_correction(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, config: Any,
                               got: Any, expected: Any, *, limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's rollout_correction with the oracle's: IS weights within corr_weight on valid tokens
    (0 at padding), the mask bit-exact, each metric both report within corr_metric."""
    from fp8rl.reference import correction as C

    m = mask.detach() != 0
    lines = [f"rollout_correction of a {tuple(mask.shape)} batch ({int(m.sum())} valid tokens); config: "
             f"rollout_is={config.rollout_is} threshold={config.rollout_is_threshold!r} batch_normalize="
             f"{config.rollout_is_batch_normalize} rollout_rs={config.rollout_rs} rs_threshold="
             f"{config.rollout_rs_threshold!r} veto={config.rollout_token_veto_threshold!r}"]
    w_bound, m_bounds = _corr_bounds(train_logp.detach(), rollout_logp.detach(), mask.detach(), config, expected)
    bad = torch.zeros(mask.shape, dtype=torch.bool)
    err = None
    if config.rollout_is is not None and got.weights is not None and expected.weights is not None:
        gw, ew = got.weights.detach().double(), expected.weights.detach().double()
        err = (gw - ew).abs()
        err = torch.where(torch.isnan(gw) & torch.isnan(ew), torch.zeros_like(err), err)
        err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
        assert w_bound is not None
        bad |= torch.where(m, err > w_bound, gw != 0)
    gm, em = got.mask.detach().double(), expected.mask.detach().double()
    bad_mask = gm != em
    bad |= bad_mask
    bad_metrics = []
    for k, e in expected.metrics.items():
        if k not in got.metrics or math.isnan(float(e)):
            continue
        gv = float(got.metrics[k])
        dv = abs(gv - float(e)) if math.isfinite(gv) else math.inf
        if not dv <= m_bounds[k]:
            bad_metrics.append(f"metric {k}: expected {float(e)!r} engine {gv!r} |err| {dv:.3e} > bound {m_bounds[k]:.3e}")
    n_tok = int(bad.sum())
    lines.append(f"tokens whose IS weight or mask differs: {n_tok} of {mask.numel()}; metrics beyond their bound: "
                 f"{len(bad_metrics)} of {len(expected.metrics)}")
    delta = C.log_ratio(train_logp.detach(), rollout_logp.detach(), mask.detach())
    raw = C.raw_log_weights(delta, m, config.rollout_is) if config.rollout_is is not None else None
    first = _first_indices(bad, limit)
    for ix in first:
        lo, lr = float(train_logp.detach()[ix]), float(rollout_logp.detach()[ix])
        d = float(delta[ix])
        lines.append(f"token {_ix(ix)}: mask {float(mask[ix])!r}; log pi_train {_f(lo)}, log pi_rollout {_f(lr)}")
        lines.append(f"  delta = log pi_train - log pi_rollout = {d!r} (fp64); rho = e^delta = {math.exp(min(d, 700))!r}")
        if raw is not None:
            lines.append(f"  raw log weight ({config.rollout_is} level) {float(raw[ix])!r}; IS bounds {config.is_bounds}")
        if err is not None and w_bound is not None:
            lines.append(f"  weight: expected {float(expected.weights[ix])!r}, engine {float(got.weights[ix])!r}, "
                         f"|err| {float(err[ix]):.3e}, bound {float(w_bound[ix]):.3e}")
        lines.append(f"  mask after correction: expected {float(em[ix])!r}, engine {float(gm[ix])!r}")
    lines += bad_metrics[:limit]
    return Explanation("rollout_correction", n_tok + len(bad_metrics), mask.numel() + len(expected.metrics),
                       first[0] if first else None, lines)


class CorrectionHandler:
    op = "rollout_correction"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        from fp8rl.reference import correction as C

        lo, lr, mask, cfg = args[:4]
        got = engine.rollout_correction(lo, lr, mask, cfg) if got is None else got
        return explain_rollout_correction(lo, lr, mask, cfg, got, C.rollout_correction(lo, lr, mask, cfg), limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        return {}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        lo, lr, mask, cfg = args[:4]
        shape = tuple(mask.shape)
        out = []
        rows = [ex.first[0]] if ex.first is not None else list(range(shape[0]))[:1]
        if ex.first is not None:
            b, t = ex.first
            sl = (slice(b, b + 1), slice(t, t + 1))
            out.append(Candidate((lo.detach()[sl].contiguous(), lr.detach()[sl].contiguous(),
                                  mask.detach()[sl].contiguous(), cfg), {},
                                 f"token ({b}, {t}) alone of the original {shape} batch (train_logp, rollout_logp, "
                                 "mask sliced alike)"))
        for b in rows:
            sl = (slice(b, b + 1), slice(0, shape[1]))
            out.append(Candidate((lo.detach()[sl].contiguous(), lr.detach()[sl].contiguous(),
                                  mask.detach()[sl].contiguous(), cfg), {},
                                 f"row {b} of the original {shape} batch (train_logp, rollout_logp, mask sliced alike)"))
        return out


# ----------------------------------------------------------------------------------------------------------------
# any op that raised in the check


def explain_raises(engine: Any, op: str, args: tuple, kwargs: dict) -> Explanation:
    """Call ``engine.<op>(*args, **kwargs)``: a disagreement when it raises (the check's ``error`` outcome)."""
    try:
        getattr(engine, op)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the exception is what the repro shows
        return Explanation(op, 1, 1, None, [f"{op} raised {type(exc).__name__}: {exc}"])
    return Explanation(op, 0, 1, None, [f"{op} returned without raising"])


#: op → handler
HANDLERS: dict[str, Any] = {h.op: h for h in (QuantizeHandler(), CastHandler(), KVStoreHandler(), CorrectionHandler())}


def handler_for(op: str) -> Any | None:
    return HANDLERS.get(op)


def run_check(explain: Callable[[], Explanation], check: bool) -> int:
    """Print an explanation; the exit status of a repro script: 1 with ``check`` while something disagrees."""
    ex = explain()
    print(ex.text())
    verdict = (f"DISCREPANCY: {ex.n_bad} of {ex.total} compared values differ from fp8rl's oracle" if ex.n_bad
               else "no discrepancy: the engine agrees with fp8rl's oracle on this input")
    print(verdict)
    return 1 if (check and ex.n_bad) else 0


__all__ = ["Candidate", "DEFAULT_LIMIT", "Explanation", "HANDLERS", "explain_cast", "explain_raises", "explain_kv_store",
           "explain_quantize", "explain_rollout_correction", "handler_for", "run_check"]
