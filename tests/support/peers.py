"""The ``peers`` tier: an upstream's own quantizer against the preset that claims it, bit for bit.

Each ``tests/engines/<tier>/test_peers_*.py`` lists :class:`PeerCase` rows — a preset, a granularity, and a call
of the installed package's *own* Python function (a native fallback, ``forward_native``, a pure-torch helper) that
returns its FP8 codes and scales — and runs every row on the fixed :data:`BATTERY` of input kinds in fp32 and bf16:
random normal, heavy-tailed, values on FP8 ties, all-zero blocks, amax 1e-12, fp32 subnormals, ±max finite, ±inf,
NaN, scales 0-3 ulps above a power of two, a non-divisible 129×257 shape and an all-zero tensor. Codes must equal
the oracle's (:func:`fp8rl.reference.quant.quantize` under the preset) exactly and scales bit for bit; two NaNs
count as equal (codes 0x7F/0xFF, NaN scales of any payload: the sign and payload of a NaN come from the vector
unit that produced it, e.g. torch's vectorized amax gives 0xFFFFFFFF, not from the formula); a mismatch fails with the counts and the first differing element.

Nothing here copies upstream code: the callables call the installed package, or the case is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from fp8rl.reference.presets import PRESETS
from fp8rl.reference.quant import Granularity, quantize

#: (rows, cols) of every battery item but the non-divisible one; divisible by the 128×128 blocks
SHAPE = (256, 256)
ODD_SHAPE = (129, 257)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _e4m3_ties() -> np.ndarray:
    """Midpoints between consecutive positive finite e4m3fn values (exact in fp32 and, below 2^-6·8, in bf16)."""
    from fp8rl.reference.formats import decode_codes

    vals = np.sort(decode_codes(np.arange(0, 0x7F, dtype=np.uint8), "e4m3fn").astype(np.float64))
    return ((vals[:-1] + vals[1:]) / 2).astype(np.float32)


def _item(name: str, dtype: torch.dtype) -> torch.Tensor:
    """One battery input (seeded; the same tensor every run)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    big = float(torch.finfo(dtype).max)
    if name == "odd_shape_normal":
        return torch.from_numpy(rng.standard_normal(ODD_SHAPE).astype(np.float32)).to(dtype)
    if name == "all_zero":
        return torch.zeros(SHAPE, dtype=dtype)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    if name == "normal":
        pass
    elif name == "heavy_tailed":
        x = (rng.standard_cauchy(SHAPE) * 10.0).astype(np.float32)
    elif name == "fp8_ties":
        ties = _e4m3_ties()
        x = rng.choice(ties, SHAPE) * rng.choice([-1.0, 1.0], SHAPE).astype(np.float32)
        x[:, ::128] = 448.0  # every row/group/block holds 448: s = 1 (m = 1) and the ties stay ties
    elif name == "zero_blocks":
        x[:128, :128] = 0.0
        x[200, :] = 0.0
    elif name == "amax_1e-12":
        x = (x * 3e-13).astype(np.float32)
        x[:, ::128] = 1e-12
    elif name == "fp32_subnormals":
        x = (x * 1e-40).astype(np.float32)
    elif name == "max_finite":
        x[3, 5] = big
        x[130, 140] = -big
        x[7, :] = big
    elif name == "inf":
        x[3, 5] = np.inf
        x[130, 140] = -np.inf
    elif name == "nan":
        x[3, 5] = np.nan
        x[200, 250] = np.nan
    elif name == "pow2_ulps":
        # each 1x128 group's amax is 0..3 fp32 ulps above 448·2^k, so amax/448 is 0-3 ulps above a power of two
        x = (x * 0.01).astype(np.float32)
        for r in range(SHAPE[0]):
            for c in range(0, SHAPE[1], 128):
                a = np.float32(448.0 * 2.0 ** ((r % 16) - 8))
                for _ in range((r + c // 128) % 4):
                    a = np.nextafter(a, np.float32(np.inf))
                x[r, c + (r % 128)] = a * (1 if r % 2 else -1)
                x[r, c:c + 128] = np.clip(x[r, c:c + 128], -float(a), float(a))
    else:
        raise ValueError(f"battery: unknown item {name!r}")
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


BATTERY: tuple[str, ...] = ("normal", "heavy_tailed", "fp8_ties", "zero_blocks", "amax_1e-12", "fp32_subnormals",
                            "max_finite", "inf", "nan", "pow2_ulps", "odd_shape_normal", "all_zero")


def battery_input(name: str, dtype_name: str) -> torch.Tensor:
    return _item(name, DTYPES[dtype_name])


@dataclass(frozen=True)
class PeerCase:
    """An upstream function that claims a preset: ``fn(x) -> (codes or fp8 tensor, scales)`` in the oracle's layout
    (scales of shape ``granularity.scale_shape(x.shape)``). ``divisible``: the function takes only shapes the
    granularity divides (the 129×257 item is skipped with ``why_divisible``); ``dtypes``: the input dtypes it
    takes."""

    preset: str
    granularity: Granularity
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    upstream: str
    divisible: bool = False
    why_divisible: str = ""
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    skip_items: dict[str, str] = field(default_factory=dict)


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.contiguous().view(torch.uint8) if q.dtype != torch.uint8 else q


def _bits(s: torch.Tensor) -> torch.Tensor:
    return s.to(torch.float32).contiguous().view(torch.int32)


@dataclass
class Agreement:
    codes_equal: int = 0
    codes_total: int = 0
    scales_equal: int = 0
    scales_total: int = 0

    def add(self, other: Agreement) -> None:
        self.codes_equal += other.codes_equal
        self.codes_total += other.codes_total
        self.scales_equal += other.scales_equal
        self.scales_total += other.scales_total


def compare(case: PeerCase, item: str, dtype_name: str, *, policy=None) -> tuple[Agreement, str]:
    """Run ``case`` on one battery input; (agreement counts, '' or a description of the first difference).
    ``policy``: judge against this policy instead of the case's preset (mutant presets)."""
    x = battery_input(item, dtype_name)
    codes_up, scale_up = case.fn(x.clone())
    ref = quantize(x, case.granularity, policy if policy is not None else PRESETS[case.preset])
    codes_up = _codes(codes_up).reshape(ref.codes.shape)
    scale_up = scale_up.to(torch.float32).reshape(ref.scale.shape)
    nan_code = torch.tensor([0x7F, 0xFF], dtype=torch.uint8) if ref.fmt == "e4m3fn" else None
    same_codes = codes_up == ref.codes
    if nan_code is not None:  # a NaN's sign bit comes from the vector unit that made it, not from the formula
        same_codes |= torch.isin(codes_up, nan_code) & torch.isin(ref.codes, nan_code)
    both_nan = torch.isnan(scale_up) & torch.isnan(ref.scale)
    same_scales = (_bits(scale_up) == _bits(ref.scale)) | both_nan
    agr = Agreement(int(same_codes.sum()), same_codes.numel(), int(same_scales.sum()), same_scales.numel())
    msg = ""
    if not bool(same_scales.all()):
        i = tuple(int(v) for v in torch.nonzero(~same_scales)[0])
        msg = (f"scales differ in {agr.scales_total - agr.scales_equal}/{agr.scales_total}; first at {i}: upstream "
               f"{scale_up[i].item()!r} (0x{_bits(scale_up)[i].item() & 0xFFFFFFFF:08x}), preset "
               f"{ref.scale[i].item()!r} (0x{_bits(ref.scale)[i].item() & 0xFFFFFFFF:08x})")
    if not bool(same_codes.all()):
        i = tuple(int(v) for v in torch.nonzero(~same_codes)[0])
        msg += ("; " if msg else "") + (
            f"codes differ in {agr.codes_total - agr.codes_equal}/{agr.codes_total}; first at {i}: x = "
            f"{x[i].item()!r}, upstream 0x{int(codes_up[i]):02x}, preset 0x{int(ref.codes[i]):02x} (scale there: "
            f"upstream {_scale_at(scale_up, case.granularity, x.shape, i)!r}, preset "
            f"{_scale_at(ref.scale, case.granularity, x.shape, i)!r})")
    return agr, msg


def _scale_at(scale: torch.Tensor, g: Granularity, shape, i) -> float:
    from fp8rl.reference.quant import expand_scale

    return float(expand_scale(scale, g, tuple(shape))[i])


def run_case(case: PeerCase, item: str, dtype_name: str) -> None:
    """The test body: skip what the function does not take, else demand bit-exact agreement."""
    if dtype_name not in case.dtypes:
        pytest.skip(f"{case.upstream} takes {case.dtypes} inputs, not {dtype_name}")
    if item in case.skip_items:
        pytest.skip(case.skip_items[item])
    if item == "odd_shape_normal" and case.divisible:
        pytest.skip(case.why_divisible or f"{case.upstream} takes only shapes its {case.granularity.label} divides")
    _, msg = compare(case, item, dtype_name)
    assert not msg, f"{case.upstream} vs preset {case.preset!r} on {item} ({dtype_name}): {msg}"


def table(cases: dict[str, PeerCase]) -> dict[str, Agreement]:
    """Per preset, the agreement over every case and battery input it takes (the closing table's numbers)."""
    out: dict[str, Agreement] = {}
    for case in cases.values():
        for item in BATTERY:
            for dt in case.dtypes:
                if item in case.skip_items or (item == "odd_shape_normal" and case.divisible):
                    continue
                agr, _ = compare(case, item, dt)
                out.setdefault(case.preset, Agreement()).add(agr)
    return out
