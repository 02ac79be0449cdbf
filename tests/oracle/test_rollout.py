"""The rollout oracle: exact fake quantization, FP8 modules, KV calibration and mismatch metrics
(fp8rl.reference.rollout, ``R``); HF model building, scoring and generation (fp8rl.reference.rollout_hf, ``H``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fp8rl import fixtures as F
from fp8rl.reference import rollout as R
from fp8rl.reference import rollout_hf as H
from fp8rl.reference import weight_sync as ws
from fp8rl.reference.gemm import block_gemm_exact
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, quantize, quantize_with_scale
from hypothesis import given, settings
from hypothesis import strategies as st


def test_torch_cast_canary_passes_on_this_torch():
    assert R._torch_cast_is_oracle("e4m3fn")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.sampled_from([1e-30, 1e-3, 1.0, 300.0, 1e8]),
       st.sampled_from(["reference", "verl_triton", "verl_torch", "sglang_group", "vllm_ue8m0_group",
                        "deepgemm_block", "te_blockwise_pow2"]),
       st.integers(0, 2**31 - 1))
def test_fake_quant_equals_the_oracle_bit_for_bit(rows, cols, mag, preset, seed):
    r = np.random.default_rng(seed)
    x = torch.from_numpy((r.standard_normal((rows, cols)) * mag).astype(np.float32))
    x[torch.from_numpy(r.random((rows, cols)) < 0.1)] = 0.0
    g = Granularity.group(128)
    want = quantize(x, g, preset).dequantize(torch.float64)
    got = R.fake_quant(x, g, preset)
    assert got.dtype == torch.float64
    assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(st.floats(1e-6, 1e3), st.sampled_from(["div", "mul_recip"]), st.integers(0, 2**31 - 1))
def test_fake_quant_with_scale_equals_the_oracle(scale, op, seed):
    from dataclasses import replace

    r = np.random.default_rng(seed)
    x = torch.from_numpy((r.standard_normal((3, 4, 64)) * scale * 300).astype(np.float32))
    pol = replace(get_policy("reference"), quant_op=op)
    s = torch.tensor([scale], dtype=torch.float32)
    codes = quantize_with_scale(x, s, Granularity.tensor(), pol)
    from fp8rl.reference.formats import decode

    want = decode(codes, "e4m3fn").reshape(x.shape).double() * s.double()
    assert torch.equal(R.fake_quant_with_scale(x, float(s), pol), want)


def test_kv_path_agrees_with_the_kv_oracle():
    from fp8rl.reference import kv

    st_ = R._KVState(R.get_recipe("fp8-all"))
    torch.manual_seed(0)
    k = torch.randn(2, 2, 7, 64).to(torch.bfloat16)
    got = st_.quant(0, "k", k)
    s = st_.scales[0]["k"]
    assert s == float((k.float().abs().amax().double() / 200.0).float())
    want = kv.quantize_kv(k, torch.tensor(s), kv.default_policy("e4m3fn", "tensor")).dequantize(torch.float32)
    assert torch.equal(got, want)
    local = R.fake_quant_with_scale(k, s, st_.policy).float()
    assert torch.equal(local, want)  # the fallback path computes the same values


def test_fp8_linear_matches_the_exact_block_gemm():
    torch.manual_seed(1)
    w = (torch.randn(256, 320) * 0.05).to(torch.bfloat16)
    x = torch.randn(9, 320).to(torch.bfloat16)
    wq = quantize(w, Granularity.block(128), "reference")
    lin = R.FP8Linear(wq.dequantize(torch.float64), R._ActQuant(get_policy("reference"), 128))
    got = lin(x)
    exact = block_gemm_exact(quantize(x, Granularity.group(128), "reference"), wq)
    want = exact.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # fp64 matmul vs exact sums: identical after rounding to bf16 except at (measure-zero) double-rounding ties
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs() * 2.0**-7
    assert bool((diff <= ulp).all()) and float((got != want).float().mean()) < 1e-3


@pytest.fixture(scope="module")
def dense():
    return F.tiny_model("tiny-qwen3")


@pytest.fixture(scope="module")
def moe():
    return F.tiny_model("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def trainer(dense):
    return H.RolloutPolicy(dense.config, dense.state_dict, "bf16")


def test_bf16_score_is_the_plain_transformers_forward(dense, trainer):
    tokens = torch.cat([F.prompt_ids(4), torch.randint(0, 512, (4, 6), generator=torch.Generator().manual_seed(0))], 1)
    model = H.build_hf_model(dense.config)
    model.load_state_dict(H.to_model_state_dict(dense.state_dict))
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits.float()
    want = torch.log_softmax(logits[:, 11:-1], -1).gather(-1, tokens[:, 12:, None]).squeeze(-1)
    assert torch.equal(trainer.score(tokens, 12), want)


def test_generate_shapes_determinism_and_consistency(trainer):
    p = F.prompt_ids(4)
    g1 = trainer.generate(p, 6, greedy=False, seed=7)
    g2 = trainer.generate(p, 6, greedy=False, seed=7)
    assert g1.tokens.shape == (4, 18) and g1.logprobs.shape == (4, 6) and g1.logprobs.dtype == torch.float32
    assert torch.equal(g1.tokens, g2.tokens) and torch.equal(g1.logprobs, g2.logprobs)
    assert torch.equal(g1.tokens[:, :12], p)
    # incremental BF16 decoding vs a full teacher-forced forward: close, not necessarily identical
    assert (g1.logprobs - trainer.score(g1.tokens, 12)).abs().max() < 0.2
    greedy = trainer.generate(p, 6)
    assert torch.equal(greedy.tokens, trainer.greedy_full(p, 6)) or \
        R.first_divergence(greedy.tokens, trainer.greedy_full(p, 6), 12).float().mean() > 3


def test_fp8_linear_recipe_runs_on_the_synced_checkpoint(dense):
    synced = ws.quantize_state_dict(dense.state_dict)
    a = H.RolloutPolicy(dense.config, dense.state_dict, "fp8-linear")
    b = H.RolloutPolicy(dense.config, dense.state_dict, "fp8-linear", synced=synced)
    p = F.prompt_ids(2)
    assert torch.equal(a.generate(p, 4).logprobs, b.generate(p, 4).logprobs)
    n_fp8 = sum(isinstance(m, R.FP8Linear) for m in a.model.modules())
    assert n_fp8 == 2 * 7  # q/k/v/o + gate/up/down per layer; lm_head stays BF16
    # a quantized lm_head (weight sync bug) is emulated as an FP8 linear too
    rec = ws.WeightSyncRecipe(include=ws.DEFAULT_INCLUDE + (r"lm_head\.weight$",), exclude=())
    c = H.RolloutPolicy(dense.config, dense.state_dict, "fp8-linear",
                        synced=ws.quantize_state_dict(dense.state_dict, rec))
    assert isinstance(c.model.lm_head, R.FP8Linear)


def test_moe_fp8_experts_and_quantized_router(moe):
    pol = H.RolloutPolicy(moe.config, moe.state_dict, "fp8-linear")
    assert isinstance(pol.model.model.layers[0].mlp.experts, R.FP8Experts)
    assert not isinstance(pol.model.model.layers[0].mlp.gate, R.FP8Router)
    rec = ws.WeightSyncRecipe(include=ws.DEFAULT_INCLUDE + (r"mlp\.gate\.weight$",), exclude=())
    q = H.RolloutPolicy(moe.config, moe.state_dict, "fp8-linear", synced=ws.quantize_state_dict(moe.state_dict, rec))
    assert isinstance(q.model.model.layers[1].mlp.gate, R.FP8Router)
    p = F.prompt_ids(2)
    a, b = pol.generate(p, 5), q.generate(p, 5)
    assert torch.isfinite(a.logprobs).all() and torch.isfinite(b.logprobs).all()


def test_fp8_experts_equal_the_transformers_loop_on_exact_weights(moe):
    """With FP8-representable weights and activations quantization disabled (identity), FP8Experts reproduces the
    transformers eager expert loop."""
    model = H.build_hf_model(moe.config)
    model.load_state_dict(H.to_model_state_dict(moe.state_dict))
    old = model.model.layers[0].mlp.experts

    class Identity:
        def __call__(self, x2d):
            return x2d.double()

    new = R.FP8Experts(old.gate_up_proj[:, :128].double(), old.gate_up_proj[:, 128:].double(),
                       old.down_proj.double(), old.act_fn, Identity())
    torch.manual_seed(0)
    h = torch.randn(10, 256).to(torch.bfloat16)
    idx = torch.randint(0, 8, (10, 2))
    wts = torch.rand(10, 2).to(torch.bfloat16)
    torch.testing.assert_close(new(h, idx, wts).float(), old(h, idx, wts).float(), rtol=0.02, atol=0.02)


def test_kv_scales_calibrate_once_reset_on_update_and_can_be_pushed(dense):
    upd = F.tiny_model("tiny-qwen3", "update")
    pol = H.RolloutPolicy(dense.config, dense.state_dict, "fp8-all")
    assert pol.kv_scales == {}
    p = F.prompt_ids(4)
    pol.generate(p, 3)
    s0 = pol.kv_scales
    assert set(s0) == {0, 1} and set(s0[0]) == {"q", "k", "v"}
    pol.generate(F.prompt_ids(8), 3)
    assert pol.kv_scales == s0  # frozen after the first batch
    pol.update_weights(upd.state_dict)
    assert pol.kv_scales == {}
    pol.generate(p, 3)
    s1 = pol.kv_scales
    assert s1[0]["k"] > 5 * s0[0]["k"] and s1[0]["v"] > 5 * s0[0]["v"]  # the update grew K and V 8x
    stale = H.RolloutPolicy(dense.config, dense.state_dict, "fp8-kv")
    stale.generate(p, 2)
    before = stale.kv_scales
    assert set(before[0]) == {"k", "v"}  # KV storage only: the query stays BF16
    stale.update_weights(upd.state_dict, recalibrate_kv=False)
    stale.generate(p, 2)
    assert stale.kv_scales == before
    stale.set_kv_scales(s1)
    assert stale.kv_scales == s1
    with pytest.raises(ValueError, match="no FP8 KV"):
        H.RolloutPolicy(dense.config, dense.state_dict, "bf16").set_kv_scales(s1)


def test_amax_calibration_variant(dense):
    rec = R.recipe_with("fp8-kv", kv_calibration="amax")
    pol = H.RolloutPolicy(dense.config, dense.state_dict, rec)
    a = H.RolloutPolicy(dense.config, dense.state_dict, "fp8-kv")
    p = F.prompt_ids(2)
    pol.generate(p, 2)
    a.generate(p, 2)
    assert abs(pol.kv_scales[0]["k"] * 448 / 200 - a.kv_scales[0]["k"]) < 1e-6 * a.kv_scales[0]["k"]
    with pytest.raises(ValueError, match="kv_calibration"):
        R.recipe_with("fp8-kv", kv_calibration="nope")


def test_mismatch_metrics_formulas():
    lp_r = torch.tensor([[-1.0, -2.0]])
    lp_t = torch.tensor([[-1.5, -2.0]])
    m = R.mismatch_metrics(lp_r, lp_t)
    rho = math.exp(-0.5)
    assert m["k3_kl"] == pytest.approx((rho - math.log(rho) - 1) / 2)
    assert m["k1_kl"] == pytest.approx(0.25)
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.5) + 1) / 2)
    assert m["max_abs_dlogp"] == 0.5 and m["mean_abs_dlogp"] == 0.25
    assert R.mismatch_metrics(lp_t, lp_t)["k3_kl"] == 0.0
    with pytest.raises(ValueError):
        R.mismatch_metrics(lp_r, lp_t[:, :1])


def test_first_divergence():
    a = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 9, 9, 9]])
    b = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 0, 5], [1, 2, 3, 4, 5]])
    assert R.first_divergence(a, b, 2).tolist() == [3, 1, 0]


def test_recipes_and_errors(dense):
    assert set(R.RECIPES) == {"bf16", "fp8-linear", "fp8-linear-ptpc", "fp8-kv", "fp8-all", "mxfp8", "nvfp4-experts"}
    with pytest.raises(ValueError, match="linear"):
        R.RolloutRecipe("x", fp8_linear=True, linear="row")
    with pytest.raises(ValueError, match="per channel"):
        H.RolloutPolicy(dense.config, dense.state_dict, "fp8-linear-ptpc", synced={})
    with pytest.raises(ValueError, match="recipe"):
        R.get_recipe("fp4")
    with pytest.raises(ValueError, match="fp8_q"):
        R.RolloutRecipe("x", fp8_q=True)
    pol = H.RolloutPolicy(dense.config, dense.state_dict, "bf16")
    with pytest.raises(ValueError, match="prompt_len"):
        pol.score(F.prompt_ids(1), 12)
    with pytest.raises(ValueError, match="integer"):
        pol.generate(F.prompt_ids(1).float(), 2)
    with pytest.raises(ValueError, match="missing"):
        H.RolloutPolicy(dense.config, {k: v for k, v in dense.state_dict.items() if "lm_head" not in k})


def test_single_thread_restores_the_thread_count():
    n = torch.get_num_threads()
    with R.single_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


def test_ptpc_recipe_quantizes_weights_per_channel_and_activations_per_token(dense):
    pol = H.RolloutPolicy(dense.config, dense.state_dict, "fp8-linear-ptpc")
    names = [n for n in dense.state_dict if n.endswith(("q_proj.weight", "down_proj.weight"))]
    assert names
    for name in names:
        mod = H._get_module(pol.model, name[: -len(".weight")])
        assert isinstance(mod, R.FP8Linear) and mod.act.g == Granularity.token()
        wq = quantize(dense.state_dict[name].to(torch.bfloat16), Granularity.channel(), "reference")
        assert torch.equal(mod.w64, wq.dequantize(torch.float64))
    assert not isinstance(pol.model.lm_head, R.FP8Linear)  # lm_head and embeddings stay BF16
    torch.manual_seed(3)
    w = (torch.randn(96, 160) * 0.05).to(torch.bfloat16)
    x = torch.randn(7, 160).to(torch.bfloat16)
    wq = quantize(w, Granularity.channel(), "reference")
    lin = R.FP8Linear(wq.dequantize(torch.float64), R._ActQuant(get_policy("reference"), Granularity.token()))
    exact = block_gemm_exact(quantize(x, Granularity.token(), "reference"), wq).to(torch.bfloat16)
    assert (lin(x).float() - exact.float()).abs().max() <= exact.float().abs().max() * 2**-8


def test_generate_with_logits_reports_the_rows_it_drew_from(trainer):
    """generate_with_logits: the tokens and log-probs of generate, bit for bit, plus fp32 logits whose log-softmax
    at each token is the reported log-prob and whose argmax is each greedy token."""
    p = F.prompt_ids(3)
    for greedy in (True, False):
        tok, lp, logits = trainer.generate_with_logits(p, 5, greedy=greedy, seed=3)
        out = trainer.generate(p, 5, greedy=greedy, seed=3)
        assert torch.equal(tok, out.tokens) and torch.equal(lp, out.logprobs)
        assert logits.shape == (3, 5, 512) and logits.dtype == torch.float32
        new = tok[:, 12:]
        want = torch.log_softmax(logits.double(), -1).gather(-1, new[..., None]).squeeze(-1)
        assert float((lp.double() - want).abs().max()) < 1e-5
        if greedy:
            assert torch.equal(new, logits.argmax(-1))


def test_decode_step_is_the_policy_hook_and_memo_is_per_class(dense):
    """A subclass's decode_step is what generate runs; memoized results are never shared across policy classes."""

    class Last(H.RolloutPolicy):
        def decode_step(self, logits, greedy, generator):
            nxt, lp, x = super().decode_step(logits, greedy, generator)
            return torch.full_like(nxt, 7), lp, x

    p = F.prompt_ids(2)
    base = H.RolloutPolicy(dense.config, dense.state_dict, "bf16", memo=True)
    other = Last(dense.config, dense.state_dict, "bf16", memo=True)
    assert not bool((base.generate(p, 3).tokens[:, 12:] == 7).all())
    assert bool((other.generate(p, 3).tokens[:, 12:] == 7).all())


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-qwen3-tied-odd"])
def test_architecture_variants_run_every_recipe(name):
    """Shared expert + gate, q/k/v biases and no QK-norm (Qwen2-MoE); tied embeddings and dimensions that are not
    multiples of 128 (tiny-qwen3-tied-odd): the FP8 modules replace exactly the synced projections (the shared
    expert's included, biases kept), the tied lm_head stays the BF16 embedding, and the FP8 recipes move the
    policy while BF16 incremental decoding stays close to the trainer."""
    m = F.tiny_model(name)
    p = F.prompt_ids(2)
    trainer = H.RolloutPolicy(m.config, m.state_dict, "bf16")
    fp8 = H.RolloutPolicy(m.config, m.state_dict, "fp8-all")
    linears = {n for n, mod in fp8.model.named_modules() if isinstance(mod, R.FP8Linear)}
    want = {n[: -len(".weight")] for n in ws.quantized_names(m.state_dict) if ".mlp.experts." not in n}
    assert linears == want
    if name == "tiny-qwen2-moe":
        lin = fp8.model.get_submodule("model.layers.0.self_attn.q_proj")
        assert lin.bias is not None and torch.equal(lin.bias, m.state_dict["model.layers.0.self_attn.q_proj.bias"])
        assert "model.layers.0.mlp.shared_expert.down_proj" in linears
        assert type(fp8.model.get_submodule("model.layers.0.mlp.shared_expert_gate")).__name__ == "Linear"
    else:
        assert fp8.model.lm_head.weight is fp8.model.model.embed_tokens.weight
        assert torch.equal(fp8.model.lm_head.weight, m.state_dict["model.embed_tokens.weight"])
    out = fp8.generate(p, 4, greedy=False, seed=1)
    d8 = (out.logprobs - trainer.score(out.tokens, 12)).abs().mean()
    b = trainer.generate(p, 4, greedy=False, seed=1)
    d16 = (b.logprobs - trainer.score(b.tokens, 12)).abs().mean()
    assert float(d16) < float(d8) and float(d8) > 1e-3


def test_fp8_linear_adds_the_bias_before_the_one_bf16_rounding():
    torch.manual_seed(0)
    w = torch.randn(40, 200).to(torch.bfloat16)
    bias = torch.randn(40).to(torch.bfloat16)
    qt = quantize(w, Granularity.block(128), "reference")
    act = R._ActQuant(get_policy("reference"), 128)
    x = torch.randn(3, 200).to(torch.bfloat16)
    got = R.FP8Linear(qt.dequantize(torch.float64), act, bias)(x)
    want = (act(x) @ qt.dequantize(torch.float64).t() + bias.double()).to(torch.bfloat16)
    assert torch.equal(got, want)


# ---- microscaling recipes (mxfp8, nvfp4-experts) --------------------------------------------------------------------

def test_mx_recipe_errors_name_the_field():
    with pytest.raises(ValueError, match=r"recipe: expected one of \['mxfp8', 'nvfp4-experts'\], got 'fp4'"):
        R.RolloutRecipe("x", fp8_linear=True, mx="fp4")
    with pytest.raises(ValueError, match="mx: the microscaling recipe 'mxfp8' quantizes linear layers"):
        R.RolloutRecipe("x", mx="mxfp8")
    assert not R.RECIPES["mxfp8"].synced_weights and R.RECIPES["mxfp8"].fp8_linear


def test_mxfp8_runs_the_decoded_mx_weights_and_mx_activations_exact(dense):
    from fp8rl.reference import microscaling as mx
    from fp8rl.reference import mx_weight_sync as mxws

    pol = H.RolloutPolicy(dense.config, dense.state_dict, "mxfp8")
    name = "model.layers.0.self_attn.q_proj.weight"
    lin = pol.model.get_submodule(name[: -len(".weight")])
    assert isinstance(lin, R.FP8Linear) and isinstance(lin.act, R.MXActQuant)
    p = mx.get_mx_policy("mxfp8_e4m3")
    want = mx.dequantize_mx(mx.mx_quantize(dense.state_dict[name].float(), p))
    assert torch.equal(lin.w64, want)
    # the weights come from the sync's bytes: a synced dict decodes to the same weights
    synced = mxws.mx_sync_state_dict(dense.state_dict, "mxfp8")
    assert torch.equal(H.RolloutPolicy(dense.config, dense.state_dict, "mxfp8", synced=synced).model
                       .get_submodule(name[: -len(".weight")]).w64, want)
    x = torch.randn(3, want.shape[1])
    assert torch.equal(lin.act(x), mx.dequantize_mx(mx.mx_quantize(x, p)))


def test_nvfp4_experts_quantizes_the_routed_experts_only_exact(moe):
    from fp8rl.reference import mx_weight_sync as mxws

    pol = H.RolloutPolicy(moe.config, moe.state_dict, "nvfp4-experts")
    kinds = {type(m).__name__ for m in pol.model.modules()}
    assert "FP8Experts" in kinds and "FP8Linear" not in kinds and "FP8Router" not in kinds
    synced = mxws.mx_sync_state_dict(moe.state_dict, "nvfp4-experts")
    broken = {k: v for k, v in synced.items() if not k.endswith(".weight_global_scale")}
    with pytest.raises(ValueError, match=r"synced: .*experts\.0\.\w+_proj\.weight is quantized by nvfp4-experts "
                                         r"but \[.*weight_global_scale'\] are missing"):
        H.RolloutPolicy(moe.config, moe.state_dict, "nvfp4-experts", synced=broken)


@pytest.mark.parametrize("recipe", ["bf16", "fp8-all"])
def test_packed_experts_roll_out_like_their_unfused_experts_exact(recipe):
    """tiny-qwen3-moe-fused holds tiny-qwen3-moe's weights with the experts packed (transformers 5's in-memory
    layout): the oracle's rollout of it — the packed FP8 sync split back into each expert's gate/up/down — gives the
    per-expert model's tokens and log-probs bit for bit."""
    from fp8rl import fixtures
    from fp8rl.conformance import _e2e as E
    from fp8rl.engines.reference import ReferenceEngine

    eng = ReferenceEngine()
    got = []
    for model in ("tiny-qwen3-moe", "tiny-qwen3-moe-fused"):
        tm = fixtures.tiny_model(model)
        handle = eng.rollout_init(tm.config, tm.state_dict, recipe)
        got.append(eng.rollout(handle, E.prompts(), 8, greedy=False, seed=11)[:2])
    (t0, lp0), (t1, lp1) = got
    assert torch.equal(t0, t1) and torch.equal(lp0.view(torch.int32), lp1.view(torch.int32))


@pytest.mark.parametrize("recipe", ["bf16", "fp8-all"])
def test_vl_wrapper_rolls_out_like_its_language_model_exact(recipe):
    """tiny-qwen2.5-vl's text-only rollout (transformers' Qwen2_5_VLForConditionalGeneration, built through
    AutoModelForImageTextToText) equals the rollout of its language model alone, the Qwen2ForCausalLM of its
    text_config with the same weights, tokens and log-probs bit for bit: on text, multimodal RoPE gives the three
    position sections the same position, which is 1-D RoPE, and the vision tower is never run."""
    from fp8rl.conformance import _e2e as E

    vl = F.tiny_model("tiny-qwen2.5-vl")
    text_cfg = dict(vl.config["text_config"], model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                    rope_scaling=None)
    text_sd = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
               for k, v in vl.state_dict.items() if not k.startswith("model.visual.")}
    got = []
    for cfg, sd in ((vl.config, vl.state_dict), (text_cfg, text_sd)):
        pol = H.RolloutPolicy(cfg, sd, recipe)
        got.append(pol.generate(E.prompts(), 8, greedy=False, seed=11))
    assert type(H.RolloutPolicy(vl.config, vl.state_dict, "bf16").model).__name__ == \
        "Qwen2_5_VLForConditionalGeneration"
    assert torch.equal(got[0].tokens, got[1].tokens)
    assert torch.equal(got[0].logprobs.view(torch.int32), got[1].logprobs.view(torch.int32))


def test_mla_refuses_the_fp8_kv_recipes_with_the_reason():
    """The FP8 KV emulation caches each head's K/V; an MLA model caches its compressed latent: the oracle refuses
    the KV recipes on it (and runs the others)."""
    mla = F.tiny_model("tiny-deepseek-v3")
    H.RolloutPolicy(mla.config, mla.state_dict, "fp8-linear")
    for recipe in ("fp8-kv", "fp8-all"):
        with pytest.raises(ValueError, match=rf"recipe '{recipe}': .*MLA .*compressed latent"):
            H.RolloutPolicy(mla.config, mla.state_dict, recipe)
