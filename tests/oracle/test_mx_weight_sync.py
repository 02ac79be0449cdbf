"""The microscaling weight-sync oracle (fp8rl.reference.mx_weight_sync): which weights each recipe quantizes, the
compressed-tensors names, dtypes and shapes, hand-decoded values, fp32 masters, bad input."""

from __future__ import annotations

import pytest
import torch
from fp8rl import capabilities, fixtures
from fp8rl.reference import microscaling as mx
from fp8rl.reference import mx_weight_sync as mxws


def _sd() -> dict[str, torch.Tensor]:
    """One MoE layer by hand: attention, a routed expert, a shared expert and its gate, the router, a norm."""
    g = torch.Generator().manual_seed(0)
    t = {
        "model.embed_tokens.weight": (8, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.q_proj.bias": (64,),
        "model.layers.0.mlp.gate.weight": (2, 64),
        "model.layers.0.mlp.experts.0.gate_proj.weight": (32, 64),
        "model.layers.0.mlp.experts.0.down_proj.weight": (64, 48),
        "model.layers.0.mlp.shared_expert.up_proj.weight": (32, 64),
        "model.layers.0.mlp.shared_expert_gate.weight": (1, 64),
        "model.layers.0.input_layernorm.weight": (64,),
        "lm_head.weight": (8, 64),
    }
    return {k: torch.randn(*s, generator=g).to(torch.bfloat16) for k, s in t.items()}


def test_capability_table_sync_recipes_quantize_with_table_recipes_exact():
    """Each ``mx_weight_sync.<recipe>`` key names an oracle sync recipe whose element recipe has its own
    ``mx_quantize.<recipe>`` key: the sync checks judge an engine's codes under its declared mx_policy of it."""
    sync_keys = capabilities.keys(prefix="mx_weight_sync.")
    assert sync_keys
    for key in sync_keys:
        recipe = mxws.get_mx_sync_recipe(key.split(".", 1)[1])
        assert f"mx_quantize.{recipe.mx_recipe}" in capabilities.CAPABILITIES, (key, recipe)
        assert "mx_policy" in capabilities.get(key).ops, key


def test_mxfp8_quantizes_every_projection_and_nvfp4_experts_only_routed_experts_exact():
    sd = _sd()
    assert mxws.mx_quantized_names(sd, "mxfp8") == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.shared_expert.up_proj.weight"]
    assert mxws.mx_quantized_names(sd, "nvfp4-experts") == [
        "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.down_proj.weight"]


def test_mxfp8_sync_layout_and_values_exact():
    sd = _sd()
    out = mxws.mx_sync_state_dict(sd, "mxfp8")
    p = "model.layers.0.mlp.experts.0.down_proj"
    w, s = out[f"{p}.weight"], out[f"{p}.weight_scale"]
    assert (w.dtype, tuple(w.shape), s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, (64, 48), torch.uint8, (64, 2))
    # decoded by hand: e4m3 value × 2^(code − 127), blocks of 32 along K (the second block holds 16 columns)
    scale = torch.exp2(s.double() - 127).repeat_interleave(32, dim=1)[:, :48]
    deq = w.double() * scale
    x = sd[f"{p}.weight"].double()
    # OCP floor rule: the block max lands in [256, 512) before the E4M3 cast (saturating at 448)
    blocks = [(0, 32), (32, 48)]
    for lo, hi in blocks:
        amax = x[:, lo:hi].abs().amax(1)
        e = torch.floor(torch.log2(amax)) - 8
        assert torch.equal(s[:, lo // 32].double() - 127, e)
    assert float((deq - x).abs().max()) <= float(x.abs().max()) * 2.0**-3
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.0.input_layernorm.weight"):
        assert out[kept] is sd[kept]


def test_nvfp4_experts_sync_layout_exact():
    sd = _sd()
    out = mxws.mx_sync_state_dict(sd, "nvfp4-experts")
    p = "model.layers.0.mlp.experts.0.down_proj"
    want = {f"{p}.weight_packed": (torch.uint8, (64, 24)), f"{p}.weight_scale": (torch.float8_e4m3fn, (64, 3)),
            f"{p}.weight_global_scale": (torch.float32, (1,))}
    assert {k: (out[k].dtype, tuple(out[k].shape)) for k in want} == want
    assert f"{p}.weight" not in out
    # g = 448·6 / amax of the BF16 weight (compressed-tensors' order: fl(fl(1/amax)·2688))
    amax = sd[f"{p}.weight"].float().abs().max()
    assert float(out[f"{p}.weight_global_scale"]) == float((1.0 / amax) * 2688.0)
    # attention, the shared expert and the router stay BF16 and untouched
    for kept in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.shared_expert.up_proj.weight",
                 "model.layers.0.mlp.gate.weight"):
        assert out[kept] is sd[kept]
    # the bytes decode (low nibble first) to the oracle's quantized values
    q = mx.MXTensor(out[f"{p}.weight_packed"], out[f"{p}.weight_scale"].view(torch.uint8),
                    out[f"{p}.weight_global_scale"].reshape(()), (64, 48), mx.get_mx_policy("nvfp4"))
    assert torch.equal(mx.dequantize_mx(q), mx.dequantize_mx(mx.mx_quantize(sd[f"{p}.weight"].float(), "nvfp4")))


@pytest.mark.parametrize("recipe", list(mxws.MX_SYNC_RECIPES))
def test_fp32_masters_sync_like_their_bf16_cast_exact(recipe):
    master = fixtures.master_state_dict("tiny-qwen3-moe")
    a = mxws.mx_sync_state_dict(master, recipe)
    b = mxws.mx_sync_state_dict({k: v.to(torch.bfloat16) for k, v in master.items()}, recipe)
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"recipe: expected one of \['mxfp8', 'nvfp4-experts'\], got 'fp4'"):
        mxws.mx_sync_state_dict(_sd(), "fp4")
    with pytest.raises(TypeError, match=r"state_dict\['w'\]: expected a torch.Tensor, got list"):
        mxws.mx_sync_state_dict({"w": [1.0]}, "mxfp8")
