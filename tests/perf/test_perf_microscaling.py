"""The perf model's microscaling rows (MXFP8, MXFP4, NVFP4 experts): bytes per weight including scales."""

from __future__ import annotations

import pytest
from fp8rl.perf import model as pm


@pytest.mark.parametrize("fmt,per_weight,per_tensor", [("mxfp8", 1 + 1 / 32, 0), ("mxfp4", 0.5 + 1 / 32, 0),
                                                       ("nvfp4", 0.5 + 1 / 16, 4)])
def test_bytes_per_weight_exact(fmt, per_weight, per_tensor):
    # hand-computed: elements + one 1-byte scale per block of 32 (E8M0) or 16 (E4M3), + NVFP4's fp32 global scale
    assert pm.weight_format_bytes(fmt, 4096, 4096) == 4096 * 4096 * per_weight + per_tensor


def test_nondivisible_rows_round_up_exact():
    # 3 × 40 NVFP4: 120 elements → 60 bytes, ceil(40/16) = 3 scales per row → 9 bytes, + 4
    assert pm.weight_format_bytes("nvfp4", 3, 40) == 60 + 9 + 4


def test_nvfp4_experts_quantizes_experts_only_exact():
    spec = pm.load_model_spec("qwen3-30b-a3b")
    wb = pm.weight_bytes(spec, "nvfp4-experts")
    experts = [w for w in spec.weight_groups() if w.kind == "expert"]
    others = [w for w in spec.weight_groups() if w.kind != "expert"]
    assert wb["bf16"] == sum(w.numel * pm.BF16_BYTES for w in others)
    assert wb["fp8"] + wb["scales"] == sum(int(pm.weight_format_bytes("nvfp4", *w.shape)) * w.count for w in experts)


def test_fp8_rows_unchanged_and_mx_rows_resolve_exact():
    spec = pm.load_model_spec("qwen3-8b")
    wb = pm.weight_bytes(spec, "fp8-linear")
    lin = [w for w in spec.weight_groups() if w.fp8_eligible]
    assert wb["scales"] == sum(-(-w.shape[0] // 128) * -(-w.shape[1] // 128) * 4 * w.count for w in lin)
    assert set(pm.PRECISIONS) == {"bf16", "fp8-linear", "fp8-kv", "fp8-all"}
    for name in pm.MX_PRECISIONS:
        assert pm.get_precision(name).name == name
    est = pm.estimate_all(spec, pm.load_hardware("B200"), pm.Workload(), ["bf16", "mxfp8", "nvfp4-experts"])
    assert est["mxfp8"].weight_bytes > pm.weight_bytes(spec, "fp8-linear")["total"]  # E8M0 per 32 > fp32 per 128²


def test_gb200_entry_matches_its_device_name_not_b200s_exact():
    assert pm.match_hardware("NVIDIA GB200").name == "GB200"
    assert pm.match_hardware("NVIDIA B200").name == "B200"
    gb = pm.load_hardware("GB200")
    # NVL72 rack figures with sparsity / 72 GPUs / 2 (dense): FP4 1,440 PF, FP8 720 PF, BF16 360 PF
    assert (gb.fp4_dense_flops, gb.fp8_dense_flops, gb.bf16_dense_flops) == (1440e15 / 144, 720e15 / 144,
                                                                              360e15 / 144)


@pytest.mark.parametrize("config,fp4", [("nvfp4-experts", True), ("mxfp4", True), ("mxfp8", False),
                                        ("fp8-linear", False)])
def test_fp4_recipes_compute_at_the_fp4_peak_exact(config, fp4):
    spec = pm.load_model_spec("qwen3-30b-a3b")
    step = pm.decode_step(spec, pm.load_hardware("GB200"), config, 256, 1536.5)
    peak = 10.0e15 if fp4 else 5.0e15
    assert step["compute_time_s"] == step["linear_flops"] / peak + step["attention_flops"] / 2.5e15
    # hardware without an FP4 peak (Hopper) falls back to the FP8 rate
    h = pm.decode_step(spec, pm.load_hardware("H200"), config, 256, 1536.5)
    assert h["compute_time_s"] == h["linear_flops"] / 1978.9e12 + h["attention_flops"] / 989.4e12
