"""Peers: transformers' FP8 integration helper against the preset that claims it, bit for bit.

Called from the installed package: ``transformers/integrations/finegrained_fp8.py`` ``Fp8Quantize._quantize_one``
(the reverse op that block-quantizes a BF16 weight into ``weight`` + ``weight_scale_inv`` with
``scale_fmt='float'``), 128×128 blocks; shapes the block does not divide are passed through unquantized by
transformers, so the 129×257 item is skipped. transformers is in every environment (base 5.25.0, vllm and triton
5.19.0, verl 5.10.4): this file runs in each. Inputs: the battery of tests/support/peers.py, fp32 and bf16.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from fp8rl.reference.quant import Granularity
from support import peers
from support.peers import PeerCase
from support.upstream import pin_marks

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
    *pin_marks("transformers", ">=5.10.4,<=5.25.0",
               "transformers' Fp8Quantize block quantizer matches hf_finegrained_fp8 bit for bit"),
]


def _quantize_one(x: torch.Tensor):
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = SimpleNamespace(weight_block_size=(128, 128), scale_fmt="float")
    out = Fp8Quantize(SimpleNamespace(quantization_config=cfg))._quantize_one("layer.weight", x)
    return out["layer.weight"], out["layer.weight_scale_inv"]


CASES: dict[str, PeerCase] = {
    "Fp8Quantize": PeerCase("hf_finegrained_fp8", Granularity.block(128), _quantize_one,
                            "transformers integrations/finegrained_fp8.py Fp8Quantize._quantize_one", divisible=True,
                            why_divisible="transformers leaves a weight the block does not divide unquantized"),
}


@pytest.mark.parametrize("dtype", list(peers.DTYPES))
@pytest.mark.parametrize("item", peers.BATTERY)
@pytest.mark.parametrize("case", list(CASES))
def test_transformers_peer_matches_preset_exact(case, item, dtype):
    peers.run_case(CASES[case], item, dtype)
