"""One prepared GPU check, within a time budget: hardware probe, FP8 vs BF16 GEMM at rollout shapes vs the roofline
ceiling, torch-cuda conformance.

    python -m fp8rl.perf.gpu_check --out DIR            # on a CUDA machine: ≤ --budget-s (480 s = 8 min) in all
    python -m fp8rl.perf.gpu_check --plan               # the stages and their time limits, as JSON (runs anywhere)
    python -m fp8rl.perf.gpu_check --force-cpu --out DIR --shapes tiny   # exercise the code path on CPU

Without CUDA (and without ``--force-cpu``) it prints why and exits 0: CI never has a GPU.

Stages, in this order (the most informative first, so a lease that ends early still leaves the GEMM numbers), each
bounded by what is left of ``--budget-s`` (a stage that would start with less than its minimum is skipped and
recorded as such; ``gpu_check.json`` is rewritten after every stage, so a killed run keeps what it measured):

1. ``probe``: the hardware probe, ``--probe-cmd`` (default ``fp8rl perf hardware --probe --out
   DIR/hardware-probe.json``: memory bandwidth, matmul throughput, ``_scaled_mm`` of the machine, in the
   ``hardware.json`` entry format) in a subprocess with a timeout. A probe command this installation lacks (exit 2,
   e.g. no ``--probe`` option yet) is recorded as unavailable with its message, not as a failure.
2. ``gemm``: the GEMM benchmark below; it checks the budget between shapes and records the shapes it had no time for.
3. ``conformance``: ``fp8rl conformance --engine torch-cuda --profile ci``, its timeout the smaller of
   ``--conformance-timeout`` and the budget left (minus a reserve for the gate).
4. ``gate``: ``fp8rl perf gate`` on ``gemm.json``.

Writes into ``--out``:

* ``gemm.json``: a ``fp8rl.perf.result`` file (kind ``gemm``, metric TFLOP/s). One group per shape (the linear
  layers of Qwen3-8B and Qwen3-30B-A3B at decode batches 64/256 and a 4096-token prefill chunk); configs ``bf16``
  (``torch.mm``), ``fp8-row`` (``torch._scaled_mm``, per-token × per-channel scales) and, where torch supports it
  (sm90 + CUDA ≥ 12.9), ``fp8-block`` (``F.scaled_mm`` 1×128 × 128×128, the DeepSeek/paper recipe). Repeats are
  interleaved and paired; each repeat times ``--iters`` back-to-back calls with CUDA events. The per-shape roofline
  ceiling (``model.gemm_speedup_ceiling`` on the detected hardware) is embedded, so ``fp8rl perf gate gemm.json``
  flags impossible speedups. Activation quantization is *not* timed (a fused engine kernel does it in the GEMM
  prologue or the previous op's epilogue; timing an unfused torch quantizer would misrepresent it).
* ``conformance/``: the report of ``fp8rl conformance --engine torch-cuda --profile ci``.
* ``gpu_check.json``: environment, hardware-table check (device memory vs hardware.json), conformance outcome,
  per-shape accuracy (relative error of each FP8 GEMM vs BF16) and achieved fraction of the roofline.
* ``gate/``: ``fp8rl perf gate gemm.json`` outputs (markdown, JSON, plot).
* ``hardware-probe.json``: the probe's entry, when the probe ran.

``gpu_check.json`` also has ``stages``: per stage its status (``ok``, ``failed``, ``unavailable``, ``skipped``,
``cut``), wall time and limit, and ``ratios``: per GEMM shape the measured median FP8/BF16 speedup beside the
model's ceiling (what the closing table prints).

Exit code: 0 when everything ran and passed; 1 if conformance was non-conformant or the GEMM gate failed; 4 if the
budget cut a stage short and nothing failed (the results so far are written).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: the whole check must fit one lease of a GPU machine (8 minutes on one H200)
DEFAULT_BUDGET_S = 480.0
#: the probe's limit and the least time worth starting each stage with (seconds)
PROBE_TIMEOUT_S = 90.0
MIN_STAGE_S = {"probe": 20.0, "gemm": 30.0, "conformance": 60.0}
#: kept back from the conformance timeout for the gate and the final files
GATE_RESERVE_S = 20.0
DEFAULT_PROBE_CMD = "fp8rl perf hardware --probe --out {out}/hardware-probe.json"
EXIT_CUT = 4

SHAPES = {
    # name: (N, K) of y = x · Wᵀ, W (N, K)
    "qwen3-8b.qkv": (6144, 4096),
    "qwen3-8b.o": (4096, 4096),
    "qwen3-8b.gate_up": (24576, 4096),
    "qwen3-8b.down": (4096, 12288),
    "qwen3-30b-a3b.qkv": (5120, 2048),
    "qwen3-30b-a3b.expert_gate_up": (1536, 2048),
}
M_VALUES = {"decode": (64, 256), "all": (64, 256, 4096), "tiny": (32,)}
TINY_SHAPES = {"tiny.a": (256, 256), "tiny.b": (128, 384)}


def _quant_rowwise(x, fp8):
    import torch

    amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    q = (x.float() / scale).clamp(-448, 448).to(fp8)
    return q, scale.to(torch.float32)


def _quant_block(x, fp8, bm: int, bn: int):
    """(rows, cols) → codes and (ceil(rows/bm), ceil(cols/bn)) fp32 dequant scales."""
    import torch

    r, c = x.shape
    pr, pc = -r % bm, -c % bn
    xp = torch.nn.functional.pad(x.float(), (0, pc, 0, pr))
    blocks = xp.reshape(xp.shape[0] // bm, bm, xp.shape[1] // bn, bn)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).reshape(xp.shape)[:r, :c].to(fp8)
    return q.contiguous(), scale.contiguous()


class _Timer:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def time(self, fn, iters: int) -> float:
        import torch

        if iters <= 0:
            return 0.0
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters


def _gemm_fns(m: int, n: int, k: int, device: str, seed: int):
    """{config: (callable, output-for-accuracy or error string)} for one shape."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(device=device, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    fns: dict[str, object] = {"bf16": lambda: x @ w.t()}
    xq, xs = _quant_rowwise(x, fp8)
    wq, ws = _quant_rowwise(w, fp8)
    ws_t = ws.t().contiguous()

    def row():
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_t, out_dtype=torch.bfloat16)

    fns["fp8-row"] = row
    try:
        from torch.nn.functional import ScalingType, SwizzleType

        aq, a_s = _quant_block(x, fp8, 1, 128)  # (M, K/128)
        bq, b_s = _quant_block(w, fp8, 128, 128)  # (N/128, K/128)
        kb = a_s.shape[1]
        l4 = -(-kb // 4) * 4
        sa = a_s.t().contiguous().t()  # (M, K/128), column-major
        sb_pad = torch.ones(b_s.shape[0], l4, device=device, dtype=torch.float32)
        sb_pad[:, :kb] = b_s
        sb = sb_pad.t()  # (L4, N/128), column-major

        def block():
            return F.scaled_mm(aq, bq.t(), [sa], [ScalingType.BlockWise1x128], [sb], [ScalingType.BlockWise128x128],
                               [SwizzleType.NO_SWIZZLE], [SwizzleType.NO_SWIZZLE], None, torch.bfloat16)

        block()
        fns["fp8-block"] = block
    except Exception as exc:  # noqa: BLE001 - record why block-wise is unavailable here
        fns["fp8-block"] = f"unsupported: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return fns


def run_gemm(out: Path, *, device: str, m_values, shapes: dict, repeats: int, iters: int, warmup: int, seed: int,
             hardware_name: str | None, deadline: float | None = None) -> tuple[dict | None, dict, list[str]]:
    """Time every shape × M (see the module docstring); before each shape, stop if ``deadline`` (time.monotonic())
    has passed. Returns (the gemm.json result or None when nothing was measured, per-group details, the groups
    skipped for the budget)."""
    import torch
    from fp8rl.environment import environment
    from fp8rl.perf import model as pm
    from fp8rl.perf.results import hardware_block, new_result, write_result

    cuda = device.startswith("cuda")
    timer = _Timer(cuda)
    hw_block = hardware_block(hardware_name) if hardware_name else (
        hardware_block(None) if cuda else {"name": None, "class": "cpu", "device": "cpu"})
    hw_name = hw_block.get("name")
    hw = pm.load_hardware(hw_name) if hw_name else None
    runs, ceilings, details, configs = [], {}, {}, ["bf16", "fp8-row"]
    skipped: list[str] = []
    seq = 0
    for sname, (n, k) in shapes.items():
        for m in m_values:
            group = f"{sname}.M{m}"
            if deadline is not None and time.monotonic() >= deadline:
                skipped.append(group)
                continue
            fns = _gemm_fns(m, n, k, device, seed)
            avail = {c: f for c, f in fns.items() if callable(f)}
            if "fp8-block" in avail and "fp8-block" not in configs:
                configs.append("fp8-block")
            ref = fns["bf16"]().float()  # type: ignore[operator]
            acc = {}
            for c, f in avail.items():
                if c != "bf16":
                    y = f().float()
                    acc[c] = float((y - ref).norm() / ref.norm().clamp(min=1e-30))
            flops = 2.0 * m * n * k
            for f in avail.values():
                timer.time(f, warmup)
            for i in range(repeats):
                for c in avail:
                    t = timer.time(avail[c], iters)
                    runs.append({"group": group, "config": c, "repeat": i, "seq": seq, "throughput": flops / t / 1e12,
                                 "wall_s": t, "tokens": None, "peak_memory_bytes": None, "peak_memory_kind": None,
                                 "kv_capacity_tokens": None, "valid": True, "problems": []})
                    seq += 1
            if hw is not None:
                ceilings[group] = {"fp8-row": pm.gemm_speedup_ceiling(m, n, k, hw, "row"),
                                   "fp8-block": pm.gemm_speedup_ceiling(m, n, k, hw, "block")}
            per = {c: sorted(r["throughput"] for r in runs if r["group"] == group and r["config"] == c)
                   for c in avail}
            med = {c: v[len(v) // 2] for c, v in per.items()}
            roof = {}
            if hw is not None:
                for c in med:
                    lb = pm.gemm_time_lb(m, n, k, hw, fp8=c != "bf16")
                    roof[c] = med[c] / (flops / lb / 1e12)
            details[group] = {"M": m, "N": n, "K": k, "median_tflops": med,
                              "median_speedup": {c: med[c] / med["bf16"] for c in med if c != "bf16"},
                              "rel_error_vs_bf16": acc, "roofline_fraction": roof,
                              "unavailable": {c: f for c, f in fns.items() if not callable(f)}}
            print(f"  {group:40s} " + "  ".join(f"{c} {v:9.4g} TF/s" for c, v in med.items()), flush=True)
    if not runs:
        return None, details, skipped
    dev_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    res = new_result(kind="gemm", source="fp8rl gpu_check", engine={"name": "torch", "version": torch.__version__},
                     model={"name": "rollout-gemm-shapes", "path": None}, hardware=hw_block,
                     workload={"m_values": list(m_values), "shapes": {k_: list(v) for k_, v in shapes.items()},
                               "repeats": repeats, "iters": iters, "warmup": warmup, "device": dev_name,
                               "timer": "cuda events" if cuda else "perf_counter"},
                     metric="tflops", baseline_config="bf16", configs=configs, runs=runs,
                     environment_=environment())
    if ceilings:
        res["ceilings"] = {g_: {c: v for c, v in cs.items() if c in configs} for g_, cs in ceilings.items()}
    write_result(res, out / "gemm.json")
    return res, details, skipped


def run_probe(out: Path, command: str, timeout: float) -> dict:
    """The hardware probe as a subprocess (``command`` with ``{out}`` replaced by the output folder)."""
    argv = shlex.split(command.format(out=str(out)))
    if argv and argv[0] == "fp8rl":
        argv = [sys.executable, "-m", "fp8rl", *argv[1:]]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = 124, f"timed out after {timeout:.0f} s: {str(exc)[-2000:]}"
    except OSError as exc:
        rc, tail = 127, f"{type(exc).__name__}: {exc}"
    # exit 2 = usage error (an installation without the probe, or other flags): unavailable, not a failure
    status = "ok" if rc == 0 else ("unavailable" if rc in (2, 127) else "failed")
    info = {"command": argv, "exit_code": rc, "status": status, "wall_s": round(time.perf_counter() - t0, 2),
            "output_tail": tail}
    probe_file = out / "hardware-probe.json"
    if rc == 0 and probe_file.exists():
        try:
            info["entry"] = json.loads(probe_file.read_text())
        except ValueError as exc:
            info["status"], info["output_tail"] = "failed", f"{probe_file}: not JSON ({exc})"
    return info


def plan(budget_s: float, conformance_timeout: float, *, skip_probe: bool = False,
         skip_conformance: bool = False) -> list[dict]:
    """The stages in order with the most time each may take when every earlier one uses its whole limit (the GEMM
    stage has no fixed limit: it stops between shapes at the deadline that leaves the conformance minimum)."""
    stages, left = [], budget_s
    if not skip_probe:
        lim = min(PROBE_TIMEOUT_S, left)
        stages.append({"stage": "probe", "limit_s": lim, "min_s": MIN_STAGE_S["probe"]})
        left -= lim
    reserve = 0.0 if skip_conformance else MIN_STAGE_S["conformance"] + GATE_RESERVE_S
    stages.append({"stage": "gemm", "limit_s": max(0.0, left - reserve), "min_s": MIN_STAGE_S["gemm"]})
    if not skip_conformance:
        stages.append({"stage": "conformance", "limit_s": min(conformance_timeout, max(0.0, left - GATE_RESERVE_S)),
                       "min_s": MIN_STAGE_S["conformance"], "note": "gets what the GEMM stage left, up to this"})
    stages.append({"stage": "gate", "limit_s": GATE_RESERVE_S, "min_s": 0.0})
    return stages


def speedup_table(details: dict, res: dict | None) -> dict:
    """Per group: measured median speedup of each FP8 config over bf16 and the model's ceiling (None off-table)."""
    ceilings = (res or {}).get("ceilings", {})
    return {g_: {c: {"measured": v, "ceiling": ceilings.get(g_, {}).get(c)} for c, v in d["median_speedup"].items()}
            for g_, d in details.items()}


def run_conformance(out: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "fp8rl", "conformance", "--engine", "torch-cuda", "--profile", "ci", "--out",
           str(out / "conformance")]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = 124, f"timed out after {timeout} s: {str(exc)[-2000:]}"
    info = {"command": cmd, "exit_code": rc, "wall_s": round(time.perf_counter() - t0, 2), "output_tail": tail}
    rep = out / "conformance" / "report.json"
    if rep.exists():
        try:
            info["summary"] = json.loads(rep.read_text()).get("summary")
        except ValueError:
            pass
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8rl.perf.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--force-cpu", action="store_true", help="run the GEMM part on CPU (to test this script)")
    ap.add_argument("--shapes", choices=("decode", "all", "tiny"), default="all")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hardware", default=None, help="hardware.json entry (default: detected)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help=f"wall-clock budget for all stages (default {DEFAULT_BUDGET_S:.0f} s)")
    ap.add_argument("--probe-cmd", default=DEFAULT_PROBE_CMD, help="hardware probe command ({out}: the output folder)")
    ap.add_argument("--skip-probe", action="store_true")
    ap.add_argument("--skip-conformance", action="store_true")
    ap.add_argument("--conformance-timeout", type=float, default=300)
    ap.add_argument("--plan", action="store_true", help="print the stages and their time limits as JSON and exit")
    args = ap.parse_args(argv)
    for name in ("repeats", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup: expected 0 or more, got {args.warmup}")
    if not args.budget_s > 0:
        ap.error(f"--budget-s: expected a positive number of seconds, got {args.budget_s}")
    if not args.conformance_timeout > 0:
        ap.error(f"--conformance-timeout: expected a positive number of seconds, got {args.conformance_timeout}")
    stages_plan = plan(args.budget_s, args.conformance_timeout, skip_probe=args.skip_probe,
                       skip_conformance=args.skip_conformance)
    if args.plan:
        print(json.dumps({"budget_s": args.budget_s, "stages": stages_plan}, indent=2))
        return 0

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.force_cpu:
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to do — skipped.")
        return 0
    start = time.monotonic()
    deadline = start + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from fp8rl.environment import environment
    from fp8rl.perf import model as pm

    on_gpu = cuda and not args.force_cpu
    summary: dict = {"environment": environment(), "device": "cuda" if on_gpu else "cpu", "budget_s": args.budget_s,
                     "plan": stages_plan, "stages": {}}

    def save() -> None:
        summary["elapsed_s"] = round(time.monotonic() - start, 2)
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")

    def left() -> float:
        return deadline - time.monotonic()

    def record(stage: str, status: str, t0: float, limit: float | None, **extra) -> None:
        summary["stages"][stage] = {"status": status, "wall_s": round(time.monotonic() - t0, 2),
                                    "limit_s": None if limit is None else round(limit, 1), **extra}
        print(f"gpu_check: {stage}: {status} ({summary['stages'][stage]['wall_s']} s)", flush=True)
        save()

    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        hw = pm.match_hardware(props.name)
        summary["hardware_check"] = {
            "device": props.name, "capability": f"{props.major}.{props.minor}", "torch_total_memory": props.total_memory,
            "table_entry": hw.name if hw else None,
            "table_hbm_bytes": hw.hbm_bytes if hw else None,
            "memory_rel_diff": (props.total_memory / hw.hbm_bytes - 1) if hw else None}
        print(f"gpu_check: {props.name} (sm{props.major}{props.minor}), torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}; table entry {hw.name if hw else 'none'}; budget {args.budget_s:.0f} s",
              flush=True)
    failed = cut = False

    # 1. probe
    if not args.skip_probe:
        t0, limit = time.monotonic(), min(PROBE_TIMEOUT_S, left())
        if limit < MIN_STAGE_S["probe"]:
            record("probe", "skipped", t0, limit, reason="budget")
            cut = True
        else:
            print(f"gpu_check: probe: {args.probe_cmd.format(out=out)} (limit {limit:.0f} s)", flush=True)
            info = run_probe(out, args.probe_cmd, limit)
            summary["probe"] = info
            record("probe", info["status"], t0, limit)
            failed |= info["status"] == "failed"

    # 2. GEMM (stops between shapes so that the conformance minimum and the gate still fit)
    t0 = time.monotonic()
    reserve = GATE_RESERVE_S + (0.0 if args.skip_conformance or not on_gpu else MIN_STAGE_S["conformance"])
    gemm_deadline = deadline - reserve
    device = "cuda" if on_gpu else "cpu"
    shapes = TINY_SHAPES if args.shapes == "tiny" else SHAPES
    res = None
    if gemm_deadline - time.monotonic() < (MIN_STAGE_S["gemm"] if on_gpu else 0.0):
        record("gemm", "skipped", t0, max(0.0, gemm_deadline - t0), reason="budget")
        cut = True
    else:
        print(f"gpu_check: GEMM {device}, {len(shapes)} shapes × M {M_VALUES[args.shapes]}, {args.repeats} paired "
              f"repeats × {args.iters} iters", flush=True)
        res, details, skipped = run_gemm(out, device=device, m_values=M_VALUES[args.shapes], shapes=shapes,
                                         repeats=args.repeats, iters=args.iters, warmup=args.warmup, seed=args.seed,
                                         hardware_name=args.hardware, deadline=gemm_deadline)
        summary["gemm"] = details
        summary["ratios"] = speedup_table(details, res)
        cut |= bool(skipped)
        record("gemm", "cut" if skipped else "ok", t0, gemm_deadline - t0, skipped_groups=skipped)

    # 3. conformance
    if on_gpu and not args.skip_conformance:
        t0, limit = time.monotonic(), min(args.conformance_timeout, left() - GATE_RESERVE_S)
        if limit < MIN_STAGE_S["conformance"]:
            record("conformance", "skipped", t0, limit, reason="budget")
            cut = True
        else:
            print(f"gpu_check: fp8rl conformance --engine torch-cuda --profile ci (limit {limit:.0f} s) ...",
                  flush=True)
            conf = run_conformance(out, limit)
            summary["conformance"] = conf
            print(f"gpu_check: conformance exit {conf['exit_code']}: {conf.get('summary')}", flush=True)
            timed_out = conf["exit_code"] == 124
            cut |= timed_out
            failed |= conf["exit_code"] not in (0, 124)
            record("conformance", "cut" if timed_out else ("ok" if conf["exit_code"] == 0 else "failed"), t0, limit)

    # 4. gate
    if res is not None:
        t0 = time.monotonic()
        from fp8rl.perf import gate as g
        from fp8rl.perf.gate_render import to_markdown, write_outputs
        from fp8rl.perf.results import load_result

        report = g.gate([(str(out / "gemm.json"), load_result(out / "gemm.json"))], g.load_claims())
        write_outputs(report, out / "gate")
        code = g.exit_code(report, allow_unmatched=True)
        summary["gate"] = {"verdict": g.overall_verdict(report), "exit_code": code}
        print(to_markdown(report))
        failed |= code == g.EXIT_FAIL
        record("gate", "failed" if code == g.EXIT_FAIL else "ok", t0, GATE_RESERVE_S)
        print("gpu_check: measured FP8/BF16 speedup vs the model's ceiling (median of paired repeats):")
        for group, cs in summary["ratios"].items():
            print(f"  {group:40s} " + "  ".join(
                f"{c} {v['measured']:.2f}× (ceiling {v['ceiling']:.2f}×)" if v["ceiling"] is not None
                else f"{c} {v['measured']:.2f}× (no ceiling: hardware not in hardware.json)" for c, v in cs.items()))
    save()
    verdict = "FAILED" if failed else ("CUT SHORT by the budget" if cut else "ok")
    print(f"gpu_check: wrote {out}/gpu_check.json{', gemm.json, gate/' if res is not None else ''} in "
          f"{summary['elapsed_s']} s of {args.budget_s:.0f} s ({verdict})")
    return 1 if failed else (EXIT_CUT if cut else 0)


if __name__ == "__main__":
    sys.exit(main())
