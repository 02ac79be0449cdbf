"""TRL as an engine under test for the rollout-correction area (``trl==1.16.0``: GRPO's vLLM importance sampling).

TRL computes its train/rollout mismatch correction inside one trainer method,
``trl.trainer.grpo_trainer.GRPOTrainer._generate_and_score_completions``: it pads the completions, recomputes
``old_per_token_logps`` with the model, forms ``(old_per_token_logps − sampling_per_token_logps) · mask`` (NaN → 0),
sums it per row for the ``sequence_*`` modes, exponentiates, and truncates (``*_truncate``: clamp to [clip_min,
clip_max]) or masks (``*_mask``: ratios outside [clip_min, clip_max] set to 0) it; the result is the batch's
``importance_sampling_ratio``, which ``_compute_loss`` multiplies into the per-token loss before the completion mask.
It logs ``sampling/importance_sampling_ratio/{min,mean,max}`` and ``sampling/sampling_logp_difference/{mean,max}``.

The adapter runs that method for real, unbound (``GRPOTrainer._generate_and_score_completions(stub, inputs)``), on
a stand-in ``self`` (:class:`_GrpoSelf`) that supplies only the trainer's inputs: ``_generate`` returns the batch's
completions (one token id per valid position, rows right-padded by TRL itself) with the rollout log-probs as vLLM's
``logprobs``; ``_get_per_token_logps_and_entropies`` returns the batch's train log-probs as the model's recomputed
``old_per_token_logps``; one reward function returns 0 (advantages are not part of the correction); no reference
model (``beta = 0``), no tools, no images. Every line of the method runs as TRL wrote it.

Mapping (:func:`trl_mode`): ``rollout_is`` token/sequence × TIS U (``clip_max = U``, no ``clip_min``) →
``token_truncate`` / ``sequence_truncate``; IcePop/MIS "lo_hi" → ``token_mask`` / ``sequence_mask`` with
``clip_min = lo`` (None for lo = 0: MIS with an upper bound only — TRL's default, ``sequence_mask``, clip_max 3).
Reported weights: TRL's ``importance_sampling_ratio`` (a (B, 1) sequence ratio broadcast) × the completion mask —
the factor ``_compute_loss`` applies to each token (TRL's own tensor is exp(0) = 1 at padding, masked later) — padded
back to the batch's length; the mask is unchanged (TRL rejects nothing from the loss). Metrics: ratio min → ``
is_weight_min``, max → ``is_weight_max``, mean → ``is_weight_mean`` (token modes) / ``is_weight_row_mean``
(sequence modes: TRL averages the per-sequence ratios), logp difference mean/max → ``abs_logp_diff_mean/max``.
TRL has no geometric level, batch normalization, rejection sampling (``rollout_rs``) or veto, and reports no KL /
perplexity / ESS metrics.

Install: ``nox -s conformance_trl`` (``locks/trl.txt``), by hand ``pip install -c constraints.txt -e '.[trl]'`` —
trl's requirements (accelerate, datasets, transformers, pandas, pyarrow) are all CPU packages.
"""

from __future__ import annotations

import collections
import types
from typing import Any

import torch
from fp8rl.engine import CapabilityMap, Engine, Unsupported

TRL_VERSION = "1.16.0"
INSTALL_HINT = f"trl not installed: pip install trl=={TRL_VERSION}, or run `nox -s conformance_trl`"

#: TRL metric (``self._metrics['train']`` key) → the suite's canonical name; the ratio mean depends on the level
METRIC_MAP: dict[str, str] = {
    "sampling/importance_sampling_ratio/min": "is_weight_min",
    "sampling/importance_sampling_ratio/max": "is_weight_max",
    "sampling/sampling_logp_difference/mean": "abs_logp_diff_mean",
    "sampling/sampling_logp_difference/max": "abs_logp_diff_max",
}
RATIO_MEAN = "sampling/importance_sampling_ratio/mean"


def _import_trl() -> tuple[Any, str | None]:
    try:
        import trl
        from accelerate import PartialState
        from trl.trainer.grpo_trainer import GRPOTrainer
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] == "trl":
            return None, INSTALL_HINT
        return None, f"trl is installed but does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return types.SimpleNamespace(trl=trl, GRPOTrainer=GRPOTrainer, PartialState=PartialState), None


def trl_mode(cfg: Any) -> tuple[str, float | None, float]:
    """(vllm_importance_sampling_mode, clip_min, clip_max) for a CorrectionConfig; Unsupported where TRL has none."""
    if cfg.rollout_is is None:
        raise Unsupported("TRL computes its mismatch correction and metrics only with "
                          "vllm_importance_sampling_correction=True (an IS mode)")
    if cfg.rollout_rs is not None or cfg.rollout_token_veto_threshold is not None:
        raise Unsupported("TRL has no rejection sampling of tokens or sequences (rollout_rs) and no veto")
    if cfg.rollout_is_batch_normalize:
        raise Unsupported("TRL has no batch normalization of the IS ratios")
    if cfg.rollout_is == "geometric":
        raise Unsupported("TRL has no geometric-mean IS level (modes: token_/sequence_ × truncate/mask)")
    lo, hi = cfg.is_bounds
    if lo is None:
        return f"{cfg.rollout_is}_truncate", None, float(hi)
    return f"{cfg.rollout_is}_mask", (None if lo == 0.0 else float(lo)), float(hi)


class _Accelerator:
    """The single-process accelerator the method asks for (device, gather, process index)."""

    device = torch.device("cpu")
    process_index = 0
    num_processes = 1
    is_main_process = True

    def gather(self, t):
        return t

    def unwrap_model(self, model):
        return model


class _Model(torch.nn.Module):
    is_gradient_checkpointing = False


class _GrpoSelf:
    """The stand-in ``self`` of ``GRPOTrainer._generate_and_score_completions`` (see the module docstring)."""

    def __init__(self, train_logp: torch.Tensor, rollout_logp: torch.Tensor, lengths: list[int], mode: str,
                 clip_min: float | None, clip_max: float) -> None:
        rows = len(lengths)
        self.accelerator = _Accelerator()
        self.model = _Model()
        self.model.train()
        self.environment_factories = None
        self.tools = None
        self.environments: list = []
        self._tokenizer = types.SimpleNamespace(pad_token_id=0)
        self.pad_to_multiple_of = None
        self.mask_truncated_completions = False
        self.args = types.SimpleNamespace(per_device_train_batch_size=rows, per_device_eval_batch_size=rows,
                                          steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1,
                                          gradient_checkpointing_kwargs=None)
        self.num_iterations = 1
        self.use_vllm = True
        self.vllm_importance_sampling_correction = True
        self.vllm_importance_sampling_mode = mode
        self.vllm_importance_sampling_clip_min = clip_min
        self.vllm_importance_sampling_clip_max = clip_max
        self.beta = 0.0
        self._metrics: dict[str, collections.defaultdict[str, list]] = {
            "train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
        dq = collections.deque
        self._logs: dict[str, Any] = {"prompt": dq(), "completion": dq(), "rewards": collections.defaultdict(dq), "advantages": dq(),
                      "extra": collections.defaultdict(dq), "images": dq()}
        self._pending_extra_logs: dict = {}
        self._pending_metrics: dict = {}
        self.num_generations = 1
        self.num_generations_eval = 1
        self.multi_objective_aggregation = "sum_then_normalize"
        self.scale_rewards = "none"
        self.reward_funcs = [None]
        self.reward_func_names = ["zero"]
        self.reward_weights = torch.ones(1)
        self.log_multimodal = False
        self._train = train_logp
        self._rollout = [[float(v) for v in rollout_logp[i, :n].tolist()] for i, n in enumerate(lengths)]
        self._lengths = lengths

    def _generate(self, prompts):
        n = len(self._lengths)
        return ([[1] for _ in range(n)], [[1] * k for k in self._lengths], None, ["x"] * n, self._rollout, {}, None,
                [None] * n)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return self._train[:, :logits_to_keep].clone(), None, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return torch.zeros(len(self._lengths), 1)


class TrlEngine(Engine):
    """TRL 1.16.0's GRPO vLLM importance-sampling correction behind the engine protocol."""

    name = "trl"
    description = ("TRL (trl==1.16.0) GRPOTrainer._generate_and_score_completions: vLLM importance sampling, "
                   "token_/sequence_ × truncate/mask, with its sampling/* metrics")

    def __init__(self) -> None:
        self._mods, self._reason = _import_trl()
        if self._mods is not None:
            self._mods.PartialState()  # accelerate's single-process state (gather_object asks for it)

    def version(self) -> str:
        if self._mods is None:
            return "trl not installed"
        return f"trl {getattr(self._mods.trl, '__version__', '?')}"

    def capabilities(self) -> CapabilityMap:
        keys = ("rollout_correction", "rollout_correction.geometric", "rollout_correction.veto",
                "rollout_correction.loss")
        if self._mods is None:
            return dict.fromkeys(keys, self._reason or INSTALL_HINT)
        return {
            "rollout_correction": True,
            "rollout_correction.geometric": "TRL has no geometric-mean IS level",
            "rollout_correction.veto": "TRL has no veto",
            "rollout_correction.loss": "TRL's GRPO loss (_compute_loss) takes one advantage per completion (B,) "
                                       "and has no REINFORCE loss; CORR-LOSS-001/002 use per-token advantages "
                                       "(its `delta` equals the dual clip c for delta ≥ 1 + epsilon_high)",
            "rollout_correction.proximal": "TRL has no decoupled PPO / proximal policy",
            "rollout_correction.decoupled": "TRL has no decoupled PPO / proximal policy",
        }

    def rollout_correction(self, train_logp, rollout_logp, mask, config):
        from fp8rl.reference.correction import CorrectionResult

        if self._mods is None:
            raise Unsupported(self._reason or INSTALL_HINT)
        mode, cmin, cmax = trl_mode(config)
        if train_logp.shape != rollout_logp.shape or train_logp.shape != mask.shape or mask.dim() != 2:
            raise ValueError(f"shape mismatch: train_logp {tuple(train_logp.shape)}, rollout_logp "
                             f"{tuple(rollout_logp.shape)}, mask {tuple(mask.shape)} (TRL takes per-row lists)")
        m = mask.detach() != 0
        lengths = [int(n) for n in m.sum(-1).tolist()]
        cols = torch.arange(mask.shape[1])
        if not bool((m == (cols[None, :] < torch.tensor(lengths)[:, None])).all()):
            raise ValueError("mask: TRL's completions are right-padded; expected each row's valid tokens first")
        stub = _GrpoSelf(train_logp.detach(), rollout_logp.detach(), lengths, mode, cmin, cmax)
        out = self._mods.GRPOTrainer._generate_and_score_completions(stub, [{"prompt": "p"} for _ in lengths])
        ratio = out["importance_sampling_ratio"]
        cmask = out["completion_mask"]
        dtype = train_logp.dtype if train_logp.is_floating_point() else torch.float32
        weights = torch.zeros(mask.shape, dtype=dtype)
        t = cmask.shape[1]
        weights[:, :t] = (ratio.expand(cmask.shape) * cmask).to(dtype)
        metrics: dict[str, float] = {}
        got = stub._metrics["train"]
        for key, name in METRIC_MAP.items():
            if key in got:
                metrics[name] = float(got[key][-1])
        if RATIO_MEAN in got:
            metrics["is_weight_mean" if mode.startswith("token") else "is_weight_row_mean"] = float(got[RATIO_MEAN][-1])
        return CorrectionResult(weights, mask.clone(), metrics)


__all__ = ["METRIC_MAP", "TRL_VERSION", "TrlEngine", "trl_mode"]
