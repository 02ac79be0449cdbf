"""The shipped fixtures: manifest, tokenizer, prompts, tiny-model configs and weights, published configs, cache."""

from __future__ import annotations

import json

import pytest
import torch
from fp8rl import fixtures as F
from fp8rl.reference.quant import Granularity


def test_manifest_lists_every_shipped_file_with_its_sha256():
    assert F.verify_manifest() == []
    files = F.load_manifest()["files"]
    for must in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "tokenizer/corpus.txt",
                 "prompts.json", "tiny_models.json", "models/tiny-qwen3/config.json",
                 "models/tiny-qwen3-moe/config.json", "models/tiny-qwen2-moe/config.json",
                 "models/tiny-qwen3-tied-odd/config.json", "published/Qwen3-8B/config.json",
                 "published/Qwen3-30B-A3B/config.json"):
        assert must in files, must


def test_manifest_detects_a_changed_file(tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "fixtures"
    shutil.copytree(F.FIXTURE_DIR, root, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    monkeypatch.setattr(F, "FIXTURE_DIR", root)
    assert F.verify_manifest() == []
    (root / "prompts.json").write_text((root / "prompts.json").read_text() + " ")
    (root / "extra.json").write_text("{}")
    problems = F.verify_manifest()
    assert any(p.startswith("prompts.json: sha256") for p in problems), problems
    assert any(p.startswith("extra.json: not in the manifest") for p in problems), problems


def test_generated_weights_match_the_recorded_digests():
    """numpy's PCG64 streams (and the init recipe) fix the weights every mismatch budget was measured on."""
    want = F.load_manifest()["generated"]
    assert set(want) == {f"{n}/{v}" for n in F.SYNC_MODELS for v in ("base", "update")}
    for key, digest in want.items():
        name, variant = key.split("/")
        spec = F.tiny_model_spec(name)
        sd = F.generate_state_dict(F.model_config(name), int(spec["seed"]), spec["init"],
                                   spec["update"] if variant == "update" else None, layout=spec.get("layout", "hub"))
        assert F.digest_state_dict(sd) == digest, f"{key}: generated weights changed (bump GENERATOR_VERSION, " \
            "re-measure the e2e budgets, rewrite the manifest)"


def test_tokenizer_is_rebuilt_byte_for_byte_from_the_corpus():
    built = F.build_tokenizer()
    shipped = F.fixture_path("tokenizer", "tokenizer.json").read_text()
    assert json.loads(built.to_str()) == json.loads(shipped)
    assert built.get_vocab_size() == F.TOKENIZER_VOCAB == 512


def test_tokenizer_loads_offline_and_prompts_are_its_token_ids():
    tok = F.load_tokenizer()
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0 and len(tok) == 512
    doc = F.prompts()
    p = doc["prompt_len"]
    for row in doc["prompts"]:
        assert tok(row["text"]).input_ids[:p] == row["ids"]
    ids = F.prompt_ids()
    assert ids.dtype == torch.int64 and ids.shape == (len(doc["prompts"]), p)
    assert tok.decode(ids[0]).startswith("The rollout engine")


def test_tokenizer_dir_loads_with_autotokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(F.tokenizer_dir()), local_files_only=True)
    assert tok("The policy").input_ids == F.load_tokenizer()("The policy").input_ids


@pytest.mark.parametrize("name", F.TINY_MODELS)
def test_tiny_configs_build_the_transformers_model_with_the_checkpoint_names(name):
    from fp8rl.reference.rollout_hf import build_hf_model, to_model_state_dict

    m = F.tiny_model(name)
    model = build_hf_model(m.config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in to_model_state_dict(m.state_dict).items()}
    if m.config.get("tie_word_embeddings"):  # the checkpoint holds the tied lm_head once, as embed_tokens
        assert model.lm_head.weight is model.model.embed_tokens.weight
        want.pop("lm_head.weight")
    assert got == want
    assert all(t.dtype == torch.bfloat16 for t in m.state_dict.values())
    assert type(model).__name__ == m.config["architectures"][0]


def test_tiny_dims_exercise_edge_blocks_groups_and_non_square_grids():
    dense = F.tiny_model("tiny-qwen3").state_dict
    g = Granularity.block(128)
    shapes = {n.split(".", 3)[-1]: tuple(t.shape) for n, t in dense.items() if n.startswith("model.layers.0.")}
    assert shapes["self_attn.q_proj.weight"] == (256, 320) and g.scale_shape((256, 320)) == (2, 3)
    assert shapes["self_attn.o_proj.weight"] == (320, 256) and g.scale_shape((320, 256)) == (3, 2)
    assert shapes["mlp.down_proj.weight"] == (320, 384)
    assert any(d % 128 for s in shapes.values() if len(s) == 2 for d in s)  # partial edge blocks / 1x128 groups
    moe = F.tiny_model("tiny-qwen3-moe")
    assert moe.is_moe and "model.layers.0.mlp.gate.weight" in moe.state_dict
    experts = [n for n in moe.state_dict if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3
    from fp8rl.reference.weight_sync import quantized_names

    aligned = [moe.state_dict[n].shape for n in quantized_names(moe.state_dict)]
    assert all(d % 128 == 0 for s in aligned for d in s)  # the aligned case


def test_architecture_variant_fixtures():
    """Shared expert + gate, q/k/v biases, no QK-norm (tiny-qwen2-moe); tied embeddings and no projection dimension
    a multiple of 128, merged q/k/v and gate/up included (tiny-qwen3-tied-odd)."""
    q2 = F.tiny_model("tiny-qwen2-moe").state_dict
    p = "model.layers.0."
    assert q2[p + "mlp.shared_expert_gate.weight"].shape == (1, 256)
    assert q2[p + "mlp.shared_expert.down_proj.weight"].shape == (256, 256)
    assert q2[p + "self_attn.q_proj.bias"].shape == (256,) and q2[p + "self_attn.k_proj.bias"].shape == (128,)
    assert not any("q_norm" in n or "k_norm" in n for n in q2)
    odd = F.tiny_model("tiny-qwen3-tied-odd")
    assert odd.config["tie_word_embeddings"] and "lm_head.weight" not in odd.state_dict
    shapes = [tuple(t.shape) for n, t in odd.state_dict.items() if n.startswith(p) and t.dim() == 2]
    assert len(shapes) == 7 and all(d % 128 for s in shapes for d in s)
    qkv = sum(odd.state_dict[p + f"self_attn.{w}_proj.weight"].shape[0] for w in "qkv")
    gate_up = 2 * odd.state_dict[p + "mlp.gate_proj.weight"].shape[0]
    assert qkv % 128 and gate_up % 128 and "model.layers.0.self_attn.q_norm.weight" in odd.state_dict


@pytest.mark.parametrize("name", F.SYNC_MODELS)
def test_fixture_names_and_shapes_are_transformers_own_exact(name):
    """Every fixture (the family ones included) has the parameter names and shapes transformers' own model class
    builds from its config (on the meta device: nothing allocated). transformers 5 holds MoE experts packed, so a
    hub-layout fixture is compared after fp8rl.fixtures.fuse_experts; the fused fixtures are compared as they are."""
    import transformers

    m = F.tiny_model(name)
    config = transformers.AutoConfig.for_model(**m.config)
    auto = transformers.AutoModelForImageTextToText if "vision_config" in m.config else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    assert type(model).__name__ == m.config["architectures"][0]
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if m.config.get("tie_word_embeddings"):
        want.pop("lm_head.weight")
    sd = m.state_dict if F.tiny_model_spec(name).get("layout") == "fused-experts" else F.fuse_experts(m.state_dict)
    assert {k: tuple(v.shape) for k, v in sd.items()} == want


def test_family_fixtures_exercise_their_family():
    """Each family fixture holds what its family adds (and the capability table has a key per family)."""
    from fp8rl import capabilities

    assert set(F.SYNC_MODELS) == set(F.TINY_MODELS) | set(F.FAMILY_MODELS)
    assert {f for n in F.FAMILY_MODELS for f in F.model_families(n)} == set(F.WSYNC_FAMILIES)
    assert all(f"weight_sync.{f}" in capabilities.CAPABILITIES for f in F.WSYNC_FAMILIES)
    assert all(F.model_families(n) == () for n in F.TINY_MODELS)
    ds = F.tiny_model("tiny-deepseek-v3").state_dict
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        assert f"model.layers.0.self_attn.{proj}.weight" in ds
    assert ds["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 256, 320)
    assert "model.layers.0.mlp.gate_proj.weight" in ds  # first_k_dense_replace = 1: layer 0 is dense
    vl = F.tiny_model("tiny-qwen2.5-vl").state_dict
    assert "model.visual.blocks.0.mlp.gate_proj.weight" in vl and "model.language_model.layers.1.self_attn.q_proj.bias" in vl
    assert not any(k.startswith("model.layers.") for k in vl)
    assert "model.layers.0.self_attn.q_norm.weight" not in F.tiny_model("tiny-llama").state_dict


@pytest.mark.parametrize("variant", ["base", "update"])
def test_fused_fixture_is_the_per_expert_fixture_packed_exact(variant):
    """tiny-qwen3-moe-fused holds tiny-qwen3-moe's weights: gate_up_proj[e] = [gate_e; up_e], down_proj[e] = down_e."""
    hub, fused = F.tiny_model("tiny-qwen3-moe", variant).state_dict, F.tiny_model("tiny-qwen3-moe-fused", variant).state_dict
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        for e in range(8):
            gu, down = fused[p + "gate_up_proj"][e], fused[p + "down_proj"][e]
            assert torch.equal(gu[:128], hub[f"{p}{e}.gate_proj.weight"]) and torch.equal(gu[128:], hub[f"{p}{e}.up_proj.weight"])
            assert torch.equal(down, hub[f"{p}{e}.down_proj.weight"])
    assert {k: v for k, v in fused.items() if ".experts." not in k}.keys() == \
        {k for k in hub if ".experts." not in k}


def test_master_weights_are_fp32_and_the_fixture_is_their_bf16_cast_exact():
    for name in F.SYNC_MODELS:
        for variant in ("base", "update"):
            master, sd = F.master_state_dict(name, variant), F.tiny_model(name, variant).state_dict
            assert set(master) == set(sd) and all(t.dtype == torch.float32 for t in master.values())
            assert all(torch.equal(master[k].to(torch.bfloat16).view(torch.int16), sd[k].view(torch.int16))
                       for k in sd), (name, variant)
            assert any(not torch.equal(master[k], sd[k].float()) for k in sd)  # fp32 carries more bits


def test_update_without_qk_norm_grows_k_and_v_through_the_projections():
    base, upd = F.tiny_model("tiny-qwen2-moe").state_dict, F.tiny_model("tiny-qwen2-moe", "update").state_dict
    k = "model.layers.0.self_attn."
    for b in ("k_proj.bias", "v_proj.bias"):
        torch.testing.assert_close(upd[k + b].float(), base[k + b].float() * 8, rtol=1e-2, atol=0)
    torch.testing.assert_close(upd[k + "q_proj.bias"].float(), base[k + "q_proj.bias"].float() / 8, rtol=1e-2,
                               atol=0)


def test_update_variant_grows_k_and_v_and_changes_every_projection():
    base, upd = F.tiny_model("tiny-qwen3"), F.tiny_model("tiny-qwen3", "update")
    b, u = base.state_dict, upd.state_dict
    k = "model.layers.0.self_attn."
    torch.testing.assert_close(u[k + "k_norm.weight"].float(), b[k + "k_norm.weight"].float() * 8, rtol=1e-2, atol=0)
    torch.testing.assert_close(u[k + "q_norm.weight"].float(), b[k + "q_norm.weight"].float() / 8, rtol=1e-2, atol=0)
    for n, t in b.items():
        if t.dim() == 2:
            assert not torch.equal(t, u[n]), n


def test_weights_are_cached_under_fp8rl_cache_and_regenerated_when_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8RL_CACHE", str(tmp_path / "c"))
    assert F.cache_dir() == tmp_path / "c"
    F._tiny_model_cached.cache_clear()
    try:
        m = F.tiny_model("tiny-qwen3")
        assert m.path.parent == tmp_path / "c" / "fixtures"
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
            {p.name for p in m.path.iterdir()}
        assert json.loads((m.path / "config.json").read_text()) == F.model_config("tiny-qwen3")
        F._tiny_model_cached.cache_clear()
        assert F.tiny_model("tiny-qwen3").digest == m.digest  # served from disk
        f = m.path / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))
        F._tiny_model_cached.cache_clear()
        assert F.tiny_model("tiny-qwen3").digest == m.digest  # corrupt file detected and regenerated
    finally:
        F._tiny_model_cached.cache_clear()


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FP8RL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert F.cache_dir() == tmp_path / "fp8rl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert F.cache_dir().parts[-2:] == (".cache", "fp8rl")


def test_published_configs():
    q8 = F.published_config("Qwen3-8B")
    assert (q8["hidden_size"], q8["intermediate_size"], q8["num_hidden_layers"], q8["num_attention_heads"],
            q8["num_key_value_heads"], q8["head_dim"], q8["vocab_size"]) == (4096, 12288, 36, 32, 8, 128, 151936)
    q30 = F.published_config("Qwen3-30B-A3B")
    assert (q30["hidden_size"], q30["moe_intermediate_size"], q30["num_experts"], q30["num_experts_per_tok"],
            q30["num_hidden_layers"], q30["num_key_value_heads"], q30["head_dim"]) == (2048, 768, 128, 8, 48, 4, 128)
    assert F.model_config("Qwen3-8B") == q8 and F.published_config_path("Qwen3-8B").name == "config.json"
    with pytest.raises(ValueError, match="unknown"):
        F.model_config("Qwen3-0.6B")
