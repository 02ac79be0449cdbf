"""Checkpoint mutants: an FP8 checkpoint writer or loader with one realistic bug each (area ``checkpoint``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from fp8rl.engines.reference import ReferenceEngine

from ._base import mutant


def _rewrite(path, edit_tensors=None, edit_qc=None) -> Path:
    """Apply edits to a written checkpoint in place (the writer's bug)."""
    from fp8rl.reference import checkpoint as ck
    from safetensors.torch import save_file

    p = Path(path)
    config, tensors = ck.read_checkpoint(p)
    if edit_tensors is not None:
        tensors = edit_tensors(dict(tensors))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(p / "model.safetensors"),
                  metadata={"format": "pt"})
    if edit_qc is not None:
        config["quantization_config"] = edit_qc(dict(config["quantization_config"]))
        (p / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return p


# -- writers -------------------------------------------------------------------------------------------------------

@mutant("ckpt-writer-scale-inverse", "the writer stores the quant multiplier 1/s as *_weight_scale_inv (the name "
        "read literally) instead of the dequant scale s", kills=("CKPT-WRITE-002",))
class WriterScaleInverse(ReferenceEngine):
    def checkpoint_write(self, out_dir, config, state_dict):
        p = super().checkpoint_write(out_dir, config, state_dict)
        return _rewrite(p, lambda t: {k: (1.0 / v.double()).float() if k.endswith("_scale_inv") else v
                                      for k, v in t.items()})


@mutant("ckpt-writer-grid-transposed", "the writer lays a non-square weight's scale grid out column-major in the "
        "row-major (ceil(N/128), ceil(K/128)) tensor", kills=("CKPT-WRITE-001",))
class WriterGridTransposed(ReferenceEngine):
    def checkpoint_write(self, out_dir, config, state_dict):
        p = super().checkpoint_write(out_dir, config, state_dict)
        return _rewrite(p, lambda t: {k: v.t().contiguous().reshape(v.shape)
                                      if k.endswith("_scale_inv") and v.shape[0] != v.shape[1] else v
                                      for k, v in t.items()})


@mutant("ckpt-writer-no-ignored-layers", "the writer keeps the MoE routers in BF16 but does not list them in "
        "ignored_layers / modules_to_not_convert (a config-driven loader then builds FP8 layers for them)",
        kills=("CKPT-CONFIG-001",))
class WriterNoIgnored(ReferenceEngine):
    def checkpoint_write(self, out_dir, config, state_dict):
        p = super().checkpoint_write(out_dir, config, state_dict)

        def edit(qc):
            qc.pop("ignored_layers", None)
            qc.pop("modules_to_not_convert", None)
            return qc
        return _rewrite(p, edit_qc=edit)


@mutant("ckpt-writer-static-per-tensor-config", "the writer copies a per-tensor FP8 config: activation_scheme "
        "'static' and no weight_block_size, for a 128x128 blockwise file", kills=("CKPT-CONFIG-001",))
class WriterPerTensorConfig(ReferenceEngine):
    def checkpoint_write(self, out_dir, config, state_dict):
        p = super().checkpoint_write(out_dir, config, state_dict)

        def edit(qc):
            qc.pop("weight_block_size", None)
            qc["activation_scheme"] = "static"
            return qc
        return _rewrite(p, edit_qc=edit)


@mutant("ckpt-writer-fp32-direct", "the writer quantizes the trainer's fp32 master weights directly (block amax "
        "and rounding from fp32) instead of their BF16 cast", kills=("CKPT-WRITE-001",))
class WriterFp32Direct(ReferenceEngine):
    def checkpoint_write(self, out_dir, config, state_dict):
        from fp8rl.reference import checkpoint as ck

        spec = ck.CheckpointSpec(policy=self.scale_policy("block"))
        tensors = ck.ws.quantize_state_dict(state_dict, spec.recipe().with_(cast_dtype=torch.float32))
        tensors = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith("_scale_inv") else v
                   for k, v in tensors.items()}
        return ck.write_tensors(out_dir, config, tensors,
                                ck.quantization_config(spec, ck.ignored_modules(state_dict, spec)))


@mutant("ckpt-writer-zero-block-scale", "the writer computes each scale as amax/448 with no floor: an all-zero "
        "block gets scale 0 and its codes 0/0 = NaN", kills=("CKPT-WRITE-002", "CKPT-WRITE-003"))
class WriterZeroBlock(ReferenceEngine):
    def checkpoint_write(self, out_dir, config, state_dict):
        p = super().checkpoint_write(out_dir, config, state_dict)
        from fp8rl.reference import checkpoint as ck

        def edit(t):
            for name in [k for k in t if k.endswith("_scale_inv")]:
                w = t[name[: -len("_scale_inv")]]
                s = t[name].clone()
                codes = w.view(torch.uint8).clone()
                vals = ck.dequantize_exact(w, s, (128, 128), torch.float64)
                n, k = vals.shape
                for i in range(s.shape[0]):
                    for j in range(s.shape[1]):
                        blk = vals[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                        if blk.numel() and float(blk.abs().max()) == 0.0:
                            s[i, j] = 0.0
                            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = 0x7F  # e4m3fn NaN
                t[name] = s
                t[name[: -len("_scale_inv")]] = codes.view(w.dtype)
            return t
        return _rewrite(p, edit)


@mutant("ckpt-writer-unguarded-declared", "the writer's block quantizer has no floor and says so: its declared policy "
        "(s = amax/448, no eps, 0/0 for a zero amax: torchao's Float8Tensor, the DeepSeek-V3 reference kernel) is "
        "met bit-exactly, so an all-zero block is written as scale 0 and NaN codes", kills=("CKPT-WRITE-003",))
class WriterUnguardedDeclared(ReferenceEngine):
    def scale_policy(self, kind):
        p = super().scale_policy(kind)
        return _unguarded(p) if kind == "block" else p


def _unguarded(p):
    """``p`` without a floor: s = amax/448, 0/0 for a zero amax (torchao's Float8Tensor, DeepSeek-V3's kernel)."""
    from dataclasses import replace

    return replace(p, name=f"{p.name}-unguarded", floor="none", eps=0.0, zero_amax="nan")


@mutant("ckpt-writer-squeezed-scale", "the writer squeezes the last dimension of every scale grid (written for a "
        "(blk_m, blk_n, 1) descale): a weight with K <= 128 ships a 1-D (ceil(N/128),) scale (veRL's Triton-path "
        "finding, verl-triton.xfails WSYNC-*)", kills=("CKPT-WRITE-002",))
class WriterSqueezedScale(ReferenceEngine):
    def checkpoint_write(self, out_dir, config, state_dict):
        p = super().checkpoint_write(out_dir, config, state_dict)
        return _rewrite(p, lambda t: {k: v.squeeze(-1).contiguous() if k.endswith("_scale_inv") else v
                                      for k, v in t.items()})


# -- channel-strategy writers (compressed-tensors FP8_DYNAMIC) ----------------------------------------------------

def _is_row_scale(name: str) -> bool:
    from fp8rl.reference import checkpoint_ct as cct

    return name.endswith(".weight" + cct.SCALE_SUFFIX)


@mutant("ckpt-channel-writer-scale-inverse", "the channel writer stores the quant multiplier 448/amax of each row as "
        "weight_scale instead of the dequant scale amax/448", kills=("CKPT-WRITE-004",))
class ChannelWriterScaleInverse(ReferenceEngine):
    def checkpoint_write_channel(self, out_dir, config, state_dict):
        p = super().checkpoint_write_channel(out_dir, config, state_dict)
        return _rewrite(p, lambda t: {k: (1.0 / v.double()).to(v.dtype) if _is_row_scale(k) else v
                                      for k, v in t.items()})


@mutant("ckpt-channel-writer-fp32-direct", "the channel writer takes each row's amax and codes from the trainer's "
        "fp32 master weights instead of their BF16 cast (the rows of a BF16 model then dequantize to other values "
        "than the weights the trainer syncs)", kills=("CKPT-WRITE-004",))
class ChannelWriterFp32Direct(ReferenceEngine):
    def checkpoint_write_channel(self, out_dir, config, state_dict):
        from fp8rl.reference import checkpoint_ct as cct
        from fp8rl.reference.quant import Granularity, quantize

        p = super().checkpoint_write_channel(out_dir, config, state_dict)
        policy = self.scale_policy("channel")

        def edit(t):
            for name in [k for k in t if _is_row_scale(k)]:
                w = name[: -len(cct.SCALE_SUFFIX)]
                qt = quantize(state_dict[w].float(), Granularity.channel(), policy)
                t[w] = qt.codes.view(torch.float8_e4m3fn)
                t[name] = qt.scale.reshape(-1, 1).to(t[name].dtype)
            return t
        return _rewrite(p, edit)


@mutant("ckpt-channel-writer-static-activations", "the channel writer copies compressed-tensors' FP8 preset for the "
        "activations (static per-tensor input scales) into an FP8_DYNAMIC file that stores no input_scale",
        kills=("CKPT-CONFIG-002",))
class ChannelWriterStaticActivations(ReferenceEngine):
    def checkpoint_write_channel(self, out_dir, config, state_dict):
        p = super().checkpoint_write_channel(out_dir, config, state_dict)

        def edit(qc):
            for g in qc["config_groups"].values():
                g["input_activations"] = dict(g["input_activations"], dynamic=False, strategy="tensor")
            return qc
        return _rewrite(p, edit_qc=edit)


@mutant("ckpt-channel-writer-unguarded-declared", "the channel writer has no floor and says so (s = amax/448, 0/0 "
        "for a zero row): its declared channel policy is met bit-exactly, so an all-zero output row is written as "
        "scale 0 and NaN codes", kills=("CKPT-WRITE-005",))
class ChannelWriterUnguardedDeclared(ReferenceEngine):
    def scale_policy(self, kind):
        p = super().scale_policy(kind)
        return _unguarded(p) if kind == "channel" else p


# -- loaders -------------------------------------------------------------------------------------------------------

def _reload_with(path, block=None, scale_fn=None, skip_ignored=False, validate=True):
    """A loader: the file dequantized with the given mistakes (the oracle reader otherwise)."""
    from fp8rl.reference import checkpoint as ck
    from fp8rl.reference import weight_sync as ws

    config, tensors = ck.read_checkpoint(path)
    qc = config["quantization_config"]
    if validate:
        ck.fp8_pairs(config, tensors)
    per_tensor = block is None and qc.get("weight_block_size") is None
    suffix = ck.PER_TENSOR_SCALE_SUFFIX if per_tensor else ws.SCALE_SUFFIX
    ignored = set(qc.get("ignored_layers") or ()) | set(qc.get("modules_to_not_convert") or ())
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight" + suffix):
            continue
        sname = name + suffix
        if sname in tensors:
            s = tensors[sname].float()
            s = scale_fn(s) if scale_fn else s
            b = tuple(t.shape) if per_tensor else tuple(block or qc["weight_block_size"])
            out[name] = ck.dequantize_exact(t, s.reshape(1, 1) if per_tensor else s, b,  # type: ignore[arg-type]
                                            torch.bfloat16)
        elif skip_ignored and name.endswith(".weight") and name[: -len(".weight")] in ignored \
                and t.dim() == 2 and ".mlp.gate." not in name:
            # builds an FP8 layer anyway: the BF16 weight is cast to e4m3fn with scale 1
            out[name] = t.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.bfloat16)
        else:
            out[name] = t
    return out


@mutant("ckpt-loader-assumes-128", "the loader ignores weight_block_size and always dequantizes with 128x128 "
        "blocks", kills=("CKPT-LOAD-002",))
class LoaderAssumes128(ReferenceEngine):
    def checkpoint_load(self, path):
        return _reload_with(path, block=(128, 128), validate=False)


@mutant("ckpt-loader-block-transposed", "the loader reads weight_block_size [Bn, Bk] as [Bk, Bn]",
        kills=("CKPT-LOAD-002",))
class LoaderBlockTransposed(ReferenceEngine):
    def checkpoint_load(self, path):
        from fp8rl.reference import checkpoint as ck

        config, _ = ck.read_checkpoint(path)
        bn, bk = config["quantization_config"]["weight_block_size"]
        return _reload_with(path, block=(bk, bn), validate=False)


@mutant("ckpt-loader-inverts-scale", "the loader divides by *_weight_scale_inv (reading the name literally as 1/s)",
        kills=("CKPT-LOAD-001",))
class LoaderInvertsScale(ReferenceEngine):
    def checkpoint_load(self, path):
        return _reload_with(path, scale_fn=lambda s: 1.0 / s)


@mutant("ckpt-loader-ignores-ignored-layers", "the loader builds FP8 layers for modules the config lists in "
        "ignored_layers / modules_to_not_convert and casts their BF16 weights to e4m3fn with scale 1",
        kills=("CKPT-LOAD-003",))
class LoaderIgnoresIgnored(ReferenceEngine):
    def checkpoint_load(self, path):
        return _reload_with(path, skip_ignored=True)


@mutant("ckpt-loader-double-rounding", "the loader multiplies codes by scales in bf16 (the scale rounded to bf16 "
        "first) instead of exactly", kills=("CKPT-LOAD-003",))
class LoaderBf16Math(ReferenceEngine):
    def checkpoint_load(self, path):
        return _reload_with(path, scale_fn=lambda s: s.to(torch.bfloat16).float())


#: the projections a loader fuses into one layer (vLLM's packed_modules_mapping of Qwen3: qkv_proj, gate_up_proj)
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


@mutant("ckpt-loader-fused-max-scale", "loading a per-tensor checkpoint, the loader fuses q/k/v and gate/up into "
        "one layer with one scale, the largest of its shards' (as vLLM's requantize_with_max_scale does), but keeps "
        "each shard's codes as stored instead of requantizing them to that scale: every shard but the one with the "
        "largest scale is scaled up", kills=("CKPT-LOAD-001",))
class LoaderFusedMaxScale(ReferenceEngine):
    def checkpoint_load(self, path):
        from fp8rl.reference import checkpoint as ck

        config, tensors = ck.read_checkpoint(path)
        held = super().checkpoint_load(path)
        if ck.scale_suffix(config) != ck.PER_TENSOR_SCALE_SUFFIX:
            return held
        fused: dict[tuple[str, str], list[str]] = {}
        for name in tensors:
            prefix, _, short = name[: -len(".weight")].rpartition(".") if name.endswith(".weight") else ("", "", "")
            if short in _FUSED and name + ck.PER_TENSOR_SCALE_SUFFIX in tensors:
                fused.setdefault((prefix, _FUSED[short]), []).append(name)
        for names in fused.values():
            top = max(tensors[n + ck.PER_TENSOR_SCALE_SUFFIX].float().reshape(()) for n in names)
            for n in names:
                held[n] = ck.dequantize_exact(tensors[n], top.reshape(1, 1), tuple(tensors[n].shape))
        return held


@mutant("ckpt-loader-ct-strategy-ignored", "loading a compressed-tensors checkpoint, the loader ignores the "
        "weights' strategy and reads every weight_scale as one per-tensor scale (its first entry): a channel-strategy "
        "(FP8_DYNAMIC) file dequantizes every row with row 0's scale", kills=("CKPT-LOAD-001",))
class LoaderCtStrategyIgnored(ReferenceEngine):
    def checkpoint_load(self, path):
        from fp8rl.reference import checkpoint as ck
        from fp8rl.reference import checkpoint_ct as cct

        config, tensors = ck.read_checkpoint(path)
        held = super().checkpoint_load(path)
        if not cct.is_compressed_tensors(config):
            return held
        for name, (codes, scale) in cct.fp8_weights(config, tensors).items():
            held[name] = cct.dequantize_exact(codes, scale.reshape(-1)[:1], cct.CTWeightScheme("tensor"))
        return held


@mutant("ckpt-loader-no-validation", "the loader trusts the file: a missing scale counts as 1, a scale grid of "
        "the wrong shape is broadcast from its first column, NaN/inf scales and a contradicting weight_block_size "
        "pass", kills=("CKPT-BAD-001",))
class LoaderNoValidation(ReferenceEngine):
    def checkpoint_load(self, path):
        from fp8rl.reference import checkpoint as ck
        from fp8rl.reference import weight_sync as ws

        config, tensors = ck.read_checkpoint(path)
        out = {}
        for name, t in tensors.items():
            if name.endswith(ws.SCALE_SUFFIX):
                continue
            if t.dtype == torch.float8_e4m3fn:
                n, k = t.shape
                s = tensors.get(ws.scale_name(name), torch.ones(1, 1)).float()
                grid = (math.ceil(n / 128), math.ceil(k / 128))
                if tuple(s.shape) != grid:
                    s = s[:, :1].expand(s.shape[0], grid[1])[: grid[0]]
                    s = torch.cat([s, s[-1:].expand(grid[0] - s.shape[0], -1)]) if s.shape[0] < grid[0] else s
                out[name] = ck.dequantize_exact(t, s, (128, 128), torch.bfloat16)
            else:
                out[name] = t
        return out


@mutant("ckpt-loader-block-from-grid", "the loader ignores weight_block_size and derives the block from the scale "
        "grid (block = N // grid rows, as transformers' Fp8Dequantize): ceil-div grids of dimensions that are not "
        "multiples of 128 fail or get the wrong geometry, a contradicting weight_block_size passes",
        kills=("CKPT-LOAD-001",))
class LoaderBlockFromGrid(ReferenceEngine):
    def checkpoint_load(self, path):
        from fp8rl.reference import checkpoint as ck
        from fp8rl.reference import weight_sync as ws

        _, tensors = ck.read_checkpoint(path)
        out = {}
        for name, t in tensors.items():
            if name.endswith(ws.SCALE_SUFFIX):
                continue
            s = tensors.get(ws.scale_name(name))
            if s is None:
                out[name] = t
                continue
            (n, k), (gn, gk) = t.shape, s.shape
            if n % gn or k % gk:
                raise ValueError(f"Weight shape ({n}, {k}) not divisible by scale grid ({gn}, {gk}).")
            out[name] = ck.dequantize_exact(t, s.float(), (n // gn, k // gk), torch.bfloat16)
        return out


# -- the loaded model's forward (CKPT-LOAD-005): weights read back right, computed with others ----------------------

def _score_with(path, tokens, prompt_len, scale_read):
    """A loader whose model computes with codes x ``scale_read(name, grid)`` (its kernel's reading of the block
    scale grid) while :meth:`checkpoint_load` reports the file's weights exactly (the oracle reader): a loader that
    keeps FP8 codes and scales and dequantizes or scales inside its forward."""
    from fp8rl.reference import checkpoint as ck
    from fp8rl.reference import checkpoint_ct as cct
    from fp8rl.reference import weight_sync as ws
    from fp8rl.reference.rollout_hf import RolloutPolicy

    config, tensors = ck.read_checkpoint(path)
    if cct.is_compressed_tensors(config):
        config, tensors = cct.to_blockwise(config, tensors)
    block = tuple(config["quantization_config"]["weight_block_size"])
    state = {}
    for name, t in tensors.items():
        if name.endswith(ws.SCALE_SUFFIX):
            continue
        sname = ws.scale_name(name)
        state[name] = ck.dequantize_exact(t, scale_read(name, tensors[sname].float()), block, torch.bfloat16) \
            if sname in tensors else t
    return RolloutPolicy(config, state, "bf16").score(tokens, prompt_len)


@mutant("ckpt-loader-forward-scale-layout", "the loader holds the file's codes and scale grids and reads them back "
        "right, but its GEMM kernel reads the row-major [N/Bn, K/Bk] scale buffer as column-major (a kernel written "
        "for K-major scales, as DeepGEMM-style kernels want them)", kills=("CKPT-LOAD-005",))
class LoaderForwardScaleLayout(ReferenceEngine):
    def checkpoint_score(self, path, tokens, prompt_len):
        return _score_with(path, tokens, prompt_len,
                           lambda name, s: s.reshape(s.shape[1], s.shape[0]).t())


@mutant("ckpt-loader-forward-experts-per-tensor", "the loader's fused-MoE forward folds each expert's block scales "
        "into one scale per weight (the first block's), while its dense layers and its read-back are right",
        kills=("CKPT-LOAD-005",))
class LoaderForwardExpertsPerTensor(ReferenceEngine):
    def checkpoint_score(self, path, tokens, prompt_len):
        return _score_with(path, tokens, prompt_len,
                           lambda name, s: s[:1, :1].expand_as(s) if ".mlp.experts." in name else s)


# -- attention (KV cache / query) scales stored in the checkpoint --------------------------------------------------

def _attention_scales_with(path, rule):
    """A loader's attention scales: the file's k/v/q per layer (validated), completed by ``rule(row)``."""
    from fp8rl.reference import checkpoint as ck

    config, tensors = ck.read_checkpoint(path)
    stored = ck.attention_scales_in_file(tensors, config["num_hidden_layers"])
    return {i: rule(dict(row)) for i, row in stored.items()}


@mutant("ckpt-kv-scales-ignored", "the loader runs the FP8 KV cache with k/v/q scales 1.0 whatever the checkpoint "
        "stores (the file's *_scale tensors dropped as unexpected keys)", kills=("CKPT-KV-001",))
class KvScalesIgnored(ReferenceEngine):
    def checkpoint_attention_scales(self, path):
        return _attention_scales_with(path, lambda row: {"q": 1.0, "k": 1.0, "v": 1.0})


@mutant("ckpt-kv-scales-swapped", "the loader installs k_scale as the value scale and v_scale as the key scale "
        "(a name mapping that pairs .k_scale with v_proj)", kills=("CKPT-KV-001",))
class KvScalesSwapped(ReferenceEngine):
    def checkpoint_attention_scales(self, path):
        from fp8rl.reference import checkpoint as ck

        def rule(row):
            want = ck.expected_attention_scales({0: row})[0]
            return {"q": want["q"], "k": want["v"], "v": want["k"]}
        return _attention_scales_with(path, rule)


@mutant("ckpt-kv-no-duplicate", "the loader uses 1.0 for whichever of k_scale / v_scale the checkpoint lacks "
        "instead of the one it has (no duplication of a single KV scale)", kills=("CKPT-KV-001", "CKPT-KV-002"))
class KvNoDuplicate(ReferenceEngine):
    def checkpoint_attention_scales(self, path):
        def rule(row):
            k, v = row.get("k", 1.0), row.get("v", 1.0)
            return {"q": row.get("q", k), "k": k, "v": v}
        return _attention_scales_with(path, rule)


@mutant("ckpt-kv-q-default-one", "the loader uses q_scale 1.0 when the checkpoint has none, instead of the k scale "
        "its documentation promises", kills=("CKPT-KV-001",))
class KvQDefaultOne(ReferenceEngine):
    def checkpoint_attention_scales(self, path):
        from fp8rl.reference import checkpoint as ck

        def rule(row):
            return dict(ck.expected_attention_scales({0: row})[0], q=row.get("q", 1.0))
        return _attention_scales_with(path, rule)


@mutant("ckpt-kv-scale-inverse", "the loader reads the stored k/v/q scales as quant multipliers and installs their "
        "reciprocal", kills=("CKPT-KV-001",))
class KvScaleInverse(ReferenceEngine):
    def checkpoint_attention_scales(self, path):
        from fp8rl.reference import checkpoint as ck

        def rule(row):
            return ck.expected_attention_scales({0: {x: 1.0 / s for x, s in row.items()}})[0]
        return _attention_scales_with(path, rule)


@mutant("ckpt-loader-kv-scale-on-proj", "the loader takes a layer's k_scale / v_scale for the weight scale of "
        "k_proj / v_proj (AutoFP8's self_attn.k_proj.k_scale naming read by suffix) and multiplies the dequantized "
        "projection by it", kills=("CKPT-LOAD-004",))
class LoaderKvScaleOnProj(ReferenceEngine):
    def checkpoint_load(self, path):
        from fp8rl.reference import checkpoint as ck

        config, tensors = ck.read_checkpoint(path)
        held = _reload_with(path)
        for i, row in ck.attention_scales_in_file(tensors, config["num_hidden_layers"]).items():
            for x in ("k", "v"):
                name = f"model.layers.{i}.self_attn.{x}_proj.weight"
                if x in row and name in held:
                    held[name] = (held[name].double() * row[x]).to(held[name].dtype)
        return held


@mutant("ckpt-kv-no-validation", "the loader takes the stored attention scales as they are: a NaN, zero or "
        "non-scalar scale is installed (its first value), and negative k and v count as absent (1.0, vLLM's -1 "
        "sentinel)", kills=("CKPT-BAD-002",))
class KvNoValidation(ReferenceEngine):
    def checkpoint_attention_scales(self, path):
        from fp8rl.reference import checkpoint as ck

        config, tensors = ck.read_checkpoint(path)
        out = {}
        for i in range(int(config["num_hidden_layers"])):
            row = {}
            for x in ck.ATTENTION_SCALES:
                t = tensors.get(ck.attention_scale_name(i, x))
                if t is not None and not float(t.reshape(-1)[0]) < 0:
                    row[x] = float(t.reshape(-1)[0])
            k, v = row.get("k", 1.0), row.get("v", row.get("k", 1.0))
            out[i] = {"q": row.get("q", k), "k": k, "v": v}
        return out
