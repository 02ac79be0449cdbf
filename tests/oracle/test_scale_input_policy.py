"""``compute_dtype="scale_input"``: the scale computed in a bf16/fp16 input's own dtype, the quotient x/s in fp32
(torchao's ``_choose_scale_float8`` + ``_quantize_affine_float8``). Checked against a hand-worked case and against
an independent peer (numpy + ml_dtypes: the bf16 scale by ml_dtypes' RNE cast of the fp32 quotient, the codes by
ml_dtypes' float8_e4m3fn cast), never against the oracle itself."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from fp8rl.reference.formats import decode_codes
from fp8rl.reference.policy import COMPUTE_DTYPES, ScalePolicy
from fp8rl.reference.presets import formula
from fp8rl.reference.quant import Granularity, quantize

SCALE_INPUT = ScalePolicy(name="scale-input", floor="none", eps=0.0, zero_amax="nan", compute_dtype="scale_input")
INPUT = ScalePolicy(name="input", floor="none", eps=0.0, zero_amax="nan", compute_dtype="input")


def test_mode_is_declared_and_named_in_the_formula_exact():
    assert "scale_input" in COMPUTE_DTYPES
    assert formula(SCALE_INPUT).endswith("the scale in the input dtype, q in fp32")
    with pytest.raises(ValueError, match="compute_dtype"):
        ScalePolicy(name="bad", compute_dtype="quotient_input")


def test_hand_worked_row_where_the_quotient_rounding_matters_exact():
    # amax 3: 3/448 = 1.7142857·2^-8; bf16 keeps 7 fraction bits: 1.7142857·128 = 219.43 → 219, so
    # s = 219/128·2^-8 = 0.006683349609375 (the same under both modes: the scale side is bf16 in each).
    # x = 9/256 = 0.03515625 (exact in bf16): x/s = 0.03515625·128·256/219 = 1152/219 = 5.26027...
    #   fp32 quotient ("scale_input"): 5.26027 lies above the e4m3 midpoint 5.25 of 5.0 and 5.5 (step 0.5 in [4, 8))
    #   → 5.5;
    #   bf16 quotient ("input"): 5.26027 → 5.25 (bf16 step 2^-5 in [4, 8)), exactly the midpoint → ties to even:
    #   5.0 = 1.010b·2^2 (even mantissa) → 5.0.
    x = torch.tensor([[3.0, 0.03515625, -0.03515625]], dtype=torch.bfloat16)
    s_bf16 = 219 / 128 * 2.0 ** -8
    for policy, want in ((SCALE_INPUT, [448.0, 5.5, -5.5]), (INPUT, [448.0, 5.0, -5.0])):
        qt = quantize(x, Granularity.token(), policy)
        assert qt.scale.flatten().tolist() == [s_bf16], policy.name
        assert decode_codes(qt.codes, "e4m3fn").tolist() == [want], policy.name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_numpy_and_ml_dtypes_peer_exact(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)).to(dtype)
    low = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16}[dtype]
    xf = x.float().numpy()
    amax = np.abs(xf).max(axis=1, keepdims=True)
    s = (amax / np.float32(448.0)).astype(low).astype(np.float32)  # correctly rounded to the input dtype
    q = np.clip(xf / s, -448.0, 448.0)  # fp32 quotient
    want = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    qt = quantize(x, Granularity.token(), SCALE_INPUT)
    assert np.array_equal(qt.scale.numpy(), s)
    assert np.array_equal(qt.codes.numpy(), want)
    # and it is neither of the other two modes: fp32 misses the scales, "input" the codes (x/s rounded first)
    assert not torch.equal(quantize(x, Granularity.token(), ScalePolicy(
        name="fp32", floor="none", eps=0.0, zero_amax="nan")).scale, qt.scale)
    assert int((quantize(x, Granularity.token(), INPUT).codes != qt.codes).sum()) > 0


def test_fp32_input_is_the_fp32_policy_exact():
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    a = quantize(x, Granularity.block(128), SCALE_INPUT)
    b = quantize(x, Granularity.block(128), ScalePolicy(name="fp32", floor="none", eps=0.0, zero_amax="nan"))
    assert torch.equal(a.scale, b.scale) and torch.equal(a.codes, b.codes)
