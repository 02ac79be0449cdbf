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

__all__ = [
    "E4M3FN", "E4M3FNUZ", "E5M2", "E5M2FNUZ", "E8M0FNU", "ELEMENT_FORMATS", "FORMATS", "FP8Format",
    "decode", "decode_codes", "encode", "encode_codes", "get_format", "round_to_format", "ulp_distance",
]
