"""fp8rl.reference: the oracle. Plain PyTorch/numpy (fp32/fp64 math), CPU-only, importable with nothing configured.

It needs only torch and numpy; nothing here may import pytest, hypothesis or any engine.
"""

from fp8rl.reference.formats import (
    E4M3FN,
    E4M3FNUZ,
    E5M2,
    E5M2FNUZ,
    E8M0FNU,
    ELEMENT_FORMATS,
    FORMATS,
    FP8Format,
    decode,
    decode_codes,
    encode,
    encode_codes,
    get_format,
    round_to_format,
    ulp_distance,
)
from fp8rl.reference.gemm import block_gemm_exact, gemm_error_bound
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import PRESETS, get_policy
from fp8rl.reference.quant import (
    Granularity,
    QuantizedTensor,
    compute_amax,
    dequantize,
    expand_scale,
    quant_multiplier_from_amax,
    quantize,
    quantize_with_scale,
    round_scale_pow2,
    scale_from_amax,
)

__all__ = [
    "E4M3FN", "E4M3FNUZ", "E5M2", "E5M2FNUZ", "E8M0FNU", "ELEMENT_FORMATS", "FORMATS", "FP8Format",
    "decode", "decode_codes", "encode", "encode_codes", "get_format", "round_to_format", "ulp_distance",
    "PRESETS", "Granularity", "QuantizedTensor", "ScalePolicy", "compute_amax", "dequantize", "expand_scale",
    "get_policy", "quant_multiplier_from_amax", "quantize", "quantize_with_scale", "round_scale_pow2",
    "scale_from_amax", "block_gemm_exact", "gemm_error_bound",
]
