"""Peers: SGLang 0.5.23's own torch quantizers against the presets that claim them, bit for bit.

Called from the installed package (loaded as the ``sglang`` engine loads it, fp8rl.engines.sglang): the ROCm torch
fallbacks ``_native_dynamic_per_token_quant_fp8`` / ``_native_dynamic_per_tensor_quant_fp8`` of
``sglang/kernels/ops/quantization/fp8_kernel.py`` (defined only under ``if _is_hip:``; their two ``def`` statements
are compiled from the installed file, unchanged, in that module's namespace — fp8_dtype e4m3fn, fp8_max 448 off
ROCm), ``srt/layers/quantization/fp8_utils.py`` ``per_block_cast_to_fp8`` (DeepGEMM's UE8M0 copy) and
``input_to_float8``. Inputs: the battery of tests/support/peers.py, fp32 and bf16.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect

import pytest
import torch
from fp8rl.reference.quant import Granularity
from support import peers
from support.peers import PeerCase
from support.upstream import pin_marks

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="sglang is not installed (sglang==0.5.23 lives in its own venv: nox -s conformance_triton)"),
    *pin_marks("sglang", "==0.5.23", "SGLang's torch FP8 quantizers match their presets bit for bit"),
]

HIP_ONLY = ("_native_dynamic_per_token_quant_fp8", "_native_dynamic_per_tensor_quant_fp8")


@functools.cache
def _ns():
    from fp8rl.engines.sglang import _mods

    return _mods()


@functools.cache
def _hip_fallbacks() -> dict:
    """The ``if _is_hip:`` fallbacks of fp8_kernel.py, compiled from the installed source, unchanged, with the
    module's own globals."""
    qk = _ns().qk
    path = inspect.getsourcefile(qk)
    tree = ast.parse(open(path).read(), path)
    defs = [n for top in tree.body if isinstance(top, ast.If) for n in top.body
            if isinstance(n, ast.FunctionDef) and n.name in HIP_ONLY]
    assert {d.name for d in defs} == set(HIP_ONLY), f"{path}: the hip-only fallbacks moved"
    scope = dict(vars(qk))
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), scope)  # noqa: S102 (the installed code)
    assert scope["fp8_max"] == 448.0 and scope["fp8_dtype"] == torch.float8_e4m3fn
    return {name: scope[name] for name in HIP_ONLY}


def _native(kind: str):
    def fn(x: torch.Tensor):
        f = _hip_fallbacks()["_native_dynamic_per_token_quant_fp8" if kind == "token"
                             else "_native_dynamic_per_tensor_quant_fp8"]
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        scale = torch.empty((x.shape[0], 1) if kind == "token" else (1,), dtype=torch.float32)
        f(out, x, scale)
        return out, scale
    return fn


def _per_block(x: torch.Tensor):
    return _ns().fu.per_block_cast_to_fp8(x)


def _input_to_float8(x: torch.Tensor):
    q, s = _ns().fu.input_to_float8(x, torch.float8_e4m3fn)
    return q, s.reshape(1)


_QK = "sglang kernels/ops/quantization/fp8_kernel.py"
CASES: dict[str, PeerCase] = {
    "native_per_token": PeerCase("sglang_native", Granularity.token(), _native("token"),
                                 f"{_QK} _native_dynamic_per_token_quant_fp8"),
    "native_per_tensor": PeerCase("sglang_native", Granularity.tensor(), _native("tensor"),
                                  f"{_QK} _native_dynamic_per_tensor_quant_fp8"),
    "per_block_cast_to_fp8": PeerCase("deepgemm_ue8m0", Granularity.block(128), _per_block,
                                      "sglang srt/layers/quantization/fp8_utils.py per_block_cast_to_fp8"),
    "input_to_float8": PeerCase("sglang_input_to_float8", Granularity.tensor(), _input_to_float8,
                                "sglang srt/layers/quantization/fp8_utils.py input_to_float8"),
}


@pytest.mark.parametrize("dtype", list(peers.DTYPES))
@pytest.mark.parametrize("item", peers.BATTERY)
@pytest.mark.parametrize("case", list(CASES))
def test_sglang_peer_matches_preset_exact(case, item, dtype):
    peers.run_case(CASES[case], item, dtype)
