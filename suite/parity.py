"""``fp8rl parity``: toy GRPO learning curves — FP8 rollouts with a correction vs BF16 rollouts, same trainer.

    fp8rl parity --engine reference --recipe fp8-all --correction tis          # writes ./fp8rl-parity
    fp8rl parity --recipe fp8-linear --correction none --seeds 8 --steps 60 --out DIR

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

Verdict: the paired bootstrap (over seeds) of the reward gap (condition − baseline) of the mean reward over the
run (the learning curve's area: the toy task saturates, so the final reward alone cannot tell learning speeds apart;
the final reward gap over the last ``--final`` steps is reported too): "matches BF16 within δ" when the 95% CI lies
inside [−δ, δ]. Output: ``parity.json`` and a
self-contained ``parity.html`` with the curves. Exit 0 when R+C matches, 1 when it does not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    import torch

#: correction names of the command → the learning oracle's corrections
CORRECTIONS = {"none": "none", "tis": "token-tis", "seq-tis": "seq-tis", "is": "is", "icepop": "icepop",
               "rs": "rs"}


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
            ref_grads: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """One GRPO run: per-step metrics and the step gradients (flattened)."""
    import torch
    from fp8rl.reference import correction as C
    from fp8rl.reference.learning import correction_config

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
    grads: list[torch.Tensor] = []
    for step in range(pc.steps):
        if step:
            handle = engine.update_weights(handle, _bf16_state(model))
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
        corr = C.rollout_correction(lp.detach().double(), roll_lp, mask, ccfg)
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


def run_parity(pc: ParityConfig, progress=None) -> dict[str, Any]:
    from fp8rl.reference.learning import ToyTask, toy_config, toy_state_dict
    from fp8rl.registry import load_engine

    pc.validate()
    engine = load_engine(pc.engine)
    task = ToyTask(modulus=pc.modulus)
    cfg = toy_config(task)
    conditions = [("bf16", "bf16", "none"), (f"{pc.recipe}+none", pc.recipe, "none"),
                  (f"{pc.recipe}+{pc.correction}", pc.recipe, pc.correction)]
    if pc.correction == "none":
        conditions = conditions[:2]
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name, _, _ in conditions}
    t0 = time.time()
    for seed in range(pc.seeds):
        sd = toy_state_dict(cfg, seed)
        base = None
        for name, recipe, corr in conditions:
            res = run_one(engine, task, cfg, sd, recipe, corr, seed, pc,
                          ref_grads=None if base is None else base["grads"])
            if base is None:
                base = res
            runs[name].append(res["metrics"])
            if progress:
                progress(f"seed {seed} {name}: final reward "
                         f"{sum(res['metrics']['reward'][-pc.final:]) / pc.final:.3f} ({time.time() - t0:.0f} s)")
    finals = {name: [sum(m["reward"][-pc.final:]) / pc.final for m in ms] for name, ms in runs.items()}
    curves = {name: [sum(m["reward"]) / len(m["reward"]) for m in ms] for name, ms in runs.items()}
    verdicts = {}
    for name, _, _ in conditions[1:]:
        mean, lo, hi = paired_bootstrap([a - b for a, b in zip(curves[name], curves["bf16"], strict=True)], pc.boot)
        fmean, flo, fhi = paired_bootstrap([a - b for a, b in zip(finals[name], finals["bf16"], strict=True)],
                                           pc.boot)
        cos = [v for m in runs[name] for v in m["cos_bf16"] if math.isfinite(v)]
        ok = bool(-pc.delta <= lo and hi <= pc.delta)
        verdicts[name] = {"reward_gap": mean, "ci95": [lo, hi], "final_reward_gap": fmean, "final_ci95": [flo, fhi],
                          "matches": ok, "mean_grad_cosine": sum(cos) / len(cos) if cos else float("nan"),
                          "text": (f"{name} {'matches' if ok else 'does NOT match'} BF16 within δ = {pc.delta}: "
                                   f"mean-reward gap over the run {mean:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}]; "
                                   f"final reward gap {fmean:+.4f} [{flo:+.4f}, {fhi:+.4f}] ({pc.seeds} paired "
                                   f"seeds)")}
    return {"config": asdict(pc), "engine": engine.name, "task": asdict(task), "conditions": [c[0] for c in conditions],
            "final_rewards": finals, "mean_rewards": curves, "runs": runs, "verdicts": verdicts,
            "wall_s": time.time() - t0}


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
    rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{v['reward_gap']:+.4f} [{v['ci95'][0]:+.4f}, "
                   f"{v['ci95'][1]:+.4f}]</td><td>{v['final_reward_gap']:+.4f} [{v['final_ci95'][0]:+.4f}, "
                   f"{v['final_ci95'][1]:+.4f}]</td><td>{v['mean_grad_cosine']:.4f}</td>"
                   f"<td><b>{'matches' if v['matches'] else 'does not match'}</b></td></tr>"
                   for n, v in result["verdicts"].items())
    plots = "".join(_svg(title, {n: [m[key] for m in result["runs"][n]] for n in result["conditions"]})
                    for key, title in (("reward", "mean reward"), ("k3", "k3 mismatch KL"),
                                       ("tis_clip", "fraction of tokens TIS truncates"),
                                       ("grad_norm", "gradient norm"), ("cos_bf16", "gradient cosine to the BF16 run")))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>fp8rl parity</title>
<style>body{{font:14px sans-serif;margin:2em;max-width:1000px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}}svg{{margin:6px;border:1px solid #eee}}</style></head><body>
<h1>fp8rl parity — toy GRPO, engine {html.escape(result['engine'])}</h1>
<p>Recipe <b>{html.escape(pc['recipe'])}</b>, correction <b>{html.escape(pc['correction'])}</b>; {pc['seeds']} seeds ×
{pc['steps']} steps, {pc['groups']} groups × {pc['group_size']} responses, Adam lr {pc['lr']}; toy task: vocabulary
{result['task']['vocab']}, {result['task']['horizon']}-token responses, reward = token sum divisible by
{result['task']['modulus']}. Verdict: paired bootstrap (over seeds) of the gap in mean reward over the run vs the
BF16 baseline; "matches" when the 95% CI lies inside ±{pc['delta']} (final reward: last {pc['final']} steps). Toy scale on CPU: this shows the
mechanism, not the size of the effect at LLM scale.</p>
<table><tr><th>condition</th><th>mean-reward gap [95% CI]</th><th>final reward gap [95% CI]</th><th>mean gradient cosine to BF16</th>
<th>verdict</th></tr>{rows}</table>
<div>{plots}</div><p>wall time {result['wall_s']:.0f} s</p></body></html>
"""


def register(subparsers: Any) -> None:
    """Add the ``parity`` subcommand (fp8rl.cli EXTRA_COMMAND_MODULES)."""
    d = ParityConfig()
    p = subparsers.add_parser("parity", help="toy GRPO learning curves: FP8 rollouts + correction vs BF16 rollouts "
                                             "(paired-bootstrap verdict)")
    p.add_argument("--engine", default=d.engine, help=f"rollout engine (default {d.engine})")
    p.add_argument("--recipe", default=d.recipe, help=f"numerics recipe of the FP8 runs (default {d.recipe})")
    p.add_argument("--correction", default=d.correction, choices=sorted(CORRECTIONS),
                   help=f"rollout correction (default {d.correction}: token TIS, U = 2)")
    p.add_argument("--seeds", type=int, default=d.seeds, help=f"paired seeds (default {d.seeds})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"GRPO steps (default {d.steps})")
    p.add_argument("--groups", type=int, default=d.groups, help=f"groups per step (default {d.groups})")
    p.add_argument("--group-size", type=int, default=d.group_size, help=f"responses per group ({d.group_size})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    p.add_argument("--modulus", type=int, default=d.modulus, help=f"reward modulus (default {d.modulus})")
    p.add_argument("--final", type=int, default=d.final, help=f"steps averaged for the final reward ({d.final})")
    p.add_argument("--delta", type=float, default=d.delta, help=f"parity margin δ on the reward (default {d.delta})")
    p.add_argument("--out", default="fp8rl-parity", help="output directory (default ./fp8rl-parity)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        pc = ParityConfig(engine=args.engine, recipe=args.recipe, correction=args.correction, seeds=args.seeds,
                          steps=args.steps, groups=args.groups, group_size=args.group_size, lr=args.lr,
                          modulus=args.modulus, final=args.final, delta=args.delta)
        pc.validate()
        from fp8rl.reference.rollout import get_recipe

        get_recipe(pc.recipe)
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
        result = run_parity(pc, progress=lambda s: print(s, flush=True))
    except Exception as exc:  # noqa: BLE001 - an engine that cannot load or roll out is a usage-level failure
        print(f"fp8rl parity: engine {pc.engine!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    (out / "parity.json").write_text(json.dumps(result, indent=1))
    (out / "parity.html").write_text(render_html(result))
    for v in result["verdicts"].values():
        print(v["text"])
    print(f"wall time {result['wall_s']:.0f} s; {out / 'parity.json'}, {out / 'parity.html'}")
    key = f"{pc.recipe}+{pc.correction}"
    return EXIT_OK if result["verdicts"].get(key, {}).get("matches", False) else EXIT_FAIL
