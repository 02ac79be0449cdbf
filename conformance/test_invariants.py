"""Area ``invariants``: properties every engine must have whatever numerics it declares.

The other areas compare an engine with the oracle under the engine's *declared* policy, so a policy that is
legitimately declared but harmful in RL (an eps that underflows in fp16, a loss whose gradient leaks into the old
log-probs) is invisible there. The checks here hold for every engine and every policy:

* INV-FINITE-001 / 002: finite inputs in fp32, bf16 and fp16 give finite positive scales, no NaN/inf codes, and (for
  the quantizer) dequantized values within the round-trip bound of the input — all-zero groups, tiny and huge
  amaxes included. A quantize policy with ``zero_amax="nan"`` declares itself unguarded for a zero amax: only those
  inputs are skipped for it, with the reason.
* INV-INPUT-001: no op writes into its caller's tensors (bytes, NaN payloads and -0.0 included, and shape, stride,
  dtype), nor changes the structure of its containers (a state dict's keys).
* INV-GRAD-001: only the current log-probs carry gradient (old log-probs, advantages, IS weights, the proximal and
  behaviour log-probs of decoupled PPO are constants; the IS weights and metrics are detached).
* INV-LAYER-001: a per-layer state op (pushing or resetting one layer's KV scales) changes only that layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from fp8rl import fixtures, tolerances
from fp8rl.checks import assert_within_bound, check, record_metrics
from fp8rl.inputspace import with_layout
from fp8rl.reference import correction as C
from fp8rl.reference import kv as kvref
from fp8rl.reference.formats import decode_codes, get_format
from fp8rl.reference.quant import Granularity, compute_amax, quantize
from fp8rl.strategies_correction import make_batch

from . import _space as S
from ._inputs import scaled_normal, spanning_values


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Small tensors: one intra-op thread (multi-threaded dispatch of tiny ops is slower on a loaded 2-core CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


# ----------------------------------------------------------------------------------------------------------------
# INV-FINITE-001: the quantizer, whatever the declared policy

#: granularity and a modest shape of each kind: several groups/blocks (K a multiple of the group size: some engines
#: take no partial group; ragged edges are the quantization area's subject), a ragged edge block
FINITE_CASES = {
    "tensor": (Granularity.tensor(), (6, 200)),
    "token": (Granularity.token(), (6, 200)),
    "channel": (Granularity.channel(), (6, 200)),
    "group": (Granularity.group(128), (4, 384)),
    "block": (Granularity.block(128), (160, 200)),
}

#: input classes: all zero; amax 1e-6, the dtype's smallest normal, a subnormal of the dtype (smallest normal ·
#: 2^-5), near the dtype's max (fp16: 60000); seeded normal data spanning binades; the same with its first
#: row/group/block zeroed
FINITE_CLASSES = ("all-zero", "amax-1e-6", "amax-min-normal", "amax-subnormal", "amax-near-max", "binades",
                  "zero-block")

#: the amax each scaled class is given, per input dtype
NEAR_MAX = {"fp32": 3.0e38, "bf16": 3.0e38, "fp16": 60000.0}


def _scaled_to(rng: np.random.Generator, shape: tuple[int, int], amax: float) -> torch.Tensor:
    """Gaussian data rescaled (in fp64) so that its largest magnitude is ``amax``."""
    n = rng.standard_normal(shape)
    return torch.from_numpy(n / np.abs(n).max() * amax)


def finite_input(cls: str, dtype: str, kind: str, rng: np.random.Generator) -> torch.Tensor:
    """A finite tensor of input class ``cls`` in ``dtype`` for granularity ``kind`` (see FINITE_CLASSES)."""
    g, shape = FINITE_CASES[kind]
    dt = DTYPES[dtype]
    tiny = float(torch.finfo(dt).tiny)
    if cls == "all-zero":
        x = torch.zeros(shape, dtype=torch.float64)
    elif cls == "amax-1e-6":
        x = _scaled_to(rng, shape, 1e-6)
    elif cls == "amax-min-normal":
        x = _scaled_to(rng, shape, tiny)
    elif cls == "amax-subnormal":
        x = _scaled_to(rng, shape, tiny * 2.0**-5)
    elif cls == "amax-near-max":
        x = _scaled_to(rng, shape, NEAR_MAX[dtype])
    elif cls in ("binades", "zero-block"):
        x = scaled_normal(rng, shape, spread=4).double()  # ±8 binades in all: finite in fp16 too
        if cls == "zero-block":
            rows = g.size[0] if kind == "block" else 1
            cols = g.size[1] if kind in ("group", "block") else shape[1]
            x[:rows, :cols] = 0.0
    else:
        raise ValueError(f"unknown input class {cls!r}")
    x = x.to(dt)
    assert bool(torch.isfinite(x).all()), f"test data: {cls} {dtype} is not finite"
    return x


@pytest.mark.parametrize("cls", FINITE_CLASSES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(FINITE_CASES))
@check("INV-FINITE-001", "Whatever the declared policy, finite fp32/bf16/fp16 inputs (all-zero, amax 1e-6, the "
       "dtype's smallest normal and a subnormal, near the dtype's max, seeded data spanning binades, one zero "
       "group among normal ones) give finite scales > 0, codes that are not NaN or inf in the policy's format, and "
       "code value × scale within the round-trip bound of the input (a policy declaring zero_amax='nan' is excused "
       "for zero-amax groups only).", bound=("quant_roundtrip", "quant_roundtrip_input_dtype_slack"),
       requires=["quantize.{kind}"])
def test_quantize_finite_bound(engine, kind, dtype, cls, rng):
    S.skip_if_limited(engine, "quantize", f"dtype.x={dtype}")
    g = FINITE_CASES[kind][0]
    x = finite_input(cls, dtype, kind, rng)
    policy = engine.scale_policy(kind)
    amax = compute_amax(x, g)
    if policy.zero_amax == "nan" and bool((amax == 0).any()):
        pytest.skip(f"the declared {kind} policy {policy.name!r} has zero_amax='nan' (unguarded by declaration): "
                    f"a zero-amax group gives NaN codes there; {int((amax == 0).sum())} group(s) of this input have "
                    "amax 0")
    got = engine.quantize(x, g)
    ctx = f"quantize[{g.label}] {cls} {dtype} {tuple(x.shape)} (declared policy {policy.name!r})"
    s = got.scale.detach().cpu()
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        i = _first_index(bad)
        raise AssertionError(f"{ctx}: {int(bad.sum())}/{s.numel()} scales are not finite and > 0; first at scale "
                             f"index {i}: scale {float(s[i])!r}, group amax {float(amax[i])!r}")
    vals = decode_codes(got.codes.cpu().numpy(), got.fmt)
    nonfinite = ~np.isfinite(vals)
    record_metrics(mismatch_frac=float(nonfinite.mean()))
    if nonfinite.any():
        i = tuple(int(v) for v in np.argwhere(nonfinite)[0])
        what = "NaN" if np.isnan(vals[i]) else "inf"
        raise AssertionError(f"{ctx}: {int(nonfinite.sum())}/{vals.size} codes are NaN/inf in {got.fmt}; first at "
                             f"{i}: x={float(x[i])!r} → code 0x{int(got.codes[i]):02x} ({what}), scale "
                             f"{float(got.expanded_scale()[i])!r}")
    scale = got.expanded_scale().double()
    deq = torch.from_numpy(vals) * scale  # exact in fp64
    if policy.compute_dtype == "input":  # the quotient is rounded to x's own dtype before the cast
        bound = tolerances.quant_roundtrip_input_dtype_bound(x.double().abs(), scale, got.fmt, x.dtype,
                                                             target_max=policy.max_value)
    else:
        bound = tolerances.quant_roundtrip_bound(x.double().abs(), scale, got.fmt, target_max=policy.max_value)
    assert_within_bound(deq, x.double(), bound, context=f"{ctx}: code value × scale vs x")


# ----------------------------------------------------------------------------------------------------------------
# INV-FINITE-002: the KV store

KV_FMTS = ("e4m3fn", "e5m2")
KV_LAYOUTS = ("tensor", "head", "token_head")


def kv_finite_input(dtype: str, rng: np.random.Generator) -> torch.Tensor:
    """K/V [T=12, H=4, D=32] in ``dtype``, finite: heads with amax 1, 1e-6, the dtype's smallest normal and near its
    max (fp16: 60000); token 0 all zero, and one more zero (token, head)."""
    dt = DTYPES[dtype]
    n = rng.standard_normal((12, 4, 32))
    head_amax = np.array([1.0, 1e-6, float(torch.finfo(dt).tiny), NEAR_MAX[dtype] / 2])
    x = n / np.abs(n).max(axis=(0, 2), keepdims=True) * head_amax.reshape(1, 4, 1)
    x[0] = 0.0
    x[5, 2] = 0.0
    x = torch.from_numpy(x).to(dt)
    assert bool(torch.isfinite(x).all()), f"test data: K/V in {dtype} is not finite"
    return x


def _kv_scales(x: torch.Tensor, layout: str, fmt: str, factor: float) -> torch.Tensor | None:
    """Finite positive scales for a static layout: fl32(amax/max·factor) per tensor or per head (1 where amax is
    0); None for token_head (the engine computes them)."""
    if layout == "token_head":
        return None
    a = x.float().abs()
    amax = a.amax() if layout == "tensor" else a.amax(dim=(0, 2))
    s = (amax.double() * factor / get_format(fmt).max_finite).float()
    return torch.where(s > 0, s, torch.ones_like(s))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("fmt", KV_FMTS)
@check("INV-FINITE-002", "Whatever the declared KV policy, finite fp32/bf16/fp16 K/V (zero tokens, a zero "
       "(token, head), heads with amax 1e-6, the dtype's smallest normal and near its max) stored with finite "
       "positive scales (amax scales, and scales that clip half the range; per-token-head scales computed by the "
       "engine) give no NaN or inf codes, and the returned scales are finite and > 0.", requires=["kv.store"])
def test_kv_store_finite_exact(engine, fmt, layout, dtype, rng):
    S.skip_if_limited(engine, "kv_store", f"dtype.x={dtype}")
    engine.kv_policy(fmt, layout)  # an unsupported (format, layout) skips with the engine's reason
    x = kv_finite_input(dtype, rng)
    for factor in ((1.0,) if layout == "token_head" else (1.0, 0.5)):
        s = _kv_scales(x, layout, fmt, factor)
        got = engine.kv_store(x, s, fmt=fmt, layout=layout)
        ctx = f"kv_store[{fmt}/{layout}] {dtype} {tuple(x.shape)}" + ("" if s is None else f" scale×{factor:g}")
        sc = torch.as_tensor(got.scale).detach().cpu().float()
        bad = ~(torch.isfinite(sc) & (sc > 0))
        if bool(bad.any()):
            i = _first_index(bad) if sc.dim() else ()
            raise AssertionError(f"{ctx}: {int(bad.sum())}/{sc.numel()} returned scales are not finite and > 0; "
                                 f"first at {i}: {float(sc[i])!r}")
        vals = decode_codes(got.codes.cpu().numpy(), fmt)
        nonfinite = ~np.isfinite(vals)
        record_metrics(mismatch_frac=float(nonfinite.mean()))
        if nonfinite.any():
            i = tuple(int(v) for v in np.argwhere(nonfinite)[0])
            raise AssertionError(f"{ctx}: {int(nonfinite.sum())}/{vals.size} codes are NaN/inf; first at {i}: "
                                 f"x={float(x[i])!r} → code 0x{int(got.codes[i]):02x} ({vals[i]!r})")


# ----------------------------------------------------------------------------------------------------------------
# INV-INPUT-001: no op writes into its caller's tensors


@dataclasses.dataclass(frozen=True)
class _TensorState:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    data: torch.Tensor  # the view's bytes, (numel, itemsize) uint8
    storage: torch.Tensor | None  # every byte of the storage (catches writes beside a non-contiguous view)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size()).clone()


def _tensor_state(t: torch.Tensor) -> _TensorState:
    storage = None
    if t.device.type == "cpu":
        storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()
    return _TensorState(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype, t.device, _bytes(t),
                        storage)


def snapshot(obj: Any, path: str, out: dict[str, Any]) -> None:
    """Record every tensor reachable from ``obj`` (dicts, lists, tuples, dataclasses such as QuantizedTensor,
    KVCache, KVScales) by its path, and the structure of each container (keys, lengths)."""
    if isinstance(obj, torch.Tensor):
        out[path] = _tensor_state(obj)
    elif isinstance(obj, dict):
        out[path + "{keys}"] = list(obj.keys())
        for k, v in obj.items():
            snapshot(v, f"{path}[{k!r}]", out)
    elif isinstance(obj, (list, tuple)):
        out[path + "{len}"] = len(obj)
        for i, v in enumerate(obj):
            snapshot(v, f"{path}[{i}]", out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            snapshot(getattr(obj, f.name), f"{path}.{f.name}", out)
    else:
        out[path] = obj


def _describe_change(path: str, before: _TensorState, now: torch.Tensor) -> str | None:
    meta_then = (before.shape, before.stride, before.offset, before.dtype, before.device)
    meta_now = (tuple(now.shape), tuple(now.stride()), int(now.storage_offset()), now.dtype, now.device)
    if meta_then != meta_now:
        return (f"{path}: shape/stride/offset/dtype/device changed from {meta_then} to {meta_now}")
    data = _bytes(now)
    diff = (data != before.data).any(dim=1)
    if bool(diff.any()):
        flat = int(diff.nonzero()[0])
        idx = tuple(int(i) for i in np.unravel_index(flat, before.shape)) if before.shape else ()
        old = before.data[flat].contiguous().view(before.dtype)
        new = data[flat].contiguous().view(before.dtype)
        return (f"{path}: {int(diff.sum())}/{diff.numel()} elements changed; first at index {idx}: "
                f"{old.item()!r} (bytes {before.data[flat].tolist()}) → {new.item()!r} (bytes {data[flat].tolist()})")
    if before.storage is not None:
        whole = torch.empty(0, dtype=torch.uint8).set_(now.untyped_storage())
        if whole.numel() != before.storage.numel() or not torch.equal(whole, before.storage):
            return f"{path}: the view's elements are unchanged but bytes of its storage outside the view changed"
    return None


def compare_snapshot(obj: Any, path: str, before: dict[str, Any], problems: list[str]) -> None:
    """Append a description of every difference between ``obj`` now and its snapshot."""
    if isinstance(obj, torch.Tensor):
        was = before.get(path)
        if not isinstance(was, _TensorState):
            problems.append(f"{path}: was {type(was).__name__}, now a tensor")
            return
        change = _describe_change(path, was, obj)
        if change:
            problems.append(change)
    elif isinstance(obj, dict):
        keys = before.get(path + "{keys}")
        if keys != list(obj.keys()):
            problems.append(f"{path}: keys changed: removed {sorted(map(str, set(keys or ()) - set(obj)))}, added "
                            f"{sorted(map(str, set(obj) - set(keys or ())))}")
        for k, v in obj.items():
            if keys is not None and k in keys:
                compare_snapshot(v, f"{path}[{k!r}]", before, problems)
    elif isinstance(obj, (list, tuple)):
        n = before.get(path + "{len}")
        if n != len(obj):
            problems.append(f"{path}: length changed from {n} to {len(obj)}")
        for i, v in enumerate(obj[: n or 0]):
            compare_snapshot(v, f"{path}[{i}]", before, problems)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            compare_snapshot(getattr(obj, f.name), f"{path}.{f.name}", before, problems)
    elif before.get(path) != obj:
        problems.append(f"{path}: changed from {before.get(path)!r} to {obj!r}")


def _layout(engine, op: str, axis: str, preferred: str) -> str:
    """``preferred`` (a non-contiguous layout), or contiguous where the engine declares it cannot take it."""
    return "contiguous" if engine.input_limits(op).get(f"{axis}={preferred}") else preferred


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` with -0.0 and a NaN carrying a payload (0x7FC01234) written into it (a copy)."""
    y = x.detach().float().contiguous().clone()
    bits = y.view(torch.int32).reshape(-1)
    bits[0] = 0x7FC01234
    bits[1] = -(2**31)  # -0.0
    return y


def _inputs_cast(engine, rng):
    x = spanning_values(rng, (24, 40))
    if not engine.input_limits("cast").get("special.x=nan"):
        x = _with_specials(x)
    x = with_layout(x, _layout(engine, "cast", "layout.x", "transposed"))
    return {"x": x}, lambda a: engine.cast(a["x"], "e4m3fn")


def _inputs_round_bf16(engine, rng):
    x = spanning_values(rng, (24, 40))
    if not engine.input_limits("round_bf16").get("special.x=nan"):
        x = _with_specials(x)
    x = with_layout(x, _layout(engine, "round_bf16", "layout.x", "sliced"))
    return {"x": x}, lambda a: engine.round_bf16(a["x"])


def _inputs_quantize(kind: str):
    def build(engine, rng):
        g = Granularity.group(128) if kind == "group" else Granularity.block(128)
        x = scaled_normal(rng, (160, 256), spread=4)  # K a multiple of 128 (some engines take no partial group)
        x[0, 1] = -0.0
        x = with_layout(x, _layout(engine, "quantize", "layout.x", "transposed"))
        return {"x": x}, lambda a: engine.quantize(a["x"], g)

    return build


def _inputs_block_gemm(engine, rng):
    a = quantize(scaled_normal(rng, (16, 256), spread=4), Granularity.group(128), "reference")
    w = quantize(torch.from_numpy(rng.standard_normal((136, 256)).astype(np.float32) * 0.05), Granularity.block(128),
                 "reference")
    return {"a": a, "w": w}, lambda args: engine.block_gemm(args["a"], args["w"], torch.float32)


def _inputs_kv_store(engine, rng):
    engine.kv_policy("e4m3fn", "head")
    x = torch.from_numpy(rng.standard_normal((9, 4, 32)).astype(np.float32))
    x[0, 0, 1] = -0.0
    x = with_layout(x, _layout(engine, "kv_store", "layout.x", "transposed"))
    scale = (x.abs().amax(dim=(0, 2)).double() / get_format("e4m3fn").max_finite).float()
    return {"x": x, "scale": scale}, lambda a: engine.kv_store(a["x"], a["scale"], fmt="e4m3fn", layout="head")


def _inputs_kv_attention(engine, rng):
    pol = engine.kv_policy("e4m3fn", "tensor")
    q = torch.from_numpy(rng.standard_normal((2, 5, 4, 16)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((2, 9, 2, 16)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((2, 9, 2, 16)).astype(np.float32))
    kc = kvref.quantize_kv(k, (k.abs().amax().double() / pol.fmax).float(), pol)
    vc = kvref.quantize_kv(v, (v.abs().amax().double() / pol.fmax).float(), pol)
    q = with_layout(q, _layout(engine, "kv_attention", "layout.q", "sliced"))
    args = {"q": q, "k_cache": kc, "v_cache": vc, "q_lengths": torch.tensor([5, 3]), "kv_lengths": torch.tensor([9, 6])}
    if pol.quantize_q:
        args["q_scale"] = (q.abs().amax().double() / 448.0 * 1.37).float()
    return args, lambda a: engine.kv_attention(a["q"], a["k_cache"], a["v_cache"], q_scale=a.get("q_scale"),
                                               causal=True, q_lengths=a["q_lengths"], kv_lengths=a["kv_lengths"])


def _inputs_kv_calibrate(engine, rng):
    def cap(scale: float):
        return tuple(torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale)
                     for shape in ((1, 3, 4, 8), (1, 3, 2, 8), (1, 3, 2, 8)))

    captures = [[cap(1.0), cap(2.0), cap(0.5)], [cap(3.0)]]

    def call(a):
        return [engine.kv_calibrate(a["captures"], strategy, fmt="e4m3fn")
                for strategy in ("engine_first_batch", "trainer_p999", "amax")]

    return {"captures": captures}, call


def _correction_pad(engine) -> str:
    limits = engine.input_limits("rollout_correction")
    return "finite" if any(cls.startswith("special.masked.") for cls in limits) else "nonfinite"


def _inputs_rollout_correction(engine, rng):
    b = make_batch(int(rng.integers(2**31)), 4, 9, max_delta=1.0, pad=_correction_pad(engine), empty_rows=False)
    layout = _layout(engine, "rollout_correction", "layout.logp", "transposed")
    args = {"train_logp": with_layout(b.train_logp, layout), "rollout_logp": with_layout(b.rollout_logp, layout),
            "mask": b.mask}
    cfg = C.CorrectionConfig("token", 2.0)  # plain token TIS: every correction engine has it
    return args, lambda a: engine.rollout_correction(a["train_logp"], a["rollout_logp"], a["mask"], cfg)


def _loss_inputs(rng: np.random.Generator, rows: int = 5, cols: int = 11):
    """(batch, logp, advantages, IS weights) of a policy-loss case (as conformance/test_correction.py's loss
    checks build them)."""
    b = make_batch(int(rng.integers(2**31)), rows, cols, max_delta=1.0, empty_rows=True)
    m = b.mask != 0
    noise = torch.from_numpy(rng.normal(0, 0.3, b.mask.shape).astype(np.float32))
    logp = torch.where(m, b.train_logp + noise, torch.zeros(()))
    adv = torch.from_numpy(rng.normal(0, 1, b.mask.shape).astype(np.float32))
    w, _, _ = C.is_weights(C.log_ratio(b.train_logp, b.rollout_logp, b.mask), m, C.CorrectionConfig("token", 2.0))
    return b, logp, adv, w.float()


def _inputs_correction_loss(engine, rng):
    b, logp, adv, w = _loss_inputs(rng)
    args = {"logp": logp, "old_logp": b.train_logp, "advantages": adv, "mask": b.mask, "weights": w}
    cfg = C.LossConfig(kind="ppo_clip", agg="seq-mean-token-mean", clip_ratio_c=3.0)
    return args, lambda a: engine.correction_loss(a["logp"], a["old_logp"], a["advantages"], a["mask"],
                                                  a["weights"], cfg)


def _inputs_weight_sync(engine, rng):
    sd = {k: v.clone() for k, v in fixtures.tiny_model("tiny-qwen3").state_dict.items()}
    return {"state_dict": sd}, lambda a: engine.weight_sync(a["state_dict"])


def _inputs_mx_quantize(engine, rng):
    x = scaled_normal(rng, (8, 96), spread=4)
    x[0, 1] = -0.0
    return {"x": x}, lambda a: engine.mx_quantize(a["x"], "mxfp8_e4m3")


#: op case → (capability it needs, input builder returning (named arguments, call))
INPUT_CASES: dict[str, tuple[str, Callable]] = {
    "cast": ("cast.e4m3fn", _inputs_cast),
    "round_bf16": ("cast.bf16", _inputs_round_bf16),
    "quantize-block": ("quantize.block", _inputs_quantize("block")),
    "quantize-group": ("quantize.group", _inputs_quantize("group")),
    "block_gemm": ("gemm.block", _inputs_block_gemm),
    "kv_store": ("kv.store", _inputs_kv_store),
    "kv_attention": ("kv.attention", _inputs_kv_attention),
    "kv_calibrate": ("kv.calibrate", _inputs_kv_calibrate),
    "rollout_correction": ("rollout_correction", _inputs_rollout_correction),
    "correction_loss": ("rollout_correction.loss", _inputs_correction_loss),
    "weight_sync": ("weight_sync", _inputs_weight_sync),
    "mx_quantize": ("mx_quantize.mxfp8_e4m3", _inputs_mx_quantize),
}


@pytest.mark.parametrize(("op", "cap"), [pytest.param(op, cap, id=op) for op, (cap, _) in INPUT_CASES.items()])
@check("INV-INPUT-001", "No engine op writes into its caller's tensors: after cast, round_bf16, quantize, "
       "block_gemm, kv_store, kv_attention, kv_calibrate, rollout_correction, correction_loss, weight_sync and "
       "mx_quantize every argument (non-contiguous views, -0.0 and NaN payloads included, and the tensors inside "
       "QuantizedTensor / KVCache / dicts / lists) has the same bytes, shape, stride and dtype, and every "
       "container the same keys.", requires=["{cap}"])
def test_ops_leave_inputs_exact(engine, op, cap, rng):
    args, call = INPUT_CASES[op][1](engine, rng)
    before: dict[str, Any] = {}
    for name, value in args.items():
        snapshot(value, name, before)
    call(args)
    problems: list[str] = []
    for name, value in args.items():
        compare_snapshot(value, name, before, problems)
    record_metrics(mismatch_frac=float(bool(problems)))
    assert not problems, f"{op} wrote into its caller's arguments:\n  " + "\n  ".join(problems[:8])


# ----------------------------------------------------------------------------------------------------------------
# INV-GRAD-001: only the current log-probs carry gradient


def _no_grad_flow(names: list[str], grads: tuple, ctx: str) -> None:
    for name, g in zip(names, grads):
        if g is not None and bool((g != 0).any()):
            i = _first_index(g != 0)
            raise AssertionError(f"{ctx}: the loss has a nonzero gradient with respect to {name} "
                                 f"({int((g != 0).sum())}/{g.numel()} elements; first at {i}: {float(g[i])!r}): "
                                 f"{name} must be a constant of the loss (detached)")


def _loss_grads(loss: torch.Tensor, current: torch.Tensor, others: dict[str, torch.Tensor], ctx: str) -> None:
    assert isinstance(loss, torch.Tensor) and loss.requires_grad and loss.grad_fn is not None, \
        f"{ctx}: the loss carries no gradient to the current log-probs"
    grads = torch.autograd.grad(loss, [current, *others.values()], allow_unused=True)
    assert grads[0] is not None, f"{ctx}: the loss does not depend on the current log-probs"
    _no_grad_flow(list(others), grads[1:], ctx)


def _for_each_supported(items: list, run: Callable[[Any], None]) -> None:
    """``run(item)`` for each item; an item the engine refuses (Unsupported: the guarded engine skips) is passed
    over, and the case is skipped only if the engine refuses every one."""
    refused = []
    for item in items:
        try:
            run(item)
        except pytest.skip.Exception as exc:
            refused.append(str(exc))
    if len(refused) == len(items):
        pytest.skip("every configuration refused: " + "; ".join(dict.fromkeys(refused))[:600])


def _grad_correction_loss(engine, rng) -> None:
    def run(kind_agg: tuple[str, str]) -> None:
        kind, agg = kind_agg
        b, logp, adv, w = _loss_inputs(rng)
        cfg = C.LossConfig(kind=kind, agg=agg, clip_ratio_c=3.0)
        x = logp.clone().requires_grad_(True)
        others = {"old_logp": b.train_logp.clone().requires_grad_(True), "advantages": adv.requires_grad_(True),
                  "weights": w.requires_grad_(True)}
        loss = engine.correction_loss(x, others["old_logp"], others["advantages"], b.mask, others["weights"], cfg)
        _loss_grads(loss, x, others, f"correction_loss {kind}/{agg}")

    _for_each_supported([(k, a) for k in C.LOSS_KINDS for a in C.LOSS_AGG_MODES], run)


def _grad_rollout_correction(engine, rng) -> None:
    b = make_batch(int(rng.integers(2**31)), 4, 9, max_delta=1.0, empty_rows=False)

    def run(cfg: C.CorrectionConfig) -> None:
        tr = b.train_logp.clone().requires_grad_(True)
        ro = b.rollout_logp.clone().requires_grad_(True)
        res = engine.rollout_correction(tr, ro, b.mask, cfg)
        ctx = f"rollout_correction rollout_is={cfg.rollout_is} threshold={cfg.rollout_is_threshold!r} " \
              f"norm={cfg.rollout_is_batch_normalize} rs={cfg.rollout_rs}"
        outputs = {"weights": res.weights, "mask": res.mask}
        outputs.update({f"metrics[{k!r}]": v for k, v in res.metrics.items()})
        leaking = [f"{name} (grad_fn {t.grad_fn})" for name, t in outputs.items()
                   if isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None)]
        assert not leaking, f"{ctx}: outputs carry gradient from the log-prob inputs: {', '.join(leaking[:6])}"

    _for_each_supported([C.CorrectionConfig("token", 2.0), C.CorrectionConfig("sequence", 2.0),
                         C.CorrectionConfig("token", "0.5_5.0"),
                         C.CorrectionConfig("token", 2.0, rollout_is_batch_normalize=True),
                         C.CorrectionConfig("sequence", 3.0, rollout_rs="token_k3", rollout_rs_threshold=0.5),
                         C.CorrectionConfig(None)], run)


def _grad_decoupled_loss(engine, rng) -> None:
    lcfg = C.LossConfig(kind="ppo_clip", agg="token-mean", clip_ratio_c=3.0)

    def run(ccfg: C.CorrectionConfig) -> None:
        b, logp, adv, _ = _loss_inputs(rng)
        x = logp.clone().requires_grad_(True)
        others = {"prox_logp": b.train_logp.clone().requires_grad_(True),
                  "behave_logp": b.rollout_logp.clone().requires_grad_(True), "advantages": adv.requires_grad_(True)}
        loss = engine.decoupled_loss(x, others["prox_logp"], others["behave_logp"], others["advantages"], b.mask,
                                     lcfg, ccfg)
        _loss_grads(loss, x, others, f"decoupled_loss behaviour weight {ccfg.rollout_is} {ccfg.rollout_is_threshold!r}")

    _for_each_supported([C.CorrectionConfig("token", 2.0), C.CorrectionConfig("token", "0.5_2.0")], run)


GRAD_CASES = {"rollout_correction.loss": _grad_correction_loss, "rollout_correction": _grad_rollout_correction,
              "rollout_correction.decoupled": _grad_decoupled_loss}


@pytest.mark.parametrize("cap", list(GRAD_CASES))
@check("INV-GRAD-001", "Only the current log-probs carry gradient: with every float input requiring grad, "
       "correction_loss (PPO-clip and REINFORCE, every aggregation) and decoupled_loss give old log-probs, "
       "advantages, IS weights and the proximal/behaviour log-probs no (or an all-zero) gradient, and "
       "rollout_correction with both log-prob inputs requiring grad returns weights, mask and metrics without a "
       "gradient.", requires=["{cap}"])
def test_only_current_logp_grad_exact(engine, cap, rng):
    GRAD_CASES[cap](engine, rng)


# ----------------------------------------------------------------------------------------------------------------
# INV-LAYER-001: per-layer state stays per layer


def _same_forward(before: kvref.KVForward, now: kvref.KVForward, ctx: str) -> None:
    """The two results hold the same values: shapes, dtypes and bytes of the output, both caches and the scales."""
    then: dict[str, Any] = {}
    got: dict[str, Any] = {}
    for name in ("out", "k_cache", "v_cache", "scales"):
        snapshot(getattr(before, name), name, then)
        snapshot(getattr(now, name), name, got)
    problems = []
    for path, was in then.items():
        new = got.get(path)
        if isinstance(was, _TensorState) and isinstance(new, _TensorState):
            if (was.shape, was.dtype) != (new.shape, new.dtype):
                problems.append(f"{path}: {was.shape} {was.dtype} → {new.shape} {new.dtype}")
            elif not torch.equal(was.data, new.data):
                diff = (was.data != new.data).any(dim=1)
                flat = int(diff.nonzero()[0])
                idx = tuple(int(i) for i in np.unravel_index(flat, was.shape)) if was.shape else ()
                problems.append(f"{path}: {int(diff.sum())}/{diff.numel()} elements differ; first at {idx}: "
                                f"{was.data[flat].contiguous().view(was.dtype).item()!r} → "
                                f"{new.data[flat].contiguous().view(new.dtype).item()!r}")
        elif isinstance(was, _TensorState) or isinstance(new, _TensorState) or was != new:
            problems.append(f"{path}: {type(was).__name__} {was if not isinstance(was, _TensorState) else ''} → "
                            f"{type(new).__name__} {new if not isinstance(new, _TensorState) else ''}")
    assert not problems, f"{ctx}: layer 1's kv_forward changed:\n  " + "\n  ".join(problems[:8])


@pytest.mark.parametrize("fmt", KV_FMTS)
@check("INV-LAYER-001", "A per-layer state op changes only its layer: after pushing new KV scales to layer 0, and "
       "separately after resetting layer 0 (scales=None) and running it, kv_forward on layer 1 with the same "
       "inputs returns the same scales, caches and output, bit for bit.",
       requires=["kv.update_scales", "kv.forward"])
def test_layer_state_isolated_exact(engine, fmt, seed, rng):
    engine.kv_policy(fmt, "tensor")
    layers = (f"INV-LAYER-001/{fmt}/{seed}/layer0", f"INV-LAYER-001/{fmt}/{seed}/layer1")
    q = torch.from_numpy(rng.standard_normal((1, 8, 4, 16)).astype(np.float32) * 2)
    k = torch.from_numpy(rng.standard_normal((1, 8, 2, 16)).astype(np.float32) * 3)
    v = torch.from_numpy(rng.standard_normal((1, 8, 2, 16)).astype(np.float32))
    base = kvref.calibrate([[(q, k, v)]], "amax", layout="tensor", fmt=fmt)
    s0 = kvref.KVScales.of(base.q, base.k, base.v)
    s1 = kvref.KVScales.of(base.q * 1.5, base.k * 0.75, base.v * 2.0)
    engine.kv_update_scales(layers[0], s0)
    engine.kv_update_scales(layers[1], s1)
    engine.kv_forward(layers[0], q, k, v, fmt=fmt)
    ref = engine.kv_forward(layers[1], q, k, v, fmt=fmt)
    # the layer-1 result compared below must be the engine's own answer, twice the same (deterministic)
    _same_forward(ref, engine.kv_forward(layers[1], q, k, v, fmt=fmt), "a repeated call (nothing pushed)")
    engine.kv_update_scales(layers[0], kvref.KVScales.of(base.q * 3.0, base.k * 3.0, base.v * 3.0))
    engine.kv_forward(layers[0], q * 2, k * 2, v * 2, fmt=fmt)
    _same_forward(ref, engine.kv_forward(layers[1], q, k, v, fmt=fmt), "after pushing new scales to layer 0")
    engine.kv_update_scales(layers[0], None)
    engine.kv_forward(layers[0], q * 4, k * 4, v * 4, fmt=fmt)  # layer 0 recalibrates from this batch
    _same_forward(ref, engine.kv_forward(layers[1], q, k, v, fmt=fmt),
                  "after resetting layer 0 (scales=None) and running it")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(FINITE_CASES))
@check("INV-STATE-001", "An op's result depends on its arguments only: quantizing input B right after input A of the "
       "same shape (A's amax 1000x B's) gives bit for bit what quantizing B alone gives (scales and codes), for every "
       "granularity kind in fp32 and bf16 — no scale, amax or code cached from an earlier call (keyed by shape, "
       "layer or tensor name) is reused.", bound="exact", requires=["quantize.{kind}"])
def test_results_depend_on_arguments_only_exact(engine, kind, dtype, rng):
    g, shape = FINITE_CASES[kind]
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    b = scaled_normal(rng, shape, spread=4).to(tdtype)
    a = (b.float() * 1000.0 + 1.0).to(tdtype)  # same shape, other values: another amax in every group
    S.skip_if_limited(engine, "quantize", f"dtype.x={dtype}")
    alone = engine.quantize(b.clone(), g)
    engine.quantize(a, g)
    after = engine.quantize(b.clone(), g)
    what = f"quantize[{kind}] {dtype} {tuple(shape)}"
    same_scale = torch.equal(alone.scale.view(torch.uint8), after.scale.view(torch.uint8))
    same_codes = torch.equal(alone.codes, after.codes)
    if not (same_scale and same_codes):
        diff = (alone.scale != after.scale).nonzero()[:1].tolist()
        ncodes = int((alone.codes != after.codes).sum())
        raise AssertionError(f"{what}: quantizing B after A differs from quantizing B alone: "
                             f"{int((alone.scale != after.scale).sum())} scales differ (first at {diff}: alone "
                             f"{alone.scale.reshape(-1)[0].item() if not diff else alone.scale[tuple(diff[0])].item()!r}, "
                             f"after {after.scale.reshape(-1)[0].item() if not diff else after.scale[tuple(diff[0])].item()!r}), "
                             f"{ncodes} codes differ: the op keeps state from an earlier call")
