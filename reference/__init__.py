"""fp8rl.reference: the oracle. Plain PyTorch/numpy (fp32/fp64 math), CPU-only, importable with nothing configured.

It needs only torch and numpy — except :mod:`~fp8rl.reference.rollout_hf`, the HF-transformers glue of the e2e
rollout oracle, which needs transformers and safetensors to build and run models. Nothing here may import pytest,
hypothesis, an engine or the harness (``fp8rl.tolerances``, ``fp8rl.checks``, …): arrows point from the harness to
the oracle only (tests/harness/test_packaging.py checks it).

Modules:

* :mod:`~fp8rl.reference.formats`: FP8/E8M0 formats, bit-level encode/decode with rounding and overflow policies.
* :mod:`~fp8rl.reference.policy`: :class:`ScalePolicy`, every numerical choice of a dynamic scaled-FP8 quantizer.
* :mod:`~fp8rl.reference.presets`: :data:`PRESETS`, the scale policies of the engines we test, and :func:`get_policy`.
* :mod:`~fp8rl.reference.quant`: :class:`Granularity`, :class:`QuantizedTensor` and the amax → scale → cast pipeline.
* :mod:`~fp8rl.reference.bounds`: error-bound formulas (unit roundoffs, γ_n, eval_slack, the fp32-accumulation GEMM
  bound).
* :mod:`~fp8rl.reference.gemm`: the exact scaled FP8 GEMM and its rigorous error bound for fp32-accumulating kernels.
* :mod:`~fp8rl.reference.kv`: FP8 KV cache (quantize-on-store, FP8 attention, Q/K/V scale calibration).
* :mod:`~fp8rl.reference.drift`: the KV-scale drift simulator (why scales must be recalibrated every RL step).
* :mod:`~fp8rl.reference.correction`: rollout correction (IS weights, rejection sampling, losses, KL estimators).
* :mod:`~fp8rl.reference.weight_sync`: BF16 trainer weights → blockwise FP8 weights + ``*_scale_inv``.
* :mod:`~fp8rl.reference.rollout`: rollout numerics (recipes, fake quantization, FP8 linear/KV emulation,
  calibration, mismatch metrics).
* :mod:`~fp8rl.reference.rollout_hf`: rollout policies on HF transformers models (needs transformers).
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
