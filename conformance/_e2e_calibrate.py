"""The e2e budgets' calibration (a command-line tool that writes package data, kept out of the experiment module).

``python -m fp8rl.conformance._e2e_calibrate --seeds 10 --write`` re-measures, with the experiment of
:mod:`fp8rl.conformance._e2e`, the distribution of the e2e mismatch metrics for the reference engine over
alternative weight seeds and sampling seeds and writes it, with the calibration's metadata (command, seeds, runs,
torch/transformers/python versions, date), to the budgets data file ``fp8rl/data/e2e_budgets.json``
(:data:`fp8rl.tolerances.E2E_BUDGETS_FILE`), from which :mod:`fp8rl.tolerances` registers the ``e2e.*`` budgets;
``--out PATH`` writes it elsewhere, ``--models`` / ``--recipes`` re-measure a subset (the file's other entries,
method and margins are kept).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from fp8rl import fixtures, tolerances
from fp8rl.reference import rollout_hf as R

from ._e2e import MODELS, N_NEW, RECIPES, measure, prompts, recipes_for

#: first sampling seed of a calibration: far from the run seeds' sampling seeds (SAMPLE_SEED + run seed), so that a
#: seed sweep of the checks (``fp8rl conformance --seeds 0..19``) tests the budgets on seeds they were not fit on
CALIBRATION_SAMPLING_BASE = 100_000


def calibration_sampling_seed(k: int, j: int, n_sampling: int) -> int:
    return CALIBRATION_SAMPLING_BASE + k * n_sampling + j


def calibrate(n_seeds: int = 10, models: tuple[str, ...] = MODELS, recipes: tuple[str, ...] = RECIPES,
              progress: bool = True, n_sampling: int = 1) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Metric samples of the reference engine per (model, recipe) over weight seeds ``seed + k`` (k = 0..K−1, the
    fixture's own seed first), both weight variants (base, update) and ``n_sampling`` sampling seeds per weight seed
    (:func:`calibration_sampling_seed`, disjoint from the checks' own): 2·K·J runs per case."""
    from fp8rl.engines.reference import ReferenceEngine

    eng = ReferenceEngine()
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for model in models:
        spec = fixtures.tiny_model_spec(model)
        cfg = fixtures.model_config(model)
        for k in range(n_seeds):
            for variant in ("base", "update"):
                sd = fixtures.generate_state_dict(cfg, int(spec["seed"]) + k, spec["init"],
                                                  spec["update"] if variant == "update" else None)
                trainer = R.RolloutPolicy(cfg, sd, "bf16")
                greedy = trainer.greedy_full(prompts(), N_NEW)
                for recipe in recipes:
                    if recipe not in recipes_for(model):
                        continue
                    for j in range(n_sampling):
                        seed = calibration_sampling_seed(k, j, n_sampling)
                        r = measure(eng, model, recipe, variant=variant, seed=seed, state=sd, config=cfg,
                                    trainer=trainer, trainer_greedy=greedy)
                        d = out.setdefault((model, recipe), {})
                        for key, v in r.metrics.items():
                            d.setdefault(key, []).append(v)
                        if progress:
                            print(f"{model} seed+{k} {variant} {recipe} sample {seed}: " +
                                  ", ".join(f"{a} {b:.4g}" for a, b in r.metrics.items()), flush=True)
    return out


def _summary(samples: dict[tuple[str, str], dict[str, list[float]]]) -> str:
    lines = ["model recipe metric: min median max (n)"]
    for (model, recipe), d in samples.items():
        for key, vals in d.items():
            v = sorted(vals)
            lines.append(f"{model} {recipe} {key}: {v[0]:.4g} {v[len(v) // 2]:.4g} {v[-1]:.4g} ({len(v)})")
    return "\n".join(lines)


def calibration_record(n_seeds: int, models: tuple[str, ...], recipes: tuple[str, ...], command: str,
                       n_sampling: int = 1) -> dict[str, Any]:
    """Metadata of a calibration run (the ``calibrations`` record of the budgets file); ``id``: its UTC time."""
    import datetime
    import os
    import platform
    import subprocess

    import transformers

    now = datetime.datetime.now(datetime.UTC)
    rec: dict[str, Any] = {
        "id": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "command": command, "date": now.strftime("%Y-%m-%d"),
        "engine": "reference", "models": list(models), "recipes": list(recipes), "n_seeds": int(n_seeds),
        "weight_seeds": f"fixture seed + k, k = 0..{int(n_seeds) - 1}", "variants": ["base", "update"],
        "sampling_seeds": f"{CALIBRATION_SAMPLING_BASE} + k·{int(n_sampling)} + j, j = 0..{int(n_sampling) - 1}",
        "runs_per_case": 2 * int(n_seeds) * int(n_sampling), "prompts": int(prompts().shape[0]),
        "new_tokens": N_NEW, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
    }
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        if rev.returncode == 0 and rev.stdout.strip():
            rec["commit"] = rev.stdout.strip()  # the checkout's HEAD (a source checkout only)
    except (OSError, subprocess.SubprocessError):
        pass
    return rec


def budgets_document(samples: dict[tuple[str, str], dict[str, list[float]]], base: dict[str, Any],
                     calibration: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a budgets document: method, margins, calibrations, measured) with the measured entries of
    ``samples`` replaced by their min / median (upper, sorted[n // 2]) / max / n — one entry per metric that has a
    margin — recorded under ``calibration`` (a :func:`calibration_record`); calibration records no entry uses any
    more are dropped."""
    import copy

    doc = copy.deepcopy(base)
    cal = dict(calibration)
    cid = cal.pop("id")
    doc["calibrations"][cid] = cal
    for (model, recipe), d in samples.items():
        entry: dict[str, Any] = {"calibration": cid}
        for metric in doc["margins"]:
            v = sorted(float(x) for x in d[metric])
            entry[metric] = {"min": v[0], "median": v[len(v) // 2], "max": v[-1], "n": len(v)}
        doc["measured"].setdefault(model, {})[recipe] = entry
    used = {e["calibration"] for recipes in doc["measured"].values() for e in recipes.values()}
    doc["calibrations"] = {k: v for k, v in doc["calibrations"].items() if k in used}
    return doc


def dump_budgets(doc: dict[str, Any]) -> str:
    """The budgets document as JSON text: indented, with number-only objects (one metric's statistics) and lists
    of scalars on one line."""
    import json

    def scalar(v: Any) -> bool:
        return v is None or isinstance(v, (str, int, float, bool))

    def enc(obj: Any, pad: str) -> str:
        if isinstance(obj, dict) and obj and not all(isinstance(v, (int, float)) for v in obj.values()):
            inner = pad + " "
            return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {enc(v, inner)}" for k, v in obj.items()) + \
                "\n" + pad + "}"
        if isinstance(obj, list) and not all(scalar(v) for v in obj):
            inner = pad + " "
            return "[\n" + ",\n".join(inner + enc(v, inner) for v in obj) + "\n" + pad + "]"
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)

    return enc(doc, "") + "\n"


def write_budgets(doc: dict[str, Any], path: str) -> None:
    """Write ``doc`` to ``path`` after checking that :func:`fp8rl.tolerances.load_e2e_budgets` accepts it."""
    import os
    import tempfile

    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_budgets(doc))
        tolerances.load_e2e_budgets(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def installed_budgets_path() -> str:
    """The budgets data file of this installation (in a source checkout: suite/data/e2e_budgets.json)."""
    from importlib import resources

    return str(resources.files("fp8rl").joinpath(tolerances.E2E_BUDGETS_FILE))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m fp8rl.conformance._e2e_calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10, help="weight seeds per model (each: base and update weights)")
    ap.add_argument("--sampling-seeds", type=int, default=1,
                    help="sampling seeds per weight seed and variant (2·seeds·sampling-seeds runs per case)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--write", action="store_true",
                    help=f"write the measured distribution to this installation's budgets file "
                         f"(fp8rl/{tolerances.E2E_BUDGETS_FILE})")
    ap.add_argument("--out", default=None, help="write the budgets file here instead")
    ap.add_argument("--json", default=None, help="write the raw samples here")
    args = ap.parse_args(argv)
    models, recipes = tuple(args.models), tuple(args.recipes)
    samples = calibrate(args.seeds, models=models, recipes=recipes, n_sampling=args.sampling_seeds)
    print(_summary(samples))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{m}/{r}": d for (m, r), d in samples.items()}, f, indent=1)
    if not all(math.isfinite(v) for d in samples.values() for vs in d.values() for v in vs):
        print("non-finite metrics: no budgets written", file=sys.stderr)
        return 1
    out = args.out or (installed_budgets_path() if args.write else None)
    if out:
        command = "python -m fp8rl.conformance._e2e_calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
        doc = budgets_document(samples, tolerances.load_e2e_budgets(),
                               calibration_record(args.seeds, models, recipes, command.strip(),
                                                  n_sampling=args.sampling_seeds))
        write_budgets(doc, out)
        print(f"budgets written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
