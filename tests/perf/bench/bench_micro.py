"""pytest-benchmark micro-benchmarks of the oracle and perf code (NOT collected by the default ``pytest`` run: the
file name does not match ``test_*.py``).

Run, save a baseline, then gate a later run against it (timing needs a quiet machine and no xdist):

    pytest tests/perf/bench -o python_files='bench_*.py' -p no:xdist --benchmark-only --benchmark-autosave
    pytest tests/perf/bench -o python_files='bench_*.py' -p no:xdist --benchmark-only \\
        --benchmark-compare --benchmark-compare-fail=median:10%

``--benchmark-compare`` (no value) compares with the latest saved run of this machine under ``.benchmarks/``
(gitignored); ``--benchmark-compare-fail=median:10%`` fails the session when a benchmark's median got > 10% slower.
Smoke (each benchmark once, no timing): add ``--benchmark-disable``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytest_benchmark")

SEED = 20260126


def _w(rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + rows + cols)
    return torch.randn(rows, cols, generator=g) * 0.02


@pytest.fixture(scope="module")
def w512():
    return _w(512, 512)


def test_oracle_encode_e4m3fn_65536(benchmark):
    from fp8rl.reference import formats

    x = _w(64, 1024).reshape(-1) * 2000
    codes = benchmark(formats.encode, x, "e4m3fn", "saturate")
    assert codes.numel() == x.numel()


def test_torch_cast_e4m3fn_65536(benchmark):
    x = _w(64, 1024).reshape(-1) * 2000
    benchmark(x.to, torch.float8_e4m3fn)


@pytest.mark.parametrize("policy", ["reference", "verl_torch"])
def test_oracle_block_quantize_512(benchmark, w512, policy):
    from fp8rl.reference.quant import Granularity, quantize

    qt = benchmark(quantize, w512, Granularity.block(128), policy)
    assert tuple(qt.scale.shape) == (4, 4)


def test_oracle_group_quantize_512(benchmark, w512):
    from fp8rl.reference.quant import Granularity, quantize

    benchmark(quantize, w512, Granularity.group(128))


def test_verl_style_block_quantize_512(benchmark, w512):
    from fp8rl.perf.suite_speed import verl_style_blockwise

    q, s = benchmark(verl_style_blockwise, w512)
    assert s.shape == (4, 4)


def test_scaled_mm_rowwise_128x1024(benchmark):
    x, w = _w(128, 1024), _w(1024, 1024)
    xs = x.abs().amax(1, keepdim=True) / 448
    ws = w.abs().amax(1, keepdim=True) / 448
    xq, wq = (x / xs).to(torch.float8_e4m3fn), (w / ws).to(torch.float8_e4m3fn)
    wst = ws.t().contiguous()
    benchmark(torch._scaled_mm, xq, wq.t(), scale_a=xs, scale_b=wst, out_dtype=torch.bfloat16)


def test_perf_model_estimate_all(benchmark):
    from fp8rl.perf import model as pm

    spec, hw = pm.load_model_spec("Qwen3-30B-A3B"), pm.load_hardware("H100-SXM-80GB")
    est = benchmark(pm.estimate_all, spec, hw, pm.Workload(1024, 20480))
    assert set(est) == set(pm.PRECISIONS)


def test_paired_bootstrap_ci_n10(benchmark):
    from fp8rl.perf.stats import paired_speedup

    base = [1000.0 + i for i in range(10)]
    cand = [1150.0 + 3 * (-1) ** i for i in range(10)]
    e = benchmark(paired_speedup, base, cand)
    assert e.lo < e.point < e.hi
