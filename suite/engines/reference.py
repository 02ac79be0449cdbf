"""The oracle as an engine.

``ReferenceEngine`` answers every op with :mod:`fp8rl.reference`. It is also the base class for the
"bring your kernel" path: subclass it, override the op you have a kernel for, and declare the policy your kernel
implements; every other op keeps the oracle's answer::

    class MyEngine(ReferenceEngine):
        name = "my-engine"
        def scale_policy(self, kind):
            return get_policy("vllm_cuda_group") if kind == "group" else super().scale_policy(kind)
        def quantize(self, x, granularity):
            if granularity.kind != "group":
                return super().quantize(x, granularity)
            codes, scale = my_kernel(x, granularity.size[1])
            return QuantizedTensor(codes, scale, granularity, self.scale_policy("group"))
"""

from __future__ import annotations

import fp8rl
import torch
from fp8rl import capabilities
from fp8rl.engine import ELEMENT_FORMATS, QUANT_KINDS, CapabilityMap, Engine
from fp8rl.reference import formats
from fp8rl.reference.gemm import block_gemm_exact
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor, quantize


class ReferenceEngine(Engine):
    """The oracle (plain PyTorch/numpy, fp32/fp64 math) exposed through the engine protocol."""

    name = "reference"
    description = "fp8rl's own oracle (bit-level casts, explicit ScalePolicy quantizers, exact fp64 block GEMM)"

    #: overflow policy of cast() per format (the CUDA SATFINITE convention for every format)
    CAST_OVERFLOW: dict[str, formats.OverflowPolicy] = {f: "saturate" for f in ELEMENT_FORMATS}

    def __init__(self, policies: dict[str, str | ScalePolicy] | None = None) -> None:
        base: dict[str, str | ScalePolicy] = {k: "reference" for k in QUANT_KINDS}
        if policies:
            unknown = set(policies) - set(QUANT_KINDS)
            if unknown:
                raise ValueError(f"policies: unknown granularity kinds {sorted(unknown)}; expected {QUANT_KINDS}")
            base.update(policies)
        self._policies = {k: get_policy(v) for k, v in base.items()}

    def version(self) -> str:
        return f"fp8rl {fp8rl.__version__}"

    def capabilities(self) -> CapabilityMap:
        """Every capability of the table; rollouts need transformers (the reason otherwise)."""
        caps: CapabilityMap = {}
        for area in ("formats", "quantization", "gemm", "kv", "correction", "weight_sync", "checkpoint"):
            caps.update(capabilities.all_of(area))
        caps.update(self._caps_e2e())
        caps["checkpoint.score"] = caps["rollout"]  # a transformers model of the checkpoint, as the rollouts
        return caps

    def cast_overflow(self, fmt: str) -> formats.OverflowPolicy:
        return self.CAST_OVERFLOW[formats.get_format(fmt).name]

    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind not in self._policies:
            raise ValueError(f"kind: expected one of {QUANT_KINDS}, got {kind!r}")
        return self._policies[kind]

    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        return formats.encode(x, fmt, self.cast_overflow(fmt)).reshape(x.shape)

    def round_bf16(self, x: torch.Tensor) -> torch.Tensor:
        bits = formats.bf16_bits_rne(x).astype("int16")
        return torch.from_numpy(bits).view(torch.bfloat16).reshape(x.shape)

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        return quantize(x, granularity, self.scale_policy(granularity.kind))

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        return block_gemm_exact(a, w).to(out_dtype)

    # -- area kv ---------------------------------------------------------------------------------------------------
    # The oracle's FP8 KV cache (fp8rl.reference.kv): vLLM-CUDA numerics (x/s, saturating, RNE) for static
    # layouts, vLLM fp8_per_token_head (x·(1/s), clamp, floor 1e-6) for "token_head"; Q quantized x·(1/s).
    # Model-level state: per layer, the pushed KVScales, or None = "recalibrate engine-side (strategy A) on the
    # next kv_forward"; a layer never given scales raises MissingKVScales instead of using 1.0.
    def kv_policy(self, fmt: str, layout: str):
        from fp8rl.reference import kv as kvref

        return kvref.default_policy(fmt, layout)

    def kv_store(self, x, scale, *, fmt, layout):
        from fp8rl.reference import kv as kvref

        return kvref.quantize_kv(x, scale, self.kv_policy(fmt, layout))

    def kv_attention(self, q, k_cache, v_cache, *, q_scale=None, causal=True, q_lengths=None, kv_lengths=None,
                     sm_scale=None):
        from fp8rl.reference import kv as kvref

        pol = self.kv_policy(k_cache.fmt, k_cache.layout)
        out = kvref.fp8_attention(q, k_cache, v_cache, q_scale=q_scale, q_fmt=pol.q_fmt, q_quant_op=pol.q_quant_op,
                                  causal=causal, q_lengths=q_lengths, kv_lengths=kv_lengths, sm_scale=sm_scale)
        return out.float()

    def kv_calibrate(self, captures, strategy, *, layout="tensor", fmt="e4m3fn"):
        from fp8rl.reference import kv as kvref

        return kvref.calibrate(captures, strategy, layout=layout, fmt=fmt)

    def _kv_layers(self) -> dict:
        return self.__dict__.setdefault("_kv_layer_scales", {})

    def kv_update_scales(self, layer, scales):
        from fp8rl.reference import kv as kvref

        if scales is None:
            self._kv_layers()[layer] = None
            return "pending"
        if not isinstance(scales, kvref.KVScales):
            raise ValueError(f"scales: expected a KVScales or None, got {type(scales).__name__}")
        self._kv_layers()[layer] = kvref.KVScales.of(scales.q, scales.k, scales.v)
        return "pushed"

    def _kv_current_scales(self, layer, q, k, v, layout):
        from fp8rl.reference import kv as kvref

        layers = self._kv_layers()
        if layer not in layers:
            raise kvref.MissingKVScales(f"layer {layer!r}: no KV scales were pushed or calibrated; refusing to run "
                                        "the FP8 KV cache with the default scale 1.0")
        scales = layers[layer]
        if scales is None:  # engine-side recalibration on the first batch after a reset, then frozen
            if layout == "head":
                raise ValueError("layout: engine-side recalibration gives per-tensor scales; push per-head scales")
            scales = kvref.calibrate_engine_first_batch(q, k, v)
            layers[layer] = scales
        return scales

    def kv_forward(self, layer, q, k, v, *, fmt, layout="tensor", causal=True, q_lengths=None, kv_lengths=None,
                   sm_scale=None):
        from fp8rl.reference import kv as kvref

        pol = self.kv_policy(fmt, layout)
        s = self._kv_current_scales(layer, q, k, v, layout)
        dynamic = layout == "token_head"
        kc = self.kv_store(k, None if dynamic else s.k, fmt=fmt, layout=layout)
        vc = self.kv_store(v, None if dynamic else s.v, fmt=fmt, layout=layout)
        out = self.kv_attention(q, kc, vc, q_scale=s.q if pol.quantize_q else None, causal=causal,
                                q_lengths=q_lengths, kv_lengths=kv_lengths, sm_scale=sm_scale)
        return kvref.KVForward(out, kc, vc, s)

    # -- area correction -------------------------------------------------------------------------------------------
    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        from fp8rl.reference import correction

        return correction.rollout_correction(train_logp, rollout_logp, mask, config)

    def correction_loss(self, logp, old_logp, advantages, mask, weights, config):
        from fp8rl.reference import correction

        return correction.policy_loss(logp, old_logp, advantages, mask, weights, config).to(logp.dtype)

    def proximal_logp(self, behave_logp, theta_logp, versions, current_version, method):
        """Decoupled PPO's approximated proximal policy (``rollout_correction.proximal``): the oracle's."""
        from fp8rl.reference import correction

        return correction.proximal_logp(behave_logp, theta_logp, versions, current_version, method)

    def decoupled_loss(self, logp, prox_logp, behave_logp, advantages, mask, loss_config, correction_config):
        """Decoupled PPO loss (``rollout_correction.decoupled``): the oracle's, in ``logp``'s dtype."""
        from fp8rl.reference import correction

        return correction.decoupled_ppo_loss(logp, prox_logp, behave_logp, advantages, mask, loss_config,
                                             correction_config).to(logp.dtype)

    # -- areas weight_sync and e2e ----------------------------------------------------------------------------------
    # weight_sync: fp8rl.reference.weight_sync (the oracle's block quantizer) under the declared
    # scale_policy("block"); an engine with its own weight-sync kernel overrides weight_sync (or
    # _weight_sync_recipe for other filters/block sizes). Rollouts: fp8rl.reference.rollout.RolloutPolicy
    # (transformers model classes, emulated FP8 numerics) running on this engine's weight_sync output, with
    # activations quantized under scale_policy("group"); the PTPC recipe (fp8-linear-ptpc) quantizes the BF16 weights
    # per channel under scale_policy("channel") and activations per token under scale_policy("token").
    # rollout_logits (rollout.logits) exposes the fp32 logits of every decoding step (RolloutPolicy.decode_step);
    # _rollout_policy_class lets a subclass swap the policy class (the e2e mutants' samplers).

    #: weight-sync results of the oracle quantizer, shared by every instance: (weights digest, recipe) → tensors
    _E2E_SYNC_MEMO: dict = {}

    def _caps_e2e(self) -> CapabilityMap:
        from fp8rl.reference.rollout_hf import transformers_reason

        return capabilities.all_of("e2e", transformers_reason() or True)

    def _weight_sync_recipe(self):
        from fp8rl.reference.weight_sync import WeightSyncRecipe

        return WeightSyncRecipe(policy=self.scale_policy("block"))

    def weight_sync(self, state_dict):
        from fp8rl.reference import weight_sync as ws

        recipe = self._weight_sync_recipe()
        if self.__dict__.get("_refitting"):  # a refit keeps no copy of a step beyond its live model (WSYNC-REFIT-003)
            return ws.quantize_state_dict(state_dict, recipe)
        # the oracle's quantizer is a pure function of (weights, recipe): memoize across engine instances
        from fp8rl.fixtures import digest_state_dict

        key = (digest_state_dict(dict(state_dict)), recipe)
        hit = ReferenceEngine._E2E_SYNC_MEMO.get(key)
        if hit is None:
            hit = ws.quantize_state_dict(state_dict, recipe)
            if len(ReferenceEngine._E2E_SYNC_MEMO) >= 8:
                ReferenceEngine._E2E_SYNC_MEMO.pop(next(iter(ReferenceEngine._E2E_SYNC_MEMO)))
            ReferenceEngine._E2E_SYNC_MEMO[key] = hit
        return dict(hit)

    def _refit_live(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live model of each config (JSON key) this engine has refit: name → tensor, as weight_sync ships."""
        live = self.__dict__.get("_refit_models")
        if live is None:
            live = self.__dict__["_refit_models"] = {}
        return live

    def refit(self, config, state_dict):
        """The oracle's refit: the live model of ``config`` holds the step's :meth:`weight_sync` output. The first
        refit of a config defines the model's parameter set; a later one may carry any subset (a bucket) and is
        validated entirely (names, shapes, dtypes) before anything is replaced, so a failed refit changes nothing.
        A trainer streaming packed experts (transformers 5's ``mlp.experts.gate_up_proj``) and one streaming the
        hub's per-expert names are two parameter layouts of one config: each has its live model; ``state_dict``
        None reads back the one refitted last."""
        import json

        from fp8rl.reference import weight_sync as ws

        models = self._refit_live()
        last: dict[str, str] = self.__dict__.setdefault("_refit_last_layout", {})
        base = json.dumps(config, sort_keys=True, default=str)
        if state_dict is None:
            key = last.get(base, base)
        else:
            packed = any(ws.is_packed_experts(n, tuple(t.shape)) for n, t in dict(state_dict).items())
            key = last[base] = base + ("|packed-experts" if packed else "")
        live = models.get(key)
        if state_dict is not None:
            self.__dict__["_refitting"] = True  # weight_sync unmemoized: the memo would hold every step's tensors
            try:
                synced = self.weight_sync(state_dict)
            finally:
                self.__dict__["_refitting"] = False
            if live is not None:
                bad = [f"{n}: {tuple(t.shape)} {t.dtype}" + ("" if n not in live else
                                                             f", the model holds {tuple(live[n].shape)} {live[n].dtype}")
                       for n, t in synced.items()
                       if n not in live or live[n].shape != t.shape or live[n].dtype != t.dtype]
                if bad:
                    raise ValueError(f"refit: {len(bad)} tensors do not fit the live model: " + "; ".join(bad[:4]))
                live = {**live, **synced}
            else:
                live = dict(synced)
            models[key] = live
        if live is None:
            raise ValueError("refit(config, None): no live model of this config (refit it with weights first)")
        return {n: t.clone() for n, t in live.items()}

    # -- area checkpoint: the oracle's blockwise-FP8 checkpoint writer and reader (fp8rl.reference.checkpoint) -------
    def checkpoint_write(self, out_dir, config, state_dict):
        from fp8rl.reference import checkpoint as ck

        return ck.write_checkpoint(out_dir, config, state_dict, ck.CheckpointSpec(policy=self.scale_policy("block")))

    def checkpoint_write_channel(self, out_dir, config, state_dict):
        """The oracle's compressed-tensors channel-strategy checkpoint (fp8rl.reference.checkpoint_ct
        .write_channel_checkpoint) under the declared channel policy."""
        from fp8rl.reference import checkpoint as ck
        from fp8rl.reference import checkpoint_ct as cct

        return cct.write_channel_checkpoint(out_dir, config, state_dict,
                                            ck.CheckpointSpec(policy=self.scale_policy("channel")))

    #: the ``quant_method`` of the checkpoints :meth:`checkpoint_load` reads (``fp8rl checkpoint-matrix`` does not
    #: run a loader on a file of another format; engines without the attribute read ``fp8`` only)
    checkpoint_formats = ("fp8", "compressed-tensors")

    def checkpoint_load(self, path):
        """The oracle's readers: blockwise FP8 (fp8rl.reference.checkpoint) or compressed-tensors FP8
        (fp8rl.reference.checkpoint_ct), by the file's ``quant_method``."""
        from fp8rl.reference import checkpoint as ck
        from fp8rl.reference import checkpoint_ct as cct

        config, tensors = ck.read_checkpoint(path)
        return cct.dequantize_any(config, tensors)

    def checkpoint_score(self, path, tokens, prompt_len):
        """The oracle's dequantized model of the checkpoint (fp8rl.reference.rollout_hf.checkpoint_policy) scoring
        ``tokens[:, prompt_len:]``."""
        from fp8rl.reference.rollout_hf import checkpoint_policy

        return checkpoint_policy(path).score(tokens, prompt_len)

    def checkpoint_attention_scales(self, path):
        """The oracle's attention scales: the file's (validated), the documented defaults where absent."""
        from fp8rl.reference import checkpoint as ck
        from fp8rl.reference import checkpoint_ct as cct

        config, tensors = ck.read_checkpoint(path)
        cct.fp8_weights_any(config, tensors)  # the file validates, in either format
        return ck.expected_attention_scales(ck.attention_scales_in_file(tensors, config["num_hidden_layers"]))

    # -- areas quantization and gemm, microscaling recipes: MXFP8 / MXFP4 (E8M0 per 32) and NVFP4 (E4M3 per 16 × fp32 global), fp8rl.reference.microscaling
    def mx_policy(self, recipe: str):
        """The microscaling policy this engine implements for ``recipe`` (the oracle's: OCP floor, compressed-tensors
        NVFP4)."""
        from fp8rl.reference.microscaling import get_mx_policy

        return get_mx_policy(recipe)

    def mx_quantize(self, x: torch.Tensor, recipe: str):
        from fp8rl.reference.microscaling import mx_quantize

        return mx_quantize(x, self.mx_policy(recipe))

    def mx_gemm(self, a, w, out_dtype: torch.dtype) -> torch.Tensor:
        from fp8rl.reference.microscaling import mx_gemm_exact

        return mx_gemm_exact(a, w).to(out_dtype)

    def mx_weight_sync(self, state_dict, recipe: str):
        """The oracle's microscaling weight sync (fp8rl.reference.mx_weight_sync) under this engine's declared
        ``mx_policy`` of the recipe's format, its quantizer this engine's ``mx_quantize``."""
        from fp8rl.reference.mx_weight_sync import get_mx_sync_recipe, mx_sync_state_dict

        r = get_mx_sync_recipe(recipe)
        return mx_sync_state_dict(state_dict, r, self.mx_policy(r.mx_recipe),
                                  quantize_fn=lambda w: self.mx_quantize(w, r.mx_recipe))

    def _rollout_policy_class(self):
        """The rollout policy class (a subclass of :class:`~fp8rl.reference.rollout_hf.RolloutPolicy`, e.g. with
        another ``decode_step``)."""
        from fp8rl.reference.rollout_hf import RolloutPolicy

        return RolloutPolicy

    def rollout_init(self, config, state_dict, recipe):
        from fp8rl.reference.rollout import get_recipe

        RolloutPolicy = self._rollout_policy_class()
        r = get_recipe(recipe)
        if r.mx is not None:  # microscaling: this engine's mx weight sync and declared mx_policy
            from fp8rl.reference.mx_weight_sync import get_mx_sync_recipe

            return RolloutPolicy(config, state_dict, r, synced=self.mx_weight_sync(state_dict, r.mx),
                                 mx_policy=self.mx_policy(get_mx_sync_recipe(r.mx).mx_recipe), memo=True)
        synced = self.weight_sync(state_dict) if r.synced_weights else None
        if r.fp8_linear and not r.synced_weights:  # PTPC: per-channel weights, per-token activations
            return RolloutPolicy(config, state_dict, r, weight_policy=self.scale_policy("channel"),
                                 act_policy=self.scale_policy("token"), memo=True)
        return RolloutPolicy(config, state_dict, r, synced=synced, act_policy=self.scale_policy("group"), memo=True)

    def rollout(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        return handle.generate(prompts, max_new_tokens, greedy=greedy, seed=seed)

    def rollout_logits(self, handle, prompts, max_new_tokens, *, greedy=True, seed=0):
        """``RolloutPolicy.generate_with_logits``: the tokens and log-probs of :meth:`rollout` plus the fp32 logits
        (BF16 lm_head output, upcast) each step drew from."""
        return handle.generate_with_logits(prompts, max_new_tokens, greedy=greedy, seed=seed)

    def update_weights(self, handle, state_dict):
        if handle.recipe.mx is not None:
            synced = self.mx_weight_sync(state_dict, handle.recipe.mx)
        else:
            synced = self.weight_sync(state_dict) if handle.recipe.synced_weights else None
        handle.update_weights(state_dict, synced=synced)
        return handle



def _noting_oracle_call(fn):
    """Wrap an op of the oracle engine so that a guarded call knows the oracle's code ran (fp8rl.engine.ORACLE_CALLS):
    a subclass's op that delegates to it (``super().quantize(...)``) is reported as the oracle's, not the engine's."""
    import functools

    from fp8rl.engine import note_oracle_call

    @functools.wraps(fn)
    def op(self, *args, **kwargs):
        note_oracle_call(self, fn.__name__)
        return fn(self, *args, **kwargs)

    return op


def _note_oracle_ops(cls: type) -> None:
    from fp8rl.registry import protocol_ops

    protocol = protocol_ops()
    for name, value in list(vars(cls).items()):
        if callable(value) and name in protocol:
            setattr(cls, name, _noting_oracle_call(value))


_note_oracle_ops(ReferenceEngine)
