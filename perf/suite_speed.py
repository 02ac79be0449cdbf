"""Performance of the suite itself, as ratios measured side by side in one run.

    python -m fp8rl.perf.suite_speed                 # oracle vs veRL-style blockwise quantizer, 4096×4096 fp32
    python -m fp8rl.perf.suite_speed --conformance   # also time `fp8rl conformance --profile ci` (target ≤ 60 s)

1. The oracle's 128×128 block quantization (``fp8rl.reference.quant.quantize(x, Granularity.block(128))``) of a
   4096×4096 fp32 weight vs a veRL-style PyTorch blockwise quantizer on the same input (target ratio ≤ 0.5×: the
   oracle sits on the critical path of every check and must not be the slow part of anyone's CI). Both run with the
   same torch thread count (the oracle splits its rows between ``torch.get_num_threads()`` threads). veRL is not installed here, so the quantizer below re-implements
   the steps of veRL's PyTorch path (``verl/utils/kernel/fp8_kernel.py`` ``_scaled_fp8_blockwise_pytorch``,
   ``VERL_DISABLE_TRITON_FP8=1``; docs/verl-correction.md §3.2): zero-pad to multiples of 128, reshape/permute to blocks, fp32
   ``amax``, ``scale = 448/amax`` (1 where amax is 0 or inf), ``x·scale``, clamp to ±448, cast to e4m3fn, undo the
   permute, crop; the descale is ``1/scale``. Repeats are interleaved (oracle, veRL, oracle, veRL, …) after one
   warm-up each; medians are compared.
   As a by-product the oracle's ``verl_torch`` policy is checked bit-for-bit against this quantizer (codes and
   scales), since it claims to be that path.
2. Optionally the wall time of ``fp8rl conformance --engine torch --profile ci`` (ratio to the 60 s target).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

FP8_MAX = 448.0
#: the oracle's block quantizer may take at most this fraction of the veRL-style quantizer's time
TARGET_RATIO = 0.5


def verl_style_blockwise(x, block: int = 128):
    """veRL's PyTorch-path blockwise FP8 quantizer, re-implemented: (e4m3fn codes (M, N), fp32 descale (bm, bn))."""
    import torch
    import torch.nn.functional as F

    m, n = x.shape
    pm, pn = -m % block, -n % block
    if pm or pn:
        x = F.pad(x, (0, pn, 0, pm), mode="constant", value=0)
    bm, bn = x.shape[0] // block, x.shape[1] // block
    blocks = x.reshape(bm, block, bn, block).permute(0, 2, 1, 3).contiguous().to(torch.float32).flatten(2)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.div(FP8_MAX, amax)
    scale = torch.where((amax == 0) | (amax == torch.inf), torch.ones_like(scale), scale)
    descale = torch.reciprocal(scale)
    blocks.mul_(scale).clamp_(-FP8_MAX, FP8_MAX)
    q = blocks.to(torch.float8_e4m3fn).reshape(bm, bn, block, block).permute(0, 2, 1, 3).reshape(x.shape)
    return q[:m, :n].contiguous(), descale.reshape(bm, bn)


def oracle_blockwise(x, policy: str = "reference"):
    from fp8rl.reference.quant import Granularity, quantize

    return quantize(x, Granularity.block(128), policy)


def _time(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def measure_quantizers(size: int = 4096, repeats: int = 7, seed: int = 0, policy: str = "reference") -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, size, generator=g, dtype=torch.float32) * 0.02
    oracle_blockwise(x, policy)  # warm-up
    verl_style_blockwise(x)
    to, tv = [], []
    for _ in range(repeats):
        to.append(_time(oracle_blockwise, x, policy))
        tv.append(_time(verl_style_blockwise, x))
    # bit-for-bit: the oracle's verl_torch preset vs this re-implementation
    qt = oracle_blockwise(x, "verl_torch")
    q, s = verl_style_blockwise(x)
    code_mismatch = int((qt.codes != q.view(torch.uint8)).sum())
    scale_mismatch = int((qt.scale != s).sum())
    mo, mv = statistics.median(to), statistics.median(tv)
    return {"size": size, "repeats": repeats, "policy": policy, "torch_threads": torch.get_num_threads(),
            "oracle_s": to, "verl_style_s": tv, "oracle_median_s": mo, "verl_style_median_s": mv,
            "ratio_oracle_over_verl": mo / mv, "target_ratio": TARGET_RATIO, "meets_target": mo / mv <= TARGET_RATIO,
            "verl_torch_policy_code_mismatches": code_mismatch, "verl_torch_policy_scale_mismatches": scale_mismatch}


def measure_conformance(timeout: float = 900) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "fp8rl", "conformance", "--engine", "torch", "--profile", "ci", "--out", d]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
        wall = time.perf_counter() - t0
    return {"command": " ".join(cmd[1:]), "exit_code": rc, "wall_s": wall, "target_s": 60.0,
            "ratio_to_target": wall / 60.0, "meets_target": wall <= 60.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8rl.perf.suite_speed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats; the medians are compared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="reference", help="oracle ScalePolicy preset (default reference)")
    ap.add_argument("--conformance", action="store_true", help="also time fp8rl conformance --profile ci")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected at least 1, got {args.repeats}")
    if args.size < 1:
        ap.error(f"--size: expected a positive matrix size, got {args.size}")
    out = {"quantize": measure_quantizers(args.size, args.repeats, args.seed, args.policy)}
    if args.conformance:
        out["conformance"] = measure_conformance()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    q = out["quantize"]
    verdict = (f"meets the ≤ {TARGET_RATIO}× target" if q["meets_target"]
               else f"MISSES the ≤ {TARGET_RATIO}× target")
    print(f"block 128×128 quantization of a {q['size']}×{q['size']} fp32 weight "
          f"({q['repeats']} interleaved repeats, {q['torch_threads']} torch threads):")
    print(f"  oracle ({q['policy']}):       median {q['oracle_median_s'] * 1e3:9.1f} ms   {['%.1f' % (t * 1e3) for t in q['oracle_s']]}")
    print(f"  veRL-style PyTorch path: median {q['verl_style_median_s'] * 1e3:9.1f} ms   {['%.1f' % (t * 1e3) for t in q['verl_style_s']]}")
    print(f"  ratio oracle / veRL = {q['ratio_oracle_over_verl']:.2f}× — {verdict}")
    print(f"  oracle 'verl_torch' policy vs veRL-style: {q['verl_torch_policy_code_mismatches']} code and "
          f"{q['verl_torch_policy_scale_mismatches']} scale mismatches")
    if "conformance" in out:
        c = out["conformance"]
        print(f"fp8rl conformance --profile ci: {c['wall_s']:.1f} s (exit {c['exit_code']}); "
              f"ratio to the 60 s target {c['ratio_to_target']:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
