"""``fp8rl parity`` (suite/parity.py): the toy GRPO curves, their JSON/HTML and the paired-bootstrap verdict, on a
configuration small enough for CI (the default one is the nightly's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fp8rl import parity as P


def test_paired_bootstrap_exact():
    mean, lo, hi = P.paired_bootstrap([0.25] * 5, boot=200)
    assert mean == lo == hi == 0.25
    mean, lo, hi = P.paired_bootstrap([-1.0, 1.0], boot=2000)
    assert mean == 0.0 and -1.0 <= lo < 0 < hi <= 1.0


def test_parity_command_writes_curves_and_verdict_exact(tmp_path):
    out = tmp_path / "par"
    r = subprocess.run([sys.executable, "-m", "fp8rl", "parity", "--engine", "reference", "--recipe", "fp8-all",
                        "--correction", "tis", "--seeds", "2", "--steps", "3", "--final", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads((out / "parity.json").read_text())
    assert res["conditions"] == ["bf16", "fp8-all+none", "fp8-all+tis"]
    for name in res["conditions"]:
        runs = res["runs"][name]
        assert len(runs) == 2 and all(len(m["reward"]) == 3 for m in runs)
        assert set(runs[0]) == {"reward", "k3", "tis_clip", "grad_norm", "cos_bf16"}
    v = res["verdicts"]["fp8-all+tis"]
    assert (r.returncode == 0) == v["matches"]
    assert v["ci95"][0] <= v["reward_gap"] <= v["ci95"][1]
    page = (out / "parity.html").read_text()
    assert "<svg" in page and "fp8-all+tis" in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    # the baseline's gradients are its own: cosine 1 by definition; the FP8 runs' cosines are real numbers ≤ 1
    assert all(c == 1.0 for m in res["runs"]["bf16"] for c in m["cos_bf16"])


@pytest.mark.parametrize("args,needle", [(["--correction", "bogus"], "--correction"),
                                         (["--steps", "3", "--final", "5"], "--final"),
                                         (["--recipe", "fp9"], "fp9")])
def test_parity_usage_errors_exact(tmp_path, args, needle):
    r = subprocess.run([sys.executable, "-m", "fp8rl", "parity", "--out", str(tmp_path / "x"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
