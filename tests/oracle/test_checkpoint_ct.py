"""The oracle's compressed-tensors FP8 checkpoint reader (fp8rl.reference.checkpoint_ct) on hand-built tiny files:
dequantization per strategy against hand-computed values, every malformed file raising a CheckpointError that names
the tensor (or the config field), and the dispatch by quant_method that the reference loader and
``fp8rl checkpoint-matrix`` use."""

from __future__ import annotations

import math

import pytest
import torch
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.reference import checkpoint as ck
from fp8rl.reference import checkpoint_ct as cct
from fp8rl.reference import weight_sync as ws

W = "model.layers.0.self_attn.q_proj.weight"
S = W + "_scale"
E4M3 = torch.float8_e4m3fn


def _codes(values) -> torch.Tensor:
    """FP8 e4m3fn tensor of exactly representable values (1, 2, -0.5, 1.125, 448 …: the cast is exact)."""
    return torch.tensor(values, dtype=torch.float32).to(E4M3)


def _config(strategy: str = "block", **weights) -> dict:
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy, **weights}
    if strategy == "block":
        w.setdefault("block_structure", [2, 4])
    if strategy == "group":
        w.setdefault("group_size", 2)
    return {"model_type": "qwen3", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "format": "float-quantized"}}}}


def _file(strategy: str = "block", scale=None, **weights) -> tuple[dict, dict]:
    codes = _codes([[1.0, 2.0, -0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 2.0], [448.0, 1.0, 1.0, 1.0, -1.0]])
    default = {"block": [[0.25, 2.0], [2.0 ** -7, 1.0]], "tensor": [0.5], "channel": [[1.0], [0.25], [2.0 ** -9]],
               "group": [[1.0, 2.0, 4.0], [0.5, 0.5, 0.5], [1.0, 1.0, 8.0]]}[strategy]
    s = torch.tensor(default if scale is None else scale, dtype=torch.float32)
    return _config(strategy, **weights), {W: codes, S: s, "model.norm.weight": torch.ones(5, dtype=torch.bfloat16)}


@pytest.mark.parametrize("strategy,want", [
    # block [2, 4]: rows 0-1 × cols 0-3 scale 0.25, cols 4 scale 2.0; row 2 × cols 0-3 2^-7, col 4 1.0
    ("block", [[0.25, 0.5, -0.125, 0.25, 2.0], [0.25, 0.25, 0.25, 0.25, 4.0], [3.5, 2.0 ** -7, 2.0 ** -7, 2.0 ** -7, -1.0]]),
    ("tensor", [[0.5, 1.0, -0.25, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5, 1.0], [224.0, 0.5, 0.5, 0.5, -0.5]]),
    ("channel", [[1.0, 2.0, -0.5, 1.0, 1.0], [0.25, 0.25, 0.25, 0.25, 0.5], [0.875, 2.0 ** -9, 2.0 ** -9, 2.0 ** -9, -2.0 ** -9]]),
    # group 2: columns (0,1), (2,3), (4) share a scale
    ("group", [[1.0, 2.0, -1.0, 2.0, 4.0], [0.5, 0.5, 0.5, 0.5, 1.0], [448.0, 1.0, 1.0, 1.0, -8.0]]),
])
def test_dequantize_per_strategy_exact(strategy, want):
    config, tensors = _file(strategy)
    held = cct.dequantize_checkpoint(config, tensors, torch.float32)
    assert held[W].tolist() == want
    assert S not in held and torch.equal(held["model.norm.weight"], tensors["model.norm.weight"])


def test_bf16_scale_and_one_rounding_exact():
    # 1.125 × (1 + 2^-7) = 1.1337890625; bf16 keeps 7 fraction bits: 0.1337890625·128 = 17.125 → 17 → 1.1328125
    config, tensors = _file("tensor", scale=[1.0 + 2.0 ** -7])
    tensors[W] = _codes([[1.125] * 5] * 3)
    tensors[S] = tensors[S].to(torch.bfloat16)
    held = cct.dequantize_checkpoint(config, tensors, torch.bfloat16)
    assert held[W].dtype == torch.bfloat16 and held[W].float().unique().tolist() == [1.1328125]
    assert cct.dequantize_checkpoint(config, tensors, torch.float64)[W].unique().tolist() == [1.1337890625]


def test_ragged_block_and_group_edges_exact():
    assert cct.scale_shape(cct.CTWeightScheme("block", block=(128, 128)), (320, 200)) == (3, 2)
    assert cct.scale_shape(cct.CTWeightScheme("group", group_size=128), (320, 200)) == (320, 2)
    assert cct.scale_shape(cct.CTWeightScheme("channel"), (320, 200)) == (320, 1)
    assert cct.scale_shape(cct.CTWeightScheme("tensor"), (320, 200)) == (1,)


def _bad(defect: str) -> tuple[dict, dict]:
    config, tensors = _file("block")
    qc = config["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    if defect == "scale-missing":
        del tensors[S]
    elif defect == "scale-wrong-shape":
        tensors[S] = tensors[S][:, :1].contiguous()
    elif defect in ("scale-nan", "scale-inf", "scale-negative"):
        tensors[S][0, 1] = {"scale-nan": math.nan, "scale-inf": math.inf, "scale-negative": -1.0}[defect]
    elif defect == "scale-int":
        tensors[S] = tensors[S].to(torch.int32)
    elif defect == "scale-orphan":
        tensors["model.layers.0.self_attn.k_proj.weight_scale"] = torch.ones(1)
    elif defect == "weight-e5m2":
        tensors[W] = tensors[W].float().to(torch.float8_e5m2)
    elif defect == "ignored-but-fp8":
        qc["ignore"] = ["re:.*self_attn\\.q_proj$"]
    elif defect == "block-contradicts":
        w["block_structure"] = [1, 4]
    elif defect == "two-groups":
        qc["config_groups"]["group_1"] = qc["config_groups"]["group_0"]
    elif defect == "not-float-quantized":
        qc["format"] = qc["config_groups"]["group_0"]["format"] = "naive-quantized"
    elif defect == "int-weights":
        w["type"] = "int"
    elif defect == "token-strategy":
        w["strategy"] = "token"
    elif defect == "no-block-structure":
        del w["block_structure"]
    elif defect == "dynamic-weights":
        w["dynamic"] = True
    else:
        raise ValueError(defect)
    return config, tensors


BAD = {  # defect → the name (tensor or config field) the error must contain
    "scale-missing": W, "scale-wrong-shape": S, "scale-nan": S, "scale-inf": S, "scale-negative": S, "scale-int": S,
    "scale-orphan": "k_proj.weight_scale", "weight-e5m2": W, "ignored-but-fp8": W, "block-contradicts": S,
    "two-groups": "config_groups", "not-float-quantized": "format", "int-weights": "weights.type",
    "token-strategy": "weights.strategy", "no-block-structure": "block_structure", "dynamic-weights": "dynamic",
}


@pytest.mark.parametrize("defect", list(BAD))
def test_bad_file_raises_naming_the_tensor_exact(defect):
    config, tensors = _bad(defect)
    with pytest.raises(ck.CheckpointError) as exc:
        cct.dequantize_checkpoint(config, tensors)
    assert BAD[defect] in str(exc.value), str(exc.value)


def test_not_compressed_tensors_config_raises_exact():
    with pytest.raises(ck.CheckpointError, match="quant_method 'compressed-tensors'"):
        cct.weight_scheme({"quantization_config": {"quant_method": "fp8"}})
    assert not cct.is_compressed_tensors({}) and cct.is_compressed_tensors(_config())


def test_is_ignored_names_and_patterns_exact():
    assert cct.is_ignored("lm_head", ["lm_head"])
    assert cct.is_ignored("model.layers.3.mlp.gate", ["re:.*mlp\\.gate$"])
    assert not cct.is_ignored("model.layers.3.mlp.gate_proj", ["re:.*mlp\\.gate$", "lm_head"])


def test_to_blockwise_renames_scales_to_fp32_scale_inv_exact():
    config, tensors = _file("block")
    tensors[S] = tensors[S].to(torch.bfloat16)
    cfg, out = cct.to_blockwise(config, tensors)
    assert set(out) == {W, W + "_scale_inv", "model.norm.weight"}
    assert out[W + "_scale_inv"].dtype == torch.float32
    assert out[W + "_scale_inv"].tolist() == [[0.25, 2.0], [2.0 ** -7, 1.0]]
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [2, 4], "ignored_layers": ["lm_head"],
                                          "modules_to_not_convert": ["lm_head"]}
    # the blockwise reader gives the same held weights
    assert torch.equal(ck.dequantize_checkpoint(config=cfg, tensors=out, dtype=torch.float64)[W],
                       cct.dequantize_checkpoint(config, tensors, torch.float64)[W])
    with pytest.raises(ck.CheckpointError, match="only a block-strategy checkpoint"):
        cct.to_blockwise(*_file("channel"))


def test_reference_loader_reads_both_formats_from_disk_exact(tmp_path):
    config, tensors = _file("group")
    path = ck.write_tensors(tmp_path / "ct", {"model_type": "qwen3"}, tensors, config["quantization_config"])
    held = ReferenceEngine().checkpoint_load(path)
    assert held[W].dtype == torch.bfloat16
    assert held[W].float().tolist() == [[1.0, 2.0, -1.0, 2.0, 4.0], [0.5, 0.5, 0.5, 0.5, 1.0],
                                        [448.0, 1.0, 1.0, 1.0, -8.0]]
    assert "compressed-tensors" in ReferenceEngine.checkpoint_formats
    # a blockwise file still goes through the blockwise reader
    bcfg, btensors = cct.to_blockwise(*_file("block"))
    bpath = ck.write_tensors(tmp_path / "fp8", {"model_type": "qwen3"}, btensors, bcfg["quantization_config"])
    assert ReferenceEngine().checkpoint_load(bpath)[W].float().tolist()[0] == [0.25, 0.5, -0.125, 0.25, 2.0]
    # fp8_weights_any: per-element scales of either format
    codes, s = cct.fp8_weights_any(*_file("channel"))[W]
    assert s.dtype == torch.float64 and s[:, 0].tolist() == [1.0, 0.25, 2.0 ** -9] and s.shape == codes.shape


def test_from_blockwise_is_the_inverse_of_to_blockwise_exact():
    """The oracle's blockwise checkpoint of a tiny model in the compressed-tensors form and back: the same tensors
    bit for bit, the same dequantized weights; the config is a valid block-strategy compressed-tensors config whose
    ignore holds the routers and lm_head."""
    from fp8rl import fixtures

    tm = fixtures.tiny_model("tiny-qwen3-moe")
    spec = ck.CheckpointSpec()
    tensors = ws.quantize_state_dict(tm.state_dict, spec.recipe())
    config = dict(tm.config, quantization_config=ck.quantization_config(spec, ck.ignored_modules(tm.state_dict, spec)))
    ct_config, ct_tensors = cct.from_blockwise(config, tensors)
    assert cct.is_compressed_tensors(ct_config) and not any(n.endswith("_scale_inv") for n in ct_tensors)
    scheme, ignore = cct.weight_scheme(ct_config)
    assert scheme == cct.CTWeightScheme("block", block=(128, 128))
    routers = {n[: -len(".weight")] for n in tm.state_dict if n.endswith(".mlp.gate.weight")}
    assert routers and set(ignore) == routers | ({"lm_head"} if "lm_head.weight" in tensors else set())
    back_config, back = cct.to_blockwise(ct_config, ct_tensors)
    assert set(back) == set(tensors) and all(torch.equal(back[n].view(torch.uint8) if back[n].dtype.itemsize == 1
                                                         else back[n], tensors[n].view(torch.uint8)
                                                         if tensors[n].dtype.itemsize == 1 else tensors[n])
                                             for n in tensors)
    a = cct.dequantize_any(ct_config, ct_tensors, torch.float64)
    b = ck.dequantize_checkpoint(config=config, tensors=tensors, dtype=torch.float64)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ck.CheckpointError, match="weight_block_size"):
        cct.from_blockwise({"quantization_config": {"quant_method": "fp8"}}, tensors)
