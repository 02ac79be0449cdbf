"""The KV conformance area end to end: reference and torch pass it, and every KV mutant is killed.

* One pytest run of ``fp8rl.conformance`` (``-k test_kv``) with both engines side by side through the real plugin:
  every KV check passes for both, and the report carries the ``kv_drift`` section with its table and plots.
* The kill matrix: each mutant is run, in process, through the checks that must kill it (and the reference
  engine through the same calls, which must pass). The full cross product is ``fp8rl mutants --area kv``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from fp8rl.checks import CHECKS, GuardedEngine
from fp8rl.conformance import test_kv as kvchecks
from fp8rl.engine import EngineError
from fp8rl.engines.reference import ReferenceEngine
from fp8rl.mutants import MUTANTS, make_mutant
from fp8rl.tolerances import TOLERANCES
from support import REPO_ROOT

ROOT = REPO_ROOT

KV_CHECK_IDS = {
    "KV-POLICY-001", "KV-STORE-001", "KV-STORE-002", "KV-STORE-003", "KV-STORE-004", "KV-STORE-005",
    "KV-ATTN-001", "KV-ATTN-002", "KV-ATTN-003", "KV-CAL-001", "KV-CAL-002", "KV-CAL-003", "KV-UPDATE-001",
    "KV-UPDATE-002", "KV-DEFAULT-001", "KV-DRIFT-001",
}

#: mutant → the check calls (function name, kwargs) that must each fail for it
KILLS: dict[str, list[tuple[str, dict]]] = {
    "kv-stale-scales": [("test_kv_update_pushed_scales", {"fmt": "e4m3fn", "layout": "tensor", "seed": 3}),
                        ("test_kv_update_engine_side_reset", {"fmt": "e5m2", "seed": 3})],
    "kv-scale-one": [("test_kv_default_scale_flagged", {"fmt": "e4m3fn"}),
                     ("test_kv_update_pushed_scales", {"fmt": "e5m2", "layout": "head", "seed": 1})],
    "kv-q-scale-ignored": [("test_kv_attention_vs_oracle_bound", {"fmt": "e4m3fn", "layout": "tensor",
                                                                  "case": "prefill-gqa"}),
                           ("test_kv_attention_vs_unquantized_bound", {"fmt": "e5m2", "layout": "head"})],
    "kv-per-tensor-scale": [("test_kv_store_random_exact", {"fmt": "e4m3fn", "layout": "head"}),
                            ("test_kv_store_edge_values_exact", {"fmt": "e5m2", "layout": "head"})],
    "kv-no-clamp": [("test_kv_store_saturates_no_nonfinite", {"fmt": "e4m3fn", "layout": "tensor"}),
                    ("test_kv_store_saturates_no_nonfinite", {"fmt": "e5m2", "layout": "head"}),
                    ("test_kv_store_edge_values_exact", {"fmt": "e4m3fn", "layout": "tensor"})],
    "kv-truncating-store": [("test_kv_store_random_exact", {"fmt": "e4m3fn", "layout": "token_head"}),
                            ("test_kv_store_roundtrip_bound", {"fmt": "e5m2", "layout": "tensor"})],
    "kv-swapped-vk-constants": [("test_kv_calibrate_engine_first_batch_exact", {"fmt": "e4m3fn"}),
                                ("test_kv_update_engine_side_reset", {"fmt": "e4m3fn", "seed": 5})],
    "kv-p999-as-max": [("test_kv_calibrate_trainer_p999_exact", {"fmt": "e4m3fn"})],
    "kv-head-amax-pooled": [("test_kv_calibrate_amax_exact", {"fmt": "e5m2", "layout": "head"})],
    "kv-reads-past-kv-len": [("test_kv_attention_padding_exact", {"fmt": "e4m3fn"}),
                             ("test_kv_attention_vs_oracle_bound", {"fmt": "e5m2", "layout": "token_head",
                                                                    "case": "varlen-causal"})],
}


def _call(engine, fn_name: str, kwargs: dict) -> None:
    fn = getattr(kvchecks, fn_name)
    args = dict(kwargs)
    if "rng" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
        args["rng"] = np.random.default_rng(1234)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fn(engine=GuardedEngine(engine), **args)
    finally:
        torch.set_num_threads(n)


def test_every_kv_mutant_is_registered_and_covered():
    kv_mutants = {n for n, m in MUTANTS.items() if m.area == "kv"}
    assert kv_mutants == set(KILLS)


def test_kv_checks_registered_with_known_bounds():
    kv = {cid: spec for cid, spec in CHECKS.items() if spec.area == "kv"}
    assert set(kv) == KV_CHECK_IDS
    assert all(spec.bound in TOLERANCES for spec in kv.values())


@pytest.mark.parametrize("mutant", sorted(KILLS))
def test_mutant_killed_by_its_checks(mutant):
    for fn_name, kwargs in KILLS[mutant]:
        _call(ReferenceEngine(), fn_name, kwargs)  # the reference passes the very same call
        with pytest.raises((AssertionError, EngineError)):
            _call(make_mutant(mutant), fn_name, kwargs)


def test_reference_and_torch_pass_kv_area(tmp_path):
    out = tmp_path / "rep"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "fp8rl.conformance", "-k", "test_kv", "-p", "no:cacheprovider",
           "-q", "-o", "addopts=", "--fp8rl-profile", "ci", "--fp8rl-engine", "reference", "--fp8rl-engine", "torch",
           "--fp8rl-report-dir", str(out)]
    if env.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        cmd += ["-p", "fp8rl.plugin"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    for engine in ("reference", "torch"):
        path = out / "engines" / engine / "report.json"
        assert path.exists(), proc.stdout[-3000:] + proc.stderr[-2000:]
        report = json.loads(path.read_text())
        kv = [c for c in report["checks"] if c["area"] == "kv"]
        bad = [(c["id"], c["case"], c["outcome"], c["message"][:300]) for c in kv if c["outcome"] != "passed"]
        assert not bad, f"{engine}: {bad}"
        assert {c["id"] for c in kv} == KV_CHECK_IDS
        section = report["sections"]["kv_drift"]
        assert len(section["plot"]) == 3 and section["table"]["rows"]
        assert section["summary"]["every-step"]["violations"] == 0
        assert section["summary"]["never"]["violations"] > 0
