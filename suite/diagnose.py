"""Diagnosis on mismatch: what an engine's quantize() output matches when it is not the declared policy's.

When a bit-exact quantization check fails, :func:`diagnose_quantize` tries, on the failing input, every preset of
the declared element format (:data:`fp8rl.reference.presets.PRESETS`) and every single-field variant of the
declared :class:`~fp8rl.reference.policy.ScalePolicy` (:func:`policy_variants`: a few eps values, every value of
each mode tuple of :mod:`fp8rl.reference.policy`, a few target maxima), and says in one paragraph which of them
reproduce the engine's codes and scales bit for bit — or, failing that, which come closest (scales equal, fewest
codes still differing), or that none explains the output.

The search is bounded: on a large input it runs on a crop (:func:`crop_to_mismatch`: the first few rows, groups or
blocks where the engine and the declared policy disagree; for a per-tensor scale, differing elements and the one
that gives the amax), and only the candidates that match or come closest there are rerun on the whole input, whose
counts the text reports.

Needs only torch, numpy and :mod:`fp8rl.reference`.
"""

from __future__ import annotations

from dataclasses import fields, replace
from functools import cache

import numpy as np
import torch
from fp8rl.reference.formats import OVERFLOW_POLICIES, decode_codes, get_format
from fp8rl.reference.policy import (
    COMPUTE_DTYPES,
    FLOOR_MODES,
    FLOOR_ORDERS,
    MULTIPLIER_OPS,
    MULTIPLIER_OVERFLOWS,
    POW2_MODES,
    QUANT_OPS,
    SCALE_OPS,
    ZERO_AMAX_MODES,
    ScalePolicy,
)
from fp8rl.reference.presets import PRESETS, VLLM_MIN_SCALE, get_policy
from fp8rl.reference.quant import Granularity, quantize

__all__ = ["EPS_VALUES", "TARGET_MAXES", "changed_fields", "count_mismatches", "crop_to_mismatch",
           "diagnose_quantize", "numerics_key", "policy_variants", "preset_candidates"]

#: eps values tried as variants, with a name where the value is a known constant
EPS_VALUES: dict[float, str] = {
    0.0: "", 1e-12: "", 1e-10: "", 1e-8: "", 1e-6: "", 1e-4: "", VLLM_MIN_SCALE: "1/(448·512)",
    float(torch.finfo(torch.float32).eps): "fp32 eps", float(torch.finfo(torch.bfloat16).eps): "bf16 eps",
    float(torch.finfo(torch.float16).eps): "fp16 eps",
}
#: target maxima tried as variants (besides the format's own max finite value); invalid ones are skipped
TARGET_MAXES: tuple[float | None, ...] = (None, 224.0, 240.0, 448.0, 57344.0)

#: inputs up to this many elements are diagnosed whole; larger ones on a crop (:func:`crop_to_mismatch`)
_CROP_ABOVE = 16384
#: at most this many candidate numerics are rerun on the whole input (exact matches, then the closest)
_VERIFY_MAX = 8
_CLOSEST_MAX = 3
_ALSO_MAX = 5


def numerics_key(policy: ScalePolicy) -> tuple:
    """Every numerical field of ``policy`` (all but ``name`` and ``description``), ``target_max`` as the value T it
    gives: two policies with equal keys quantize every input identically."""
    return tuple(policy.max_value if f.name == "target_max" else getattr(policy, f.name)
                 for f in fields(policy) if f.name not in ("name", "description"))


def _field_names() -> list[str]:
    return [f.name for f in fields(ScalePolicy) if f.name not in ("name", "description")]


def changed_fields(declared: ScalePolicy, policy: ScalePolicy) -> list[str]:
    """The fields where ``policy`` differs from ``declared``, as ``field=value`` (``target_max`` compared by the T it
    gives), e.g. ``["eps=1e-12", "quant_op='mul_recip'"]``."""
    out = []
    for name, a, b in zip(_field_names(), numerics_key(declared), numerics_key(policy)):
        if a != b:
            out.append(f"{name}={getattr(policy, name)!r}")
    return out


def _variant_values(declared: ScalePolicy) -> dict[str, tuple]:
    """field → the values tried for it by :func:`policy_variants`."""
    t_max = tuple(dict.fromkeys((*TARGET_MAXES, declared.format.max_finite)))
    return {
        "eps": tuple(EPS_VALUES), "floor": FLOOR_MODES, "pow2": POW2_MODES, "floor_order": FLOOR_ORDERS,
        "scale_op": SCALE_OPS, "quant_op": QUANT_OPS, "multiplier_op": MULTIPLIER_OPS,
        "multiplier_overflow": MULTIPLIER_OVERFLOWS, "clamp": (True, False), "zero_amax": ZERO_AMAX_MODES,
        "compute_dtype": COMPUTE_DTYPES, "target_max": t_max, "overflow": OVERFLOW_POLICIES,
    }


def _variant_label(name: str, value) -> str:
    label = f"{name}={value!r}"
    note = EPS_VALUES.get(value, "") if name == "eps" else ""
    return f"{label} ({note})" if note else label


def policy_variants(declared: ScalePolicy) -> list[tuple[str, ScalePolicy]]:
    """Single-field variants of ``declared``: (label ``field=value``, policy) for each field and each value tried
    (:data:`EPS_VALUES`, every value of the mode tuples of :mod:`fp8rl.reference.policy`, clamp on/off,
    :data:`TARGET_MAXES` and the format's max finite, every overflow policy). Values equal to the declared one, and
    combinations ScalePolicy rejects (ValueError), are left out; so are variants whose numerics repeat an earlier
    one's or the declared policy's (e.g. target_max None and 448 for e4m3fn)."""
    declared = get_policy(declared)
    seen = {numerics_key(declared)}
    out: list[tuple[str, ScalePolicy]] = []
    for name, values in _variant_values(declared).items():
        for value in values:
            label = _variant_label(name, value)
            try:
                policy = replace(declared, name=f"{declared.name} with {label}", **{name: value})
            except ValueError:
                continue
            key = numerics_key(policy)
            if key in seen:
                continue
            seen.add(key)
            out.append((label, policy))
    return out


def preset_candidates(declared: ScalePolicy) -> list[tuple[str, ScalePolicy]]:
    """(preset name, policy) for every preset of :data:`~fp8rl.reference.presets.PRESETS` whose element format is
    the declared one's, except presets with the declared policy's numerics."""
    declared = get_policy(declared)
    key = numerics_key(declared)
    return [(name, p) for name, p in PRESETS.items() if p.fmt == declared.fmt and numerics_key(p) != key]


# ---------------------------------------------------------------------------------------------------------------
# comparing outputs


@cache
def _canonical_table(fmt: str) -> np.ndarray:
    """code → code, with every NaN code of ``fmt`` mapped to one NaN code (256 entries)."""
    codes = np.arange(256, dtype=np.uint8)
    nan = np.isnan(decode_codes(codes, fmt))
    return np.where(nan, codes[nan][0] if nan.any() else 0, codes).astype(np.uint8)


def _nan_canonical(codes: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 codes with every NaN code replaced by one code (NaN codes compare as equal codes)."""
    return _canonical_table(fmt)[codes]


def _code_diff(got: np.ndarray, want: np.ndarray, fmt: str) -> np.ndarray:
    """Elementwise: the codes differ (NaN codes equal)."""
    return _nan_canonical(got, fmt) != _nan_canonical(want, fmt)


def _scale_diff(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise: the scales differ (compared as values, NaN equal to NaN, as the checks compare them)."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    return ~((g == w) | (np.isnan(g) & np.isnan(w)))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def count_mismatches(got_codes: torch.Tensor, got_scale: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     fmt: str) -> tuple[int, int]:
    """(differing scales, differing codes) of an engine output against another quantization of the same input;
    NaN codes compare as equal codes, NaN scales as equal scales."""
    ns = int(_scale_diff(_np(got_scale), _np(scale)).sum())
    nc = int(_code_diff(_np(got_codes).astype(np.uint8), _np(codes).astype(np.uint8), fmt).sum())
    return ns, nc


# ---------------------------------------------------------------------------------------------------------------
# the crop


def _unit_size(g: Granularity) -> tuple[int, int]:
    """(rows, columns) of one independent unit of the 2-D view: a row (token, channel), a 1×G group or a Bm×Bn
    block."""
    if g.kind == "group":
        return 1, g.size[1]
    if g.kind == "block":
        return g.size
    return 1, 0  # 0: the whole row (token, channel)


def _units(mask: np.ndarray, ur: int, uc: int) -> np.ndarray:
    """An element mask (R, K) reduced to one flag per unit (ceil(R/ur), ceil(K/uc)); uc = 0: one unit per row."""
    r, k = mask.shape
    uc = uc or k
    pr, pc = -(-r // ur) * ur, -(-k // uc) * uc
    padded = np.zeros((pr, pc), dtype=bool)
    padded[:r, :k] = mask
    return np.asarray(padded.reshape(pr // ur, ur, pc // uc, uc).any(axis=(1, 3)))


def _span(units: np.ndarray, size: int, total: int) -> np.ndarray:
    """The element indices of the given units of ``size`` elements (the last unit may be short)."""
    return np.concatenate([np.arange(u * size, min((u + 1) * size, total)) for u in units]).astype(np.int64)


def _crop_tensor(x: torch.Tensor, got_codes: torch.Tensor, got_scale: torch.Tensor, ref_codes: torch.Tensor,
                 ref_scale: torch.Tensor, fmt: str, max_elems: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`crop_to_mismatch` for a per-tensor scale: a 1-D x' of the element that gives the amax (the first
    NaN, if any) and the first ``max_elems`` elements whose codes differ (all elements, if the scale differs)."""
    flat = x.reshape(-1)
    codes = got_codes.reshape(-1)
    if bool(_scale_diff(_np(got_scale), _np(ref_scale)).any()):
        idx = np.arange(min(max_elems, flat.numel()))
    else:
        idx = np.flatnonzero(_code_diff(_np(codes).astype(np.uint8), _np(ref_codes).reshape(-1).astype(np.uint8),
                                        fmt))[:max_elems]
    a = np.abs(_np(flat.float()))
    nan = np.isnan(a)
    top = int(np.flatnonzero(nan)[0]) if nan.any() else int(np.argmax(a))
    keep = torch.from_numpy(np.unique(np.append(idx, top)).astype(np.int64))
    return flat.index_select(0, keep).contiguous(), codes.index_select(0, keep).contiguous(), got_scale


def crop_to_mismatch(x: torch.Tensor, g: Granularity, got_codes: torch.Tensor, got_scale: torch.Tensor,
                     ref_codes: torch.Tensor, ref_scale: torch.Tensor, fmt: str, *, max_rows: int | None = None,
                     max_cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A small input that quantizes, unit for unit, as part of ``x`` does: (x', the engine's codes of x', its
    scales of x').

    ``x`` is viewed as 2-D (rows of the last dimension; blocks and channels are 2-D already). Kept: the first
    ``max_rows`` unit rows (rows; block rows for blocks) where the engine's output and the reference output
    (``ref_*``, the declared policy's) differ, and within them the first ``max_cols`` differing unit columns (1×G
    groups or block columns; whole rows otherwise) — units are independent, and a short edge unit stays last. A
    per-tensor scale depends on the amax alone, so its x' is 1-D: the element that gives the amax (its first NaN,
    if any) and the first ``max_cols``·512 (4096) differing elements.
    """
    if max_rows is None:
        max_rows = 1 if g.kind == "block" else 4
    if max_cols is None:
        max_cols = 2 if g.kind == "block" else 8
    if g.kind == "tensor":
        return _crop_tensor(x, got_codes, got_scale, ref_codes, ref_scale, fmt, max_cols * 512)
    ur, uc = _unit_size(g)
    x2 = x.reshape(-1, x.shape[-1])
    r, k = x2.shape
    codes2 = got_codes.reshape(r, k)
    diff = _units(_code_diff(_np(codes2).astype(np.uint8), _np(ref_codes).reshape(r, k).astype(np.uint8), fmt),
                  ur, uc)
    diff |= _scale_diff(_np(got_scale), _np(ref_scale)).reshape(diff.shape)
    if not diff.any():
        diff[:] = True
    rows = np.flatnonzero(diff.any(axis=1))[:max_rows]
    cols = np.flatnonzero(diff[rows].any(axis=0))[:max_cols] if uc else np.array([0])
    ri = torch.from_numpy(_span(rows, ur, r))
    ci = torch.from_numpy(_span(cols, uc or k, k))
    xc = x2.index_select(0, ri).index_select(1, ci).contiguous()
    cc = codes2.index_select(0, ri).index_select(1, ci).contiguous()
    if uc:
        s2 = got_scale.reshape(diff.shape)
        sc = s2.index_select(0, torch.from_numpy(rows)).index_select(1, torch.from_numpy(cols)).contiguous()
    else:
        sc = got_scale.reshape(-1, 1).index_select(0, torch.from_numpy(rows)).contiguous()
    return xc, cc, sc


# ---------------------------------------------------------------------------------------------------------------
# the diagnosis


class _Group:
    """Candidates with one numerics: preset names and/or a variant label, one policy, its counts on the crop."""

    def __init__(self, policy: ScalePolicy, distance: int, order: int) -> None:
        self.policy = policy
        self.distance = distance
        self.order = order
        self.presets: list[str] = []
        self.variant: str | None = None
        self.crop: tuple[int, int] = (0, 0)
        self.full: tuple[int, int] | None = None

    def has_preset(self) -> bool:
        return bool(self.presets)

    def name(self) -> str:
        """``preset 'a'`` / ``presets 'a', 'b'`` and/or ``the declared policy with f=v``."""
        parts = []
        if self.presets:
            quoted = ", ".join(f"'{p}'" for p in self.presets)
            parts.append(("preset " if len(self.presets) == 1 else "presets ") + quoted)
        if self.variant:
            parts.append(f"the declared policy with {self.variant}")
        return parts[0] + (f" (= {parts[1]})" if len(parts) > 1 else "")

    def short(self) -> str:
        """The variant label, else ``preset 'a'`` (for the closest-candidates list)."""
        if self.variant:
            return self.variant
        return ("preset " if len(self.presets) == 1 else "presets ") + ", ".join(f"'{p}'" for p in self.presets)


def _candidates(declared: ScalePolicy) -> list[_Group]:
    """Every preset of the declared format and every single-field variant, grouped by numerics."""
    groups: dict[tuple, _Group] = {}
    order = 0
    items = [(n, p, True) for n, p in preset_candidates(declared)]
    items += [(label, p, False) for label, p in policy_variants(declared)]
    for label, policy, is_preset in items:
        key = numerics_key(policy)
        grp = groups.get(key)
        if grp is None:
            grp = groups[key] = _Group(policy, len(changed_fields(declared, policy)), order)
            order += 1
        if is_preset:
            grp.presets.append(label)
        elif grp.variant is None:
            grp.variant = label
    return list(groups.values())


def _evaluate(x: torch.Tensor, g: Granularity, policy: ScalePolicy, codes: torch.Tensor,
              scale: torch.Tensor) -> tuple[int, int] | None:
    """(differing scales, differing codes) of the engine output against ``policy``'s; None if the oracle rejects
    the policy for this input."""
    try:
        q = quantize(x, g, policy)
    except (ValueError, TypeError):
        return None
    return count_mismatches(codes, scale, q.codes, q.scale, policy.fmt)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _changes_note(declared: ScalePolicy, grp: _Group) -> str:
    """`` (eps=1e-12, quant_op='mul_recip')``: a preset's changed fields (none for a variant, whose label says it)."""
    if grp.variant:
        return ""
    changes = changed_fields(declared, grp.policy)
    return " (" + ", ".join(changes[:3]) + (", …" if len(changes) > 3 else "") + ")"


def _exact_text(declared: ScalePolicy, exact: list[_Group]) -> str:
    best = exact[0]
    differs = ""
    if not best.variant:
        changes = changed_fields(declared, best.policy)
        differs = "; differs in " + ", ".join(changes[:5]) + (", …" if len(changes) > 5 else "")
    if best.presets and best.variant:
        suggest = f"preset '{best.presets[0]}' or {best.variant}"
    else:
        suggest = best.variant if best.variant else f"preset '{best.presets[0]}'"
    text = (f"diagnosis: codes and scales match {best.name()} bit-exactly (declared '{declared.name}'{differs}): "
            f"declare {suggest}?")
    others = exact[1:]
    if others:
        listed = "; ".join(o.name() + _changes_note(declared, o) for o in others[:_ALSO_MAX])
        more = f"; and {len(others) - _ALSO_MAX} more" if len(others) > _ALSO_MAX else ""
        text += f" Also bit-exact on this input: {listed}{more}."
    return text


def _closest_text(declared: ScalePolicy, base: tuple[int, int], closest: list[_Group]) -> str:
    phrases = []
    for grp in closest:
        ns, nc = grp.full  # type: ignore[misc]
        if ns == 0:
            phrases.append(f"scales match with {grp.short()} ({_plural(nc, 'code')} still differ)")
        else:
            phrases.append(f"{grp.short()} leaves {_plural(ns, 'scale')} and {_plural(nc, 'code')} differing")
    return (f"diagnosis: no preset or single-field variant of the declared policy '{declared.name}' matches both "
            f"codes and scales; closest: {'; '.join(phrases)} (declared: {_plural(base[0], 'scale')} and "
            f"{_plural(base[1], 'code')} differ).")


def diagnose_quantize(x: torch.Tensor, granularity: Granularity, got_codes: torch.Tensor, got_scale: torch.Tensor,
                      declared: ScalePolicy) -> str:
    """One paragraph saying what an engine's quantize() output of ``x`` (``got_codes``, ``got_scale``) matches
    when it is not the declared policy's output.

    Candidates: the presets of the declared format and the single-field variants of ``declared``
    (:func:`preset_candidates`, :func:`policy_variants`), grouped by numerics. Those whose scales and codes equal
    the engine's bit for bit (NaN codes equal) on the whole input are named, nearest to the declared policy (fewest
    changed fields) first: ``diagnosis: codes and scales match preset 'p' bit-exactly (declared 'd'; differs in
    …): declare preset 'p'?`` or ``… match the declared policy with compute_dtype='input' bit-exactly (declared
    'd'): declare compute_dtype='input'?``. Failing that, the candidates that come closer than the declared policy
    (scales equal and fewer codes differing, or fewer scales differing), with their counts on the whole input;
    failing that, ``diagnosis: no preset or single-field variant of the declared policy explains the output``.
    """
    declared = get_policy(declared)
    g = granularity
    x = x.detach().cpu().contiguous()
    got_codes = got_codes.detach().cpu()
    got_scale = got_scale.detach().cpu()
    if tuple(got_codes.shape) != tuple(x.shape) or tuple(got_scale.shape) != g.scale_shape(tuple(x.shape)):
        return (f"diagnosis: not attempted (codes of shape {tuple(got_codes.shape)} and scales of shape "
                f"{tuple(got_scale.shape)} for an input of shape {tuple(x.shape)})")
    fmt = declared.fmt
    ref = quantize(x, g, declared)
    base = count_mismatches(got_codes, got_scale, ref.codes, ref.scale, fmt)
    if base == (0, 0):
        return (f"diagnosis: on this input the output equals what the declared policy '{declared.name}' gives "
                "(codes and scales; NaN codes compared as equal)")
    cropped = x.numel() > _CROP_ABOVE
    if cropped:
        xc, cc, sc = crop_to_mismatch(x, g, got_codes, got_scale, ref.codes, ref.scale, fmt)
        refc = quantize(xc, g, declared)
        base_c = count_mismatches(cc, sc, refc.codes, refc.scale, fmt)
        cropped = xc.numel() < x.numel()
    else:
        xc, cc, sc, base_c = x, got_codes, got_scale, base

    groups = []
    for grp in _candidates(declared):
        counts = _evaluate(xc, g, grp.policy, cc, sc)
        if counts is None:
            continue
        grp.crop = counts
        groups.append(grp)

    def rank(grp: _Group) -> tuple:
        return grp.distance, not grp.has_preset(), grp.order

    exact = sorted((grp for grp in groups if grp.crop == (0, 0)), key=rank)
    verified = []
    for grp in exact[:_VERIFY_MAX]:
        grp.full = _evaluate(x, g, grp.policy, got_codes, got_scale) if cropped else grp.crop
        if grp.full == (0, 0):
            verified.append(grp)
    if verified:
        return _exact_text(declared, verified)

    # closer than the declared policy: fewer differing scales, or as few and fewer differing codes
    better = sorted((grp for grp in groups if (grp.crop < base_c and grp.crop != (0, 0)) or
                     (grp.full is not None and grp.full < base)),
                    key=lambda grp: (grp.crop, rank(grp)))
    closest = []
    for grp in better[:_VERIFY_MAX]:
        if grp.full is None:
            grp.full = _evaluate(x, g, grp.policy, got_codes, got_scale) if cropped else grp.crop
        if grp.full is not None and grp.full < base:
            closest.append(grp)
    closest.sort(key=lambda grp: (grp.full, rank(grp)))
    if closest:
        return _closest_text(declared, base, closest[:_CLOSEST_MAX])
    n_presets = sum(len(grp.presets) for grp in groups)
    n_variants = sum(grp.variant is not None for grp in groups)
    return (f"diagnosis: no preset or single-field variant of the declared policy explains the output (tried "
            f"{n_presets} presets of {get_format(fmt).name} and {n_variants} variants of '{declared.name}'; "
            f"declared: {_plural(base[0], 'scale')} and {_plural(base[1], 'code')} differ).")
