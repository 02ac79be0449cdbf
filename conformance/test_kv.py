"""Area ``kv``: FP8 KV cache (store/load), FP8 attention, Q/K/V scale calibration and per-step recalibration.

The engine declares its KV numerics per (format, scale layout) with ``kv_policy``; stored codes and scales must
then equal the oracle's (fp8rl.reference.kv) bit for bit. FP8 attention is compared with the oracle's FP8
attention on the same FP8 operands within the derived fp32-arithmetic bound, and with the unquantized attention
within the empirically justified κ × fresh-scale error. Calibration outputs must equal each strategy's formula.
The RL-specific checks simulate weight updates (fp8rl.reference.drift): after an update the engine must use the
new scales, a reset must recalibrate, a layer without scales must not silently run with 1.0, and per-step
recalibration must hold the drift bound at every step (the per-step table and plots go to the report).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from fp8rl import tolerances
from fp8rl.checks import (
    assert_codes_equal,
    assert_tensors_equal,
    assert_within_bound,
    check,
    record_metrics,
    record_section,
)
from fp8rl.engine import EngineError, Unsupported
from fp8rl.inputspace import with_layout, with_specials
from fp8rl.reference import drift
from fp8rl.reference import kv as kvref
from fp8rl.reference.formats import decode_codes, get_format
from hypothesis import given
from hypothesis import strategies as st

from . import _space as S
from ._inputs import cast_sweep, kv_tensor

FMTS = ("e4m3fn", "e5m2")
LAYOUTS = ("tensor", "head", "token_head")
FORMATS = pytest.mark.parametrize("fmt", FMTS)
ALL_LAYOUTS = pytest.mark.parametrize("layout", LAYOUTS)
STATIC_LAYOUTS = pytest.mark.parametrize("layout", ("tensor", "head"))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread (multi-threaded dispatch of tiny ops is far slower on a loaded CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------------------------
# inputs


def amax_scale(x: torch.Tensor, layout: str, fmt: str, factor: float = 1.0) -> torch.Tensor | None:
    """fl32(amax / max · factor) per tensor or per head; None for token_head (dynamic)."""
    fmax = get_format(fmt).max_finite
    if layout == "token_head":
        return None
    a = x.abs().amax() if layout == "tensor" else x.abs().amax(dim=tuple(i for i in range(x.dim()) if i != x.dim() - 2))
    return (a.double() * factor / fmax).float()


def oracle_store(engine, x: torch.Tensor, scale, fmt: str, layout: str) -> kvref.KVCache:
    return kvref.quantize_kv(x, scale, engine.kv_policy(fmt, layout))


def compare_cache(got: kvref.KVCache, expected: kvref.KVCache, x: torch.Tensor, context: str) -> None:
    """Scales and codes of a cache the engine wrote (validated by GuardedEngine) vs the oracle's."""
    assert_tensors_equal(got.scale.float(), expected.scale, context=f"{context}: scales")
    assert_codes_equal(_canonical_nan(got.codes, expected.fmt), _canonical_nan(expected.codes, expected.fmt),
                       expected.fmt, context=f"{context}: codes", inputs=x)


def _canonical_nan(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Every NaN code → the format's canonical NaN: a NaN input (or a NaN token scale) must store *a* NaN, but its
    sign/payload is not specified (IEEE leaves the sign of a computed NaN open; CUDA's convert drops it)."""
    nan = torch.from_numpy(np.isnan(decode_codes(codes.cpu(), fmt)))
    return torch.where(nan, torch.tensor(get_format(fmt).nan_code, dtype=torch.uint8), codes.cpu().to(torch.uint8))


def attention_case(rng: np.random.Generator, case: str, fmt: str, layout: str):
    """(q, k_cache, v_cache, q_scale, kwargs) built by the oracle; cache slots past kv_len hold random bytes."""
    cases = {  # B, Tq, Tk, Hq, Hkv, D, causal, q_lengths, kv_lengths
        "prefill-gqa": (2, 24, 24, 8, 2, 64, True, None, None),
        "varlen-causal": (3, 16, 40, 4, 2, 32, True, [16, 5, 1], [40, 21, 9]),
        "decode-mqa": (4, 1, 33, 4, 1, 64, True, [1, 1, 1, 0], [33, 7, 1, 0]),
        "noncausal-mha": (2, 12, 20, 2, 2, 16, False, [12, 3], [20, 4]),
    }
    b, tq, tk, hq, hkv, d, causal, ql, kl = cases[case]
    gain = float(rng.choice([0.5, 2.0]))
    q = torch.from_numpy(rng.standard_normal((b, tq, hq, d)).astype(np.float32) * gain)
    k = kv_tensor(rng, (b, tk, hkv, d), spread=2)
    v = kv_tensor(rng, (b, tk, hkv, d), spread=2)
    q_lengths = None if ql is None else torch.tensor(ql)
    kv_lengths = None if kl is None else torch.tensor(kl)
    pol = kvref.default_policy(fmt, layout)
    kc = kvref.quantize_kv(k, amax_scale(k, layout, fmt), pol)
    vc = kvref.quantize_kv(v, amax_scale(v, layout, fmt), pol)
    if kl is not None:  # garbage (NaN codes included) beyond each sequence's kv_len
        for cache in (kc, vc):
            for i, n in enumerate(kl):
                junk = rng.integers(0, 256, size=cache.codes[i, n:].shape).astype(np.uint8)
                cache.codes[i, n:] = torch.from_numpy(junk)
                if cache.layout == "token_head":
                    cache.scale[i, n:] = float("nan")
    q_scale = (q.abs().amax().double() / 448.0 * 1.37).float()  # deliberately ≠ 1 and not a power of two
    return q, kc, vc, q_scale, {"causal": causal, "q_lengths": q_lengths, "kv_lengths": kv_lengths}


# ----------------------------------------------------------------------------------------------------------------
# declared policy and store


@FORMATS
@ALL_LAYOUTS
@check("KV-POLICY-001", "The engine declares a valid KV policy per (format, layout) whose store saturates: "
       "finite K/V beyond ±max·s must be stored as ±max (clamp or saturating convert), never as NaN/inf.",
       requires=["kv.store"])
def test_kv_policy_saturates_exact(engine, fmt, layout):
    pol = engine.kv_policy(fmt, layout)
    assert isinstance(pol, kvref.KVPolicy), f"kv_policy returned {type(pol).__name__}, expected KVPolicy"
    assert (pol.fmt, pol.layout) == (fmt, layout), f"kv_policy({fmt}, {layout}) declared ({pol.fmt}, {pol.layout})"
    assert pol.saturates, (f"{engine.name} declares a non-saturating KV store for {fmt}/{layout} (clamp=False, "
                           f"overflow={pol.overflow!r}): an out-of-range K/V becomes NaN/inf in the cache and "
                           "poisons every later attention over it")


@FORMATS
@ALL_LAYOUTS
@check("KV-STORE-001", "On seeded K/V whose heads span ±6 binades (4-D batched and 3-D [T, H, D] shapes, odd head "
       "dims), stored codes and scales equal the oracle's under the declared policy, with amax scales, scales "
       "leaving headroom, and scales that clip half the range.", requires=["kv.store"])
def test_kv_store_random_exact(engine, fmt, layout, rng):
    for shape in ((2, 33, 4, 64), (7, 3, 5), (1, 1, 1, 8)):
        x = kv_tensor(rng, shape)
        for factor in ((1.0,) if layout == "token_head" else (1.0, 1 / 0.7, 0.5)):
            s = amax_scale(x, layout, fmt, factor)
            got = engine.kv_store(x, s, fmt=fmt, layout=layout)
            compare_cache(got, oracle_store(engine, x, s, fmt, layout), x,
                          f"kv_store[{fmt}/{layout}] {shape} scale×{factor:.3g}")


def _sweep_tensor(fmt: str, heads: int, d: int) -> torch.Tensor:
    sweep = cast_sweep(fmt)
    n = heads * d
    pad = (-sweep.numel()) % n
    full = torch.cat([sweep, torch.linspace(-1.0, 1.0, pad)]) if pad else sweep
    return full.reshape(-1, heads, d)


@FORMATS
@ALL_LAYOUTS
@check("KV-STORE-002", "Edge values stored exactly as the oracle: every FP8 value × s, RNE ties (power-of-two s "
       "makes x/s exact), ±1 fp32 ulp around them, overflow (saturation), ±inf, NaN (any NaN code), ±0, fp32 "
       "subnormals, with power-of-two and generic scales.", requires=["kv.store"])
def test_kv_store_edge_values_exact(engine, fmt, layout):
    heads, d = 4, 8
    y = _sweep_tensor(fmt, heads, d)
    for s_val in (2.0**-5, 0.0123, 3.0):
        x = (y.double() * s_val).float()
        if layout == "token_head":
            s = None
        elif layout == "tensor":
            s = torch.tensor(s_val, dtype=torch.float32)
        else:
            s = torch.tensor([s_val, s_val * 0.75, s_val * 2.0, s_val * 1.0000001], dtype=torch.float32)
        got = engine.kv_store(x, s, fmt=fmt, layout=layout)
        compare_cache(got, oracle_store(engine, x, s, fmt, layout), x, f"kv_store[{fmt}/{layout}] sweep s={s_val:g}")


@FORMATS
@STATIC_LAYOUTS
@check("KV-STORE-003", "Finite K/V far beyond the range (|x/s| up to 1e30, and ±inf) never produce a NaN or inf "
       "code: they store as ±max; only NaN inputs give NaN codes.", requires=["kv.store"])
def test_kv_store_saturates_no_nonfinite_exact(engine, fmt, layout, rng):
    fmax = get_format(fmt).max_finite
    shape = (64, 2, 16)
    x = kv_tensor(rng, shape, spread=1)
    s = amax_scale(x, layout, fmt, 1.0)
    mags = torch.from_numpy(np.exp2(rng.uniform(0, 100, size=shape)).astype(np.float32))
    big = x.sign() * mags * fmax * (s if layout == "tensor" else s.reshape(1, -1, 1))
    big[0, 0, :4] = torch.tensor([math.inf, -math.inf, fmax * 1.0001, -fmax * 1.0001])
    got = engine.kv_store(big, s, fmt=fmt, layout=layout)
    vals = decode_codes(got.codes, fmt)
    bad = ~np.isfinite(vals)
    record_metrics(mismatch_frac=float(bad.mean()))
    if bad.any():
        ix = np.argwhere(bad)[:5].tolist()
        raise AssertionError(f"kv_store[{fmt}/{layout}]: {int(bad.sum())}/{bad.size} finite-or-inf out-of-range "
                             f"inputs stored as NaN/inf codes (first at {ix}, e.g. x={float(big[tuple(ix[0])]):g}); "
                             "expected saturation to ±max")
    over = (big.double().abs() / (s.double() if layout == "tensor" else s.double().reshape(1, -1, 1))) > \
        kvref.clip_threshold(fmt)
    assert bool((np.abs(vals[over.numpy()]) == fmax).all()), \
        f"kv_store[{fmt}/{layout}]: clipped inputs are not stored as ±{fmax:g}"


@FORMATS
@ALL_LAYOUTS
@check("KV-STORE-004", "Dequantize-on-load (code value × returned scale) is within the round-trip bound of the "
       "input for every element, clipped or not (policy-independent).", bound="quant_roundtrip",
       requires=["kv.store"])
def test_kv_store_roundtrip_bound(engine, fmt, layout, rng):
    x = kv_tensor(rng, (3, 17, 4, 32))
    for factor in ((1.0,) if layout == "token_head" else (1.0, 0.5)):
        got = engine.kv_store(x, amax_scale(x, layout, fmt, factor), fmt=fmt, layout=layout)
        cache = kvref.KVCache(got.codes, got.scale.float(), fmt, layout)
        full = kvref.expand_scale(cache.scale, layout, tuple(x.shape))
        bound = tolerances.quant_roundtrip_bound(x.abs(), full, fmt)
        assert_within_bound(cache.dequantize(), x, bound, context=f"kv load∘store[{fmt}/{layout}] scale×{factor}")


@STATIC_LAYOUTS
@check("KV-STORE-005", "For hypothesis-drawn K/V (shapes, magnitudes 1e-30…1e30, zeros, scales off any power of "
       "two) stored codes equal the oracle's under the declared policy, in both formats.", requires=["kv.store"])
def test_kv_store_property_exact(engine, layout):
    @given(st.integers(1, 9), st.integers(1, 4), st.integers(1, 24), st.sampled_from(FMTS),
           st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]), st.floats(0.3, 3.0), st.integers(0, 2**32 - 1))
    def inner(t, h, d, fmt, magnitude, factor, data_seed):
        r = np.random.default_rng(data_seed)
        x = torch.from_numpy((r.standard_normal((t, h, d)) * magnitude).astype(np.float32))
        x[torch.from_numpy(r.random((t, h, d)) < 0.1)] = 0.0
        s = amax_scale(x, layout, fmt, factor)
        s = torch.where(s > 0, s, torch.ones_like(s))
        got = engine.kv_store(x, s, fmt=fmt, layout=layout)
        compare_cache(got, oracle_store(engine, x, s, fmt, layout), x,
                      f"kv_store[{fmt}/{layout}] hypothesis {(t, h, d)} magnitude {magnitude:g} seed {data_seed}")

    inner()


# ----------------------------------------------------------------------------------------------------------------
# attention

CASES = pytest.mark.parametrize("case", ("prefill-gqa", "varlen-causal", "decode-mqa", "noncausal-mha"))


def _first_layout(engine, fmt: str, layouts: tuple[str, ...]) -> str:
    """The first of ``layouts`` the engine declares a KV policy for (the last one's Unsupported propagates)."""
    for layout in layouts[:-1]:
        try:
            engine.kv_policy(fmt, layout)
            return layout
        except (Unsupported, pytest.skip.Exception):  # the guarded engine turns Unsupported into a skip
            continue
    engine.kv_policy(fmt, layouts[-1])
    return layouts[-1]


@FORMATS
@ALL_LAYOUTS
@CASES
@check("KV-ATTN-001", "FP8 attention over the caches (GQA/MQA/MHA, causal bottom-right and non-causal, variable "
       "lengths, FP8 Q with q_scale ≠ 1 where the declared policy quantizes Q, and without Q quantization) is within "
       "the derived fp32-arithmetic bound of the oracle's FP8 attention on the same FP8 operands.",
       bound="kv_attention_arith",
       requires=["kv.attention"])
def test_kv_attention_vs_oracle_bound(engine, fmt, layout, case, rng):
    q, kc, vc, q_scale, kw = attention_case(rng, case, fmt, layout)
    pol = engine.kv_policy(fmt, layout)
    # an engine whose declared policy keeps Q unquantized (quantize_q=False: no FP8 query) is given no q_scale
    for qs in ((q_scale, None) if pol.quantize_q else (None,)):
        ctx = f"kv_attention[{fmt}/{layout}/{case}] q_scale={'none' if qs is None else f'{float(qs):.4g}'}"
        got = engine.kv_attention(q, kc, vc, q_scale=qs, **kw).detach().cpu().double()
        q_hat = kvref.to_f32(q).double() if qs is None else kvref.quantize_q(q, qs, pol.q_fmt, pol.q_quant_op)
        k_hat, v_hat = kvref.dequantize_kv(kc), kvref.dequantize_kv(vc)
        expected = kvref.attention(q_hat, k_hat, v_hat, **kw)
        terms = kvref.attention_bound_terms(q_hat, k_hat, v_hat, **kw)
        bound = tolerances.kv_attention_arith_bound(terms.score_abs_max, terms.score_span, terms.weighted_abs_v,
                                                    terms.head_dim, terms.n_keys)
        assert_within_bound(got, expected, bound, context=ctx)


@FORMATS
@check("KV-ATTN-002", "Cache slots beyond each sequence's kv_len (random bytes, NaN/inf codes, NaN token scales "
       "where the engine has per-token-head scales, else per-tensor scales) never influence the output, and rows of "
       "padded queries are exactly 0.", requires=["kv.attention"])
def test_kv_attention_padding_exact(engine, fmt, rng):
    layout = _first_layout(engine, fmt, ("token_head", "tensor"))
    q, kc, vc, q_scale, kw = attention_case(rng, "varlen-causal", fmt, layout)
    q_scale = q_scale if engine.kv_policy(fmt, layout).quantize_q else None
    out = engine.kv_attention(q, kc, vc, q_scale=q_scale, **kw)
    out = out.detach().cpu().double()
    ql = kw["q_lengths"]
    for b in range(q.shape[0]):
        valid = out[b, : int(ql[b])]
        assert bool(torch.isfinite(valid).all()), \
            f"kv_attention[{fmt}]: sequence {b} has non-finite outputs: garbage beyond kv_len was read"
        pad = out[b, int(ql[b]):]
        assert bool((pad == 0).all()), f"kv_attention[{fmt}]: padded query rows of sequence {b} are not 0"
    # changing the garbage must not change a single output bit
    for cache in (kc, vc):
        for b, n in enumerate(kw["kv_lengths"].tolist()):
            cache.codes[b, n:] = 0
    again = engine.kv_attention(q, kc, vc, q_scale=q_scale, **kw).detach().cpu().double()
    assert_tensors_equal(again, out, context=f"kv_attention[{fmt}]: output after rewriting slots past kv_len")


@FORMATS
@STATIC_LAYOUTS
@check("KV-ATTN-003", "The engine's own store + FP8 attention with fresh amax scales is as accurate as FP8 can "
       "be: relative error vs the unquantized fp64 attention ≤ κ × the oracle's FP8 error (policy-independent).",
       bound="kv_attention_vs_fresh", requires=["kv.store", "kv.attention"])
def test_kv_attention_vs_unquantized_bound(engine, fmt, layout, rng):
    kappa = tolerances.get("kv_attention_vs_fresh").value
    worst = 0.0
    for case in ("prefill-gqa", "varlen-causal"):
        q, kc0, _, q_scale, kw = attention_case(rng, case, fmt, layout)
        k = kv_tensor(rng, tuple(kc0.codes.shape), spread=2)
        v = kv_tensor(rng, tuple(kc0.codes.shape), spread=2)
        ks, vs = amax_scale(k, layout, fmt), amax_scale(v, layout, fmt)
        kc = engine.kv_store(k, ks, fmt=fmt, layout=layout)
        vc = engine.kv_store(v, vs, fmt=fmt, layout=layout)
        qs = q_scale if engine.kv_policy(fmt, layout).quantize_q else None
        got = engine.kv_attention(q, kc, vc, q_scale=qs, **kw).detach().cpu().double()
        exact = kvref.attention(q, k, v, **kw)
        pol = kvref.default_policy(fmt, layout)
        ref8 = kvref.fp8_attention(q, kvref.quantize_kv(k, ks, pol), kvref.quantize_kv(v, vs, pol), q_scale=q_scale,
                                   **kw)
        e_engine, e_ref = kvref.relative_error(got, exact), kvref.relative_error(ref8, exact)
        worst = max(worst, e_engine / (kappa * e_ref))
        assert e_engine <= kappa * e_ref, (
            f"kv_attention[{fmt}/{layout}/{case}]: relative error vs unquantized attention {e_engine:.4g} > "
            f"κ={kappa:g} × oracle FP8 error {e_ref:.4g} (scales k={ks}, q={float(q_scale):.4g})")
    record_metrics(err_over_bound=worst)


# ----------------------------------------------------------------------------------------------------------------
# calibration


def _captures(rng: np.random.Generator, sizes: list[int], growth: float = 1.0) -> list[list[kvref.Capture]]:
    """captures[rank][micro_batch] = (q, k, v) with 2 KV heads of very different magnitude (K: 1 and 0.01,
    V: 0.5 and 2); micro-batch m of a rank is scaled by growth^m."""
    k_heads = torch.tensor([1.0, 0.01]).reshape(1, 1, 2, 1)
    v_heads = torch.tensor([0.5, 2.0]).reshape(1, 1, 2, 1)
    out = []
    for n in sizes:
        rank = []
        for m in range(n):
            mag = float(np.exp(rng.normal(0, 0.3))) * growth**m
            q = torch.from_numpy(rng.standard_normal((1, 3, 4, 4)).astype(np.float32) * mag * 3)
            k = torch.from_numpy(rng.standard_normal((1, 3, 2, 4)).astype(np.float32) * mag * 7) * k_heads
            v = torch.from_numpy(rng.standard_normal((1, 3, 2, 4)).astype(np.float32) * mag) * v_heads
            rank.append((q, k, v))
        out.append(rank)
    return out


def _compare_scales(got: kvref.KVScales, expected: kvref.KVScales, context: str) -> None:
    for name in ("q", "k", "v"):
        g = torch.as_tensor(getattr(got, name)).float()
        assert_tensors_equal(g, getattr(expected, name), context=f"{context}: {name}_scale")


@FORMATS
@check("KV-CAL-001", "Strategy A (engine-side, vLLM calc_kv_scales): scales equal fl32(max|q|/200), "
       "fl32(max|k|/200), fl32(max|v|/100) of the *first* batch only; later (larger) batches are ignored.",
       requires=["kv.calibrate"])
def test_kv_calibrate_engine_first_batch_exact(engine, fmt, rng):
    caps = _captures(rng, [3, 2], growth=4.0)
    q, k, v = caps[0][0]
    expected = kvref.calibrate_engine_first_batch(q, k, v)
    _compare_scales(engine.kv_calibrate(caps, "engine_first_batch", fmt=fmt), expected, "calibrate A")
    # the formula by hand for one value, so the oracle itself is pinned
    assert float(expected.v) == float(np.float32(float(v.abs().max()) / np.float32(100.0)))


@FORMATS
@check("KV-CAL-002", "Strategy B (trainer-side, NeMo-RL): per rank the nearest-rank p99.9 of per-micro-batch "
       "amaxes (Python round, ties to even), max over ranks, × 1.05 / 448 (K/V: / the cache format's max) — "
       "exactly, with rank sizes where p99.9, the max and round-half-up differ.", requires=["kv.calibrate"])
def test_kv_calibrate_trainer_p999_exact(engine, fmt, rng):
    caps = _captures(rng, [1501, 1001, 3])
    # an outlier micro-batch on rank 0 that p99.9 must drop. Rank sizes pin the index formula: NeMo-RL computes
    # round((99.9 / 100.0) · (n − 1)); for n = 1501 that is round(1498.5000000000002) = 1499, while a literal 0.999
    # gives round(1498.5) = 1498 (banker's rounding) and round-half-up 1499; n = 1001 → 999; n = 3 → 2 (the max)
    q, k, v = caps[0][7]
    caps[0][7] = (q * 50, k * 50, v * 50)
    expected = kvref.calibrate(caps, "trainer_p999", fmt=fmt)
    _compare_scales(engine.kv_calibrate(caps, "trainer_p999", fmt=fmt), expected, "calibrate B")
    pooled_max = max(float(mb[1].abs().max()) for rank in caps for mb in rank)
    assert float(expected.k) < pooled_max * 1.05 / get_format(fmt).max_finite, "test data: p99.9 must drop the outlier"


@FORMATS
@STATIC_LAYOUTS
@check("KV-CAL-003", "Strategy C (plain amax): scale = fl32(amax / max) over every micro-batch of every rank, per "
       "tensor or per KV head (Q per tensor, / 448).", requires=["kv.calibrate"])
def test_kv_calibrate_amax_exact(engine, fmt, layout, rng):
    caps = _captures(rng, [4, 2], growth=1.5)
    expected = kvref.calibrate(caps, "amax", layout=layout, fmt=fmt)
    _compare_scales(engine.kv_calibrate(caps, "amax", layout=layout, fmt=fmt), expected, f"calibrate C/{layout}")


# ----------------------------------------------------------------------------------------------------------------
# RL loop: weight updates, resets, defaults, drift


def _drift_captures(steps: tuple[int, ...], seed: int, layer: int = 0) -> dict[int, kvref.Capture]:
    """Post-RoPE (q, k, v) of one layer of the drift simulator's stack at the given RL steps (fp32)."""
    cfg = drift.DriftConfig(seed=seed % 1000)
    model = drift.TinyAttentionStack.init(cfg)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in range(max(steps) + 1):
        if t > 0:
            model.rl_step(t - 1)
        if t in steps:
            tokens = torch.randint(cfg.vocab, (2, 24), generator=gen)
            _, caps = model.forward(tokens)
            out[t] = tuple(c.float() for c in caps[layer])
    return out  # type: ignore[return-value]


def _layer_scales(q, k, v, fmt: str, layout: str) -> kvref.KVScales:
    return kvref.calibrate([[(q, k, v)]], "amax", layout=layout, fmt=fmt)


def _check_forward(engine, res: kvref.KVForward, q, k, v, scales: kvref.KVScales, fmt: str, layout: str,
                   context: str) -> None:
    pol = engine.kv_policy(fmt, layout)
    compare_cache(res.k_cache, kvref.quantize_kv(k, scales.k, pol), k, f"{context}: K cache")
    compare_cache(res.v_cache, kvref.quantize_kv(v, scales.v, pol), v, f"{context}: V cache")
    q_hat = kvref.quantize_q(q, scales.q, pol.q_fmt, pol.q_quant_op) if pol.quantize_q else q.double()
    k_hat, v_hat = res.k_cache.dequantize(), res.v_cache.dequantize()
    expected = kvref.attention(q_hat, k_hat, v_hat, causal=True)
    terms = kvref.attention_bound_terms(q_hat, k_hat, v_hat, causal=True)
    bound = tolerances.kv_attention_arith_bound(terms.score_abs_max, terms.score_span, terms.weighted_abs_v,
                                                terms.head_dim, terms.n_keys)
    assert_within_bound(res.out.detach().cpu().double(), expected, bound,
                        context=f"{context}: attention output")


@FORMATS
@STATIC_LAYOUTS
@check("KV-UPDATE-001", "After a simulated weight update (ranges grown ~2×), scales pushed with kv_update_scales "
       "are the ones the next kv_forward uses: returned scales, cache codes and attention output match the oracle "
       "with the new scales (an engine that keeps step-0 scales saturates and fails).",
       bound="kv_attention_arith", requires=["kv.update_scales"])
def test_kv_update_pushed_scales_bound(engine, fmt, layout, seed):
    caps = _drift_captures((0, 12), seed)
    layer = f"KV-UPDATE-001/{fmt}/{layout}/{seed}"
    q0, k0, v0 = caps[0]
    q1, k1, v1 = caps[12]
    s0 = _layer_scales(q0, k0, v0, fmt, layout)
    s1 = _layer_scales(q1, k1, v1, fmt, layout)
    stale_sat = kvref.saturation_fraction(k1, s0.k, layout, fmt)
    assert stale_sat > 0, "test data: the update must make step-0 scales saturate"
    engine.kv_update_scales(layer, s0)
    _check_forward(engine, engine.kv_forward(layer, q0, k0, v0, fmt=fmt, layout=layout), q0, k0, v0, s0, fmt, layout,
                   "step 0")
    engine.kv_update_scales(layer, s1)
    res = engine.kv_forward(layer, q1, k1, v1, fmt=fmt, layout=layout)
    used = res.scales
    if isinstance(used, kvref.KVScales) and used.equals(s0):
        raise AssertionError(f"kv_forward after the weight update still uses the step-0 scales {s0.as_dict()} "
                             f"(new: {s1.as_dict()}); {stale_sat:.2%} of K saturates with them")
    _compare_scales(used, s1, "scales used after the update")
    _check_forward(engine, res, q1, k1, v1, s1, fmt, layout, "step 12 (after update)")


@FORMATS
@check("KV-UPDATE-002", "Engine-side recalibration: after kv_update_scales(layer, None) the next kv_forward "
       "computes strategy-A scales from that batch and freezes them for the following batches; a reset after the "
       "next weight update recomputes them from the new activations.", requires=["kv.update_scales"])
def test_kv_update_engine_side_reset_exact(engine, fmt, seed):
    caps = _drift_captures((0, 12), seed)
    layer = f"KV-UPDATE-002/{fmt}/{seed}"
    q0, k0, v0 = caps[0]
    q1, k1, v1 = caps[12]
    engine.kv_update_scales(layer, None)
    first = engine.kv_forward(layer, q0, k0, v0, fmt=fmt)
    a0 = kvref.calibrate_engine_first_batch(q0, k0, v0)
    _compare_scales(first.scales, a0, "scales after reset (first batch)")
    _check_forward(engine, first, q0, k0, v0, a0, fmt, "tensor", "first batch after reset")
    second = engine.kv_forward(layer, q0[:1] * 0.5, k0[:1] * 0.5, v0[:1] * 0.5, fmt=fmt)
    _compare_scales(second.scales, a0, "scales on the second batch (must stay frozen)")
    engine.kv_update_scales(layer, None)
    res = engine.kv_forward(layer, q1, k1, v1, fmt=fmt)
    a1 = kvref.calibrate_engine_first_batch(q1, k1, v1)
    if isinstance(res.scales, kvref.KVScales) and res.scales.equals(a0):
        raise AssertionError("after the reset that follows the weight update the engine kept the step-0 scales "
                             f"{a0.as_dict()} (expected {a1.as_dict()})")
    _compare_scales(res.scales, a1, "scales after the second reset")
    _check_forward(engine, res, q1, k1, v1, a1, fmt, "tensor", "after weight update + reset")


@FORMATS
@check("KV-DEFAULT-001", "A layer that never received or calibrated scales must not silently run with the default "
       "scale 1.0: with K/V/Q amax ≫ 448 the engine's own FP8 KV path (kv_forward with the scales it picks by "
       "itself) either refuses (MissingKVScales) or clips nothing (K, V, and Q where the policy quantizes Q).",
       requires=["kv.forward"])
def test_kv_default_scale_flagged_exact(engine, fmt, rng):
    fmax = get_format(fmt).max_finite
    q = torch.from_numpy(rng.standard_normal((1, 16, 4, 32)).astype(np.float32)) * 300
    k = kv_tensor(rng, (1, 16, 2, 32), spread=1) * (fmax * 4 / 3)
    v = kv_tensor(rng, (1, 16, 2, 32), spread=1) * (fmax * 2 / 3)
    layer = f"KV-DEFAULT-001/{fmt}/never-set"
    try:
        res = engine.kv_forward(layer, q, k, v, fmt=fmt)
    except EngineError as exc:
        if isinstance(exc.__cause__, kvref.MissingKVScales):
            return  # refused: the flag the spec asks for
        raise
    s = res.scales
    pol = engine.kv_policy(fmt, res.k_cache.layout)
    named = (("q", q, pol.q_fmt),) if pol.quantize_q else ()  # an unquantized Q cannot clip
    sat = {n: kvref.saturation_fraction(x, getattr(s, n), res.k_cache.layout, f)
           for n, x, f in (*named, ("k", k, fmt), ("v", v, fmt))}
    record_metrics(mismatch_frac=max(sat.values()))
    ones = all(float(torch.as_tensor(getattr(s, n)).max()) == 1.0 for n in ("q", "k", "v"))
    assert max(sat.values()) == 0, (
        f"layer without scales ran silently with scales {s.as_dict()}{' (the default 1.0)' if ones else ''}: "
        f"saturated fractions {', '.join(f'{n} {v:.2%}' for n, v in sat.items())} (amax q {float(q.abs().max()):.4g}, "
        f"k {float(k.abs().max()):.4g}, v {float(v.abs().max()):.4g}); refuse with MissingKVScales or calibrate")


#: drift config of the conformance run (smaller than the CLI default: 16 steps, ranges grow for 10)
DRIFT_CHECK_CONFIG = {"steps": 16, "grow_steps": 10, "growth": 0.09}


@check("KV-DRIFT-001", "Drift simulation through the engine (16 RL-like steps of a tiny QK-norm + RoPE GQA stack, "
       "scales by strategy B pushed per schedule): per-step recalibration holds the bound at every step (attention "
       "error ≤ κ_attn and log-prob divergence ≤ κ_lp × the fresh-amax FP8 error); the table and plots for never / "
       "every step / every 5 steps go to the report.",
       bound=("kv_attention_vs_fresh", "kv_drift_logprob_vs_fresh"), requires=["kv.update_scales"], timeout=120.0)
def test_kv_drift_per_step_recalibration_bound(engine, seed):
    cfg = drift.DriftConfig(seed=seed % 1000, **DRIFT_CHECK_CONFIG)  # type: ignore[arg-type]
    result = drift.simulate(cfg, backend=drift.EngineBackend(engine, cfg.fmt, cfg.layout, f"KV-DRIFT-001/{seed}"),
                            kappa_attn=tolerances.get("kv_attention_vs_fresh").value,
                            kappa_lp=tolerances.get("kv_drift_logprob_vs_fresh").value)
    record_section("kv_drift", result.to_section(f"KV-scale drift through {engine.name}"))
    summ = result.summary()
    record_metrics(err_over_bound=summ["every-step"]["max_attn_err_over_bound"],
                   never_max_attn_err_over_bound=summ["never"]["max_attn_err_over_bound"],
                   never_violations=summ["never"]["violations"])
    bad = result.violations("every-step")
    assert not bad, (
        "per-step recalibration violates the drift bound at steps " + ", ".join(
            f"{t} (attn {result.schedules['every-step'][t].attn_err:.3g} vs bound {result.attn_bound(t):.3g}, "
            f"log-prob {result.schedules['every-step'][t].logprob_div:.3g} vs {result.lp_bound(t):.3g}, "
            f"saturation {result.schedules['every-step'][t].saturation:.3g})" for t in bad[:4]))


# ----------------------------------------------------------------------------------------------------------------
# the input space of kv_store / kv_attention (fp8rl.inputspace)

_STORE_CLASSES = S.classes("kv_store", ("dtype.", "layout.", "special.", "size."))


def _finite_amax_scale(x: torch.Tensor, layout: str, fmt: str) -> torch.Tensor | None:
    """amax_scale over the finite values (a special value placed in K/V must not set the scale)."""
    finite = torch.where(torch.isfinite(x.float()), x.float(), torch.zeros_like(x, dtype=torch.float32))
    s = amax_scale(finite.clamp(-1e30, 1e30), layout, fmt)
    return None if s is None else torch.where(s > 0, s, torch.ones_like(s))


@FORMATS
@ALL_LAYOUTS
@pytest.mark.parametrize("cls", _STORE_CLASSES)
@check("KV-SPACE-001", "For every class of the kv_store input space — fp32/bf16/fp16 K/V; contiguous, transposed "
       "(heads × dims), sliced and strided layouts; head dims below 64, 64 and 128; NaN, ±inf, -0, fp32 "
       "subnormals and ±FLT_MAX placed in K/V — stored codes and scales equal the oracle's under the declared "
       "policy.", requires=["kv.store"])
def test_kv_store_input_space_exact(engine, fmt, layout, cls, rng):
    S.skip_if_limited(engine, "kv_store", cls)
    axis, _, value = cls.partition("=")
    d = S.SIZE_OF[value] if axis == "size.x.head_dim" else 48
    x = kv_tensor(rng, (12, 4, d), spread=3)
    if axis == "special.x":
        x = with_specials(x, [value], rng)
    if axis == "dtype.x":
        x = x.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[value])
    if axis == "layout.x":
        x = with_layout(x, value)
    s = _finite_amax_scale(x, layout, fmt)
    got = engine.kv_store(x, s, fmt=fmt, layout=layout)
    x32 = x.float().contiguous()
    compare_cache(got, oracle_store(engine, x32, s, fmt, layout), x32, f"kv_store[{fmt}/{layout}] {cls}")


_ATTN_CLASSES = S.classes("kv_attention", ("dtype.", "layout.", "arg.causal", "arg.sm_scale", "arg.q_scale",
                                           "arg.lengths", "arg.gqa", "special."))
#: the attention case that carries a class (varlen: ragged lengths with NaN codes past kv_len; mha: Hq = Hkv)
_ATTN_CASE = {"arg.lengths=none": "prefill-gqa", "arg.gqa=gqa": "prefill-gqa", "arg.gqa=mha": "noncausal-mha",
              "arg.causal=false": "noncausal-mha", "special.cache=nan-code": "varlen-causal"}


@FORMATS
@ALL_LAYOUTS
@pytest.mark.parametrize("cls", _ATTN_CLASSES)
@check("KV-SPACE-002", "For every class of the kv_attention input space — fp32/bf16/fp16 and non-contiguous "
       "queries, causal and non-causal, a given sm_scale, with and without a q_scale (where the policy quantizes "
       "Q), ragged and full lengths, GQA and MHA, NaN codes in slots past kv_len — the output is within the derived "
       "fp32-arithmetic bound of the oracle's FP8 attention on the same FP8 operands.",
       bound="kv_attention_arith", requires=["kv.attention"])
def test_kv_attention_input_space_bound(engine, fmt, layout, cls, rng):
    S.skip_if_limited(engine, "kv_attention", cls)
    axis, _, value = cls.partition("=")
    q, kc, vc, q_scale, kw = attention_case(rng, _ATTN_CASE.get(cls, "varlen-causal"), fmt, layout)
    pol = engine.kv_policy(fmt, layout)
    qs = q_scale if pol.quantize_q and cls != "arg.q_scale=none" else None
    if cls == "arg.q_scale=given" and not pol.quantize_q:
        pytest.skip(f"kv_attention: the declared {fmt}/{layout} policy keeps Q unquantized (no FP8 query)")
    if cls == "arg.sm_scale=given":
        kw = {**kw, "sm_scale": 0.37}
    if axis == "dtype.q":
        q = q.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[value])
    if axis == "layout.q":
        q = with_layout(q, value)
    got = engine.kv_attention(q, kc, vc, q_scale=qs, **kw).detach().cpu().double()
    q_hat = kvref.to_f32(q.float().contiguous()).double() if qs is None else \
        kvref.quantize_q(q.float().contiguous(), qs, pol.q_fmt, pol.q_quant_op)
    k_hat, v_hat = kvref.dequantize_kv(kc), kvref.dequantize_kv(vc)
    expected = kvref.attention(q_hat, k_hat, v_hat, **kw)
    terms = kvref.attention_bound_terms(q_hat, k_hat, v_hat, **kw)
    bound = tolerances.kv_attention_arith_bound(terms.score_abs_max, terms.score_span, terms.weighted_abs_v,
                                                terms.head_dim, terms.n_keys)
    assert_within_bound(got, expected, bound, context=f"kv_attention[{fmt}/{layout}] {cls} q {q.dtype}")
