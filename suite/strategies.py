"""Hypothesis strategies for FP8-relevant inputs, and the suite's hypothesis profiles.

The values FP8 code gets wrong are the subject here, so every strategy draws them on purpose: subnormals, ±max,
±max ± one fp32 ulp, exact midpoints between adjacent codes (round-to-nearest-even ties), the overflow midpoint
(max + half an ulp), ±inf, NaN, ±0, all-zero groups and blocks, scales just above powers of two. Strategies that
could produce NaN/inf take explicit ``allow_nan``/``allow_inf`` flags; nothing here disables them globally.

All float strategies return Python floats that are exactly representable in fp32.

Profiles (:func:`register_profiles`): ``ci`` (derandomized, no database, no deadline, 25 examples, print_blob),
``dev`` (50 examples, no deadline), ``nightly`` (10× ci, randomized), ``mutants`` (like ci without the shrink
phase: a mutant only needs one failing example). :func:`load_profile_from_env` reads ``FP8RL_HYPOTHESIS_PROFILE``
(default ``ci`` when the ``CI`` environment variable is set, else ``dev``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from typing import cast

import numpy as np
import torch
from fp8rl.reference.formats import decode_codes, get_format
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import PRESETS
from fp8rl.reference.quant import GRANULARITY_KINDS, Granularity, GranularityKind, expand_scale
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

__all__ = [
    "CI_MAX_EXAMPLES", "PROFILE_ENV", "PROFILE_NAMES", "amax_near_pow2_boundaries", "block_shapes",
    "blocks_with_zero_block", "fp8_edge_values",
    "fp32_near_fp8", "granularities", "load_profile", "load_profile_from_env", "register_profiles",
    "scale_policies", "scales", "tensors",
]

PROFILE_ENV = "FP8RL_HYPOTHESIS_PROFILE"
PROFILE_NAMES: tuple[str, ...] = ("ci", "dev", "nightly", "mutants")

CI_MAX_EXAMPLES = 25

_f32 = np.float32


# ---------------------------------------------------------------------------------------------------------------
# Profiles


def register_profiles() -> None:
    """Register the ``ci``, ``dev``, ``nightly`` and ``mutants`` hypothesis profiles (idempotent)."""
    settings.register_profile("ci", derandomize=True, database=None, max_examples=CI_MAX_EXAMPLES, deadline=None,
                              print_blob=True)
    settings.register_profile("dev", max_examples=50, deadline=None)
    settings.register_profile("nightly", max_examples=10 * CI_MAX_EXAMPLES, deadline=None, print_blob=True)
    settings.register_profile("mutants", derandomize=True, database=None, max_examples=CI_MAX_EXAMPLES,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target], deadline=None,
                              print_blob=True)


def load_profile(name: str) -> str:
    """Register the profiles and load ``name`` (ValueError naming the known profiles)."""
    if name not in PROFILE_NAMES:
        raise ValueError(f"profile: unknown hypothesis profile {name!r}; expected one of {PROFILE_NAMES}")
    register_profiles()
    settings.load_profile(name)
    return name


def seed_profile(run_seed: int) -> None:
    """Make the loaded profile's examples a function of the run seed (``fp8rl conformance --seed N``): seed 0 of a
    derandomized profile (ci, mutants) keeps its fixed examples; any other seed, and every seed of a randomized
    profile (full, nightly), draws from the seed hypothesis is given with ``--hypothesis-seed`` (which
    ``fp8rl.runner.pytest_args`` passes), never from the example database, so a run is reproducible from its seed."""
    current = settings.default
    assert current is not None  # a profile is loaded (load_profile)
    if run_seed == 0 and current.derandomize:
        return
    settings.register_profile(f"_fp8rl_seeded_{run_seed}", parent=current, derandomize=False, database=None)
    settings.load_profile(f"_fp8rl_seeded_{run_seed}")


def load_profile_from_env(default: str | None = None) -> str:
    """Load the profile named by ``FP8RL_HYPOTHESIS_PROFILE``; otherwise ``default``, else ``ci`` when the ``CI``
    environment variable is set, else ``dev``. Returns the loaded name."""
    name = os.environ.get(PROFILE_ENV) or default or ("ci" if os.environ.get("CI") else "dev")
    return load_profile(name)


# ---------------------------------------------------------------------------------------------------------------
# Scalar values


@cache
def _positive_values(fmt: str) -> tuple[float, ...]:
    """Every finite positive value of ``fmt``, ascending."""
    v = decode_codes(np.arange(256), fmt)
    v = np.unique(v[np.isfinite(v) & (v > 0)])
    return tuple(float(x) for x in v)


def _next32(x: float, toward: float) -> float:
    return float(np.nextafter(_f32(x), _f32(toward)))


def _signed(values) -> list[float]:
    out = []
    for v in values:
        out += [v, -v]
    return out


@cache
def _midpoints(fmt: str) -> tuple[float, ...]:
    pos = _positive_values(fmt)
    f = get_format(fmt)
    mids = [0.5 * pos[0]]  # between 0 and the smallest subnormal: ties to 0
    mids += [0.5 * (lo + hi) for lo, hi in zip(pos[:-1], pos[1:])]
    top_ulp = pos[-1] - pos[-2]
    mids.append(pos[-1] + 0.5 * top_ulp)  # the overflow midpoint (464 for e4m3fn): RNE keeps max
    assert all(float(_f32(m)) == m for m in mids), f"{f.name}: midpoints must be fp32-exact"
    return tuple(mids)


@cache
def _edge_list(fmt: str, allow_nan: bool, allow_inf: bool, target_max: float | None) -> tuple[float, ...]:
    f = get_format(fmt)
    pos = _positive_values(fmt)
    mx = pos[-1]
    mids = _midpoints(fmt)
    sub_max = max((v for v in pos if v < f.min_normal), default=pos[0])
    base = [
        pos[0], 2 * pos[0], 1.5 * pos[0], 0.5 * pos[0], sub_max, f.min_normal, 0.5 * (sub_max + f.min_normal),
        mx, pos[-2], _next32(mx, np.inf), _next32(mx, 0.0), mids[-1], _next32(mids[-1], np.inf),
        _next32(mids[-1], 0.0), 2 * mx, float(np.finfo(np.float32).max), 1.0, 1.0625, 1.1875,
        float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).smallest_subnormal),
    ]
    if target_max is not None:
        t = float(target_max)
        base += [t, _next32(t, np.inf), _next32(t, 0.0)]
    vals = [0.0, -0.0] + _signed(base)
    if allow_inf:
        vals += [float("inf"), float("-inf")]
    if allow_nan:
        vals.append(float("nan"))
    assert all(float(_f32(v)) == v or v != v for v in vals)
    return tuple(vals)


def fp8_edge_values(fmt: str, *, allow_nan: bool = False, allow_inf: bool = False,
                    target_max: float | None = None) -> st.SearchStrategy[float]:
    """The edge cases of ``fmt``: ±0, smallest subnormal and its ties (½, 1½ of it), largest subnormal, smallest
    normal and the tie between them, ±max, the value below max, max ± 1 fp32 ulp, the overflow midpoint and its
    fp32 neighbours, 2·max, fp32 max and tiny values, the e4m3 ties 1.0625/1.1875, ``target_max`` and its
    neighbours; ±inf and NaN when allowed."""
    return st.sampled_from(_edge_list(get_format(fmt).name, allow_nan, allow_inf, target_max))


@cache
def _near_pool(fmt: str, cap: float) -> tuple[float, ...]:
    """fp32 values where FP8 rounding decides, |v| ≤ cap: FP8 values ±1 fp32 ulp, midpoints ±1/±2 fp32 ulps."""
    vals: set[float] = set()
    for v in _positive_values(fmt):
        vals.update((v, _next32(v, np.inf), _next32(v, 0.0)))
    for m in _midpoints(fmt):
        up1, dn1 = _next32(m, np.inf), _next32(m, 0.0)
        vals.update((m, up1, dn1, _next32(up1, np.inf), _next32(dn1, 0.0)))
    vals.update(v for v in _edge_list(fmt, False, False, None) if v > 0)
    pos = sorted(v for v in vals if 0 < v <= cap)
    return tuple([0.0, -0.0] + _signed(pos))


def fp32_near_fp8(fmt: str, *, allow_nan: bool = False, allow_inf: bool = False,
                  max_magnitude: float | None = None) -> st.SearchStrategy[float]:
    """fp32 values concentrated where FP8 rounding decides: exact FP8 values and their ±1 fp32-ulp neighbours,
    exact midpoints (ties) and their ±1/±2 fp32-ulp neighbours, the edge values of :func:`fp8_edge_values`, and
    plain fp32 floats in ±2·max (subnormals included). ``max_magnitude`` caps |value| (default: no cap beyond the
    edge values, which reach fp32 max)."""
    f = get_format(fmt)
    cap = float(max_magnitude) if max_magnitude is not None else float(np.finfo(np.float32).max)
    plain = min(cap, 2 * f.max_finite)
    parts = [st.sampled_from(_near_pool(f.name, cap)), st.floats(-plain, plain, width=32, allow_subnormal=True)]
    special = ([float("inf"), float("-inf")] if allow_inf else []) + ([float("nan")] if allow_nan else [])
    if special:
        parts.append(st.sampled_from(special))
    return st.one_of(parts)


def scales() -> st.SearchStrategy[float]:
    """Positive fp32 dequant scales: powers of two, one/two fp32 ulps either side of them (where pow2 rounding
    and log2 disagree), 0.75, 1.0000001, and plain positive floats in [2^-40, 2^40]."""
    pows = st.integers(-40, 40).map(lambda k: 2.0**k)
    near = st.builds(lambda p, k: float(np.nextafter(_f32(p), _f32(np.inf if k > 0 else 0))) if k else p,
                     pows, st.sampled_from([-1, 0, 1]))
    return st.one_of(pows, near, st.sampled_from([0.75, float(_f32(1.0000001)), 3.0, float(_f32(0.1))]),
                     st.floats(min_value=2.0**-40, max_value=2.0**40, width=32))


def amax_near_pow2_boundaries(target_max: float, *, k_range: tuple[int, int] = (-20, 10)) -> st.SearchStrategy[float]:
    """amax values T·2^k and their ±1, ±2 fp32-ulp neighbours: the amaxes whose scale amax/T sits on or next to a
    power of two (UE8M0 ceil/log2 edge, TE multiplier floor edge)."""
    def make(k: int, j: int) -> float:
        v = _f32(target_max * 2.0**k)
        for _ in range(abs(j)):
            v = np.nextafter(v, _f32(np.inf if j > 0 else 0))
        return float(v)

    return st.builds(make, st.integers(*k_range), st.integers(-2, 2))


# ---------------------------------------------------------------------------------------------------------------
# Tensors and shapes


@st.composite
def tensors(draw, shapes, elements: st.SearchStrategy[float] | None = None, *,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A torch tensor of ``dtype`` (fp32 values rounded to it) with shape drawn from ``shapes`` (a strategy or a
    fixed tuple) and elements from ``elements`` (default :func:`fp32_near_fp8` of e4m3fn, finite)."""
    shape = draw(shapes) if isinstance(shapes, st.SearchStrategy) else tuple(shapes)
    elems = elements if elements is not None else fp32_near_fp8("e4m3fn")
    arr = draw(hnp.arrays(np.float32, shape, elements=elems))
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).to(dtype)


@st.composite
def block_shapes(draw, block: int | tuple[int, int] = (8, 16), *, max_row_blocks: int = 3, max_col_blocks: int = 4,
                 huge_k_blocks: int = 32) -> tuple[int, int]:
    """2-D shapes (rows, cols) for a Bm×Bk block (or 1×Bk group) grid: divisible, non-divisible (ragged edge
    blocks), a single row, a single partial block, and huge K (one row, ``huge_k_blocks`` blocks plus a ragged
    tail). Keep the block small in CI: the cases exercised depend on the ratio, not the absolute size."""
    bm, bk = (block, block) if isinstance(block, int) else block
    kind = draw(st.sampled_from(["divisible", "ragged", "one_row", "partial", "huge_k"]))
    if kind == "divisible":
        return (bm * draw(st.integers(1, max_row_blocks)), bk * draw(st.integers(1, max_col_blocks)))
    if kind == "ragged":
        rows = bm * draw(st.integers(0, max_row_blocks - 1)) + draw(st.integers(1, bm))
        cols = bk * draw(st.integers(0, max_col_blocks - 1)) + draw(st.integers(1, bk))
        return (rows, cols)
    if kind == "one_row":
        return (1, bk * draw(st.integers(0, max_col_blocks - 1)) + draw(st.integers(1, bk)))
    if kind == "partial":
        return (draw(st.integers(1, bm)), draw(st.integers(1, bk)))
    return (1, bk * huge_k_blocks + draw(st.integers(0, bk - 1)))


def granularities(kinds: Sequence[GranularityKind] = cast("tuple[GranularityKind, ...]", GRANULARITY_KINDS), *,
                  group_sizes: Sequence[int] = (4, 8, 16), block_sizes: Sequence[int | tuple[int, int]] = (
                      4, (4, 8), (8, 4))) -> st.SearchStrategy[Granularity]:
    """Granularities of the given kinds with small (CI-sized) group and block sizes."""
    options: list[Granularity] = []
    for k in kinds:
        if k == "group":
            options += [Granularity.group(g) for g in group_sizes]
        elif k == "block":
            options += [Granularity.block(b) for b in block_sizes]
        else:
            options.append(Granularity(k))
    return st.sampled_from(options)


@st.composite
def blocks_with_zero_block(draw, g: Granularity, shapes, elements: st.SearchStrategy[float] | None = None, *,
                           negative_zero: bool | None = None) -> torch.Tensor:
    """A 2-D fp32 tensor (shape from ``shapes``) in which at least one group/block of ``g`` is all zero (+0, or -0
    when ``negative_zero``; drawn when None). With ``tensor`` granularity the whole tensor is zero."""
    x = draw(tensors(shapes, elements))
    shape = tuple(x.shape)
    ids = torch.arange(int(np.prod(g.scale_shape(shape)))).reshape(g.scale_shape(shape))
    id_map = expand_scale(ids, g, shape)
    n_groups = int(ids.numel())
    chosen = draw(st.sets(st.integers(0, n_groups - 1), min_size=1, max_size=min(n_groups, 3)))
    neg = draw(st.booleans()) if negative_zero is None else negative_zero
    zero = -0.0 if neg else 0.0
    mask = torch.zeros(shape, dtype=torch.bool)
    for c in chosen:
        mask |= id_map == c
    return torch.where(mask, torch.full_like(x, zero), x)


def scale_policies(fmt: str | None = None, *, names: Sequence[str] | None = None) -> st.SearchStrategy[ScalePolicy]:
    """Presets of :data:`fp8rl.reference.quant.PRESETS` (restricted to ``names``), moved to ``fmt`` if given."""
    chosen = sorted(PRESETS) if names is None else list(names)
    unknown = set(chosen) - set(PRESETS)
    if unknown:
        raise ValueError(f"names: unknown presets {sorted(unknown)}; expected a subset of {sorted(PRESETS)}")
    policies = [PRESETS[n] if fmt is None else PRESETS[n].for_format(fmt) for n in chosen]
    return st.sampled_from(policies)
