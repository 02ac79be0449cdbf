"""Hardware probe: measure this machine so that the perf model can predict for it (``fp8rl perf hardware --probe``).

What is measured (best of ``repeats`` after one warm-up, as STREAM reports best times):

* memory bandwidth, STREAM-like on ``size_mib`` MiB fp32 vectors: *copy* ``a[:] = b`` (2 × N × 4 bytes moved) and
  *triad* ``a = b + s·c`` (3 × N × 4 bytes); the entry's ``hbm_bandwidth_Bps`` is the larger of the two (the model
  streams weights and KV, read-dominated traffic);
* dense matmul throughput, ``n × n × n`` (2n³ FLOP): fp32 and bf16;
* FP8: ``torch._scaled_mm`` on float8_e4m3fn operands with per-tensor fp32 scales and a bf16 output, when this torch
  build supports it on the device (PyTorch's CPU build does, through oneDNN), on an n small enough that one call
  stays within ``FP8_CALL_BUDGET_S`` (a slow fallback path is measured, not waited on). ``fp8_dense_flops`` is the
  larger of the FP8 and BF16 rates: an engine can always dequantize FP8 weights and run the BF16 GEMM (W8A16), so
  the BF16 rate is reachable for FP8 linear layers too, and the model's prediction stays a ceiling on machines whose
  FP8 GEMM is slower than their BF16 one (measured: 0.18x on an AMD EPYC, ~0.002x on a Sapphire-Rapids-class Xeon
  where PyTorch's CPU ``_scaled_mm`` takes a slow path while vLLM's W8A16 kernel does not). Where FP8 is not
  supported at all, the reason is recorded and ``fp8_dense_flops`` takes the bf16 number.

CPU timing is host wall-clock (``time.perf_counter``); on CUDA the same code times with CUDA events on the current
stream after a synchronize. The output is a file in the ``hardware.json`` format (one entry, plus a ``measured``
block with every raw number), loadable by ``fp8rl perf model --hardware FILE`` and ``fp8rl perf run --hardware
FILE``. ``hbm_bytes`` is the device's memory (CUDA: ``total_memory``; CPU: ``MemTotal`` of /proc/meminfo).

A probe is a measurement on a possibly shared machine: the entry records the 1-minute load average next to it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["FP8_CALL_BUDGET_S", "fp8_matmul_size", "probe", "write_probe", "probe_file"]


def _timer(device: str) -> Callable[[Callable[[], Any]], float]:
    import torch

    if device == "cuda":
        def timed(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return timed

    def timed_cpu(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return timed_cpu


def _best(timed: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    return min(timed(fn) for _ in range(repeats))


def _total_memory(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return str(torch.cuda.get_device_name(0))
    from fp8rl.environment import cpu_model

    return str(cpu_model() or platform.processor() or "cpu")


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _stream(timed: Callable[[Callable[[], Any]], float], device: str, size_mib: int,
            repeats: int) -> tuple[int, float, float]:
    """(bytes per vector, best copy time, best triad time); the vectors are freed on return."""
    import torch

    numel = size_mib * 2**20 // 4
    a = torch.empty(numel, dtype=torch.float32, device=device)
    b = torch.rand(numel, dtype=torch.float32, device=device)
    c = torch.rand(numel, dtype=torch.float32, device=device)
    t_copy = _best(timed, lambda: a.copy_(b), repeats)
    t_triad = _best(timed, lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return numel * 4, t_copy, t_triad


#: the longest one FP8 ``_scaled_mm`` of the probe should take (s). Where the device's FP8 GEMM is a slow fallback
#: (measured: PyTorch 2.13's CPU ``_scaled_mm`` on a Sapphire-Rapids-class CPU, 0.11 GFLOP/s, 2.4 s for 512³ against
#: 5 ms in BF16: 2048³ would take ~5 min a call) the FP8 rate is measured on a smaller n instead
FP8_CALL_BUDGET_S = 2.0
#: the size of the one pilot call that sizes the FP8 measurement
FP8_PILOT_N = 128


def fp8_matmul_size(t_pilot: float, pilot_n: int, n: int, budget_s: float = FP8_CALL_BUDGET_S) -> int:
    """The FP8 matmul size to measure: ``n`` halved until a call's estimated time, ``t_pilot · (size / pilot_n)³``
    (a GEMM's time grows with its FLOPs), is within ``budget_s``; never below ``pilot_n``."""
    size = n
    while size > pilot_n and t_pilot * (size / pilot_n) ** 3 > budget_s:
        size //= 2
    return max(size, pilot_n)


def probe(device: str | None = None, *, size_mib: int | None = None, matmul_n: int | None = None, repeats: int = 5,
          name: str | None = None) -> dict[str, Any]:
    """Measure ``device`` (``cpu``, ``cuda``; default: cuda when available); returns ``{"name": ..., "entry": {...}}``,
    the entry with the hardware.json keys plus ``measured`` (every raw number, the timer, threads and load)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # defaults: big enough to leave the caches (CPU) / to fill the tensor cores (GPU), small enough for seconds
    size_mib = _check_positive("size_mib", size_mib if size_mib is not None else (2048 if device == "cuda" else 256))
    matmul_n = _check_positive("matmul_n", matmul_n if matmul_n is not None else (8192 if device == "cuda" else 2048))
    _check_positive("repeats", repeats)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch.cuda.is_available() is False")
    timed = _timer(device)
    nbytes, t_copy, t_triad = _stream(timed, device, size_mib, repeats)
    copy_bps, triad_bps = 2 * nbytes / t_copy, 3 * nbytes / t_triad

    n = matmul_n
    flop = 2.0 * n**3
    x32 = torch.randn(n, n, device=device)
    y32 = torch.randn(n, n, device=device)
    t_fp32 = _best(timed, lambda: torch.mm(x32, y32), repeats)
    xb, yb = x32.bfloat16(), y32.bfloat16()
    t_bf16 = _best(timed, lambda: torch.mm(xb, yb), repeats)
    fp8: dict[str, Any] = {"supported": False, "flops": None, "reason": None, "n": None}
    try:
        one = torch.tensor(1.0, device=device)

        def scaled_mm(k: int) -> Callable[[], Any]:
            x8 = x32[:k, :k].to(torch.float8_e4m3fn)
            y8 = y32[:k, :k].t().contiguous().to(torch.float8_e4m3fn)  # _scaled_mm wants a column-major operand
            return lambda: torch._scaled_mm(x8, y8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        n8 = fp8_matmul_size(timed(scaled_mm(min(n, FP8_PILOT_N))), min(n, FP8_PILOT_N), n)
        t_fp8 = _best(timed, scaled_mm(n8), repeats)
        fp8 = {"supported": True, "flops": 2.0 * n8**3 / t_fp8, "reason": None, "n": n8}
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        fp8["reason"] = f"torch {torch.__version__} _scaled_mm on {device}: {type(exc).__name__}: {str(exc)[:200]}"
    bf16_flops = flop / t_bf16
    dev_name = _device_name(device)
    cls = "cpu"
    if device == "cuda":
        from fp8rl.perf.model import match_hardware

        known = match_hardware(dev_name)
        cls = known.cls if known else "cuda"
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = None
    when = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    label = name or ("probed-" + "".join(ch if ch.isalnum() else "-" for ch in dev_name).strip("-")[:60])
    measured = {
        "device": device, "device_name": dev_name, "when": when, "torch": str(torch.__version__),
        "threads": torch.get_num_threads(), "loadavg_1m": load, "repeats": repeats, "timer":
        "cuda events" if device == "cuda" else "time.perf_counter",
        "stream": {"size_mib": size_mib, "copy_Bps": copy_bps, "triad_Bps": triad_bps,
                   "copy_s": t_copy, "triad_s": t_triad},
        "matmul": {"n": n, "fp32_flops": flop / t_fp32, "bf16_flops": bf16_flops,
                   "fp8_scaled_mm_flops": fp8["flops"], "fp8_supported": fp8["supported"],
                   "fp8_n": fp8["n"], "fp8_reason": fp8["reason"]},
    }
    source = (f"measured by `fp8rl perf hardware --probe` on {when} ({dev_name}, {device}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, load {load if load is None else round(load, 2)}): bandwidth = "
              f"max(STREAM copy, triad) on {size_mib} MiB; FLOP/s = best of {repeats} {n}^3 matmuls")
    if not fp8["supported"]:
        source += f"; fp8_dense_flops = the bf16 figure ({fp8['reason']})"
    elif fp8["flops"] < bf16_flops:
        source += (f"; fp8_dense_flops = the bf16 figure, the larger (FP8 _scaled_mm measured "
                   f"{fp8['flops'] / 1e9:.3g} GFLOP/s on {fp8['n']}^3: an engine can always dequantize FP8 weights "
                   "to BF16 and run the BF16 GEMM, so the BF16 rate bounds an FP8 linear's speed from below)")
    elif fp8["n"] != n:
        source += (f"; the FP8 _scaled_mm rate on {fp8['n']}^3 (at {n}^3 one call would take over "
                   f"{FP8_CALL_BUDGET_S:g} s: a slow FP8 GEMM path on this device)")
    entry = {"class": cls, "match": [dev_name], "hbm_bytes": _total_memory(device),
             "hbm_bandwidth_Bps": max(copy_bps, triad_bps), "bf16_dense_flops": bf16_flops,
             "fp8_dense_flops": max(fp8["flops"], bf16_flops) if fp8["supported"] else bf16_flops, "source": source,
             "measured": measured}
    return {"name": label, "entry": entry}


def probe_file(probed: dict[str, Any]) -> dict[str, Any]:
    """The hardware.json-format document holding one probed entry."""
    return {"schema": "fp8rl.perf.hardware", "schema_version": 1,
            "notes": ["Measured, not datasheet: peaks are achieved numbers of this machine at probe time (see each "
                      "entry's measured block; on a shared machine they vary with its load)."],
            "hardware": {probed["name"]: probed["entry"]}}


def write_probe(probed: dict[str, Any], out: str | Path) -> Path:
    p = Path(out)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(probe_file(probed), indent=2) + "\n")
    return p
