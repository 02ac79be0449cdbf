"""Area ``checkpoint``: the FP8 checkpoint path between a writer and a loader (docs/checkpoint.md).

Writers (capability ``checkpoint.write``): the engine writes a blockwise-FP8 HF checkpoint of BF16 weights or of
the trainer's fp32 masters; its FP8 codes and ``*_weight_scale_inv`` scales must be bit-exact against the oracle's
128×128 block quantization of the BF16 weight under the engine's declared ``scale_policy("block")``, on the tiny
models (dimensions that are not multiples of 128) and on input classes (all-zero rows, columns and blocks, tiny and
huge amax, outliers, ragged shapes); its ``quantization_config`` must say what the file holds.

Loaders (capability ``checkpoint.load``): the engine loads a checkpoint written by the oracle writer
(fp8rl.reference.checkpoint) and returns the weights it holds; each must equal codes × block scales of the file,
computed exactly and rounded once to the dtype the loader holds; the config's ``weight_block_size`` and
``ignored_layers`` / ``modules_to_not_convert`` must be honoured; a malformed checkpoint must raise. The oracle's
files come in four layouts (``fp8rl.engine.CHECKPOINT_LAYOUTS``): blockwise FP8, per-tensor FP8, and the
compressed-tensors block and channel (FP8_DYNAMIC) strategies; a loader is fed those it declares.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8rl import fixtures
from fp8rl.checks import assert_codes_equal, assert_tensors_equal, check, record_metrics
from fp8rl.engine import EngineError, checkpoint_layout_reason
from fp8rl.reference import checkpoint as ck
from fp8rl.reference import checkpoint_ct as cct
from fp8rl.reference import weight_sync as ws
from fp8rl.reference.formats import decode_codes
from fp8rl.reference.policy import ScalePolicy

#: the models whose checkpoints every writer and loader is judged on (tiny-qwen3: hidden 320, intermediate 384)
CKPT_MODELS = ("tiny-qwen3", "tiny-qwen3-moe")
MODELS = pytest.mark.parametrize("model", CKPT_MODELS)


# ----------------------------------------------------------------------------------------------------------------
# input classes of the writer (one weight each, HF projection names so every writer quantizes them)

def _class_weight(cls: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1800 + sum(map(ord, cls)))
    if cls == "ragged":
        return torch.randn(200, 300, generator=g)
    if cls == "narrow":  # K <= 128: a single column of blocks, scale grid (3, 1)
        return torch.randn(300, 100, generator=g)
    if cls == "zero_rows":
        w = torch.randn(130, 257, generator=g)
        w[:5] = 0
        w[129] = 0
        return w
    if cls == "zero_cols":
        w = torch.randn(257, 130, generator=g)
        w[:, :7] = 0
        w[:, 128:] = 0
        return w
    if cls == "zero_blocks":
        w = torch.randn(256, 300, generator=g)
        w[:128, 128:256] = 0
        w[128:, 256:] = 0
        return w
    if cls == "tiny_amax":
        return torch.randn(129, 131, generator=g) * 1e-30
    if cls == "huge_amax":
        return torch.randn(129, 131, generator=g) * 1e37
    if cls == "outliers":
        w = torch.randn(200, 260, generator=g) * 1e-3
        w[3, 5], w[150, 200] = 3e4, -2e4
        return w
    raise ValueError(f"cls: unknown input class {cls!r}")


WRITER_CLASSES = ("ragged", "narrow", "zero_rows", "zero_cols", "zero_blocks", "tiny_amax", "huge_amax", "outliers")


#: the config.json the input-class checkpoints are written with
_CLASS_CONFIG = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}


def _class_state_dict(cls: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    w = _class_weight(cls).to(dtype)  # fp32: not BF16-representable, the writer must cast to BF16 first
    return {"model.layers.0.self_attn.q_proj.weight": w,
            "model.layers.0.input_layernorm.weight": torch.ones(w.shape[1], dtype=torch.bfloat16).to(dtype)}


def _read_blockwise(path: Path, context: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a checkpoint in the oracle's blockwise form: a compressed-tensors file's validated
    block-strategy form (weight_scale → weight_scale_inv, fp32: exact; docs/compressed-tensors.md), any other as
    stored."""
    config, tensors = ck.read_checkpoint(path)
    if not cct.is_compressed_tensors(config):
        return config, tensors
    try:
        return cct.to_blockwise(config, tensors)
    except ck.CheckpointError as exc:
        raise AssertionError(f"{context}: not a valid compressed-tensors FP8 checkpoint: {exc}") from exc


def _compare_written(path: Path, sd: dict[str, torch.Tensor], policy: ScalePolicy, context: str) -> int:
    """Codes and scales of the file vs the oracle's quantization of sd's BF16 cast (bit for bit); names, dtypes
    and the BF16 tensors kept as they are. Returns the number of quantized weights compared."""
    _, got = _read_blockwise(path, context)
    return _compare_to_oracle(got, ws.quantize_state_dict(sd, ws.WeightSyncRecipe(policy=policy)), sd, policy,
                              context, ws.SCALE_SUFFIX)


def _compare_to_oracle(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], sd: dict[str, torch.Tensor],
                       policy: ScalePolicy, context: str, scale_suffix: str,
                       scale_dtypes: tuple[torch.dtype, ...] | None = None) -> int:
    """A written file's tensors vs the oracle's: the same names; FP8 codes bit for bit (dtype and shape equal);
    ``<m>.weight<scale_suffix>`` scale values exactly, of the oracle's shape and dtype (or any of ``scale_dtypes``);
    every other tensor byte-identical. Returns the number of FP8 weights compared."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, f"{context}: tensor names differ from the oracle's: missing {missing[:6]}, " \
        f"unexpected {extra[:6]}"
    n = 0
    for name, w in want.items():
        g = got[name]
        is_scale = name.endswith(".weight" + scale_suffix)
        dtype_ok = g.dtype in scale_dtypes if is_scale and scale_dtypes else g.dtype == w.dtype
        if not dtype_ok or tuple(g.shape) != tuple(w.shape):
            raise AssertionError(f"{context}: {name}: {g.dtype} {tuple(g.shape)}, expected "
                                 f"{' / '.join(map(str, scale_dtypes)) if is_scale and scale_dtypes else w.dtype} "
                                 f"{tuple(w.shape)}")
        if is_scale:
            assert_tensors_equal(g, w, context=f"{context}: {name} ({policy.name}, held as {g.dtype})")
        elif w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            n += 1
            assert_codes_equal(g.contiguous().view(torch.uint8), w.view(torch.uint8), policy.fmt,
                               context=f"{context}: {name} codes ({policy.name})", inputs=sd[name].float())
        elif not torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)):
            raise AssertionError(f"{context}: {name} ({w.dtype}) must be stored unchanged; its bytes differ")
    return n


def _model_sd(model: str, precision: str) -> dict[str, torch.Tensor]:
    if precision == "fp32":
        return fixtures.master_state_dict(model)
    return fixtures.tiny_model(model).state_dict


@MODELS
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@check("CKPT-WRITE-001", "A writer's checkpoint of a tiny model (BF16 weights, or the trainer's fp32 masters cast "
       "to BF16 first) holds, for every attention/MLP/expert projection, FP8 codes and fp32 *_weight_scale_inv "
       "equal bit for bit to the oracle's 128x128 block quantization under the declared block policy, and every "
       "other tensor in BF16 unchanged, with no other names.", requires=["checkpoint.write"])
def test_checkpoint_writer_model_exact(engine, model, precision, tmp_path):
    sd = _model_sd(model, precision)
    path = Path(engine.checkpoint_write(tmp_path / "ckpt", fixtures.tiny_model(model).config, sd))
    n = _compare_written(path, sd, engine.scale_policy("block"), f"{model} ({precision})")
    record_metrics(quantized_weights=n)


@pytest.mark.parametrize("cls", WRITER_CLASSES)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@check("CKPT-WRITE-002", "A writer's codes and scales are bit-exact under its declared block policy on every input "
       "class: shapes that are not multiples of 128 (and K <= 128: one column of blocks), all-zero rows, columns and 128x128 blocks, tiny (1e-30) and "
       "huge (1e37) amax, outliers, in BF16 and fp32.", requires=["checkpoint.write"])
def test_checkpoint_writer_classes_exact(engine, cls, precision, tmp_path):
    sd = _class_state_dict(cls, torch.float32 if precision == "fp32" else torch.bfloat16)
    path = Path(engine.checkpoint_write(tmp_path / "ckpt", _CLASS_CONFIG, sd))
    _compare_written(path, sd, engine.scale_policy("block"), f"class {cls} ({precision})")


#: the input classes whose blocks a careless scale rule breaks (a zero amax: 0/0; extreme amaxes)
FINITE_CLASSES = ("zero_rows", "zero_cols", "zero_blocks", "tiny_amax", "huge_amax")


@pytest.mark.parametrize("cls", FINITE_CLASSES)
@check("CKPT-WRITE-003", "Whatever the declared policy, a writer's checkpoint of finite BF16 weights is a file "
       "every loader can use: each block scale is finite and > 0 and no FP8 code is NaN or inf (all-zero rows, "
       "columns and 128x128 blocks, tiny and huge amax). A policy without a floor passes CKPT-WRITE-002 bit-exactly "
       "with scale 0 and 0/0 = NaN codes for an all-zero block; any loader then multiplies NaN into the weights.",
       requires=["checkpoint.write"])
def test_checkpoint_writer_finite_exact(engine, cls, tmp_path):
    sd = _class_state_dict(cls, torch.bfloat16)
    config, tensors = _read_blockwise(Path(engine.checkpoint_write(tmp_path / "ckpt", _CLASS_CONFIG, sd)),
                                      f"class {cls}")
    bad, checked = _unusable_scales_or_codes(tensors, ws.SCALE_SUFFIX, "block")
    assert checked, f"class {cls}: the file holds no FP8 weight with a block scale"
    assert not bad, f"class {cls} (BF16 weights, all finite): " + "; ".join(bad)


def _unusable_scales_or_codes(tensors: dict[str, torch.Tensor], suffix: str, what: str) -> tuple[list[str], int]:
    """(problems, FP8 weights checked) of a written file: an FP8 weight without its ``<name><suffix>`` scale, a
    scale with an entry that is not finite and > 0 (``what``: "block" or "row"), an FP8 code that is NaN or inf."""
    fmts = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2"}
    bad, checked = [], 0
    for name, w in sorted(tensors.items()):
        if w.dtype not in fmts:
            continue
        checked += 1
        scale = tensors.get(name + suffix)
        if scale is None:
            bad.append(f"{name}: no {name + suffix}")
        else:
            s = scale.double()
            ok = torch.isfinite(s) & (s > 0)
            if not ok.all():
                bad.append(f"{name}: {int((~ok).sum())} of {s.numel()} {what} scales are not finite and > 0 "
                           f"(e.g. {s[~ok].flatten()[0].item()!r})")
        vals = decode_codes(w.contiguous().view(torch.uint8), fmts[w.dtype])
        nonfinite = int((~np.isfinite(vals)).sum())
        if nonfinite:
            bad.append(f"{name}: {nonfinite} of {vals.size} FP8 codes are NaN or inf")
    return bad, checked


@MODELS
@check("CKPT-CONFIG-001", "The written config.json keeps the model config and carries quantization_config with "
       "quant_method 'fp8', fmt of the declared policy's format ('e4m3' for e4m3fn), activation_scheme 'dynamic', "
       "weight_block_size [128, 128], and ignored_layers and modules_to_not_convert each listing exactly the 2-D "
       "linear modules kept in BF16 (the MoE routers); a compressed-tensors writer's: quant_method "
       "'compressed-tensors', format 'float-quantized', one config group targeting Linear with FP8 float "
       "symmetric static block [128, 128] weights, and ignore listing exactly the routers and lm_head.",
       requires=["checkpoint.write"])
def test_checkpoint_writer_config_exact(engine, model, tmp_path):
    tm = fixtures.tiny_model(model)
    path = Path(engine.checkpoint_write(tmp_path / "ckpt", tm.config, tm.state_dict))
    config, _ = ck.read_checkpoint(path)
    changed = sorted(k for k, v in tm.config.items() if k not in ("quantization_config", "torch_dtype", "dtype")
                     and config.get(k) != v)
    assert not changed, f"{model}: model config fields changed or dropped: {changed[:6]}"
    qc = config.get("quantization_config")
    assert isinstance(qc, dict), f"{model}: config.json has no quantization_config dict (got {qc!r})"
    fmt = {"e4m3fn": "e4m3", "e5m2": "e5m2"}.get(engine.scale_policy("block").fmt)
    routers = sorted(n[: -len(".weight")] for n in tm.state_dict if n.endswith((".mlp.gate.weight",
                                                                                 ".mlp.shared_expert_gate.weight")))
    if cct.is_compressed_tensors(config):
        _check_ct_config(config, routers + (["lm_head"] if "lm_head.weight" in tm.state_dict else []), model)
        return
    want = {"quant_method": "fp8", "fmt": fmt, "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "ignored_layers": routers, "modules_to_not_convert": routers}
    bad = []
    for key, value in want.items():
        got = qc.get(key)
        if key in ("ignored_layers", "modules_to_not_convert"):
            got = sorted(got) if isinstance(got, list) else got
        if got != value:
            bad.append(f"{key}: {got!r}, expected {value!r}")
    assert not bad, f"{model}: quantization_config: " + "; ".join(bad)


def _check_ct_config(config: dict, ignore: list[str], model: str) -> None:
    """CKPT-CONFIG-001 for a compressed-tensors file: the fields of cct.quantization_config (one group, its
    targets, the FP8 block weight args, format) and ignore (as a set); the file validates (cct.weight_scheme)."""
    try:
        cct.weight_scheme(config)
    except ck.CheckpointError as exc:
        raise AssertionError(f"{model}: {exc}") from exc
    qc = config["quantization_config"]
    want = cct.quantization_config(cct.CTWeightScheme("block", block=(128, 128)), sorted(ignore))
    bad = [f"{k}: {qc.get(k)!r}, expected {want[k]!r}" for k in ("quant_method", "format") if qc.get(k) != want[k]]
    (gname, group), = qc["config_groups"].items()
    wg = want["config_groups"]["group_0"]
    if group.get("targets") != wg["targets"]:
        bad.append(f"config_groups.{gname}.targets: {group.get('targets')!r}, expected {wg['targets']!r}")
    for k, v in wg["weights"].items():
        if group["weights"].get(k) != v:
            bad.append(f"config_groups.{gname}.weights.{k}: {group['weights'].get(k)!r}, expected {v!r}")
    if sorted(qc.get("ignore") or []) != want["ignore"]:
        bad.append(f"ignore: {qc.get('ignore')!r}, expected {want['ignore']!r}")
    assert not bad, f"{model}: quantization_config: " + "; ".join(bad)


# ----------------------------------------------------------------------------------------------------------------
# channel-strategy writers (compressed-tensors FP8_DYNAMIC: one scale per output row, dynamic per-token activations)

_CT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _read_channel(path: Path, context: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a compressed-tensors channel-strategy file, validated by the oracle's reader."""
    config, tensors = ck.read_checkpoint(path)
    try:
        scheme, _ = cct.weight_scheme(config)
        cct.fp8_weights(config, tensors)
    except ck.CheckpointError as exc:
        raise AssertionError(f"{context}: not a valid compressed-tensors FP8 checkpoint: {exc}") from exc
    if scheme.strategy != "channel":
        raise AssertionError(f"{context}: weights strategy {scheme.strategy!r}, expected 'channel'")
    return config, tensors


def _compare_written_channel(path: Path, sd: dict[str, torch.Tensor], policy: ScalePolicy, context: str) -> int:
    """Codes and (N, 1) row scales of a channel-strategy file vs the oracle's per-channel quantization of sd's BF16
    cast (cct.channel_tensors: codes bit for bit, scale values exactly, in any dtype compressed-tensors allows);
    names and the BF16 tensors kept as they are. Returns the number of quantized weights compared."""
    _, got = _read_channel(path, context)
    return _compare_to_oracle(got, cct.channel_tensors(sd, ck.CheckpointSpec(policy=policy)), sd, policy, context,
                              cct.SCALE_SUFFIX, _CT_SCALE_DTYPES)


#: CKPT-WRITE-004's cases: the tiny models in BF16 and as fp32 masters, then the writer input classes
CHANNEL_WRITE_CASES = [pytest.param("model", m, p, id=f"{m}-{p}") for m in CKPT_MODELS for p in ("bf16", "fp32")] + \
    [pytest.param("class", c, p, id=f"{c}-{p}") for c in WRITER_CLASSES for p in ("bf16", "fp32")]


@pytest.mark.parametrize("kind, what, precision", CHANNEL_WRITE_CASES)
@check("CKPT-WRITE-004", "A channel-strategy writer's compressed-tensors checkpoint (llm-compressor's FP8_DYNAMIC) "
       "holds, for every projection, FP8 codes equal bit for bit and an (N, 1) weight_scale (fp32, bf16 or fp16) "
       "equal in value to the oracle's per-output-row quantization of the BF16 weight under the declared channel "
       "policy, every other tensor in BF16 unchanged, no other names: on the tiny models (BF16 weights, or the "
       "trainer's fp32 masters cast to BF16 first) and on every writer input class.",
       requires=["checkpoint.write_channel"])
def test_checkpoint_channel_writer_exact(engine, kind, what, precision, tmp_path):
    if kind == "model":
        sd = _model_sd(what, precision)
        config = fixtures.tiny_model(what).config
    else:
        sd = _class_state_dict(what, torch.float32 if precision == "fp32" else torch.bfloat16)
        config = _CLASS_CONFIG
    path = Path(engine.checkpoint_write_channel(tmp_path / "ckpt", config, sd))
    n = _compare_written_channel(path, sd, engine.scale_policy("channel"), f"{what} ({precision}, channel)")
    record_metrics(quantized_weights=n)


@pytest.mark.parametrize("cls", FINITE_CLASSES)
@check("CKPT-WRITE-005", "Whatever the declared channel policy, a channel-strategy writer's checkpoint of finite "
       "BF16 weights holds a finite row scale > 0 for every output row and no NaN or inf FP8 code (all-zero rows, "
       "columns and blocks, tiny and huge amax): an all-zero row written as scale 0 and 0/0 codes passes "
       "CKPT-WRITE-004 under a policy without a floor and poisons every loader.",
       requires=["checkpoint.write_channel"])
def test_checkpoint_channel_writer_finite_exact(engine, cls, tmp_path):
    sd = _class_state_dict(cls, torch.bfloat16)
    _, tensors = ck.read_checkpoint(Path(engine.checkpoint_write_channel(tmp_path / "ckpt", _CLASS_CONFIG, sd)))
    bad, checked = _unusable_scales_or_codes(tensors, cct.SCALE_SUFFIX, "row")
    assert checked, f"class {cls}: the file holds no FP8 weight"
    assert not bad, f"class {cls} (BF16 weights, all finite; channel): " + "; ".join(bad)


@MODELS
@check("CKPT-WRITE-006", "Whatever the declared channel policy, every weight of a channel-strategy writer's checkpoint "
       "of a tiny model's BF16 weights, dequantized exactly (codes x its row scale, fp64), is within the "
       "quantization round-trip bound (quant_roundtrip, single rounding to the element format) of the BF16 weight, "
       "and every other tensor is the BF16 weight unchanged.", bound="quant_roundtrip",
       requires=["checkpoint.write_channel"])
def test_checkpoint_channel_writer_roundtrip_bound(engine, model, tmp_path):
    from fp8rl.checkpoint_compare import compare_roundtrip

    tm = fixtures.tiny_model(model)
    path = Path(engine.checkpoint_write_channel(tmp_path / "ckpt", tm.config, tm.state_dict))
    r = compare_roundtrip(*_read_channel(path, model), tm.state_dict)
    n_over = sum(w.over for w in r.over)
    record_metrics(err_over_bound=r.worst, elements_over_bound=n_over)
    bad = r.problems + [f"{w.name} {w.shape}: {w.over} elements" for w in r.over]
    assert not bad, f"{model} (channel): {n_over} of {r.elements} quantized elements in {len(r.over)} tensors " \
        f"exceed the single-rounding bound quant_roundtrip, worst {r.worst:.4g}x the bound (max |err| " \
        f"{max((w.max_err for w in r.over), default=0.0):.3g}): " + "; ".join(bad[:4])


@MODELS
@check("CKPT-CONFIG-002", "A channel-strategy writer's config.json keeps the model config and carries the "
       "compressed-tensors quantization_config of FP8_DYNAMIC: quant_method 'compressed-tensors', format "
       "'float-quantized', quantization_status 'compressed', one config group targeting Linear with FP8 float "
       "symmetric static channel weights and FP8 float symmetric dynamic per-token input activations, and ignore "
       "listing exactly the routers and lm_head (a loader that reads static activations looks for an input_scale "
       "the file does not have).", requires=["checkpoint.write_channel"])
def test_checkpoint_channel_writer_config_exact(engine, model, tmp_path):
    tm = fixtures.tiny_model(model)
    path = Path(engine.checkpoint_write_channel(tmp_path / "ckpt", tm.config, tm.state_dict))
    config, _ = _read_channel(path, model)
    changed = sorted(k for k, v in tm.config.items() if k not in ("quantization_config", "torch_dtype", "dtype")
                     and config.get(k) != v)
    assert not changed, f"{model}: model config fields changed or dropped: {changed[:6]}"
    qc = config["quantization_config"]
    ignore = sorted(n[: -len(".weight")] for n in tm.state_dict if n.endswith((".mlp.gate.weight",
                                                                               ".mlp.shared_expert_gate.weight")))
    want = cct.channel_quantization_config(sorted(ignore + (["lm_head"] if "lm_head.weight" in tm.state_dict
                                                            else [])))
    bad = [f"{k}: {qc.get(k)!r}, expected {want[k]!r}" for k in ("quant_method", "format", "quantization_status")
           if qc.get(k) != want[k]]
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        bad.append(f"config_groups: {len(groups)} groups, expected 1")
    else:
        (gname, group), = groups.items()
        wg = want["config_groups"]["group_0"]
        if group.get("targets") != wg["targets"]:
            bad.append(f"config_groups.{gname}.targets: {group.get('targets')!r}, expected {wg['targets']!r}")
        for part in ("weights", "input_activations"):
            have = group.get(part) or {}
            for k, v in wg[part].items():
                if have.get(k) != v:
                    bad.append(f"config_groups.{gname}.{part}.{k}: {have.get(k)!r}, expected {v!r}")
    if sorted(qc.get("ignore") or []) != want["ignore"]:
        bad.append(f"ignore: {qc.get('ignore')!r}, expected {want['ignore']!r}")
    assert not bad, f"{model}: quantization_config: " + "; ".join(bad)


# ----------------------------------------------------------------------------------------------------------------
# loaders: checkpoints written by the oracle writer


@functools.lru_cache(maxsize=1)
def _scratch() -> Path:
    """One temporary folder per process for the checkpoints the loader checks read, removed at exit."""
    import atexit
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="fp8rl-ckpt-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.lru_cache(maxsize=16)
def _oracle_checkpoint(model: str, block: tuple[int, int] | None = (128, 128), keep: tuple[str, ...] = (),
                       fmt: str = "fp8") -> Path:
    """The oracle's checkpoint of ``model``: blockwise FP8 (``fmt="fp8"``), per-tensor FP8 (``fmt="fp8-per-tensor"``:
    one ``weight_scale`` per projection, so q/k/v and gate/up, which a loader fuses, have different scales), the
    blockwise codes and scales in the compressed-tensors block-strategy form (``fmt="compressed-tensors"``,
    fp8rl.reference.checkpoint_ct), or the compressed-tensors channel strategy with dynamic per-token activations
    (``fmt="compressed-tensors-channel"``: one scale per output row, llm-compressor's FP8_DYNAMIC)."""
    import tempfile

    tm = fixtures.tiny_model(model)
    root = Path(tempfile.mkdtemp(prefix=f"{model}-", dir=_scratch()))
    if fmt == "compressed-tensors-channel":
        return Path(cct.write_channel_checkpoint(root, tm.config, tm.state_dict, ck.CheckpointSpec(keep=keep)))
    if fmt == "fp8-per-tensor":
        block = None
    path = ck.write_checkpoint(root, tm.config, tm.state_dict, ck.CheckpointSpec(block=block, keep=keep))
    if fmt == "compressed-tensors":
        config, tensors = cct.from_blockwise(*ck.read_checkpoint(path))
        path = ck.write_tensors(root, config, tensors, config["quantization_config"])
    return path


#: the layouts a loader is fed (case ids: the model for blockwise FP8, "per-tensor:<model>" for per-tensor FP8,
#: "<layout>:<model>" for the others)
LOAD_CASES = [pytest.param("fp8", m, id=m) for m in CKPT_MODELS] + \
    [pytest.param("fp8-per-tensor", m, id=f"per-tensor:{m}") for m in CKPT_MODELS] + \
    [pytest.param("compressed-tensors", m, id=f"compressed-tensors:{m}") for m in CKPT_MODELS] + \
    [pytest.param("compressed-tensors-channel", m, id=f"compressed-tensors-channel:{m}") for m in CKPT_MODELS]


#: the loader checks whose cases of equal parameters load the same checkpoint: conftest runs each CKPT-LOAD-005
#: case right after the CKPT-LOAD-001 case of the same id, so a loader that keeps its last start (vLLM) starts once
SAME_CHECKPOINT_CHECKS = ("test_checkpoint_loader_exact", "test_checkpoint_loaded_logprobs_bound")


def _case_label(fmt: str, model: str) -> str:
    return model if fmt == "fp8" else f"{fmt.replace('fp8-', '')}:{model}"


#: the loader checks' timeout: each may start an inference engine on a fresh checkpoint (a vllm.LLM start on 2 busy
#: CPU cores: 25-80 s measured), well past the default 60 s of a check
LOADER_TIMEOUT = 600


def _loads_format(engine, fmt: str) -> None:
    """Skip (with the loader's reason) a layout whose quant_method the loader does not declare in
    ``checkpoint_formats``, or that the loader says it can't load here (fp8rl.engine.checkpoint_layout_reason)."""
    reason = checkpoint_layout_reason(engine, fmt)
    if reason is not None:
        pytest.skip(reason)


def _compare_loaded(held: dict, path: Path, context: str) -> None:
    """The loader's weights vs codes × scales of the file, exact in fp64 and rounded once to the held dtype
    (fp8rl.checkpoint_compare, the comparison the interop matrix's cells report too)."""
    from fp8rl.checkpoint_compare import compare_held

    if not isinstance(held, dict):
        raise AssertionError(f"{context}: checkpoint_load returned {type(held).__name__}, expected a dict")
    c = compare_held(held, path)
    if c.invalid:
        raise AssertionError(f"{context}: {c.invalid}")
    assert not c.missing and not c.extra, f"{context}: held weights' names differ from the checkpoint's: missing " \
        f"{c.missing[:6]}, unexpected {c.extra[:6]}"
    record_metrics(mismatch_count=c.values_differ, max_abs_err=c.max_abs_err)
    assert not c.differences, f"{context}: {len(c.differences)} tensors differ from codes x scales of the file: " \
        + "; ".join(d.text() for d in c.differences[:6])


@pytest.mark.parametrize("fmt, model", LOAD_CASES)
@check("CKPT-LOAD-001", "A loader loading the oracle's 128x128 checkpoint of a tiny model holds every quantized "
       "weight equal to codes x block scales of the file (computed exactly, rounded once to the dtype it holds) "
       "and every other tensor as stored, under the checkpoint's names; the same for the oracle's per-tensor "
       "checkpoint (weight_block_size null, one weight_scale per projection: the shards of a fused QKV or gate_up "
       "layer have different scales, each must dequantize with its own), and, for a loader that declares the "
       "compressed-tensors format, for the 128x128 codes and scales in its block-strategy form and for the "
       "oracle's channel-strategy (FP8_DYNAMIC) checkpoint, one scale per output row.",
       requires=["checkpoint.load"], timeout=LOADER_TIMEOUT)
def test_checkpoint_loader_exact(engine, fmt, model):
    _loads_format(engine, fmt)
    path = _oracle_checkpoint(model, fmt=fmt)
    _compare_loaded(engine.checkpoint_load(path), path, _case_label(fmt, model))


@pytest.mark.parametrize("fmt, model", LOAD_CASES)
@check("CKPT-LOAD-005", "The model a loader loads from the oracle's 128x128 or per-tensor checkpoint of a tiny "
       "model (or the 128x128 codes and scales in the compressed-tensors form) gives the tokens of a rollout sampled from the oracle's "
       "dequantized model (codes x scales exactly, rounded once to BF16, in a BF16 transformers model) the "
       "oracle's log-probs within the e2e area's bf16 budgets of that model (k3 KL, token_mult_prob_error, "
       "max |dlogp|): held weights that match the file are not enough if the forward computes with others. The "
       "channel-strategy checkpoint prescribes dynamic per-token FP8 activations: its budgets are the "
       "fp8-linear-ptpc recipe's.",
       bound="e2e_mismatch", requires=["checkpoint.score"], timeout=LOADER_TIMEOUT)
def test_checkpoint_loaded_logprobs_bound(engine, fmt, model, run_seed):
    from fp8rl.reference.rollout import mismatch_metrics

    from . import _e2e as E

    _loads_format(engine, fmt)
    path = _oracle_checkpoint(model, fmt=fmt)
    tokens, lp_oracle = E.checkpoint_oracle_scored(str(path), E.sampling_seed(run_seed))
    lp = engine.checkpoint_score(path, tokens, E.prompt_len())
    m = mismatch_metrics(lp, lp_oracle)
    recipe = E.checkpoint_recipe(fmt)
    record_metrics(**{k: m[k] for k in E.METRICS},
                   err_over_bound=max(m[k] / E.budget(k, model, recipe) for k in ("k3_kl", "max_abs_dlogp")))
    over = E.budget_violations(m, model, recipe)
    assert not over, f"{_case_label(fmt, model)}: the loaded model's log-probs vs the oracle's dequantized model ({recipe} budgets): " \
        + "; ".join(over) + f" (mean |dlogp| {m['mean_abs_dlogp']:.3g} over {lp.numel()} tokens)"


@pytest.mark.parametrize("block", [(64, 128), (128, 64)], ids=["64x128", "128x64"])
@check("CKPT-LOAD-002", "A loader honours weight_block_size: a checkpoint written with non-square 64x128 or "
       "128x64 blocks loads with each weight equal to codes x its block's scale exactly (no 128x128 assumption, "
       "no transposed block).", requires=["checkpoint.load"], timeout=LOADER_TIMEOUT)
def test_checkpoint_loader_block_size_exact(engine, block):
    _loads_format(engine, "fp8")
    path = _oracle_checkpoint("tiny-qwen3-moe", block)
    _compare_loaded(engine.checkpoint_load(path), path, f"tiny-qwen3-moe, weight_block_size {list(block)}")


#: the projections CKPT-LOAD-003's checkpoints keep in BF16 and list as ignored: one unfused projection and every
#: shard of one fused layer (a loader that fuses q/k/v into one layer, as vLLM does, needs one scheme per fused layer)
KEPT = ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj")

#: CKPT-LOAD-003 / -004's layouts: blockwise FP8 on tiny-qwen3-moe, and the compressed-tensors channel layout on
#: tiny-qwen3 (the dense model every loader of that layout starts, vLLM on any CPU included; case ids as LOAD_CASES')
LAYOUT_CASES = [pytest.param("fp8", "tiny-qwen3-moe", id="tiny-qwen3-moe"),
                pytest.param("compressed-tensors-channel", "tiny-qwen3", id="compressed-tensors-channel:tiny-qwen3")]


@pytest.mark.parametrize("fmt, model", LAYOUT_CASES)
@check("CKPT-LOAD-003", "A loader honours ignored_layers / modules_to_not_convert (compressed-tensors: ignore): "
       "projections the checkpoint keeps in BF16 and lists there (besides the routers: an o_proj and the q/k/v "
       "of one layer) are held bit-identical to the stored BF16 weights, the rest dequantized exactly; in each "
       "layout the loader declares.", requires=["checkpoint.load"], timeout=LOADER_TIMEOUT)
def test_checkpoint_loader_ignored_layers_exact(engine, fmt, model):
    _loads_format(engine, fmt)
    path = _oracle_checkpoint(model, (128, 128), KEPT, fmt=fmt)
    _compare_loaded(engine.checkpoint_load(path), path,
                    f"{_case_label(fmt, model)}, {len(KEPT)} projections kept BF16")


# ----------------------------------------------------------------------------------------------------------------
# bad checkpoints

_VICTIM = "model.layers.0.self_attn.q_proj.weight"


def _bad_checkpoint(defect: str) -> Path:
    import json
    import tempfile

    from safetensors.torch import save_file

    src = _oracle_checkpoint("tiny-qwen3-moe")
    config, tensors = ck.read_checkpoint(src)
    tensors = dict(tensors)
    sname = ws.scale_name(_VICTIM)
    s = tensors[sname].clone()
    if defect == "scale-wrong-shape":
        tensors[sname] = s[:, :1].contiguous()
    elif defect == "scale-missing":
        del tensors[sname]
    elif defect == "scale-nan":
        s[0, 0] = math.nan
        tensors[sname] = s
    elif defect == "scale-inf":
        s[-1, -1] = math.inf
        tensors[sname] = s
    elif defect == "block-size-contradicts":
        config["quantization_config"]["weight_block_size"] = [64, 64]
    else:
        raise ValueError(f"defect: unknown defect {defect!r}")
    out = Path(tempfile.mkdtemp(prefix=f"bad-{defect}-", dir=_scratch()))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


BAD_DEFECTS = ("scale-wrong-shape", "scale-missing", "scale-nan", "scale-inf", "block-size-contradicts")
#: the same defects in the compressed-tensors channel layout (tiny-qwen3, a dense model every loader of that layout
#: starts): an (N, 1) weight_scale with half the rows, no weight_scale, a NaN row scale, an inf row scale
CHANNEL_DEFECTS = ("channel-scale-wrong-shape", "channel-scale-missing", "channel-scale-nan", "channel-scale-inf")


def _bad_channel_checkpoint(defect: str) -> Path:
    import tempfile

    src = _oracle_checkpoint("tiny-qwen3", fmt="compressed-tensors-channel")
    config, tensors = ck.read_checkpoint(src)
    tensors = dict(tensors)
    sname = _VICTIM + cct.SCALE_SUFFIX
    s = tensors[sname].clone()
    if defect == "channel-scale-wrong-shape":
        tensors[sname] = s[: s.shape[0] // 2].contiguous()
    elif defect == "channel-scale-missing":
        del tensors[sname]
    elif defect == "channel-scale-nan":
        s[0, 0] = math.nan
        tensors[sname] = s
    elif defect == "channel-scale-inf":
        s[-1, 0] = math.inf
        tensors[sname] = s
    else:
        raise ValueError(f"defect: unknown defect {defect!r}")
    out = Path(tempfile.mkdtemp(prefix=f"bad-{defect}-", dir=_scratch()))
    return ck.write_tensors(out, config, tensors, config["quantization_config"])


@pytest.mark.parametrize("defect", BAD_DEFECTS + CHANNEL_DEFECTS)
@check("CKPT-BAD-001", "A loader given a malformed blockwise-FP8 checkpoint (a scale of the wrong shape, a missing "
       "scale, a NaN or inf scale, a weight_block_size that contradicts the scale shapes) raises an error instead "
       "of holding weights; the same for a compressed-tensors channel checkpoint with a row-scale vector of the "
       "wrong length, no row-scale vector, a NaN or an inf row scale (loaders of that layout).",
       requires=["checkpoint.load"], timeout=LOADER_TIMEOUT)
def test_checkpoint_loader_rejects_bad_exact(engine, defect):
    channel = defect in CHANNEL_DEFECTS
    _loads_format(engine, "compressed-tensors-channel" if channel else "fp8")
    path = _bad_channel_checkpoint(defect) if channel else _bad_checkpoint(defect)
    try:
        held = engine.checkpoint_load(path)
    except EngineError:
        return
    w = held.get(_VICTIM) if isinstance(held, dict) else None
    what = f"{_VICTIM} held as {w.dtype} {tuple(w.shape)}, {int(torch.isnan(w.float()).sum())} NaN, " \
           f"{int(torch.isinf(w.float()).sum())} inf" if isinstance(w, torch.Tensor) else "no such weight"
    raise AssertionError(f"checkpoint with defect {defect!r} loaded without an error ({what})")


# ----------------------------------------------------------------------------------------------------------------
# attention (KV cache and query) scales stored in a checkpoint

#: per layer of the KV-scale checkpoint: which of q/k/v the file stores, with distinct values (powers of two and
#: exact binary fractions, none 1.0, so a default 1.0 or a swap shows)
KV_CASES: dict[str, dict[str, float]] = {
    "qkv": {"q": 0.25, "k": 0.0625, "v": 0.125},
    "none": {},
    "kv-no-q": {"k": 0.5, "v": 0.375},
    "k-only": {"k": 0.75},
}


#: the kv_cache_scheme of a compressed-tensors file whose KV cache is FP8 with one static scale per tensor (what
#: llm-compressor writes for ``kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor}``)
CT_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

#: the attention-scale checks' file formats (case-id prefix): blockwise FP8 with every projection in BF16 (no FP8
#: linear kernel needed), and a compressed-tensors channel (FP8_DYNAMIC) file with an FP8 kv_cache_scheme
KV_FORMATS = {"fp8": "", "compressed-tensors-channel": "compressed-tensors-channel:"}


@functools.lru_cache(maxsize=4)
def _kv_checkpoint(cases: tuple[tuple[str, float], ...] | None = None, fmt: str = "fp8") -> Path:
    """tiny-qwen3 stacked to one layer per KV case (layers 0-1 repeated) with the attention scales of KV_CASES,
    layer i holding case i; with ``cases`` (a tuple of (q|k|v, value)), two layers holding those scales instead.
    ``fmt="fp8"``: every projection kept in BF16 and listed in ignored_layers (so a loader needs no FP8 linear
    kernel: on CPU vLLM has none for block or per-tensor FP8 weights); ``fmt="compressed-tensors-channel"``: the
    oracle's channel file (whose kernel vLLM runs on any CPU) with ``kv_cache_scheme`` :data:`CT_KV_CACHE_SCHEME`."""
    import tempfile

    tm = fixtures.tiny_model("tiny-qwen3")
    n0 = int(tm.config["num_hidden_layers"])
    rows = list(KV_CASES.values()) if cases is None else [dict(cases), dict(cases)]
    sd = {}
    for name, t in tm.state_dict.items():
        if not name.startswith("model.layers."):
            sd[name] = t
            continue
        i, rest = name[len("model.layers."):].split(".", 1)
        for j in range(len(rows)):
            if j % n0 == int(i):
                sd[f"model.layers.{j}.{rest}"] = t.clone()
    config = dict(tm.config, num_hidden_layers=len(rows))
    root = Path(tempfile.mkdtemp(prefix="kv-scales-", dir=_scratch()))
    if fmt == "compressed-tensors-channel":
        cct.write_channel_checkpoint(root, config, sd)
        cfg, tensors = ck.read_checkpoint(root)
        ck.write_tensors(root, cfg, tensors, dict(cfg["quantization_config"], kv_cache_scheme=dict(CT_KV_CACHE_SCHEME)))
    else:
        keep = tuple(sorted({n[: -len(".weight")] for n, t in sd.items()
                             if t.dim() == 2 and n.endswith("_proj.weight")}))
        ck.write_checkpoint(root, config, sd, ck.CheckpointSpec(keep=keep))
    return ck.write_attention_scales(root, dict(enumerate(rows)))


_KV_LOADED: dict = {}


def _kv_format(engine, fmt: str) -> None:
    """Skip a compressed-tensors case for a loader that does not read that layout here (the blockwise cases need no
    FP8 linear kernel: every loader of attention scales reads them)."""
    if fmt != "fp8":
        _loads_format(engine, fmt)


@pytest.mark.parametrize("fmt, case", [pytest.param(f, c, id=f"{p}{c}") for f, p in KV_FORMATS.items()
                                       for c in KV_CASES])
@check("CKPT-KV-001", "A loader running an FP8 (e4m3) KV cache on a checkpoint that stores k_scale, v_scale and "
       "q_scale per layer, each present or absent, uses exactly the file's scales, and where one is absent the "
       "documented default (k and v absent: 1.0; k alone: the k scale for both; q absent: the k scale); in a "
       "blockwise file and in a compressed-tensors channel file with an FP8 kv_cache_scheme.",
       requires=["checkpoint.attention_scales"], timeout=600)
def test_checkpoint_attention_scales_exact(engine, fmt, case):
    _kv_format(engine, fmt)
    path = _kv_checkpoint(fmt=fmt)
    key = (engine.name, id(engine), str(path))
    if key not in _KV_LOADED:  # one load per engine for all cases (a vLLM start: ~25-60 s on CPU)
        try:
            _KV_LOADED[key] = engine.checkpoint_attention_scales(path)
        except Exception as e:  # every case reports the same load error, without loading again
            _KV_LOADED[key] = e
    used = _KV_LOADED[key]
    if isinstance(used, Exception):
        raise used
    layer = list(KV_CASES).index(case)
    config, tensors = ck.read_checkpoint(path)
    want = ck.expected_attention_scales(ck.attention_scales_in_file(tensors, config["num_hidden_layers"]))[layer]
    got = used.get(layer) if isinstance(used, dict) else None
    if not isinstance(got, dict):
        raise AssertionError(f"layer {layer} ({case}): checkpoint_attention_scales gave {got!r}, expected a "
                             "{'q', 'k', 'v'} dict")
    bad = [f"{x}_scale {got.get(x)!r}, expected {want[x]!r}" for x in ck.ATTENTION_SCALES if got.get(x) != want[x]]
    assert not bad, f"layer {layer} (file stores {KV_CASES[case] or 'no scale'}): " + "; ".join(bad)


@functools.lru_cache(maxsize=4)
def _oracle_checkpoint_with_attention_scales(fmt: str, model: str) -> Path:
    import shutil
    import tempfile

    src = _oracle_checkpoint(model, fmt=fmt)
    root = Path(tempfile.mkdtemp(prefix="attn-scales-", dir=_scratch())) / "ckpt"
    shutil.copytree(src, root)
    return ck.write_attention_scales(root, {0: {"q": 0.25, "k": 0.0625, "v": 0.125}, 1: {"k": 0.5}})


@pytest.mark.parametrize("fmt, model", LAYOUT_CASES)
@check("CKPT-LOAD-004", "A loader loading a checkpoint that also stores per-layer k_scale / v_scale / q_scale holds "
       "every weight exactly as without them (codes x scales, no attention scale applied to a projection or "
       "mistaken for a weight scale), in each layout it declares; it may keep or drop the attention scales "
       "themselves.", requires=["checkpoint.load"], timeout=LOADER_TIMEOUT)
def test_checkpoint_loader_with_attention_scales_exact(engine, fmt, model):
    import tempfile

    _loads_format(engine, fmt)
    path = _oracle_checkpoint_with_attention_scales(fmt, model)
    held = engine.checkpoint_load(path)
    if isinstance(held, dict):
        config, tensors = ck.read_checkpoint(path)
        names = {ck.attention_scale_name(i, x) for i in range(int(config["num_hidden_layers"]))
                 for x in ck.ATTENTION_SCALES}
        kept = {n: held[n] for n in names if n in held}
        held = {n: t for n, t in held.items() if n not in names}
        bad = [f"{n}: {t.reshape(-1)[:1].tolist()} vs {tensors[n].tolist()}" for n, t in kept.items()
               if t.numel() != 1 or float(t.float().reshape(())) != float(tensors[n])]
        assert not bad, f"attention scales held but changed: {bad[:4]}"
        path = ck.write_tensors(Path(tempfile.mkdtemp(prefix="attn-scales-view-", dir=_scratch())), config,
                                {n: t for n, t in tensors.items() if n not in names}, config["quantization_config"])
    _compare_loaded(held, path, f"{_case_label(fmt, model)} with attention scales")


@pytest.mark.parametrize("fmt", [pytest.param(f, id=p.rstrip(":") or "fp8") for f, p in KV_FORMATS.items()])
@check("CKPT-KV-002", "A loader running an FP8 (e4m3) KV cache on a checkpoint that stores v_scale but no k_scale "
       "uses that v scale for both keys and values (and, q absent, for the query), or raises an error naming the "
       "missing k_scale; in a blockwise file and in a compressed-tensors channel file with an FP8 kv_cache_scheme.",
       requires=["checkpoint.attention_scales"], timeout=600)
def test_checkpoint_attention_scales_v_only_exact(engine, fmt):
    _kv_format(engine, fmt)
    path = _kv_checkpoint((("v", 1.5),), fmt=fmt)
    try:
        used = engine.checkpoint_attention_scales(path)
    except EngineError as e:
        if "k_scale" in str(e):
            return
        raise AssertionError(f"v_scale 1.5 without k_scale: the load failed without naming k_scale ({e})") from e
    want = {"q": 1.5, "k": 1.5, "v": 1.5}
    got = used.get(0) if isinstance(used, dict) else None
    assert got == want, f"v_scale 1.5 without k_scale: layer 0 uses {got!r}, expected {want!r}"


#: bad attention scales: (which scales of layer 0 the file stores, as written)
BAD_KV: dict[str, dict[str, object]] = {
    "k-nan": {"k": math.nan, "v": 0.125},
    "kv-negative": {"k": -0.5, "v": -0.5},
    "k-zero": {"k": 0.0, "v": 0.125},
    "k-vector": {"k": (0.0625, 0.125), "v": 0.125},
}


@functools.lru_cache(maxsize=8)
def _bad_kv_checkpoint(defect: str) -> Path:
    import json
    import tempfile

    from safetensors.torch import save_file

    src = _kv_checkpoint((("k", 0.0625), ("v", 0.125)))
    config, tensors = ck.read_checkpoint(src)
    tensors = dict(tensors)
    for x, v in BAD_KV[defect].items():
        tensors[ck.attention_scale_name(0, x)] = torch.tensor(v, dtype=torch.float32)
    out = Path(tempfile.mkdtemp(prefix=f"bad-kv-{defect}-", dir=_scratch()))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@pytest.mark.parametrize("defect", list(BAD_KV))
@check("CKPT-BAD-002", "A loader given a checkpoint whose attention scale is NaN, zero, negative (k and v both) or "
       "not a single value raises an error instead of running the FP8 KV cache with it or with a default.",
       requires=["checkpoint.attention_scales"], timeout=600)
def test_checkpoint_bad_attention_scales_rejected_exact(engine, defect):
    path = _bad_kv_checkpoint(defect)
    try:
        used = engine.checkpoint_attention_scales(path)
    except EngineError:
        return
    got = used.get(0) if isinstance(used, dict) else used
    raise AssertionError(f"attention scales {BAD_KV[defect]} of layer 0 loaded without an error; layer 0 uses {got!r}")
