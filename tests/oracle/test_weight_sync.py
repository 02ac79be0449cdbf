"""The weight-sync oracle: names, exclusions, scale convention, writer/loader."""

from __future__ import annotations

import json

import pytest
import torch
from fp8rl import fixtures as F
from fp8rl import tolerances
from fp8rl.reference import weight_sync as ws
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, quantize


@pytest.fixture(scope="module")
def moe():
    return F.tiny_model("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def dense():
    return F.tiny_model("tiny-qwen3")


@pytest.fixture(scope="module")
def dense_synced(dense):
    return ws.quantize_state_dict(dense.state_dict)


def test_default_filters_pick_projections_and_experts_only(moe):
    names = ws.quantized_names(moe.state_dict)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert len(names) == 2 * (4 + 8 * 3)
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight",
              "model.layers.0.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight"):
        assert n not in names
    assert ws.ignored_layers(moe.state_dict) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert not ws.is_quantized_name("model.layers.0.mlp.shared_expert_gate.weight", (1, 256))
    assert not ws.is_quantized_name("model.layers.0.self_attn.q_proj.weight", (256,))  # 1-D: never


def test_quantize_state_dict_layout_and_values(dense, dense_synced):
    sd, out = dense.state_dict, dense_synced
    g = Granularity.block(128)
    keys = list(out)
    for n in ws.quantized_names(sd):
        w, s = out[n], out[ws.scale_name(n)]
        assert keys.index(ws.scale_name(n)) == keys.index(n) + 1
        assert w.dtype == torch.float8_e4m3fn and w.shape == sd[n].shape
        assert s.dtype == torch.float32 and tuple(s.shape) == g.scale_shape(tuple(sd[n].shape))
        ref = quantize(sd[n], g, "reference")
        assert torch.equal(w.view(torch.uint8), ref.codes) and torch.equal(s, ref.scale)
    for n, t in sd.items():
        if n not in ws.quantized_names(sd):
            assert out[n] is t
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 3)


def test_scale_is_the_dequant_multiplier_within_the_roundtrip_bound(dense, dense_synced):
    deq = ws.dequantize_state_dict(dense_synced, dtype=torch.float64)
    assert set(deq) == set(dense.state_dict)
    for n in ws.quantized_names(dense.state_dict):
        x = dense.state_dict[n].double()
        qt = ws.synced_tensors(dense_synced)[n]
        bound = tolerances.quant_roundtrip_bound(x.abs(), qt.expanded_scale(), "e4m3fn")
        assert bool(((deq[n] - x).abs() <= bound).all()), n


def test_recipe_overrides_and_verl_policies(moe):
    out = ws.quantize_state_dict(moe.state_dict, exclude=(), include=(r"(^|\.)mlp\.gate\.weight$",))
    assert set(ws.synced_tensors(out)) == {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"}
    w = moe.state_dict["model.layers.0.self_attn.o_proj.weight"]
    for preset in ("verl_triton", "verl_torch", "deepgemm_block"):
        out = ws.quantize_state_dict({"x.o_proj.weight": w}, policy=preset)
        ref = quantize(w, Granularity.block(128), preset)
        assert torch.equal(out["x.o_proj.weight"].view(torch.uint8), ref.codes)
        assert torch.equal(out["x.o_proj.weight_scale_inv"], ref.scale)
    with pytest.raises(ValueError, match="invalid regex"):
        ws.WeightSyncRecipe(exclude=("(",))


def test_fp32_master_weights_are_cast_to_bf16_first():
    torch.manual_seed(0)
    w32 = torch.randn(130, 200)
    out = ws.quantize_state_dict({"a.q_proj.weight": w32})
    ref = quantize(w32.to(torch.bfloat16), Granularity.block(128), "reference")
    assert torch.equal(out["a.q_proj.weight"].view(torch.uint8), ref.codes)


def test_fp32_master_state_dict_syncs_like_its_bf16_cast_exact():
    """Every tensor, quantized or kept, of an fp32 master state dict syncs bit for bit like its BF16 cast; the kept
    ones are shipped in BF16."""
    for name in F.SYNC_MODELS:
        master = F.master_state_dict(name)
        a = ws.quantize_state_dict(master)
        b = ws.quantize_state_dict({k: v.to(torch.bfloat16) for k, v in master.items()})
        assert list(a) == list(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
        assert {t.dtype for k, t in a.items() if k not in ws.quantized_names(master) and
                not k.endswith(ws.SCALE_SUFFIX)} == {torch.bfloat16}


def test_shared_expert_projections_are_quantized_and_its_gate_and_biases_kept():
    m = F.tiny_model("tiny-qwen2-moe")
    names = set(ws.quantized_names(m.state_dict))
    p = "model.layers.0.mlp."
    assert {p + f"shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")} <= names
    assert p + "shared_expert_gate.weight" not in names and p + "gate.weight" not in names
    assert not any(n.endswith(".bias") for n in names)
    assert len(names) == 2 * (4 + 8 * 3 + 3)
    assert ws.ignored_layers(m.state_dict) == [f"model.layers.{i}.mlp.{g}" for i in (0, 1)
                                               for g in ("gate", "shared_expert_gate")]
    synced = ws.quantize_state_dict(m.state_dict)
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert synced[bias] is m.state_dict[bias] and ws.scale_name(bias) not in synced


def test_quantize_fn_hook_receives_every_weight(dense):
    seen = []

    def qfn(x, g):
        seen.append(tuple(x.shape))
        return quantize(x, g, get_policy("reference"))

    ws.quantize_state_dict(dense.state_dict, quantize_fn=qfn)
    assert len(seen) == len(ws.quantized_names(dense.state_dict))


def test_writer_produces_a_block_fp8_checkpoint_and_the_loader_dequantizes_it(tmp_path, moe):
    from safetensors import safe_open

    d = ws.write_hf_checkpoint(tmp_path / "ckpt", moe.config, moe.state_dict, tokenizer_dir=F.tokenizer_dir())
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert qc["ignored_layers"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert cfg["torch_dtype"] == "bfloat16" and (d / "tokenizer.json").exists()
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.3.up_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.0.mlp.experts.3.up_proj.weight_scale_inv").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.mlp.gate.weight").get_dtype() == "BF16"
    config, sd = ws.load_hf_checkpoint(d)
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert set(sd) == set(moe.state_dict) and all(t.dtype == torch.bfloat16 for t in sd.values())
    want = ws.dequantize_state_dict(ws.quantize_state_dict(moe.state_dict))
    assert all(torch.equal(sd[k], want[k]) for k in sd)
    _, raw = ws.load_hf_checkpoint(d, dequantize=False)
    assert raw["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_loader_accepts_the_weight_scale_name(tmp_path, dense):
    from safetensors.torch import save_file

    synced = ws.quantize_state_dict(dense.state_dict)
    renamed = {(k[: -len("_inv")] if k.endswith("_scale_inv") else k): v for k, v in synced.items()}
    d = tmp_path / "c"
    d.mkdir()
    save_file(renamed, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({**dense.config, "quantization_config": ws.quantization_config()}))
    _, sd = ws.load_hf_checkpoint(d)
    assert set(sd) == set(dense.state_dict)


def test_bf16_checkpoint_round_trips(tmp_path, dense):
    d = ws.write_hf_checkpoint(tmp_path / "b", dense.config, dense.state_dict, fp8=False)
    cfg, sd = ws.load_hf_checkpoint(d)
    assert "quantization_config" not in cfg
    assert all(torch.equal(sd[k], dense.state_dict[k]) for k in sd)


def test_synced_tensors_rejects_malformed_pairs():
    bad = {"a.weight": torch.zeros(4, 4, dtype=torch.bfloat16), "a.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        ws.synced_tensors(bad)
    bad = {"a.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(2, 1)}
    with pytest.raises(ValueError, match="scale"):
        ws.synced_tensors(bad)


def test_packed_experts_sync_like_their_unfused_experts_exact():
    """Packed (E, N, K) experts are quantized expert by expert: tiny-qwen3-moe-fused's codes and (E, ceil(N/128),
    ceil(K/128)) scales are tiny-qwen3-moe's per-expert tensors stacked (gate and up are 128 rows each, so the fused
    gate_up blocks are exactly the gate and up blocks), and every other tensor syncs identically."""
    hub = ws.quantize_state_dict(F.tiny_model("tiny-qwen3-moe").state_dict)
    fused = ws.quantize_state_dict(F.tiny_model("tiny-qwen3-moe-fused").state_dict)
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        for what, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            codes, scales = fused[p + what], fused[ws.scale_name(p + what)]
            assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
            want_c = torch.stack([torch.cat([hub[f"{p}{e}.{q}.weight"] for q in parts]) for e in range(8)])
            want_s = torch.stack([torch.cat([hub[ws.scale_name(f"{p}{e}.{q}.weight")] for q in parts]) for e in range(8)])
            assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8))
            assert torch.equal(scales, want_s) and scales.shape == (8, 2, 2 if what == "gate_up_proj" else 1)
    rest = [k for k in fused if ".experts." not in k]
    assert all(torch.equal(fused[k].view(torch.uint8), hub[k].view(torch.uint8)) for k in rest)


def test_family_fixtures_quantize_the_language_model_projections_only():
    """Hand-listed: MLA's five projections per layer, the dense layer's MLP, the packed experts and the shared experts
    of tiny-deepseek-v3 (router, its bias and both MLA norms kept); every projection of Qwen2.5-VL's language model
    and nothing of its vision tower; Llama's seven projections per layer."""
    ds = set(ws.quantized_names(F.tiny_model("tiny-deepseek-v3").state_dict))
    want = {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2)
            for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
    want |= {f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    want |= {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    want |= {f"model.layers.1.mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert ds == want
    vl_sd = F.tiny_model("tiny-qwen2.5-vl").state_dict
    vl = set(ws.quantized_names(vl_sd))
    assert vl == {f"model.language_model.layers.{i}.{p}.weight" for i in range(2)
                  for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert len(ws.quantized_names(F.tiny_model("tiny-llama").state_dict)) == 14


def test_packed_experts_dequantize_back_within_the_roundtrip_bound():
    sd = F.tiny_model("tiny-deepseek-v3").state_dict
    synced = ws.quantize_state_dict(sd)
    qts = ws.synced_tensors(synced)
    name = "model.layers.1.mlp.experts.down_proj"
    assert {ws.expert_key(name, e) for e in range(4)} <= set(qts) and name not in qts
    assert torch.equal(ws.source_tensor(sd, ws.expert_key(name, 2)), sd[name][2])
    back = ws.dequantize_state_dict(synced)
    assert back[name].shape == sd[name].shape and ws.scale_name(name) not in back
    for e in range(4):
        qt = qts[ws.expert_key(name, e)]
        bound = tolerances.quant_roundtrip_bound(sd[name][e].float().abs(), qt.expanded_scale(), qt.fmt)
        assert ((back[name][e].double() - sd[name][e].double()).abs() <= bound.double() + 2.0 ** -8 * back[name][e].double().abs()).all()
    with pytest.raises(ValueError, match="packed"):
        bad = dict(synced)
        bad[ws.scale_name(name)] = synced[ws.scale_name(name)][0]
        ws.synced_tensors(bad)


def test_kv_cache_scales_sync_in_fp32_as_given_exact():
    """A per-layer FP8 KV-cache scale in the stream (``<layer>.self_attn.k_scale``/``v_scale``, 0-d) ships in fp32
    bit for bit: cast to BF16 it would move by up to 2^-9 and every K/V code with it. A 2-D tensor of that name, or
    a BF16 scalar of another name, is not a KV-cache scale."""
    s = torch.tensor(0.0107299, dtype=torch.float32)
    sd = {"model.layers.0.self_attn.k_scale": s, "model.layers.0.self_attn.v_scale": s.double(),
          "model.layers.0.self_attn.attn.q_scale": s}
    out = ws.quantize_state_dict(sd)
    for name in ("model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"):
        assert out[name].dtype == torch.float32 and out[name].shape == () and torch.equal(out[name], s), name
    assert out["model.layers.0.self_attn.attn.q_scale"].dtype == torch.bfloat16  # not a name the oracle ships fp32
    assert not ws.is_kv_cache_scale("model.layers.0.self_attn.k_scale", (1, 1))
    assert ws.is_kv_cache_scale("model.language_model.layers.3.self_attn.v_scale", ())
