"""The engine protocol: what an engine under test exposes to the suite.

An engine is an object with a ``name``, a ``version()`` string, a ``capabilities()`` map and op methods. Each
capability key maps to ``True`` (available) or to a human-readable reason why it is not; a check that needs an
unavailable capability is *skipped with that reason*, never passed.

Capability keys, their areas, the ops each gates and their meaning: :mod:`fp8rl.capabilities` (the one table).
The protocol is split by area into mixins (:class:`CoreOps`: formats, quantization, GEMM; :class:`KVOps`;
:class:`CorrectionOps`; :class:`RolloutOps`: weight sync and e2e; :class:`CheckpointOps`: FP8 checkpoint writers and
loaders; :class:`MXOps`: the microscaling recipes); :class:`Engine` is all of them: every op the capability table gates
is declared here, with the shapes and dtypes it receives and returns.

The engine *declares* the numerics it implements, so that checks compare like with like:
``cast_overflow(fmt)`` names its overflow policy per format, and ``scale_policy(kind)`` returns the
:class:`~fp8rl.reference.quant.ScalePolicy` its quantizer follows for a granularity kind. A check then demands
bit-exact agreement with the oracle *under the declared policy*.

"Bring your kernel" (docs/vendor-guide.md): subclass :class:`Engine`, implement the ops your code has and declare only
those capabilities. An op inherited from :class:`fp8rl.engines.reference.ReferenceEngine` runs fp8rl's oracle: its
cases are reported as the oracle's and never certify the engine (docs/verdict.md §1).
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from typing import Any

import torch
from fp8rl.capabilities import ELEMENT_FORMATS, GEMM_KINDS, QUANT_KINDS
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.quant import Granularity, QuantizedTensor

CapabilityMap = dict[str, "bool | str"]


#: during one guarded op call, the (engine id, op) pairs whose implementation by fp8rl's oracle ran: an engine op
#: that delegates to the oracle's own (``super().quantize(...)`` in a ReferenceEngine subclass) ran the oracle
ORACLE_CALLS: contextvars.ContextVar[set | None] = contextvars.ContextVar("fp8rl_oracle_calls", default=None)


def note_oracle_call(engine: object, op: str) -> None:
    """Called by the oracle engine's ops (fp8rl.engines.reference): its implementation of ``op`` ran on ``engine``."""
    calls = ORACLE_CALLS.get()
    if calls is not None:
        calls.add((id(engine), op))


class Unsupported(Exception):
    """Raised by an engine op for an input it cannot handle by design (the check is skipped with the message)."""


class EngineError(Exception):
    """The engine misbehaved (raised, returned the wrong shape/dtype/None/NaN): the check's outcome is ``error``."""


class CoreOps:
    """Identity, capabilities and declared numerics, and the ops of the formats, quantization and gemm areas
    (capabilities ``cast.*``, ``quantize.*``, ``gemm.*``)."""

    name: str = "engine"
    #: engine-specific description shown by ``fp8rl engines``
    description: str = ""

    def version(self) -> str:
        return "unknown"

    def instrument_notes(self) -> list[str]:
        """What the results rely on beyond the engine's own code (e.g. a Triton-interpreter workaround); every
        report of this engine names each note (report.json ``engine.notes``, the Markdown/HTML header)."""
        return []

    def capabilities(self) -> CapabilityMap:
        return {}

    def input_limits(self, op: str) -> dict[str, str]:
        """Input classes of ``op`` (fp8rl.inputspace, e.g. ``"dtype.x=fp16"``, ``"layout.x=strided"``) this engine
        cannot take, each with the reason; the checks of those classes are skipped with it. Default: none (every
        input the protocol allows)."""
        return {}

    # -- declared numerics ---------------------------------------------------------------------------------
    def cast_overflow(self, fmt: str) -> str:
        """Overflow policy of :meth:`cast` for ``fmt`` ("saturate", "nan" or "inf")."""
        raise Unsupported(f"{self.name} declares no cast policy for {fmt}")

    def scale_policy(self, kind: str) -> ScalePolicy:
        """The ScalePolicy this engine's quantizer implements for a granularity kind."""
        raise Unsupported(f"{self.name} declares no scale policy for {kind}")

    # -- ops -------------------------------------------------------------------------------------------------
    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """Round fp32 ``x`` to ``fmt``; return uint8 codes of the same shape."""
        raise Unsupported(f"{self.name} has no cast op")

    def round_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """Round fp32 ``x`` to bfloat16 (capability ``cast.bf16``); return a ``torch.bfloat16`` tensor, same shape."""
        raise Unsupported(f"{self.name} has no bf16 rounding op")

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        """Quantize ``x`` with the engine's declared policy for ``granularity.kind``."""
        raise Unsupported(f"{self.name} has no quantize op")

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y = dequant(a) @ dequant(w)ᵀ for a (M,K) activations and w (N,K) weights, returned in ``out_dtype``."""
        raise Unsupported(f"{self.name} has no block_gemm op")


class KVOps:
    """Area ``kv``: the FP8 KV cache (capabilities ``kv.store``, ``kv.attention``, ``kv.calibrate``, ``kv.forward``,
    ``kv.update_scales``).

    Types live in fp8rl.reference.kv: KVPolicy, KVCache, KVScales, KVForward, MissingKVScales. Tensors are "BTHD":
    K/V [..., T, H, D], Q [B, Tq, Hq, D]. ``kv_forward`` runs a layer's Q/K/V through the engine's FP8 KV path with
    whatever scales it would use by itself (e.g. vLLM's default 1.0 for a checkpoint without k/v scales); an engine
    declaring ``kv.update_scales`` also declares ``kv.forward``: the checks of scales that change per RL step call
    both.
    """

    name: str

    def kv_policy(self, fmt: str, layout: str) -> Any:
        """Declared numerics (a ``KVPolicy``) of the FP8 KV cache in element format ``fmt`` ("e4m3fn", "e5m2")
        with scale ``layout`` ("tensor", "head", "token_head"): quant op (x/s or x·fl32(1/s)), clamp, overflow,
        token-head scale floor, and how FP8 attention quantizes Q. Raise Unsupported for combinations the
        engine does not implement (the checks for them are skipped with the message)."""
        raise Unsupported(f"{self.name} declares no FP8 KV cache")

    def kv_store(self, x: torch.Tensor, scale: torch.Tensor | None, *, fmt: str, layout: str) -> Any:
        """Quantize-on-store of K or V ``x`` [..., T, H, D] → ``KVCache(codes uint8 x.shape, scale fp32)``.

        ``x``: fp32, bf16 or fp16, 3-D [T, H, D] or batched 4-D, contiguous or not (every class the checks send:
        ``fp8rl.inputspace.MODEL["kv_store"]``, tabulated in docs/vendor-guide.md §4).

        ``scale``: the dequant scale, shape () for layout "tensor" and (H,) for "head"; None for "token_head",
        where the engine computes s = max(fl32(amax_D / max), floor) per (token, head) and returns it. Codes:
        RNE(clamp(x / s)) (or x·fl32(1/s)) under the declared ``kv_policy(fmt, layout)``.
        """
        raise Unsupported(f"{self.name} has no kv_store op")

    def kv_attention(self, q: torch.Tensor, k_cache: Any, v_cache: Any, *, q_scale: torch.Tensor | None = None,
                     causal: bool = True, q_lengths: torch.Tensor | None = None,
                     kv_lengths: torch.Tensor | None = None, sm_scale: float | None = None) -> torch.Tensor:
        """FP8 attention over caches (``KVCache`` of [B, Tk, Hkv, D]) → fp32 [B, Tq, Hq, D].

        K and V are dequantized from the caches; Q is quantized per tensor with ``q_scale`` (the declared
        ``q_fmt``/``q_quant_op``) when given, else used in fp32. GQA: query head h reads KV head h // (Hq/Hkv).
        ``q_lengths``/``kv_lengths`` [B] give each sequence's valid queries/keys (cache slots beyond kv_len hold
        garbage and must never be read); causal masking is bottom-right aligned (query i sees key j iff
        j ≤ i + kv_len − q_len); rows of padded queries are 0; sm_scale defaults to 1/√D.
        """
        raise Unsupported(f"{self.name} has no kv_attention op")

    def kv_calibrate(self, captures: Any, strategy: str, *, layout: str = "tensor", fmt: str = "e4m3fn") -> Any:
        """Q/K/V scales (``KVScales``) from captured post-RoPE activations ``captures[rank][micro_batch] =
        (q, k, v)`` with a named strategy: "engine_first_batch" (A, vLLM first batch amax / (200, 200, 100)),
        "trainer_p999" (B, NeMo-RL 1.05·p99.9 of micro-batch amaxes / 448, max over ranks) or "amax"
        (C, amax / max; per KV head for layout "head"). See fp8rl.reference.kv for the exact formulas."""
        raise Unsupported(f"{self.name} has no kv_calibrate op")

    def kv_update_scales(self, layer: int | str, scales: Any) -> str:
        """After a weight update: install new ``KVScales`` for ``layer`` (trainer-side push; returns "pushed"),
        or with ``scales=None`` reset the layer so that its next ``kv_forward`` recalibrates engine-side with
        strategy A on that batch and then freezes the scales (verl's per-step reset; returns "pending")."""
        raise Unsupported(f"{self.name} has no kv_update_scales op")

    def kv_forward(self, layer: int | str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, fmt: str,
                   layout: str = "tensor", causal: bool = True, q_lengths: torch.Tensor | None = None,
                   kv_lengths: torch.Tensor | None = None, sm_scale: float | None = None) -> Any:
        """One layer's FP8 KV path with the layer's *current* scales (the RL rollout path): store K/V, run FP8
        attention (Q quantized when the policy says so) and return ``KVForward(out, k_cache, v_cache, scales)``
        with the scales actually used (capability ``kv.forward``). A layer with no scales ever set must not
        silently use 1.0: raise ``MissingKVScales`` (or calibrate engine-side)."""
        raise Unsupported(f"{self.name} has no kv_forward op")


class CorrectionOps:
    """Area ``correction``: rollout correction (capabilities ``rollout_correction``: rollout_is None/"token"/
    "sequence", TIS and IcePop thresholds, batch normalization, the 11 RS options; ``rollout_correction.geometric``:
    rollout_is="geometric"; ``rollout_correction.veto``: the historical rollout_token_veto_threshold;
    ``rollout_correction.loss``: :meth:`correction_loss`; ``rollout_correction.proximal``: :meth:`proximal_logp`;
    ``rollout_correction.decoupled``: :meth:`decoupled_loss`)."""

    name: str

    def rollout_correction(self, train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                           config: Any) -> Any:
        """Rollout correction for one batch: IS weights, rejection-sampling mask and mismatch metrics.

        ``train_logp`` / ``rollout_logp``: (B, T) log-probs of the sampled tokens under the trainer's policy
        (π_train, veRL's ``old_log_prob``) and the rollout engine's (π_rollout); ``mask``: (B, T) 0/1 response
        mask (values at mask 0 may be −inf/NaN and must not matter); ``config``: a
        :class:`fp8rl.reference.correction.CorrectionConfig` (already validated).

        Returns a :class:`fp8rl.reference.correction.CorrectionResult`: ``weights`` (B, T) in the input dtype,
        detached, 0 on padding, or None when ``config.rollout_is`` is None; ``mask`` (B, T), the input mask with
        rejected tokens zeroed, in the input mask's dtype; ``metrics``: the suite's canonical metric names (see
        :func:`fp8rl.reference.correction.rollout_correction`) — an engine may omit metrics it does not compute
        (checks on an omitted metric are skipped). Must raise ``ValueError`` for an all-zero mask or mismatched
        shapes.
        """
        raise Unsupported(f"{self.name} has no rollout_correction op")

    def correction_loss(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, weights: torch.Tensor | None, config: Any) -> torch.Tensor:
        """Scalar policy loss with the per-token loss multiplied by the IS weights (treated as constants).

        ``config``: a :class:`fp8rl.reference.correction.LossConfig` (PPO-clip with dual clip, or REINFORCE;
        token-mean / seq-mean-token-mean / seq-mean-token-sum aggregation over ``mask``). The result must be
        differentiable with respect to ``logp``.
        """
        raise Unsupported(f"{self.name} has no correction_loss op")

    def proximal_logp(self, behave_logp: torch.Tensor, theta_logp: torch.Tensor, versions: torch.Tensor,
                      current_version: int, method: str) -> torch.Tensor:
        """Decoupled PPO's proximal policy log π_prox approximated without a forward pass of it (capability
        ``rollout_correction.proximal``; oracle :func:`fp8rl.reference.correction.proximal_logp`).

        ``behave_logp`` / ``theta_logp``: (B, T) floating log-probs of the sampled tokens under the behaviour
        (rollout) policy and the current policy θ; ``versions``: (B, T) int64 policy version that generated each
        token (−1 for prompt tokens); ``current_version``: θ's version v_θ. α = clamp((v_θ − 1 − v)/(v_θ − v), 0, 1)
        for generated tokens, 0 for prompt and fresh ones; ``method``: ``"loglinear"`` (l_b + α(l_θ − l_b)),
        ``"linear"`` (log((1 − α)e^{l_b} + α·e^{l_θ}), no additive floor) or ``"rollout"`` (l_b); raise Unsupported
        for a method the engine does not implement.

        Returns a tensor of ``behave_logp``'s shape (the oracle: in its dtype), θ's log-probs treated as constants.
        """
        raise Unsupported(f"{self.name} has no proximal_logp op")

    def decoupled_loss(self, logp: torch.Tensor, prox_logp: torch.Tensor, behave_logp: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, loss_config: Any,
                       correction_config: Any) -> torch.Tensor:
        """Decoupled PPO loss (capability ``rollout_correction.decoupled``; oracle
        :func:`fp8rl.reference.correction.decoupled_ppo_loss`): L = Σ_t m'_t·w_t·PPO-clip(π_θ/π_prox, A)_t / Σ_t m_t.

        ``logp``: (B, T) floating log π_θ of the sampled tokens (requires grad); ``prox_logp`` / ``behave_logp``:
        (B, T) log π_prox (the clip's reference policy) and log π_behave (the rollout's); ``advantages``: (B, T);
        ``mask``: (B, T) 0/1 response mask (values at mask 0 must not matter); ``loss_config``: a
        :class:`fp8rl.reference.correction.LossConfig` (the checks use ``kind="ppo_clip"``, ``agg="token-mean"``;
        raise Unsupported for others the engine lacks); ``correction_config``: a
        :class:`fp8rl.reference.correction.CorrectionConfig` giving the behaviour IS weight w = π_prox/π_behave
        (truncated or masked) and the rejection mask m'. The denominator is the *original* count of valid tokens.

        Returns a 0-d tensor (the oracle: in ``logp``'s dtype), differentiable with respect to ``logp`` only (w, the
        proximal and behaviour log-probs are constants).
        """
        raise Unsupported(f"{self.name} has no decoupled_loss op")


class RolloutOps:
    """Areas ``weight_sync`` and ``e2e`` (capabilities ``weight_sync``, ``rollout``, ``update_weights``,
    ``rollout.<recipe>``, ``rollout.logits``).

    Recipes: ``bf16``, ``fp8-linear`` (W8A8 blockwise linear layers: 128×128 weights, dynamic 1×128 activations),
    ``fp8-linear-ptpc`` (per-channel weights, per-token activations), ``fp8-kv`` (FP8 e4m3fn KV cache, per-tensor
    per-layer scales, storage only), ``fp8-all`` (both, plus an FP8 query: FP8 attention). Models are given as an
    HF config dict and a BF16 state dict with HF *checkpoint* names (MoE experts unfused:
    ``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``), e.g. ``fp8rl.fixtures.tiny_model(name)``. Oracles:
    fp8rl.reference.weight_sync and fp8rl.reference.rollout.
    """

    name: str

    def weight_sync(self, state_dict: Any) -> dict[str, torch.Tensor]:
        """The tensors this engine's per-step weight sync loads, for a checkpoint-named ``state_dict`` of BF16
        weights or of the trainer's fp32 master weights (cast to BF16 first: an fp32 state dict syncs bit for bit
        like its BF16 cast).

        Quantized weights (q/k/v/o_proj, gate/up/down_proj, dense or per expert): ``name`` → FP8 tensor
        (``torch.float8_e4m3fn``) of the weight's shape, plus ``name + "_scale_inv"`` → fp32 **dequant** scales of
        shape (⌈N/128⌉, ⌈K/128⌉) (128×128 blocks, DeepSeek/vLLM convention), quantized with the engine's declared
        ``scale_policy("block")`` after a cast to BF16; a shared expert's projections (``mlp.shared_expert.*``)
        too. Everything else — embeddings, ``lm_head``, every norm, biases, the MoE router ``mlp.gate``, the
        shared-expert gate ``mlp.shared_expert_gate`` — is returned unchanged in BF16. No other keys.
        """
        raise Unsupported(f"{self.name} has no weight_sync op")

    def refit(self, config: Any, state_dict: Any) -> dict[str, torch.Tensor]:
        """One RL step's FP8 refit into the engine's live inference model, read back (capability
        ``weight_sync.refit``).

        ``config``: the HF config dict of the model; the engine builds its live FP8 model (FP8 linears per its
        quantization config) on the first call for a config and keeps it: every later call with that config is a
        refit of the same live model. ``config["kv_cache_dtype"] == "fp8_e4m3"`` (not an HF key; capability
        ``weight_sync.refit_kv``): the live model has an FP8 (e4m3fn) KV cache with per-tensor, per-layer scales.
        ``state_dict``: the trainer's weights at this step, checkpoint names, BF16 (or fp32 master weights),
        streamed through the engine's own per-step quantize-and-load path; with an FP8 KV cache it also carries the
        step's KV-cache scales, ``<layer>.self_attn.k_scale`` / ``v_scale`` (fp32 0-d dequant scales: stored
        K = fp8(k / k_scale); the trainer-side calibration of the step). ``None``: no sync, only the read-back. A
        refit that fails must raise and leave the live model as it was before the call.

        Returns every parameter the live model holds after the call, read back from the model in the layout its
        kernels consume and under checkpoint names (fused layers split into their checkpoint parts): FP8 weights
        ``name`` (``torch.float8_e4m3fn``, the weight's shape) + ``name + "_scale_inv"`` (fp32 dequant scales,
        (⌈N/128⌉, ⌈K/128⌉)), every other parameter in its dtype (BF16). Copies: the caller may keep them across
        refits. With an FP8 KV cache, also each attention layer's KV-cache scales as its attention kernels read them
        (``<layer>.self_attn.k_scale`` / ``v_scale``, fp32 0-d). The oracle: the step's :meth:`weight_sync` output
        (fp8rl.reference.weight_sync).
        """
        raise Unsupported(f"{self.name} has no refit op")

    def rollout_init(self, config: Any, state_dict: Any, recipe: str) -> Any:
        """Start a rollout policy: the model of HF ``config`` (dict) with BF16 ``state_dict`` under numerics
        ``recipe`` (see the capability keys above; FP8-linear recipes quantize through the engine's own weight
        sync). Returns an opaque handle for :meth:`rollout` and :meth:`update_weights`. KV scales (FP8 KV recipes)
        are calibrated by the engine on the first batch it runs (or are otherwise correct for the weights)."""
        raise Unsupported(f"{self.name} has no rollout op")

    def rollout(self, handle: Any, prompts: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
                seed: int = 0) -> Any:
        """Fixed-length generation from ``prompts`` (B, P) int64 (no padding; EOS ignored): greedy (argmax) or
        sampled at temperature 1 from the full distribution (no top-k/top-p), seeded by ``seed``. The rows are
        independent draws: identical prompts in one batch (a GRPO group) get independent samples.

        Returns ``(tokens, logprobs)`` (a tuple or ``fp8rl.reference.rollout.RolloutOutput``): tokens (B, P + N)
        int64 starting with the prompts, and logprobs (B, N) float32 = log π_rollout(token) of each generated token
        under the engine's own numerics (what a rollout engine reports as the rollout log-probs, vLLM
        ``logprobs=0``).
        """
        raise Unsupported(f"{self.name} has no rollout op")

    def rollout_logits(self, handle: Any, prompts: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
                       seed: int = 0) -> Any:
        """:meth:`rollout` that also exposes the distribution each token was drawn from (capability
        ``rollout.logits``; engines that cannot expose it leave the capability unavailable with the reason).

        The same generation as ``rollout(handle, prompts, max_new_tokens, greedy=greedy, seed=seed)`` — the same
        tokens and log-probs, bit for bit — returned as ``(tokens, logprobs, logits)`` with ``logits`` (B, N, V)
        float32: at each generated position, the logits the engine sampled that token from (greedy: took the
        argmax of), i.e. what the sampler saw after everything applied before it — at temperature 1 and without
        top-k/top-p, the model's output logits. They are logits *of the generation itself*, not a re-scoring of
        the tokens (a teacher-forced forward differs from incremental decoding by rounding). Only their
        log-softmax matters: any per-row additive constant is allowed, e.g. the full fp32 log-prob vectors (vLLM
        ``logprobs=-1``).

        The e2e checks demand: each reported log-prob is the fp32 log-softmax of its row at the token (tolerance
        ``rollout_logprob_fp32``); a greedy token is maximal in its row (any of tied maxima); sampled tokens follow
        softmax(row), rows independent (a goodness-of-fit test, ``rollout_gof``).
        """
        raise Unsupported(f"{self.name} has no rollout_logits op")

    def update_weights(self, handle: Any, state_dict: Any) -> Any:
        """Load new BF16 weights into a running policy (the per-RL-step sync; re-quantized for FP8 linears) and
        return the handle to use from now on. Later rollouts must follow the new weights, and FP8 KV scales must be
        recalibrated for them (or pushed): scales from the old weights are stale."""
        raise Unsupported(f"{self.name} has no update_weights op")


class CheckpointOps:
    """Area ``checkpoint``: FP8 checkpoints between a writer and a loader (capabilities ``checkpoint.write``,
    ``checkpoint.write_channel``, ``checkpoint.load``, ``checkpoint.score``, ``checkpoint.attention_scales``;
    docs/checkpoint.md).

    A checkpoint is a Hugging Face model directory: ``config.json`` (the model config plus ``quantization_config``)
    and ``*.safetensors``, tensors under HF *checkpoint* names (MoE experts unfused). Oracles:
    fp8rl.reference.checkpoint (blockwise and per-tensor FP8, ``quant_method: fp8``) and
    fp8rl.reference.checkpoint_ct (compressed-tensors). Paths are given as ``str`` or ``os.PathLike``. A loader may
    also declare ``checkpoint_formats`` (the ``quant_method`` values it reads; default ``("fp8",)``),
    ``checkpoint_format_notes`` (format → why not) and ``checkpoint_layout_reason(layout)`` (see
    :func:`checkpoint_layout_reason`): declarations, not ops.
    """

    name: str

    def checkpoint_write(self, out_dir: str | os.PathLike[str], config: Mapping[str, Any],
                         state_dict: Mapping[str, torch.Tensor]) -> str | os.PathLike[str]:
        """Write an FP8 checkpoint of ``state_dict`` into ``out_dir`` (created if missing) and return the directory.

        ``config``: the HF model config (a dict); ``state_dict``: checkpoint-named BF16 weights, or the trainer's fp32
        master weights (cast to BF16 first). Every attention/MLP/expert projection is stored as FP8 codes
        (``torch.float8_e4m3fn``, the weight's shape) plus **dequant** scales of shape (⌈N/128⌉, ⌈K/128⌉), bit-exact
        to the 128×128 block quantization of the BF16 weight under the engine's declared ``scale_policy("block")``:
        fp32 ``<m>.weight_scale_inv`` (``quant_method: fp8``, ``weight_block_size`` [128, 128], ``ignored_layers`` /
        ``modules_to_not_convert``), or compressed-tensors' block-strategy form (``<m>.weight_scale``); every
        other tensor (embeddings, norms, routers, ``lm_head``) in BF16 unchanged, no other names. ``config.json``
        keeps every field of ``config`` and adds the ``quantization_config`` that says what the file holds.
        """
        raise Unsupported(f"{self.name} has no checkpoint_write op")

    def checkpoint_write_channel(self, out_dir: str | os.PathLike[str], config: Mapping[str, Any],
                                 state_dict: Mapping[str, torch.Tensor]) -> str | os.PathLike[str]:
        """Write a compressed-tensors channel-strategy checkpoint (llm-compressor's FP8_DYNAMIC) of ``state_dict``
        into ``out_dir`` and return the directory. Inputs as :meth:`checkpoint_write`.

        Every projection: FP8 codes (``torch.float8_e4m3fn``, the weight's shape) and ``<m>.weight_scale`` of shape
        (N, 1) (fp32, bf16 or fp16), one dequant scale per output row under the declared ``scale_policy("channel")``
        of the BF16 weight; every other tensor in BF16 unchanged. ``quantization_config``: ``quant_method
        "compressed-tensors"``, format ``float-quantized``, one group targeting Linear with static channel FP8
        weights and dynamic per-token FP8 input activations, ``ignore`` = the routers and ``lm_head``.
        """
        raise Unsupported(f"{self.name} has no checkpoint_write_channel op")

    def checkpoint_load(self, path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
        """Load the checkpoint at ``path`` as the engine does and return the weights it then holds, by checkpoint
        name (fused modules split back: q/k/v, gate/up, per expert), in the dtype it holds them (e.g. BF16): each
        quantized weight must equal codes × scales of the file (computed exactly, rounded once to that dtype), every
        other tensor as stored. Only the formats in ``checkpoint_formats`` are fed. A malformed checkpoint (a scale
        of the wrong shape, missing, NaN or inf; a ``weight_block_size`` contradicting the scale shapes) must raise
        (any exception but Unsupported), not load."""
        raise Unsupported(f"{self.name} has no checkpoint_load op")

    def checkpoint_score(self, path: str | os.PathLike[str], tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """log π(tokens[:, t] | tokens[:, :t]) for t ≥ ``prompt_len`` under the model the engine loads from the
        checkpoint at ``path``, teacher-forced with its own forward: ``tokens`` (B, T) int64 → (B, T − prompt_len)
        float32 (log-softmax of the fp32 logits at each scored token)."""
        raise Unsupported(f"{self.name} has no checkpoint_score op")

    def checkpoint_attention_scales(self, path: str | os.PathLike[str]) -> dict[int, dict[str, float]]:
        """The q/k/v scales each attention layer uses after loading the checkpoint at ``path`` with an FP8 (e4m3) KV
        cache: layer index → ``{"q": float, "k": float, "v": float}``. The file's ``k_scale`` / ``v_scale`` /
        ``q_scale`` where stored, else the documented defaults (k and v absent: 1.0; one present: it for both; q
        absent: the k scale; fp8rl.reference.checkpoint.expected_attention_scales). A NaN, zero, negative or
        non-scalar scale must raise."""
        raise Unsupported(f"{self.name} has no checkpoint_attention_scales op")


class MXOps:
    """The microscaling recipes (MXFP8 e4m3/e5m2 and MXFP4: E8M0 scales per 32; NVFP4: E4M3 scales per 16 × an
    fp32 global scale) in the areas ``quantization``, ``gemm`` and ``weight_sync`` (capabilities
    ``mx_quantize.<recipe>``, ``mx_quantize.nondivisible``, ``mx_gemm.<recipe>``, ``mx_weight_sync.<recipe>``).
    Oracle and formulas: fp8rl.reference.microscaling, fp8rl.reference.mx_weight_sync; docs/microscaling.md."""

    name: str

    def mx_policy(self, recipe: str) -> Any:
        """The :class:`~fp8rl.reference.microscaling.MXPolicy` this engine implements for ``recipe`` (``mxfp8_e4m3``,
        ``mxfp8_e5m2``, ``mxfp4``, ``nvfp4``): exponent rule, scale arithmetic order."""
        raise Unsupported(f"{self.name} has no microscaling quantizer")

    def mx_quantize(self, x: torch.Tensor, recipe: str) -> Any:
        """``x`` (…, K) → :class:`~fp8rl.reference.microscaling.MXTensor` (uint8 element bytes, packed two per byte
        for FP4, element 2i in the low nibble; uint8 scale codes per block along K; NVFP4's fp32 global scale)."""
        raise Unsupported(f"{self.name} has no mx_quantize op")

    def mx_gemm(self, a: Any, w: Any, out_dtype: torch.dtype) -> torch.Tensor:
        """y = a @ wᵀ of two MXTensors of one recipe, accumulated in fp32, rounded once to ``out_dtype``."""
        raise Unsupported(f"{self.name} has no mx_gemm op")

    def mx_weight_sync(self, state_dict: Any, recipe: str) -> dict[str, torch.Tensor]:
        """The tensors this engine's per-step weight sync loads under a microscaling rollout recipe (``mxfp8``:
        every projection; ``nvfp4-experts``: the routed MoE experts only), for a checkpoint-named BF16 (or fp32
        master) state dict: compressed-tensors names (``<p>.weight`` e4m3 + ``<p>.weight_scale`` uint8 E8M0; or
        ``<p>.weight_packed`` uint8 + ``<p>.weight_scale`` e4m3 + ``<p>.weight_global_scale`` fp32 (1,)), every
        other tensor its BF16 cast (fp8rl.reference.mx_weight_sync)."""
        raise Unsupported(f"{self.name} has no mx_weight_sync op")


class Engine(CoreOps, KVOps, CorrectionOps, RolloutOps, CheckpointOps, MXOps):
    """Base class (and documentation) of the engine protocol: every area's ops. Subclasses override what they
    support; every op not overridden raises :class:`Unsupported`, and ``capabilities()`` must say so with a
    reason (keys: :mod:`fp8rl.capabilities`)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version(), "capabilities": self.capabilities()}


def import_failure(module: str, install_hint: str) -> str | None:
    """Import ``module`` (an engine's own package); None if it imports, else why not: just ``install_hint`` when the
    package itself is missing, the error plus the hint when it is installed but fails to import."""
    import importlib

    top = module.split(".")[0]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == top:
            return install_hint
        return f"{top} does not import ({exc}); {install_hint}"
    except Exception as exc:  # noqa: BLE001 - any import failure makes the engine unavailable
        return f"{top} is installed but does not import ({type(exc).__name__}: {exc}); {install_hint}"
    return None


def per_tensor_kv_input(x: torch.Tensor, scale: Any) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Validate a ``kv_store`` call with one per-tensor scale (what CPU cache writes take): returns
    (x as fp32 [N, H, D], the scale as a 0-d fp32 tensor, x's original shape), or raises ValueError naming the
    argument."""
    if scale is None:
        raise ValueError("scale: layout 'tensor' needs a scale")
    s = torch.as_tensor(scale, dtype=torch.float32)
    if s.numel() != 1:
        raise ValueError(f"scale: expected a scalar for layout 'tensor', got shape {tuple(s.shape)}")
    x32 = x.to(torch.float32)
    if x32.dim() < 3:
        raise ValueError(f"x: expected [..., T, H, D], got shape {tuple(x32.shape)}")
    shape = tuple(x32.shape)
    return x32.reshape(-1, shape[-2], shape[-1]), s.reshape(()), shape


def capability_reason(engine: Engine, key: str) -> str | None:
    """None if ``key`` is available on ``engine``, else the reason it is not (unknown keys get a reason too)."""
    caps = engine.capabilities()
    status = caps.get(key)
    if status is True:
        return None
    if status is None or status is False:
        return f"engine {engine.name!r} does not declare capability {key!r}"
    return str(status)


def checkpoint_format_reason(engine: Engine, quant_method: str | None) -> str | None:
    """None if the loader ``engine`` reads checkpoints of ``quant_method`` (its ``checkpoint_formats``, default
    ``("fp8",)``), else why not (with its ``checkpoint_format_notes`` entry for that format, if any)."""
    formats = tuple(getattr(engine, "checkpoint_formats", ("fp8",)))
    if quant_method in formats:
        return None
    note = dict(getattr(engine, "checkpoint_format_notes", {}) or {}).get(quant_method)
    return (f"{engine.name} loads quant_method {' / '.join(formats)} checkpoints; this file is {quant_method!r}"
            + (f" ({note})" if note else ""))


#: the checkpoint layouts the loader checks feed a loader (conformance CKPT-LOAD-001/005 cases, ``fp8rl
#: checkpoint-matrix`` rows) → their ``quant_method``: blockwise FP8 (``weight_block_size`` [Bn, Bk]), per-tensor
#: FP8 (``weight_block_size`` null), compressed-tensors block strategy, compressed-tensors channel strategy with
#: dynamic per-token activations (llm-compressor's FP8_DYNAMIC)
CHECKPOINT_LAYOUTS = {"fp8": "fp8", "fp8-per-tensor": "fp8", "compressed-tensors": "compressed-tensors",
                      "compressed-tensors-channel": "compressed-tensors"}


def checkpoint_layout_reason(engine: Engine, layout: str) -> str | None:
    """None if the loader ``engine`` reads checkpoints of ``layout`` (a key of :data:`CHECKPOINT_LAYOUTS`), else why
    not: its quant_method is not among the engine's ``checkpoint_formats`` (:func:`checkpoint_format_reason`), or
    the engine's optional ``checkpoint_layout_reason(layout)`` says why it can't here (e.g. vLLM's block-FP8 CPU
    kernel needs AMX tiles while its channel-wise kernel runs on any CPU)."""
    if layout not in CHECKPOINT_LAYOUTS:
        raise ValueError(f"layout: expected one of {sorted(CHECKPOINT_LAYOUTS)}, got {layout!r}")
    reason = checkpoint_format_reason(engine, CHECKPOINT_LAYOUTS[layout])
    hook = getattr(engine, "checkpoint_layout_reason", None)
    return reason if reason is not None or hook is None else hook(layout)


__all__ = ["ORACLE_CALLS", "note_oracle_call", "ELEMENT_FORMATS", "GEMM_KINDS", "QUANT_KINDS", "CapabilityMap", "CheckpointOps", "CoreOps", "CorrectionOps", "Engine",
           "EngineError", "KVOps", "RolloutOps", "Unsupported", "capability_reason", "checkpoint_format_reason",
           "CHECKPOINT_LAYOUTS", "checkpoint_layout_reason",
           "import_failure", "per_tensor_kv_input"]
