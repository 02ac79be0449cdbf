"""The scale policies of the engines we test: :data:`PRESETS` (name → :class:`~fp8rl.reference.policy.ScalePolicy`)
and :func:`get_policy`.

Each preset's description cites the engine source it reproduces and the section of docs/engine-numerics.md that measures it.
:func:`get_policy` is how every quantizer of the oracle accepts a policy: a preset name or a ScalePolicy.

Needs only torch and numpy (through :mod:`fp8rl.reference.policy`).
"""

from __future__ import annotations

from fp8rl.reference.policy import ScalePolicy

__all__ = ["PRESETS", "VLLM_MIN_SCALE", "get_policy"]


def _p(name: str, description: str, **kw) -> ScalePolicy:
    return ScalePolicy(name=name, description=description, **kw)


#: vLLM's minimum dynamic scale 1/(448·512) (``MIN_SCALE_FACTOR``): s = max(amax/448, 1/(448·512)), so a group's
#: quantized values stay ≤ 448·512 times its smallest representable step
VLLM_MIN_SCALE = 1.0 / (448.0 * 512.0)

PRESETS: dict[str, ScalePolicy] = {p.name: p for p in (
    _p("reference", "fp8rl's default: amax floor 1e-10, s = amax/T, q = x/s, clamp, RNE-saturate (the CUDA "
       "per_token_group_quant_fp8 formula, docs/engine-numerics.md §2.2)",
       floor="amax", eps=1e-10),
    _p("vllm_cuda_group", "vLLM per_token_group_quant_fp8 CUDA kernel (csrc/quantization/w8a8/fp8/"
       "per_token_group_quant.cu): s = max(amax,1e-10)/448, q = clamp(x/s), SATFINITE (docs/engine-numerics.md §2.2, §6)",
       floor="amax", eps=1e-10),
    _p("vllm_triton_group", "vLLM per_token_group_quant_fp8 Triton fallback (model_executor/layers/quantization/"
       "utils/fp8_utils.py): s = max(amax,1e-10)·(1/448), q = clamp(x/s) (docs/engine-numerics.md §2.2, §7)",
       floor="amax", eps=1e-10, scale_op="mul_recip_max"),
    _p("vllm_native", "vLLM QuantFP8.forward_native per-tensor/per-token path (layers/quantization/"
       "input_quant_fp8.py): s = max(amax/448, 1/(448·512)), q = clamp(x·(1/s)) (docs/engine-numerics.md §2.1); the native *group* "
       "path divides instead, see 'vllm_native_group'",
       floor="scale", eps=VLLM_MIN_SCALE, quant_op="mul_recip"),
    _p("vllm_native_group", "vLLM QuantFP8._quantize_group_native (input_quant_fp8.py): s = max(amax/448, "
       "1/(448·512)), q = clamp(x/s) (docs/engine-numerics.md §2.2 'Inconsistency to test'). With use_ue8m0 vLLM rounds to a "
       "power of two *before* this clamp, so tiny groups get the non-power-of-two scale 1/(448·512); that order is "
       "not representable here (floors apply before pow2)",
       floor="scale", eps=VLLM_MIN_SCALE),
    _p("vllm_per_token", "vLLM scaled_fp8_quant dynamic per-token CUDA (csrc/quantization/w8a8/fp8/common.cu): "
       "s = max(amax/448, 1/(448·512)), q = clamp(x/s) (docs/engine-numerics.md §2.1, §6)",
       floor="scale", eps=VLLM_MIN_SCALE),
    _p("vllm_per_tensor_cuda", "vLLM scaled_fp8_quant dynamic per-tensor CUDA: s = amax/448 with no eps, "
       "q = clamp(x·(1/s)); an all-zero tensor gives s = 0 and NaN here (the kernel's fminf(NaN,448) is predicted "
       "to store +448, not verified on GPU) (docs/engine-numerics.md §2.1)",
       floor="none", eps=0.0, zero_amax="nan", quant_op="mul_recip"),
    _p("vllm_ue8m0_group", "vLLM per_token_group_quant_fp8 with UE8M0 (CUDA kernel): s = 2^ceil(log2(max(amax/448, "
       "1e-10))) via exp2f/ceilf/log2f, q = clamp(x/s) (docs/engine-numerics.md §2.2, §7). The Triton fallback applies no "
       "1e-10 scale floor (s ≥ 2^-42 instead of 2^-33 for all-zero groups)",
       floor="scale", eps=1e-10, pow2="ceil_log2"),
    _p("vllm_triton_ue8m0_group", "vLLM per_token_group_quant_fp8 Triton fallback with use_ue8m0=True (model_executor/"
       "layers/quantization/utils/fp8_utils.py): s = exp2(ceil(log2(max(amax,1e-10)·fl(1/448)))), q = clamp(x/s); "
       "unlike the CUDA kernel (vllm_ue8m0_group) no 1e-10 scale floor: an all-zero group gets 2^-42, not 2^-33 "
       "(docs/engine-numerics.md §2.2, §7)",
       floor="amax", eps=1e-10, scale_op="mul_recip_max", pow2="ceil_log2"),
    _p("deepgemm_block", "DeepGEMM/vLLM per_block_cast_to_fp8 (vllm/utils/deep_gemm.py, third_party/deep_gemm/"
       "utils/math.py): s = max(amax,1e-4)/448, q = (x·(1/s)).to(fp8) with no clamp (saturating torch cast) "
       "(docs/engine-numerics.md §2.3)",
       floor="amax", eps=1e-4, quant_op="mul_recip", clamp=False),
    _p("deepgemm_ue8m0", "DeepGEMM per_block/per_token_cast_to_fp8 with use_ue8m0: s = ceil_to_ue8m0(max(amax,1e-4)"
       "/448) on the fp32 bits (exponent + (mantissa≠0), clamped to [1,254]), q = (x·(1/s)).to(fp8), no clamp "
       "(docs/engine-numerics.md §2.3, §7). SGLang's copy (srt/layers/quantization/fp8_utils.py per_block_cast_to_fp8, "
       "always UE8M0, used by quant_weight_ue8m0) has the same numerics",
       floor="amax", eps=1e-4, pow2="ceil_bits", quant_op="mul_recip", clamp=False),
    _p("verl_triton", "verl _blockwise_cast_to_fp8_kernel (verl/utils/kernel/fp8_kernel.py, default path): "
       "s = max(amax,1e-10)/448, q = clamp(x·(1/s)) (docs/paper-numbers.md §1.2)",
       floor="amax", eps=1e-10, quant_op="mul_recip"),
    _p("verl_torch", "verl _scaled_fp8_blockwise_pytorch (VERL_DISABLE_TRITON_FP8=1): m = 448/amax, m = 1 when "
       "amax is 0 or inf, s = 1/m, q = clamp(x·m) (docs/paper-numbers.md §1.2). verl keeps a NaN amax as NaN (here: scale 1)",
       floor="none", eps=0.0, zero_amax="one", scale_op="recip_multiplier", quant_op="mul_max_over_amax"),
    _p("te_blockwise_pow2", "TransformerEngine Float8BlockQuantizer (common/recipe/recipe_common.cuh "
       "compute_scale_from_amax): amax_epsilon 0, m = 448/amax (0/inf/NaN amax → 1, inf m → FLT_MAX), mantissa "
       "of m zeroed, scale_inv = 1/m, q = x·m, SATFINITE (docs/engine-numerics.md §4.1)",
       floor="amax", eps=0.0, zero_amax="one", pow2="floor_multiplier", scale_op="recip_multiplier",
       quant_op="mul_max_over_amax"),
    _p("sglang_group", "SGLang sglang_per_token_group_quant_fp8 JIT kernel (kernels/jit/csrc/gemm/"
       "per_token_group_quant.cuh, CUDA only; source re-read for 0.5.23: amax = max(amax, 1e-10f), raw_scale = "
       "amax * kMaxValueInv, quant_scale = kMaxValue / amax): amax' = max(amax,1e-10), stored s = amax'·(1/448), "
       "q = x·(448/amax') (docs/engine-numerics.md §3.1)",
       floor="amax", eps=1e-10, scale_op="mul_recip_max", quant_op="mul_max_over_amax"),
    _p("sglang_triton_group", "SGLang Triton 1x128 group quant with row-major scales, the per_token_group_quant_fp8 "
       "of every non-CUDA platform (sglang/kernels/ops/quantization/fp8_kernel.py _per_token_group_quant_8bit, "
       "0.5.23; also SGLang's per-token activation and per-channel weight quant there, group = K): amax' = "
       "max(amax,1e-10), s = amax'/448, q = clamp(x·(1/s)) (measured under TRITON_INTERPRET=1 with the "
       "faithful-downcast workaround; docs/engine-numerics.md §3.1, docs/triton-interpreter.md)",
       floor="amax", eps=1e-10, quant_op="mul_recip"),
    _p("sglang_triton_group_colmajor", "SGLang Triton 1x128 group quant with column-major scales "
       "(fp8_kernel.py _per_token_group_quant_8bit_colmajor, column_major_scales=True): amax' = max(amax,1e-10), "
       "s = amax'/448, q = clamp(x/s) — true division, unlike the row-major kernel (docs/engine-numerics.md §3.1)",
       floor="amax", eps=1e-10),
    _p("sglang_triton_group_ue8m0", "SGLang Triton column-major group quant with SCALE_UE8M0 "
       "(_per_token_group_quant_8bit_colmajor): s = exp2(ceil(log2(max(amax,1e-10)/448))), q = clamp(x/s). The "
       "interpreter's log2 is numpy's fp32 log2 (as torch's here); a GPU's approximate lg2 may round differently "
       "a few ulps above a power of two (docs/engine-numerics.md §3.1, §7)",
       floor="amax", eps=1e-10, pow2="ceil_log2"),
    _p("sglang_static", "SGLang static_quant_fp8 Triton kernel (fp8_kernel.py _static_quant_fp8) and the static "
       "per-tensor MLA stage 2: the scale is given (static); q = clamp(x·(1/s)). Only quant_op/clamp apply (use "
       "with quantize_with_scale); the amax fields repeat the group defaults (docs/engine-numerics.md §3.1)",
       floor="amax", eps=1e-10, quant_op="mul_recip"),
    _p("sglang_mla_tensor", "SGLang per_tensor_quant_mla_fp8 (fp8_kernel.py _per_tensor_quant_mla_fp8_stage1/2): "
       "per-row amax' = max(amax,1e-12), s = atomic max of amax'/448 (= max(amax,1e-12)/448), "
       "q = clamp(x·(1/s)) (docs/engine-numerics.md §3.1)",
       floor="amax", eps=1e-12, quant_op="mul_recip"),
    _p("sglang_native", "SGLang ROCm torch fallbacks _native_dynamic_per_token_quant_fp8 / "
       "_native_dynamic_per_tensor_quant_fp8 (fp8_kernel.py, defined only under `if _is_hip:`): amax' = "
       "max(amax,1e-12), s = amax'/fp8_max, q = clamp(x/s), in the *input* dtype (bf16 in → bf16 arithmetic; this "
       "preset is the fp32-input case). fp8_max is 224 with e4m3fnuz on gfx94x, 448 with e4m3fn elsewhere (docs/engine-numerics.md §3.1)",
       floor="amax", eps=1e-12),
    _p("sglang_fp8_quantize", "SGLang fp8_quantize Triton kernel (kernels/ops/quantization/fp8_quantize.py): "
       "q = (fl32(x)·scale_inv).to(fp8) with the caller's scale_inv = 1/s, no clamp: the conversion saturates "
       "(Triton's satfinite fp32→fp8 on NVIDIA); bf16/fp16 input only (docs/engine-numerics.md §3.1)",
       floor="amax", eps=1e-10, quant_op="mul_recip", clamp=False),
    _p("torchao", "torchao blockwise training quant (torchao/prototype/blockwise_fp8_training/kernels.py): "
       "m = fl32(448/max(amax,1e-12)) (fp64 then fp32, identical to fp32 division), q = clamp(x·m), s = 1/m "
       "(docs/engine-numerics.md §5)",
       floor="amax", eps=1e-12, scale_op="recip_multiplier", quant_op="mul_max_over_amax"),
    _p("deepseek_ref", "DeepSeek-V3 reference act_quant / torchao fp8_blockwise_act_quant (torchao/prototype/"
       "blockwise_fp8_inference/kernels.py): s = amax/448 with no eps (zero block → NaN), q = x/s, no clamp "
       "(docs/engine-numerics.md §5)",
       floor="none", eps=0.0, zero_amax="nan", clamp=False),
    _p("rocm_fnuz", "vLLM/SGLang dynamic group quant on ROCm gfx94x: e4m3fnuz clamped at 224 (not 240), "
       "s = max(amax,1e-10)/224, q = clamp(x/s) (docs/engine-numerics.md §1, §2.1)",
       fmt="e4m3fnuz", target_max=224.0, floor="amax", eps=1e-10),
)}


def get_policy(name_or_policy: str | ScalePolicy) -> ScalePolicy:
    """A preset by name (or the policy itself); ValueError lists the presets."""
    if isinstance(name_or_policy, ScalePolicy):
        return name_or_policy
    if not isinstance(name_or_policy, str):
        raise TypeError(f"policy: expected a preset name or a ScalePolicy, got {type(name_or_policy).__name__}")
    try:
        return PRESETS[name_or_policy]
    except KeyError:
        raise ValueError(f"policy: unknown preset {name_or_policy!r}; expected one of {sorted(PRESETS)}") from None
