"""Learning-parity tracks (docs/learning-parity.md): the exact relative policy-gradient bias of the toy policy per
recipe (no correction vs token TIS) and the toy GRPO run's reward gap and gradient cosine to the BF16 run, so the
dashboard shows learning parity next to throughput.

Engine: ``FP8RL_BENCH_ENGINE`` (default ``reference``), with the ``rollout`` and ``rollout.logits`` capabilities;
otherwise skipped (NotImplementedError in setup). The GRPO track runs a reduced ``fp8rl parity`` (4 seeds × 20
steps, ~1.5 min on one core); the full default configuration runs in ``nox -s nightly``.
"""

from __future__ import annotations

import os

from .common import Benchmark

RECIPES = ["fp8-linear", "fp8-kv", "fp8-all"]


def _engine(caps):
    from fp8rl.registry import EngineLoadError, load_engine

    name = os.environ.get("FP8RL_BENCH_ENGINE", "reference")
    try:
        eng = load_engine(name)
    except EngineLoadError as exc:
        raise NotImplementedError(str(exc)) from None
    have = eng.capabilities()
    missing = [c for c in caps if have.get(c) is not True]
    if missing:
        raise NotImplementedError(f"{name}: no {', '.join(missing)}")
    return eng


class ExactGradientBias(Benchmark):
    """‖E[ĝ] − ∇J‖/‖∇J‖ of the toy policy under the engine's enumerated rollout policy (exact)."""

    params = (RECIPES, ["none", "token-tis"])
    param_names = ["recipe", "correction"]
    timeout = 300

    def setup(self, recipe, correction):
        self.engine = _engine(["rollout", f"rollout.{recipe}", "rollout.logits"])

    def track_gradient_bias(self, recipe, correction):
        from fp8rl.reference import learning as L

        task, cfg, sd, table = L.toy_fixture(0)
        h = self.engine.rollout_init(cfg, sd, recipe)
        q = L.rollout_table(task, lambda toks: self.engine.rollout_logits(h, toks, 1, greedy=True)[2][:, 0])
        return L.expected_gradient(table, q, L.oracle_coefficients(table, q, correction)).bias

    track_gradient_bias.unit = "relative"  # type: ignore[attr-defined]


class ToyGRPOParity(Benchmark):
    """Toy GRPO (fp8rl parity, reduced: 4 seeds x 20 steps): gap in mean reward and mean gradient cosine to the BF16
    run, of FP8-all rollouts with token TIS and without correction (one run gives both conditions)."""

    params = (["fp8-all+tis", "fp8-all+none"],)
    param_names = ["condition"]
    timeout = 900

    def setup_cache(self):
        try:
            _engine(["rollout", "rollout.fp8-all", "rollout.bf16", "update_weights"])
        except NotImplementedError:
            return None
        from fp8rl.parity import ParityConfig, run_parity

        pc = ParityConfig(engine=os.environ.get("FP8RL_BENCH_ENGINE", "reference"), recipe="fp8-all",
                          correction="tis", seeds=4, steps=20, final=5)
        return run_parity(pc)["verdicts"]

    def setup(self, verdicts, condition):
        if verdicts is None:
            raise NotImplementedError("the engine has no fp8-all/bf16 rollouts with weight updates")

    def track_reward_gap(self, verdicts, condition):
        return verdicts[condition]["reward_gap"]

    track_reward_gap.unit = "reward"  # type: ignore[attr-defined]

    def track_grad_cosine(self, verdicts, condition):
        return verdicts[condition]["mean_grad_cosine"]

    track_grad_cosine.unit = "cosine"  # type: ignore[attr-defined]


#: folder holding the nightly's ``parity-<control>/parity.json`` (``nox -s nightly`` sets it to fp8rl-nightly)
PARITY_ENV = "FP8RL_ASV_PARITY"
CONTROLS = ["noise", "wrong-policy", "inverted-ratio"]


class ParityControls(Benchmark):
    """fp8rl parity's positive controls, as the nightly ran them (8 seeds × 30 steps): the smallest strength at which
    parity said "does not match BF16" (noise and inverted ratio: σ of the logit noise; wrong-policy: the sampling
    temperature), read from ``$FP8RL_ASV_PARITY/parity-<control>/parity.json``'s ``control.smallest_detected``.
    A control never caught is NaN on the dashboard (and fails the nightly)."""

    params = (CONTROLS,)
    param_names = ["control"]

    def setup(self, control):
        import json
        from pathlib import Path

        folder = os.environ.get(PARITY_ENV)
        path = Path(folder or ".") / f"parity-{control}" / "parity.json"
        if not folder or not path.is_file():
            raise NotImplementedError(f"no {path} ({PARITY_ENV} names the nightly's folder)")
        self.control = json.loads(path.read_text()).get("control") or {}

    def track_smallest_detected(self, control):
        value = self.control.get("smallest_detected")
        return float("nan") if value is None else float(value)

    track_smallest_detected.unit = "sigma or temperature"  # type: ignore[attr-defined]
