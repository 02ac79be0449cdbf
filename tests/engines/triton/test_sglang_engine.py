"""The ``sglang`` engine: SGLang 0.5.23's own FP8 code on CPU (Triton kernels in the interpreter, faithful-downcast).

Pins the paths the engine does not expose as suite ops (column-major / UE8M0 group scales, static quant,
fp8_quantize, the ROCm torch fallbacks, input_to_float8) against their oracle presets, the CUDA-only entry points,
the shims, and the findings recorded in conformance/vendors/sglang.xfails. Skips cleanly where sglang (or triton)
is not installed (the base venv); run it in the SGLang venv (see fp8rl.engines.sglang).
"""

from __future__ import annotations

import ast
import importlib.util
import sys

import numpy as np
import pytest
import torch
from fp8rl.engines import _sglang_shim as shim
from fp8rl.engines import _triton_interp
from fp8rl.engines import sglang as S
from fp8rl.reference.formats import encode
from fp8rl.reference.presets import PRESETS, get_policy
from fp8rl.reference.quant import Granularity, quantize, quantize_with_scale
from support.upstream import pinned

#: every test here that needs the installed package pins its behaviour (tests/support/upstream.py)
PIN = pinned("sglang", "==0.5.23", "SGLang 0.5.23's FP8 quantizers, GEMM and KV write")


@pytest.fixture(scope="module")
def ns():
    """SGLang's FP8 modules; every test using it skips (with the reason) where sglang or triton is missing."""
    reason = S.sglang_reason()
    if reason:
        pytest.skip(reason)
    return S._load()[0]


def test_engine_without_sglang_gives_reasons(monkeypatch):
    monkeypatch.setattr(S, "_load", lambda: (None, S.INSTALL_HINT))
    eng = S.SglangEngine()
    caps = eng.capabilities()
    assert caps and set(caps.values()) == {S.INSTALL_HINT} and eng.version() == "sglang not installed"
    assert eng.instrument_notes() == [_triton_interp.WORKAROUND_NOTE, S.DEVICE_NAME_NOTE, S.TORCHVISION_NOTE]


def test_torchvision_shim_serves_only_sglang_imports(tmp_path, monkeypatch):
    """The stand-in answers an ``import`` executed in an ``sglang*`` module, nothing else, and is invisible to
    importlib.util.find_spec; it is gone after the block (runs without sglang: a probe module plays SGLang)."""
    if shim.real_torchvision_installed():
        pytest.skip("a real torchvision is installed: the shim stays inactive")
    pkg = tmp_path / "sglang_fp8rl_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import torchvision.transforms as T\n"
                                     "from torchvision.transforms.functional import InterpolationMode\n")
    (tmp_path / "other_fp8rl_probe.py").write_text("import torchvision\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with shim.torchvision_stub() as created:
            with pytest.raises(ModuleNotFoundError):  # a non-sglang importer is refused
                import other_fp8rl_probe  # noqa: F401
            import sglang_fp8rl_probe as probe
        assert created == ["torchvision", "torchvision.transforms", "torchvision.transforms.functional"]
        assert getattr(probe.T, shim.MARKER) and "InterpolationMode" in repr(probe.InterpolationMode)
        with pytest.raises(RuntimeError, match="torchvision stub"):
            probe.T.Compose([])
        assert not any(m == "torchvision" or m.startswith("torchvision.") for m in sys.modules)
        assert importlib.util.find_spec("torchvision") is None
        assert not any(isinstance(f, shim._Finder) for f in sys.meta_path)
    finally:
        for m in ("sglang_fp8rl_probe", "other_fp8rl_probe"):
            sys.modules.pop(m, None)


def test_torchvision_shim_is_invisible_to_find_spec_inside_the_block():
    if shim.real_torchvision_installed():
        pytest.skip("a real torchvision is installed: the shim stays inactive")
    with shim.torchvision_stub():
        assert importlib.util.find_spec("torchvision") is None
        with pytest.raises(ModuleNotFoundError):
            import torchvision  # noqa: F401  (this test module is not an sglang module)


@pytest.fixture(scope="module")
def eng(ns):
    return S.SglangEngine()


def _x(shape, seed=0, spread=8):
    r = np.random.default_rng(seed)
    v = r.standard_normal(shape) * np.exp2(r.uniform(-spread, spread, (shape[0], 1)))
    return torch.from_numpy(v.astype(np.float32))


def _u8(t):
    return t.view(torch.uint8)


@PIN
def test_capabilities_policies_and_notes(eng, ns):
    caps = eng.capabilities()
    for k in ("cast.e4m3fn", "cast.e5m2", "quantize.tensor", "quantize.token", "quantize.channel", "quantize.group",
              "quantize.block", "gemm.block", "gemm.tensor", "gemm.row", "kv.store"):
        assert caps[k] is True, (k, caps[k])
    for k in ("cast.e4m3fnuz", "cast.bf16", "kv.attention", "kv.calibrate", "kv.update_scales"):
        assert isinstance(caps[k], str) and caps[k]
    assert all(p in PRESETS for p in S.POLICIES.values())
    assert eng.scale_policy("group").name == "sglang_triton_group"
    assert eng.instrument_notes() == [_triton_interp.WORKAROUND_NOTE, S.DEVICE_NAME_NOTE, S.TORCHVISION_NOTE]
    assert "0.5.23" in eng.version() and _triton_interp.interpreter_active()


@PIN
def test_torchvision_stub_is_gone_after_import(ns):
    from fp8rl.engines._sglang_shim import MARKER

    assert "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None
    assert set(ns.stubbed) <= {"torchvision", "torchvision.transforms", "torchvision.transforms.functional"}
    iu = sys.modules.get("sglang.srt.multimodal.internvl_utils")
    if iu is not None:  # the SGLang module keeps its stand-in (unused by FP8 code)
        assert getattr(iu.T, MARKER, False)
        with pytest.raises(RuntimeError, match="torchvision stub"):
            iu.T.Compose([])


@PIN
def test_cuda_only_entry_points_raise_name_error(ns):
    x = _x((2, 256))
    with pytest.raises(NameError, match="sgl_per_token_quant_fp8"):
        ns.qk.sglang_per_token_quant_fp8(x)
    with pytest.raises(NameError):
        ns.qk.scaled_fp8_quant(x)
    with pytest.raises(NameError, match="per_token_group_quant"):
        ns.qk.sglang_per_token_group_quant_fp8(x, 128)
    assert ns.qk.per_token_group_quant_fp8 is ns.qk._per_token_group_quant_8bit_raw  # the non-CUDA alias
    for name in ("_native_dynamic_per_token_quant_fp8", "_native_dynamic_per_tensor_quant_fp8",
                 "_native_static_quant_fp8"):
        assert not hasattr(ns.qk, name)  # defined only under `if _is_hip:`


@PIN
def test_group_row_major_is_the_production_path_exact(eng):
    x = _x((8, 384), seed=1)
    got = eng.quantize(x, Granularity.group(128))
    ref = quantize(x, Granularity.group(128), "sglang_triton_group")
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.codes, ref.codes)


@PIN
def test_group_column_major_divides_exact(ns):
    x = _x((64, 512), seed=2)
    x[0, :2] = torch.tensor([3136.0, 10.9375])  # s = 7, x/s = 1.5625 is a tie: x/s → 0x3c, x·fl32(1/7) → 0x3d
    with _triton_interp.conversions("faithful"):
        q, s = ns.qk.per_token_group_quant_fp8(x, 128, column_major_scales=True)
        q_row, _ = ns.qk.per_token_group_quant_fp8(x, 128)
    assert s.shape == (64, 4) and s.stride() == (1, 64)  # column-major
    ref = quantize(x, Granularity.group(128), "sglang_triton_group_colmajor")
    assert torch.equal(s.contiguous(), ref.scale) and torch.equal(_u8(q), ref.codes)
    # x/s vs x·(1/s): the two layouts disagree on rare codes of the same input, by one code
    assert _u8(q)[0, 1] == 0x3C and _u8(q_row)[0, 1] == 0x3D
    diff = (_u8(q).int() - _u8(q_row).int()).abs()
    assert int((diff != 0).sum()) < x.numel() // 100 and int(diff.max()) == 1


@PIN
def test_group_ue8m0_kernel_exact(ns):
    """SCALE_UE8M0 is reachable only by launching the kernel: the Python entry then needs deep_gemm."""
    x = _x((4, 256), seed=3)
    with pytest.raises(ModuleNotFoundError, match="deep_gemm"), _triton_interp.conversions("faithful"):
        ns.qk.per_token_group_quant_fp8(x, 128, column_major_scales=True, scale_ue8m0=True)
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    s = torch.empty((2, 4), dtype=torch.float32).permute(1, 0)
    with _triton_interp.conversions("faithful"):
        ns.qk._per_token_group_quant_8bit_colmajor[(x.numel() // 128,)](
            x, q, s, 128, x.shape[1], s.stride(1), 1e-10, bit8_min=-448.0, bit8_max=448.0, BLOCK=128,
            num_warps=1, num_stages=1, SCALE_UE8M0=True)
    ref = quantize(x, Granularity.group(128), "sglang_triton_group_ue8m0")
    assert torch.equal(s.contiguous(), ref.scale) and torch.equal(_u8(q), ref.codes)
    assert bool((torch.log2(s) == torch.log2(s).round()).all())


@PIN
def test_static_quant_multiplies_by_the_reciprocal_exact(ns):
    x = torch.tensor([[10.9375, -10.9375, 7.0 * 448 * 2, 0.0]])
    with _triton_interp.conversions("faithful"):
        q, s = ns.qk.static_quant_fp8(x, torch.tensor([7.0]), repeat_scale=True)
    assert s.shape == (1, 1) and float(s) == 7.0
    ref = quantize_with_scale(x, torch.tensor([7.0]), Granularity.tensor(), "sglang_static")
    assert torch.equal(_u8(q), ref) and _u8(q).tolist() == [[0x3D, 0xBD, 0x7E, 0]]  # x/7 would give 0x3c


@PIN
def test_nan_becomes_minus_448_in_triton_clamp(ns, eng):
    """Finding (sglang.xfails CAST-SWEEP-001[e4m3fn): tl.clamp(propagate_nan=NONE) maps NaN to the lower bound."""
    x = torch.tensor([[float("nan"), 1.0, float("inf"), -float("inf")]])
    for mode in ("raw", "faithful"):
        with _triton_interp.conversions(mode):
            q, _ = ns.qk.static_quant_fp8(x, torch.ones(1))
        assert _u8(q).tolist() == [[0xFE, 0x38, 0x7E, 0xFE]]
    assert eng.cast(x.flatten(), "e4m3fn").tolist() == [0xFE, 0x38, 0x7E, 0xFE]
    # fp8_quantize (bf16 in, no clamp) keeps NaN through the satfinite conversion
    got = eng.cast(x.flatten().to(torch.bfloat16), "e4m3fn").tolist()
    assert got[0] & 0x7F == 0x7F and got[1:] == [0x38, 0x7E, 0xFE]


@PIN
def test_mla_per_tensor_multi_head_exact(ns):
    x = _x((6, 64), seed=4).reshape(2, 3, 64)  # [heads, seq, head_size]
    with _triton_interp.conversions("faithful"):
        q, s = ns.qk.per_tensor_quant_mla_fp8(x, torch.zeros(1, dtype=torch.float32))
    ref = quantize(x.reshape(6, 64), Granularity.tensor(), "sglang_mla_tensor")
    assert torch.equal(s, ref.scale) and torch.equal(_u8(q).reshape(6, 64), ref.codes)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@PIN
def test_fp8_quantize_scaled_exact(ns, fmt):
    x = (_x((4, 64), seed=5, spread=4) * 3).to(torch.bfloat16)
    s = torch.tensor([0.37], dtype=torch.float32)
    inv = float(torch.tensor(1.0) / s)  # the caller's scale_inv = fl32(1/s)
    dt = torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2
    with _triton_interp.conversions("faithful"):
        q = ns.fq.fp8_quantize(x, scale_inv=inv, fp8_dtype=dt)
    pol = get_policy("sglang_fp8_quantize").for_format(fmt)
    assert torch.equal(_u8(q), quantize_with_scale(x.float(), s, Granularity.tensor(), pol))


@PIN
def test_input_to_float8_reciprocal_times_max(ns):
    """input_to_float8 writes ``fp_max / amax`` (Python float / tensor), which torch evaluates as
    ``amax.reciprocal() * fp_max``: m = fl(fl(1/amax)·448), not fl(448/amax) — no ScalePolicy expresses it, so the
    engine's per-tensor op is the MLA kernel instead."""
    r = np.random.default_rng(6)
    amaxes = torch.from_numpy(np.exp2(r.uniform(-20, 20, 400)).astype(np.float32))
    differ = 0
    for a in amaxes.tolist():
        x = torch.tensor([[a, -a / 3, 0.0]], dtype=torch.float32)
        q, s = ns.fu.input_to_float8(x)
        amax = torch.tensor(a, dtype=torch.float32)
        m = amax.reciprocal() * torch.tensor(448.0)
        assert float(s) == float(torch.tensor(1.0) / m)
        assert torch.equal(_u8(q), encode((x * m).clamp(-448, 448), "e4m3fn", "saturate").reshape(x.shape))
        differ += int(float(m) != float(torch.tensor(448.0) / amax))
    assert differ > 0  # 1-ulp multiplier differences from fl(448/amax) exist


def _native_fallbacks(ns):
    """The three ``_native_*`` definitions, compiled from the installed fp8_kernel.py source (they live inside
    ``if _is_hip:``): SGLang's exact statements, run with the module's own fp8_dtype/fp8_max/fp8_min — source-
    extracted, NOT a path SGLang takes on any CPU platform."""
    path = ns.qk.__file__
    tree = ast.parse(open(path, encoding="utf-8").read())
    wanted = {"_native_dynamic_per_token_quant_fp8", "_native_dynamic_per_tensor_quant_fp8", "_native_static_quant_fp8"}
    defs = [n for top in tree.body if isinstance(top, ast.If) for n in top.body
            if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {d.name for d in defs} == wanted
    g = {"torch": torch, "fp8_max": ns.qk.fp8_max, "fp8_min": ns.qk.fp8_min, "fp8_dtype": ns.qk.fp8_dtype}
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), g)  # noqa: S102
    return g


@PIN
def test_native_fallbacks_source_extracted_exact(ns):
    g = _native_fallbacks(ns)
    x = _x((5, 200), seed=7)
    x[1] = 0.0
    out, scale = torch.empty(5, 200, dtype=torch.float8_e4m3fn), torch.empty(5, 1)
    g["_native_dynamic_per_token_quant_fp8"](out, x, scale)
    ref = quantize(x, Granularity.token(), "sglang_native")
    assert torch.equal(scale, ref.scale) and torch.equal(_u8(out), ref.codes)
    out_t, scale_t = torch.empty(5, 200, dtype=torch.float8_e4m3fn), torch.empty(1)
    g["_native_dynamic_per_tensor_quant_fp8"](out_t, x, scale_t)
    ref_t = quantize(x, Granularity.tensor(), "sglang_native")
    assert torch.equal(scale_t, ref_t.scale) and torch.equal(_u8(out_t), ref_t.codes)
    g["_native_static_quant_fp8"](out_t, x, torch.tensor(7.0))
    assert torch.equal(_u8(out_t), quantize_with_scale(x, torch.tensor([7.0]), Granularity.tensor(), "sglang_native"))


@PIN
def test_block_gemm_device_name_shim(ns, eng):
    a = quantize(_x((3, 384), seed=8), Granularity.group(128), "reference")
    w = quantize(_x((128, 384), seed=9, spread=1) * 0.05, Granularity.block(128), "reference")
    with pytest.raises(AttributeError, match="replace"):  # get_device_name() is None on CPU
        ns.gemm.w8a8_block_fp8_matmul_triton(a.codes.view(torch.float8_e4m3fn), w.codes.view(torch.float8_e4m3fn),
                                             a.scale, w.scale, [128, 128], output_dtype=torch.float32)
    original = ns.gemm.get_device_name
    out = eng.block_gemm(a, w, torch.float32)
    assert ns.gemm.get_device_name is original  # the shim is undone after the call
    exact = a.dequantize(torch.float64) @ w.dequantize(torch.float64).T
    assert out.dtype == torch.float32 and torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-6)


@PIN
def test_kv_store_divides_without_clamp(eng):
    x = torch.tensor([1.0, 3.0, 5000.0, -float("inf"), float("nan"), 10.9375]).reshape(1, 1, 1, 6)
    c = eng.kv_store(x, torch.tensor(7.0), fmt="e4m3fn", layout="tensor")
    # x/7 with torch's saturating e4m3fn cast: 5000/7 = 714 and -inf saturate, NaN stays NaN, 10.9375/7 = 1.5625 tie → 0x3c
    assert c.codes.flatten().tolist()[2:] == [0x7E, 0xFE, 0x7F, 0x3C]
    pol = eng.kv_policy("e4m3fn", "tensor")
    assert (pol.quant_op, pol.clamp, pol.overflow) == ("div", False, "saturate")


@PIN
def test_raw_interpreter_conversions_differ(ns):
    r = S.raw_vs_faithful()
    assert r["raw"]["group_scales_equal"] and r["faithful"]["group_scales_equal"]
    assert r["faithful"]["group_codes_differ"] == 0 and r["raw"]["group_codes_differ"] > 0
    assert r["faithful"]["gemm_bf16_differ"] == 0 and r["raw"]["gemm_bf16_differ"] > r["raw"]["gemm_total"] // 4
    inputs = r["cast_sweep_inputs"]
    raw, oracle = r["raw"]["cast_sweep_codes"], r["cast_sweep_oracle"]
    assert raw[inputs.index(1.0625)] == 0x39 and oracle[inputs.index(1.0625)] == 0x38  # ties rounded up
    assert raw[inputs.index(17.0)] == 0x59 and oracle[inputs.index(17.0)] == 0x58
    assert r["faithful"]["cast_sweep_codes"][:11] == oracle[:11]
