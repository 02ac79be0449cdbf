"""Analytic roofline + KV-capacity model of FP8 rollout (no hardware needed).

From an HF ``config.json`` (dense or MoE; GQA; ``head_dim``; tied or untied embeddings) and a hardware spec
(:file:`hardware.json`: HBM bytes and bandwidth, dense BF16/FP8 tensor-core FLOP/s) the model computes, per
precision config:

``bf16``        everything BF16 (the baseline)
``fp8-linear``  W8A8 blockwise linear layers (FP8 weights + fp32 128×128 block scales), BF16 KV cache
``fp8-kv``      BF16 weights, FP8 KV cache used *for storage only* (attention math in BF16)
``fp8-all``     FP8 linear + FP8 KV cache + FP8 attention math (the paper's "full FP8")

* **weight bytes**: the weight-sync rules (docs/paper-numbers.md §1.3, docs/verl-correction.md §3.3) decide what is FP8: q/k/v/o, gate/up/down
  and MoE expert matrices are FP8 (1 byte/element + one fp32 scale per 128×128 block, ceil-div grid); embeddings,
  lm_head, every norm (incl. QK-norm), biases and the MoE router (and Qwen2-MoE's shared-expert gate) stay BF16.
* **KV bytes per token**: ``2 (K,V) · layers · kv_heads · head_dim · bytes`` (2 for BF16, 1 for FP8; the
  per-tensor K/V scales are negligible). With tensor parallelism ``tp`` a GPU holds ``max(1, kv_heads // tp)`` heads.
* **KV capacity**: ``budget − weights`` divided by the KV bytes per token, rounded down to whole vLLM blocks (16
  tokens). The budget (weights + KV per GPU) is either ``hbm_bytes · gpu_memory_utilization − overhead`` or
  *calibrated* from one measured row (:func:`budget_from_kv_tokens`: the budget that reproduces a reported capacity
  for one config). The calibration assumes the non-weight, non-KV memory (activations, CUDA graphs) is the same
  across configs.
* **max concurrency** (vLLM's definition): ``capacity / (prompt_len + gen_len)``, the number of full-length
  requests whose KV fits at once.
* **decode-step lower bound** at decode concurrency ``C`` and mean context ``L``:
  ``t = max(bytes / BW, linear_flops / peak_linear + attention_flops / peak_attention)`` where the bytes are the
  weights read once per step (embeddings: only the gathered rows, ≈0; MoE experts: the expected fraction touched,
  ``1 − (1 − k/E)^C`` under uniform routing), the KV read (``C · L · kv_bytes_per_token``) and written
  (``C · kv_bytes_per_token``); linear FLOPs are ``2 · C · active params`` and attention FLOPs
  ``4 · C · L · heads · head_dim · layers`` (QKᵀ and PV). FP8 peaks apply to the linear layers under ``fp8-linear``
  /``fp8-all`` and to attention under ``fp8-all``.
* **throughput ceiling**: decode-only, at steady state the scheduler keeps ``C = min(max_num_seqs, requests,
  capacity / L)`` sequences alive with ``L = prompt_len + gen_len / 2`` (the mean context over a response's life),
  so the ceiling is ``C / t(C, L)`` tokens/s; its ratio to BF16 at the same workload is the **speedup ceiling**.
  Prefill, sampling, scheduling and preemption (recompute) costs are not modelled; they make real systems slower
  and, in the case of BF16 preemption, can make measured ratios exceed the ceiling a little (see claims.toml:
  ``ceiling_slack``).

Units: bytes, seconds, FLOP, FLOP/s, tokens. Every function is pure; the data files are read once.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "PRECISIONS", "Precision", "ModelSpec", "Hardware", "Workload", "WeightGroup", "ConfigEstimate",
    "load_model_spec", "known_models", "load_hardware", "load_hardware_file", "known_hardware", "match_hardware", "get_precision",
    "weight_bytes", "kv_bytes_per_token", "kv_capacity_tokens", "max_concurrency", "memory_budget",
    "budget_from_kv_tokens", "decode_step", "estimate", "estimate_all", "speedup_ceiling", "gemm_time_lb",
    "gemm_speedup_ceiling", "normalize_model_name",
]

BF16_BYTES = 2
FP8_BYTES = 1
SCALE_BYTES = 4  # fp32 block scale
WEIGHT_BLOCK = 128
GIB = 1 << 30

# ---------------------------------------------------------------------------------------------------------------
# precision configs


@dataclass(frozen=True)
class Precision:
    """A rollout precision config: which parts run in FP8."""

    name: str
    linear_fp8: bool
    kv_fp8: bool
    attention_fp8: bool
    description: str = ""
    #: how quantized weights are stored (a key of WEIGHT_FORMATS) and which weight kinds are quantized
    weight_format: str = "fp8-block128"
    quant_kinds: tuple[str, ...] = ("linear", "expert")

    @property
    def kv_bytes(self) -> int:
        return FP8_BYTES if self.kv_fp8 else BF16_BYTES


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("bf16", False, False, False, "BF16 weights, BF16 KV cache (baseline)"),
    Precision("fp8-linear", True, False, False, "W8A8 blockwise FP8 linear layers; BF16 KV cache"),
    Precision("fp8-kv", False, True, False, "BF16 linear layers; FP8 KV cache for storage only (BF16 attention)"),
    Precision("fp8-all", True, True, True, "FP8 linear + FP8 KV cache + FP8 attention (the paper's full FP8)"),
)}

#: quantized weight storage: element bytes, scale bytes per scale, elements per scale (1×B along K, or a B×B tile
#: for "fp8-block128"), per-tensor bytes (NVFP4's fp32 global scale). Bytes per weight = elem + scale/B (+ tensor).
WEIGHT_FORMATS: dict[str, tuple[float, int, int, int]] = {
    "fp8-block128": (1.0, 4, 128, 0),   # FP8 + fp32 scale per 128×128 tile: 1 + 4/16384 ≈ 1.00024 B/weight
    "mxfp8": (1.0, 1, 32, 0),           # E4M3 + E8M0 per 32: 1 + 1/32 = 1.03125 B/weight
    "mxfp4": (0.5, 1, 32, 0),           # E2M1 (packed) + E8M0 per 32: 0.5 + 1/32 = 0.53125 B/weight
    "nvfp4": (0.5, 1, 16, 4),           # E2M1 (packed) + E4M3 per 16 + fp32 global: 0.5625 B/weight + 4 B/tensor
    "fp8-per-channel": (1.0, 4, 1 << 30, 0),  # FP8 + one fp32 scale per output row (vLLM fp8_per_channel / PTPC)
}

#: weight formats whose GEMMs run at the FP4 tensor-core rate (where hardware.json lists ``fp4_dense_flops``)
FP4_WEIGHT_FORMATS = ("mxfp4", "nvfp4")

#: the microscaling rollout recipes (docs/microscaling.md): not in PRECISIONS (the FP8 tables keep their rows); name
#: them in ``fp8rl perf model --configs``. Compute: MXFP8 at the FP8 dense peak (its rate on Blackwell), MXFP4 and
#: NVFP4 at the FP4 dense peak where the hardware lists one (B200, GB200), else the FP8 peak (a lower-bound ceiling).
#: As for the FP8 rows, every linear FLOP runs at the recipe's rate (the BF16 layers of nvfp4-experts included).
MX_PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("mxfp8", True, False, False, "MXFP8 linear and expert layers (E4M3 + E8M0 per 32); BF16 KV cache",
              weight_format="mxfp8"),
    Precision("mxfp4", True, False, False, "MXFP4 linear and expert layers (E2M1 + E8M0 per 32); BF16 KV cache",
              weight_format="mxfp4"),
    Precision("nvfp4-experts", True, False, False, "NVFP4 MoE experts only (E2M1 + E4M3 per 16 + fp32 global); "
              "attention/dense linears, boundary layers, embeddings and lm_head BF16; BF16 KV cache",
              weight_format="nvfp4", quant_kinds=("expert",)),
)}


#: other FP8 recipes an engine runs (not in PRECISIONS, so the paper's tables keep their rows): vLLM's
#: ``quantization="fp8_per_channel"`` = per-token activations × per-channel weights (PTPC), the W8A8 recipe vLLM's
#: CPU build runs. For the model it is FP8-linear with one fp32 scale per weight row.
VARIANT_PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp8-linear-ptpc", True, False, False, "W8A8 FP8 linear, per-token activation and per-channel weight "
              "scales (vLLM fp8_per_channel); BF16 KV cache", weight_format="fp8-per-channel"),
)}


def weight_format_bytes(fmt: str, rows: int, cols: int) -> float:
    """Bytes of one quantized (rows, cols) weight under ``fmt`` (WEIGHT_FORMATS), scales included."""
    elem, sbytes, block, per_tensor = WEIGHT_FORMATS[fmt]
    if fmt == "fp8-block128":
        nscales = math.ceil(rows / block) * math.ceil(cols / block)
    else:
        nscales = rows * math.ceil(cols / block)
    return math.ceil(rows * cols * elem) + nscales * sbytes + per_tensor


_PRECISION_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "baseline": "bf16",
    "fp8-linear": "fp8-linear", "fp8": "fp8-linear", "fp8-w8a8": "fp8-linear", "w8a8": "fp8-linear",
    "fp8-kv": "fp8-kv", "kv-fp8": "fp8-kv", "fp8-kv-only": "fp8-kv",
    "fp8-all": "fp8-all", "fp8-linear+kv": "fp8-all", "fp8-linear-kv": "fp8-all", "fp8-full": "fp8-all",
}


def get_precision(name: str | Precision) -> Precision:
    """The :class:`Precision` called ``name`` (aliases such as ``fp8``/``fp8-linear+kv`` accepted)."""
    if isinstance(name, Precision):
        return name
    key = str(name).strip().lower().replace("_", "-")
    if key in MX_PRECISIONS:
        return MX_PRECISIONS[key]
    if key in VARIANT_PRECISIONS:
        return VARIANT_PRECISIONS[key]
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"precision: unknown config {name!r}; expected one of {list(PRECISIONS)}")
    return PRECISIONS[_PRECISION_ALIASES[key]]


# ---------------------------------------------------------------------------------------------------------------
# model spec


@dataclass(frozen=True)
class WeightGroup:
    """``count`` tensors of ``shape`` with the same role (e.g. every layer's q_proj)."""

    name: str
    kind: str  # embedding | lm_head | norm | bias | router | linear | expert
    shape: tuple[int, ...]
    count: int

    @property
    def fp8_eligible(self) -> bool:
        """Quantized to FP8 by the weight-sync rules (linear and expert matrices only)."""
        return self.kind in ("linear", "expert")

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.count

    def bytes(self, fp8: bool, fmt: str = "fp8-block128") -> int:
        if fp8 and self.fp8_eligible and fmt != "fp8-block128":
            rows, cols = self.shape
            return int(weight_format_bytes(fmt, rows, cols)) * self.count
        if fp8 and self.fp8_eligible:
            rows, cols = self.shape
            scales = math.ceil(rows / WEIGHT_BLOCK) * math.ceil(cols / WEIGHT_BLOCK)
            return (rows * cols * FP8_BYTES + scales * SCALE_BYTES) * self.count
        return self.numel * BF16_BYTES


@dataclass(frozen=True)
class ModelSpec:
    """The architecture fields of an HF config that the model needs."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    model_type: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str | None = None) -> ModelSpec:
        """Parse an HF config dict (Llama/Qwen2/Qwen3 dense, Qwen2-MoE/Qwen3-MoE/Mixtral MoE spellings)."""
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = cfg["text_config"]

        def req(key: str) -> int:
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"config: missing required field {key!r}")
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"config: {key} must be a positive integer, got {v!r}")
            return v

        hidden = req("hidden_size")
        layers = req("num_hidden_layers")
        heads = req("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        vocab = req("vocab_size")
        model_type = str(cfg.get("model_type", ""))
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        topk = int(cfg.get("num_experts_per_tok") or 0)
        inter = int(cfg.get("intermediate_size") or 0)
        moe_inter = int(cfg.get("moe_intermediate_size") or (inter if experts else 0))
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        moe_layers: tuple[int, ...] = ()
        if experts:
            if topk <= 0 or topk > experts:
                raise ValueError(f"config: num_experts_per_tok must be in 1..{experts}, got {topk}")
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            first_dense = int(cfg.get("first_k_dense_replace") or 0)
            moe_layers = tuple(i for i in range(layers)
                               if i not in dense_only and i >= first_dense and (i + 1) % step == 0)
        if len(moe_layers) < layers and inter <= 0:
            raise ValueError("config: dense layers need intermediate_size > 0")
        if kv_heads > heads or heads % kv_heads:
            raise ValueError(f"config: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                             f"({kv_heads})")
        qk_norm = model_type.startswith("qwen3") or bool(cfg.get("qk_norm") or cfg.get("use_qk_norm"))
        attention_bias = bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe")))
        nm = name or cfg.get("_name_or_path") or model_type or "model"
        return cls(name=str(nm), hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=int(kv_heads),
                   head_dim=int(head_dim), intermediate_size=inter, vocab_size=vocab,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   attention_bias=attention_bias, qk_norm=qk_norm, num_experts=experts if moe_layers else 0,
                   num_experts_per_tok=topk if moe_layers else 0,
                   moe_intermediate_size=moe_inter if moe_layers else 0, shared_expert_intermediate_size=shared,
                   moe_layers=moe_layers, model_type=model_type)

    # -- inventory ---------------------------------------------------------------------------------------------
    def weight_groups(self) -> list[WeightGroup]:
        """Every weight tensor, grouped by role, with the kind that decides its rollout precision."""
        h, hd, nl = self.hidden_size, self.head_dim, self.num_layers
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        n_moe = len(self.moe_layers)
        n_dense = nl - n_moe
        g = [WeightGroup("model.embed_tokens.weight", "embedding", (self.vocab_size, h), 1)]
        if not self.tie_word_embeddings:
            g.append(WeightGroup("lm_head.weight", "lm_head", (self.vocab_size, h), 1))
        g += [
            WeightGroup("layers.*.self_attn.q_proj.weight", "linear", (q_out, h), nl),
            WeightGroup("layers.*.self_attn.k_proj.weight", "linear", (kv_out, h), nl),
            WeightGroup("layers.*.self_attn.v_proj.weight", "linear", (kv_out, h), nl),
            WeightGroup("layers.*.self_attn.o_proj.weight", "linear", (h, q_out), nl),
            WeightGroup("layers.*.input_layernorm.weight", "norm", (h,), nl),
            WeightGroup("layers.*.post_attention_layernorm.weight", "norm", (h,), nl),
            WeightGroup("model.norm.weight", "norm", (h,), 1),
        ]
        if self.attention_bias:
            g += [WeightGroup("layers.*.self_attn.q_proj.bias", "bias", (q_out,), nl),
                  WeightGroup("layers.*.self_attn.k_proj.bias", "bias", (kv_out,), nl),
                  WeightGroup("layers.*.self_attn.v_proj.bias", "bias", (kv_out,), nl)]
        if self.qk_norm:
            g += [WeightGroup("layers.*.self_attn.q_norm.weight", "norm", (hd,), nl),
                  WeightGroup("layers.*.self_attn.k_norm.weight", "norm", (hd,), nl)]
        if n_dense:
            i = self.intermediate_size
            g += [WeightGroup("layers.*.mlp.gate_proj.weight", "linear", (i, h), n_dense),
                  WeightGroup("layers.*.mlp.up_proj.weight", "linear", (i, h), n_dense),
                  WeightGroup("layers.*.mlp.down_proj.weight", "linear", (h, i), n_dense)]
        if n_moe:
            e, mi = self.num_experts, self.moe_intermediate_size
            g += [WeightGroup("layers.*.mlp.gate.weight", "router", (e, h), n_moe),
                  WeightGroup("layers.*.mlp.experts.*.gate_proj.weight", "expert", (mi, h), n_moe * e),
                  WeightGroup("layers.*.mlp.experts.*.up_proj.weight", "expert", (mi, h), n_moe * e),
                  WeightGroup("layers.*.mlp.experts.*.down_proj.weight", "expert", (h, mi), n_moe * e)]
            if self.shared_expert_intermediate_size:
                s = self.shared_expert_intermediate_size
                g += [WeightGroup("layers.*.mlp.shared_expert.gate_proj.weight", "linear", (s, h), n_moe),
                      WeightGroup("layers.*.mlp.shared_expert.up_proj.weight", "linear", (s, h), n_moe),
                      WeightGroup("layers.*.mlp.shared_expert.down_proj.weight", "linear", (h, s), n_moe),
                      WeightGroup("layers.*.mlp.shared_expert_gate.weight", "router", (1, h), n_moe)]
        return g

    def num_params(self) -> int:
        return sum(w.numel for w in self.weight_groups())

    def active_params_per_token(self) -> int:
        """Parameters a token multiplies through (matmul FLOPs = 2 · this): attention, dense MLPs, top-k experts,
        router, lm_head. Embedding lookups and norms do no matmul."""
        total = 0
        for w in self.weight_groups():
            if w.kind in ("embedding", "norm", "bias"):
                continue
            if w.kind == "expert":
                total += math.prod(w.shape) * len(self.moe_layers) * self.num_experts_per_tok
            else:
                total += w.numel
        if self.tie_word_embeddings:
            total += self.vocab_size * self.hidden_size  # the tied embedding is the lm_head matmul
        return total

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        return max(1, self.num_kv_heads // tp)


# ---------------------------------------------------------------------------------------------------------------
# data: models and hardware


def normalize_model_name(name: str) -> str:
    """``Qwen/Qwen3-8B-Base`` → ``qwen3-8b``: lower case, org prefix and -base/-instruct/-fp8 suffixes dropped."""
    n = str(name).strip().lower().replace("_", "-")
    n = n.rstrip("/").split("/")[-1]
    n = re.sub(r"\.json$", "", n)
    changed = True
    while changed:
        changed = False
        for suffix in ("-base", "-instruct", "-chat", "-fp8", "-bf16", "-config"):
            if n.endswith(suffix):
                n, changed = n[: -len(suffix)], True
    return n


def _perf_files():
    return resources.files("fp8rl.perf")


@cache
def _bundled_models() -> dict[str, str]:
    """normalized name → fixture name of every config fp8rl.fixtures ships (published and tiny models)."""
    from fp8rl import fixtures

    return {normalize_model_name(n): n for n in (*fixtures.PUBLISHED_CONFIGS, *fixtures.TINY_MODELS)}


def known_models() -> list[str]:
    return sorted(_bundled_models().values())


def load_model_spec(model: str | Path | dict | ModelSpec, name: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a spec, an HF config dict, a ``config.json`` path, a model directory holding one,
    or a model fp8rl.fixtures ships (``Qwen3-8B``, ``Qwen/Qwen3-30B-A3B-Base``, ``tiny-qwen3``, ...)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return ModelSpec.from_hf_config(model, name=name)
    p = Path(str(model)).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSpec.from_hf_config(json.loads((p / "config.json").read_text()), name=name or p.name)
    if p.is_file():
        nm = name or (p.parent.name if p.name == "config.json" else p.stem)
        return ModelSpec.from_hf_config(json.loads(p.read_text()), name=nm)
    key = normalize_model_name(str(model))
    bundled = _bundled_models()
    if key not in bundled:
        raise ValueError(f"model: {model!r} is neither a config.json/model directory nor a known model "
                         f"({', '.join(known_models())})")
    from fp8rl import fixtures

    return ModelSpec.from_hf_config(fixtures.model_config(bundled[key]), name=name or bundled[key])


@dataclass(frozen=True)
class Hardware:
    name: str
    cls: str
    hbm_bytes: int
    hbm_bandwidth_Bps: float
    bf16_dense_flops: float
    fp8_dense_flops: float
    match: tuple[str, ...] = ()
    source: str = ""
    #: dense FP4 (NVFP4/MXFP4) tensor-core peak, where the datasheet gives one (Blackwell); None elsewhere
    fp4_dense_flops: float | None = None

    def peak(self, fp8: bool, fp4: bool = False) -> float:
        """The dense peak of the linear layers' format: FP4 where asked and listed, else FP8 or BF16."""
        if fp4 and self.fp4_dense_flops:
            return self.fp4_dense_flops
        return self.fp8_dense_flops if fp8 else self.bf16_dense_flops


def _parse_hardware(data: dict) -> dict[str, Hardware]:
    out = {}
    for name, h in data["hardware"].items():
        out[name] = Hardware(name=name, cls=h["class"], hbm_bytes=int(h["hbm_bytes"]),
                             hbm_bandwidth_Bps=float(h["hbm_bandwidth_Bps"]),
                             bf16_dense_flops=float(h["bf16_dense_flops"]), fp8_dense_flops=float(h["fp8_dense_flops"]),
                             match=tuple(h.get("match", ())), source=h.get("source", ""),
                             fp4_dense_flops=float(h["fp4_dense_flops"]) if h.get("fp4_dense_flops") else None)
    return out


@cache
def _hardware_table() -> dict[str, Hardware]:
    return _parse_hardware(json.loads((_perf_files() / "hardware.json").read_text()))


def load_hardware_file(path: str | Path) -> dict[str, Hardware]:
    """The entries of a file in the hardware.json format (e.g. written by ``fp8rl perf hardware --probe``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        if data.get("schema") != "fp8rl.perf.hardware" or not isinstance(data.get("hardware"), dict):
            raise ValueError("not a fp8rl.perf.hardware file")
        table = _parse_hardware(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"hardware: {p} is not a usable hardware.json-format file ({exc})") from None
    if not table:
        raise ValueError(f"hardware: {p} has no entries")
    return table


def known_hardware() -> list[str]:
    return list(_hardware_table())


def load_hardware(name: str | Hardware) -> Hardware:
    """A hardware entry by name (case-insensitive; a device name such as ``NVIDIA H200`` is matched too)."""
    if isinstance(name, Hardware):
        return name
    text = str(name).strip()
    if text.endswith(".json") or os.sep in text:
        # a probed (or hand-written) hardware.json-format file, optionally FILE#ENTRY
        fname, _, entry = text.partition("#")
        if Path(fname).is_file():
            ftable = load_hardware_file(fname)
            if entry:
                if entry not in ftable:
                    raise ValueError(f"hardware: {fname} has no entry {entry!r}; it has {', '.join(ftable)}")
                return ftable[entry]
            if len(ftable) > 1:
                raise ValueError(f"hardware: {fname} has {len(ftable)} entries; name one as FILE#ENTRY "
                                 f"({', '.join(ftable)})")
            return next(iter(ftable.values()))
        if text.endswith(".json"):
            raise ValueError(f"hardware: no such file {fname}")
    table = _hardware_table()
    for key, hw in table.items():
        if key.lower() == str(name).strip().lower():
            return hw
    found = match_hardware(str(name))
    if found is None:
        raise ValueError(f"hardware: unknown {name!r}; known: {', '.join(table)}")
    return found


def match_hardware(device_name: str | None) -> Hardware | None:
    """The entry whose ``match`` patterns occur in a device name (``torch.cuda.get_device_name``), or None."""
    if not device_name:
        return None
    dn = device_name.lower()
    best: tuple[int, Hardware] | None = None
    for hw in _hardware_table().values():
        for pat in hw.match:
            if pat.lower() in dn and (best is None or len(pat) > best[0]):
                best = (len(pat), hw)
    return best[1] if best else None


# ---------------------------------------------------------------------------------------------------------------
# memory


def weight_bytes(spec: ModelSpec, precision: str | Precision, tp: int = 1) -> dict[str, int]:
    """Weight bytes per GPU: ``total``, ``fp8`` (FP8 elements), ``scales`` (fp32 block scales), ``bf16`` (the rest).

    With ``tp`` > 1 every matrix and the (vocab-parallel) embedding/lm_head are split evenly; norms are replicated.
    """
    p = get_precision(precision)
    fp8 = scales = bf16 = 0
    for w in spec.weight_groups():
        if p.linear_fp8 and w.fp8_eligible and w.kind in p.quant_kinds and p.weight_format != "fp8-block128":
            elem = w.count * math.ceil(w.shape[0] * w.shape[1] * WEIGHT_FORMATS[p.weight_format][0])
            fp8 += elem  # quantized element bytes (FP8 or packed FP4)
            scales += w.bytes(True, p.weight_format) - elem
            continue
        if p.linear_fp8 and w.fp8_eligible and w.kind in p.quant_kinds:
            rows, cols = w.shape
            fp8 += rows * cols * w.count
            scales += math.ceil(rows / WEIGHT_BLOCK) * math.ceil(cols / WEIGHT_BLOCK) * w.count * SCALE_BYTES
        else:
            bf16 += w.numel * BF16_BYTES
    if tp > 1:
        norms = sum(w.numel * BF16_BYTES for w in spec.weight_groups() if w.kind == "norm")
        fp8, scales = math.ceil(fp8 / tp), math.ceil(scales / tp)
        bf16 = math.ceil((bf16 - norms) / tp) + norms
    return {"total": fp8 + scales + bf16, "fp8": fp8, "scales": scales, "bf16": bf16}


def kv_bytes_per_token(spec: ModelSpec, precision: str | Precision, tp: int = 1) -> int:
    """K and V bytes one token occupies in one GPU's cache (all layers)."""
    p = get_precision(precision)
    return 2 * spec.num_layers * spec.kv_heads_per_gpu(tp) * spec.head_dim * p.kv_bytes


def budget_from_kv_tokens(spec: ModelSpec, precision: str | Precision, kv_tokens: int, tp: int = 1) -> int:
    """Calibrate: the per-GPU memory budget (weights + KV) under which ``precision`` has ``kv_tokens`` of KV."""
    return weight_bytes(spec, precision, tp)["total"] + int(kv_tokens) * kv_bytes_per_token(spec, precision, tp)


def memory_budget(hw: Hardware, gpu_memory_utilization: float = 0.9, overhead_bytes: int = 2 * GIB) -> int:
    """Per-GPU budget for weights + KV: ``hbm · utilization − overhead`` (activations, CUDA graphs, NCCL...)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return int(hw.hbm_bytes * gpu_memory_utilization) - int(overhead_bytes)


def kv_capacity_tokens(spec: ModelSpec, precision: str | Precision, budget_bytes: int, tp: int = 1,
                       block_size: int = 16) -> int:
    """Tokens of KV cache that fit next to the weights in ``budget_bytes`` (whole blocks; 0 if none fit)."""
    free = budget_bytes - weight_bytes(spec, precision, tp)["total"]
    per_block = kv_bytes_per_token(spec, precision, tp) * block_size
    return max(0, free // per_block) * block_size


def max_concurrency(capacity_tokens: int, prompt_len: int, gen_len: int) -> float:
    """vLLM's "maximum concurrency": full-length requests (prompt + response) whose KV fits at once."""
    return capacity_tokens / (prompt_len + gen_len)


# ---------------------------------------------------------------------------------------------------------------
# time


@dataclass(frozen=True)
class Workload:
    """A rollout workload and the engine settings that matter to the model."""

    prompt_len: int = 1024
    gen_len: int = 1024
    max_num_seqs: int = 256
    num_requests: int | None = None
    gpu_memory_utilization: float = 0.9
    overhead_bytes: int = 2 * GIB
    tp: int = 1
    block_size: int = 16
    #: calibrate the budget from a measured capacity instead: (precision, kv_tokens)
    calibration: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        for f in ("prompt_len", "gen_len", "max_num_seqs", "tp", "block_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if f == "prompt_len" else 1):
                raise ValueError(f"workload: {f} must be a positive integer, got {v!r}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"workload: num_requests must be ≥ 1, got {self.num_requests}")

    @property
    def mean_context(self) -> float:
        """Mean context length of a live sequence during decode (prompt + half the response)."""
        return self.prompt_len + (self.gen_len + 1) / 2

    def with_(self, **kw) -> Workload:
        return replace(self, **kw)


def decode_step(spec: ModelSpec, hw: Hardware, precision: str | Precision, concurrency: float, context: float,
                tp: int = 1) -> dict[str, Any]:
    """Lower bound of one decode step's time for ``concurrency`` sequences at mean ``context`` tokens."""
    p = get_precision(precision)
    c = max(float(concurrency), 0.0)
    expert_frac = 0.0
    if spec.is_moe:
        expert_frac = 1.0 - (1.0 - spec.num_experts_per_tok / spec.num_experts) ** c
    wbytes = 0.0
    for w in spec.weight_groups():
        if w.kind == "embedding" and not spec.tie_word_embeddings:
            wbytes += c * w.shape[1] * BF16_BYTES  # gathered rows only
            continue
        b = w.bytes(p.linear_fp8 and w.kind in p.quant_kinds, p.weight_format)
        wbytes += b * (expert_frac if w.kind == "expert" else 1.0)
    wbytes /= tp
    kvb = kv_bytes_per_token(spec, p, tp)
    kv_read = c * context * kvb
    kv_write = c * kvb
    total_bytes = wbytes + kv_read + kv_write
    lin_flops = 2.0 * c * spec.active_params_per_token() / tp
    attn_flops = 4.0 * c * context * spec.num_heads * spec.head_dim * spec.num_layers / tp
    t_mem = total_bytes / hw.hbm_bandwidth_Bps
    t_cmp = lin_flops / hw.peak(p.linear_fp8, p.weight_format in FP4_WEIGHT_FORMATS) + \
        attn_flops / hw.peak(p.attention_fp8)
    return {"time_s": max(t_mem, t_cmp), "memory_time_s": t_mem, "compute_time_s": t_cmp,
            "bound": "memory" if t_mem >= t_cmp else "compute", "weight_bytes_read": wbytes,
            "kv_bytes_read": kv_read, "bytes": total_bytes, "linear_flops": lin_flops, "attention_flops": attn_flops}


@dataclass
class ConfigEstimate:
    """Everything the model says about one precision config at one workload."""

    precision: str
    weight_bytes: int
    weight_breakdown: dict[str, int]
    kv_bytes_per_token: int
    budget_bytes: int
    kv_budget_bytes: int
    kv_capacity_tokens: int
    max_concurrency: float
    decode_concurrency: float
    step: dict[str, Any]
    throughput_tok_s: float
    ratio_vs_bf16: float = float("nan")
    fits: bool = True
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _budget(spec: ModelSpec, hw: Hardware, wl: Workload) -> int:
    if wl.calibration is not None:
        prec, tokens = wl.calibration
        return budget_from_kv_tokens(spec, prec, tokens, wl.tp)
    return memory_budget(hw, wl.gpu_memory_utilization, wl.overhead_bytes)


def estimate(spec: ModelSpec, hw: Hardware, precision: str | Precision, wl: Workload) -> ConfigEstimate:
    """The model's numbers for one config (``ratio_vs_bf16`` is filled by :func:`estimate_all`)."""
    p = get_precision(precision)
    budget = _budget(spec, hw, wl)
    wb = weight_bytes(spec, p, wl.tp)
    kvb = kv_bytes_per_token(spec, p, wl.tp)
    cap = kv_capacity_tokens(spec, p, budget, wl.tp, wl.block_size)
    notes = []
    c = cap / wl.mean_context
    c = min(c, float(wl.max_num_seqs))
    if wl.num_requests is not None:
        c = min(c, float(wl.num_requests))
    fits = cap >= wl.prompt_len + wl.gen_len
    if not fits:
        notes.append(f"one full-length request ({wl.prompt_len + wl.gen_len} tokens) does not fit in the KV "
                     f"cache ({cap} tokens)")
    step = decode_step(spec, hw, p, c, wl.mean_context, wl.tp)
    tput = c / step["time_s"] if step["time_s"] > 0 else 0.0
    return ConfigEstimate(precision=p.name, weight_bytes=wb["total"], weight_breakdown=wb, kv_bytes_per_token=kvb,
                          budget_bytes=budget, kv_budget_bytes=budget - wb["total"], kv_capacity_tokens=cap,
                          max_concurrency=max_concurrency(cap, wl.prompt_len, wl.gen_len), decode_concurrency=c,
                          step=step, throughput_tok_s=tput, fits=fits, notes=notes)


def estimate_all(spec: ModelSpec, hw: Hardware, wl: Workload,
                 precisions: tuple[str, ...] | list[str] = tuple(PRECISIONS)) -> dict[str, ConfigEstimate]:
    """:func:`estimate` for every config, with ``ratio_vs_bf16`` (throughput ceiling relative to BF16)."""
    base = estimate(spec, hw, "bf16", wl)
    out = {}
    for name in precisions:
        e = base if get_precision(name).name == "bf16" else estimate(spec, hw, name, wl)
        e.ratio_vs_bf16 = e.throughput_tok_s / base.throughput_tok_s if base.throughput_tok_s > 0 else float("inf")
        out[e.precision] = e
    return out


def speedup_ceiling(spec: ModelSpec, hw: Hardware, precision: str | Precision, wl: Workload,
                    baseline: str | Precision = "bf16") -> float:
    """The model's throughput ceiling of ``precision`` over ``baseline`` at workload ``wl``."""
    a = estimate(spec, hw, baseline, wl).throughput_tok_s
    b = estimate(spec, hw, precision, wl).throughput_tok_s
    return b / a if a > 0 else float("inf")


# ---------------------------------------------------------------------------------------------------------------
# GEMM roofline (for the GPU GEMM check)


def gemm_time_lb(m: int, n: int, k: int, hw: Hardware, fp8: bool, out_bytes: int = BF16_BYTES,
                 scale_bytes: int = 0) -> float:
    """Lower bound of y(M,N) = x(M,K) · W(N,K)ᵀ: max(bytes/BW, 2MNK/peak)."""
    in_bytes = FP8_BYTES if fp8 else BF16_BYTES
    nbytes = (m * k + n * k) * in_bytes + m * n * out_bytes + scale_bytes
    return max(nbytes / hw.hbm_bandwidth_Bps, 2.0 * m * n * k / hw.peak(fp8))


def gemm_speedup_ceiling(m: int, n: int, k: int, hw: Hardware, scaling: str = "row") -> float:
    """Roofline ceiling of an FP8 GEMM's speedup over BF16 (scales: row-wise (M+N)·4 B, block-wise per 1×128 /
    128×128 tile)."""
    if scaling == "row":
        sb = (m + n) * SCALE_BYTES
    elif scaling == "block":
        sb = (m * math.ceil(k / 128) + math.ceil(n / 128) * math.ceil(k / 128)) * SCALE_BYTES
    elif scaling == "tensor":
        sb = 2 * SCALE_BYTES
    else:
        raise ValueError(f"scaling: expected row, block or tensor, got {scaling!r}")
    return gemm_time_lb(m, n, k, hw, False) / gemm_time_lb(m, n, k, hw, True, scale_bytes=sb)
