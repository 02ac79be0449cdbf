"""``fp8rl perf`` subcommands (registered into the main CLI by ``register(subparsers)``).

    fp8rl perf model    --model NAME|config.json|DIR --hardware NAME [--workload P:G[:S]] [--json]
    fp8rl perf run      --engine NAME --model DIR --configs bf16,fp8-kv --batch B --prompt-len P --gen-len G
                        --repeats N [--out FILE]
    fp8rl perf ingest   --run CONFIG FILE... [--run CONFIG FILE...] --model-name NAME --out FILE
    fp8rl perf gate     RESULTS... [--claims F] [--baseline B --max-regression 5%] [--out DIR]
    fp8rl perf claims   list the claims the gate knows
    fp8rl perf hardware list the hardware specs the model knows; --probe [--out FILE] measures this machine

Exit codes: 0 ok/pass; 1 fail (gate FAIL/REGRESSED, or a harness run broke the workload); 2 usage error, engine
without the rollout capability, or nothing gated; 3 gate SUSPECT (no failure, but a measurement looks wrong).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE


def _console():
    from rich.console import Console

    # wide tables when piped into a log (rich defaults to 80 columns there)
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _err(msg: str) -> int:
    print(f"fp8rl perf: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _gib(x: float | int | None) -> str:
    return "–" if x is None else f"{x / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------------------------------------------
# model


def _parse_workload(text: str) -> tuple[int, int, int | None]:
    parts = text.replace(",", ":").split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"--workload: expected PROMPT:GEN[:MAX_NUM_SEQS], got {text!r}")
    vals = [int(p) for p in parts]
    return vals[0], vals[1], (vals[2] if len(vals) == 3 else None)


def _parse_calibration(text: str) -> tuple[str, int]:
    cfg, _, tok = text.partition(":")
    if not tok:
        raise ValueError(f"--calibrate: expected CONFIG:KV_TOKENS (e.g. bf16:249952), got {text!r}")
    return cfg, int(tok.replace(",", "").replace("_", ""))


def cmd_model(args: argparse.Namespace) -> int:
    from fp8rl.perf import model as pm

    try:
        spec = pm.load_model_spec(args.model)
        hw = pm.load_hardware(args.hardware)
        configs = [pm.get_precision(c).name for c in args.configs.split(",") if c.strip()]
        prompt, gen, seqs = args.prompt_len, args.gen_len, args.max_num_seqs
        if args.workload:
            prompt, gen, s = _parse_workload(args.workload)
            seqs = s or seqs
        calib = _parse_calibration(args.calibrate) if args.calibrate else None
        if calib:
            calib = (pm.get_precision(calib[0]).name, calib[1])
        wl = pm.Workload(prompt_len=prompt, gen_len=gen, max_num_seqs=seqs, num_requests=args.requests,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         overhead_bytes=int(args.overhead_gib * 2**30), tp=args.tp, block_size=args.block_size,
                         calibration=calib)
        if "bf16" not in configs:
            configs = ["bf16", *configs]
        est = pm.estimate_all(spec, hw, wl, configs)
    except (ValueError, OSError) as exc:
        return _err(str(exc))
    payload = {
        "model": {"name": spec.name, "params": spec.num_params(), "active_params_per_token": spec.active_params_per_token(),
                  "moe": spec.is_moe, "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
        "hardware": {"name": hw.name, "class": hw.cls, "hbm_bytes": hw.hbm_bytes, "bandwidth_Bps": hw.hbm_bandwidth_Bps,
                     "bf16_dense_flops": hw.bf16_dense_flops, "fp8_dense_flops": hw.fp8_dense_flops,
                     "fp4_dense_flops": hw.fp4_dense_flops},
        "workload": {"prompt_len": wl.prompt_len, "gen_len": wl.gen_len, "max_num_seqs": wl.max_num_seqs,
                     "num_requests": wl.num_requests, "gpu_memory_utilization": wl.gpu_memory_utilization,
                     "overhead_bytes": wl.overhead_bytes, "tp": wl.tp, "block_size": wl.block_size,
                     "calibration": list(calib) if calib else None, "mean_context": wl.mean_context},
        "configs": {k: v.to_dict() for k, v in est.items()},
    }
    if args.json:
        print(json.dumps(payload, indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table(title=f"{spec.name} on {hw.name}: prompt {wl.prompt_len}, response {wl.gen_len}, max_num_seqs "
                    f"{wl.max_num_seqs}" + (f", budget calibrated from {calib[0]} = {calib[1]:,} KV tokens" if calib
                                            else f", gpu_memory_utilization {wl.gpu_memory_utilization}"),
              title_justify="left")
    t.add_column("")
    for k in est:
        t.add_column(k, justify="right")
    rows = [
        ("weights", lambda e: _gib(e.weight_bytes)),
        ("  of which FP8 / scales", lambda e: f"{_gib(e.weight_breakdown['fp8'])} / {e.weight_breakdown['scales'] / 2**20:.1f} MiB"),
        ("KV bytes / token", lambda e: f"{e.kv_bytes_per_token:,}"),
        ("KV budget", lambda e: _gib(e.kv_budget_bytes)),
        ("KV capacity (tokens)", lambda e: f"{e.kv_capacity_tokens:,}"),
        ("max concurrency", lambda e: f"{e.max_concurrency:.2f}×"),
        ("decode concurrency", lambda e: f"{e.decode_concurrency:.1f}"),
        ("step lower bound", lambda e: f"{e.step['time_s'] * 1e3:.2f} ms ({e.step['bound']})"),
        ("throughput ceiling", lambda e: f"{e.throughput_tok_s:,.0f} tok/s"),
        ("ratio vs bf16", lambda e: f"{e.ratio_vs_bf16:.3f}×" if math.isfinite(e.ratio_vs_bf16) else "∞"),
    ]
    for label, fn in rows:
        t.add_row(label, *[fn(e) for e in est.values()])
    con = _console()
    con.print(t)
    for e in est.values():
        for n in e.notes:
            con.print(f"[yellow]{e.precision}: {n}[/yellow]")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------------------------
# run


def cmd_run(args: argparse.Namespace) -> int:
    from fp8rl.perf.harness import RolloutUnavailable, run_benchmark
    from fp8rl.perf.results import write_result
    from fp8rl.registry import EngineLoadError, load_engine

    try:
        engine = load_engine(args.engine)
    except EngineLoadError as exc:
        return _err(str(exc))
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    con = _console()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = len(configs) * (args.warmup + args.repeats)
    show = not args.no_progress and con.is_terminal
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, disable=not show, transient=True) as prog:
        task = prog.add_task("perf run", total=total)

        def tick(label: str) -> None:
            prog.update(task, advance=1, description=label)

        try:
            result = run_benchmark(engine, model=args.model, configs=configs, batch=args.batch,
                                   prompt_len=args.prompt_len, gen_len=args.gen_len, repeats=args.repeats,
                                   warmup=args.warmup, seed=args.seed, order=args.order, greedy=not args.sample,
                                   vocab_size=args.vocab_size,
                                   model_name=args.model_name, hardware=args.hardware, command=sys.argv,
                                   progress=tick, config_budget_s=args.config_budget_s)
        except RolloutUnavailable as exc:
            return _err(f"cannot run: {exc}")
        except ValueError as exc:
            return _err(str(exc))
    out = write_result(result, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_run_summary(result, con)
        con.print(f"result: {out}")
    bad = [r for r in result["runs"] if not r["valid"]]
    if bad:
        con.print(f"[red]{len(bad)} run(s) broke the fixed-length workload: "
                  f"{'; '.join(sorted({p for r in bad for p in r['problems']}))}[/red]")
        return EXIT_FAIL
    return EXIT_OK


def _print_run_summary(result: dict, con) -> None:
    from rich.table import Table

    wl = result["workload"]
    t = Table(title=f"{result['engine']['name']} · {result['model']['name']} · batch {wl['batch']}, prompt "
                    f"{wl['prompt_len']}, gen {wl['gen_len']}, {wl['repeats']} paired repeats ({wl['order']})",
              title_justify="left")
    for c in ("config", "valid runs", "median tok/s", "min–max tok/s", "median wall", "peak mem", "KV cap",
              "median ratio"):
        t.add_column(c, justify="right" if c != "config" else "left")
    def f(x, fmt: str) -> str:
        return "–" if x is None else fmt.format(x)

    for cfg, s in result["summary"].items():
        t.add_row(cfg, f"{s['valid_runs']}/{s['runs']}", f(s["median_throughput"], "{:,.1f}"),
                  f"{f(s['min_throughput'], '{:,.1f}')}–{f(s['max_throughput'], '{:,.1f}')}",
                  f(s["median_wall_s"], "{:.3f} s"), _gib(s["peak_memory_bytes"]),
                  f(s["kv_capacity_tokens"], "{:,}"), f(s["median_ratio_vs_baseline"], "{:.3f}×"))
    con.print(t)
    con.print("[dim]ratios here are medians; `fp8rl perf gate` computes paired bootstrap CIs[/dim]")


# ----------------------------------------------------------------------------------------------------------------
# ingest


def cmd_ingest(args: argparse.Namespace) -> int:
    from fp8rl.perf.results import ResultError, hardware_block, ingest_vllm, write_result

    groups: list[tuple[str | None, list[str]]] = []
    for item in args.run or []:
        if len(item) < 2:
            return _err("--run: expected CONFIG FILE [FILE ...]")
        groups.append((item[0], item[1:]))
    if args.files:
        groups.append((None, list(args.files)))
    if not groups:
        return _err("ingest: give files with --run CONFIG FILE... (or PyTorch-benchmark-format files positionally)")
    try:
        hw = hardware_block(args.hardware) if args.hardware else {"name": None, "class": None, "device": None}
        result = ingest_vllm(groups, model_name=args.model_name, hardware=hw, engine_version=args.engine_version,
                             prompt_len=args.prompt_len, gen_len=args.gen_len, baseline=args.baseline,
                             command=sys.argv)
        out = write_result(result, args.out)
    except (ResultError, ValueError) as exc:
        return _err(str(exc))
    n = {c: sum(1 for r in result["runs"] if r["config"] == c) for c in result["configs"]}
    print(f"ingested {sum(n.values())} vLLM bench runs {n} ({result['metric']}) -> {out}")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------------------------
# gate


def _parse_fraction(text: str) -> float:
    t = text.strip()
    v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    if not 0 <= v < 1:
        raise ValueError(f"--max-regression: expected a fraction in [0, 1) or a percentage, got {text!r}")
    return v


def cmd_gate(args: argparse.Namespace) -> int:
    from fp8rl.perf import gate as g
    from fp8rl.perf.gate_render import write_outputs
    from fp8rl.perf.results import ResultError, load_result

    try:
        claims = g.load_claims(args.claims)
        results = [(str(p), load_result(p)) for p in args.results]
        baseline = (str(args.baseline), load_result(args.baseline)) if args.baseline else None
        max_reg = _parse_fraction(args.max_regression)
        report = g.gate(results, claims, baseline=baseline, max_regression=max_reg, confidence=args.confidence,
                        n_resamples=args.resamples, seed=args.seed, method=args.ci_method, min_pairs=args.min_pairs,
                        only_claims=args.claim)
    except (ResultError, ValueError) as exc:
        return _err(str(exc))
    code = g.exit_code(report, allow_unmatched=args.allow_unmatched)
    if args.out:
        paths = write_outputs(report, args.out)
    if args.json:
        d = report.to_dict()
        d["exit_code"] = code
        print(json.dumps(d, indent=2, default=float))
    else:
        _print_gate(report, code)
        if args.out:
            print("written: " + ", ".join(str(p) for p in paths.values()))
    if g.overall_verdict(report) == "NOTHING-GATED" and not args.allow_unmatched:
        print("fp8rl perf gate: nothing was gated (no claim applied to any comparison and no --baseline); "
              "pass --allow-unmatched to accept", file=sys.stderr)
    return code


def _print_gate(report, code: int) -> None:
    from fp8rl.perf import gate as g
    from fp8rl.perf.gate_render import _fmt
    from rich.table import Table

    con = _console()
    colors = {"PASS": "green", "FAIL": "red", "INSUFFICIENT": "red", "NOT-RUN": "red", "REGRESSED": "red", "SUSPECT": "yellow",
              "INFO": "blue", "NO-CLAIM": "dim"}
    t = Table(title=f"perf gate: {g.overall_verdict(report)} (exit {code}; {report.confidence:.0%} bootstrap CIs)",
              title_justify="left")
    for c in ("file", "group", "comparison", "n", "ratio", "CI", "claim", "band", "ceiling", "vs model", "verdict"):
        t.add_column(c)
    for r in report.rows:
        e = r.estimate
        band = (f"{_fmt(r.claim_lower, 2)}–{_fmt(r.claim_upper, 2)}" if r.claim_upper is not None
                else (f"≥ {_fmt(r.claim_lower, 2)}" if r.claim_lower is not None else "–"))
        col = colors.get(r.verdict, "white")
        t.add_row(Path(r.file).name, r.group, f"{r.config} / {r.baseline}", str(e.n), f"{_fmt(e.point)}×",
                  f"[{_fmt(e.lo)}, {_fmt(e.hi)}]", r.claim_id or "–", band, _fmt(r.ceiling, 2),
                  "–" if r.model_error is None else f"{r.model_error:+.1%}", f"[{col}]{r.verdict}[/{col}]")
    con.print(t)
    for r in report.rows:
        if r.reason and r.verdict not in ("PASS", "NO-CLAIM", "INFO"):
            con.print(f"  {r.claim_id or r.config}: {r.reason}")
    for n in report.notes:
        con.print(f"  note: {n}")


# ----------------------------------------------------------------------------------------------------------------
# listings


def cmd_claims(args: argparse.Namespace) -> int:
    from fp8rl.perf import gate as g
    from fp8rl.perf.results import ResultError

    try:
        claims = g.load_claims(args.claims)
    except ResultError as exc:
        return _err(str(exc))
    if args.json:
        from dataclasses import asdict

        print(json.dumps([asdict(c) for c in claims], indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table(title=f"{len(claims)} perf claims", title_justify="left")
    for col in ("id", "model", "engine", "hw class", "comparison", "band", "gate", "source"):
        t.add_column(col, no_wrap=col != "source", overflow="ellipsis", max_width=48 if col == "source" else None)
    for c in claims:
        hwc = c.hardware_class if isinstance(c.hardware_class, str) else ",".join(c.hardware_class)
        t.add_row(c.id, c.model, c.engine, hwc, f"{c.config}/{c.baseline}",
                  f"{c.lower:.2f}–{c.upper:.2f}" if c.upper else f"≥ {c.lower:.2f}", "yes" if c.gate else "info",
                  c.source.split(":")[0][:60])
    _console().print(t)
    return EXIT_OK


def cmd_hardware(args: argparse.Namespace) -> int:
    from fp8rl.perf import model as pm

    if args.probe:
        return _cmd_probe(args)
    hws = [pm.load_hardware(n) for n in pm.known_hardware()]
    if args.json:
        from dataclasses import asdict

        print(json.dumps([asdict(h) for h in hws], indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table(title="hardware specs (perf/hardware.json)", title_justify="left")
    for c in ("name", "class", "HBM", "bandwidth", "BF16 dense", "FP8 dense", "FP4 dense"):
        t.add_column(c)
    for h in hws:
        t.add_row(h.name, h.cls, _gib(h.hbm_bytes), f"{h.hbm_bandwidth_Bps / 1e12:.2f} TB/s",
                  f"{h.bf16_dense_flops / 1e12:,.0f} TFLOP/s", f"{h.fp8_dense_flops / 1e12:,.0f} TFLOP/s",
                  f"{h.fp4_dense_flops / 1e12:,.0f} TFLOP/s" if h.fp4_dense_flops else "—")
    _console().print(t)
    return EXIT_OK


def _cmd_probe(args: argparse.Namespace) -> int:
    from fp8rl.perf import model as pm
    from fp8rl.perf.probe import probe, probe_file, write_probe

    try:
        probed = probe(args.device, size_mib=args.size_mib, matmul_n=args.matmul_n, repeats=args.repeats,
                       name=args.name)
    except ValueError as exc:
        return _err(str(exc))
    out = write_probe(probed, args.out) if args.out else None
    if args.json:
        print(json.dumps(probe_file(probed), indent=2))
        return EXIT_OK
    e, m = probed["entry"], probed["entry"]["measured"]
    con = _console()
    con.print(f"{probed['name']} ({m['device_name']}, {m['device']}, {m['threads']} threads, load "
              f"{m['loadavg_1m']:.2f})" if m["loadavg_1m"] is not None else probed["name"])
    con.print(f"  memory      {_gib(e['hbm_bytes'])}")
    con.print(f"  bandwidth   copy {m['stream']['copy_Bps'] / 1e9:,.2f} GB/s, triad {m['stream']['triad_Bps'] / 1e9:,.2f}"
              f" GB/s ({m['stream']['size_mib']} MiB)")
    mm = m["matmul"]
    fp8 = (f"{mm['fp8_scaled_mm_flops'] / 1e9:,.1f} GFLOP/s" if mm["fp8_supported"]
           else f"unsupported ({mm['fp8_reason']})")
    con.print(f"  matmul n={mm['n']}  fp32 {mm['fp32_flops'] / 1e9:,.1f}, bf16 {mm['bf16_flops'] / 1e9:,.1f} GFLOP/s, "
              f"fp8 _scaled_mm {fp8}")
    if out is not None:
        pm.load_hardware(str(out))  # the written file must load in the model
        con.print(f"written: {out}  (use: fp8rl perf model --hardware {out} ...; fp8rl perf run --hardware {out})")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------------------------


def register(subparsers) -> None:
    """Add ``perf`` and its subcommands to the main ``fp8rl`` parser."""
    p = subparsers.add_parser("perf", help="throughput model, harness, claim and regression gates",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="perf_command", required=True)

    m = sub.add_parser("model", help="analytic roofline + KV-capacity model for an HF config on a GPU")
    m.add_argument("--model", required=True,
                   help="known name (Qwen3-8B, Qwen3-30B-A3B, tiny-qwen3, ...), a config.json or a model dir")
    m.add_argument("--hardware", default="H100-SXM-80GB",
                   help="entry of hardware.json or a probed file FILE[#ENTRY] (default H100-SXM-80GB)")
    m.add_argument("--configs", default="bf16,fp8-linear,fp8-kv,fp8-all")
    m.add_argument("--workload", default=None, help="PROMPT:GEN[:MAX_NUM_SEQS], e.g. 2048:20480:256")
    m.add_argument("--prompt-len", type=int, default=1024)
    m.add_argument("--gen-len", type=int, default=1024)
    m.add_argument("--max-num-seqs", type=int, default=256)
    m.add_argument("--requests", type=int, default=None, help="number of requests (caps the concurrency)")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    m.add_argument("--overhead-gib", type=float, default=2.0, help="non-weight, non-KV memory (default 2 GiB)")
    m.add_argument("--calibrate", default=None,
                   help="CONFIG:KV_TOKENS: derive the budget from a measured capacity (e.g. bf16:249952)")
    m.add_argument("--tp", type=int, default=1)
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_model)

    r = sub.add_parser("run", help="measure rollout throughput of precision configs (interleaved paired repeats)")
    r.add_argument("--engine", required=True, help="engine with the 'rollout' capability (name or pkg.mod:factory)")
    r.add_argument("--model", required=True,
                   help="tiny fixture name (tiny-qwen3, tiny-qwen3-moe) or HF checkpoint dir (config.json + safetensors)")
    r.add_argument("--configs", default="bf16,fp8-linear", help="comma list; the first is the baseline")
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--prompt-len", type=int, default=64)
    r.add_argument("--gen-len", type=int, default=64)
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--warmup", type=int, default=1)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--order", choices=("interleaved", "abba"), default="interleaved")
    r.add_argument("--sample", action="store_true", help="seeded sampling instead of greedy decoding")
    r.add_argument("--vocab-size", type=int, default=None, help="prompt id range (default: from config.json)")
    r.add_argument("--model-name", default=None, help="name the gate matches claims on (default: from the model)")
    r.add_argument("--hardware", default=None,
                   help="hardware.json entry, a probed file (fp8rl perf hardware --probe --out FILE) or 'cpu' "
                        "(default: detected)")
    r.add_argument("--config-budget-s", type=float, default=None,
                   help="the most seconds one config's warm-up and timed calls may take, estimated from a pilot "
                        "rollout: a config over it is not timed (the gate says NOT-RUN; the baseline always runs)")
    r.add_argument("--out", default="perf-result.json")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--json", action="store_true", help="also print the result JSON")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("ingest", help="convert `vllm bench throughput --output-json` files into a result file")
    i.add_argument("files", nargs="*", help="PyTorch-benchmark-format files (config inferred from their args)")
    i.add_argument("--run", nargs="+", action="append", metavar="CONFIG_THEN_FILES",
                   help="CONFIG FILE [FILE ...]: repeats of one config in execution order (repeatable)")
    i.add_argument("--model-name", required=True)
    i.add_argument("--hardware", default=None)
    i.add_argument("--engine-version", default=None)
    i.add_argument("--prompt-len", type=int, default=None)
    i.add_argument("--gen-len", type=int, default=None, help="with it, the metric is output tokens/s")
    i.add_argument("--baseline", default="bf16")
    i.add_argument("--out", required=True)
    i.set_defaults(func=cmd_ingest)

    g = sub.add_parser("gate", help="claim gates (bootstrap CI of paired speedups) and regression gate")
    g.add_argument("results", nargs="+")
    g.add_argument("--claims", default=None, help="claims TOML (default: the packaged claims.toml)")
    g.add_argument("--claim", action="append", default=None, help="only this claim id (repeatable)")
    g.add_argument("--baseline", default=None, help="baseline result file for the regression gate")
    g.add_argument("--max-regression", default="5%", help="e.g. 5%% or 0.05 (default 5%%)")
    g.add_argument("--confidence", type=float, default=0.95)
    g.add_argument("--resamples", type=int, default=9999)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ci-method", default="BCa", choices=("BCa", "percentile", "basic"))
    g.add_argument("--min-pairs", type=int, default=3)
    g.add_argument("--out", default=None, help="directory for gate.json, gate.md, gate.png")
    g.add_argument("--allow-unmatched", action="store_true", help="exit 0 when nothing was gated")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gate)

    c = sub.add_parser("claims", help="list the claims")
    c.add_argument("--claims", default=None)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_claims)

    h = sub.add_parser("hardware", help="list hardware specs, or --probe this machine")
    h.add_argument("--json", action="store_true")
    h.add_argument("--probe", action="store_true",
                   help="measure this machine (STREAM copy/triad, fp32/bf16 matmul, FP8 _scaled_mm) and write a "
                        "hardware.json-format entry (fp8rl.perf.probe)")
    h.add_argument("--out", default=None, help="with --probe: file to write (use it as --hardware FILE)")
    h.add_argument("--device", default=None, choices=("cpu", "cuda"), help="with --probe (default: cuda if present)")
    h.add_argument("--name", default=None, help="with --probe: entry name (default: probed-<device name>)")
    h.add_argument("--size-mib", type=int, default=None,
                   help="with --probe: STREAM vector size (default 256 MiB on CPU, 2048 MiB on CUDA)")
    h.add_argument("--matmul-n", type=int, default=None,
                   help="with --probe: n of the n^3 matmuls (default 2048 on CPU, 8192 on CUDA)")
    h.add_argument("--repeats", type=int, default=5, help="with --probe: best of N (default 5)")
    h.set_defaults(func=cmd_hardware)
