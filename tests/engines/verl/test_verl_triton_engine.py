"""The ``verl-triton`` engine: veRL's Triton blockwise FP8 weight quantizer (its default path) under Triton's CPU
interpreter.

Without veRL/Triton (the base environment) every capability must say why; with them (the ``[verl]`` venv plus
triton; run this file in its own pytest process — collecting ``tests/engines/verl/test_verl_engine.py`` first imports veRL's
fp8_kernel, and with it triton, without the interpreter) the adapter, both veRL paths and the recorded findings are
pinned bit-exactly against the oracle presets.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.engines import verl as V
from fp8rl.engines.verl_triton import VerlTritonEngine
from fp8rl.reference.presets import PRESETS
from fp8rl.reference.quant import Granularity, quantize
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import pinned

#: every test here that needs the installed package pins its behaviour (tests/support/upstream.py)
PIN = pinned("verl", "==0.9.1", "veRL 0.9.1's Triton blockwise FP8 quantizer")

XFAILS = REPO_ROOT / "conformance" / "vendors" / "verl-triton.xfails"
HAVE = importlib.util.find_spec("verl") is not None and importlib.util.find_spec("triton") is not None
B = Granularity.block(128)
_Q = "model.layers.0.mlp.experts.0.down_proj.weight"


def test_registry_name():
    from fp8rl.registry import BUILTINS

    assert BUILTINS["verl-triton"] == "fp8rl.engines.verl_triton:VerlTritonEngine"


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=41)


@pytest.mark.skipif(HAVE, reason="verl and triton are installed: the unavailable path is not reachable")
def test_without_verl_or_triton_every_capability_says_why():
    eng = VerlTritonEngine()
    assert eng.version() == "verl-triton unavailable"
    caps = eng.capabilities()
    assert caps["quantize.block"] and isinstance(caps["quantize.block"], str)
    assert all(isinstance(v, str) for v in caps.values())
    assert capability_reason(eng, "weight_sync") is not None
    with pytest.raises(Unsupported):
        eng.quantize(torch.ones(128, 128), B)
    with pytest.raises(Unsupported):
        eng.weight_sync({})


# ----------------------------------------------------------------------------------------------------------------
# with veRL + Triton (run in a fresh process)

needs = pytest.mark.skipif(not HAVE, reason=f"verl and triton are not installed: {V.INSTALL_HINT}; pip install "
                                            "triton==3.9.0")


@pytest.fixture(scope="module")
def eng():
    e = VerlTritonEngine()
    if e._fk is None:
        pytest.skip(f"verl-triton unavailable in this process: {e._reason}")
    return e


def _w(shape, seed=0):
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape).astype(np.float32) * 0.02
    x *= np.exp2(r.integers(-6, 7, size=(shape[0], 1))).astype(np.float32)
    return torch.from_numpy(x)


@needs
@PIN
def test_capabilities_policy_and_notes(eng):
    from fp8rl.engines import _triton_interp as TI

    caps = eng.capabilities()
    assert caps["quantize.block"] is True and caps["weight_sync"] is True
    assert "engine verl" in caps["rollout_correction"] and "blockwise only" in caps["quantize.group"]
    assert eng.scale_policy("block") is PRESETS["verl_triton"]
    with pytest.raises(Unsupported):
        eng.scale_policy("group")
    assert TI.WORKAROUND_NOTE in eng.instrument_notes()
    assert "interpreter" in eng.version() and "faithful-downcast" in eng.version()
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(eng._fk._blockwise_cast_to_fp8_kernel, InterpretedFunction)


@needs
@PIN
def test_triton_path_bit_exact_vs_verl_triton_and_zero_block(eng):
    """Partial edge blocks (veRL pads with zeros and crops), an all-zero block: s = fl(1e-10)/448 ≈ 2.2e-13."""
    x = _w((200, 328), seed=1)
    x[:128, :128] = 0
    got = eng.quantize(x, B)
    ref = quantize(x, B, "verl_triton")
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.codes, ref.codes)
    assert tuple(got.scale.shape) == (2, 3)
    assert got.scale[0, 0].item() == (torch.tensor(1e-10) / torch.tensor(448.0)).item()


@needs
@PIN
def test_pytorch_path_is_verl_torch_and_differs_on_zero_blocks(eng):
    """veRL's other path (_scaled_fp8_blockwise_pytorch, VERL_DISABLE_TRITON_FP8=1) is the verl_torch preset: an
    all-zero block gets scale 1.0 there, 2.2e-13 on the Triton path; other blocks agree up to 1-ulp scale
    differences (1/(448/a) vs a/448)."""
    x = _w((256, 256), seed=2)
    x[128:, 128:] = 0
    q, s = eng._fk._scaled_fp8_blockwise_pytorch(x, [128, 128])
    s = s.reshape(2, 2)
    ref = quantize(x, B, "verl_torch")
    assert torch.equal(s, ref.scale) and torch.equal(q.view(torch.uint8), ref.codes)
    tri = eng.quantize(x, B)
    assert s[1, 1].item() == 1.0 and tri.scale[1, 1].item() < 1e-12
    assert torch.allclose(s[:1], tri.scale[:1], rtol=2e-7, atol=0)


@needs
@PIN
def test_finding_weight_sync_squeezes_single_column_block_scale(eng):
    """quant_weights_by_name does param_scale.squeeze(-1), meant for the PyTorch path's (bm, bn, 1) descale: on the
    Triton path a weight with K <= 128 ships a 1-D scale ((2,) instead of (2, 1)); the kernel itself returns (2, 1)."""
    w = _w((256, 128), seed=3).to(torch.bfloat16)
    _, s = eng._fk.scaled_fp8_blockwise_triton(w, [128, 128])
    assert tuple(s.shape) == (2, 1)
    before = eng._fk._DISABLE_TRITON_FP8
    got = eng.weight_sync({_Q: w})
    assert eng._fk._DISABLE_TRITON_FP8 == before  # the dispatcher switch is restored
    assert tuple(got[_Q + "_scale_inv"].shape) == (2,)
    ref = quantize(w.float(), B, "verl_triton")
    assert torch.equal(got[_Q + "_scale_inv"], ref.scale.reshape(2))
    assert torch.equal(got[_Q].view(torch.uint8), ref.codes)
    # K > 128: the scale keeps its 2-D shape
    wide = _w((128, 320), seed=4).to(torch.bfloat16)
    assert tuple(eng.weight_sync({_Q: wide})[_Q + "_scale_inv"].shape) == (1, 3)


@needs
@PIN
def test_raw_interpreter_conversions_change_codes_not_scales(eng):
    """Evidence for the workaround: with the interpreter's own fp32→fp8 conversion the scales still equal the
    preset but ~10% of codes differ from the oracle (ties rounded up, lost mantissa carry)."""
    x = _w((256, 256), seed=5)
    raw = VerlTritonEngine(mode="raw").quantize(x, B)
    ref = quantize(x, B, "verl_triton")
    assert torch.equal(raw.scale, ref.scale)
    frac = float((raw.codes != ref.codes).float().mean())
    assert 0.01 < frac < 0.3, frac


@PIN
@needs
def test_checkpoint_matrix_verl_triton_writer(tmp_path):
    """The interop matrix with veRL's default (Triton) path as the writer: tiny-qwen3 conformant end to end (file
    within bound, oracle loader exact, log-probs exact); tiny-qwen3-moe's file carries the squeeze(-1) finding (16
    expert down_proj scales of shape (2,)): a known file deviation (WSYNC-BOUND-001[tiny-qwen3-moe]) and a loader
    error that names the tensor, not a silent load, so the matrix exits 1."""
    import json

    from fp8rl.cli import main

    out = tmp_path / "m"
    assert main(["checkpoint-matrix", "--writer", "verl-triton", "--loader", "reference", "--out", str(out)]) == 1
    cells = {c["model"]: c for c in json.loads((out / "matrix.json").read_text())["cells"]}
    dense, moe = cells["tiny-qwen3"], cells["tiny-qwen3-moe"]
    assert (dense["status"], dense["file"]["status"], dense["logprobs"]["max_abs_dlogp"]) == ("conformant",
                                                                                              "conformant", 0.0)
    assert moe["file"]["status"] == "deviation" and moe["file"]["known"]
    assert moe["status"] == "error" and "down_proj.weight_scale_inv" in moe["detail"] and not moe["known"]
