"""``fp8rl parity`` (suite/parity.py): the toy GRPO curves, their JSON/HTML and the paired-bootstrap verdict, on a
configuration small enough for CI (the default one is the nightly's)."""

from __future__ import annotations

import json

import pytest
from fp8rl import parity as P
from fp8rl.cli import main


def test_paired_bootstrap_exact():
    mean, lo, hi = P.paired_bootstrap([0.25] * 5, boot=200)
    assert mean == lo == hi == 0.25
    mean, lo, hi = P.paired_bootstrap([-1.0, 1.0], boot=2000)
    assert mean == 0.0 and -1.0 <= lo < 0 < hi <= 1.0


def test_parity_command_writes_curves_and_verdict_exact(tmp_path, capsys):
    out = tmp_path / "par"
    rc = main(["parity", "--engine", "reference", "--recipe", "fp8-all", "--correction", "tis", "--seeds", "2",
               "--steps", "2", "--final", "1", "--out", str(out)])
    assert rc in (0, 1), capsys.readouterr()
    res = json.loads((out / "parity.json").read_text())
    assert res["conditions"] == ["bf16", "fp8-all+none", "fp8-all+tis"]
    for name in res["conditions"]:
        runs = res["runs"][name]
        assert len(runs) == 2 and all(len(m["reward"]) == 2 for m in runs)
        assert set(runs[0]) == {"reward", "k3", "tis_clip", "grad_norm", "cos_bf16"}
    v = res["verdicts"]["fp8-all+tis"]
    assert (rc == 0) == v["matches"]
    assert "fp8-all+tis" in capsys.readouterr().out
    assert v["ci95"][0] <= v["reward_gap"] <= v["ci95"][1]
    page = (out / "parity.html").read_text()
    assert "<svg" in page and "fp8-all+tis" in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    # the baseline's gradients are its own: cosine 1 by definition; the FP8 runs' cosines are real numbers ≤ 1
    assert all(c == 1.0 for m in res["runs"]["bf16"] for c in m["cos_bf16"])


@pytest.mark.parametrize("args,needle", [(["--correction", "bogus"], "--correction"),
                                         (["--steps", "3", "--final", "5"], "--final"),
                                         (["--recipe", "fp9"], "fp9")])
def test_parity_usage_errors_exact(tmp_path, capsys, args, needle):
    rc = main(["parity", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, (rc, err)
