"""KV-scale drift simulator: why Q/K/V scales must be recalibrated every RL step.

A tiny seeded attention stack (embedding → L × [RMSNorm → Q/K/V projections → per-head QK-norm with learnable
gains → RoPE → causal GQA attention → output projection, residual] → RMSNorm → LM head) takes RL-like steps:
every weight gets a small seeded random update (relative size ``noise``), and the QK-norm gains and the V
projection drift multiplicatively: up by ``growth`` per step (outlier K channels faster) for ``grow_steps``
steps, then down by ``shrink`` per step. This is the mechanism of docs/paper-numbers.md §2.5: post-QK-norm ranges move with the
weights, so scales computed once go stale — growing ranges saturate at ±448 (clipping the largest K entries,
which dominate the attention scores), shrinking ranges lose precision.

Per step the simulator computes, in fp64 and unquantized (the trainer's view), the rollout batch's per-layer
post-RoPE Q/K/V and the LM head's log-probs, plus calibration captures of a separate training batch split over
``ranks`` × ``micro_batches``. For each recalibration schedule (``never``, ``every-step``, ``every-N``) the
scales are recomputed with the chosen strategy (:mod:`fp8rl.reference.kv`: A engine-side first batch, B
trainer-side p99.9, C amax) when the schedule says so and pushed to an FP8 attention backend (the oracle, or an
engine under test). Reported per step:

* ``saturation``: fraction of rollout Q/K/V elements with |x/s| > max (all layers);
* ``attn_err``: max over layers of ‖ô − o‖_F/‖o‖_F, FP8 attention of the layer's reference Q/K/V vs fp64;
* ``logprob_div``: mean over positions of |log π_fp8(a_t) − log π(a_t)| for actions a_t sampled from π (the
  FP8 forward propagates through all layers), and ``kl``: mean token KL(π ‖ π_fp8).

The bound a schedule must hold at each step is relative to ``fresh`` — FP8 with per-step amax scales computed on
the rollout batch itself, the best any per-tensor calibration can do: attn_err ≤ κ_attn·fresh and
logprob_div ≤ κ_lp·fresh. The default factors :data:`KAPPA_ATTN_VS_FRESH` and :data:`KAPPA_LP_VS_FRESH` are the
values of the harness's tolerances ``kv_attention_vs_fresh`` and ``kv_drift_logprob_vs_fresh`` (whose derivations
say how they were measured); a caller may pass others to :func:`simulate`. This module imports nothing from the
harness; tests/oracle/test_kv_drift.py checks that the two stay equal.
The default config runs in well under a second per 10 steps on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from fp8rl.reference import kv as kvref
from fp8rl.reference.formats import get_format

SCHEDULES = ("never", "every-step", "every-n")

#: κ_attn: a schedule's attention error may be at most κ_attn × the fresh-amax FP8 error (tolerance
#: ``kv_attention_vs_fresh``: in-range rescaling gives ratios in [0.39, 1.49]; 2.0 = 1.49 + one third margin)
KAPPA_ATTN_VS_FRESH = 2.0
#: κ_lp: a schedule's log-prob divergence may be at most κ_lp × the fresh-amax divergence (tolerance
#: ``kv_drift_logprob_vs_fresh``: every-step recalibration measured in [0.85, 1.28])
KAPPA_LP_VS_FRESH = 2.0


@dataclass(frozen=True)
class DriftConfig:
    """Simulator configuration (all sizes tiny; the defaults run in < 1 s per 10 steps)."""

    steps: int = 24
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 128
    seq_len: int = 48
    batch: int = 4
    calib_batch: int = 8
    ranks: int = 2
    micro_batches: int = 2
    fmt: str = "e4m3fn"
    layout: str = "tensor"
    strategy: str = "trainer_p999"
    every_n: int = 5
    growth: float = 0.07
    grow_steps: int = 16
    shrink: float = 0.04
    noise: float = 0.01
    outlier_channels: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab", "seq_len",
                     "batch", "calib_batch", "ranks", "micro_batches", "every_n"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected a positive integer, got {val!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads: must be a multiple of n_kv_heads ({self.n_kv_heads}), got {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.calib_batch % (self.ranks * self.micro_batches):
            raise ValueError(f"calib_batch: must split into ranks × micro_batches = "
                             f"{self.ranks * self.micro_batches} parts, got {self.calib_batch}")
        if not 0 <= self.outlier_channels <= self.head_dim:
            raise ValueError(f"outlier_channels: expected 0..{self.head_dim}, got {self.outlier_channels}")
        if self.fmt not in kvref.KV_FORMATS:
            raise ValueError(f"fmt: expected one of {kvref.KV_FORMATS}, got {self.fmt!r}")
        if self.layout not in ("tensor", "head"):
            raise ValueError(f"layout: expected 'tensor' or 'head', got {self.layout!r}")
        strategy = kvref.strategy_name(self.strategy)
        if self.layout == "head" and strategy != "amax":
            raise ValueError(f"strategy: layout 'head' needs per-head scales (strategy 'amax'/C), got {self.strategy!r}")
        for name in ("growth", "shrink", "noise"):
            val = getattr(self, name)
            if not (isinstance(val, int | float) and math.isfinite(val) and val >= 0):
                raise ValueError(f"{name}: expected a finite non-negative number, got {val!r}")
        if self.grow_steps < 0:
            raise ValueError(f"grow_steps: expected ≥ 0, got {self.grow_steps!r}")


# ----------------------------------------------------------------------------------------------------------------
# the tiny model


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE over the last dim of x [B, T, H, D]."""
    _, t, _, d = x.shape
    half = d // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang)[None, :, None, :], torch.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class TinyAttentionStack:
    """Weights of the stack (fp64). Built by :meth:`init`; :meth:`rl_step` applies one seeded RL-like update."""

    cfg: DriftConfig
    emb: torch.Tensor
    lm_head: torch.Tensor
    wq: list[torch.Tensor]
    wk: list[torch.Tensor]
    wv: list[torch.Tensor]
    wo: list[torch.Tensor]
    log_gq: list[torch.Tensor]
    log_gk: list[torch.Tensor]
    log_gv: list[torch.Tensor]
    gen: torch.Generator = field(repr=False)

    @staticmethod
    def init(cfg: DriftConfig) -> TinyAttentionStack:
        g = torch.Generator().manual_seed(cfg.seed)
        d, dh, hq, hkv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

        def rnd(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) * std

        log_gk = []
        for _ in range(cfg.n_layers):
            lk = torch.zeros(dh, dtype=torch.float64)
            lk[: cfg.outlier_channels] = math.log(3.0)  # K outlier channels (pre-RoPE), as QK-normed LLMs show
            log_gk.append(lk)
        return TinyAttentionStack(
            cfg=cfg, emb=rnd(cfg.vocab, d, std=1.0), lm_head=rnd(cfg.vocab, d, std=1.0 / math.sqrt(d)),
            wq=[rnd(hq * dh, d, std=1 / math.sqrt(d)) for _ in range(cfg.n_layers)],
            wk=[rnd(hkv * dh, d, std=1 / math.sqrt(d)) for _ in range(cfg.n_layers)],
            wv=[rnd(hkv * dh, d, std=1 / math.sqrt(d)) for _ in range(cfg.n_layers)],
            wo=[rnd(d, hq * dh, std=0.25 / math.sqrt(hq * dh)) for _ in range(cfg.n_layers)],
            log_gq=[torch.zeros(dh, dtype=torch.float64) for _ in range(cfg.n_layers)],
            log_gk=log_gk, log_gv=[torch.zeros((), dtype=torch.float64) for _ in range(cfg.n_layers)], gen=g)

    def rl_step(self, step: int) -> None:
        """One RL-like update: W += noise·rms(W)·N(0, 1) for every matrix; the log QK-norm gains and the log V
        gain move by +growth (K outlier channels ×1.5, other K channels ×0.5, Q ×0.5, V ×1.0) for the first
        ``grow_steps`` steps and by −shrink afterwards, plus N(0, (growth/4)²) channel noise."""
        c = self.cfg
        drift = c.growth if step < c.grow_steps else -c.shrink
        g = self.gen

        def jitter(w: torch.Tensor) -> torch.Tensor:
            rms = float(w.pow(2).mean().sqrt())
            return w + c.noise * rms * torch.randn(w.shape, generator=g, dtype=torch.float64)

        for i in range(c.n_layers):
            self.wq[i], self.wk[i], self.wv[i], self.wo[i] = (jitter(w) for w in (self.wq[i], self.wk[i],
                                                                                 self.wv[i], self.wo[i]))
            noise_q = torch.randn(c.head_dim, generator=g, dtype=torch.float64) * c.growth / 4
            noise_k = torch.randn(c.head_dim, generator=g, dtype=torch.float64) * c.growth / 4
            per_k = torch.full((c.head_dim,), 0.5, dtype=torch.float64)
            per_k[: c.outlier_channels] = 1.5
            self.log_gq[i] = self.log_gq[i] + 0.5 * drift + noise_q
            self.log_gk[i] = self.log_gk[i] + per_k * drift + noise_k
            self.log_gv[i] = self.log_gv[i] + drift
        self.lm_head = jitter(self.lm_head)

    def forward(self, tokens: torch.Tensor,
                attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, list[kvref.Capture]]:
        """Log-probs [B, T, V] (fp64) and per-layer post-RoPE (q, k, v) of the attention inputs.

        ``attend(layer, q, k, v)`` replaces the fp64 causal attention (e.g. by FP8 attention); its output is
        used in fp64."""
        c = self.cfg
        b, t = tokens.shape
        x = self.emb[tokens]
        caps: list[kvref.Capture] = []
        for i in range(c.n_layers):
            h = _rms_norm(x)
            q = (h @ self.wq[i].T).reshape(b, t, c.n_heads, c.head_dim)
            k = (h @ self.wk[i].T).reshape(b, t, c.n_kv_heads, c.head_dim)
            v = (h @ self.wv[i].T).reshape(b, t, c.n_kv_heads, c.head_dim) * torch.exp(self.log_gv[i])
            q = _rope(_rms_norm(q) * torch.exp(self.log_gq[i]))
            k = _rope(_rms_norm(k) * torch.exp(self.log_gk[i]))
            caps.append((q, k, v))
            o = kvref.attention(q, k, v, causal=True) if attend is None else attend(i, q, k, v).double()
            x = x + o.reshape(b, t, -1) @ self.wo[i].T
        logits = _rms_norm(x) @ self.lm_head.T
        return torch.log_softmax(logits, dim=-1), caps


# ----------------------------------------------------------------------------------------------------------------
# FP8 attention backends


class OracleBackend:
    """FP8 attention with pushed per-layer scales, computed by the oracle (fp8rl.reference.kv)."""

    def __init__(self, fmt: str = "e4m3fn", layout: str = "tensor") -> None:
        self.policy = kvref.default_policy(fmt, layout)
        self.scales: dict[str, kvref.KVScales] = {}

    def push(self, key: str, scales: kvref.KVScales) -> None:
        self.scales[key] = scales

    def attend(self, key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = self.scales[key]
        kc = kvref.quantize_kv(k, s.k, self.policy)
        vc = kvref.quantize_kv(v, s.v, self.policy)
        out = kvref.fp8_attention(q, kc, vc, q_scale=s.q if self.policy.quantize_q else None,
                                  q_fmt=self.policy.q_fmt, q_quant_op=self.policy.q_quant_op, causal=True)
        assert isinstance(out, torch.Tensor)
        return out


class EngineBackend:
    """FP8 attention through an engine's model-level KV path (``kv_update_scales`` + ``kv_forward``, the
    fp8rl engine protocol): each drift key becomes the engine layer ``"<tag>/<key>"``."""

    def __init__(self, engine: Any, fmt: str = "e4m3fn", layout: str = "tensor", tag: str = "drift") -> None:
        self.engine, self.fmt, self.layout, self.tag = engine, fmt, layout, tag

    def push(self, key: str, scales: kvref.KVScales) -> None:
        self.engine.kv_update_scales(f"{self.tag}/{key}", scales)

    def attend(self, key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        res = self.engine.kv_forward(f"{self.tag}/{key}", q.float(), k.float(), v.float(), fmt=self.fmt,
                                     layout=self.layout, causal=True)
        if not isinstance(res, kvref.KVForward):
            raise TypeError(f"kv_forward returned {type(res).__name__}, expected KVForward")
        return res.out


# ----------------------------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class StepRecord:
    step: int
    recalibrated: bool
    saturation: float
    attn_err: float
    logprob_div: float
    kl: float
    k_scale: float  # layer 0 K scale in use (max over heads for per-head scales)


@dataclass
class DriftResult:
    config: DriftConfig
    every_n: int
    schedules: dict[str, list[StepRecord]]
    fresh: list[StepRecord]
    k_amax: list[float]  # max over layers of max|k| of the rollout batch, per step
    kappa_attn: float
    kappa_lp: float

    def attn_bound(self, step: int) -> float:
        return self.kappa_attn * self.fresh[step].attn_err

    def lp_bound(self, step: int) -> float:
        return self.kappa_lp * self.fresh[step].logprob_div

    def violations(self, schedule: str) -> list[int]:
        """Steps where the schedule exceeds the attention or the log-prob bound."""
        return [r.step for r in self.schedules[schedule]
                if r.attn_err > self.attn_bound(r.step) or r.logprob_div > self.lp_bound(r.step)]

    def holds(self, schedule: str) -> bool:
        return not self.violations(schedule)

    def label(self, schedule: str) -> str:
        return f"every-{self.every_n}" if schedule == "every-n" else schedule

    def summary(self) -> dict[str, dict[str, float | int]]:
        out: dict[str, dict[str, float | int]] = {}
        for name, recs in {**self.schedules, "fresh": self.fresh}.items():
            out[self.label(name) if name != "fresh" else "fresh"] = {
                "max_saturation": max(r.saturation for r in recs),
                "max_attn_err": max(r.attn_err for r in recs),
                "max_attn_err_over_bound": max(r.attn_err / self.attn_bound(r.step) for r in recs),
                "max_logprob_div": max(r.logprob_div for r in recs),
                "max_logprob_div_over_bound": max(r.logprob_div / self.lp_bound(r.step) for r in recs),
                "max_kl": max(r.kl for r in recs),
                "violations": 0 if name == "fresh" else len(self.violations(name)),
            }
        return out

    def table(self) -> dict[str, Any]:
        """Per-step table (columns: step, K amax, then saturation / attention error / log-prob divergence per
        schedule and the bounds)."""
        names = list(self.schedules)
        cols = ["step", "k_amax"]
        for n in names:
            lab = self.label(n)
            cols += [f"{lab} sat", f"{lab} attn_err", f"{lab} lp_div"]
        cols += ["attn bound", "lp bound"]
        rows = []
        for t in range(len(self.fresh)):
            row: list[Any] = [t, self.k_amax[t]]
            for n in names:
                r = self.schedules[n][t]
                row += [r.saturation, r.attn_err, r.logprob_div]
            row += [self.attn_bound(t), self.lp_bound(t)]
            rows.append(row)
        return {"columns": cols, "rows": rows}

    def to_section(self, title: str | None = None) -> dict[str, Any]:
        """A report section (fp8rl.reports contract): text, per-step table, and line plots."""
        steps = list(range(len(self.fresh)))
        summ = self.summary()
        text = (f"Tiny {self.config.n_layers}-layer attention stack, {self.config.steps} RL-like steps "
                f"(ranges grow {self.config.growth:g}/step for {self.config.grow_steps} steps, then shrink "
                f"{self.config.shrink:g}/step), FP8 {self.config.fmt} KV cache + FP8 Q, strategy "
                f"{kvref.strategy_name(self.config.strategy)} ({kvref.STRATEGIES[kvref.strategy_name(self.config.strategy)]}). "
                "Bound per step: attention error ≤ κ_attn × and log-prob divergence ≤ κ_lp × the per-step "
                f"fresh-amax FP8 error (κ_attn = {self.kappa_attn:g}, κ_lp = {self.kappa_lp:g}). " + "; ".join(
                    f"{k}: {v['violations']} violating steps, max saturation {v['max_saturation']:.3g}, max attention "
                    f"error {v['max_attn_err']:.3g}, max log-prob divergence {v['max_logprob_div']:.3g}"
                    for k, v in summ.items()))
        series_attn = {self.label(n): [r.attn_err for r in recs] for n, recs in self.schedules.items()}
        series_attn["bound"] = [self.attn_bound(t) for t in steps]
        series_lp = {self.label(n): [r.logprob_div for r in recs] for n, recs in self.schedules.items()}
        series_lp["bound"] = [self.lp_bound(t) for t in steps]
        series_sat = {self.label(n): [100 * r.saturation for r in recs] for n, recs in self.schedules.items()}
        return {
            "title": title or "KV-scale drift: recalibration schedules",
            "text": text,
            "table": self.table(),
            "summary": summ,
            "config": asdict(self.config),
            "plot": [
                {"type": "lines", "title": "Relative attention error per RL step", "x": steps, "series": series_attn,
                 "xlabel": "RL step", "ylabel": "‖ô − o‖ / ‖o‖ (max over layers)", "yscale": "log"},
                {"type": "lines", "title": "Log-prob divergence per RL step", "x": steps, "series": series_lp,
                 "xlabel": "RL step", "ylabel": "mean |Δ log π(a)|", "yscale": "log"},
                {"type": "lines", "title": "Saturated (clipped) Q/K/V per RL step", "x": steps,
                 "series": series_sat, "xlabel": "RL step", "ylabel": "% of elements with |x/s| > max + ½ulp",
                 "yscale": "linear"},
            ],
        }


# ----------------------------------------------------------------------------------------------------------------
# the simulation


def _split(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return list(torch.chunk(t, parts, dim=0))


def _saturation(caps: list[kvref.Capture], scales: list[kvref.KVScales], fmt: str, layout: str) -> float:
    n_sat = 0.0
    n = 0
    for (q, k, v), s in zip(caps, scales):
        for x, sc, f, lay in ((q, s.q, "e4m3fn", "tensor"), (k, s.k, fmt, layout), (v, s.v, fmt, layout)):
            n_sat += kvref.saturation_fraction(x, sc, lay, f) * x.numel()
            n += x.numel()
    return n_sat / n


def _logprob_metrics(lp_ref: torch.Tensor, lp: torch.Tensor, actions: torch.Tensor) -> tuple[float, float]:
    a = actions.unsqueeze(-1)
    div = (lp.gather(-1, a) - lp_ref.gather(-1, a)).abs().mean()
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(dim=-1).mean()
    return float(div), float(kl)


@dataclass(frozen=True)
class _StepData:
    step: int
    rollout: torch.Tensor
    lp_ref: torch.Tensor
    caps: list[kvref.Capture]
    outs_ref: list[torch.Tensor]
    actions: torch.Tensor


def _calibrate_layer(cfg: DriftConfig, strategy: str, rollout_caps: kvref.Capture,
                     train_caps: kvref.Capture) -> kvref.KVScales:
    """Scales of one layer: A on the first batch the engine sees (the rollout's first sequence), B/C on the
    training batch split into ranks × micro-batches."""
    if strategy == "engine_first_batch":
        q, k, v = rollout_caps
        return kvref.calibrate_engine_first_batch(q[:1], k[:1], v[:1])
    n = cfg.micro_batches
    qs, ks, vs = (_split(t, cfg.ranks * n) for t in train_caps)
    per_rank = [[(qs[r * n + m], ks[r * n + m], vs[r * n + m]) for m in range(n)] for r in range(cfg.ranks)]
    return kvref.calibrate(per_rank, strategy, layout=cfg.layout, fmt=cfg.fmt)


def _evaluate(model: TinyAttentionStack, data: _StepData, name: str, backend: Any, scales: list[kvref.KVScales],
              recalibrated: bool) -> StepRecord:
    cfg = model.cfg
    errs = [kvref.relative_error(backend.attend(f"{name}/L{i}", q, k, v), data.outs_ref[i])
            for i, (q, k, v) in enumerate(data.caps)]
    with torch.no_grad():
        lp, _ = model.forward(data.rollout, attend=lambda i, q, k, v: backend.attend(f"{name}/L{i}", q, k, v))
    div, kl = _logprob_metrics(data.lp_ref, lp, data.actions)
    return StepRecord(data.step, recalibrated, _saturation(data.caps, scales, cfg.fmt, cfg.layout), max(errs), div,
                      kl, float(scales[0].k.max()))


def simulate(config: DriftConfig | None = None, *, backend: Any = None,
             schedules: tuple[str, ...] = SCHEDULES, kappa_attn: float | None = None,
             kappa_lp: float | None = None) -> DriftResult:
    """Run the simulator. ``backend`` (default :class:`OracleBackend`) needs ``push(key, KVScales)`` and
    ``attend(key, q, k, v) -> out`` (causal FP8 attention with the key's current scales); keys are
    ``"<schedule>/L<layer>"``. The fresh-amax baseline always uses the oracle. ``kappa_attn``/``kappa_lp``: the
    bound factors (None → :data:`KAPPA_ATTN_VS_FRESH` / :data:`KAPPA_LP_VS_FRESH`).

    Runs with one torch intra-op thread (restored afterwards): the tensors are tiny, and on a loaded machine
    multi-threaded dispatch of tiny ops is 100× slower than the work itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(config, backend, schedules, kappa_attn, kappa_lp)
    finally:
        torch.set_num_threads(threads)


def _simulate(config: DriftConfig | None, backend: Any, schedules: tuple[str, ...], kappa_attn: float | None,
              kappa_lp: float | None) -> DriftResult:
    cfg = config or DriftConfig()
    for sched in schedules:
        if sched not in SCHEDULES:
            raise ValueError(f"schedules: unknown schedule {sched!r}; expected a subset of {SCHEDULES}")
    k_attn = float(KAPPA_ATTN_VS_FRESH if kappa_attn is None else kappa_attn)
    k_lp = float(KAPPA_LP_VS_FRESH if kappa_lp is None else kappa_lp)
    strategy = kvref.strategy_name(cfg.strategy)
    model = TinyAttentionStack.init(cfg)
    data_gen = torch.Generator().manual_seed(cfg.seed + 1)
    be = backend if backend is not None else OracleBackend(cfg.fmt, cfg.layout)
    oracle = OracleBackend(cfg.fmt, cfg.layout)
    fmax = get_format(cfg.fmt).max_finite
    current: dict[str, list[kvref.KVScales]] = {}
    recs: dict[str, list[StepRecord]] = {s: [] for s in schedules}
    fresh: list[StepRecord] = []
    k_amax: list[float] = []

    for step in range(cfg.steps):
        if step > 0:
            model.rl_step(step - 1)
        rollout = torch.randint(cfg.vocab, (cfg.batch, cfg.seq_len), generator=data_gen)
        train = torch.randint(cfg.vocab, (cfg.calib_batch, cfg.seq_len), generator=data_gen)
        with torch.no_grad():
            lp_ref, caps = model.forward(rollout)
            _, train_caps = model.forward(train)
        probs = lp_ref.exp().reshape(-1, cfg.vocab)
        actions = torch.multinomial(probs, 1, generator=data_gen).reshape(cfg.batch, cfg.seq_len)
        data = _StepData(step, rollout, lp_ref, caps, [kvref.attention(q, k, v, causal=True) for (q, k, v) in caps],
                         actions)
        k_amax.append(max(float(k.abs().max()) for (_, k, _) in caps))

        # fresh: per-step amax scales of the rollout batch itself (the bound's reference level)
        fresh_scales = [kvref.calibrate_amax([[c]], fmax, cfg.layout, q_fp8_max=448.0) for c in caps]
        for i, s in enumerate(fresh_scales):
            oracle.push(f"fresh/L{i}", s)
        fresh.append(_evaluate(model, data, "fresh", oracle, fresh_scales, True))

        calibrated: list[kvref.KVScales] | None = None
        for name in schedules:
            due = step == 0 or name == "every-step" or (name == "every-n" and step % cfg.every_n == 0)
            if due:
                calibrated = calibrated or [_calibrate_layer(cfg, strategy, caps[i], train_caps[i])
                                            for i in range(cfg.n_layers)]
                current[name] = calibrated
                for i, s in enumerate(calibrated):
                    be.push(f"{name}/L{i}", s)
            recs[name].append(_evaluate(model, data, name, be, current[name], due))

    return DriftResult(cfg, cfg.every_n, recs, fresh, k_amax, k_attn, k_lp)


__all__ = ["KAPPA_ATTN_VS_FRESH", "KAPPA_LP_VS_FRESH", "SCHEDULES", "DriftConfig", "DriftResult", "EngineBackend",
           "OracleBackend", "StepRecord", "TinyAttentionStack", "simulate"]
