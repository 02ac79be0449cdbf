"""AReaL as an engine under test for the rollout-correction area (``areal==1.0.4``, its real functions on CPU).

Which AReaL function each op calls:

* ``rollout_correction`` → ``areal.utils.functional.functional.apply_rejection_sampling(proximal_logprobs=log
  π_train, old_logprobs=log π_rollout, loss_mask, cu_seqlens=None, config=areal.api.cli_args.
  RejectionSamplingConfig(...))``: in AReaL's decoupled PPO the recomputed (proximal) policy plays π_train and the
  inference engine's behaviour policy π_rollout; the behaviour weight ``behave_imp_weight`` = π_prox/π_behave is the
  IS weight. :func:`areal_config` maps the suite's :class:`~fp8rl.reference.correction.CorrectionConfig` onto it.
* ``decoupled_loss`` → ``areal.utils.functional.functional.ppo_actor_loss_fn`` (the same rejection config).
* ``proximal_logp`` → ``areal.trainer.ppo.actor.compute_prox_logp_approximations`` (the loglinear / linear
  proximal-policy approximations from per-token versions).

Conventions (docs/rl-frameworks-correction.md §3): AReaL's ``action="mask"`` zeroes the behaviour weight *and* the
token's ``loss_mask``, but ``ppo_actor_loss_fn`` divides by the *original* count of valid tokens (its own comment:
"keeps the denominator consistent with loss_weight_fn"), so a rejected token adds 0 and still counts: that is IcePop
(weight 0, mask unchanged), and the adapter reports the input mask; AReaL's updated mask is kept in
``last_areal_mask`` for tests. ``action="clamp"`` clamps the weight to [lower or 0, upper]: TIS. At
``level="sequence"`` with ``metric="ratio"`` the weight is the *geometric mean* of the row's ratios (aggregation in
log space, ``agg="mean"``): the oracle's ``rollout_is="geometric"``; AReaL has no product-ratio (``"sequence"``)
weight, no batch normalization and no rejection that removes tokens from the loss (``rollout_rs``). Metric: its
``filtered_fraction`` (share of valid tokens clamped, or rejected) is the oracle's ``is_fraction_truncated`` (TIS) /
``is_oob_fraction`` (IcePop).

Install (pure Python; AReaL's own requirements pin CUDA-era torch<2.11 and dozens of agent/serving packages):
``nox -s conformance_areal`` (``locks/areal.txt``), by hand ``pip install -c constraints.txt -e '.[areal]'`` then
``pip install --no-deps areal==1.0.4`` — the ``[areal]`` extra is the set AReaL's ``import areal`` and
``areal.trainer`` need on CPU. AReaL pins torch>=2.9.1,<2.11 and transformers<=5.3.0; the tier runs torch
2.13.0+cpu (the only CPU build the suite locks) with transformers 5.3.0: the functions called are plain tensor code.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from fp8rl.engine import CapabilityMap, Engine, Unsupported

AREAL_VERSION = "1.0.4"
INSTALL_HINT = (f"areal not installed: pip install --no-deps areal=={AREAL_VERSION} plus fp8rl's 'areal' extra, or "
                "run `nox -s conformance_areal`")


def _import_areal() -> tuple[Any, str | None]:
    try:
        import areal
        from areal.api.cli_args import RejectionSamplingConfig
        from areal.utils.functional import functional
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] == "areal":
            return None, INSTALL_HINT
        return None, f"areal is installed but does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return types.SimpleNamespace(areal=areal, F=functional, RSConfig=RejectionSamplingConfig), None


def _import_actor() -> tuple[Any, str | None]:
    try:
        from areal.trainer.ppo import actor
        from areal.utils import constants
    except Exception as exc:  # noqa: BLE001
        return None, (f"areal.trainer.ppo.actor does not import ({type(exc).__name__}: {exc}): areal.trainer imports "
                      "every trainer and its stats loggers (swanlab, trackio, wandb, tensorboardX)")
    return types.SimpleNamespace(actor=actor, constants=constants), None


def areal_config(cfg: Any) -> dict[str, Any]:
    """The ``RejectionSamplingConfig`` keyword arguments equivalent to a CorrectionConfig; Unsupported (with the
    reason) where AReaL has no equivalent."""
    if cfg.rollout_is is None:
        raise Unsupported("AReaL computes no mismatch metrics outside its loss and has no correction without the "
                          "behaviour weight (rejection_sampling=None does nothing)")
    if cfg.rollout_rs is not None or cfg.rollout_token_veto_threshold is not None:
        raise Unsupported("AReaL has no rejection that removes tokens from the loss: action='mask' zeroes the "
                          "behaviour weight and keeps the original denominator (IcePop-like), and always applies the "
                          "behaviour weight; rollout_rs / veto have no equivalent")
    if cfg.rollout_is_batch_normalize:
        raise Unsupported("AReaL has no batch normalization of the behaviour weights")
    if cfg.rollout_is == "sequence":
        raise Unsupported("AReaL's sequence-level behaviour weight is the geometric mean of the row's ratios "
                          "(rollout_is='geometric'); it has no product-ratio weight")
    lo, hi = cfg.is_bounds
    if hi <= 1.0:
        raise Unsupported(f"AReaL rejects upper ≤ 1 for metric='ratio' (got {hi!r})")
    level = "token" if cfg.rollout_is == "token" else "sequence"
    if lo is None:
        return dict(level=level, action="clamp", metric="ratio", agg="mean", upper=float(hi), lower=None)
    return dict(level=level, action="mask", metric="ratio", agg="mean", upper=float(hi),
                lower=None if lo == 0.0 else float(lo))


class ArealEngine(Engine):
    """AReaL 1.0.4's behaviour-policy correction (decoupled PPO) behind the engine protocol."""

    name = "areal"
    description = ("AReaL (areal==1.0.4) decoupled PPO: apply_rejection_sampling (behaviour IS weight π_prox/π_behave, "
                   "clamp = TIS, mask = IcePop, token or geometric sequence level), ppo_actor_loss_fn, "
                   "compute_prox_logp_approximations")

    def __init__(self) -> None:
        self._mods, self._reason = _import_areal()
        self._actor: Any = None
        self._actor_reason: str | None = self._reason
        if self._mods is not None:
            self._actor, self._actor_reason = _import_actor()
        #: AReaL's own updated loss_mask of the last rollout_correction call (the adapter reports the input mask)
        self.last_areal_mask: torch.Tensor | None = None

    def version(self) -> str:
        if self._mods is None:
            return "areal not installed"
        return f"areal {getattr(self._mods.areal, '__version__', '?')}"

    def capabilities(self) -> CapabilityMap:
        keys = ("rollout_correction", "rollout_correction.geometric", "rollout_correction.veto",
                "rollout_correction.loss", "rollout_correction.proximal", "rollout_correction.decoupled")
        if self._mods is None:
            return dict.fromkeys(keys, self._reason or INSTALL_HINT)
        return {
            "rollout_correction": True,
            "rollout_correction.geometric": True,
            "rollout_correction.veto": "AReaL has no veto (a row rejected when any token's ratio is below τ)",
            "rollout_correction.loss": "AReaL's ppo_actor_loss_fn takes no external IS weights: its behaviour weight "
                                       "is computed inside from π_prox/π_behave (CORR-DPPO-001 checks that loss)",
            "rollout_correction.proximal": True if self._actor is not None else (self._actor_reason or INSTALL_HINT),
            "rollout_correction.decoupled": True,
        }

    def _require(self) -> Any:
        if self._mods is None:
            raise Unsupported(self._reason or INSTALL_HINT)
        return self._mods

    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        from fp8rl.reference.correction import CorrectionResult

        mods = self._require()
        kwargs = areal_config(config)
        if train_logp.shape != rollout_logp.shape or train_logp.shape != mask.shape:
            raise ValueError(f"shape mismatch: {tuple(train_logp.shape)}, {tuple(rollout_logp.shape)}, "
                             f"{tuple(mask.shape)}")  # AReaL's own check compares prox/old and prox/mask only
        if not bool((mask != 0).any()):
            raise ValueError("mask: expected at least one valid token (AReaL returns weights for an empty batch)")
        res = mods.F.apply_rejection_sampling(
            proximal_logprobs=train_logp, old_logprobs=rollout_logp, loss_mask=mask, cu_seqlens=None,
            config=mods.RSConfig(**kwargs))
        self.last_areal_mask = res.loss_mask
        key = "is_fraction_truncated" if kwargs["action"] == "clamp" else "is_oob_fraction"
        weights = res.behave_imp_weight.to(train_logp.dtype if train_logp.is_floating_point() else torch.float32)
        return CorrectionResult(weights, mask.clone(), {key: float(res.filtered_fraction)})

    def decoupled_loss(self, logp, prox_logp, behave_logp, advantages, mask, loss_config, correction_config):
        mods = self._require()
        if loss_config.kind != "ppo_clip" or loss_config.agg != "token-mean":
            raise Unsupported("AReaL's ppo_actor_loss_fn is PPO-clip with a token-mean (sum / original count)")
        loss, _ = mods.F.ppo_actor_loss_fn(
            logprobs=logp, proximal_logprobs=prox_logp, old_logprobs=behave_logp, advantages=advantages,
            eps_clip=loss_config.clip_ratio_low, loss_mask=mask != 0, eps_clip_higher=loss_config.clip_ratio_high,
            c_clip=loss_config.clip_ratio_c, rejection_sampling=mods.RSConfig(**areal_config(correction_config)),
            importance_sampling_level="token")
        return loss

    def proximal_logp(self, behave_logp, theta_logp, versions, current_version, method):
        self._require()
        if self._actor is None:
            raise Unsupported(self._actor_reason or INSTALL_HINT)
        c = self._actor.constants
        names = {"loglinear": c.PROX_APPROX_METHOD_LOGLINEAR, "linear": c.PROX_APPROX_METHOD_LINEAR,
                 "rollout": c.PROX_APPROX_METHOD_ROLLOUT}
        if method not in names:
            raise Unsupported(f"AReaL has no proximal approximation {method!r}")
        got = self._actor.actor.compute_prox_logp_approximations(
            old_logp=behave_logp, logprobs=theta_logp, versions=versions, current_version=current_version,
            method=names[method])
        return got[names[method]]


__all__ = ["AREAL_VERSION", "ArealEngine", "areal_config"]
