"""``fp8rl parity``: toy GRPO learning curves — FP8 rollouts with a correction vs BF16 rollouts, same trainer.

    fp8rl parity --engine reference --recipe fp8-all --correction tis          # writes ./fp8rl-parity
    fp8rl parity --recipe fp8-linear --correction none --seeds 8 --steps 60 --out DIR
    fp8rl parity --control noise --sigma 0.5,1,2,4,8                           # a positive control, swept

The enumerable toy policy of :mod:`fp8rl.reference.learning` (1-layer Qwen3, vocabulary 8, 3-token responses,
reward = token sum divisible by ``--modulus``) is trained with GRPO for ``--steps`` steps: each step the engine
rolls out ``--groups`` × ``--group-size`` responses from the current weights (synced to the engine in BF16 through
its ``update_weights``), under numerics recipe R; the trainer (float32 master weights, teacher-forced log-probs)
computes group-normalized advantages, the rollout correction C from its own and the engine's reported log-probs
(the oracle's :func:`fp8rl.reference.correction.rollout_correction`) and the PPO-clip loss (one update per batch,
so the clip is inactive), and takes an Adam step. Three conditions share every seed: ``bf16`` (recipe bf16, no
correction: the baseline), ``R+none`` and ``R+C``. Per step: mean reward, k3 mismatch KL, the fraction of tokens
TIS truncates, gradient norm, and the cosine of the step's gradient with the baseline's gradient at the same step
(same seed).

Verdict (:func:`judge`): the paired bootstrap (over seeds) of the reward gap (condition − baseline) of the mean reward
over the run (the learning curve's area: the toy task saturates, so the final reward alone cannot tell learning
speeds apart; the final reward gap over the last ``--final`` steps is reported too), with its power: the minimum gap
the seeds detect at 80 % power (paired two-sided t-test, α = 0.05), MDE = (t_{0.975,n−1} + t_{0.8,n−1})·sd/√n from
the SD of the paired differences (floored at the rewards' rounding; fewer than 3 seeds are always underpowered).
"does not match BF16" when the 95 % CI lies entirely beyond ±δ; else
"underpowered: need N seeds" when δ < MDE (no verdict; N from the same formula); else "matches BF16 within δ" when
the CI lies inside [−δ, δ] and "does not match" when it crosses ±δ.

Regime options (docs/learning-parity.md, "A regime where correction matters"; the defaults leave the measured
configuration's results unchanged): ``--stale K`` rolls the recipe's conditions out from the trainer's weights K
steps old (asynchronous RL's off-policy lag; the ``bf16`` baseline stays synchronous: the learning the pipeline must
match); ``--metric exact`` judges the trainer's exact expected reward J(θ) = Σ_s π_θ(s) R(s) per step (every response
enumerated) instead of the rollouts' mean reward, which also counts the rollout policy's own reward; ``--vocab``,
``--horizon`` and ``--logit-gain`` (a sharper initial policy) change the toy task.

Positive controls (``--control``, :mod:`fp8rl.parity_controls`): conditions built to be wrong, which must get "does
not match"; ``--sigma``/``--temperature`` sweeps their strength and parity.json records the smallest value caught.

Output: ``parity.json`` and a self-contained ``parity.html`` with the curves. Exit codes: 0 when R+C matches, 1 when
it does not, 4 (``EXIT_INCOMPLETE``) when it is underpowered, 2 on a usage error. With ``--control``: 0 when parity
caught the control (for a sweep: at least one value), 1 when it said "matches" for every value, 4 otherwise.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    import torch

#: correction names of the command → the learning oracle's corrections
CORRECTIONS = {"none": "none", "tis": "token-tis", "seq-tis": "seq-tis", "is": "is", "icepop": "icepop",
               "rs": "rs"}

#: the curve the verdict judges: the mean reward of the step's rollouts (the default), or the trainer's exact expected
#: reward J(θ) = Σ_s π_θ(s) R(s) before the step's update, by enumerating the vocab^horizon responses. The rollout
#: reward mixes learning with the rollout policy's own reward (a noisier or staler sampler collects less from the same
#: policy); the exact one is learning only
METRICS = ("rollout", "exact")
EXACT_MAX = 4096


@dataclass(frozen=True)
class ParityConfig:
    engine: str = "reference"
    recipe: str = "fp8-all"
    correction: str = "tis"
    seeds: int = 8
    steps: int = 30
    groups: int = 8
    group_size: int = 8
    lr: float = 0.005
    modulus: int = 5
    final: int = 10
    delta: float = 0.05
    boot: int = 2000
    #: options of the regime search (docs/learning-parity.md, "A regime where correction matters"); the defaults are
    #: the measured configuration's and leave its results unchanged
    stale: int = 0  #: rollouts from the trainer's weights ``stale`` steps old (asynchronous RL's off-policy lag)
    metric: str = "rollout"  #: judged curve: "rollout" (the rollouts' mean reward) or "exact" (J(θ) by enumeration)
    vocab: int = 8
    horizon: int = 3
    logit_gain: float = 2.0  #: initial lm_head scale (toy_state_dict): larger = a sharper, lower-entropy policy

    def validate(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"--correction: expected one of {sorted(CORRECTIONS)}, got {self.correction!r}")
        for name in ("seeds", "steps", "groups", "group_size", "final", "boot"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected ≥ 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"--group-size: expected ≥ 2 (GRPO normalizes within a group), got {self.group_size}")
        if self.final > self.steps:
            raise ValueError(f"--final: expected ≤ --steps ({self.steps}), got {self.final}")
        if not (self.lr > 0 and self.delta > 0):
            raise ValueError(f"--lr and --delta: expected > 0, got {self.lr}, {self.delta}")
        if self.modulus < 2:
            raise ValueError(f"--modulus: expected ≥ 2, got {self.modulus}")
        if int(self.stale) < 0:
            raise ValueError(f"--stale: expected ≥ 0, got {self.stale}")
        if self.metric not in METRICS:
            raise ValueError(f"--metric: expected one of {list(METRICS)}, got {self.metric!r}")
        if not (math.isfinite(self.logit_gain) and self.logit_gain > 0):
            raise ValueError(f"--logit-gain: expected a finite number > 0, got {self.logit_gain}")
        from fp8rl.reference.learning import ToyTask

        try:
            ToyTask(vocab=self.vocab, horizon=self.horizon, modulus=self.modulus)
        except ValueError as exc:
            raise ValueError(f"--vocab/--horizon: {exc}") from None
        if self.metric == "exact" and self.vocab ** self.horizon > EXACT_MAX:
            raise ValueError(f"--metric exact: enumerates vocab^horizon responses per step; expected ≤ {EXACT_MAX}, "
                             f"got {self.vocab}^{self.horizon}")

    def task(self):
        from fp8rl.reference.learning import ToyTask

        return ToyTask(vocab=self.vocab, horizon=self.horizon, modulus=self.modulus)


def _trainer(cfg: dict, sd: dict):
    import torch
    from fp8rl.reference.rollout_hf import build_hf_model, to_model_state_dict

    model = build_hf_model(cfg, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict({k: v.float() for k, v in to_model_state_dict(sd).items()}, strict=False)
    model.train(False)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _bf16_state(model) -> dict[str, torch.Tensor]:
    import torch

    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items() if "rotary" not in k}


def run_one(engine, task, cfg: dict, sd: dict, recipe: str, correction: str, seed: int, pc: ParityConfig,
            ref_grads: list[torch.Tensor] | None = None, correct=None) -> dict[str, Any]:
    """One GRPO run: per-step metrics and the step gradients (flattened). ``correct`` replaces the oracle's
    ``rollout_correction(train_logp, rollout_logp, mask, config)`` (a positive control's broken op)."""
    import torch
    from fp8rl.reference import correction as C
    from fp8rl.reference.learning import correction_config

    correct = correct or C.rollout_correction

    torch.manual_seed(seed)
    model = _trainer(cfg, sd)
    params = [p for p in model.parameters()]
    opt = torch.optim.Adam(params, lr=pc.lr)
    handle = engine.rollout_init(cfg, _bf16_state(model), recipe)
    ccfg = correction_config(CORRECTIONS[correction])
    loss_cfg = C.LossConfig(kind="ppo_clip", agg="token-mean")
    n = pc.groups * pc.group_size
    p_len = len(task.prompt)
    out: dict[str, list[float]] = {k: [] for k in ("reward", "k3", "tis_clip", "grad_norm", "cos_bf16")}
    if pc.metric == "exact":
        out["exact_reward"] = []
        from fp8rl.reference.learning import enumerate_sequences

        all_resp = enumerate_sequences(task)
        all_tok = torch.cat([task.prompt_tensor(all_resp.shape[0]), all_resp], 1)
        all_r = task.reward(all_resp)
    grads: list[torch.Tensor] = []
    history = [_bf16_state(model)] if pc.stale else []  # the synced weights of steps 0..step (stale rollouts)
    for step in range(pc.steps):
        if step and pc.stale:
            history.append(_bf16_state(model))
            if len(history) > pc.stale + 1:
                history.pop(0)
            if step > pc.stale:  # steps 1..stale roll out from the initial weights the engine already holds
                handle = engine.update_weights(handle, history[0])
        elif step:
            handle = engine.update_weights(handle, _bf16_state(model))
        if pc.metric == "exact":
            with torch.no_grad():
                lg = model(input_ids=all_tok, use_cache=False).logits[:, p_len - 1:-1].double()
                seq_lp = torch.log_softmax(lg, -1).gather(-1, all_resp[:, :, None]).squeeze(-1).sum(-1)
            out["exact_reward"].append(float((seq_lp.exp() * all_r).sum()))
        res = engine.rollout(handle, task.prompt_tensor(n), task.horizon, greedy=False,
                             seed=seed * 100_003 + step)
        tokens, roll_lp = res[0].clone(), res[1].clone().double()
        resp = tokens[:, p_len:]
        r = task.reward(resp)
        g = r.reshape(pc.groups, pc.group_size)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).reshape(-1)
        logits = model(input_ids=tokens, use_cache=False).logits[:, p_len - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, resp[:, :, None]).squeeze(-1)
        mask = torch.ones_like(roll_lp)
        corr = correct(lp.detach().double(), roll_lp, mask, ccfg)
        w = corr.weights
        loss = C.policy_loss(lp, lp.detach(), adv[:, None].expand_as(lp), corr.mask, w, loss_cfg)
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).detach().double()
        grads.append(flat)
        opt.step()
        out["reward"].append(float(r.mean()))
        out["k3"].append(float(corr.metrics.get("kl_k3", float("nan"))))
        out["tis_clip"].append(float(corr.metrics.get("is_fraction_truncated", 0.0)))
        out["grad_norm"].append(float(flat.norm()))
        if ref_grads is not None:
            ref = ref_grads[step]
            den = float(flat.norm() * ref.norm())
            out["cos_bf16"].append(float(flat @ ref) / den if den > 0 else float("nan"))
        else:
            out["cos_bf16"].append(1.0)
    return {"metrics": out, "grads": grads}


def paired_bootstrap(diffs: list[float], boot: int, seed: int = 0) -> tuple[float, float, float]:
    """(mean, 2.5%, 97.5%) of the mean of paired differences, resampling seeds with replacement."""
    import torch

    d = torch.tensor(diffs, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, d.numel(), (boot, d.numel()), generator=gen)
    means = d[idx].mean(1)
    return float(d.mean()), float(torch.quantile(means, 0.025)), float(torch.quantile(means, 0.975))


#: the verdicts of a condition against the baseline (parity.json ``verdicts[name]["verdict"]``)
VERDICTS = ("matches", "does-not-match", "underpowered")


def min_detectable_gap(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean gap a paired two-sided t-test at level ``alpha`` detects with probability ``power``
    from ``n`` paired seeds whose differences have standard deviation ``sd``:
    MDE = (t_{1−α/2, n−1} + t_{power, n−1}) · sd / √n (inf below 2 seeds: no spread to estimate)."""
    from scipy import stats

    if n < 2:
        return math.inf
    dof = n - 1
    return float((stats.t.ppf(1 - alpha / 2, dof) + stats.t.ppf(power, dof)) * sd / math.sqrt(n))


#: the fewest paired seeds a verdict other than "underpowered" rests on: with 2, the SD has one degree of freedom
#: and the bootstrap "CI" is the two differences themselves
MIN_SEEDS = 3


def seeds_needed(sd: float, delta: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """The fewest paired seeds (≥ :data:`MIN_SEEDS`) whose :func:`min_detectable_gap` at this ``sd`` is ≤ ``delta``."""
    from scipy import stats

    if not delta > 0:
        raise ValueError(f"delta: expected > 0, got {delta}")
    if sd <= 0:
        return MIN_SEEDS
    # the normal quantiles are below the t quantiles: their n is a lower bound, and MDE falls as n grows
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n = max(MIN_SEEDS, math.floor((z * sd / delta) ** 2))
    while min_detectable_gap(sd, n, alpha, power) > delta:
        n += 1
    return n


def judge(name: str, diffs: list[float], delta: float, boot: int, resolution: float = 0.0) -> dict[str, Any]:
    """The verdict on the paired differences (condition − baseline) of the run-mean reward, with its power.

    The SD of the differences is floored at ``resolution``/√6: a run-mean reward is a multiple of ``resolution``
    (1 / responses per run), so equal differences (ties, common with few short runs) give an SD of 0 that only says
    the spread is below the rounding (a difference of two rounded values has SD resolution/√6).

    - fewer than :data:`MIN_SEEDS` seeds: "underpowered";
    - the 95 % bootstrap CI lies entirely beyond ±δ: "does-not-match" (a gap larger than δ is shown; power does
      not matter);
    - else, δ is below the minimum detectable gap at 80 % power: "underpowered" (neither a match nor a mismatch can
      be claimed; the seeds that would do are named);
    - else "matches" when the CI lies inside [−δ, δ], "does-not-match" when it crosses ±δ."""
    if not delta > 0:
        raise ValueError(f"delta: expected > 0, got {delta}")
    if not resolution >= 0:
        raise ValueError(f"resolution: expected ≥ 0, got {resolution}")
    mean, lo, hi = paired_bootstrap(diffs, boot)
    n = len(diffs)
    sd_obs = statistics.stdev(diffs) if n >= 2 else None
    sd = None if sd_obs is None else max(sd_obs, resolution / math.sqrt(6))
    mde = None if sd is None else min_detectable_gap(sd, n)
    need = None if sd is None else seeds_needed(sd, delta)
    head = f"mean-reward gap over the run {mean:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}]"
    power = "" if sd is None else (f"minimum detectable gap at 80% power {mde:.4f} (SD of the paired differences "
                                   f"{sd:.4f}, {n} seeds)")
    if n < MIN_SEEDS:
        verdict = "underpowered"
        text = (f"{name}: underpowered: need ≥ {max(MIN_SEEDS, need or 0)} seeds — {n} paired seed{'s' * (n != 1)} "
                f"cannot carry a verdict; no parity verdict. {head}" + (f"; {power}" if power else ""))
    elif lo > delta or hi < -delta:
        verdict = "does-not-match"
        text = f"{name} does NOT match BF16 within δ = {delta}: {head} lies beyond ±δ; {power}"
    elif mde is None or not mde <= delta:
        verdict = "underpowered"
        text = f"{name}: underpowered: need {need} seeds — δ = {delta} is below the {power}; no parity verdict. {head}"
    elif -delta <= lo and hi <= delta:
        verdict = "matches"
        text = f"{name} matches BF16 within δ = {delta}: {head}; {power}"
    else:
        verdict = "does-not-match"
        text = f"{name} does NOT match BF16 within δ = {delta}: {head} crosses ±δ; {power}"
    return {"reward_gap": mean, "ci95": [lo, hi], "verdict": verdict, "matches": verdict == "matches",
            "sd_diff": sd, "sd_observed": sd_obs, "mde80": mde, "seeds_needed": need, "text": text}


def _conditions(pc: ParityConfig, control: str | None, values) -> list:
    from fp8rl.parity_controls import Condition, control_conditions

    base = [Condition("bf16", "bf16", "none")]
    if control is not None:
        return base + control_conditions(control, pc.correction, values)
    conds = base + [Condition(f"{pc.recipe}+none", pc.recipe, "none")]
    if pc.correction != "none":
        conds.append(Condition(f"{pc.recipe}+{pc.correction}", pc.recipe, pc.correction))
    return conds


def run_parity(pc: ParityConfig, progress=None, *, control: str | None = None,
               values: tuple[float, ...] | None = None) -> dict[str, Any]:
    """Train every condition on every seed and judge each against the bf16 baseline (:func:`judge`). With
    ``control`` (``fp8rl.parity_controls.CONTROLS``), the conditions are the baseline and that positive control's,
    one per value of its σ or temperature (``values``; None: its defaults), on the reference engine; parity.json's
    ``control`` names the conditions parity caught and the smallest value it caught."""
    from fp8rl.reference.learning import toy_config, toy_state_dict
    from fp8rl.reference.rollout import single_thread
    from fp8rl.registry import load_engine

    pc.validate()
    if control is not None and pc.engine != "reference":
        raise ValueError(f"--engine: the positive controls run on the reference engine, got {pc.engine!r}")
    engine = load_engine(pc.engine)
    task = pc.task()
    cfg = toy_config(task)
    conditions = _conditions(pc, control, values)
    runs: dict[str, list[dict[str, list[float]]]] = {c.name: [] for c in conditions}
    t0 = time.time()
    for seed in range(pc.seeds):
        sd = toy_state_dict(cfg, seed, logit_gain=pc.logit_gain)
        base = None
        for c in conditions:
            with single_thread():  # an 11k-parameter model gains nothing from threads; contention costs 3-5x
                # the baseline is synchronous BF16 whatever --stale says: what an asynchronous pipeline must match
                res = run_one(c.engine or engine, task, cfg, sd, c.recipe, c.correction, seed,
                              pc if base is not None or not pc.stale else replace(pc, stale=0),
                              ref_grads=None if base is None else base["grads"], correct=c.correct)
            if base is None:
                base = res
            runs[c.name].append(res["metrics"])
            if progress:
                progress(f"seed {seed} {c.name}: final reward "
                         f"{sum(res['metrics']['reward'][-pc.final:]) / pc.final:.3f} ({time.time() - t0:.0f} s)")
    key = "exact_reward" if pc.metric == "exact" else "reward"
    finals = {name: [sum(m[key][-pc.final:]) / pc.final for m in ms] for name, ms in runs.items()}
    curves = {name: [sum(m[key]) / len(m[key]) for m in ms] for name, ms in runs.items()}
    verdicts = {}
    for c in conditions[1:]:
        name = c.name
        v = judge(name, [a - b for a, b in zip(curves[name], curves["bf16"], strict=True)], pc.delta, pc.boot,
                  resolution=1.0 / (pc.groups * pc.group_size * pc.steps) if key == "reward" else 0.0)
        fmean, flo, fhi = paired_bootstrap([a - b for a, b in zip(finals[name], finals["bf16"], strict=True)],
                                           pc.boot)
        cos = [x for m in runs[name] for x in m["cos_bf16"] if math.isfinite(x)]
        v.update({"final_reward_gap": fmean, "final_ci95": [flo, fhi],
                  "mean_grad_cosine": sum(cos) / len(cos) if cos else float("nan")})
        v["text"] += f"; final reward gap {fmean:+.4f} [{flo:+.4f}, {fhi:+.4f}]"
        verdicts[name] = v
    out = {"config": asdict(pc), "engine": engine.name, "task": asdict(task), "conditions": [c.name for c in conditions],
           "final_rewards": finals, "mean_rewards": curves, "runs": runs, "verdicts": verdicts,
           "wall_s": time.time() - t0}
    if control is not None:
        from fp8rl.parity_controls import CONTROLS, PARAMETER

        caught = {c.name: verdicts[c.name]["verdict"] == "does-not-match" for c in conditions[1:]}
        detected = [c.strength for c in conditions[1:] if caught[c.name]]
        param = PARAMETER[control]
        smallest = min(x for x in detected if x is not None) if any(x is not None for x in detected) else None
        out["control"] = {"name": control, "breaks": CONTROLS[control], "caught": caught, "parameter": param,
                          "values": [c.strength for c in conditions[1:]], "smallest_detected": smallest,
                          f"smallest_{param}_detected": smallest}
    return out


# ----------------------------------------------------------------------------------------------------------------
# HTML

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def _svg(title: str, series: dict[str, list[list[float]]], width: int = 460, height: int = 220) -> str:
    """Line plot of the seed-mean of each series (shaded: min–max over seeds)."""
    vals = [v for runs in series.values() for run in runs for v in run if math.isfinite(v)]
    if not vals:
        return f"<p>{html.escape(title)}: no data</p>"
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        hi = lo + 1.0
    steps = max(len(run) for runs in series.values() for run in runs)
    pad = 36

    def xy(i: int, v: float) -> str:
        x = pad + (width - pad - 8) * i / max(steps - 1, 1)
        y = height - pad + (-(height - pad - 12)) * (v - lo) / (hi - lo)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" style="font:11px sans-serif">',
             f'<text x="{pad}" y="10">{html.escape(title)}</text>',
             f'<text x="2" y="{height - pad}">{lo:.3g}</text><text x="2" y="20">{hi:.3g}</text>']
    for k, (name, runs) in enumerate(series.items()):
        col = _COLORS[k % len(_COLORS)]
        mean = [sum(r[i] for r in runs) / len(runs) for i in range(steps)]
        mn = [min(r[i] for r in runs) for i in range(steps)]
        mx = [max(r[i] for r in runs) for i in range(steps)]
        band = " ".join(xy(i, v) for i, v in enumerate(mx)) + " " + " ".join(
            xy(i, v) for i, v in reversed(list(enumerate(mn))))
        parts.append(f'<polygon points="{band}" fill="{col}" opacity="0.12"/>')
        parts.append(f'<polyline points="{" ".join(xy(i, v) for i, v in enumerate(mean))}" fill="none" '
                     f'stroke="{col}" stroke-width="1.6"/>')
        parts.append(f'<text x="{width - 150}" y="{24 + 13 * k}" fill="{col}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(result: dict[str, Any]) -> str:
    pc = result["config"]
    ctl = result.get("control")
    control = "" if ctl is None else (
        f"<p><b>Positive control {html.escape(ctl['name'])}</b>: {html.escape(ctl['breaks'])}. Parity must say "
        f"'does not match' for each control condition; smallest {ctl['parameter']} it did: {ctl['smallest_detected']}.</p>")
    rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{v['reward_gap']:+.4f} [{v['ci95'][0]:+.4f}, "
                   f"{v['ci95'][1]:+.4f}]</td><td>{v['final_reward_gap']:+.4f} [{v['final_ci95'][0]:+.4f}, "
                   f"{v['final_ci95'][1]:+.4f}]</td><td>{v['mean_grad_cosine']:.4f}</td>"
                   f"<td>{'—' if v['mde80'] is None else format(v['mde80'], '.4f')} ({v['seeds_needed'] or '≥ 2'} seeds needed)</td><td><b>{html.escape(v['verdict'])}</b></td></tr>"
                   for n, v in result["verdicts"].items())
    plots = "".join(_svg(title, {n: [m[key] for m in result["runs"][n]] for n in result["conditions"]})
                    for key, title in (("reward", "mean reward"), ("k3", "k3 mismatch KL"),
                                       ("tis_clip", "fraction of tokens TIS truncates"),
                                       ("grad_norm", "gradient norm"), ("cos_bf16", "gradient cosine to the BF16 run")))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>fp8rl parity</title>
<style>body{{font:14px sans-serif;margin:2em;max-width:1000px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}svg{{margin:6px;border:1px solid #eee}}</style></head><body>
<h1>fp8rl parity — toy GRPO, engine {html.escape(result['engine'])}</h1>{control}
<p>Recipe <b>{html.escape(pc['recipe'])}</b>, correction <b>{html.escape(pc['correction'])}</b>; {pc['seeds']} seeds ×
{pc['steps']} steps, {pc['groups']} groups × {pc['group_size']} responses, Adam lr {pc['lr']}; toy task: vocabulary
{result['task']['vocab']}, {result['task']['horizon']}-token responses, reward = token sum divisible by
{result['task']['modulus']}. Verdict: paired bootstrap (over seeds) of the gap in mean reward over the run vs the
BF16 baseline; "matches" when the 95% CI lies inside ±{pc['delta']} and ±{pc['delta']} is at least the gap the
seeds detect with 80% power ("underpowered" otherwise; final reward: last {pc['final']} steps). Toy scale on CPU: this shows the
mechanism, not the size of the effect at LLM scale.</p>
<table><tr><th>condition</th><th>mean-reward gap [95% CI]</th><th>final reward gap [95% CI]</th><th>mean gradient cosine to BF16</th>
<th>minimum detectable gap (80% power)</th><th>verdict</th></tr>{rows}</table>
<div>{plots}</div><p>wall time {result['wall_s']:.0f} s</p></body></html>
"""


def register(subparsers: Any) -> None:
    """Add the ``parity`` subcommand (fp8rl.cli EXTRA_COMMAND_MODULES)."""
    from fp8rl.parity_controls import CONTROLS

    d = ParityConfig()
    p = subparsers.add_parser("parity", help="toy GRPO learning curves: FP8 rollouts + correction vs BF16 rollouts "
                                             "(paired-bootstrap verdict with its power; --control: positive controls)")
    p.add_argument("--engine", default=d.engine, help=f"rollout engine (default {d.engine})")
    p.add_argument("--recipe", default=d.recipe, help=f"numerics recipe of the FP8 runs (default {d.recipe})")
    p.add_argument("--correction", default=d.correction, choices=sorted(CORRECTIONS),
                   help=f"rollout correction (default {d.correction}: token TIS, U = 2)")
    p.add_argument("--control", choices=sorted(CONTROLS), default=None,
                   help="run a positive control instead of --recipe: a condition parity must call 'does not match' "
                        "(" + "; ".join(f"{k}: {v}" for k, v in CONTROLS.items()) + ")")
    p.add_argument("--sigma", default=None,
                   help="logit-noise σ of --control noise (comma-separated: a sweep; default 0.5,1,2,4,8) or of "
                        "--control inverted-ratio (one value; default 1)")
    p.add_argument("--temperature", default=None,
                   help="sampling temperature of --control wrong-policy (comma-separated: a sweep; default 3)")
    p.add_argument("--seeds", type=int, default=d.seeds, help=f"paired seeds (default {d.seeds})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"GRPO steps (default {d.steps})")
    p.add_argument("--groups", type=int, default=d.groups, help=f"groups per step (default {d.groups})")
    p.add_argument("--group-size", type=int, default=d.group_size, help=f"responses per group ({d.group_size})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    p.add_argument("--modulus", type=int, default=d.modulus, help=f"reward modulus (default {d.modulus})")
    p.add_argument("--final", type=int, default=d.final, help=f"steps averaged for the final reward ({d.final})")
    p.add_argument("--delta", type=float, default=d.delta, help=f"parity margin δ on the reward (default {d.delta})")
    p.add_argument("--stale", type=int, default=d.stale,
                   help="roll out from the trainer's weights this many steps old, as asynchronous RL does (default "
                        f"{d.stale}: on-policy up to the recipe's numerics)")
    p.add_argument("--metric", choices=METRICS, default=d.metric,
                   help=f"the curve judged: rollout (the rollouts' mean reward, default) or exact (the trainer's "
                        f"expected reward J(θ) by enumerating every response; vocab^horizon ≤ {EXACT_MAX})")
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"toy vocabulary (default {d.vocab})")
    p.add_argument("--horizon", type=int, default=d.horizon, help=f"response length in tokens (default {d.horizon})")
    p.add_argument("--logit-gain", type=float, default=d.logit_gain,
                   help=f"initial logit scale of the toy policy: larger = sharper (default {d.logit_gain})")
    p.add_argument("--out", default="fp8rl-parity", help="output directory (default ./fp8rl-parity)")
    p.set_defaults(func=_main)


#: a parity verdict → the command's exit code (the condition judged: --recipe+--correction)
VERDICT_EXIT = {"matches": EXIT_OK, "does-not-match": EXIT_FAIL, "underpowered": EXIT_INCOMPLETE}


def control_exit(result: dict[str, Any]) -> int:
    """Exit code of a control run: 0 when parity caught the control (said "does not match" for at least one of its
    conditions), 1 when it said "matches" for every one (blind to it), 4 otherwise (underpowered, nothing caught)."""
    verdicts = [v["verdict"] for v in result["verdicts"].values()]
    if "does-not-match" in verdicts:
        return EXIT_OK
    return EXIT_FAIL if all(v == "matches" for v in verdicts) else EXIT_INCOMPLETE


def _control_values(args: argparse.Namespace) -> tuple[float, ...] | None:
    """The control's strengths from --sigma/--temperature (validated), or None for its defaults."""
    from fp8rl.parity_controls import PARAMETER, control_conditions, parse_values

    given = {k: getattr(args, k) for k in ("sigma", "temperature") if getattr(args, k) is not None}
    if args.control is None:
        if given:
            raise ValueError(f"--{next(iter(given))}: applies to --control only")
        return None
    param = PARAMETER[args.control]
    for k in given:
        if k != param:
            raise ValueError(f"--{k}: the {args.control} control takes --{param}, not --{k}")
    if args.engine != "reference":
        raise ValueError(f"--engine: the positive controls run on the reference engine, got {args.engine!r}")
    values = parse_values(f"--{param}", given[param]) if param in given else None
    control_conditions(args.control, args.correction, values)
    return values


def _main(args: argparse.Namespace) -> int:
    try:
        pc = ParityConfig(engine=args.engine, recipe=args.recipe, correction=args.correction, seeds=args.seeds,
                          steps=args.steps, groups=args.groups, group_size=args.group_size, lr=args.lr,
                          modulus=args.modulus, final=args.final, delta=args.delta, stale=args.stale,
                          metric=args.metric, vocab=args.vocab, horizon=args.horizon, logit_gain=args.logit_gain)
        pc.validate()
        from fp8rl.reference.rollout import get_recipe

        get_recipe(pc.recipe)
        values = _control_values(args)
    except (ValueError, KeyError) as exc:
        print(f"fp8rl parity: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"fp8rl parity: --out: cannot create {out}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = run_parity(pc, progress=lambda s: print(s, flush=True), control=args.control, values=values)
    except Exception as exc:  # noqa: BLE001 - an engine that cannot load or roll out is a usage-level failure
        print(f"fp8rl parity: engine {pc.engine!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    (out / "parity.json").write_text(json.dumps(result, indent=1))
    (out / "parity.html").write_text(render_html(result))
    for v in result["verdicts"].values():
        print(v["text"])
    if args.control is not None:
        ctl = result["control"]
        caught = [n for n, c in ctl["caught"].items() if c]
        print(f"positive control {args.control}: parity caught {len(caught)} of {len(ctl['caught'])} conditions"
              + (f"; smallest {ctl['parameter']} detected {ctl['smallest_detected']:g}"
                 if ctl["smallest_detected"] is not None else ""))
    print(f"wall time {result['wall_s']:.0f} s; {out / 'parity.json'}, {out / 'parity.html'}")
    if args.control is not None:
        return control_exit(result)
    key = f"{pc.recipe}+{pc.correction}"
    return VERDICT_EXIT[result["verdicts"][key]["verdict"]]
