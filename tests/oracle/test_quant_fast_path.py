"""The oracle's fast quantizer equals its definition bit for bit.

:func:`fp8rl.reference.quant_plain.quantize_plain` is the definition (whole-tensor torch steps, the bit-level
encoder); :func:`fp8rl.reference.quant.quantize` is its fast path (fp32 amax and quotients strip by strip in numpy on
threads, the table encoder). Here both run on the same inputs and must agree exactly:

* amax (``compute_amax`` vs ``compute_amax_plain``) and scales: the same fp32 bits, any NaN equal to any NaN;
* codes: the same bytes (-0 and +0 distinct), with one freedom: the code of a NaN element is a NaN code of either
  sign. The signs differ only where both factors of x·R(1/s) or x·m are NaN (a NaN element in a group whose
  reciprocal or multiplier is NaN): IEEE 754 does not say which operand's NaN a product carries, and on x86 torch's
  CPU multiply returns the second's, numpy's the first's.

Inputs: every class of the quantize input space (``fp8rl.inputspace.MODEL["quantize"]``, built by the conformance
SPACE check's ``tensor_of_class``) × every granularity kind × every preset (each distinct pipeline per case; the
presets that share one rotate across cases, so each preset runs at least once per kind), the strips shrunk so that
these inputs cross many strip, thread and table-chunk boundaries; hypothesis-drawn small tensors of subnormals, ±max,
±inf, NaN, ties and all-zero groups over every preset moved to every element format; the edge shapes of the fast
path's introduction; and a weight-sized input at the production strip size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from unittest import mock

import numpy as np
import pytest
import torch
from fp8rl.conformance._space import tensor_of_class
from fp8rl.inputspace import MODEL
from fp8rl.reference import formats as F
from fp8rl.reference import quant as Q
from fp8rl.reference.formats import ELEMENT_FORMATS, get_format
from fp8rl.reference.presets import PRESETS, get_policy
from fp8rl.reference.quant import GRANULARITY_KINDS, Granularity, compute_amax, quantize
from fp8rl.reference.quant_plain import compute_amax_plain, quantize_plain
from fp8rl.strategies import (
    block_shapes,
    blocks_with_zero_block,
    fp8_edge_values,
    fp32_near_fp8,
    granularities,
    scale_policies,
    tensors,
)
from hypothesis import given
from hypothesis import strategies as st

# ---------------------------------------------------------------------------------------------------------------
# comparison


def _f32_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype fp32 and bits; any NaN equals any NaN (payloads are not part of the definition)."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(na, nb) and torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32)))


def _is_nan_code(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    return torch.from_numpy(np.isnan(F.decode_codes(codes.numpy(), fmt)))


@contextlib.contextmanager
def _one_torch_thread():
    """torch's intra-op threads off while the definition runs: its result doesn't depend on them (elementwise ops
    and max are exact per element), and on a loaded 2-core machine waking them costs more than these small ops."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def assert_amax_equal(x: torch.Tensor, g: Granularity, context: str) -> None:
    """compute_amax (strips, threads) == compute_amax_plain, bit for bit (NaN == NaN)."""
    fast = compute_amax(x, g)
    with _one_torch_thread():
        assert _f32_same(fast, compute_amax_plain(x, g)), f"{context} {g.label}: amax differs"


def assert_fast_equals_plain(x: torch.Tensor, g: Granularity, policy, context: str) -> None:
    """quantize(x) == quantize_plain(x): scales bit for bit (NaN == NaN), codes byte for byte except NaN codes
    of NaN elements (module docstring)."""
    with np.errstate(all="ignore"):
        fast = quantize(x, g, policy)  # on torch.get_num_threads() threads
    with _one_torch_thread(), np.errstate(all="ignore"):
        plain = quantize_plain(x, g, policy)
        where = f"{context} {g.label} {policy.name} (fmt={policy.fmt}, overflow={policy.overflow}, clamp={policy.clamp})"
        s_fast, s_plain = fast.scale.flatten(), plain.scale.flatten()
        assert _f32_same(fast.scale, plain.scale), (
            f"{where}: scales differ: fast {s_fast[:4].tolist()}, plain {s_plain[:4].tolist()}")
        assert fast.codes.dtype == plain.codes.dtype == torch.uint8 and fast.codes.shape == plain.codes.shape, where
        differ = fast.codes != plain.codes
        if not bool(differ.any()):
            return
        free = torch.isnan(x.float()) & _is_nan_code(fast.codes, policy.fmt) & _is_nan_code(plain.codes, policy.fmt)
        bad = differ & ~free
        idx = [tuple(i) for i in torch.nonzero(bad)[:4].tolist()]
        assert not bool(bad.any()), (
            f"{where}: {int(bad.sum())} codes differ, e.g. at {idx}: x {[x.float()[i].item() for i in idx]}, "
            f"fast {[hex(fast.codes[i].item()) for i in idx]}, plain {[hex(plain.codes[i].item()) for i in idx]}")


@contextlib.contextmanager
def _small_strips(strip_elems: int, lut_chunk: int = 1000):
    """Shrink the fast path's strip (and the table encoder's chunk) so that small inputs cross many strip, thread and
    chunk boundaries."""
    with mock.patch.object(Q, "_STRIP_ELEMS", strip_elems), mock.patch.object(F, "_LUT_CHUNK", lut_chunk):
        yield


# ---------------------------------------------------------------------------------------------------------------
# every class of the quantize input space × kind × preset

#: the usual granularity of each kind (the conformance SPACE check's), and the other sizes of the arg.* classes
KINDS = {"tensor": Granularity.tensor(), "token": Granularity.token(), "channel": Granularity.channel(),
         "group": Granularity.group(128), "block": Granularity.block(128)}
assert tuple(KINDS) == GRANULARITY_KINDS
_OTHER = {"arg.group_size=other": Granularity.group(64), "arg.block_size=other": Granularity.block((128, 64))}
#: kinds that take any rank (they act on the last dim); channel and block are 2-D only
_ND_KINDS = ("tensor", "token", "group")


def _preset_groups() -> list[list[str]]:
    """Presets grouped by pipeline (every field but the name and description), each group sorted."""
    groups: dict[tuple, list[str]] = {}
    for name, policy in sorted(PRESETS.items()):
        key = tuple(getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name not in ("name", "description"))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


PRESET_GROUPS = _preset_groups()


def _space_cases() -> list[tuple[str, str, tuple[str, ...]]]:
    """(kind, class, presets): each class with each kind that takes it (an ``arg.*`` class with its own kind), and
    one preset per distinct pipeline — the i-th case of a kind takes the (i mod n)-th of a group of n identical ones."""
    cases = []
    count = dict.fromkeys(KINDS, 0)
    for cls in MODEL["quantize"].classes():
        for kind in KINDS:
            if cls.startswith("rank.") and cls != "rank.x=2d" and kind not in _ND_KINDS:
                continue
            if cls.startswith("arg.") and not (cls == f"arg.kind={kind}" or cls.startswith(f"arg.{kind}_size=")):
                continue
            i = count[kind]
            count[kind] += 1
            cases.append((kind, cls, tuple(grp[i % len(grp)] for grp in PRESET_GROUPS)))
    return cases


SPACE_CASES = _space_cases()


def test_space_cases_cover_every_class_kind_and_preset_exact():
    """Every class of the quantize model is a case, every kind has every preset, every preset's pipeline runs."""
    assert {cls for _, cls, _ in SPACE_CASES} == set(MODEL["quantize"].classes())
    for kind in KINDS:
        assert {n for k, _, names in SPACE_CASES if k == kind for n in names} == set(PRESETS), kind


@pytest.mark.parametrize(("kind", "cls", "names"), SPACE_CASES, ids=[f"{k}-{c}" for k, c, _ in SPACE_CASES])
def test_quantize_equals_plain_on_input_space_exact(kind, cls, names):
    """The conformance SPACE input of ``cls`` (fp32/bf16/fp16; contiguous, transposed, sliced, strided; 1-D, 2-D,
    3-D; sizes below, at, above the tiles and ragged; NaN, ±inf, -0, subnormals, ±FLT_MAX; group 64, block 128×64),
    quantized with ``kind`` under every preset: amax, scales and codes equal the definition's. Strips of 2^10
    elements and table chunks of 1000 make these inputs span several strips, threads and chunks."""
    g = _OTHER.get(cls, KINDS[kind])
    rng = np.random.default_rng(zlib.crc32(f"{kind}-{cls}".encode()))
    x = tensor_of_class(cls, rng, rows=(160 if kind == "block" and not cls.startswith("size.") else None))
    with _small_strips(1 << 10):
        assert_amax_equal(x, g, cls)
        for name in names:
            assert_fast_equals_plain(x, g, PRESETS[name], f"{cls} {tuple(x.shape)} {x.dtype}")


# ---------------------------------------------------------------------------------------------------------------
# hypothesis: drawn edge values, all-zero groups, every preset moved to every element format

_F32 = np.finfo(np.float32)
#: fp32 subnormals (and ±0 and ±tiny at the ends)
_SUBNORMALS = st.floats(-float(_F32.tiny), float(_F32.tiny), width=32, allow_subnormal=True)
#: ±FLT_MAX, ±tiny, ±the smallest subnormal, ±inf, ±NaN (a NaN with the sign bit set, too), ±0, the formats' maxima
_SPECIALS = st.sampled_from([float(_F32.max), -float(_F32.max), float(_F32.tiny), -float(_F32.tiny),
                             float(_F32.smallest_subnormal), -float(_F32.smallest_subnormal), math.inf, -math.inf,
                             math.nan, -math.nan, 0.0, -0.0, 448.0, -448.0, 57344.0, -57344.0, 240.0, -240.0])
ELEMENTS = st.one_of(fp32_near_fp8("e4m3fn", allow_nan=True, allow_inf=True),
                     fp8_edge_values("e5m2", allow_nan=True, allow_inf=True, target_max=224.0),
                     _SUBNORMALS, _SPECIALS)
#: whole-tensor magnitudes: groups whose scale underflows, sits at the eps floor, or overflows
MAGNITUDES = st.sampled_from([1.0, 2.0 ** -140, 2.0 ** -120, 2.0 ** -40, 2.0 ** 20, 2.0 ** 100])
SHAPES = block_shapes((8, 16), max_row_blocks=2, max_col_blocks=3, huge_k_blocks=8)


@st.composite
def policies(draw):
    """A preset moved to a drawn element format (``scale_policies``), with a drawn overflow policy and clamp."""
    fmt = draw(st.sampled_from(ELEMENT_FORMATS))
    policy = draw(scale_policies(fmt))
    overflow = draw(st.sampled_from(get_format(fmt).allowed_overflow()))
    return dataclasses.replace(policy, overflow=overflow, clamp=draw(st.booleans()))


@st.composite
def inputs(draw, zero_group: bool):
    """(x, g): a small 2-D tensor of ELEMENTS at a drawn magnitude (with at least one all-zero group when
    ``zero_group``), as fp32, bf16 or fp16, reshaped to 1-D or 3-D for the kinds that take them."""
    g = draw(granularities())
    x = draw(blocks_with_zero_block(g, SHAPES, ELEMENTS) if zero_group else tensors(SHAPES, ELEMENTS))
    x = (x * draw(MAGNITUDES)).to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))
    rank = draw(st.sampled_from(["2d", "1d", "3d"])) if g.kind in _ND_KINDS else "2d"
    if rank == "1d":
        x = x[0]
    elif rank == "3d" and x.shape[0] % 2 == 0:
        x = x.reshape(2, x.shape[0] // 2, x.shape[1])
    return x, g


@given(case=inputs(zero_group=False), policy=policies(), strip=st.sampled_from([16, 100, 1 << 17]))
def test_quantize_equals_plain_on_drawn_edge_values_exact(case, policy, strip):
    """Drawn tensors of subnormals, ±FLT_MAX, ±FP8 max and their neighbours, ties, ±inf, ±NaN, ±0 at drawn
    magnitudes, with every preset on every element format, overflow policy and clamp, at small and production strip
    sizes: the fast path equals the definition."""
    x, g = case
    with _small_strips(strip, lut_chunk=7):
        assert_amax_equal(x, g, f"{tuple(x.shape)} {x.dtype}")
        assert_fast_equals_plain(x, g, policy, f"{tuple(x.shape)} {x.dtype}")


@given(case=inputs(zero_group=True), policy=policies())
def test_quantize_equals_plain_with_all_zero_groups_exact(case, policy):
    """Tensors with all-zero (+0 or -0) groups and blocks — the zero-amax rule of every preset: the fast path equals
    the definition (and a -0 element keeps its sign code wherever the format has one)."""
    x, g = case
    with _small_strips(16, lut_chunk=7):
        assert_fast_equals_plain(x, g, policy, f"{tuple(x.shape)} {x.dtype}")


# ---------------------------------------------------------------------------------------------------------------
# the edge shapes of the fast path's introduction, and the production strip size


def _spiked(shape, scale: float, seed: int) -> torch.Tensor:
    """Gaussian values with NaN, ±inf, -0, an fp32 subnormal, -3e38, 448 and 464 spread over the tensor."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    flat = x.view(-1)
    n = flat.numel()
    for i, v in enumerate((math.nan, math.inf, -math.inf, -0.0, 1e-40, -3e38, 448.0, 464.0)):
        if n > 4 * i + 3:
            flat[(4 * i + 3) * n // 37] = v
    return x


def _edge_shape_cases():
    grans = [Granularity.tensor(), Granularity.token(), Granularity.channel(), Granularity.group(128),
             Granularity.group(48), Granularity.block(128), Granularity.block((64, 32))]
    cases = [(shape, 3.0, gr) for shape in ((256, 256), (150, 260), (7, 130), (1, 5)) for gr in grans]
    cases += [(shape, 0.5, gr) for shape in ((2, 3, 200), (5000,))
              for gr in (Granularity.tensor(), Granularity.token(), Granularity.group(128), Granularity.group(48))]
    return cases


EDGE_SHAPE_CASES = _edge_shape_cases()


def _covering_presets() -> list[str]:
    """A few presets that together take every value each ScalePolicy field takes in PRESETS (greedy set cover)."""
    fields = [f.name for f in dataclasses.fields(PRESETS["reference"]) if f.name not in ("name", "description")]
    pairs = {n: {(f, getattr(p, f)) for f in fields} for n, p in PRESETS.items()}
    need = set().union(*pairs.values())
    chosen: list[str] = []
    while need:
        best = max(sorted(PRESETS), key=lambda n: len(pairs[n] & need))
        chosen.append(best)
        need -= pairs[best]
    return chosen


COVERING_PRESETS = _covering_presets()


@pytest.mark.parametrize(("shape", "spread", "g"), EDGE_SHAPE_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{g.label}" for s, _, g in EDGE_SHAPE_CASES])
def test_quantize_equals_plain_on_edge_shapes_exact(shape, spread, g):
    """Shapes spanning many strips per block row (strips of 4096 elements), uneven edges, 1-D and 3-D tensors, an
    all-zero block, special values, under presets that together take every value of every policy field."""
    x = _spiked(shape, spread, 20261201)
    if shape == (256, 256):
        x[128:256, 0:128] = 0.0  # an all-zero block (and groups and rows that are partly zero)
    with _small_strips(1 << 12):
        assert_amax_equal(x, g, str(shape))
        for name in COVERING_PRESETS:
            assert_fast_equals_plain(x, g, PRESETS[name], str(shape))


def test_quantize_equals_plain_at_production_strips_exact():
    """A weight-sized input (512×4096, four strips per 128-row block, split across threads) at the production strip
    and chunk sizes, block 128 under the default and the veRL torch presets (what ``python -m fp8rl.perf.suite_speed``
    times) and group 128 under the default: the fast path equals the definition end to end."""
    x = torch.randn(512, 4096, generator=torch.Generator().manual_seed(7)) * 0.02
    x[3, 5] = math.nan
    x[200, 300] = math.inf
    x[300:301, 0:128] = -0.0
    for g, names in ((Granularity.block(128), ("reference", "verl_torch")), (Granularity.group(128), ("reference",))):
        assert_amax_equal(x, g, "512x4096")
        for name in names:
            assert_fast_equals_plain(x, g, get_policy(name), "512x4096")


def test_nan_times_nan_sign_is_the_only_freedom_exact():
    """Where the two paths may differ, found by this suite: a NaN element of a group whose amax is NaN, under a
    floored policy that multiplies (vllm_native: s = max(NaN, eps) is torch's all-ones NaN 0xFFFFFFFF, so R(1/s)
    is a negative NaN). On x86 the fast path's numpy x·R(1/s) keeps x's +NaN (code 0x7F) and the definition's torch
    multiply the operand's -NaN (0xFF). Both are NaN codes; every other code is the same byte. Dividing policies
    keep x's NaN on both paths."""
    x = torch.tensor([[1.0, math.nan, -2.0, 0.5]])
    g = Granularity.token()
    for name in ("vllm_native", "reference"):
        policy = PRESETS[name]
        fast, plain = quantize(x, g, policy), quantize_plain(x, g, policy)
        assert _f32_same(fast.scale, plain.scale) and bool(torch.isnan(fast.scale).all())
        assert torch.equal(fast.codes[:, [0, 2, 3]], plain.codes[:, [0, 2, 3]])
        assert bool(_is_nan_code(fast.codes, policy.fmt)[0, 1]) and bool(_is_nan_code(plain.codes, policy.fmt)[0, 1])
        if policy.quant_op == "div":
            assert torch.equal(fast.codes, plain.codes)
        assert_fast_equals_plain(x, g, policy, "nan row")
