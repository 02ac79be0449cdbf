"""fp8rl.policy_lint: declared ScalePolicy / KVPolicy checked against the dtypes they compute in.

The vendor case: s = max(amax/448, 1e-12) computed in the input dtype, where 1e-12 is 0 in fp16 (shown below with
plain torch), declared as ScalePolicy(floor="scale", eps=1e-12, compute_dtype="input"): an error. The double rounding
of compute_dtype="input" is a listed deviation, and its derived extra error is checked against plain torch casts.
"""

from __future__ import annotations

import math

import pytest
import torch
from fp8rl.engine import Unsupported
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.policy_lint import (
    DTYPES,
    PolicyLint,
    compute_dtypes,
    double_rounding_bound,
    lint_engine,
    lint_kv_policy,
    lint_scale_policy,
    round_to,
)
from fp8rl.reference.formats import get_format
from fp8rl.reference.kv import KV_FORMATS, LAYOUTS, KVPolicy, default_policy
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import PRESETS
from fp8rl.reference.quant import GRANULARITY_KINDS, Granularity, quantize, quantize_with_scale

ACME = ScalePolicy(name="acme", floor="scale", eps=1e-12, compute_dtype="input", zero_amax="floor")
ACME_FP16 = ("eps=1e-12 rounds to 0 in fp16 (compute_dtype='input'): an all-zero group gets scale 0 and NaN codes, "
             "a group of amax 2^-24 (5.96e-8) gets scale 0 and codes ±448; use an eps >= 2^-24 (5.96e-8) that is "
             "representable, or compute the scale in fp32")


# ---- errors -----------------------------------------------------------------------------------------------------


def test_vendor_eps_rounds_to_zero_in_fp16_is_an_error_exact():
    # plain torch, no fp8rl: 1e-12 is 0 in fp16 (below 2^-25), not in bf16 or fp32
    assert torch.tensor(1e-12, dtype=torch.float16) == 0
    assert torch.tensor(1e-12, dtype=torch.bfloat16) != 0 and torch.tensor(1e-12, dtype=torch.float32) != 0
    # ... so the vendor's fp16 quantizer gives scale 0 and NaN codes for an all-zero block, 448 for a block of 1e-6
    zero = torch.zeros(4, dtype=torch.float16)
    s = torch.clamp(zero.abs().amax() / 448, min=1e-12)
    assert s.dtype == torch.float16 and s.item() == 0.0
    assert torch.isnan((zero / s).clamp(-448, 448)).all()
    tiny = torch.full((4,), 1e-6, dtype=torch.float16)
    s = torch.clamp(tiny.abs().amax() / 448, min=1e-12)
    assert s.item() == 0.0 and (tiny / s).clamp(-448, 448).tolist() == [448.0] * 4

    lint = lint_scale_policy(ACME, "block")
    assert lint.errors == (ACME_FP16,)
    assert not lint.ok and lint.warnings == ()
    # the oracle under the declared policy reproduces exactly that (so exact checks alone would pass)
    q = quantize(torch.zeros(1, 8, dtype=torch.float16), Granularity.tensor(), ACME)
    assert q.scale.item() == 0.0 and torch.isnan(q.values()).all()


def test_vendor_case_with_an_fp32_scale_or_a_representable_eps_is_fine_exact():
    for fixed in (ScalePolicy(name="acme32", floor="scale", eps=1e-12),
                  ScalePolicy(name="acme-amax32", floor="amax", eps=1e-12),
                  ScalePolicy(name="acme-eps", floor="scale", eps=2.0 ** -24, compute_dtype="input")):
        lint = lint_scale_policy(fixed, "block")
        assert lint.errors == () and lint.warnings == (), fixed.name
    assert compute_dtypes(ScalePolicy(name="a", floor="scale", eps=1e-12)) == ("fp32",)
    assert compute_dtypes(ACME) == ("fp32", "bf16", "fp16")
    # eps = 2^-25 is a tie that rounds to the even 0 in fp16: still an error
    assert round_to(2.0 ** -25, "fp16") == 0.0 and round_to(2.0 ** -24, "fp16") == 2.0 ** -24
    assert lint_scale_policy(ScalePolicy(name="tie", floor="scale", eps=2.0 ** -25, compute_dtype="input"),
                             "block").errors


def test_subnormal_fp16_floor_whose_reciprocal_overflows_is_an_error_exact():
    # 2^-20 is an fp16 subnormal (min normal 2^-14); its reciprocal 2^20 is beyond fp16's 65504: inf
    eps = torch.tensor(2.0 ** -20, dtype=torch.float16)
    assert eps.item() == 2.0 ** -20 and eps.item() < torch.finfo(torch.float16).smallest_normal
    assert torch.isinf(1 / eps) and torch.isnan(torch.zeros(1, dtype=torch.float16) * (1 / eps)).all()
    p = ScalePolicy(name="sub", floor="scale", eps=2.0 ** -20, quant_op="mul_recip", compute_dtype="input")
    lint = lint_scale_policy(p, "group")
    assert lint.errors == (
        "eps=9.53674e-07 gives the smallest scale s_min = 9.54e-7, whose reciprocal 1/s_min = 1.05e6 exceeds 65504, "
        "the max finite of fp16 (compute_dtype='input'), so R(1/s_min) = inf: an all-zero group gets scale 9.54e-7 "
        "and NaN codes; use an eps >= 2^-15 (3.05e-5) that is representable, or compute the scale in fp32",)
    # 2^-15: 1/s = 32768 is finite in fp16
    assert lint_scale_policy(ScalePolicy(name="ok", floor="scale", eps=2.0 ** -15, quant_op="mul_recip",
                                         compute_dtype="input"), "group").errors == ()
    # the same floor with true division cannot overflow (|x/s| ≤ T when s is the floor)
    assert lint_scale_policy(ScalePolicy(name="div", floor="scale", eps=2.0 ** -20, compute_dtype="input"),
                             "group").errors == ()


def test_fp32_floor_that_vanishes_or_overflows_is_an_error_for_either_floor_exact():
    lint = lint_scale_policy(ScalePolicy(name="a50", floor="amax", eps=1e-50), "token")
    assert len(lint.errors) == 1 and lint.errors[0].startswith("eps=1e-50 rounds to 0 in fp32: an all-zero group "
                                                               "gets scale 0 and NaN codes")
    lint = lint_scale_policy(ScalePolicy(name="a40", floor="amax", eps=1e-40, quant_op="mul_recip"), "token")
    assert len(lint.errors) == 1 and "exceeds 3.4e38, the max finite of fp32, so R(1/s_min) = inf" in lint.errors[0]


def test_scale_floor_that_does_not_reach_the_multiplier_is_an_error_exact():
    p = ScalePolicy(name="bypass", floor="scale", eps=1e-10, quant_op="mul_max_over_amax")
    (err,) = lint_scale_policy(p, "token").errors
    assert err.startswith("floor='scale' (eps=1e-10) does not reach the multiplier m = T/amax")
    assert "an all-zero group gets scale 1e-10 and NaN codes" in err


def test_unguarded_declarations_are_not_errors_exact():
    for p in (ScalePolicy(name="nan", floor="none", eps=0.0, zero_amax="nan"),
              ScalePolicy(name="nan-in", floor="none", eps=0.0, zero_amax="nan", compute_dtype="input"),
              PRESETS["torchao_float8"], PRESETS["compressed_tensors_fp8"], PRESETS["hf_finegrained_fp8"]):
        assert lint_scale_policy(p, "tensor").errors == (), p.name


def test_amax_floor_that_vanishes_in_fp16_is_a_warning_exact():
    # sglang_native (verified upstream formula: clamp(min=1e-12) of the input-dtype amax) loses its floor in fp16:
    # accepted as declared, listed as a warning, not an error
    lint = lint_scale_policy("sglang_native", "token")
    assert lint.errors == ()
    assert lint.warnings == (
        "eps=1e-12 rounds to 0 in fp16 (compute_dtype='input'): an all-zero group gets scale 0 and NaN codes, a group "
        "of amax 2^-24 (5.96e-8) gets scale 0 and codes ±448; use an eps >= 2^-16 (1.53e-5) that is representable, "
        "or compute the scale in fp32",)
    q = quantize(torch.zeros(1, 4, dtype=torch.float16), Granularity.token(), "sglang_native")
    assert torch.isnan(q.values()).all()
    assert lint_scale_policy("vllm_scaled_quantize", "block").errors == ()


def test_every_preset_lints_without_errors_exact():
    for name, p in PRESETS.items():
        for kind in GRANULARITY_KINDS:
            assert lint_scale_policy(p, kind).errors == (), (name, kind)
    warned = {n for n, p in PRESETS.items() if lint_scale_policy(p, "block").warnings}
    assert warned == {"sglang_native", "vllm_scaled_quantize"}


# ---- KV ---------------------------------------------------------------------------------------------------------


def test_kv_policies_exact():
    for fmt in KV_FORMATS:
        for layout in LAYOUTS:
            assert lint_kv_policy(default_policy(fmt, layout), fmt, layout) == PolicyLint()
    assert torch.tensor(1e-50, dtype=torch.float32) == 0
    (err,) = lint_kv_policy(KVPolicy(layout="token_head", token_head_floor=1e-50), "e4m3fn", "token_head").errors
    assert err == ("token_head_floor=1e-50 rounds to 0 in fp32: an all-zero (token, head) gets scale 0 and NaN "
                   "codes; use a token_head_floor >= 2^-149 (1.4e-45)")
    # an fp32-subnormal floor: fine for x/s, its reciprocal overflows fp32 for x·fl32(1/s)
    assert torch.isinf(1 / torch.tensor(1e-40, dtype=torch.float32))
    div = KVPolicy(layout="token_head", token_head_floor=1e-40, quant_op="div")
    assert lint_kv_policy(div, "e4m3fn", "token_head").errors == ()
    rec = KVPolicy(layout="token_head", token_head_floor=1e-40, quant_op="mul_recip")
    (err,) = lint_kv_policy(rec, "e4m3fn", "token_head").errors
    assert "so fl32(1/s) = inf (quant_op='mul_recip'): an all-zero (token, head) gets scale 1e-40 and NaN codes" in err
    # static layouts have no floor: nothing to lint
    assert lint_kv_policy(KVPolicy(layout="tensor", token_head_floor=1e-50), "e4m3fn", "tensor") == PolicyLint()


# ---- deviations -------------------------------------------------------------------------------------------------


def test_double_rounding_deviation_listed_for_input_only_exact():
    (dev,) = lint_scale_policy(ACME, "block").deviations
    assert dev == {
        "kind": "block", "policy": "acme", "field": "compute_dtype", "value": "input", "dtypes": ["bf16", "fp16"],
        "what": "x/s is rounded to bf16/fp16 before the cast to e4m3fn (double rounding)",
        "extra_error": "a code may be the other FP8 neighbour of x/s, 1 e4m3fn ulp from single rounding, when x/s "
                       "lies within 2^-p_in relative of an FP8 rounding midpoint; bf16: |deq − x| ≤ s·(2^-4 + "
                       "2^-8)·|x/s| = 0.0664·s·|x/s|; fp16: |deq − x| ≤ s·(2^-4 + 2^-11)·|x/s| = 0.063·s·|x/s| in "
                       "e4m3fn's normal range (single rounding: s·2^-4·|x/s|)"}
    assert lint_scale_policy("sglang_native", "token").deviations[0]["policy"] == "sglang_native"
    e5 = lint_scale_policy(ACME.for_format("e5m2"), "group").deviations[0]
    assert e5["kind"] == "group" and "(2^-3 + 2^-11)" in e5["extra_error"]
    for cd in ("fp32", "scale_input"):
        p = ScalePolicy(name=cd, floor="scale", eps=2.0 ** -10, compute_dtype=cd)
        assert lint_scale_policy(p, "block").deviations == (), cd
    assert double_rounding_bound("e4m3fn", "bf16") == 2.0 ** -4 + 2.0 ** -8
    assert double_rounding_bound("e5m2", "fp16") == 2.0 ** -3 + 2.0 ** -11


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("in_name", ["bf16", "fp16"])
def test_double_rounding_extra_error_bound(fmt, in_name):
    """Single (fp32 x/s → FP8) vs double (x/s in the input dtype → FP8) rounding with plain torch casts, over
    values spanning FP8's normal range; the oracle's compute_dtype="input" / "fp32" codes are the same two."""
    in_dt = DTYPES[in_name]
    f8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    f = get_format(fmt)
    gen = torch.Generator().manual_seed(0)
    n = 1 << 17
    # a scale of the input dtype (as the input-dtype pipeline has), not a power of two
    s_in = torch.tensor(3.0 / 448.0, dtype=in_dt)
    s = float(s_in)
    lo, hi = math.log2(f.min_normal), math.log2(f.max_finite)
    z = torch.exp2(lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    x = (sign * z * s).to(in_dt)
    z_exact = x.double() / s
    keep = (z_exact.abs() >= f.min_normal) & (z_exact.abs() <= f.max_finite)
    x, z_exact = x[keep], z_exact[keep]
    assert x.numel() > n // 2

    single = (x.float() / s_in.float()).to(f8)          # fl32(x/s) → FP8
    double = (x / s_in).to(f8)                          # R_in(x/s) → FP8 (torch computes bf16/fp16 x/s so)
    c1, c2 = single.view(torch.uint8), double.view(torch.uint8)
    # the oracle models the same two paths
    g = Granularity.tensor()
    p_in = ScalePolicy(name="in", floor="scale", eps=2.0 ** -10, fmt=fmt, compute_dtype="input")
    p_32 = ScalePolicy(name="f32", floor="scale", eps=2.0 ** -10, fmt=fmt)
    st = torch.tensor([s], dtype=torch.float32)
    assert torch.equal(quantize_with_scale(x, st, g, p_in), c2)
    assert torch.equal(quantize_with_scale(x, st, g, p_32), c1)

    differ = c1 != c2
    assert differ.any(), "double rounding never changed a code: the deviation would not be real"
    # at most 1 FP8 ulp apart: same sign bit, magnitude codes adjacent (codes are monotone in magnitude)
    assert torch.equal(c1 & 0x80, c2 & 0x80)
    assert ((c1 & 0x7F).int() - (c2 & 0x7F).int()).abs().max().item() <= 1

    # |deq − x| ≤ s·(2^-p_fp8 + 2^-p_in)·|x/s| = c·|x| (exact in fp64: c·s, x and c·|x| are all exact there)
    coef = double_rounding_bound(fmt, in_name)
    deq2 = double.double() * s
    err2 = (deq2 - x.double()).abs()
    ratio = (err2 / (coef * x.double().abs())).max().item()
    assert ratio <= 1.0, ratio
    # single rounding stays within its own half ulp, 2^-p_fp8 relative; where the codes differ, double rounding
    # picked the farther neighbour
    err1 = (single.double() * s - x.double()).abs()
    assert (err1 <= 2.0 ** -(f.man_bits + 1) * x.double().abs()).all()
    assert (err2[differ] > err1[differ]).all()


# ---- engines ----------------------------------------------------------------------------------------------------


class _AcmeEngine(ReferenceEngine):
    name = "acme"

    def __init__(self):
        super().__init__({"block": ScalePolicy(name="acme-block", floor="scale", eps=1e-12, compute_dtype="input"),
                          "token": "sglang_native"})


class _OddEngine(ReferenceEngine):
    name = "odd"

    def scale_policy(self, kind):
        if kind == "tensor":
            raise Unsupported("no per-tensor quantizer")
        if kind == "token":
            return "not a policy"
        return super().scale_policy(kind)

    def kv_policy(self, fmt, layout):
        if fmt == "e5m2":
            raise Unsupported("no e5m2 cache")
        return {"layout": layout}


def test_lint_engine_reference_has_no_errors_exact():
    eng = ReferenceEngine()
    lint = lint_engine(eng, eng.capabilities())
    assert lint == PolicyLint() and lint.ok
    assert lint_engine(eng) == lint  # caps default to engine.capabilities()


def test_lint_engine_prefixes_and_skips_exact():
    eng = _AcmeEngine()
    lint = lint_engine(eng, eng.capabilities())
    assert lint.errors == ("scale_policy('block') 'acme-block': " + ACME_FP16,)
    assert [w.split(":")[0] for w in lint.warnings] == ["scale_policy('token') 'sglang_native'"]
    assert sorted((d["kind"], d["policy"]) for d in lint.deviations) == [("block", "acme-block"),
                                                                         ("token", "sglang_native")]
    assert lint.as_dict()["errors"] == list(lint.errors)
    # only what the caps declare True is linted
    caps = {k: v for k, v in eng.capabilities().items() if k != "quantize.block"}
    caps["quantize.block"] = "not on this build"
    assert lint_engine(eng, caps).errors == ()
    # Unsupported and non-policy answers are skipped
    odd = _OddEngine()
    assert lint_engine(odd, odd.capabilities()) == PolicyLint()


def test_merged_lists_identical_deviations_once_exact():
    lint = lint_scale_policy(ACME, "block")
    both = PolicyLint().merged(lint, "a: ").merged(lint, "a: ")
    assert both.deviations == lint.deviations and both.errors == ("a: " + ACME_FP16,)


def test_builtin_engines_and_mutants_lint_without_errors_exact():
    from fp8rl.mutants import MUTANTS
    from fp8rl.registry import BUILTINS, EngineLoadError, load_engine

    linted = 0
    for name in BUILTINS:
        try:
            eng = load_engine(name)
        except EngineLoadError:
            continue
        assert lint_engine(eng, eng.capabilities()).errors == (), name
        linted += 1
    assert linted >= 1
    for name, m in MUTANTS.items():
        eng = m.factory()
        assert lint_engine(eng, eng.capabilities()).errors == (), name
