"""The oracle's FP8 checkpoint writer and reader (fp8rl.reference.checkpoint)."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from fp8rl import fixtures
from fp8rl.reference import checkpoint as ck
from fp8rl.reference import weight_sync as ws


def _bf16_rne_from_f64(v: float) -> float:
    """Independent single rounding of a finite normal fp64 value to bf16 (8 significant bits), by integer
    arithmetic on the fp64 bits."""
    b = struct.unpack("<Q", struct.pack("<d", v))[0]
    drop = 52 - 7
    keep, rest = b >> drop, b & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    if rest > half or (rest == half and keep & 1):
        keep += 1
    return struct.unpack("<d", struct.pack("<Q", keep << drop))[0]


def test_round_exact_rounds_once_exact():
    v = torch.tensor([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 1 + 2**-8, 3.0], dtype=torch.float64)
    got = ck.round_exact(v, torch.bfloat16).double().tolist()
    assert got == [1 + 2**-7, -(1 + 2**-7), 1.0, 3.0]
    assert v.to(torch.bfloat16).double()[0].item() == 1.0  # torch's fp64 -> bf16 cast rounds twice


def test_round_exact_matches_integer_rounding_exact():
    rng = np.random.default_rng(18)
    codes = torch.from_numpy(rng.integers(0, 256, 4000).astype(np.uint8)).view(torch.float8_e4m3fn)
    scale = torch.from_numpy(rng.uniform(1e-4, 1.0, 4000).astype(np.float32))
    v = codes.to(torch.float64) * scale.double()
    ok = torch.isfinite(v) & (v.abs() > 2.0**-120)
    got = ck.round_exact(v[ok], torch.bfloat16).double().tolist()
    want = [_bf16_rne_from_f64(x) for x in v[ok].tolist()]
    assert got == want


def test_writer_then_reader_is_codes_times_scales_exact(tmp_path):
    tm = fixtures.tiny_model("tiny-qwen3")
    path = ck.write_checkpoint(tmp_path, tm.config, tm.state_dict)
    config, tensors = ck.read_checkpoint(path)
    got = ck.dequantize_checkpoint(path, dtype=torch.float64)
    for name in ws.quantized_names(tm.state_dict):
        codes, s = tensors[name], tensors[ws.scale_name(name)]
        n, k = codes.shape
        assert tuple(s.shape) == (math.ceil(n / 128), math.ceil(k / 128))
        full = torch.kron(s.double(), torch.ones(128, 128, dtype=torch.float64))[:n, :k]
        assert torch.equal(got[name], codes.double() * full), name
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128], "ignored_layers": [],
                                             "modules_to_not_convert": []}
    assert got["lm_head.weight"].dtype == torch.bfloat16


def test_writer_lists_routers_and_kept_modules_exact(tmp_path):
    tm = fixtures.tiny_model("tiny-qwen3-moe")
    keep = ("model.layers.0.self_attn.o_proj",)
    path = ck.write_checkpoint(tmp_path, tm.config, tm.state_dict, ck.CheckpointSpec(keep=keep))
    config, tensors = ck.read_checkpoint(path)
    qc = config["quantization_config"]
    want = ["model.layers.0.mlp.gate", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate"]
    assert sorted(qc["ignored_layers"]) == sorted(qc["modules_to_not_convert"]) == want
    assert tensors["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert ws.scale_name("model.layers.0.self_attn.o_proj.weight") not in tensors


@pytest.mark.parametrize("defect, message", [
    ("scale-wrong-shape", r"weight_scale_inv: shape \(2, 1\), expected \(2, 2\)"),
    ("scale-missing", r"q_proj.weight: FP8 weight without its scale"),
    ("scale-nan", r"q_proj.weight_scale_inv: 1 of 4 scales are NaN, inf or negative"),
    ("scale-inf", r"q_proj.weight_scale_inv: 1 of 4 scales are NaN, inf or negative"),
    ("block-size-contradicts", r"weight_scale_inv: shape \(\d, \d\), expected \(\d, \d\) = ceil"),
])
def test_reader_rejects_bad_checkpoints(defect, message):
    from fp8rl.conformance import test_checkpoint as tc

    with pytest.raises(ck.CheckpointError, match=message):
        ck.dequantize_checkpoint(tc._bad_checkpoint(defect))


def test_reader_rejects_fmt_mismatch_and_fp8_ignored_layer(tmp_path):
    tm = fixtures.tiny_model("tiny-qwen3-moe")
    path = ck.write_checkpoint(tmp_path, tm.config, tm.state_dict)
    config, tensors = ck.read_checkpoint(path)
    bad = json.loads(json.dumps(config))
    bad["quantization_config"]["fmt"] = "e5m2"
    with pytest.raises(ck.CheckpointError, match="quantization_config.fmt is 'e5m2'"):
        ck.dequantize_checkpoint(config=bad, tensors=tensors)
    bad = json.loads(json.dumps(config))
    bad["quantization_config"]["ignored_layers"].append("model.layers.0.self_attn.q_proj")
    with pytest.raises(ck.CheckpointError, match="listed in ignored_layers"):
        ck.dequantize_checkpoint(config=bad, tensors=tensors)
    bad = json.loads(json.dumps(config))
    del bad["quantization_config"]["weight_block_size"]
    with pytest.raises(ck.CheckpointError, match="weight_block_size: missing"):
        ck.dequantize_checkpoint(config=bad, tensors=tensors)


def test_per_tensor_writer_matches_torch_cast_exact(tmp_path):
    """The per-tensor layout against an independent computation: s = fl32(amax(|bf16 w|) / 448) in fp64 arithmetic,
    codes = torch's float8_e4m3fn cast of w / s (fp64 division, one rounding at the cast: the oracle's RNE), the
    scale a 0-d fp32 ``<m>.weight_scale``, config weight_block_size null; the reader gives codes x s exactly."""
    tm = fixtures.tiny_model("tiny-qwen3")
    path = ck.write_checkpoint(tmp_path, tm.config, tm.state_dict, ck.CheckpointSpec(block=None))
    config, tensors = ck.read_checkpoint(path)
    assert config["quantization_config"]["weight_block_size"] is None
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["weight_block_size"] is None
    got = ck.dequantize_checkpoint(path, dtype=torch.float64)
    names = ws.quantized_names(tm.state_dict)
    assert len(names) == 14
    for name in names:
        w = tm.state_dict[name].to(torch.bfloat16).double()
        s = torch.tensor(float(w.abs().max()) / 448.0, dtype=torch.float32)
        codes, stored = tensors[name], tensors[name + "_scale"]
        assert stored.shape == () and stored.dtype == torch.float32 and torch.equal(stored, s), name
        want = (w / s.double()).to(torch.float8_e4m3fn)
        assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)), name
        assert torch.equal(got[name], codes.double() * s.double()), name
        assert ws.scale_name(name) not in tensors
    for i in range(2):  # the shards a loader fuses (QKV, gate_up) have different scales: what the loader must keep
        at = f"model.layers.{i}."
        qkv = {float(tensors[f"{at}self_attn.{x}_proj.weight_scale"]) for x in "qkv"}
        assert len(qkv) == 3, qkv
        assert tensors[f"{at}mlp.gate_proj.weight_scale"] != tensors[f"{at}mlp.up_proj.weight_scale"]


def test_channel_writer_matches_torch_cast_exact(tmp_path):
    """The compressed-tensors channel layout (FP8_DYNAMIC) against an independent computation: per output row
    s_n = fl32(amax(|bf16 w[n, :]|) / 448) in fp64 arithmetic, codes = torch's float8_e4m3fn cast of w / s_n, the
    scales an (N, 1) fp32 ``<m>.weight_scale``; the config a channel-strategy weight group with dynamic per-token
    activations, lm_head ignored; the compressed-tensors reader gives codes x s_n exactly."""
    from fp8rl.reference import checkpoint_ct as cct

    tm = fixtures.tiny_model("tiny-qwen3-moe")
    path = cct.write_channel_checkpoint(tmp_path, tm.config, tm.state_dict)
    config, tensors = ck.read_checkpoint(path)
    qc = config["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert (qc["quant_method"], group["weights"]["strategy"], group["weights"]["dynamic"]) == \
        ("compressed-tensors", "channel", False)
    assert group["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                          "strategy": "token"}
    routers = [n[: -len(".weight")] for n in tm.state_dict if n.endswith("mlp.gate.weight")]
    assert routers and set(qc["ignore"]) == {"lm_head", *routers}
    got = cct.dequantize_checkpoint(config, tensors, dtype=torch.float64)
    names = ws.quantized_names(tm.state_dict)
    assert names
    for name in names:
        w = tm.state_dict[name].to(torch.bfloat16).double()
        s = (w.abs().amax(dim=1, keepdim=True) / 448.0).float()
        codes, stored = tensors[name], tensors[name + "_scale"]
        assert stored.shape == (w.shape[0], 1) and stored.dtype == torch.float32 and torch.equal(stored, s), name
        want = (w / s.double()).to(torch.float8_e4m3fn)
        assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)), name
        assert torch.equal(got[name], codes.double() * s.double()), name
    assert len(set(tensors[names[0] + "_scale"].flatten().tolist())) > 1  # one scale per row, not one per tensor


def test_per_tensor_reader_keeps_attention_scales_and_rejects_bad_files(tmp_path):
    tm = fixtures.tiny_model("tiny-qwen3")
    path = ck.write_checkpoint(tmp_path, tm.config, tm.state_dict, ck.CheckpointSpec(block=None))
    ck.write_attention_scales(path, {0: {"k": 0.5, "v": 0.25}})
    config, tensors = ck.read_checkpoint(path)
    got = ck.dequantize_checkpoint(config=config, tensors=tensors)
    assert float(got["model.layers.0.self_attn.k_scale"]) == 0.5  # a *_scale that is no weight's stays as stored
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = dict(tensors, **{q + "_scale": torch.ones(2)})
    with pytest.raises(ck.CheckpointError, match=r"q_proj.weight_scale: shape \(2,\), expected a single per-tensor"):
        ck.dequantize_checkpoint(config=config, tensors=bad)
    bad = {(k + "_inv" if k == q + "_scale" else k): v for k, v in tensors.items()}  # transformers' per-tensor name
    with pytest.raises(ck.CheckpointError, match=r"q_proj.weight: FP8 weight without its scale .*weight_scale'"
                                                  r" \(weight_block_size is null"):
        ck.dequantize_checkpoint(config=config, tensors=bad)
    bad = dict(tensors, **{q + "_scale": torch.tensor(float("nan"))})
    with pytest.raises(ck.CheckpointError, match="q_proj.weight_scale: 1 of 1 scales are NaN"):
        ck.dequantize_checkpoint(config=config, tensors=bad)


def test_spec_validates_arguments():
    with pytest.raises(ValueError, match="block: expected two positive ints or None"):
        ck.CheckpointSpec(block=(128, 0))
    with pytest.raises(ValueError, match="activation_scheme"):
        ck.CheckpointSpec(activation_scheme="weird")
    with pytest.raises(ValueError, match="dtype: expected"):
        ck.round_exact(torch.zeros(1, dtype=torch.float64), torch.float16)


# -- attention scales stored in a checkpoint ----------------------------------------------------------------------

def test_expected_attention_scales_defaults_exact():
    stored = {0: {"q": 0.25, "k": 0.0625, "v": 0.125}, 1: {}, 2: {"k": 0.5, "v": 0.375}, 3: {"k": 0.75},
              4: {"v": 1.5}}
    assert ck.expected_attention_scales(stored) == {
        0: {"q": 0.25, "k": 0.0625, "v": 0.125},
        1: {"q": 1.0, "k": 1.0, "v": 1.0},
        2: {"q": 0.5, "k": 0.5, "v": 0.375},
        3: {"q": 0.75, "k": 0.75, "v": 0.75},
        4: {"q": 1.5, "k": 1.5, "v": 1.5},
    }


def test_attention_scales_round_trip_through_the_file_exact(tmp_path):
    tm = fixtures.tiny_model("tiny-qwen3")
    p = ck.write_checkpoint(tmp_path / "c", tm.config, tm.state_dict)
    ck.write_attention_scales(p, {0: {"k": 0.0625, "q": 3.0}, 1: {"v": 2.0 ** -20}})
    config, tensors = ck.read_checkpoint(p)
    assert ck.attention_scales_in_file(tensors, 2) == {0: {"q": 3.0, "k": 0.0625}, 1: {"v": 2.0 ** -20}}
    assert tensors["model.layers.0.self_attn.k_scale"].dtype == torch.float32
    assert tensors["model.layers.0.self_attn.k_scale"].shape == ()
    assert len(list(p.glob("*.safetensors"))) == 1
    ck.fp8_pairs(config, tensors)  # the weights are untouched and still valid


@pytest.mark.parametrize("value, shape, match", [(math.nan, (), "finite"), (0.0, (), "> 0"), (-1.0, (), "> 0"),
                                                 (math.inf, (), "finite"), (0.5, (2,), "one fp32 value")])
def test_bad_attention_scale_names_the_tensor(value, shape, match):
    t = torch.full(shape, value, dtype=torch.float32)
    with pytest.raises(ck.CheckpointError, match=match) as e:
        ck.attention_scales_in_file({"model.layers.1.self_attn.v_scale": t}, 2)
    assert "model.layers.1.self_attn.v_scale" in str(e.value)


def test_attention_scale_name_rejects_unknown_kind():
    with pytest.raises(ValueError, match="which"):
        ck.attention_scale_name(0, "p")
