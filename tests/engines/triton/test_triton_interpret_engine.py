"""The Triton interpreter as an instrument: its own conversions (findings) and the faithful-downcast workaround.

Needs ``triton`` (the ``[triton]`` extra; CI runs this file in the SGLang/Triton venv). Skips with the reason
elsewhere. Every expected value comes from the oracle (``fp8rl.reference.formats``) or from hand-worked cases.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.upstream import pin_marks  # noqa: E402

#: every test here pins Triton 3.9.0's interpreter (its conversions and the workaround's scope)
pytestmark = pin_marks("triton", "==3.9.0", "Triton 3.9.0 interpreter: fp32/bf16 -> fp8/bf16 conversions")
TI = pytest.importorskip("fp8rl.engines._triton_interp")
if TI.triton_reason():
    pytest.skip(TI.triton_reason(), allow_module_level=True)

from fp8rl.engines.triton_interpret import TritonInterpretEngine, TritonInterpretFaithfulEngine  # noqa: E402
from fp8rl.reference.formats import bf16_bits_rne, decode_codes, encode  # noqa: E402
from fp8rl.reference.quant import Granularity, quantize  # noqa: E402

RAW = TritonInterpretEngine()
FAITHFUL = TritonInterpretFaithfulEngine()
if RAW._reason:
    pytest.skip(RAW._reason, allow_module_level=True)


def _cast_values(engine, values, fmt):
    return decode_codes(engine.cast(torch.tensor(values, dtype=torch.float32), fmt).numpy(), fmt).tolist()


# -- findings about the raw interpreter (hand-worked cases) -----------------------------------------------------

def test_raw_interpreter_loses_mantissa_carry_exact():
    # 31.6 in e4m3fn: 1.975·2^4, mantissa rounds up to 2.0 → 32 (exponent 5). The interpreter ORs the carry into
    # the exponent field (odd exponent 4 → stays 4) and the mantissa bits become 0: 16.
    assert _cast_values(FAITHFUL, [31.6, 126.3], "e4m3fn") == [32.0, 128.0]
    assert _cast_values(RAW, [31.6, 126.3], "e4m3fn") == [16.0, 64.0]


def test_raw_interpreter_rounds_ties_up_exact():
    # -400 is the tie between -384 (mantissa 100, even) and -416 (101): RNE gives -384
    assert _cast_values(FAITHFUL, [-400.0], "e4m3fn") == [-384.0]
    assert _cast_values(RAW, [-400.0], "e4m3fn") == [-416.0]


def test_raw_interpreter_overflow_and_nan_exact():
    got = _cast_values(RAW, [float("inf"), 537.6, float("nan")], "e4m3fn")
    assert got[:2] == [256.0, 256.0]  # not saturated to 448
    assert got[2] == 384.0  # NaN became a finite value
    f = _cast_values(FAITHFUL, [float("inf"), -float("inf"), 537.6, float("nan")], "e4m3fn")
    assert f[:3] == [448.0, -448.0, 448.0] and np.isnan(f[3])
    assert _cast_values(RAW, [68812.8], "e5m2") == [float("inf")]
    assert _cast_values(FAITHFUL, [68812.8, float("inf")], "e5m2") == [57344.0, 57344.0]


def test_interpreter_upcasts_e4m3fn_nan_code_to_480_exact():
    # the up-conversion is outside the faithful-downcast workaround: e4m3fn's NaN codes 0x7f/0xff decode to ±480
    # (the bit pattern read as plain e4m3, no fn NaN rule), in a plain .to(tl.float32) and inside tl.dot. torch (the
    # oracle's peer here) decodes them to NaN. GEMM-SPACE-001's NaN-code classes on SGLang fail because of this.
    import triton
    import triton.language as tl

    @triton.jit
    def upcast(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.float32))

    @triton.jit
    def dot16(a_ptr, b_ptr, o_ptr):
        i = tl.arange(0, 16)
        a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
        b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
        tl.store(o_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))

    codes = torch.tensor([0x7F, 0xFF, 0x7E, 0x01], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.isnan(codes.float()[:2]).all()  # torch: NaN
    for mode in ("raw", "faithful"):
        with TI.conversions(mode):
            out = torch.empty(4)
            upcast[(1,)](codes, out, N=4)
            assert out.tolist() == [480.0, -480.0, 448.0, 2.0**-9]
            a = torch.ones(16, 16).to(torch.float8_e4m3fn)
            a.view(torch.uint8)[0, 0] = 0x7F
            o = torch.empty(16, 16)
            dot16[(1,)](a, torch.ones(16, 16).to(torch.float8_e4m3fn), o)
            assert o[0].tolist() == [495.0] * 16 and o[1].tolist() == [16.0] * 16  # 480 + 15, not NaN


def test_raw_interpreter_truncates_fp32_to_bf16_exact():
    x = torch.tensor([1.0 + 2.0 ** -8 + 2.0 ** -9, 1.0 + 2.0 ** -7 + 2.0 ** -8 + 2.0 ** -10],
                     dtype=torch.float32)  # both round up under RNE (dropped part > half an ulp)
    raw = RAW.round_bf16(x).view(torch.int16).numpy().astype(np.uint16)
    trunc = (x.numpy().view(np.uint32) >> 16).astype(np.uint16)
    assert raw.tolist() == trunc.tolist()
    assert FAITHFUL.round_bf16(x).view(torch.int16).numpy().astype(np.uint16).tolist() == bf16_bits_rne(x).tolist()
    assert (bf16_bits_rne(x) != trunc).all()


def test_raw_interpreter_turns_low_payload_nan_into_inf_exact():
    x = torch.from_numpy(np.array([0x7F800001], dtype=np.uint32).view(np.float32))
    assert RAW.round_bf16(x).float().isinf().all()
    assert FAITHFUL.round_bf16(x).float().isnan().all()


# -- the workaround, against the oracle -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_faithful_cast_matches_oracle_exact(fmt):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(1 << 16) * np.exp2(rng.integers(-24, 20, 1 << 16))).astype(np.float32)
    x = np.concatenate([x, [np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45]]).astype(np.float32)
    xt = torch.from_numpy(x)
    got = FAITHFUL.cast(xt, fmt).numpy()
    exp = encode(xt, fmt, "saturate").numpy()
    nan = np.isnan(x)
    assert (got[~nan] == exp[~nan]).all()
    assert np.isnan(decode_codes(got[nan], fmt)).all()


def test_faithful_bf16_input_path_matches_oracle_exact():
    b = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = FAITHFUL.cast(b, "e4m3fn").numpy()
    exp = encode(b.float(), "e4m3fn", "saturate").numpy()
    nan = b.float().isnan().numpy()
    assert (got[~nan] == exp[~nan]).all()


@pytest.mark.parametrize("g", [Granularity.token(), Granularity.group(128), Granularity.block(128),
                               Granularity.tensor()], ids=str)
def test_faithful_quantizer_matches_reference_policy_exact(g):
    rng = np.random.default_rng(3)
    x = torch.from_numpy((rng.standard_normal((130, 300)) * np.exp2(rng.integers(-6, 6, (1, 300)))).astype(np.float32))
    got = FAITHFUL.quantize(x, g)
    exp = quantize(x, g, "reference")
    assert torch.equal(got.scale, exp.scale.to(torch.float32))
    assert torch.equal(got.codes, exp.codes)


def test_conversions_mode_is_scoped_exact():
    with TI.conversions("faithful"):
        with TI.conversions("raw"):
            inner = _cast_values(RAW, [31.6], "e4m3fn")
        outer = _cast_values(FAITHFUL, [31.6], "e4m3fn")
    assert inner == [16.0] and outer == [32.0]
    with pytest.raises(ValueError, match="mode"):
        with TI.conversions("gpu"):
            pass


def test_notes_name_the_workaround():
    assert RAW.instrument_notes() == []
    assert FAITHFUL.instrument_notes() == [TI.WORKAROUND_NOTE]
    assert TI.WORKAROUND in FAITHFUL.version()


def test_interpreter_refused_after_compiled_import():
    code = ("import os; os.environ['TRITON_INTERPRET']='0'; import triton; "
            "from fp8rl.engines.triton_interpret import TritonInterpretEngine as E; "
            "print(E().capabilities()['cast.e4m3fn'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr
    assert "TRITON_INTERPRET" in r.stdout
