"""The end-to-end mismatch experiment shared by the e2e checks, the report section and the budget calibration.

One *case* = (engine, tiny model, weights variant, recipe): the engine starts a rollout policy, generates
``N_NEW`` tokens from each fixed prompt twice — greedy, then sampled at temperature 1 (seed ``SAMPLE_SEED``) — and
the BF16 trainer oracle (:class:`fp8rl.reference.rollout.RolloutPolicy` with recipe ``bf16``, teacher-forced)
scores the sampled tokens. Mismatch metrics (:func:`~fp8rl.reference.rollout.mismatch_metrics`) come from the
sampled rollout; the first divergence position compares the greedy tokens with the trainer's own greedy
continuation (full forward per step, no cache).

The budgets' calibration, which runs this experiment for the reference engine over alternative seeds and writes
``fp8rl/data/e2e_budgets.json``, is :mod:`fp8rl.conformance._e2e_calibrate`
(``python -m fp8rl.conformance._e2e_calibrate --seeds 10 --write``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from fp8rl import fixtures, tolerances
from fp8rl.reference import rollout_hf as R

#: the Qwen fixtures and the family fixtures the oracle rolls out (fixtures.E2E_FAMILY_MODELS: each needs the
#: engine's ``rollout.<family>``, fp8rl.capabilities.family_keys)
MODELS: tuple[str, ...] = fixtures.TINY_MODELS + fixtures.E2E_FAMILY_MODELS
RECIPES: tuple[str, ...] = tuple(R.RECIPES)
FP8_RECIPES: tuple[str, ...] = tuple(r for r in RECIPES if r != "bf16")
#: the models every recipe runs on; the architecture-variant fixtures (shared-expert MoE without QK-norm, tied
#: embeddings with no projection dimension a multiple of 128) run VARIANT_RECIPES only: BF16 (the engine's own
#: model code on the architecture) and fp8-all (FP8 linear layers, KV cache and query on it) — CI time
MATRIX_MODELS: tuple[str, ...] = ("tiny-qwen3", "tiny-qwen3-moe")
VARIANT_RECIPES: tuple[str, ...] = ("bf16", "fp8-all")


#: the microscaling recipes (docs/microscaling.md) and the one matrix model each runs on: mxfp8 on the dense model,
#: nvfp4-experts (NVFP4 on the routed experts only) on the MoE. mxfp8 on the MoE is calibrated (400 runs) but not
#: checked: its k3 KL tail (routing flips under MXFP8 activations) reaches 0.363 at the checks' own seed 0, 3.5x the
#: maximum of the 400 held-out calibration runs, so a max-based budget would false-alarm (docs/microscaling.md)
MX_CASES: dict[str, str] = {"mxfp8": "tiny-qwen3", "nvfp4-experts": "tiny-qwen3-moe"}


def case_reason(engine: Any, model: str, recipe: str) -> str | None:
    """Why ``engine`` does not run the case (model, recipe): the first missing capability and its reason."""
    from fp8rl.capabilities import family_keys
    from fp8rl.checks import capability_reason

    for key in (f"rollout.{recipe}", *family_keys("rollout", model)):
        reason = capability_reason(engine, key)
        if reason is not None:
            return f"{key}: {reason}"
    return None


def require_model(engine: Any, model: str) -> None:
    """Skip the running check with the engine's reason unless it declares the model's ``rollout.<family>``."""
    from fp8rl.capabilities import family_keys
    from fp8rl.checks import require

    require(engine, *family_keys("rollout", model))


#: the recipes of an MLA fixture: without an FP8 KV cache (the oracle's FP8 KV emulation caches each head's K/V;
#: MLA engines cache the compressed latent, which it does not emulate: fp8rl.reference.rollout_hf refuses)
MLA_RECIPES: tuple[str, ...] = ("bf16", "fp8-linear")


def recipes_for(model: str) -> tuple[str, ...]:
    """The recipes the e2e area runs on ``model``."""
    if "mla" in fixtures.model_families(model):
        return MLA_RECIPES
    if model not in MATRIX_MODELS:
        return VARIANT_RECIPES
    return tuple(r for r in RECIPES if R.RECIPES[r].mx is None or MX_CASES.get(r) == model)


#: every (model, recipe) case of the e2e area
CASES: tuple[tuple[str, str], ...] = tuple((m, r) for m in MODELS for r in recipes_for(m))
N_NEW = 20
SAMPLE_SEED = 1234
METRICS = ("k3_kl", "token_mult_prob_error", "max_abs_dlogp")


def prompts() -> torch.Tensor:
    return fixtures.prompt_ids()


def prompt_len() -> int:
    return int(prompts().shape[1])


# ----------------------------------------------------------------------------------------------------------------
# oracle (engine-independent, cached per process)


@functools.lru_cache(maxsize=8)
def oracle(model: str, variant: str = "base") -> R.RolloutPolicy:
    """The BF16 trainer policy of a tiny model fixture."""
    m = fixtures.tiny_model(model, variant)
    return R.RolloutPolicy(m.config, m.state_dict, "bf16")


@functools.lru_cache(maxsize=8)
def oracle_greedy(model: str, variant: str = "base") -> torch.Tensor:
    return oracle(model, variant).greedy_full(prompts(), N_NEW)


# ----------------------------------------------------------------------------------------------------------------
# one case


@dataclass
class CaseResult:
    model: str
    variant: str
    recipe: str
    metrics: dict[str, float]
    dlogp_by_position: list[float]  # mean over prompts of |Δlogp| at each generated position (sampled rollout)
    first_divergence: list[int]  # per prompt (greedy rollout)
    extra: dict[str, Any] = field(default_factory=dict)


def measure(engine: Any, model: str, recipe: str, *, variant: str = "base", seed: int = SAMPLE_SEED,
            state: Any = None, config: Any = None, trainer: R.RolloutPolicy | None = None,
            trainer_greedy: torch.Tensor | None = None) -> CaseResult:
    """Run one case on ``engine`` (any object with the rollout ops; a GuardedEngine in checks)."""
    m = fixtures.tiny_model(model, variant) if state is None else None
    cfg = config if config is not None else m.config  # type: ignore[union-attr]
    sd = state if state is not None else m.state_dict  # type: ignore[union-attr]
    trainer = trainer or oracle(model, variant)
    ref_greedy = trainer_greedy if trainer_greedy is not None else oracle_greedy(model, variant)
    p, plen = prompts(), prompt_len()
    handle = engine.rollout_init(cfg, sd, recipe)
    # greedy first: the FP8 KV scales are calibrated on that first batch (the prompts' prefill), as in the update check
    tok_g, lp_g = engine.rollout(handle, p, N_NEW, greedy=True, seed=seed)  # validated by GuardedEngine
    tok_s, lp_s = engine.rollout(handle, p, N_NEW, greedy=False, seed=seed)
    lp_old = trainer.score(tok_s, plen)
    metrics = R.mismatch_metrics(lp_s, lp_old)
    fd = R.first_divergence(tok_g, ref_greedy, plen)
    metrics["first_div_mean"] = float(fd.double().mean())
    metrics["first_div_min"] = float(fd.min())
    return CaseResult(model, variant, recipe, metrics, (lp_s - lp_old).abs().mean(0).tolist(), fd.tolist(),
                      extra={"greedy": (tok_g, lp_g), "sampled": (tok_s, lp_s)})


# ----------------------------------------------------------------------------------------------------------------
# per-engine cache (checks of one engine share the rollouts; the report section is built from it)

_CACHE: dict[tuple[int, str, str, str, int], tuple[Any, CaseResult | BaseException]] = {}


def sampling_seed(run_seed: int) -> int:
    """The rollout sampling seed of a run: ``SAMPLE_SEED + run seed`` (``fp8rl conformance --seed N``; seed 0 is the
    seed the budgets were first measured at, a sweep ``--seeds A..B`` samples fresh tokens at every seed)."""
    return SAMPLE_SEED + int(run_seed)


def cached_case(engine: Any, model: str, recipe: str, variant: str = "base", *, run_seed: int = 0) -> CaseResult:
    """:func:`measure` once per (engine, model, variant, recipe, seed) per process; re-raises a cached failure."""
    key = (id(engine), model, variant, recipe, int(run_seed))
    hit = _CACHE.get(key)
    if hit is None:
        try:
            res: CaseResult | BaseException = measure(engine, model, recipe, variant=variant,
                                                      seed=sampling_seed(run_seed))
        except (Exception, pytest.skip.Exception) as exc:  # noqa: BLE001 - replayed to the check that owns it
            res = exc
        _CACHE[key] = hit = (engine, res)  # the engine is kept alive so that its id is not reused
    res = hit[1]
    if isinstance(res, BaseException):
        raise res
    return res


#: engines whose rollout configurations were pre-started (id → engine, kept alive so that the id is not reused)
_PRESTARTED: dict[int, Any] = {}


def prestart(engine: Any) -> None:
    """Optional engine hook: an engine that starts a process per rollout configuration (vLLM: ~20 s per
    ``vllm.LLM``) may define ``prestart_rollouts(cases)`` (cases: ``[(config, state_dict, recipe)]``) to start
    every configuration the mismatch section needs at once. Called once per engine; any failure is left to
    ``rollout_init`` of the case (which then reports it)."""
    inner = getattr(engine, "inner", engine)
    hook = getattr(inner, "prestart_rollouts", None)
    if hook is None or id(engine) in _PRESTARTED:
        return
    _PRESTARTED[id(engine)] = engine
    cases = []
    for model, recipe in CASES:
        if case_reason(engine, model, recipe) is None and (id(engine), model, "base", recipe) not in _CACHE:
            m = fixtures.tiny_model(model)
            cases.append((m.config, m.state_dict, recipe))
    try:
        hook(cases)
    except Exception:  # noqa: BLE001, S110 - each case reports its own failure from rollout_init
        pass


def budget(metric: str, model: str, recipe: str) -> float:
    return tolerances.e2e_budget(metric, model, recipe)


def budget_violations(metrics: dict[str, float], model: str, recipe: str) -> list[str]:
    """The metrics of :data:`METRICS` over their e2e budget for ``model`` under ``recipe`` (empty when within all)."""
    out = []
    for metric in METRICS:
        b = budget(metric, model, recipe)
        v = metrics[metric]
        if not v <= b:
            out.append(f"{metric} = {v:.4g} > budget {b:.4g}")
    return out


def within_budget(res: CaseResult) -> list[str]:
    """Budget violations of a case ("" list when within every budget)."""
    return budget_violations(res.metrics, res.model, res.recipe)


def checkpoint_recipe(layout: str | None) -> str:
    """The e2e recipe whose budgets a model loaded from a checkpoint of ``layout`` (fp8rl.engine.CHECKPOINT_LAYOUTS)
    is held to (CKPT-LOAD-005, ``fp8rl checkpoint-matrix``): ``fp8-linear-ptpc`` for the compressed-tensors channel
    layout, whose config prescribes dynamic per-token FP8 activations (a correct loader runs W8A8 with per-channel
    weight scales: that recipe's numerics), ``bf16`` otherwise (the other layouts' dynamic activation scheme is also
    FP8, but their budgets were measured for W8A16 loaders; docs/checkpoint.md)."""
    return "fp8-linear-ptpc" if layout == "compressed-tensors-channel" else "bf16"


@functools.lru_cache(maxsize=8)
def checkpoint_oracle_scored(path: str, sampling_seed: int = SAMPLE_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probs) of the oracle's dequantized model of a checkpoint directory
    (rollout_hf.checkpoint_policy): the e2e prompts, :data:`N_NEW` tokens sampled at temperature 1 from that model,
    scored teacher-forced by it (CKPT-LOAD-005 and ``fp8rl checkpoint-matrix``; cached per path and seed)."""
    policy = R.checkpoint_policy(path)
    tokens = policy.generate(prompts(), N_NEW, greedy=False, seed=sampling_seed).tokens
    return tokens, policy.score(tokens, prompt_len())


def fmt_case(res: CaseResult) -> str:
    m = res.metrics
    fd = f", first divergence per prompt {res.first_divergence}" if res.first_divergence else ""
    return (f"{res.model} [{res.variant}] {res.recipe}: k3 KL {m['k3_kl']:.3g}, token_mult_prob_error "
            f"{m['token_mult_prob_error']:.4f}, max |Δlogp| {m['max_abs_dlogp']:.3g}, mean |Δlogp| "
            f"{m['mean_abs_dlogp']:.3g}{fd}")


# ----------------------------------------------------------------------------------------------------------------
# self-consistency of a rollout (capability rollout.logits): reported log-probs, greedy tokens and samples against
# the logits the engine exposes

#: the goodness-of-fit batch: every fixed prompt GOF_COPIES times (a GRPO-style group), GOF_NEW sampled tokens each
GOF_COPIES = 64
GOF_NEW = 16


@dataclass
class LogitsRollout:
    """One ``rollout_logits`` call, validated: tokens (B, P + N) int64, logprobs (B, N) fp32, logits (B, N, V) fp32
    (CPU)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    logits: torch.Tensor
    prompt_len: int

    @property
    def new(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]


def rollout_logits(engine: Any, handle: Any, prompts_: torch.Tensor, max_new: int, *, greedy: bool, seed: int,
                   vocab: int) -> LogitsRollout:
    """``engine.rollout_logits`` with its output validated (EngineError names what is wrong)."""
    from fp8rl.engine import EngineError

    out = engine.rollout_logits(handle, prompts_, max_new, greedy=greedy, seed=seed)
    what = f"{engine.name}.rollout_logits"
    if not isinstance(out, tuple) or len(out) != 3:
        raise EngineError(f"{what}: expected a (tokens, logprobs, logits) tuple, got {type(out).__name__}")
    tokens, logprobs, logits = (t.cpu() if isinstance(t, torch.Tensor) else t for t in out)
    b, p = prompts_.shape
    for name, t, shape, dtype in (("tokens", tokens, (b, p + max_new), torch.int64),
                                  ("logprobs", logprobs, (b, max_new), torch.float32),
                                  ("logits", logits, (b, max_new, vocab), torch.float32)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise EngineError(f"{what}: {name}: expected {dtype} {shape}, got {got}")
    if not torch.equal(tokens[:, :p], prompts_.cpu()):
        raise EngineError(f"{what}: tokens do not start with the prompts")
    new = tokens[:, p:]
    if bool(((new < 0) | (new >= vocab)).any()):
        raise EngineError(f"{what}: token ids outside [0, {vocab})")
    if not bool(torch.isfinite(logprobs).all()) or bool(torch.isnan(logits).any()) or \
            bool(torch.isposinf(logits).any()) or not bool(torch.isfinite(logits).any(-1).all()):
        raise EngineError(f"{what}: non-finite log-probs, or logits rows with NaN/+inf or no finite entry")
    return LogitsRollout(tokens, logprobs, logits, p)


@dataclass
class LogitsCase:
    """The standard case's greedy and sampled rollouts through ``rollout_logits``, and ``rollout``'s (from the
    mismatch case) for the same arguments."""

    greedy: LogitsRollout
    sampled: LogitsRollout
    rollout_greedy: tuple[torch.Tensor, torch.Tensor]
    rollout_sampled: tuple[torch.Tensor, torch.Tensor]


_LOGITS_CACHE: dict[tuple, tuple[Any, LogitsCase | BaseException]] = {}


def _cached(cache: dict, key: tuple, engine: Any, fn) -> Any:
    hit = cache.get(key)
    if hit is None:
        try:
            res = fn()
        except (Exception, pytest.skip.Exception) as exc:  # noqa: BLE001 - replayed to the check that owns it
            res = exc
        cache[key] = hit = (engine, res)
    if isinstance(hit[1], BaseException):
        raise hit[1]
    return hit[1]


def logits_case(engine: Any, model: str, recipe: str, *, run_seed: int = 0) -> LogitsCase:
    """The mismatch case's rollouts again through ``rollout_logits`` (a fresh handle, greedy then sampled, the same
    seed), once per (engine, model, recipe, seed) per process."""

    def run() -> LogitsCase:
        case = cached_case(engine, model, recipe, run_seed=run_seed)
        m = fixtures.tiny_model(model)
        seed, v = sampling_seed(run_seed), int(fixtures.text_config(m.config)["vocab_size"])
        handle = engine.rollout_init(m.config, m.state_dict, recipe)
        g = rollout_logits(engine, handle, prompts(), N_NEW, greedy=True, seed=seed, vocab=v)
        smp = rollout_logits(engine, handle, prompts(), N_NEW, greedy=False, seed=seed, vocab=v)
        return LogitsCase(g, smp, case.extra["greedy"], case.extra["sampled"])

    return _cached(_LOGITS_CACHE, (id(engine), model, recipe, int(run_seed)), engine, run)


def gof_rollout(engine: Any, model: str, recipe: str, *, run_seed: int = 0) -> LogitsRollout:
    """The goodness-of-fit batch: each fixed prompt GOF_COPIES times, GOF_NEW tokens sampled at temperature 1."""

    def run() -> LogitsRollout:
        m = fixtures.tiny_model(model)
        p = prompts().repeat_interleave(GOF_COPIES, dim=0)
        handle = engine.rollout_init(m.config, m.state_dict, recipe)
        return rollout_logits(engine, handle, p, GOF_NEW, greedy=False, seed=sampling_seed(run_seed),
                              vocab=int(fixtures.text_config(m.config)["vocab_size"]))

    return _cached(_LOGITS_CACHE, ("gof", id(engine), model, recipe, int(run_seed)), engine, run)


def logprob_excess(r: LogitsRollout) -> tuple[torch.Tensor, torch.Tensor]:
    """|reported log-prob − fp64 log_softmax(logits)[token]| and its fp32 bound (B, N) each."""
    want = torch.log_softmax(r.logits.double(), -1).gather(-1, r.new[..., None]).squeeze(-1)
    err = (r.logprobs.double() - want).abs()
    err[torch.isnan(err) | ~torch.isfinite(want)] = math.inf  # a token of probability 0 was drawn
    bound = tolerances.rollout_logprob_fp32_bound(r.logits, r.new)
    return err, torch.where(torch.isfinite(want), bound, 0.0)


def argmax_violations(r: LogitsRollout) -> torch.Tensor:
    """Positions (B, N) bool where the greedy token is not maximal in its logits row (ties: any maximal token)."""
    tok = r.logits.gather(-1, r.new[..., None]).squeeze(-1)
    return tok < r.logits.amax(-1)


def pit_values(r: LogitsRollout, seed: int) -> torch.Tensor:
    """Randomized probability integral transform of every sampled token under its row's softmax (fp64), the
    vocabulary ordered by decreasing probability (ties by token id): U = P(before t) + W·p_t, W ~ U(0, 1) from a
    generator seeded with ``seed``. i.i.d. Uniform(0, 1) when each token is drawn from its row."""
    p = torch.softmax(r.logits.double(), -1).reshape(-1, r.logits.shape[-1])
    t = r.new.reshape(-1)
    pt = p.gather(-1, t[:, None])
    ids = torch.arange(p.shape[-1])
    before = (p > pt) | ((p == pt) & (ids[None, :] < t[:, None]))
    w = torch.rand(t.shape[0], generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
    return ((p * before).sum(-1) + w * pt.squeeze(-1)).clamp(0.0, 1.0)


def ks_uniform(u: torch.Tensor) -> float:
    """Kolmogorov–Smirnov distance of the empirical CDF of ``u`` from Uniform(0, 1)."""
    x = u.double().sort().values
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - x, x - (i - 1) / n).max())


def gof_tv_allowance(r: LogitsRollout) -> float:
    """Total-variation allowance of the GoF threshold: fp32 log-softmax rounding (exp(max bound) − 1 over every row)
    plus a sampler's fp32 random numbers (V·2^-23); see the tolerance ``rollout_gof``."""
    b = float(tolerances.rollout_logprob_fp32_bound(r.logits).max())
    return math.expm1(b) + r.logits.shape[-1] * 2.0**-23


# ----------------------------------------------------------------------------------------------------------------
# report section


def mismatch_section(engine: Any, run_seed: int = 0) -> dict[str, Any]:
    """The ``mismatch`` report section for ``engine``: a table (model × recipe) and per-model plots of the mean
    per-token |Δlogp| along the generated sequence, one series per recipe (recipes the engine lacks are listed)."""

    cols = ["model", "recipe", "k3 KL", "budget", "token_mult_prob_error", "budget", "max |Δlogp|", "budget",
            "mean |Δlogp|", "first divergence (mean)", "floor", "first divergence (min)"]
    rows: list[list[Any]] = []
    plots = []
    notes = []
    prestart(engine)
    for model in MODELS:
        series: dict[str, list[float]] = {}
        for recipe in recipes_for(model):
            reason = case_reason(engine, model, recipe)
            if reason is not None:
                notes.append(f"{model}/{recipe}: not run ({reason})")
                continue
            try:
                r = cached_case(engine, model, recipe, run_seed=run_seed)
            except (Exception, pytest.skip.Exception) as exc:  # noqa: BLE001
                notes.append(f"{model}/{recipe}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            m = r.metrics
            rows.append([model, recipe, m["k3_kl"], budget("k3_kl", model, recipe), m["token_mult_prob_error"],
                         budget("token_mult_prob_error", model, recipe), m["max_abs_dlogp"],
                         budget("max_abs_dlogp", model, recipe), m["mean_abs_dlogp"], m["first_div_mean"],
                         budget("first_div_mean", model, recipe), m["first_div_min"]])
            series[recipe] = r.dlogp_by_position
        if series:
            plots.append({"type": "lines", "title": f"{model}: mean |Δlogp| per generated token vs the BF16 trainer",
                          "x": list(range(N_NEW)), "series": series, "xlabel": "generated token position",
                          "ylabel": "mean |log π_rollout − log π_trainer|", "yscale": "log"})
    p = prompts()
    text = (f"Rollouts of {p.shape[0]} fixed prompts ({p.shape[1]} tokens) × {N_NEW} new tokens on the tiny "
            f"fixtures; KL metrics over the sampled rollout (temperature 1, seed {sampling_seed(run_seed)}) scored by the BF16 "
            "trainer (teacher-forced transformers forward); first divergence: greedy rollout vs the trainer's own "
            f"greedy continuation ({N_NEW} = no divergence). Budgets: fp8rl.tolerances 'e2e.*' (measured distribution of "
            "the reference FP8 emulation, with margins).")
    if notes:
        text += " " + " ".join(notes)
    sec: dict[str, Any] = {"title": "FP8 rollout vs BF16 trainer: mismatch per recipe", "text": text,
                           "table": {"columns": cols, "rows": rows}}
    if plots:
        sec["plot"] = plots
    return sec
