"""The analytic perf model: parameter inventory, weight-sync precision rules, KV capacity, roofline.

The validation test reproduces the paper's measured KV capacities for Qwen3-8B-Base (NeMo-RL PR #1212,
docs/paper-numbers.md §2.1) from the BF16 row alone.
"""

from __future__ import annotations

import json
import math

import pytest
from fp8rl.perf import model as pm

PAPER_ROWS = {"bf16": (249_952, 11.10), "fp8-linear": (299_344, 13.29), "fp8-all": (598_672, 26.57)}
PAPER_MAX_MODEL_LEN = 2048 + 20480  # 249,952 / 11.10 ≈ 22,518 → prompt 2K + 20K response = 22,528


@pytest.fixture(scope="module")
def q8():
    return pm.load_model_spec("qwen3-8b")


@pytest.fixture(scope="module")
def q30():
    return pm.load_model_spec("Qwen/Qwen3-30B-A3B-Base")


def test_published_parameter_counts(q8, q30):
    # Qwen3 model cards: 8.2B (6.95B non-embedding); 30.5B total, 3.3B activated
    assert q8.num_params() == pytest.approx(8.19e9, rel=2e-3)
    assert q30.num_params() == pytest.approx(30.5e9, rel=3e-3)
    active_30 = q30.active_params_per_token() + q30.vocab_size * q30.hidden_size  # + embedding row, as cards count
    assert active_30 == pytest.approx(3.3e9, rel=0.03)
    assert not q8.is_moe and q30.is_moe and len(q30.moe_layers) == 48


def test_weight_sync_rules_what_stays_bf16(q30):
    groups = {w.name: w for w in q30.weight_groups()}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "layers.*.mlp.gate.weight",
                 "layers.*.input_layernorm.weight", "layers.*.self_attn.q_norm.weight", "model.norm.weight"):
        assert not groups[name].fp8_eligible, name
    for name in ("layers.*.self_attn.q_proj.weight", "layers.*.self_attn.o_proj.weight",
                 "layers.*.mlp.experts.*.down_proj.weight"):
        assert groups[name].fp8_eligible, name
    wb = pm.weight_bytes(q30, "fp8-linear")
    bf16_part = sum(w.numel for w in groups.values() if not w.fp8_eligible) * 2
    assert wb["bf16"] == bf16_part
    assert wb["total"] == wb["fp8"] + wb["scales"] + wb["bf16"]


def test_block_scales_use_ceil_div_and_fp32():
    cfg = {"hidden_size": 200, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 100, "intermediate_size": 300, "vocab_size": 1000, "tie_word_embeddings": True}
    spec = pm.ModelSpec.from_hf_config(cfg)
    # q (200x200): 2x2 blocks; k, v (100x200): 1x2; o (200x200): 2x2; gate/up (300x200): 3x2; down (200x300): 2x3
    n_scales = 4 + 2 + 2 + 4 + 6 + 6 + 6
    wb = pm.weight_bytes(spec, "fp8-linear")
    assert wb["scales"] == 4 * n_scales
    # tied: one embedding matrix, no lm_head
    assert "lm_head.weight" not in {w.name for w in spec.weight_groups()}
    assert wb["bf16"] == (1000 * 200 + 200 * 3) * 2


def test_kv_bytes_per_token(q8, q30):
    assert pm.kv_bytes_per_token(q8, "bf16") == 2 * 36 * 8 * 128 * 2 == 147_456
    assert pm.kv_bytes_per_token(q8, "fp8-kv") == 73_728
    assert pm.kv_bytes_per_token(q30, "fp8-all") == 2 * 48 * 4 * 128
    assert pm.kv_bytes_per_token(q8, "fp8-linear") == pm.kv_bytes_per_token(q8, "bf16")
    assert pm.kv_bytes_per_token(q8, "bf16", tp=2) == 147_456 // 2
    assert pm.kv_bytes_per_token(q30, "bf16", tp=8) == 2 * 48 * 1 * 128 * 2  # 4 KV heads replicated beyond tp=4


def test_validation_paper_kv_capacity_rows_within_3_percent(q8):
    """Calibrate the memory budget from the BF16 row, predict the FP8 rows (docs/paper-numbers.md §2.1)."""
    budget = pm.budget_from_kv_tokens(q8, "bf16", PAPER_ROWS["bf16"][0])
    assert pm.kv_capacity_tokens(q8, "bf16", budget) == PAPER_ROWS["bf16"][0]  # 249,952 is a multiple of 16
    for cfg in ("fp8-linear", "fp8-all"):
        pred = pm.kv_capacity_tokens(q8, cfg, budget)
        paper = PAPER_ROWS[cfg][0]
        assert abs(pred / paper - 1) < 0.03, (cfg, pred, paper)
        assert pm.max_concurrency(pred, 2048, 20480) == pytest.approx(PAPER_ROWS[cfg][1], rel=0.03)
    # the calibrated BF16 concurrency reproduces vLLM's printed number to its 2 decimals
    assert round(pm.max_concurrency(PAPER_ROWS["bf16"][0], 2048, 20480), 2) == PAPER_ROWS["bf16"][1]


def test_capacity_rounds_down_to_blocks_and_never_negative(q8):
    budget = pm.weight_bytes(q8, "bf16")["total"] + 17 * 147_456 + 5
    assert pm.kv_capacity_tokens(q8, "bf16", budget) == 16
    assert pm.kv_capacity_tokens(q8, "bf16", 1) == 0


def test_estimate_monotone_and_ratios(q8):
    hw = pm.load_hardware("H100-SXM-80GB")
    wl = pm.Workload(prompt_len=2048, gen_len=20480, calibration=("bf16", 249_952))
    est = pm.estimate_all(q8, hw, wl)
    assert est["bf16"].ratio_vs_bf16 == 1.0
    assert 1.0 < est["fp8-linear"].ratio_vs_bf16 < est["fp8-kv"].ratio_vs_bf16 < est["fp8-all"].ratio_vs_bf16
    # in the KV-capacity-bound regime the fp8-kv ceiling is the capacity ratio, 2x
    assert est["fp8-kv"].ratio_vs_bf16 == pytest.approx(2.0, rel=0.01)
    assert est["bf16"].step["bound"] == "memory"
    # the ceiling is at or above every published band's top (the model is an upper guard)
    assert est["fp8-linear"].ratio_vs_bf16 >= 1.10


def test_decode_step_regimes(q8):
    hw = pm.load_hardware("H200")
    small = pm.decode_step(q8, hw, "bf16", concurrency=1, context=128)
    assert small["bound"] == "memory"
    # weight-bandwidth bound at batch 1: fp8 halves most bytes
    ratio = small["time_s"] / pm.decode_step(q8, hw, "fp8-linear", 1, 128)["time_s"]
    assert 1.6 < ratio < 2.0
    big = pm.decode_step(q8, hw, "bf16", concurrency=4096, context=16)
    assert big["bound"] == "compute"


def test_moe_expert_fraction(q30):
    hw = pm.load_hardware("H100-SXM-80GB")
    one = pm.decode_step(q30, hw, "bf16", 1, 0)
    many = pm.decode_step(q30, hw, "bf16", 512, 0)
    expert_bytes = sum(w.bytes(False) for w in q30.weight_groups() if w.kind == "expert")
    # one token touches top-8 of 128 experts per layer; 512 tokens touch ~all
    assert one["weight_bytes_read"] < 0.1 * expert_bytes + 2e9
    assert many["weight_bytes_read"] == pytest.approx(pm.weight_bytes(q30, "bf16")["total"], rel=0.02)


def test_gemm_ceiling():
    hw = pm.load_hardware("H100-SXM-80GB")
    assert pm.gemm_speedup_ceiling(8192, 8192, 8192, hw) == pytest.approx(2.0, rel=1e-3)  # compute bound
    assert 1.8 < pm.gemm_speedup_ceiling(16, 4096, 4096, hw) <= 2.0  # weight-bandwidth bound
    with pytest.raises(ValueError):
        pm.gemm_speedup_ceiling(1, 1, 1, hw, scaling="nope")


def test_names_paths_and_hardware_matching(tmp_path):
    from fp8rl import fixtures

    cfg = fixtures.published_config("Qwen3-8B")
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    assert pm.load_model_spec(d).num_params() == pm.load_model_spec("Qwen3-8B-Base").num_params()
    assert pm.load_model_spec(d / "config.json").name == "my-model"
    assert pm.normalize_model_name("Qwen/Qwen3-30B-A3B-Instruct") == "qwen3-30b-a3b"
    assert {"Qwen3-8B", "Qwen3-30B-A3B", "tiny-qwen3", "tiny-qwen3-moe"} <= set(pm.known_models())
    tiny = pm.load_model_spec("tiny-qwen3-moe")
    assert tiny.is_moe and tiny.num_experts == 8 and tiny.num_experts_per_tok == 2
    with pytest.raises(ValueError, match="neither"):
        pm.load_model_spec("no-such-model")
    assert pm.match_hardware("NVIDIA H100 80GB HBM3").name == "H100-SXM-80GB"
    assert pm.match_hardware("NVIDIA H200").name == "H200"
    assert pm.match_hardware("NVIDIA B200").cls == "blackwell"
    assert pm.match_hardware("Intel Xeon") is None
    assert pm.load_hardware("h200").name == "H200"
    with pytest.raises(ValueError):
        pm.load_hardware("TPU")
    assert pm.get_precision("fp8-linear+kv").name == "fp8-all"
    with pytest.raises(ValueError):
        pm.get_precision("int4")


def test_config_validation():
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 100}
    spec = pm.ModelSpec.from_hf_config(base)
    assert spec.num_kv_heads == 4 and spec.head_dim == 16 and not spec.is_moe
    with pytest.raises(ValueError, match="hidden_size"):
        pm.ModelSpec.from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="multiple"):
        pm.ModelSpec.from_hf_config({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        pm.ModelSpec.from_hf_config({**base, "num_experts": 4, "num_experts_per_tok": 8})
    mixtral = pm.ModelSpec.from_hf_config({**base, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.is_moe and mixtral.moe_intermediate_size == 128
    sparse = pm.ModelSpec.from_hf_config({**base, "num_experts": 4, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32, "decoder_sparse_step": 2})
    assert sparse.moe_layers == (1,)
    with pytest.raises(ValueError):
        pm.Workload(prompt_len=10, gen_len=0)


def test_workload_that_does_not_fit(q30):
    hw = pm.load_hardware("H100-SXM-80GB")
    est = pm.estimate(q30, hw, "bf16", pm.Workload(1024, 20480, gpu_memory_utilization=0.5))
    assert est.kv_capacity_tokens == 0 and not est.fits and est.notes
    assert math.isinf(pm.speedup_ceiling(q30, hw, "fp8-linear", pm.Workload(1024, 20480, gpu_memory_utilization=0.5)))
