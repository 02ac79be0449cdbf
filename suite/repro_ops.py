"""Per-op comparison, explanation and shrinking for ``fp8rl repro`` (and the ``repro.py`` scripts it writes).

For each supported op, an ``explain_<op>`` function takes the op's inputs, the engine's declared numerics, the
engine's result and fp8rl's oracle result, and returns an :class:`Explanation`: how many elements disagree and, for
the first ones, every intermediate value (quantize: the group's amax, the scale as amax/T and the engine's, x/s in
fp32 and rounded to 16-bit dtypes, the expected and actual code and its decoded value; block_gemm: per K block the
code products, both scales, the partial product exact and fp32-accumulated; kv_attention: the query, Q̂, the keys'
scores and softmax weights; correction_loss: per token r, the per-token loss and ∂L/∂logp; weight_sync: the first
differing 128x128 block's amax, scales and codes). A :class:`Handler` per op ties it together for the repro command:
run the engine and the oracle on captured arguments, and propose smaller inputs (the failing row, block, head, token
or K block, then the fewest elements the op allows) that may still disagree.

Judgement is the check's: codes and masks bit-exact, IS weights within ``corr_weight``, metrics within
``corr_metric``, GEMM outputs within ``gemm_fp32_accum``, attention within ``kv_attention_arith``, the loss and its
gradient within ``corr_loss`` (fp8rl.tolerances); weight sync byte for byte. Nothing here changes what a check
decides; it only explains one op call.
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
# helpers shared by the ops judged within a bound


def _bound_bad(got: torch.Tensor, expected: torch.Tensor, bound: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bad, err, bound) elementwise, as fp8rl.checks.assert_within_bound judges: NaN agrees only with NaN."""
    g = got.detach().cpu().double()
    e = expected.detach().cpu().double()
    b = (bound.detach().cpu().double() if isinstance(bound, torch.Tensor)
         else torch.tensor(float(bound), dtype=torch.float64)).expand_as(e)
    err = (g - e).abs()
    both_nan = torch.isnan(g) & torch.isnan(e)
    err = torch.where(both_nan, torch.zeros_like(err), err)
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    b = torch.where(both_nan, torch.zeros_like(b), b)
    b = torch.where(torch.isnan(b), torch.zeros_like(b), b)
    return err > b, err, b


def _beyond_bound(got: torch.Tensor, expected: torch.Tensor, bound: Any, limit: int, *, bound_name: str,
                  element: str, axes: str = "") -> tuple[int, list[tuple[int, ...]], list[str]]:
    """(how many outputs lie beyond the bound, the first ``limit`` of them, the printout): a count line, then per
    element ``<element>[index]<axes>: oracle, engine, |err| > bound`` (the judgement of :func:`_bound_bad`)."""
    bad, err, b = _bound_bad(got, expected, bound)
    nb = int(bad.sum())
    lines = [f"outputs beyond the {bound_name}: {nb} of {expected.numel()}"]
    first = _first_indices(bad, limit)
    gd, ed = got.detach().cpu().double(), expected.detach().cpu().double()
    for ix in first:
        lines.append(f"{element}{_ix(ix)}{axes}: oracle {_f(float(ed[ix]))}, engine {_f(float(gd[ix]))}, "
                     f"|err| {float(err[ix]):.3e} > bound {float(b[ix]):.3e}")
    return nb, first, lines


def _dt(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------------------
# block_gemm (area gemm)


def _gemm_slice(qt: Any, rows: slice, k0: int, k1: int) -> Any:
    """Rows ``rows`` and columns k0:k1 of a 2-D QuantizedTensor, with the scales those elements use. The columns
    must not cut a scale group/block (k0 on a group edge)."""
    from fp8rl.reference.quant import QuantizedTensor

    g = qt.granularity
    codes = qt.codes[rows, k0:k1].contiguous()
    s = qt.scale
    if g.kind in ("token", "channel"):
        s = s[rows]
    elif g.kind == "group":
        G = g.size[1]
        s = s[rows, k0 // G:(k1 - 1) // G + 1]
    elif g.kind == "block":
        bm, bk = g.size
        r0, r1 = rows.start, rows.stop
        s = s[r0 // bm:(r1 - 1) // bm + 1, k0 // bk:(k1 - 1) // bk + 1]
    return QuantizedTensor(codes, s.contiguous().clone(), g, qt.policy)


def gemm_oracle(a: Any, w: Any, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact fp64 product, the elementwise gemm_fp32_accum bound for ``out_dtype``): what GEMM-* judge by."""
    from fp8rl.reference.gemm import block_gemm_exact, gemm_error_bound

    return block_gemm_exact(a, w), gemm_error_bound(a, w, out_dtype)


def explain_block_gemm(a: Any, w: Any, out_dtype: torch.dtype, got: torch.Tensor, expected: torch.Tensor,
                       bound: torch.Tensor, *, limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's block_gemm(a, w) with the exact product within the gemm_fp32_accum bound; for the
    first output beyond it, every K block: the codes' dot product, both scales, the block's partial product (exact
    and with fp32 accumulation) and the running sums."""
    from fp8rl.reference.gemm import _segments
    from fp8rl.reference.quant import expand_scale

    m, k = tuple(a.codes.shape)
    n = int(w.codes.shape[0])
    lines = [f"block_gemm of a ({m}, {k}) {a.fmt} [{a.granularity.label}] x w ({n}, {k}) {w.fmt} "
             f"[{w.granularity.label}] -> {_dt(out_dtype)}; oracle: the exact fp64 product; bound gemm_fp32_accum"]
    if tuple(got.shape) != (m, n):
        lines.append(f"shape differs: engine {tuple(got.shape)}, expected ({m}, {n})")
        return Explanation("block_gemm", 1, m * n, None, lines)
    nb, first, shown = _beyond_bound(got, expected, bound, limit, bound_name="bound", element="y")
    lines += shown
    gd, ed = got.detach().cpu().double(), expected.detach().cpu().double()
    if first:
        i, j = first[0]
        av, wv = a.values().double(), w.values().double()
        sa, sw = expand_scale(a.scale, a.granularity, (m, k)).double(), expand_scale(w.scale, w.granularity, (n, k)).double()
        lines.append(f"output ({i}, {j}) by K block (row {i} of a, row {j} of w; the scales constant on each block):")
        run_exact, run_f32 = 0.0, torch.zeros((), dtype=torch.float32)
        for k0, k1 in _segments(k, a, w):
            dot = float((av[i, k0:k1] * wv[j, k0:k1]).sum())  # exact: FP8 values on a 2^-g grid, short sums
            s_a, s_w = float(sa[i, k0]), float(sw[j, k0])
            part = dot * s_a * s_w
            prods = (av[i, k0:k1] * sa[i, k0:k1]).float() * (wv[j, k0:k1] * sw[j, k0:k1]).float()
            part32 = torch.zeros((), dtype=torch.float32)
            for p in prods:
                part32 = part32 + p
            run_exact += part
            run_f32 = run_f32 + part32
            lines.append(f"  K {k0}:{k1}: sum of code products {dot!r}; s_a {_f(s_a)}, s_w {_f(s_w)}; partial "
                         f"{part!r} (fp32 accumulation {_f(float(part32))}); running sum exact {run_exact!r}, "
                         f"fp32 {_f(float(run_f32))}")
        lines.append(f"  total: oracle {_f(float(ed[i, j]))}; fp32 accumulation of the blocks {_f(float(run_f32))} "
                     f"(rounded to {_dt(out_dtype)}: {float(run_f32.to(out_dtype))!r}); engine {_f(float(gd[i, j]))}; "
                     f"engine - oracle = {float(gd[i, j] - ed[i, j])!r}")
    return Explanation("block_gemm", nb, m * n, first[0] if first else None, lines)


class BlockGemmHandler:
    op = "block_gemm"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        a, w, out_dtype = _gemm_args(args, kwargs)
        got = engine.block_gemm(a, w, out_dtype) if got is None else got
        expected, bound = gemm_oracle(a, w, out_dtype)
        return explain_block_gemm(a, w, out_dtype, got, expected, bound, limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        return {}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        from fp8rl.reference.gemm import _segments

        a, w, out_dtype = _gemm_args(args, kwargs)
        if ex.first is None:
            return []
        i, j = ex.first
        m, k = tuple(a.codes.shape)
        n = int(w.codes.shape[0])
        ri, rj = slice(i, i + 1), slice(j, j + 1)
        out = []
        for k0, k1 in _segments(k, a, w):
            out.append(Candidate((_gemm_slice(a, ri, k0, k1), _gemm_slice(w, rj, k0, k1), out_dtype), {},
                                 f"row {i} of a and row {j} of w (output element ({i}, {j})) of the original "
                                 f"({m}, {k}) x ({n}, {k}) GEMM, K {k0}:{k1} only (one K block; scales sliced alike)"))
        out.append(Candidate((_gemm_slice(a, ri, 0, k), _gemm_slice(w, rj, 0, k), out_dtype), {},
                             f"row {i} of a and row {j} of w (output element ({i}, {j})) of the original ({m}, {k}) x "
                             f"({n}, {k}) GEMM, every K block (scales sliced alike)"))
        return out


def _gemm_args(args: tuple, kwargs: dict) -> tuple[Any, Any, torch.dtype]:
    names = ("a", "w", "out_dtype")
    vals = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    return vals["a"], vals["w"], vals["out_dtype"]


# ----------------------------------------------------------------------------------------------------------------
# kv_attention (area kv)

_ATTN_KW = ("q_scale", "causal", "q_lengths", "kv_lengths", "sm_scale")


def kv_attention_oracle(policy: Any, q: torch.Tensor, k_cache: Any, v_cache: Any, kw: dict) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor,
                                                                                                       torch.Tensor]:
    """(the oracle's FP8 attention on the same FP8 operands, the kv_attention_arith bound, the Q̂ it used) as
    KV-ATTN-001 computes them under the declared KV ``policy``."""
    from fp8rl import tolerances
    from fp8rl.reference import kv as kvref

    qs = kw.get("q_scale")
    rest = {k: v for k, v in kw.items() if k != "q_scale"}
    q_hat = kvref.to_f32(q).double() if qs is None else kvref.quantize_q(q, qs, policy.q_fmt, policy.q_quant_op)
    k_hat, v_hat = kvref.dequantize_kv(k_cache), kvref.dequantize_kv(v_cache)
    expected = kvref.attention(q_hat, k_hat, v_hat, **rest)
    t = kvref.attention_bound_terms(q_hat, k_hat, v_hat, **rest)
    bound = tolerances.kv_attention_arith_bound(t.score_abs_max, t.score_span, t.weighted_abs_v, t.head_dim, t.n_keys)
    bound = torch.as_tensor(bound, dtype=torch.float64)
    return expected, bound, q_hat


def explain_kv_attention(q: torch.Tensor, k_cache: Any, v_cache: Any, kw: dict, policy: Any, got: torch.Tensor,
                         expected: torch.Tensor, bound: torch.Tensor, q_hat: torch.Tensor, *,
                         limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's kv_attention with the oracle's within kv_attention_arith; for the first output beyond
    it: the query (and Q̂), the keys it sees with their scores and softmax weights, and both output rows."""
    from fp8rl.reference import kv as kvref

    B, Tq, Hq, D = tuple(q.shape)
    Tk, Hkv = int(k_cache.codes.shape[1]), int(k_cache.codes.shape[2])
    lines = [f"kv_attention of q {tuple(q.shape)} {_dt(q.dtype)} over caches {tuple(k_cache.codes.shape)} "
             f"{k_cache.fmt}/{k_cache.layout}; " + ", ".join(f"{k}={_short(kw.get(k))}" for k in _ATTN_KW)
             + f"; declared KV policy: quantize_q {policy.quantize_q}, q_fmt {policy.q_fmt}, q_quant_op "
             f"{policy.q_quant_op}"]
    if tuple(got.shape) != tuple(expected.shape):
        lines.append(f"shape differs: engine {tuple(got.shape)}, expected {tuple(expected.shape)}")
        return Explanation("kv_attention", 1, expected.numel(), None, lines)
    nb, first, shown = _beyond_bound(got, expected, bound, limit, bound_name="kv_attention_arith bound",
                                     element="o", axes=" (batch, query, head, d)")
    lines += shown
    gd, ed = got.detach().cpu().double(), expected.detach().cpu().double()
    if first:
        bi, i, h, _ = first[0]
        g = h // (Hq // Hkv)
        rest = {k: v for k, v in kw.items() if k != "q_scale"}
        k_hat, v_hat = kvref.dequantize_kv(k_cache), kvref.dequantize_kv(v_cache)
        _, p = kvref.attention(q_hat, k_hat, v_hat, return_probs=True, **rest)
        sm = 1.0 / math.sqrt(D) if kw.get("sm_scale") is None else float(kw["sm_scale"])
        qs = kw.get("q_scale")
        lines.append(f"query ({bi}, {i}, head {h}) reads KV head {g}; sm_scale {sm!r}; q_scale "
                     f"{'none (Q in fp32)' if qs is None else _f(float(torch.as_tensor(qs)))}")
        qx = q.detach().double()[bi, i, h]
        lines.append(f"  q[:4] {[float(v) for v in qx[:4]]}; Q-hat[:4] (the Q the oracle uses) "
                     f"{[float(v) for v in q_hat[bi, i, h, :4]]}")
        seen = (p[bi, h, i] > 0).nonzero().flatten().tolist()
        scores = sm * (q_hat[bi, i, h] @ k_hat[bi, :, g].T)
        lines.append(f"  keys with p > 0: {len(seen)} of {Tk}; max score {float(scores[seen].max()) if seen else 0.0!r}")
        for jj in seen[:8]:
            ks = kvref.expand_scale(k_cache.scale, k_cache.layout, tuple(k_cache.codes.shape))[bi, jj, g, 0]
            lines.append(f"  key {jj}: k scale {_f(float(ks))}, score sm*q.k {float(scores[jj])!r}, p "
                         f"{float(p[bi, h, i, jj])!r}")
        lines.append(f"  output row o[{bi}, {i}, {h}, :4]: oracle {[float(v) for v in ed[bi, i, h, :4]]}, engine "
                     f"{[float(v) for v in gd[bi, i, h, :4]]}")
    return Explanation("kv_attention", nb, expected.numel(), first[0] if first else None, lines)


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return repr(float(v)) if v.numel() == 1 and v.dim() == 0 else str(v.tolist())
    return repr(v)


def _attn_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any, Any, dict]:
    names = ("q", "k_cache", "v_cache")
    vals = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    return vals["q"], vals["k_cache"], vals["v_cache"], {k: v for k, v in kwargs.items() if k in _ATTN_KW}


def _cache_slice(cache: Any, b: int, t: slice, g: slice) -> Any:
    from fp8rl.reference.kv import KVCache

    s = cache.scale
    if cache.layout == "head":
        s = s[g]
    elif cache.layout == "token_head":
        s = s[b:b + 1, t, g]
    return KVCache(cache.codes[b:b + 1, t, g].contiguous(), s.contiguous().clone(), cache.fmt, cache.layout)


class KVAttentionHandler:
    op = "kv_attention"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        q, kc, vc, kw = _attn_args(args, kwargs)
        got = engine.kv_attention(q, kc, vc, **kw) if got is None else got
        policy = engine.kv_policy(kc.fmt, kc.layout)
        expected, bound, q_hat = kv_attention_oracle(policy, q, kc, vc, kw)
        return explain_kv_attention(q, kc, vc, kw, policy, got, expected, bound, q_hat, limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        import dataclasses

        _, kc, _, _ = _attn_args(args, kwargs)
        return {"kv_policy": dataclasses.asdict(engine.kv_policy(kc.fmt, kc.layout))}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        q, kc, vc, kw = _attn_args(args, kwargs)
        if ex.first is None:
            return []
        b, i, h, _ = ex.first
        B, Tq, Hq, D = tuple(q.shape)
        Tk, Hkv = int(kc.codes.shape[1]), int(kc.codes.shape[2])
        g = h // (Hq // Hkv)
        ql = kw.get("q_lengths")
        kl = kw.get("kv_lengths")
        qlen = int(torch.as_tensor(ql)[b]) if ql is not None else Tq
        kvlen = int(torch.as_tensor(kl)[b]) if kl is not None else Tk
        seen = min(i + kvlen - qlen + 1, kvlen) if kw.get("causal", True) else kvlen
        q1 = q.detach()[b:b + 1, i:i + 1, h:h + 1].contiguous()
        orig = f"of the original q {tuple(q.shape)} and caches {tuple(kc.codes.shape)}"
        out = []
        if i < qlen and seen > 0:
            kw1 = {**kw, "q_lengths": None, "kv_lengths": None}
            out.append(Candidate((q1, _cache_slice(kc, b, slice(0, seen), slice(g, g + 1)),
                                  _cache_slice(vc, b, slice(0, seen), slice(g, g + 1))), kw1,
                                 f"query token {i} of head {h} in sequence {b} {orig}, with the {seen} keys it sees "
                                 f"(KV head {g}, cache slots 0:{seen}; no lengths needed)"))
        if ql is not None or kl is not None:
            like = torch.as_tensor(ql if ql is not None else kl)
            kw2 = {**kw, "q_lengths": torch.tensor([1 if i < qlen else 0], dtype=like.dtype),
                   "kv_lengths": torch.tensor([max(seen, 0) if i < qlen else kvlen], dtype=like.dtype)}
            out.append(Candidate((q1, _cache_slice(kc, b, slice(0, Tk), slice(g, g + 1)),
                                  _cache_slice(vc, b, slice(0, Tk), slice(g, g + 1))), kw2,
                                 f"query token {i} of head {h} in sequence {b} {orig}, over sequence {b}'s whole cache "
                                 f"of KV head {g} with q_lengths {kw2['q_lengths'].tolist()} and kv_lengths "
                                 f"{kw2['kv_lengths'].tolist()} (the slots past kv_len kept)"))
        kw3 = {**kw, "q_lengths": None if ql is None else torch.as_tensor(ql)[b:b + 1].clone(),
               "kv_lengths": None if kl is None else torch.as_tensor(kl)[b:b + 1].clone()}
        out.append(Candidate((q.detach()[b:b + 1].contiguous(), _cache_slice(kc, b, slice(0, Tk), slice(0, Hkv)),
                              _cache_slice(vc, b, slice(0, Tk), slice(0, Hkv))), kw3,
                             f"sequence {b} (every query and head) {orig}"))
        return out


# ----------------------------------------------------------------------------------------------------------------
# correction_loss (area correction)

_LOSS_NAMES = ("logp", "old_logp", "advantages", "mask", "weights", "config")


def _loss_args(args: tuple, kwargs: dict) -> tuple:
    vals = dict(zip(_LOSS_NAMES, args, strict=False)) | {k: v for k, v in kwargs.items() if k in _LOSS_NAMES}
    return tuple(vals.get(n) for n in _LOSS_NAMES)


def correction_loss_oracle(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                           weights: torch.Tensor | None, config: Any) -> dict[str, Any]:
    """The oracle's loss and ∂L/∂logp (float64) and the corr_loss bounds on both, as CORR-LOSS-001/002 derive them
    (magnitudes times the corr_loss_headroom factor)."""
    from fp8rl import tolerances
    from fp8rl.reference import correction as C

    m = mask.detach() != 0
    xr = logp.detach().double().requires_grad_(True)
    ref = C.policy_loss(xr, old, adv, mask, weights, config)
    (r_grad,) = torch.autograd.grad(ref, xr)
    lp = logp.detach().double()
    n = int(m.sum())
    zero = torch.zeros((), dtype=torch.float64)
    L = float(torch.where(m, (lp - old.detach().double()).abs() + lp.abs(), zero).max()) if n else 0.0
    per = (C.ppo_clip_token_loss(lp, old.detach().double(), adv.detach().double(), config)
           if config.kind == "ppo_clip" else -adv.detach().double() * lp)
    w = weights.detach().double() if weights is not None else torch.ones_like(lp)
    headroom = tolerances.get("corr_loss_headroom").value
    mag = float(C.aggregate(torch.where(m, (per * w).abs(), zero), mask, config.agg)) * headroom
    gmag = float(r_grad.abs().max()) * headroom
    return {"loss": ref.detach(), "grad": r_grad, "per": per, "n": n, "L": L,
            "bound": tolerances.corr_loss_bound(mag, n, L), "grad_bound": tolerances.corr_loss_bound(gmag, n, L)}


def engine_correction_loss(engine: Any, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                           weights: torch.Tensor | None, config: Any) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(the engine's loss, its ∂L/∂logp or None, why not): the check's call, logp a fresh leaf requiring grad."""
    x = logp.detach().clone().requires_grad_(True)
    got = engine.correction_loss(x, old, adv, mask, weights, config)
    if not isinstance(got, torch.Tensor) or got.dim() != 0:
        return torch.as_tensor(got), None, "the loss is not a 0-d tensor"
    if not got.requires_grad:
        return got.detach(), None, "the loss is not differentiable with respect to logp"
    (grad,) = torch.autograd.grad(got, x)
    return got.detach(), grad, ""


def explain_correction_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                            weights: torch.Tensor | None, config: Any, got_loss: torch.Tensor,
                            got_grad: torch.Tensor | None, oracle: dict[str, Any], *, why: str = "",
                            limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's correction_loss (value and ∂L/∂logp) with the oracle's within corr_loss."""
    m = mask.detach() != 0
    lines = [f"correction_loss of a {tuple(mask.shape)} batch ({oracle['n']} valid tokens); config: kind "
             f"{config.kind}, agg {config.agg}, clip_ratio_low {config.clip_ratio_low!r}, clip_ratio_high "
             f"{config.clip_ratio_high!r}, clip_ratio_c {config.clip_ratio_c!r}; IS weights "
             f"{'none' if weights is None else 'given'}"]
    gl, el = float(got_loss.double()), float(oracle["loss"])
    dl = abs(gl - el) if math.isfinite(gl) else math.inf
    loss_bad = not dl <= oracle["bound"]
    lines.append(f"loss: oracle {_f(el)}, engine {_f(gl)}, |err| {dl:.3e} {'>' if loss_bad else '<='} bound "
                 f"{oracle['bound']:.3e}")
    n_bad = int(loss_bad)
    first = None
    if got_grad is None:
        lines.append(f"gradient: none ({why})")
        n_bad += 1
    elif tuple(got_grad.shape) != tuple(mask.shape):
        lines.append(f"gradient shape {tuple(got_grad.shape)}, expected {tuple(mask.shape)}")
        n_bad += 1
    else:
        bad, err, b = _bound_bad(got_grad, oracle["grad"], oracle["grad_bound"])
        nb = int(bad.sum())
        n_bad += nb
        lines.append(f"gradient dL/dlogp: {nb} of {mask.numel()} tokens beyond the bound {oracle['grad_bound']:.3e}")
        idx = _first_indices(bad, limit)
        first = idx[0] if idx else None
        for ix in idx:
            lp, lo = float(logp.detach()[ix]), float(old.detach()[ix])
            r = math.exp(max(min(lp - lo, 20.0), -20.0))
            lines.append(f"token {_ix(ix)}: mask {float(mask[ix])!r}; logp {_f(lp)}, old_logp {_f(lo)}, advantage "
                         f"{_f(float(adv[ix]))}, weight {'1' if weights is None else _f(float(weights[ix]))}")
            lines.append(f"  ratio r = e^(logp - old) = {r!r}; per-token loss (before w) {float(oracle['per'][ix])!r}")
            lines.append(f"  dL/dlogp: oracle {float(oracle['grad'][ix])!r}, engine {float(got_grad[ix])!r}, "
                         f"|err| {float(err[ix]):.3e}")
    rows = [int(r) for r in range(mask.shape[0]) if bool(m[r].any())]
    lines.append(f"valid tokens per row: {[int(m[r].sum()) for r in range(mask.shape[0])]} (rows {rows} count)")
    return Explanation("correction_loss", n_bad, 1 + mask.numel(), first, lines, anchor=rows)


class CorrectionLossHandler:
    op = "correction_loss"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        # the gradient needs a fresh call: the captured result is detached
        logp, old, adv, mask, weights, cfg = _loss_args(args, kwargs)
        loss, grad, why = engine_correction_loss(engine, logp, old, adv, mask, weights, cfg)
        oracle = correction_loss_oracle(logp, old, adv, mask, weights, cfg)
        return explain_correction_loss(logp, old, adv, mask, weights, cfg, loss, grad, oracle, why=why, limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        return {}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        logp, old, adv, mask, weights, cfg = _loss_args(args, kwargs)
        shape = tuple(mask.shape)
        rows = list(ex.anchor or [])
        if ex.first is not None and ex.first[0] in rows:
            rows.remove(ex.first[0])
            rows.insert(0, ex.first[0])
        out = []
        for b in rows[:8]:
            sl = slice(b, b + 1)
            x = logp.detach()[sl].clone().requires_grad_(logp.requires_grad)
            out.append(Candidate((x, old.detach()[sl].clone(), adv.detach()[sl].clone(), mask.detach()[sl].clone(),
                                  None if weights is None else weights.detach()[sl].clone(), cfg), {},
                                 f"row {b} of the original {shape} batch (logp, old_logp, advantages, mask, weights "
                                 "sliced alike)"))
        return out


# ----------------------------------------------------------------------------------------------------------------
# weight_sync (area weight_sync)


def weight_sync_oracle(state_dict: Any, policy: Any) -> dict[str, torch.Tensor]:
    """The oracle's sync of ``state_dict`` under the declared block ``policy`` (fp8rl.reference.weight_sync)."""
    from fp8rl.reference import weight_sync as ws

    return ws.quantize_state_dict(state_dict, ws.WeightSyncRecipe(policy=policy))


def _same_tensor(g: torch.Tensor, w: torch.Tensor) -> bool:
    if g.dtype != w.dtype or g.shape != w.shape:
        return False
    if not w.numel():
        return True
    return torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


def explain_weight_sync(state_dict: Any, policy: Any, got: dict, want: dict, *,
                        limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's weight_sync(state_dict) with the oracle's: names, dtypes, shapes, every byte; for the
    first differing quantized weight, its first differing 128x128 block: amax, amax/T, both scales, the codes."""
    from fp8rl.reference import weight_sync as ws

    lines = [f"weight_sync of {len(state_dict)} tensors; {_policy_line(policy)}"]
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    diff = [n for n in want if n in got and not _same_tensor(got[n], want[n])]
    n_bad = len(missing) + len(extra) + len(diff)
    lines.append(f"tensors that differ: {len(diff)}; missing names: {missing[:6]}; unexpected names: {extra[:6]}")
    anchor = None
    for name in (missing + extra)[:limit]:
        base = name.removesuffix(ws.SCALE_SUFFIX)
        where = "the engine lacks" if name in missing else "only the engine ships"
        lines.append(f"{name}: {where} it (input {base}: "
                     f"{_dt(state_dict[base].dtype) if base in state_dict else 'absent'}; oracle ships "
                     f"{_dt(want[base].dtype) if base in want else 'nothing'} for it, the engine "
                     f"{_dt(got[base].dtype) if base in got else 'nothing'})")
        if anchor is None and base in state_dict:
            anchor = (base, (0, 0))
    for name in diff[:limit]:
        g, w = got[name], want[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            lines.append(f"{name}: engine {_dt(g.dtype)} {tuple(g.shape)}, oracle {_dt(w.dtype)} {tuple(w.shape)}")
            continue
        gb = g.contiguous().view(torch.uint8).reshape(w.numel(), -1)
        wb = w.contiguous().view(torch.uint8).reshape(w.numel(), -1)
        bad = (gb != wb).any(-1).reshape(w.shape)
        ix = _first_indices(bad, 1)[0]
        lines.append(f"{name}: {int(bad.sum())} of {w.numel()} elements differ, first at {_ix(ix)}")
        base = name.removesuffix(ws.SCALE_SUFFIX)
        if anchor is None and base in state_dict and state_dict[base].dim() == 2:
            anchor = (base, (ix[0], ix[1]) if name.endswith(ws.SCALE_SUFFIX) else (ix[0] // 128, ix[1] // 128))
    if anchor is not None and ws.scale_name(anchor[0]) in want and ws.scale_name(anchor[0]) in got:
        base, (bi, bj) = anchor
        x = state_dict[base].to(torch.bfloat16).float()
        r0, c0 = bi * 128, bj * 128
        blk = x[r0:r0 + 128, c0:c0 + 128]
        amax = float(blk.abs().max())
        T = float(policy.max_value)
        es, gs = want[ws.scale_name(base)], got[ws.scale_name(base)]
        so = float(es[bi, bj])
        se = float(gs[bi, bj]) if gs.dim() == 2 and bi < gs.shape[0] and bj < gs.shape[1] else float("nan")
        plain = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(T, dtype=torch.float32))
        lines.append(f"block ({bi}, {bj}) of {base} = rows {r0}:{r0 + blk.shape[0]}, cols {c0}:{c0 + blk.shape[1]} "
                     f"(input cast to BF16): amax {_f(amax)}; amax/{T:g} fp32 {_f(plain)} (rounded: {_r16(plain)})")
        lines.append(f"  {ws.scale_name(base)}[{bi}, {bj}]: oracle {_f(so)}, engine {_f(se)}")
        gc = got[base].contiguous().view(torch.uint8) if got[base].element_size() == 1 else None
        wc = want[base].contiguous().view(torch.uint8)
        if gc is not None and gc.shape == wc.shape:
            bad = (gc[r0:r0 + 128, c0:c0 + 128] != wc[r0:r0 + 128, c0:c0 + 128])
            for lr, lc in _first_indices(bad, limit):
                r, c = r0 + lr, c0 + lc
                xv = float(x[r, c])
                lines.append(f"  element ({r}, {c}): x {_f(xv)}; x/s with the oracle's scale fp32 "
                             f"{_f(float(torch.tensor(xv) / torch.tensor(so, dtype=torch.float32)))}; expected code "
                             f"{_code(int(wc[r, c]), policy.fmt)}, engine code {_code(int(gc[r, c]), policy.fmt)}")
        elif gc is None:
            lines.append(f"  engine's {base} is {_dt(got[base].dtype)}, oracle's {_dt(want[base].dtype)}")
    return Explanation("weight_sync", n_bad, len(set(want) | set(got)), None, lines, anchor)


class WeightSyncHandler:
    op = "weight_sync"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        sd = args[0] if args else kwargs["state_dict"]
        got = engine.weight_sync(sd) if got is None else got
        policy = engine.scale_policy("block")
        return explain_weight_sync(sd, policy, got, weight_sync_oracle(sd, policy), limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        import dataclasses

        return {"scale_policy": dataclasses.asdict(engine.scale_policy("block"))}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        sd = args[0] if args else kwargs["state_dict"]
        if ex.anchor is None:
            return []
        name, (bi, bj) = ex.anchor
        t = sd[name]
        out = []
        if t.dim() == 2:
            r0, c0 = bi * 128, bj * 128
            blk = t[r0:r0 + 128, c0:c0 + 128].contiguous().clone()
            out.append(Candidate(({name: blk},), {},
                                 f"the 128x128 block ({bi}, {bj}) of {name} alone (rows {r0}:{r0 + blk.shape[0]}, "
                                 f"cols {c0}:{c0 + blk.shape[1]} of its {tuple(t.shape)} {_dt(t.dtype)} weight), as a "
                                 "one-tensor state dict"))
        out.append(Candidate(({name: t.contiguous().clone()},), {},
                             f"{name} alone ({tuple(t.shape)} {_dt(t.dtype)}), as a one-tensor state dict"))
        return out


# ----------------------------------------------------------------------------------------------------------------
# mx_quantize (area quantization, microscaling recipes)


def explain_mx_quantize(x: torch.Tensor, recipe: str, policy: Any, got: Any, expected: Any, *,
                        limit: int = DEFAULT_LIMIT) -> Explanation:
    """Compare the engine's mx_quantize(x, recipe) with the oracle's under the declared MXPolicy: the global scale
    (NVFP4) bit for bit, the block scale codes and the element codes; per differing block its amax, log2(amax/T)
    and both scales; per differing element x, x/scale and both codes."""
    from fp8rl.reference import microscaling as mx

    B = int(policy.block)
    lines = [f"mx_quantize[{recipe}] of x {tuple(x.shape)} {_dt(x.dtype)}; declared policy {policy.name!r}: elem "
             f"{policy.elem}, block {B}, scale_fmt {policy.scale_fmt}, exp_rounding {policy.exp_rounding}, ratio_op "
             f"{policy.ratio_op}, scale_op {policy.scale_op}, quant_op {policy.quant_op}, global_op {policy.global_op}"]
    if tuple(got.shape) != tuple(expected.shape) or got.scales.shape != expected.scales.shape \
            or got.data.shape != expected.data.shape:
        lines.append(f"shapes differ: engine shape {tuple(got.shape)} scales {tuple(got.scales.shape)} data "
                     f"{tuple(got.data.shape)}, oracle {tuple(expected.shape)} {tuple(expected.scales.shape)} "
                     f"{tuple(expected.data.shape)}")
        return Explanation("mx_quantize", 1, expected.scales.numel() + expected.data.numel(), None, lines)
    n_g = 0
    if expected.global_scale is not None:
        gg = torch.as_tensor(got.global_scale, dtype=torch.float32).reshape(())
        eg = expected.global_scale.reshape(()).float()
        n_g = int(gg.view(torch.int32) != eg.view(torch.int32))
        lines.append(f"global scale g: oracle {_f(float(eg))}, engine {_f(float(gg))}" + ("   <-- differs" if n_g else ""))
    bad_s = got.scales != expected.scales
    gc, ec = got.codes(), expected.codes()
    bad_c = gc != ec
    n_s, n_c = int(bad_s.sum()), int(bad_c.sum())
    lines.append(f"block scale codes: {n_s} of {expected.scales.numel()} differ; element codes: {n_c} of {ec.numel()} "
                 "differ")
    xf = x.detach().cpu().float()
    first_c = _first_indices(bad_c, limit)
    blocks = _first_indices(bad_s, limit) or [(*ix[:-1], ix[-1] // B) for ix in first_c[:1]]
    T = float(mx.ELEMENT_MAX[policy.elem])
    gsv, esv = got.scale_values(), expected.scale_values()
    for bi in blocks:
        k0 = bi[-1] * B
        blk = xf[bi[:-1]][k0:k0 + B]
        amax = float(blk.abs().max())
        r = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(T, dtype=torch.float32))
        lines.append(f"block {_ix(bi)} = x[{', '.join(str(i) for i in bi[:-1])}, {k0}:{k0 + blk.numel()}]: amax "
                     f"{_f(amax)}; amax/{T:g} fp32 {_f(r)}; log2 {math.log2(r) if r > 0 else -math.inf!r}")
        lines.append(f"  scale code: oracle {int(expected.scales[bi])} (dequant multiplier {float(esv[bi])!r}), engine "
                     f"{int(got.scales[bi])} ({float(gsv[bi])!r})")
    for ix in first_c:
        bi = (*ix[:-1], ix[-1] // B)
        xv = float(xf[ix])
        lines.append(f"element {_ix(ix)} (block {_ix(bi)}): x {_f(xv)}; x/scale with the oracle's scale "
                     f"{xv / float(esv[bi]) if float(esv[bi]) else math.inf!r}; expected code {int(ec[ix]):#04x}, engine "
                     f"code {int(gc[ix]):#04x}")
    anchor = (blocks[0], B) if blocks else None  # the first differing block and the block size
    return Explanation("mx_quantize", n_g + n_s + n_c, 1 + expected.scales.numel() + ec.numel(),
                       first_c[0] if first_c else None, lines, anchor)


class MXQuantizeHandler:
    op = "mx_quantize"

    def run(self, engine: Any, args: tuple, kwargs: dict, got: Any = None, limit: int = DEFAULT_LIMIT) -> Explanation:
        from fp8rl.reference import microscaling as mx

        x = args[0] if args else kwargs["x"]
        recipe = args[1] if len(args) > 1 else kwargs["recipe"]
        got = engine.mx_quantize(x, recipe) if got is None else got
        policy = engine.mx_policy(recipe)
        return explain_mx_quantize(x, recipe, policy, got, mx.mx_quantize(x, policy), limit=limit)

    def declared(self, engine: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        import dataclasses

        recipe = args[1] if len(args) > 1 else kwargs["recipe"]
        return {"mx_policy": dataclasses.asdict(engine.mx_policy(recipe))}

    def candidates(self, args: tuple, kwargs: dict, ex: Explanation) -> list[Candidate]:
        x = args[0] if args else kwargs["x"]
        recipe = args[1] if len(args) > 1 else kwargs["recipe"]
        if ex.anchor is None or x.dim() < 1:
            return []
        bi, B = tuple(ex.anchor[0]), int(ex.anchor[1])
        lead = bi[:-1]
        k0 = bi[-1] * B
        k1 = min(k0 + B, int(x.shape[-1]))
        row = x.detach()[lead] if lead else x.detach()
        shape = tuple(x.shape)
        where = ", ".join(str(i) for i in lead)
        return [Candidate((row[k0:k1].reshape(1, -1).contiguous(), recipe), {},  # NVFP4: g from this block alone
                          f"block {_ix(bi)} = x[{where + ', ' if where else ''}{k0}:{k1}] of the original {shape} x "
                          f"alone, as a (1, {k1 - k0}) tensor"),
                Candidate((row.reshape(1, -1).contiguous(), recipe), {},
                          f"row {_ix(lead)} of the original {shape} x (every block of it), as a (1, {shape[-1]}) tensor")]


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
HANDLERS: dict[str, Any] = {h.op: h for h in (QuantizeHandler(), CastHandler(), KVStoreHandler(), CorrectionHandler(),
                                              BlockGemmHandler(), KVAttentionHandler(), CorrectionLossHandler(),
                                              WeightSyncHandler(), MXQuantizeHandler())}


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


__all__ = ["Candidate", "DEFAULT_LIMIT", "Explanation", "HANDLERS", "correction_loss_oracle", "engine_correction_loss",
           "explain_block_gemm", "explain_cast", "explain_correction_loss", "explain_kv_attention", "explain_kv_store", "explain_mx_quantize",
           "explain_quantize", "explain_raises", "explain_rollout_correction", "explain_weight_sync", "gemm_oracle",
           "handler_for", "kv_attention_oracle", "run_check", "weight_sync_oracle"]
