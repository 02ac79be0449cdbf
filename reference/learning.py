"""Learning-level oracle: the exact policy gradient of a policy small enough to enumerate, and the exact expectation
of a trainer's (IS-corrected) estimator when the sequences come from another policy π_rollout.

The toy task (:class:`ToyTask`): a fixed prompt, a response of ``horizon`` tokens from a vocabulary of ``vocab``,
reward 1 when the response's token sum is divisible by ``modulus`` (verifiable, ≈ 1/modulus of the space). The
policy is a transformers causal LM (:func:`toy_config`, :func:`toy_state_dict`: a 1-layer Qwen3 built from a seed;
nothing is downloaded). Its response space has N = V^H sequences (V = 8, H = 3: 512), so every expectation is a
finite sum.

Coefficient space. Every log-probability the trainer can touch is an *entry* e = (prefix p, token v):
log π(v | prompt + p), for the 1 + V + … + V^(H−1) prefixes p (584 entries for V = 8, H = 3). Teacher-forced,
the gradient of token t of sequence s is g_e with e = (s_<t, s_t). Any estimator of the form
ĝ(s) = Σ_t γ_t(s) g_{e(s,t)} has E_q[ĝ] = Σ_e c_e g_e with c_e = Σ_{(s,t) → e} q(s) γ_t(s), and every norm and
inner product of such vectors is a quadratic form in the Gram matrix K = J Jᵀ of the entries' gradients (J: entries ×
parameters, computed once in float64 by autograd). So the bias ‖E_q[ĝ] − ∇J‖, its cosine with ∇J and the
variance E_q‖ĝ − E ĝ‖² are exact (up to float64 rounding) for any rollout policy q given by its entry table.

The true gradient: J(θ) = Σ_s π(s) R(s), ∇J = Σ_s π(s) R(s) Σ_t g_{e(s,t)} (c_e = Σ π R). The estimators the
trainer computes from rollouts of q (advantage A = R − b with a constant baseline b, REINFORCE surrogate
Σ_t w_t A log π_t, the weights w from the rollout correction): none (w = 1), token TIS (w_t = min(ρ_t, U)), sequence
TIS (w = min(Π_t ρ_t, U)), IcePop/MIS (w_t = ρ_t inside [lo, hi], else 0) and rejection sampling (a sequence whose
statistic leaves the band is dropped), ρ_t = π_t / q_t.

Analytic truncation bias (docs/learning-parity.md). Sequence TIS: E_q[min(ρ, U) A G] = ∇J − Σ_s q(s)(ρ(s) − U)_+
A(s) G(s) (G(s) = Σ_t g_{e(s,t)}; IS without truncation is unbiased wherever q > 0 where π > 0), so
‖bias‖ ≤ Σ_s q(s)(ρ(s) − U)_+ |A(s)| ‖G(s)‖. Token TIS: E_q[Σ_t min(ρ_t, U) A g_t] = ∇J + D − T with the
token-level approximation term D = Σ_s Σ_t (q(s) ρ_t(s) − π(s)) A(s) g_{e(s,t)} (token IS corrects only the token's
own probability, not its prefix's nor its suffix's) and the truncation term T = Σ_s q(s) Σ_t (ρ_t(s) − U)_+ A(s)
g_{e(s,t)}, so ‖bias‖ ≤ Σ_s Σ_t (|q(s) ρ_t(s) − π(s)| + q(s)(ρ_t(s) − U)_+) |A(s)| ‖g_{e(s,t)}‖.

This module imports nothing from the harness: torch, transformers (through :mod:`fp8rl.reference.rollout_hf`) and the
correction oracle.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CORRECTIONS", "Estimate", "GradientTable", "ToyTask", "correction_config", "enumerate_sequences", "kappa",
           "perturbed_table", "projections", "sequence_index", "toy_fixture",
           "estimator_coefficients", "expected_gradient", "gradient_table", "oracle_coefficients", "prefixes",
           "rollout_table", "table_from_logits", "tis_bias_bound", "toy_config", "toy_state_dict"]

#: the corrections of the learning area: name → (rollout_is, threshold, rollout_rs, rs threshold)
CORRECTIONS: dict[str, dict[str, Any]] = {
    "none": {"rollout_is": None},
    "is": {"rollout_is": "sequence", "rollout_is_threshold": 1e30},
    "token-tis": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "seq-tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "icepop": {"rollout_is": "token", "rollout_is_threshold": (0.5, 2.0)},
    "rs": {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
}


def correction_config(name: str):
    """The :class:`~fp8rl.reference.correction.CorrectionConfig` of a learning-area correction name."""
    from fp8rl.reference.correction import CorrectionConfig

    if name not in CORRECTIONS:
        raise ValueError(f"correction: unknown {name!r}; expected one of {sorted(CORRECTIONS)}")
    return CorrectionConfig(**CORRECTIONS[name])


@dataclass(frozen=True)
class ToyTask:
    """The enumerable task: prompt, vocabulary, horizon and the verifiable reward."""

    vocab: int = 8
    horizon: int = 3
    prompt: tuple[int, ...] = (1, 2)
    modulus: int = 3

    def __post_init__(self) -> None:
        if not 2 <= self.vocab <= 64:
            raise ValueError(f"vocab: expected 2..64, got {self.vocab}")
        if not 1 <= self.horizon or self.vocab ** self.horizon > 100_000:
            raise ValueError(f"horizon: expected ≥ 1 with vocab^horizon ≤ 1e5, got {self.vocab}^{self.horizon}")
        if not self.prompt or any(not 0 <= t < self.vocab for t in self.prompt):
            raise ValueError(f"prompt: expected a non-empty tuple of token ids < {self.vocab}, got {self.prompt}")
        if self.modulus < 2:
            raise ValueError(f"modulus: expected ≥ 2, got {self.modulus}")

    def reward(self, seqs: torch.Tensor) -> torch.Tensor:
        """R(s) ∈ {0, 1} (float64) for responses (N, H): 1 when the token sum is divisible by ``modulus``."""
        return (seqs.sum(-1) % self.modulus == 0).double()

    def prompt_tensor(self, batch: int = 1) -> torch.Tensor:
        return torch.tensor([list(self.prompt)] * batch, dtype=torch.int64)


def enumerate_sequences(task: ToyTask) -> torch.Tensor:
    """Every response (V^H, H) int64, in lexicographic order (row index = the base-V number of the response)."""
    return torch.tensor(list(itertools.product(range(task.vocab), repeat=task.horizon)),
                        dtype=torch.int64).reshape(-1, task.horizon)


def prefixes(task: ToyTask, length: int) -> torch.Tensor:
    """Every response prefix of ``length`` tokens (V^length, length), lexicographic (the empty one for 0)."""
    if length == 0:
        return torch.zeros(1, 0, dtype=torch.int64)
    return torch.tensor(list(itertools.product(range(task.vocab), repeat=length)), dtype=torch.int64)


def _prefix_offsets(task: ToyTask) -> list[int]:
    out, acc = [], 0
    for t in range(task.horizon):
        out.append(acc)
        acc += task.vocab ** t
    return out + [acc]


def entry_index(task: ToyTask, seqs: torch.Tensor) -> torch.Tensor:
    """(N, H) entry indices e(s, t) = (index of prefix s_<t) · V + s_t."""
    v = task.vocab
    off = _prefix_offsets(task)
    cols = []
    code = torch.zeros(seqs.shape[0], dtype=torch.int64)
    for t in range(task.horizon):
        cols.append((off[t] + code) * v + seqs[:, t])
        code = code * v + seqs[:, t]
    return torch.stack(cols, 1)


def n_entries(task: ToyTask) -> int:
    return _prefix_offsets(task)[-1] * task.vocab


# ----------------------------------------------------------------------------------------------------------------
# the toy policy


def toy_config(task: ToyTask, *, hidden: int = 32, layers: int = 1, heads: int = 1, kv_heads: int = 1,
               head_dim: int = 32, intermediate: int = 64) -> dict[str, Any]:
    """HF config (Qwen3ForCausalLM) of the toy policy."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": task.vocab,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": layers, "bos_token_id": None, "eos_token_id": 0,
        "pad_token_id": 0, "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True,
    }


def toy_state_dict(config: Mapping[str, Any], seed: int = 0, *, logit_gain: float = 2.0) -> dict[str, torch.Tensor]:
    """BF16 weights of the toy policy from ``seed`` (torch CPU generator): projections N(0, 1/fan_in), embeddings
    N(0, 1), norms 1 + N(0, 0.1²), lm_head N(0, (gain/√hidden)²) so the logits of a unit-RMS state have std ≈ gain."""
    from fp8rl.reference.rollout_hf import build_hf_model

    model = build_hf_model(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(seed))
    hidden = int(config["hidden_size"])
    out: dict[str, torch.Tensor] = {}
    for name, p in sorted(model.state_dict().items()):
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif "embed_tokens" in name:
            t = torch.randn(p.shape, generator=gen)
        elif name.startswith("lm_head"):
            t = torch.randn(p.shape, generator=gen) * (logit_gain / math.sqrt(hidden))
        else:
            t = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
        out[name] = t.to(torch.bfloat16)
    return out


def _fp64_trainer(config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]):
    from fp8rl.reference.rollout_hf import build_hf_model, to_model_state_dict

    model = build_hf_model(config, dtype=torch.float64, attn_implementation="eager")
    sd = {k: v.to(torch.float64) for k, v in to_model_state_dict(state_dict).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise ValueError(f"state_dict: does not fit the config (missing {missing}, unexpected {unexpected})")
    return model


@dataclass
class GradientTable:
    """The trainer's side, exact in float64: entry log-probs, the entries' gradients and their Gram matrix."""

    task: ToyTask
    logp: torch.Tensor  #: (entries,) float64 log π_train of every entry
    jac: torch.Tensor  #: (entries, parameters) float64 gradients g_e
    seqs: torch.Tensor = field(init=False)
    entries: torch.Tensor = field(init=False)
    gram: torch.Tensor = field(init=False)  #: (entries, entries) K = J Jᵀ

    def __post_init__(self) -> None:
        self.seqs = enumerate_sequences(self.task)
        self.entries = entry_index(self.task, self.seqs)
        self.gram = self.jac @ self.jac.T

    @property
    def n_params(self) -> int:
        return int(self.jac.shape[1])

    def seq_token_logp(self, table: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) per-token log-probs of every sequence under an entry table (default: the trainer's)."""
        return (self.logp if table is None else table)[self.entries]

    def vector(self, coeffs: torch.Tensor) -> torch.Tensor:
        """The parameter-space gradient Σ_e c_e g_e of coefficients ``c`` (float64)."""
        return coeffs.double() @ self.jac


def gradient_table(task: ToyTask, config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                   ) -> GradientTable:
    """Entry log-probs of the fp64 trainer (teacher-forced prefixes, one forward per prefix) and the gradients of
    every entry with respect to every parameter (autograd: the V entries of a prefix in one batched backward)."""
    from fp8rl.reference.rollout import single_thread

    model = _fp64_trainer(config, state_dict)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    eye = torch.eye(task.vocab, dtype=torch.float64)
    logps, jac_rows = [], []
    with single_thread():
        for t in range(task.horizon):
            pre = prefixes(task, t)
            toks = torch.cat([task.prompt_tensor(pre.shape[0]), pre], 1)
            for i in range(toks.shape[0]):
                out = model(input_ids=toks[i:i + 1], use_cache=False).logits[0, -1].double()
                lp = torch.log_softmax(out, -1)
                logps.append(lp.detach())
                grads = torch.autograd.grad(lp, params, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
                jac_rows.append(torch.cat([(g if g is not None else torch.zeros(task.vocab, *p.shape,
                                                                                  dtype=torch.float64))
                                           .reshape(task.vocab, -1) for g, p in zip(grads, params, strict=True)], 1))
    return GradientTable(task, torch.cat(logps), torch.cat(jac_rows, 0))


def table_from_logits(rows: list[torch.Tensor]) -> torch.Tensor:
    """Entry log-prob table (float64) from per-prefix-length logits rows [(V^t, V) for t < H] (any dtype)."""
    return torch.cat([torch.log_softmax(r.double(), -1).reshape(-1) for r in rows])


def rollout_table(task: ToyTask, next_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """π_rollout's entry table by enumeration: ``next_logits(tokens (B, P + t)) → (B, V)`` logits of the next token
    after every prefix (e.g. a one-token rollout of the engine returning its sampling logits)."""
    rows = []
    for t in range(task.horizon):
        pre = prefixes(task, t)
        toks = torch.cat([task.prompt_tensor(pre.shape[0]), pre], 1)
        rows.append(next_logits(toks))
    return table_from_logits(rows)


# ----------------------------------------------------------------------------------------------------------------
# estimators


def _scatter(task: ToyTask, entries: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    c = torch.zeros(n_entries(task), dtype=torch.float64)
    return c.index_add_(0, entries.reshape(-1), values.reshape(-1).double())


def estimator_coefficients(table: GradientTable, q_table: torch.Tensor,
                           gamma: torch.Tensor) -> torch.Tensor:
    """E_q[ĝ] in coefficient space for per-token estimator coefficients ``gamma`` (N, H): Σ q(s) γ_t(s) per entry."""
    q = torch.exp(table.seq_token_logp(q_table).sum(-1))
    return _scatter(table.task, table.entries, q[:, None] * gamma.double())


def true_gradient_coefficients(table: GradientTable) -> torch.Tensor:
    """∇J = Σ_s π(s) R(s) G(s) in coefficient space."""
    pi = torch.exp(table.seq_token_logp().sum(-1))
    r = table.task.reward(table.seqs)
    return _scatter(table.task, table.entries, (pi * r)[:, None].expand(-1, table.task.horizon))


def oracle_coefficients(table: GradientTable, q_table: torch.Tensor, correction: str,
                        baseline: float | None = None) -> torch.Tensor:
    """Per-token REINFORCE coefficients γ_t(s) = w_t(s) · m_t(s) · A(s) (N, H) of a correction, computed with the
    float64 correction oracle (A = R − b, b = E_π[R] unless given)."""
    from fp8rl.reference import correction as C

    train = table.seq_token_logp()
    roll = table.seq_token_logp(q_table)
    mask = torch.ones_like(train)
    res = C.rollout_correction(train, roll, mask, correction_config(correction))
    a = advantages(table, baseline)
    w = res.weights if res.weights is not None else torch.ones_like(train)
    return w.double() * res.mask.double() * a[:, None]


def advantages(table: GradientTable, baseline: float | None = None) -> torch.Tensor:
    """A(s) = R(s) − b with the constant baseline b = E_π[R] (the trainer's expected reward) unless given."""
    r = table.task.reward(table.seqs)
    if baseline is None:
        baseline = float((torch.exp(table.seq_token_logp().sum(-1)) * r).sum())
    return r - baseline


@dataclass
class Estimate:
    """The expected estimator against ∇J: relative bias ‖E ĝ − ∇J‖/‖∇J‖, cosine, relative variance
    E‖ĝ − E ĝ‖²/‖∇J‖² (q-weighted, one sample)."""

    bias: float
    cosine: float
    variance: float
    grad_norm: float

    def as_dict(self) -> dict[str, float]:
        return {"bias": self.bias, "cosine": self.cosine, "variance": self.variance, "grad_norm": self.grad_norm}


def expected_gradient(table: GradientTable, q_table: torch.Tensor, gamma: torch.Tensor) -> Estimate:
    """:class:`Estimate` of the estimator with coefficients ``gamma`` (N, H) on sequences drawn from ``q_table``."""
    k = table.gram
    c = estimator_coefficients(table, q_table, gamma)
    ge, gj = table.vector(c), table.vector(true_gradient_coefficients(table))
    nj, ne = float(gj.norm()), float(ge.norm())
    bias = float((ge - gj).norm()) / nj
    cos = float(ge @ gj) / (ne * nj) if ne > 0 else 0.0
    # E_q ‖ĝ(s)‖² = Σ_s q(s) γ_sᵀ K[e_s, e_s] γ_s
    e = table.entries
    ksub = k[e[:, :, None], e[:, None, :]]
    g = gamma.double()
    per = torch.einsum("nh,nhk,nk->n", g, ksub, g)
    q = torch.exp(table.seq_token_logp(q_table).sum(-1))
    var = (float((q * per).sum()) - ne * ne) / (nj * nj)
    return Estimate(bias, cos, var, nj)


def tis_bias_bound(table: GradientTable, q_table: torch.Tensor, level: str, cap: float,
                   baseline: float | None = None) -> float:
    """The analytic bound on ‖E_q[ĝ_TIS] − ∇J‖ / ‖∇J‖ (module docstring; ``tolerances['learning_tis_bias']``):
    sequence level Σ_s q(s)(ρ(s) − U)_+ |A(s)| ‖G(s)‖; token level Σ_s Σ_t (|q(s)ρ_t(s) − π(s)| +
    q(s)(ρ_t(s) − U)_+) |A(s)| ‖g_{e(s,t)}‖; both over ‖∇J‖."""
    k = table.gram
    train = table.seq_token_logp()
    roll = table.seq_token_logp(q_table)
    pi = torch.exp(train.sum(-1))
    q = torch.exp(roll.sum(-1))
    a = advantages(table, baseline).abs()
    nj = float(table.vector(true_gradient_coefficients(table)).norm())
    e = table.entries
    if level == "sequence":
        rho = torch.exp(train.sum(-1) - roll.sum(-1))
        ksub = k[e[:, :, None], e[:, None, :]]
        gnorm = torch.sqrt(ksub.sum((-1, -2)).clamp_min(0))
        return float((q * (rho - cap).clamp_min(0) * a * gnorm).sum()) / nj
    if level != "token":
        raise ValueError(f"level: expected 'token' or 'sequence', got {level!r}")
    rho_t = torch.exp(train - roll)
    gnorm_t = torch.sqrt(torch.diagonal(k)[e].clamp_min(0))
    approx = (q[:, None] * rho_t - pi[:, None]).abs()
    trunc = q[:, None] * (rho_t - cap).clamp_min(0)
    return float(((approx + trunc) * a[:, None] * gnorm_t).sum()) / nj


def kappa(table: GradientTable, coeffs: torch.Tensor) -> float:
    """κ = Σ_e (|c_e| + |c^J_e|)·‖g_e‖ / ‖∇J‖ (the condition of an estimator's comparison with ∇J;
    ``tolerances['learning_grad_arith']``)."""
    cj = true_gradient_coefficients(table)
    gnorm = torch.sqrt(torch.diagonal(table.gram).clamp_min(0))
    return float(((coeffs.double().abs() + cj.abs()) * gnorm).sum()) / float(table.vector(cj).norm())


def perturbed_table(table: GradientTable, sigma: float, seed: int = 0) -> torch.Tensor:
    """A synthetic rollout policy: the trainer's next-token logits (its entry log-probs) plus i.i.d. N(0, σ²) noise
    per entry (torch CPU generator ``seed``), renormalized per prefix — a mismatch of known size with full support."""
    gen = torch.Generator().manual_seed(int(seed))
    v = table.task.vocab
    noisy = table.logp.reshape(-1, v) + sigma * torch.randn(table.logp.shape, generator=gen,
                                                              dtype=torch.float64).reshape(-1, v)
    return torch.log_softmax(noisy, -1).reshape(-1)


def projections(table: GradientTable) -> torch.Tensor:
    """p(s) = ⟨G(s), ∇J⟩ / ‖∇J‖² for every sequence (N,) float64."""
    gj = table.vector(true_gradient_coefficients(table))
    per_entry = table.jac @ gj / float(gj @ gj)
    return per_entry[table.entries].sum(-1)


def sequence_index(task: ToyTask, responses: torch.Tensor) -> torch.Tensor:
    """Row of :func:`enumerate_sequences` of each response (M, H)."""
    idx = torch.zeros(responses.shape[0], dtype=torch.int64)
    for t in range(task.horizon):
        idx = idx * task.vocab + responses[:, t]
    return idx


_FIXTURES: dict[tuple, tuple] = {}


def toy_fixture(seed: int = 0, task: ToyTask | None = None) -> tuple[ToyTask, dict[str, Any],
                                                                    dict[str, torch.Tensor], GradientTable]:
    """(task, config, BF16 state dict, gradient table) of the toy policy of ``seed`` (memoized per process)."""
    task = task or ToyTask()
    key = (task, int(seed))
    hit = _FIXTURES.get(key)
    if hit is None:
        cfg = toy_config(task)
        sd = toy_state_dict(cfg, seed)
        hit = (task, cfg, sd, gradient_table(task, cfg, sd))
        _FIXTURES[key] = hit
    return hit
