"""Weight sync: the BF16 trainer weights → the blockwise-FP8 tensors a rollout engine loads (docs/paper-numbers.md §1.3–1.4).

Every RL step the trainer streams its BF16 weights as ``(name, tensor)`` with HF *checkpoint* names; each eligible
weight is quantized on the fly with 128×128 blocks and the engine receives ``(name, fp8)`` plus
``(name + "_scale_inv", fp32)`` — the DeepSeek-V3 / vLLM ``weight_block_size`` checkpoint convention, where
``*_weight_scale_inv`` is the **dequant multiplier** (W ≈ fp8 · scale, broadcast over 128×128 tiles) of shape
(⌈N/128⌉, ⌈K/128⌉) for an (N, K) weight.

What is quantized (docs/paper-numbers.md §1.3, verl ``FP8QuantizerHelper``, vLLM ``is_fp8_weight``): 2-D ``.weight`` tensors of the
attention projections ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (DeepSeek's MLA: ``q_a_proj``/``q_b_proj``/
``kv_a_proj_with_mqa``/``kv_b_proj``/``o_proj``, as in DeepSeek-V3's own FP8 checkpoint), the MLP
``gate_proj``/``up_proj``/``down_proj`` and the same projections of every MoE expert (``mlp.experts.<e>.*``) and of
a shared expert (``mlp.shared_expert.*`` Qwen2-MoE, ``mlp.shared_experts.*`` DeepSeek). Experts packed into 3-D
tensors (transformers 5's in-memory layout ``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj``
(E, H, I)) are quantized expert by expert: codes of the tensor's shape and scales (E, ⌈N/128⌉, ⌈K/128⌉), each
expert's slice exactly the 2-D quantization of that expert's weight (vLLM's ``w13_weight_scale_inv`` layout). What
stays BF16 by default: the embeddings, ``lm_head``, every norm (RMSNorm, QK-norm, MLA's ``q_a_layernorm``/
``kv_a_layernorm``), every bias (1-D; DeepSeek's router ``e_score_correction_bias`` too), the MoE router
``mlp.gate`` (verl #5107; the paper's router ablation shows the largest mismatch when the router is quantized), the
shared-expert gate ``mlp.shared_expert_gate`` (a 1 × hidden sigmoid gate: a router-like scalar per token) and a
multimodal model's vision tower ``visual.*`` (the FP8 rollout recipe covers the language model's linear layers; the
vision encoder runs once per image and its merger feeds the language model directly: llm-compressor's FP8 recipes
for VL models ignore ``re:.*visual.*``). Patterns are regular expressions matched with ``re.search`` against the
parameter name; ``exclude`` wins over ``include``.

The quantizer is the oracle's :func:`fp8rl.reference.quant.quantize` with ``Granularity.block(128)`` under a
:class:`~fp8rl.reference.policy.ScalePolicy` (verl's Triton path is the ``verl_triton`` preset of
:data:`fp8rl.reference.presets.PRESETS`, its PyTorch path ``verl_torch``). Weights are cast to BF16 first, as verl casts to the engine dtype before quantizing: the trainer's fp32 master
weights sync exactly like their BF16 cast.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor, quantize

__all__ = [
    "DEFAULT_EXCLUDE", "DEFAULT_INCLUDE", "FP8_TORCH_DTYPES", "SCALE_SUFFIX", "WeightSyncRecipe",
    "KV_CACHE_SCALE", "PACKED_EXPERTS", "dequantize_state_dict", "expert_key", "ignored_layers", "is_kv_cache_scale",
    "is_packed_experts", "is_quantized_name",
    "load_hf_checkpoint", "quantization_config", "quantize_state_dict", "quantized_names", "scale_name",
    "source_tensor", "synced_tensors", "write_hf_checkpoint",
]

#: suffix of the fp32 dequant scale stored next to each FP8 weight (``q_proj.weight`` → ``q_proj.weight_scale_inv``)
SCALE_SUFFIX = "_scale_inv"
#: the 3-D packed expert tensors (E, N, K) quantized expert by expert (transformers 5's fused MoE layout)
PACKED_EXPERTS = r"\.experts\.(gate_up_proj|down_proj)$"
#: names whose 2-D ``.weight`` is quantized: attention (GQA and MLA) and MLP projections, dense, per expert, or the
#: 3-D packed experts (:data:`PACKED_EXPERTS`)
DEFAULT_INCLUDE: tuple[str, ...] = (
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$",
    r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$",
    PACKED_EXPERTS,
)
#: names that stay BF16 whatever ``include`` says: embeddings, lm_head, every norm, the MoE router (and a shared-
#: expert gate, which the name-based SGLang filter would otherwise catch through its broad "mlp" include)
DEFAULT_EXCLUDE: tuple[str, ...] = (
    r"(^|\.)embed_tokens\.",
    r"(^|\.)lm_head\.",
    r"norm\.weight$",
    r"(^|\.)mlp\.gate\.weight$",
    r"(^|\.)shared_expert_gate\.",
    r"(^|\.)visual\.",
)
#: element format → torch dtype of the stored FP8 weights
FP8_TORCH_DTYPES: dict[str, torch.dtype] = {
    "e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz, "e5m2fnuz": torch.float8_e5m2fnuz,
}
_CHECKPOINT_FMT = {"e4m3fn": "e4m3", "e5m2": "e5m2", "e4m3fnuz": "e4m3", "e5m2fnuz": "e5m2"}


@dataclass(frozen=True)
class WeightSyncRecipe:
    """How weights are quantized for the rollout engine.

    ``block``: (Bn, Bk) weight tile (128×128); ``policy``: the ScalePolicy of the block quantizer (name or object);
    ``include``/``exclude``: regexes over parameter names (see the module docstring); ``cast_dtype``: the dtype the
    weights are cast to before quantization (the engine dtype, BF16).
    """

    name: str = "fp8-block128"
    block: tuple[int, int] = (128, 128)
    policy: ScalePolicy | str = "reference"
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    cast_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", get_policy(self.policy))
        if len(self.block) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block):
            raise ValueError(f"block: expected two positive ints, got {self.block!r}")
        object.__setattr__(self, "block", (int(self.block[0]), int(self.block[1])))
        for what in ("include", "exclude"):
            pats = tuple(getattr(self, what))
            for p in pats:
                try:
                    re.compile(p)
                except re.error as exc:
                    raise ValueError(f"{what}: invalid regex {p!r}: {exc}") from None
            object.__setattr__(self, what, pats)
        fmt = get_policy(self.policy).fmt
        if fmt not in FP8_TORCH_DTYPES:  # pragma: no cover - ScalePolicy validates fmt
            raise ValueError(f"policy: unsupported format {fmt!r}")

    @property
    def granularity(self) -> Granularity:
        return Granularity.block(self.block)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return FP8_TORCH_DTYPES[get_policy(self.policy).fmt]

    def with_(self, **changes: Any) -> WeightSyncRecipe:
        from dataclasses import replace

        return replace(self, **changes)


def _recipe(recipe: WeightSyncRecipe | None, exclude: Iterable[str] | None, include: Iterable[str] | None,
            policy: ScalePolicy | str | None) -> WeightSyncRecipe:
    r = recipe if recipe is not None else WeightSyncRecipe()
    if not isinstance(r, WeightSyncRecipe):
        raise TypeError(f"recipe: expected a WeightSyncRecipe or None, got {type(r).__name__}")
    changes: dict[str, Any] = {}
    if exclude is not None:
        changes["exclude"] = tuple([exclude] if isinstance(exclude, str) else exclude)
    if include is not None:
        changes["include"] = tuple([include] if isinstance(include, str) else include)
    if policy is not None:
        changes["policy"] = policy
    return r.with_(**changes) if changes else r


def scale_name(name: str) -> str:
    """``...q_proj.weight`` → ``...q_proj.weight_scale_inv``."""
    return name + SCALE_SUFFIX


#: an attention layer's FP8 KV-cache scales in a weight stream (vLLM's checkpoint names, mapped by its loaders to the
#: layer's ``attn.k_scale`` / ``attn.v_scale``): fp32 scalars, dequant scales (stored K = fp8(k / k_scale))
KV_CACHE_SCALE = r"\.self_attn\.(k|v)_scale$"


def is_kv_cache_scale(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """A per-layer FP8 KV-cache scale (:data:`KV_CACHE_SCALE`, 0-d): synced in fp32 as given, never cast to BF16."""
    return len(tuple(shape)) == 0 and re.search(KV_CACHE_SCALE, name) is not None


def is_packed_experts(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """A 3-D packed expert tensor (E, N, K) (:data:`PACKED_EXPERTS`)."""
    return len(tuple(shape)) == 3 and re.search(PACKED_EXPERTS, name) is not None


def is_quantized_name(name: str, shape: tuple[int, ...] | torch.Size, recipe: WeightSyncRecipe | None = None) -> bool:
    """Whether weight sync quantizes this parameter: 2-D (or 3-D packed experts), matches ``include`` and no
    ``exclude`` pattern."""
    r = recipe or WeightSyncRecipe()
    if len(tuple(shape)) != 2 and not is_packed_experts(name, shape):
        return False
    if any(re.search(p, name) for p in r.exclude):
        return False
    return any(re.search(p, name) for p in r.include)


def quantized_names(state_dict: Mapping[str, torch.Tensor], recipe: WeightSyncRecipe | None = None) -> list[str]:
    """The names :func:`quantize_state_dict` quantizes, in input order."""
    return [n for n, t in state_dict.items() if is_quantized_name(n, tuple(t.shape), recipe)]


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], recipe: WeightSyncRecipe | None = None, *,
                        exclude: Iterable[str] | None = None, include: Iterable[str] | None = None,
                        policy: ScalePolicy | str | None = None,
                        quantize_fn: Callable[[torch.Tensor, Granularity], QuantizedTensor] | None = None,
                        ) -> dict[str, torch.Tensor]:
    """The tensors weight sync ships: FP8 codes + ``*_weight_scale_inv`` for eligible weights, the rest as given.

    * ``state_dict``: checkpoint-named tensors in any float dtype — BF16 weights, or the trainer's fp32 master
      weights: every floating tensor is cast to ``recipe.cast_dtype`` (BF16) first, the quantized ones before
      quantizing, so an fp32 state dict syncs bit for bit like its BF16 cast.
    * ``recipe``: :class:`WeightSyncRecipe` (default: 128×128 blocks, the ``reference`` policy, default filters);
      ``exclude``/``include``/``policy`` override its fields.
    * ``quantize_fn(x, granularity) → QuantizedTensor``: the block quantizer (default: the oracle under
      ``recipe.policy``); engines pass their own to reuse the rest of the pipeline.

    Returns a new dict in input order: ``name`` → FP8 tensor (``torch.float8_e4m3fn`` for e4m3fn) of the weight's
    shape and ``name + "_scale_inv"`` → fp32 (⌈N/Bn⌉, ⌈K/Bk⌉), right after it; a per-layer FP8 KV-cache scale
    (:func:`is_kv_cache_scale`) in fp32; every other tensor in ``recipe.cast_dtype`` (the input tensor itself, not a
    copy, when it already has that dtype).
    """
    r = _recipe(recipe, exclude, include, policy)
    g = r.granularity
    qfn = quantize_fn or (lambda x, gran: quantize(x, gran, r.policy))
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if is_kv_cache_scale(name, tuple(t.shape)):
            out[name] = t.to(torch.float32)  # a KV-cache scale stays fp32 (a BF16 scale would move every K/V code)
            continue
        if not is_quantized_name(name, tuple(t.shape), r):
            out[name] = t.to(r.cast_dtype) if t.is_floating_point() and t.dtype != r.cast_dtype else t
            continue
        x = t.detach().to("cpu", r.cast_dtype)
        qts = [qfn(xe, g) for xe in x] if x.dim() == 3 else [qfn(x, g)]  # packed experts: expert by expert
        for qt in qts:
            if not isinstance(qt, QuantizedTensor):
                raise TypeError(f"quantize_fn returned {type(qt).__name__} for {name!r}, expected QuantizedTensor")
        codes = [qt.codes.contiguous().view(FP8_TORCH_DTYPES[qt.fmt]) for qt in qts]
        scales = [qt.scale.to(torch.float32).contiguous() for qt in qts]
        out[name] = torch.stack(codes) if x.dim() == 3 else codes[0]
        out[scale_name(name)] = torch.stack(scales) if x.dim() == 3 else scales[0]
    return out


def expert_key(name: str, expert: int) -> str:
    """The key :func:`synced_tensors` gives expert ``expert``'s slice of a packed tensor: ``name[expert]``."""
    return f"{name}[{expert}]"


def source_tensor(state_dict: Mapping[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """The BF16 weight behind a :func:`synced_tensors` key (a packed expert slice ``name[e]`` → ``state_dict[name][e]``),
    None if the state dict has no such tensor."""
    m = re.fullmatch(r"(?P<name>.*)\[(?P<e>\d+)\]", key)
    if m and m["name"] in state_dict:
        return state_dict[m["name"]][int(m["e"])]
    return state_dict.get(key)


def synced_tensors(synced: Mapping[str, torch.Tensor], block: tuple[int, int] = (128, 128),
                   policy: ScalePolicy | str = "reference") -> dict[str, QuantizedTensor]:
    """The FP8 weights of a synced state dict as QuantizedTensors (``policy`` is only a label here).

    A weight counts as quantized when ``name + "_scale_inv"`` is present; its dtype must be one of the FP8 dtypes
    and the scale fp32 of the ceil-div shape (ValueError otherwise). A 3-D packed expert tensor gives one entry per
    expert, keyed :func:`expert_key` (``name[e]``), whose scales are the matching slice of the 3-D scale tensor.
    """
    policy = get_policy(policy)
    g = Granularity.block(block)
    out: dict[str, QuantizedTensor] = {}
    fmts = {v: k for k, v in FP8_TORCH_DTYPES.items()}
    for name, t in synced.items():
        sname = scale_name(name)
        if sname not in synced:
            continue
        if t.dtype not in fmts:
            raise ValueError(f"{name}: has {sname} but dtype {t.dtype} is not an FP8 dtype")
        s = synced[sname]
        if s.dtype != torch.float32:
            raise ValueError(f"{sname}: expected float32, got {s.dtype}")
        codes = t.detach().cpu().contiguous().view(torch.uint8)
        pol = policy.for_format(fmts[t.dtype])
        if codes.dim() == 3:
            if s.dim() != 3 or s.shape[0] != codes.shape[0]:
                raise ValueError(f"{sname}: expected ({codes.shape[0]}, ...) scales for the packed {name} "
                                 f"{tuple(codes.shape)}, got {tuple(s.shape)}")
            for e in range(codes.shape[0]):
                out[expert_key(name, e)] = QuantizedTensor(codes[e], s[e].detach().cpu().contiguous(), g, pol)
            continue
        out[name] = QuantizedTensor(codes, s.detach().cpu().contiguous(), g, pol)
    return out


def dequantize_state_dict(synced: Mapping[str, torch.Tensor], block: tuple[int, int] = (128, 128),
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Inverse of :func:`quantize_state_dict`: every (FP8, ``*_scale_inv``) pair → fp8·scale in ``dtype``
    (exact in fp64, rounded once), scale entries dropped, everything else unchanged."""
    qts = synced_tensors(synced, block)
    drop = {scale_name(n) for n in synced if scale_name(n) in synced}
    out: dict[str, torch.Tensor] = {}
    for name, t in synced.items():
        if name in drop:
            continue
        if name in qts:
            out[name] = qts[name].dequantize(torch.float64).to(dtype)
        elif expert_key(name, 0) in qts:
            out[name] = torch.stack([qts[expert_key(name, e)].dequantize(torch.float64).to(dtype)
                                     for e in range(t.shape[0])])
        else:
            out[name] = t
    return out


# ----------------------------------------------------------------------------------------------------------------
# HF checkpoint writer / loader


def ignored_layers(state_dict: Mapping[str, torch.Tensor], recipe: WeightSyncRecipe | None = None) -> list[str]:
    """Module names of 2-D linear-like weights that weight sync keeps in BF16 although an engine building FP8 layers
    from the config could quantize them: the MoE routers (verl passes ``model.layers.<i>.mlp.gate`` as
    ``ignored_layers``) and the shared-expert gates (``mlp.shared_expert_gate``, Qwen2-MoE). Embeddings and lm_head
    are never FP8 layers in vLLM/SGLang, norms are not linear."""
    r = recipe or WeightSyncRecipe()
    out = []
    for name, t in state_dict.items():
        if t.dim() == 2 and name.endswith(".weight") and \
                re.search(r"(^|\.)mlp\.(gate|shared_expert_gate)\.weight$", name) and \
                not is_quantized_name(name, tuple(t.shape), r):
            out.append(name[: -len(".weight")])
    return out


def quantization_config(recipe: WeightSyncRecipe | None = None, ignored: list[str] | None = None) -> dict[str, Any]:
    """The HF ``quantization_config`` of a blockwise-FP8 checkpoint: ``{quant_method: fp8, fmt: e4m3,
    activation_scheme: dynamic, weight_block_size: [128, 128]}`` (+ ``ignored_layers`` when given), the dict verl
    injects into vLLM/SGLang (docs/paper-numbers.md §1.1)."""
    r = recipe or WeightSyncRecipe()
    cfg: dict[str, Any] = {"quant_method": "fp8", "fmt": _CHECKPOINT_FMT[get_policy(r.policy).fmt],
                           "activation_scheme": "dynamic", "weight_block_size": list(r.block)}
    if ignored:
        cfg["ignored_layers"] = list(ignored)
    return cfg


def write_hf_checkpoint(out_dir: str | Path, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], *,
                        recipe: WeightSyncRecipe | None = None, fp8: bool = True,
                        tokenizer_dir: str | Path | None = None) -> Path:
    """Write an HF checkpoint directory: ``config.json`` + ``model.safetensors`` (+ tokenizer files).

    With ``fp8`` (default) the weights go through :func:`quantize_state_dict` (``recipe``) and the config gets
    ``quantization_config`` (:func:`quantization_config`, with the routers as ``ignored_layers``) and
    ``torch_dtype: bfloat16``; with ``fp8=False`` a plain BF16 checkpoint. Returns the directory.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "bfloat16"
    if fp8:
        r = recipe or WeightSyncRecipe()
        tensors = quantize_state_dict(state_dict, r)
        cfg["quantization_config"] = quantization_config(r, ignored_layers(state_dict, r))
    else:
        tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_dict.items()}
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and (f.name.startswith("tokenizer") or f.name == "special_tokens_map.json"):
                (out / f.name).write_bytes(f.read_bytes())
    return out


def load_hf_checkpoint(path: str | Path, *, dequantize: bool = True, dtype: torch.dtype = torch.bfloat16,
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read an HF checkpoint directory → (config, state dict).

    With ``dequantize`` (default) and a ``quant_method: fp8`` config, every FP8 weight with a ``*_scale_inv`` (or
    ``*_scale``, vLLM ≥ 0.11's dense naming — also a dequant multiplier) is dequantized with the config's
    ``weight_block_size`` into ``dtype`` and the scales are dropped, giving back a BF16 state dict; otherwise the
    tensors are returned as stored.
    """
    from safetensors.torch import load_file

    p = Path(path)
    config = json.loads((p / "config.json").read_text())
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors file")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    qc = config.get("quantization_config") or {}
    if not dequantize or qc.get("quant_method") != "fp8":
        return config, sd
    block = tuple(int(b) for b in qc.get("weight_block_size") or (128, 128))
    renamed = {}
    for k, v in sd.items():
        if k.endswith(".weight_scale") and k[: -len("_scale")] in sd and scale_name(k[: -len("_scale")]) not in sd:
            renamed[scale_name(k[: -len("_scale")])] = v
        else:
            renamed[k] = v
    return config, dequantize_state_dict(renamed, block, dtype)  # type: ignore[arg-type]
