"""Peers: veRL 0.9.1's PyTorch blockwise quantizer against the preset that claims it, bit for bit.

Called from the installed package: ``verl/utils/kernel/fp8_kernel.py`` ``_scaled_fp8_blockwise_pytorch`` (the path
``scaled_fp8_blockwise`` takes with ``VERL_DISABLE_TRITON_FP8=1`` or without Triton), 128×128 blocks. Inputs: the
battery of tests/support/peers.py, fp32 and bf16.
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
    pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                       reason="verl is not installed (verl==0.9.1 lives in its own venv: nox -s conformance_verl)"),
    *pin_marks("verl", "==0.9.1", "veRL's PyTorch blockwise FP8 quantizer matches verl_torch bit for bit"),
]


def _blockwise(x: torch.Tensor):
    from verl.utils.kernel.fp8_kernel import _scaled_fp8_blockwise_pytorch

    return _scaled_fp8_blockwise_pytorch(x, [128, 128])


CASES: dict[str, PeerCase] = {
    "scaled_fp8_blockwise_pytorch": PeerCase("verl_torch", Granularity.block(128), _blockwise,
                                             "verl utils/kernel/fp8_kernel.py _scaled_fp8_blockwise_pytorch"),
}


@pytest.mark.parametrize("dtype", list(peers.DTYPES))
@pytest.mark.parametrize("item", peers.BATTERY)
@pytest.mark.parametrize("case", list(CASES))
def test_verl_peer_matches_preset_exact(case, item, dtype):
    peers.run_case(CASES[case], item, dtype)
