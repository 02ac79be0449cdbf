"""The ``torchao-mx`` engine (torchao's ``to_mx``): behaviour without torchao (base environment) and — where
torchao 0.18.0 is installed (the ``conformance_checkpoint`` nox session) — executable evidence of the finding in
conformance/vendors/torchao-mx.xfails."""

from __future__ import annotations

import pytest
import torch
from fp8rl.engine import capability_reason
from fp8rl.engines.torchao_mx import TorchaoMXEngine
from fp8rl.reference import microscaling as mx
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import installed_version, pinned

PIN = pinned("torchao", "==0.18.0", "to_mx FLOOR stores E8M0 code 0 (2^-127) but divides by 2^-126")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "torchao-mx.xfails"
needs_torchao = pytest.mark.skipif(installed_version("torchao") is None, reason="torchao is not installed (the checkpoint tier installs it)")


def test_without_torchao_every_capability_says_why(monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)
    caps = TorchaoMXEngine().capabilities()
    assert caps and all(isinstance(v, str) and "torchao" in v for v in caps.values()), caps


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=81)


@needs_torchao
def test_declares_the_ocp_floor_presets_and_says_why_not_nvfp4():
    e = TorchaoMXEngine()
    assert {r: e.mx_policy(r).name for r in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4")} == {
        "mxfp8_e4m3": "ocp_mxfp8_e4m3", "mxfp8_e5m2": "ocp_mxfp8_e5m2", "mxfp4": "ocp_mxfp4"}
    assert "amax/2688" in (capability_reason(e, "mx_quantize.nvfp4") or "")
    assert "multiple of the block" in (capability_reason(e, "mx_quantize.nondivisible") or "")


@needs_torchao
@PIN
@pytest.mark.parametrize("recipe,spec_code,torchao_code", [("mxfp8_e4m3", 0xC8, 0xC0), ("mxfp8_e5m2", 0xC4, 0xC0)])
def test_bottom_clamped_block_is_quantized_at_twice_its_stored_scale_exact(recipe, spec_code, torchao_code):
    # amax 2^-125: floor(log2 amax) - emax < -127, so the exponent clamps to -127 (code 0 = 2^-127); the spec divides
    # -2^-125 by 2^-127 (-4), torchao by F32_MIN_NORMAL = 2^-126 (-2): the stored block decodes to x/2
    x = torch.linspace(-1, 1, 32).reshape(1, 32) * 2.0**-125
    got = TorchaoMXEngine().mx_quantize(x, recipe)
    want = mx.mx_quantize(x, mx.get_mx_policy(recipe))
    assert int(got.scales[0, 0]) == int(want.scales[0, 0]) == 0
    assert (int(want.data[0, 0]), int(got.data[0, 0])) == (spec_code, torchao_code)
    deq = mx.dequantize_mx(mx.MXTensor(got.data, got.scales, None, (1, 32), got.policy))
    assert (float(deq[0, 0]), float(deq[0, -1])) == (-(2.0**-126), 2.0**-126)  # ±amax decode to ±amax/2


@needs_torchao
def test_gaussian_blocks_are_bit_exact_to_the_floor_rule_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g) * torch.exp2(torch.randint(-8, 9, (16, 1), generator=g).float())
    for recipe in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"):
        got, want = TorchaoMXEngine().mx_quantize(x, recipe), mx.mx_quantize(x, mx.get_mx_policy(recipe))
        assert torch.equal(got.scales, want.scales) and torch.equal(got.data, want.data), recipe
