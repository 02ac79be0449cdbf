"""veRL as an engine under test for the rollout-correction and weight-sync areas.

Calls veRL's real functions (``verl==0.9.1``, pure Python): ``verl.trainer.ppo.rollout_corr_helper.
compute_rollout_correction_and_rejection_mask`` (IS weights, RS mask, IS/RS/off-policy metrics),
``verl.utils.debug.metrics.calculate_debug_metrics`` (probability-space mismatch metrics) and
``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`` / ``compute_policy_loss_reinforce`` (the loss with
``rollout_is_weights``). The suite's :class:`~fp8rl.reference.correction.CorrectionConfig` maps 1:1 onto veRL's
``algorithm.rollout_correction`` keys; metric names map as in :data:`METRIC_MAP`.

veRL is optional: without it the engine still loads and every capability says how to install it.
Install (pure-Python wheel, no CUDA): ``nox -s conformance_verl`` builds the locked environment (``locks/verl.txt``);
by hand, ``pip install -c constraints.txt -e '.[verl]'`` then ``pip install --no-deps verl==0.9.1`` (veRL's own requirements pull vLLM-era pins, wandb, datasets, …; the
rollout-correction modules only need the ``[verl]`` extra: ray, tensordict, omegaconf, transformers, codetiming,
orjson, packaging, numpy).

Weight sync (capability ``weight_sync``): veRL's trainer-side FP8 weight sync for SGLang/TRT-LLM, run for real —
``verl.utils.sglang.sglang_fp8_utils.SGLangFP8QuantizerHelper(build_sglang_fp8_quant_config())
.quant_weights_by_name(state_dict.items(), dtype=torch.bfloat16)``: veRL's name-based parameter filter
(``FP8QuantizerHelper.should_quantize_param`` + SGLang ``ignored_layers``), the ``v.to(dtype)`` cast, veRL's
quantizer ``verl.utils.kernel.fp8_kernel.scaled_fp8_blockwise`` and its ``name + "_scale_inv"`` naming (the same
``*_weight_scale_inv`` convention as the oracle: no renaming by the adapter). The quantizer must take its PyTorch
path (``_scaled_fp8_blockwise_pytorch``: triton absent, or ``VERL_DISABLE_TRITON_FP8=1`` before veRL is
imported); the declared ``scale_policy("block")`` is then the ``verl_torch`` preset. With the Triton path active the
capability says so; the Triton path is engine ``verl-triton`` (below).

Engine ``verl-triton`` (:class:`VerlTritonEngine`): veRL's *default* quantizer path, the Triton kernel
``_blockwise_cast_to_fp8_kernel`` behind ``verl.utils.kernel.fp8_kernel.scaled_fp8_blockwise_triton`` (what
``scaled_fp8_blockwise`` dispatches to when triton imports and ``VERL_DISABLE_TRITON_FP8`` is unset), run unchanged by
Triton's CPU interpreter: ``quantize`` block (veRL's own zero padding to whole blocks and crop) → preset
``verl_triton`` (s = max(amax, 1e-10)/448, q = clamp(x·(1/s))), and ``weight_sync`` as above with the dispatcher on
its Triton path (the module's ``_DISABLE_TRITON_FP8`` switch, read per call, is held False for the call — what an
unset ``VERL_DISABLE_TRITON_FP8`` gives at import). The interpreter is requested before veRL imports triton; every
launch runs inside ``conversions("faithful")`` (the ``faithful-downcast`` workaround of
:mod:`fp8rl.engines._triton_interp`, named in ``instrument_notes()``). A process in which veRL's fp8_kernel was
imported with triton but without the interpreter (e.g. engine ``verl`` first) gets a capability reason instead. The
two paths differ for an all-zero block: Triton s = 1e-10/448 ≈ 2.2e-13, PyTorch s = 1.
Two environment notes, both honest about what runs:

* ``verl.utils.fp8_utils`` imports ``verl.workers.rollout.utils``, which imports ``uvicorn`` and ``fastapi`` (HTTP
  server code unrelated to quantization). If exactly those are missing, the adapter imports ``fp8_utils`` with a
  temporary stand-in for that one module that provides only ``ensure_async_iterator`` — a verbatim copy of veRL's
  6-line helper — and removes the stand-in right after; every other line that runs is veRL's.
  ``pip install uvicorn fastapi`` makes the adapter use the real module.
* ``quant_weights_by_name`` calls ``torch.distributed.get_rank()`` (for a debug log) inside a ``try`` whose
  ``except Exception`` ships the weight **unquantized**; without a process group every weight would silently stay
  BF16. The adapter therefore runs it inside a 1-rank gloo group (``HashStore``) when none is initialized, and
  destroys the group afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from fp8rl.capabilities import WSYNC_FAMILY_KEYS
from fp8rl.engine import CapabilityMap, Engine, EngineError, Unsupported, import_failure

VERL_VERSION = "0.9.1"
INSTALL_HINT = (f"verl not installed: pip install --no-deps verl=={VERL_VERSION} plus fp8rl's 'verl' extra (ray, "
                f"tensordict, omegaconf, transformers, codetiming, orjson, packaging), or run `nox -s conformance_verl`")

TRITON_ARITH_NOTE = (
    "veRL's Triton kernel runs in Triton's interpreter, whose fp32 division (amax/448, 1/s) is numpy's correctly "
    "rounded division, not the compiled GPU code (div.full.f32): a GPU run may differ where they round differently")

#: veRL metric (without the ``rollout_corr/`` prefix) → the suite's canonical name
METRIC_MAP: dict[str, str] = {
    "kl": "kl_k1",
    "k3_kl": "kl_k3",
    "training_ppl": "training_ppl",
    "rollout_ppl": "rollout_ppl",
    "training_log_ppl": "training_log_ppl",
    "rollout_log_ppl": "rollout_log_ppl",
    "log_ppl_diff": "log_ppl_diff",
    "log_ppl_abs_diff": "log_ppl_abs_diff",
    "log_ppl_diff_max": "log_ppl_diff_max",
    "log_ppl_diff_min": "log_ppl_diff_min",
    "ppl_ratio": "ppl_ratio",
    "chi2_token": "chi2_token",
    "chi2_seq": "chi2_seq",
    "rollout_is_mean": "is_weight_mean",
    "rollout_is_eff_sample_size": "is_ess",
    "rollout_is_ratio_fraction_high": "is_fraction_high",
    "rollout_is_ratio_fraction_low": "is_fraction_low",
    "rollout_is_oob_ratio": "is_oob_fraction",
    "rollout_is_batch_norm_factor": "is_batch_norm_factor",
    "rollout_rs_masked_fraction": "rs_masked_fraction",
    "rollout_rs_seq_masked_fraction": "rs_seq_masked_fraction",
}
DEBUG_METRIC_MAP: dict[str, str] = {
    "training/rollout_probs_diff_max": "probs_diff_max",
    "training/rollout_probs_diff_mean": "probs_diff_mean",
    "training/rollout_probs_diff_std": "probs_diff_std",
    "training/rollout_actor_probs_pearson_corr": "probs_pearson_corr",
}


async def _ensure_async_iterator(iterable):
    """Verbatim copy of ``verl.workers.rollout.utils.ensure_async_iterator`` (verl 0.9.1), used only when that
    module cannot be imported for want of uvicorn/fastapi (see the module docstring)."""
    if hasattr(iterable, "__aiter__"):
        async for item in iterable:
            yield item
    else:
        for item in iterable:
            yield item


#: what the adapter did to import veRL's fp8_utils ("real" or the stand-in note), for reports and tests
FP8_UTILS_IMPORT: dict[str, str] = {}


def _import_verl_fp8(triton: bool = False) -> tuple[Any, str | None]:
    """(namespace with veRL's weight-sync quantizer + SGLang parameter filter, or None; reason when unusable).

    ``triton=False`` (engine ``verl``): ``scaled_fp8_blockwise`` must take its PyTorch path. ``triton=True`` (engine
    ``verl-triton``): veRL's Triton kernel must be importable and interpreted (see :func:`_import_verl_triton`)."""
    if triton:
        fk, reason = _import_verl_triton()
        if fk is None:
            return None, reason
    reason = import_failure("verl", INSTALL_HINT)
    if reason:
        return None, reason
    stub_name = "verl.workers.rollout.utils"
    if not triton and "verl.utils.kernel.fp8_kernel" not in sys.modules:
        # fp8_kernel reads the switch once, at import: force the PyTorch path unless the user chose otherwise
        os.environ.setdefault("VERL_DISABLE_TRITON_FP8", "1")
    try:
        try:
            from verl.utils import fp8_utils
            FP8_UTILS_IMPORT["how"] = "real"
        except ModuleNotFoundError as exc:
            if exc.name not in ("uvicorn", "fastapi") or stub_name in sys.modules:
                raise
            stub = types.ModuleType(stub_name)
            stub.ensure_async_iterator = _ensure_async_iterator  # type: ignore[attr-defined]
            sys.modules[stub_name] = stub
            try:
                from verl.utils import fp8_utils
            finally:
                if sys.modules.get(stub_name) is stub:
                    del sys.modules[stub_name]
            FP8_UTILS_IMPORT["how"] = (f"stand-in for {stub_name} ({exc.name} not installed): only "
                                       "ensure_async_iterator, a verbatim copy")
        from verl.utils.kernel import fp8_kernel
        from verl.utils.sglang import sglang_fp8_utils
    except Exception as exc:  # noqa: BLE001
        return None, (f"veRL's FP8 weight-sync modules do not import ({type(exc).__name__}: {exc}); "
                      "pip install uvicorn fastapi (verl.workers.rollout.utils needs them)")
    if not triton and fp8_kernel.is_triton_available() and not fp8_kernel._DISABLE_TRITON_FP8:
        return None, ("veRL's scaled_fp8_blockwise would take its Triton path (triton imports and "
                      "VERL_DISABLE_TRITON_FP8 was not 1 when veRL was imported): engine verl drives the PyTorch "
                      "path (set VERL_DISABLE_TRITON_FP8=1); the Triton path is engine verl-triton")
    ns = types.SimpleNamespace(fp8_utils=fp8_utils, fp8_kernel=fp8_kernel, sglang=sglang_fp8_utils)
    return ns, None


def _import_verl() -> tuple[Any, str | None]:
    """(the veRL modules as a namespace, or None; the reason when unavailable)."""
    try:
        import verl
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.utils.debug import metrics as debug_metrics
        from verl.workers.config.actor import FSDPActorConfig
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] == "verl":
            return None, INSTALL_HINT
        return None, f"verl is installed but does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"

    mods = types.SimpleNamespace(verl=verl, helper=rollout_corr_helper, core=core_algos, debug=debug_metrics,
                                 actor_config=FSDPActorConfig)
    return mods, None


def _import_verl_triton() -> tuple[Any, str | None]:
    """(veRL's ``verl.utils.kernel.fp8_kernel`` with its Triton kernel decorated for Triton's interpreter, or None;
    the reason when unusable). Requests the interpreter before veRL imports triton (``@triton.jit`` decides at
    decoration time)."""
    import importlib.util

    from . import _triton_interp as TI

    if importlib.util.find_spec("verl") is None:
        return None, f"{INSTALL_HINT}; plus pip install triton==3.9.0 for the Triton path"
    name = "verl.utils.kernel.fp8_kernel"
    if name not in sys.modules:
        reason = TI.enable_interpreter()
        if reason:
            return None, f"verl-triton needs Triton's interpreter: {reason}"
    try:
        from verl.utils.kernel import fp8_kernel
    except Exception as exc:  # noqa: BLE001
        return None, f"veRL's fp8_kernel does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    if not fp8_kernel.is_triton_available():
        return None, ("triton did not import when veRL's fp8_kernel was imported, so veRL has no Triton path here; "
                      "pip install triton==3.9.0 (fresh process)")
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception as exc:  # noqa: BLE001
        return None, f"triton's interpreter is unavailable ({type(exc).__name__}: {exc})"
    if not isinstance(fp8_kernel._blockwise_cast_to_fp8_kernel, InterpretedFunction):
        return None, ("veRL's _blockwise_cast_to_fp8_kernel was decorated without Triton's interpreter (veRL's "
                      "fp8_kernel, e.g. through engine verl, imported triton before TRITON_INTERPRET=1): on CPU it "
                      "fails with '0 active drivers'; run engine verl-triton in its own process or with "
                      "TRITON_INTERPRET=1")
    return fp8_kernel, None


@contextlib.contextmanager
def _triton_dispatch(fp8_kernel: Any) -> Iterator[None]:
    """Make veRL's dispatcher ``scaled_fp8_blockwise`` take its Triton path for the enclosed calls — what it does when
    ``VERL_DISABLE_TRITON_FP8`` is unset at import (veRL's default); the switch is a module global read per call."""
    old = fp8_kernel._DISABLE_TRITON_FP8
    fp8_kernel._DISABLE_TRITON_FP8 = False
    try:
        yield
    finally:
        fp8_kernel._DISABLE_TRITON_FP8 = old


#: the quantization config veRL 0.8 gives its SGLang rollout and weight sync (FP8_BLOCK_QUANT_KWARGS, written inline
#: in verl/workers/rollout/sglang_rollout/sglang_rollout.py of verl 0.8.0); 0.9 builds it with
#: build_sglang_fp8_quant_config (the same four keys, plus any ignored_layers)
VERL_08_FP8_BLOCK_QUANT_KWARGS = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}


def _weight_sync(ns: Any, state_dict: Any) -> dict[str, torch.Tensor]:
    """``SGLangFP8QuantizerHelper(build_sglang_fp8_quant_config()).quant_weights_by_name(items, dtype=bf16)``,
    drained, inside a 1-rank gloo group when none exists (see the module docstring); duplicate names are an error."""
    import torch.distributed as dist

    build = getattr(ns.sglang, "build_sglang_fp8_quant_config", None)  # veRL >= 0.9
    helper = ns.sglang.SGLangFP8QuantizerHelper(build() if build is not None else dict(VERL_08_FP8_BLOCK_QUANT_KWARGS))
    items = list(dict(state_dict).items())

    async def _drain():
        return [kv async for kv in helper.quant_weights_by_name(items, dtype=torch.bfloat16)]

    own_group = False
    if not dist.is_initialized():
        if not (dist.is_available() and dist.is_gloo_available()):
            raise Unsupported("veRL's quant_weights_by_name needs torch.distributed (get_rank) and this torch "
                              "has no gloo backend")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        own_group = True
    try:
        pairs = asyncio.run(_drain())
    finally:
        if own_group:
            dist.destroy_process_group()
    out: dict[str, torch.Tensor] = {}
    for name, t in pairs:
        if name in out:
            raise EngineError(f"veRL weight sync yielded {name!r} twice")
        out[name] = t
    return out


class VerlEngine(Engine):
    """veRL's rollout-correction helpers (CPU tensors) behind the engine protocol."""

    name = "verl"
    description = ("veRL (verl==0.9.1) rollout_corr_helper: TIS/IcePop IS weights, k1/k2/k3 rejection sampling, "
                   "mismatch metrics, PPO-clip/REINFORCE losses with rollout_is_weights; FP8 weight sync "
                   "(SGLangFP8QuantizerHelper name filter + scaled_fp8_blockwise, PyTorch path)")

    def __init__(self) -> None:
        self._mods, self._reason = _import_verl()
        self._fp8: Any
        self._fp8_reason: str | None
        self._fp8, self._fp8_reason = _import_verl_fp8() if self._mods is not None else (None, self._reason)

    def version(self) -> str:
        if self._mods is None:
            return "verl not installed"
        return f"verl {getattr(self._mods.verl, '__version__', '?')}"

    def capabilities(self) -> CapabilityMap:
        if self._mods is None:
            return {k: self._reason or INSTALL_HINT for k in ("rollout_correction", "rollout_correction.geometric",
                                                              "rollout_correction.veto", "rollout_correction.loss",
                                                              "weight_sync", *WSYNC_FAMILY_KEYS)}
        sync = True if self._fp8 is not None else (self._fp8_reason or INSTALL_HINT)
        return {
            "weight_sync": sync,
            # veRL's filter is name-based (FP8QuantizerHelper.should_quantize_param): it runs on any architecture's
            # names; what it makes of each family is the checks' verdict (conformance/vendors/verl.xfails)
            **dict.fromkeys(WSYNC_FAMILY_KEYS, sync),
            "rollout_correction": True,
            "rollout_correction.geometric": "veRL's rollout_is accepts only 'token' and 'sequence' (geometric IS "
                                            "existed in the Oct-2025 mismatch_helper; geometric RS is seq_mean_k1)",
            "rollout_correction.veto": "veRL removed rollout_token_veto_threshold in #4544 (Jan 2026); "
                                       "seq_max_k2/k3 replaces it",
            "rollout_correction.loss": True,
        }

    def scale_policy(self, kind: str):
        """veRL's weight quantizer is blockwise only; its PyTorch path is the ``verl_torch`` preset."""
        from fp8rl.reference.presets import get_policy

        if kind != "block":
            raise Unsupported(f"veRL quantizes weights 128x128 blockwise only (no {kind!r} quantizer)")
        return get_policy("verl_torch")

    # -- ops -------------------------------------------------------------------------------------------------------
    def weight_sync(self, state_dict):
        """veRL's SGLang/TRT-LLM trainer-side weight sync, run for real (see the module docstring)."""
        if self._fp8 is None:
            raise Unsupported(self._fp8_reason or INSTALL_HINT)
        return _weight_sync(self._fp8, state_dict)

    def _require(self) -> Any:
        if self._mods is None:
            raise Unsupported(self._reason or INSTALL_HINT)
        return self._mods

    @staticmethod
    def _is_threshold(spec: Any) -> Any:
        """A (lo, hi) pair → veRL's "lo_hi" string; floats and strings pass through."""
        if isinstance(spec, (tuple, list)):
            return f"{float(spec[0])!r}_{float(spec[1])!r}"
        return spec

    @staticmethod
    def _rs_threshold(spec: Any) -> Any:
        """A sequence of per-option thresholds (each a number, string or (lo, hi) pair) → veRL's comma list."""
        if isinstance(spec, (tuple, list)):
            return ",".join(str(VerlEngine._is_threshold(s)) for s in spec)
        return spec

    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        from fp8rl.reference.correction import CorrectionResult

        mods = self._require()
        if config.rollout_is == "geometric":
            raise Unsupported("veRL has no geometric IS level (rollout_is must be 'token' or 'sequence')")
        if config.rollout_token_veto_threshold is not None:
            raise Unsupported("veRL 0.9.1 has no rollout_token_veto_threshold (removed in #4544)")
        if config.is_bounds is not None and config.is_bounds[0] == 0.0:
            raise Unsupported("veRL has no masked IS with an upper bound only: its 'lo_hi' rollout_is_threshold "
                              "requires lo > 0 (ValueError 'lower bound must be positive')")
        proto, new_mask, metrics = mods.helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=train_logp,
            rollout_log_prob=rollout_logp,
            response_mask=mask,
            rollout_is=config.rollout_is,
            rollout_is_threshold=self._is_threshold(config.rollout_is_threshold),
            rollout_is_batch_normalize=config.rollout_is_batch_normalize,
            rollout_rs=config.rollout_rs,
            rollout_rs_threshold=self._rs_threshold(config.rollout_rs_threshold),
        )
        weights = None if proto is None else proto.batch["rollout_is_weights"]
        out: dict[str, float] = {}
        for key, value in metrics.items():
            short = key.removeprefix("rollout_corr/")
            name = METRIC_MAP.get(short)
            if name is None and short.startswith("rollout_rs_") and short.endswith("masked_fraction"):
                name = "rs_" + short.removeprefix("rollout_rs_")
            if name is not None:
                out[name] = float(value)
        if config.rollout_is == "token" and not config.icepop and "is_fraction_high" in out:
            # token-level TIS: veRL's fraction above U is exactly the truncated fraction
            out["is_fraction_truncated"] = out["is_fraction_high"]
        out.update(self._debug_metrics(mods, train_logp, rollout_logp, mask))
        return CorrectionResult(weights, new_mask, out)

    @staticmethod
    def _debug_metrics(mods, train_logp, rollout_logp, mask) -> dict[str, float]:
        from verl.protocol import DataProto

        data = DataProto.from_dict(tensors={
            "old_log_probs": train_logp.detach(), "rollout_log_probs": rollout_logp.detach(),
            "response_mask": mask, "responses": torch.zeros(mask.shape, dtype=torch.long)})
        with warnings.catch_warnings():  # torch's "degrees of freedom <= 0" for one valid token (NaN std/corr)
            warnings.simplefilter("ignore", UserWarning)
            got = mods.debug.calculate_debug_metrics(data)
        return {DEBUG_METRIC_MAP[k]: float(v) for k, v in got.items() if k in DEBUG_METRIC_MAP}

    def correction_loss(self, logp, old_logp, advantages, mask, weights, config):
        mods = self._require()
        actor = mods.actor_config(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                                  use_dynamic_bsz=False, clip_ratio=config.clip_ratio_low,
                                  clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
                                  clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.agg)
        if config.kind == "ppo_clip":
            loss, _ = mods.core.compute_policy_loss_vanilla(
                old_log_prob=old_logp, log_prob=logp, advantages=advantages, response_mask=mask,
                loss_agg_mode=config.agg, config=actor, rollout_is_weights=weights)
        else:
            loss, _ = mods.core.compute_policy_loss_reinforce(
                rollout_log_prob=old_logp, log_prob=logp, advantages=advantages, response_mask=mask,
                loss_agg_mode=config.agg, config=actor, rollout_is_weights=weights)
        return loss


__all__ = ["DEBUG_METRIC_MAP", "FP8_UTILS_IMPORT", "INSTALL_HINT", "METRIC_MAP", "VerlEngine"]
