"""Diagnosis on mismatch (fp8rl.diagnose): a failing quantization check says what the engine's output does match.

The engines' quantizers here are written by hand in torch (amax, scale and quotient in the dtype the engine uses,
torch's float8_e4m3fn cast), not taken from the oracle; each test first checks that the engine really differs from
the policy it declares on its input. The end-to-end test runs the real check through ``fp8rl conformance`` on an
engine class in a temporary module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from fp8rl.diagnose import crop_to_mismatch, diagnose_quantize, policy_variants
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import PRESETS, get_policy
from fp8rl.reference.quant import Granularity, quantize
from support import REPO_ROOT

NO_MATCH = "no preset or single-field variant of the declared policy explains the output"

#: the engines' kernels and engine classes, as a vendor would write them in their own module
ENGINE_SRC = '''
import torch
import torch.nn.functional as F
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import QuantizedTensor


def group_quant_mul_recip(x, group):
    """1xG groups: s = max(amax, 1e-10)/448 (fp32), q = clamp(x * (1/s), +-448), torch's e4m3fn cast
    (SGLang's row-major Triton group kernel)."""
    x = x.float()
    k = x.shape[-1]
    pad = -k % group
    xp = F.pad(x, (0, pad)).reshape(*x.shape[:-1], (k + pad) // group, group)
    s = torch.maximum(xp.abs().amax(dim=-1), torch.tensor(1e-10)) / 448.0
    q = (xp * (1.0 / s).unsqueeze(-1)).clamp(-448.0, 448.0)
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*x.shape[:-1], k + pad)[..., :k].contiguous()
    return codes, s


def block_quant_bf16(x, bm, bn, quotient_bf16=True):
    """Bm x Bn blocks of a bf16 tensor: amax and s = amax/448 in bf16, q = x/s in bf16 (or in fp32 with
    quotient_bf16=False), clamp to +-448, torch's e4m3fn cast; the scale is returned as fp32."""
    xb = x.to(torch.bfloat16)
    m, n = xb.shape
    pm, pn = -m % bm, -n % bn
    blocks = F.pad(xb.float(), (0, pn, 0, pm)).reshape((m + pm) // bm, bm, (n + pn) // bn, bn)
    amax = torch.maximum(blocks.abs().amax(dim=(1, 3)), torch.tensor(1e-10)).to(torch.bfloat16)
    s = amax / torch.tensor(448.0, dtype=torch.bfloat16)
    q = blocks.to(torch.bfloat16) / s[:, None, :, None] if quotient_bf16 else blocks / s.float()[:, None, :, None]
    codes = q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(m + pm, n + pn)[:m, :n].contiguous(), s.float()


def group_quant_recip_max(x, group):
    """1xG groups: s = max(amax, 1e-10) * fl(1/448) (fp32), q = clamp(x/s, +-448), torch's e4m3fn cast (vLLM's
    Triton group kernel)."""
    x = x.float()
    k = x.shape[-1]
    pad = -k % group
    xp = F.pad(x, (0, pad)).reshape(*x.shape[:-1], (k + pad) // group, group)
    s = torch.maximum(xp.abs().amax(dim=-1), torch.tensor(1e-10)) * (torch.tensor(1.0) / 448.0)
    q = (xp / s.unsqueeze(-1)).clamp(-448.0, 448.0)
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*x.shape[:-1], k + pad)[..., :k].contiguous()
    return codes, s


class MulRecipGroup(ReferenceEngine):
    """Declares vLLM's CUDA group kernel (q = x/s) but multiplies by 1/s."""

    name = "mul-recip-group"

    def scale_policy(self, kind):
        return get_policy("vllm_cuda_group") if kind == "group" else super().scale_policy(kind)

    def quantize(self, x, granularity):
        if granularity.kind != "group":
            return super().quantize(x, granularity)
        codes, scale = group_quant_mul_recip(x, granularity.size[1])
        return QuantizedTensor(codes, scale, granularity, self.scale_policy("group"))


class RecipMaxGroup(MulRecipGroup):
    """Declares vLLM's CUDA group kernel (s = amax/448) but multiplies amax by fl(1/448)."""

    name = "recip-max-group"

    def quantize(self, x, granularity):
        if granularity.kind != "group":
            return super().quantize(x, granularity)
        codes, scale = group_quant_recip_max(x, granularity.size[1])
        return QuantizedTensor(codes, scale, granularity, self.scale_policy("group"))
'''


@pytest.fixture(scope="module")
def engine_module(tmp_path_factory: pytest.TempPathFactory):
    """ENGINE_SRC written to a temporary directory as module ``diag_vendor_engines`` and imported."""
    path = tmp_path_factory.mktemp("diag_engines") / "diag_vendor_engines.py"
    path.write_text(ENGINE_SRC)
    spec = importlib.util.spec_from_file_location("diag_vendor_engines", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bf16_gaussian(shape, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Gaussian values rounded to bf16 (as QUANT-EXACT-002 draws them), returned as fp32."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).to(torch.bfloat16).float()


def _first_sentence(text: str) -> str:
    """The diagnosis up to its 'Also bit-exact' list (the best match)."""
    return text.split(" Also bit-exact")[0]


# ---------------------------------------------------------------------------------------------------------------
# (a) the engine implements another preset than it declares


def test_group_engine_implementing_another_preset_is_named_exact(engine_module):
    assert {"sglang_triton_group", "vllm_cuda_group"} <= set(PRESETS)
    x = _bf16_gaussian((64, 4096), seed=0)
    g = Granularity.group(128)
    codes, scale = engine_module.group_quant_mul_recip(x, 128)
    declared = get_policy("vllm_cuda_group")
    ref = quantize(x, g, declared)
    assert not torch.equal(codes, ref.codes), "the input must separate x/s from x*(1/s)"

    text = diagnose_quantize(x, g, codes, scale, declared)

    best = _first_sentence(text)
    assert text.startswith("diagnosis: codes and scales match ")
    assert "'sglang_triton_group'" in best and "bit-exactly" in best and "(declared 'vllm_cuda_group'" in best
    assert "quant_op='mul_recip'" in best
    assert "'vllm_cuda_group'" not in best.split("(declared")[0]


def test_group_engine_of_another_preset_on_a_ragged_3d_input_exact(engine_module):
    rng = np.random.default_rng(3)
    x = torch.from_numpy((rng.standard_normal((5, 3, 1000)) * np.exp2(rng.integers(-8, 8, (5, 3, 1000))))
                         .astype(np.float32)).to(torch.bfloat16).float()
    g = Granularity.group(128)
    codes, scale = engine_module.group_quant_mul_recip(x, 128)
    declared = get_policy("vllm_cuda_group")
    assert not torch.equal(codes, quantize(x, g, declared).codes)
    assert "'sglang_triton_group'" in _first_sentence(diagnose_quantize(x, g, codes, scale, declared))


def test_nan_codes_compare_as_one_code_exact(engine_module):
    x = _bf16_gaussian((64, 1024), seed=1)
    x[2, 5] = float("nan")
    g = Granularity.group(128)
    codes, scale = engine_module.group_quant_mul_recip(x, 128)
    nan = torch.isnan(x.reshape(64, 8, 128)).any(-1).repeat_interleave(128, dim=-1)
    declared = get_policy("vllm_cuda_group")
    ref = quantize(x, g, declared)
    other_nan = 0x7F if int(ref.codes[2, 0]) == 0xFF else 0xFF  # the NaN code the oracle does not write
    assert int(ref.codes[2, 0]) in (0x7F, 0xFF)
    codes = torch.where(nan, torch.full_like(codes, other_nan), codes)
    assert not torch.equal(codes[~nan], ref.codes[~nan])

    text = diagnose_quantize(x, g, codes, scale, declared)

    assert "'sglang_triton_group'" in _first_sentence(text), text


# ---------------------------------------------------------------------------------------------------------------
# (b) the scale is computed in the input's dtype


@pytest.mark.parametrize("shape", [(256, 384), (200, 328), (64, 4096)])
def test_block_engine_with_bf16_scale_names_compute_dtype_input_exact(engine_module, shape):
    rng = np.random.default_rng(2)
    x = torch.from_numpy((rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(np.float32))
    x = x.to(torch.bfloat16)
    g = Granularity.block(128)
    codes, scale = engine_module.block_quant_bf16(x, 128, 128)
    declared = get_policy("reference")
    assert declared.compute_dtype == "fp32"
    ref = quantize(x, g, declared)
    assert not (torch.equal(codes, ref.codes) and torch.equal(scale, ref.scale)), "bf16 and fp32 must differ here"

    text = diagnose_quantize(x, g, codes, scale, declared)

    best = _first_sentence(text)
    assert best.startswith("diagnosis: codes and scales match the declared policy with compute_dtype='input' "
                           "bit-exactly (declared 'reference')"), text
    assert "declare compute_dtype='input'?" in best


# ---------------------------------------------------------------------------------------------------------------
# (c) nothing matches; the closest


def _flip(codes: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """``n`` codes changed in their 0x40 bit, never into a NaN code (0x7F, 0xFF)."""
    rng = np.random.default_rng(seed)
    flat = codes.clone().reshape(-1)
    ok = np.flatnonzero(~np.isin(flat.numpy() ^ 0x40, [0x7F, 0xFF]))
    idx = torch.from_numpy(rng.choice(ok, n, replace=False))
    flat[idx] ^= 0x40
    return flat.reshape(codes.shape)


@pytest.mark.parametrize("kind", ["tensor", "token", "group", "block"])
def test_randomly_flipped_codes_match_nothing_exact(kind):
    g = {"tensor": Granularity.tensor(), "token": Granularity.token(), "group": Granularity.group(128),
         "block": Granularity.block(128)}[kind]
    x = _bf16_gaussian((64, 4096), seed=4)
    declared = get_policy("vllm_cuda_group")
    ref = quantize(x, g, declared)
    codes = _flip(ref.codes, 40, seed=5)
    assert int((codes != ref.codes).sum()) == 40

    text = diagnose_quantize(x, g, codes, ref.scale, declared)

    assert text.startswith(f"diagnosis: {NO_MATCH}"), text
    assert "declared: 0 scales and 40 codes differ" in text


def test_a_scale_off_by_three_matches_nothing_exact():
    x = _bf16_gaussian((16, 1024), seed=6)
    g = Granularity.group(128)
    declared = get_policy("reference")
    ref = quantize(x, g, declared)
    scale = ref.scale.clone()
    scale[3, 2] *= 3.0

    text = diagnose_quantize(x, g, ref.codes, scale, declared)

    assert text.startswith(f"diagnosis: {NO_MATCH}"), text
    assert "declared: 1 scale and 0 codes differ" in text


def test_closest_candidate_matches_the_scales_with_its_code_count_exact(engine_module):
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((256, 384)).astype(np.float32)).to(torch.bfloat16)
    g = Granularity.block(128)
    codes, scale = engine_module.block_quant_bf16(x, 128, 128, quotient_bf16=False)  # bf16 scale, fp32 quotient
    codes = _flip(codes, 3, seed=8)
    declared = get_policy("reference")
    amax = x.float().reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    n_scales = int((scale != amax / 448.0).sum())
    assert n_scales > 1

    text = diagnose_quantize(x, g, codes, scale, declared)

    assert text.startswith("diagnosis: no preset or single-field variant of the declared policy 'reference' matches "
                           "both codes and scales; closest: scales match with compute_dtype='scale_input' (3 codes "
                           "still differ)"), text
    assert f"(declared: {n_scales} scales and " in text


# ---------------------------------------------------------------------------------------------------------------
# the pieces


def test_policy_variants_change_one_field_to_a_valid_value():
    declared = get_policy("vllm_cuda_group")
    variants = policy_variants(declared)
    labels = [label for label, _ in variants]
    names = [f for f in ScalePolicy.__dataclass_fields__ if f not in ("name", "description")]
    for label, policy in variants:
        field, _, value = label.partition("=")
        changed = [f for f in names if getattr(policy, f) != getattr(declared, f)]
        assert changed == [field], (label, changed)
        assert repr(getattr(policy, field)) == value.split(" (")[0]
    for want in ("compute_dtype='input'", "compute_dtype='scale_input'", "quant_op='mul_recip'",
                 "scale_op='recip_multiplier'", "pow2='ceil_bits'", "floor='scale'", "eps=1e-12", "clamp=False",
                 "target_max=224.0", "zero_amax='one'", "multiplier_op='recip_mul'"):
        assert want in labels, want
    # invalid single-field combinations are left out: a zero-amax 'floor' rule needs a floor and eps > 0
    for invalid in ("floor='none'", "eps=0.0", "pow2='floor_multiplier'", "floor_order='pow2_then_floor'",
                    "zero_amax='scale_dtype_eps'", "target_max=57344.0"):
        assert invalid not in labels, invalid


@pytest.mark.parametrize("kind, shape, policy", [
    ("tensor", (64, 4096), "deepgemm_ue8m0"),
    ("tensor", (4, 3, 1000), "deepgemm_ue8m0"),
    ("token", (64, 4096), "sglang_triton_group"),
    ("channel", (96, 200), "sglang_triton_group"),
    ("group", (5, 3, 1000), "vllm_triton_group"),
    ("block", (200, 328), "vllm_triton_group"),
    ("block", (384, 640), "deepgemm_ue8m0"),
])
def test_crop_quantizes_as_the_whole_input_exact(kind, shape, policy):
    g = {"tensor": Granularity.tensor(), "token": Granularity.token(), "channel": Granularity.channel(),
         "group": Granularity.group(128), "block": Granularity.block(128)}[kind]
    rng = np.random.default_rng(9)
    x = torch.from_numpy((rng.standard_normal(shape) * np.exp2(rng.integers(-6, 6, shape))).astype(np.float32))
    x = x.to(torch.bfloat16).float()  # bf16 values: x/s and x*(1/s) differ in ~0.04% of them
    x.view(-1)[x.numel() // 2] = float("nan") if kind == "tensor" and len(shape) == 3 else 5000.0
    got = quantize(x, g, policy)
    ref = quantize(x, g, "reference")
    assert not (torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale))

    xc, cc, sc = crop_to_mismatch(x, g, got.codes, got.scale, ref.codes, ref.scale, "e4m3fn")

    assert xc.numel() < x.numel()
    again = quantize(xc, g, policy)
    assert torch.equal(again.codes, cc) and torch.equal(again.scale.nan_to_num(7.0), sc.nan_to_num(7.0))
    crop_ref = quantize(xc, g, "reference")
    assert not (torch.equal(crop_ref.codes, cc) and torch.equal(crop_ref.scale, sc)), "the crop keeps the mismatches"


def test_wrong_shapes_are_not_diagnosed():
    x = _bf16_gaussian((4, 256), seed=10)
    g = Granularity.group(128)
    ref = quantize(x, g, "reference")
    text = diagnose_quantize(x, g, ref.codes[:, :128], ref.scale, get_policy("reference"))
    assert text.startswith("diagnosis: not attempted")


def test_diagnosis_stays_fast_on_a_64x4096_input(engine_module):
    import time

    x = _bf16_gaussian((64, 4096), seed=11).to(torch.bfloat16)
    pol = replace(get_policy("reference"), name="bf16", compute_dtype="input")
    for g in (Granularity.group(128), Granularity.block(128), Granularity.token(), Granularity.tensor()):
        got = quantize(x, g, pol)
        start = time.perf_counter()
        diagnose_quantize(x, g, got.codes, got.scale, get_policy("reference"))
        assert time.perf_counter() - start < 2.0, g.label


def test_a_failing_diagnosis_keeps_the_original_message(monkeypatch):
    import fp8rl.conformance.test_quantization as tq

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(tq, "diagnose_quantize", boom)
    x = _bf16_gaussian((2, 256), seed=12)
    g = Granularity.group(128)
    got = quantize(x, g, "reference")
    with pytest.raises(AssertionError) as info:
        with tq._diagnosed(x, g, got, get_policy("reference")):
            raise AssertionError("codes differ: the original message")
    assert str(info.value) == "codes differ: the original message\ndiagnosis: unavailable (RuntimeError: boom)"


# ---------------------------------------------------------------------------------------------------------------
# (d) end to end: the conformance runner's report carries the diagnosis


@pytest.mark.parametrize("engine, keyword, checks, preset", [
    ("MulRecipGroup", "divide_vs_multiply and group", {"QUANT-EXACT-002"}, "sglang_triton_group"),
    ("RecipMaxGroup", "group and (divide_vs_multiply or property_exact)", {"QUANT-EXACT-002", "QUANT-PROP-001"},
     "vllm_triton_group"),
])
def test_conformance_report_message_carries_the_diagnosis(tmp_path, engine, keyword, checks, preset):
    """The real checks through ``fp8rl conformance``: each failed check's report.json message is the comparison's
    reproduction plus the diagnosis naming the preset the engine computes (QUANT-PROP-001: hypothesis's final,
    shrunk example)."""
    mod_dir = tmp_path / "vendor"
    mod_dir.mkdir()
    (mod_dir / "diag_vendor_engines.py").write_text(ENGINE_SRC)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(mod_dir), str(REPO_ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "fp8rl", "conformance", "--engine", f"diag_vendor_engines:{engine}",
                        "--area", "quantization", "-k", keyword, "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    by_id = {c["id"]: c for c in json.loads((out / "report.json").read_text())["checks"]}
    assert set(by_id) == checks
    for check_id in checks:
        entry = by_id[check_id]
        assert entry["outcome"] == "failed", entry
        msg = entry["message"]
        assert "differ" in msg and "\ndiagnosis: codes and scales match " in msg, msg
        best = _first_sentence(msg.split("\ndiagnosis: ")[1])
        assert f"'{preset}'" in best and "bit-exactly (declared 'vllm_cuda_group'" in best, msg
