"""``fp8rl repro REPORT CHECK-ID[case]... [--out DIR] [--check]``: standalone reproductions of failing cases.

From a report (report.json, or the directory holding it) and one or more of its failed, errored or xfailed cases,
this writes, per case, a folder a vendor can run without the fp8rl repository:

* ``call.safetensors`` + ``call.json``: the inputs of the offending engine op call, shrunk to the smallest slice that
  still disagrees with fp8rl's oracle; the op, its non-tensor arguments, the numerics the engine declares for it,
  and which slice of the original input it is;
* ``original.safetensors`` + ``original.json``: the same call as the check made it, before shrinking;
* ``repro.py``: loads the engine the way the report's run did (built-in name, ``mutant:NAME``, entry point or
  ``pkg.module:factory``), calls the op and the oracle (``fp8rl.reference``) on the inputs, and prints every
  intermediate value of the first differing elements; ``python repro.py --check`` exits 1 while the discrepancy
  holds and 0 once it is gone;
* ``README.md``: the check (spec sentence, bound), the engine and versions, the slice, what the script printed here.

How: the cases are rerun together, once (``fp8rl conformance --engine E -k 'A or B ...' --seed N`` in one
subprocess, the report's profile) with :data:`fp8rl.repro_capture.CAPTURE_ENV` set, so that the guarded engine saves
every op call with the pytest node id of the check making it; each case takes the calls of its own node id. Per
case, on a freshly loaded engine, the first call whose result disagrees with the oracle (:mod:`fp8rl.repro_ops`) is
the offender; smaller inputs (the failing row, block, head, token or K block, then the fewest elements the op allows)
are tried, smallest first, and the first that still disagrees is written. One case: ``--out`` is its folder; several:
``--out DIR`` gets ``DIR/<case>/`` each (default ``<report dir>/repro/<case>``). Ops without a comparison here get a
folder whose ``repro.py`` reruns the conformance case and whose README says plainly that the input was not captured;
for the checkpoint and e2e areas it also says why it can't be (files on disk, a live model) and which fixture and seed
rebuild it. The guide to a repro folder: docs/repro.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE

#: outcomes a repro can be made for (a passed or skipped case has no discrepancy to reproduce)
REPRODUCIBLE = ("failed", "error", "xfailed")
#: the file that marks a folder as a repro folder (so that rewriting one never deletes anything else)
MARKER = "call.json"
FALLBACK_MARKER = "repro.json"


class ReproError(Exception):
    """A bad argument or input: the message names it and what was expected (exit 2)."""


# ----------------------------------------------------------------------------------------------------------------
# the report side


def load_report_dir(path: str | os.PathLike) -> tuple[Path, dict]:
    """(report.json's path, the report) for a report.json or a directory holding one."""
    from fp8rl.reports import ReportValidationError, load_report

    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise ReproError(f"report: expected a report.json or a directory holding one, got {str(path)!r}")
    try:
        return p, load_report(p)
    except (ReportValidationError, json.JSONDecodeError) as exc:
        raise ReproError(f"report: {str(p)!r} is not a valid fp8rl report: {exc}") from None


_LABEL = re.compile(r"^(?P<id>[A-Z0-9]+(?:-[A-Z0-9]+)+)(?:\[(?P<case>.*)\])?$")


def parse_label(label: str) -> tuple[str, str | None]:
    """``CHECK-ID[case]`` → (id, case); ``CHECK-ID`` → (id, None)."""
    m = _LABEL.match(label.strip())
    if m is None:
        raise ReproError(f"case: expected CHECK-ID or CHECK-ID[case] (e.g. QUANT-EXACT-001[block]), got {label!r}")
    return m.group("id"), m.group("case")


def case_label(entry: dict) -> str:
    return f"{entry['id']}[{entry['case']}]" if entry.get("case") else entry["id"]


def find_case(report: dict, label: str) -> dict:
    """The report's check entry named by ``label`` (a bare id must name exactly one case)."""
    cid, case = parse_label(label)
    same_id = [c for c in report["checks"] if c["id"] == cid]
    if not same_id:
        raise ReproError(f"case: the report has no check {cid!r} (it ran {len(report['checks'])} cases)")
    hits = same_id if case is None else [c for c in same_id if (c.get("case") or "") == case]
    if not hits:
        cases = ", ".join(sorted(case_label(c) for c in same_id)[:10])
        raise ReproError(f"case: the report has no case {label!r}; its cases of {cid}: {cases}")
    if len(hits) > 1:
        bad = [c for c in hits if c["outcome"] in REPRODUCIBLE]
        if len(bad) != 1:
            raise ReproError(f"case: {label!r} names {len(hits)} cases; name one as {cid}[case]: "
                             + ", ".join(case_label(c) for c in hits[:10]))
        hits = bad
    return hits[0]


def engine_spec(report: dict) -> str:
    """How the report's run loaded its engine: the ``--fp8rl-engine`` of its command (a built-in name,
    ``mutant:NAME``, an entry point or ``pkg.module:factory``), else the report's engine name."""
    cmd = [str(a) for a in report.get("command") or []]
    for i, arg in enumerate(cmd):
        if arg == "--fp8rl-engine" and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith("--fp8rl-engine="):
            return arg.split("=", 1)[1]
    return str(report["engine"]["name"])


def conformance_args(engine: str, label: str, seed: int, profile: str) -> list[str]:
    """The ``fp8rl conformance`` arguments that rerun one case of a report."""
    return ["conformance", "--engine", engine, "-k", label, "--seed", str(seed), "--profile", profile]


def bound_derivations(bound: str) -> dict[str, str]:
    """Bound name → its derivation in the tolerance table (``fp8rl checks --json``'s ``bounds``), for a report
    entry's ``bound`` (``"a"`` or ``"a, b"``); a name the table lacks says so."""
    from fp8rl import tolerances

    out = {}
    for name in (b.strip() for b in bound.split(",") if b.strip()):
        try:
            out[name] = tolerances.get(name).derivation
        except (KeyError, ValueError):
            out[name] = "not in this fp8rl's tolerance table"
    return out


# ----------------------------------------------------------------------------------------------------------------
# the rerun with capture


@dataclass
class Rerun:
    outcome: str
    message: str
    returncode: int
    calls_dir: Path
    output: str
    #: label → {"outcome", "message", "nodeid"} of each case the rerun reported
    cases: dict[str, dict] = field(default_factory=dict)


def _rerun_entry(checks: list[dict], label: str) -> dict | None:
    for c in checks:
        if case_label(c) == label or (c["id"] == label and c["outcome"] != "skipped"):
            return c
    return None


def rerun_with_capture(engine: str, labels: str | list[str], seed: int, profile: str, workdir: Path, *,
                       timeout: float) -> Rerun:
    """Run one or several cases again with op-call capture on, in one subprocess ``fp8rl conformance`` of one
    process (``-k 'A or B ...'``): each captured call names the check running it (its pytest node id)."""
    from fp8rl.repro_capture import CAPTURE_ENV

    labels = [labels] if isinstance(labels, str) else list(labels)
    calls = workdir / "calls"
    out = workdir / "report"
    calls.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fp8rl", *conformance_args(engine, " or ".join(labels), seed, profile), "--out",
           str(out), "--no-isolation"]
    env = {**os.environ, CAPTURE_ENV: str(calls)}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Rerun("timeout", f"the rerun took longer than {timeout:g} s", -1, calls, "",
                     {lb: {"outcome": "timeout", "message": "", "nodeid": None} for lb in labels})
    rep = out / "report.json"
    checks = json.loads(rep.read_text()).get("checks", []) if rep.is_file() else []
    cases = {}
    for lb in labels:
        c = _rerun_entry(checks, lb)
        cases[lb] = ({"outcome": c["outcome"], "message": c.get("message", ""), "nodeid": c.get("nodeid")} if c
                     else {"outcome": "not_run", "message": "", "nodeid": None})
    first = cases[labels[0]]
    return Rerun(str(first["outcome"]), str(first["message"]), proc.returncode, calls, (proc.stdout + proc.stderr)[-4000:],
                 cases)


def calls_of_case(calls: list, nodeid: str | None) -> list:
    """The captured calls made while the check ``nodeid`` ran (setup included): ``Call.check`` is pytest's
    PYTEST_CURRENT_TEST, ``'<nodeid> (setup|call|teardown)'``."""
    if nodeid is None:
        return []
    return [c for c in calls if c.check.rsplit(" (", 1)[0] == nodeid]


# ----------------------------------------------------------------------------------------------------------------
# choosing and shrinking the offending call


@dataclass
class Found:
    """The offending op call, the input written (shrunk, or the original) and what it shows."""

    call: Any  # fp8rl.repro_capture.Call
    args: tuple
    kwargs: dict
    slice: str
    explanation: Any  # fp8rl.repro_ops.Explanation
    standalone: bool
    raised: bool = False
    tried: list[str] = field(default_factory=list)


def _decodable(value: Any) -> bool:
    from fp8rl.repro_capture import Opaque

    if isinstance(value, Opaque):
        return False
    if isinstance(value, (list, tuple)):
        return all(_decodable(v) for v in value)
    if isinstance(value, dict):
        return all(_decodable(v) for v in value.values())
    return True


def find_offender(calls: list, engine: Any) -> Found | None:
    """The first captured call whose result disagrees with the oracle, shrunk; else the first that raised."""
    from fp8rl.repro_ops import explain_raises, handler_for

    for call in calls:
        h = handler_for(call.op)
        if h is None or call.error is not None or not (_decodable(call.args) and _decodable(call.kwargs)):
            continue
        got = call.result if _decodable(call.result) else None
        try:
            ex = h.run(engine, call.args, call.kwargs, got=got)
        except Exception:  # noqa: BLE001 - a call the comparison can't take (e.g. another op's shapes): not it
            continue
        if not ex.n_bad:
            continue
        return shrink(h, call, engine, ex)
    for call in calls:
        if call.error is not None and _decodable(call.args) and _decodable(call.kwargs):
            ex = explain_raises(engine, call.op, call.args, call.kwargs)
            return Found(call, call.args, call.kwargs, "the arguments of the check's call, unshrunk", ex,
                         standalone=bool(ex.n_bad), raised=True)
    return None


def shrink(handler: Any, call: Any, engine: Any, ex: Any) -> Found:
    """The smallest candidate input that still disagrees on the engine (each tried in order, smallest first)."""
    tried = []
    fresh = handler.run(engine, call.args, call.kwargs)  # the engine again, without the run's earlier calls
    if not fresh.n_bad:
        return Found(call, call.args, call.kwargs, "the arguments of the check's call, unshrunk", ex,
                     standalone=False, tried=["the original input, called again alone: no discrepancy"])
    for cand in handler.candidates(call.args, call.kwargs, ex):
        try:
            res = handler.run(engine, cand.args, cand.kwargs)
        except Exception as exc:  # noqa: BLE001 - the engine refuses this smaller shape: try the next
            tried.append(f"{cand.description}: the op raised {type(exc).__name__}")
            continue
        if res.n_bad:
            return Found(call, cand.args, cand.kwargs, cand.description, res, standalone=True, tried=tried)
        tried.append(f"{cand.description}: no discrepancy")
    return Found(call, call.args, call.kwargs, "the arguments of the check's call, unshrunk (no smaller slice "
                 "disagrees)", fresh, standalone=True, tried=tried)


# ----------------------------------------------------------------------------------------------------------------
# the folder


_BODIES: dict[str, tuple[str, str]] = {
    "quantize": (
        "from fp8rl.reference.quant import quantize\nfrom fp8rl.repro_ops import explain_quantize\n",
        """    x, granularity = call.args
    got = engine.quantize(x, granularity)  # the engine's op on the captured input
    policy = engine.scale_policy(granularity.kind)  # the numerics it declares (call.json: declared)
    expected = quantize(x, granularity, policy)  # fp8rl's oracle under that policy
    return explain_quantize(x, granularity, policy, got, expected, limit=limit)
"""),
    "cast": (
        "from fp8rl.reference.formats import encode\nfrom fp8rl.repro_ops import explain_cast\n",
        """    x, fmt = call.args
    got = engine.cast(x, fmt)  # the engine's op on the captured input
    overflow = engine.cast_overflow(fmt)  # the overflow rule it declares
    expected = encode(x, fmt, overflow).reshape(x.shape)  # fp8rl's bit-level encoder
    return explain_cast(x, fmt, overflow, got, expected, limit=limit)
"""),
    "kv_store": (
        "from fp8rl.reference.kv import quantize_kv\nfrom fp8rl.repro_ops import explain_kv_store\n",
        """    x, scale = call.args
    fmt, layout = call.kwargs["fmt"], call.kwargs["layout"]
    got = engine.kv_store(x, scale, fmt=fmt, layout=layout)  # the engine's op on the captured input
    policy = engine.kv_policy(fmt, layout)  # the KV numerics it declares (call.json: declared)
    expected = quantize_kv(x, scale, policy)  # fp8rl's oracle under that policy
    return explain_kv_store(x, scale, policy, got, expected, limit=limit)
"""),
    "rollout_correction": (
        "from fp8rl.reference.correction import rollout_correction\n"
        "from fp8rl.repro_ops import explain_rollout_correction\n",
        """    train_logp, rollout_logp, mask, config = call.args
    got = engine.rollout_correction(train_logp, rollout_logp, mask, config)  # the engine's op
    expected = rollout_correction(train_logp, rollout_logp, mask, config)  # fp8rl's oracle (float64)
    return explain_rollout_correction(train_logp, rollout_logp, mask, config, got, expected, limit=limit)
"""),
}

_BODIES.update({
    "block_gemm": (
        "from fp8rl.repro_ops import explain_block_gemm, gemm_oracle\n",
        """    a, w, out_dtype = call.args  # QuantizedTensors: codes, scale, granularity, policy (call.json)
    got = engine.block_gemm(a, w, out_dtype)  # the engine's op on the captured operands
    expected, bound = gemm_oracle(a, w, out_dtype)  # the exact fp64 product; the gemm_fp32_accum bound
    return explain_block_gemm(a, w, out_dtype, got, expected, bound, limit=limit)
"""),
    "kv_attention": (
        "from fp8rl.repro_ops import explain_kv_attention, kv_attention_oracle\n",
        """    q, k_cache, v_cache = call.args  # k_cache, v_cache: KVCache (codes, scale, fmt, layout)
    kw = call.kwargs  # q_scale, causal, q_lengths, kv_lengths, sm_scale as the check passed them
    got = engine.kv_attention(q, k_cache, v_cache, **kw)  # the engine's op on the captured input
    policy = engine.kv_policy(k_cache.fmt, k_cache.layout)  # the KV numerics it declares (call.json: declared)
    expected, bound, q_hat = kv_attention_oracle(policy, q, k_cache, v_cache, kw)  # fp8rl's FP8 attention
    return explain_kv_attention(q, k_cache, v_cache, kw, policy, got, expected, bound, q_hat, limit=limit)
"""),
    "correction_loss": (
        "from fp8rl.repro_ops import correction_loss_oracle, engine_correction_loss, explain_correction_loss\n",
        """    logp, old_logp, advantages, mask, weights, config = call.args
    # the engine's loss and its gradient with respect to logp (a fresh leaf, as the check makes it)
    loss, grad, why = engine_correction_loss(engine, logp, old_logp, advantages, mask, weights, config)
    oracle = correction_loss_oracle(logp, old_logp, advantages, mask, weights, config)  # float64, and the bounds
    return explain_correction_loss(logp, old_logp, advantages, mask, weights, config, loss, grad, oracle, why=why,
                                   limit=limit)
"""),
    "weight_sync": (
        "from fp8rl.repro_ops import explain_weight_sync, weight_sync_oracle\n",
        """    (state_dict,) = call.args  # checkpoint names -> tensors
    got = engine.weight_sync(state_dict)  # the engine's op on the captured input
    policy = engine.scale_policy("block")  # the block policy it declares (call.json: declared)
    expected = weight_sync_oracle(state_dict, policy)  # fp8rl's oracle (fp8rl.reference.weight_sync)
    return explain_weight_sync(state_dict, policy, got, expected, limit=limit)
"""),
})

_BODIES["mx_quantize"] = (
    "from fp8rl.reference.microscaling import mx_quantize\nfrom fp8rl.repro_ops import explain_mx_quantize\n",
    """    x, recipe = call.args
    got = engine.mx_quantize(x, recipe)  # the engine's op on the captured input
    policy = engine.mx_policy(recipe)  # the MXPolicy it declares (call.json: declared)
    expected = mx_quantize(x, policy)  # fp8rl's oracle under that policy
    return explain_mx_quantize(x, recipe, policy, got, expected, limit=limit)
""")

_RAISES = ("from fp8rl.repro_ops import explain_raises\n",
           """    return explain_raises(engine, OP, call.args, call.kwargs)  # the op raised in the check
""")

_SCRIPT = '''#!/usr/bin/env python3
"""{title}

{about}

Run:  python repro.py [--check] [--limit N]
      --check: exit 1 while the engine disagrees with fp8rl's oracle on this input, 0 once it agrees.
Needs fp8rl (pip install fp8rl=={fp8rl_version}) and the engine's own package; nothing from fp8rl's repository.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp8rl.registry import load_engine
from fp8rl.repro_capture import load_call
from fp8rl.repro_ops import run_check
{imports}
HERE = Path(__file__).resolve().parent
#: loaded as the report's run loaded it: a built-in name, mutant:NAME, an entry point or pkg.module:factory
ENGINE = {engine!r}
OP = {op!r}
#: which part of the check's original input call.safetensors holds
SLICE = {slice!r}


def explain(limit: int):
    engine = load_engine(ENGINE)
    call = load_call(HERE / "call")  # call.json (non-tensor arguments) + call.safetensors (tensors)
{body}

def main() -> int:
    parser = argparse.ArgumentParser(description={title!r})
    parser.add_argument("--check", action="store_true", help="exit 1 while the discrepancy holds, 0 once it is gone")
    parser.add_argument("--limit", type=int, default=5, help="differing elements to explain (default 5)")
    args = parser.parse_args()
    if args.limit < 1:
        parser.error(f"--limit: expected a positive integer, got {{args.limit}}")
    print(f"{{OP}} of engine {{ENGINE}}; input: {{SLICE}}")
    return run_check(lambda: explain(args.limit), args.check)


if __name__ == "__main__":
    sys.exit(main())
'''

_FALLBACK_SCRIPT = '''#!/usr/bin/env python3
"""{title}

The input of this case was NOT captured ({why}). This script reruns the case with fp8rl's own check:
    fp8rl {command}
and prints its outcome and message.

Run:  python repro.py [--check]
      --check: exit 1 while the case still fails (failed, error or xfailed), 0 once it passes.
Needs fp8rl (pip install fp8rl=={fp8rl_version}) and the engine's own package.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ARGS = {args!r}
LABEL = {label!r}


def main() -> int:
    parser = argparse.ArgumentParser(description={title!r})
    parser.add_argument("--check", action="store_true", help="exit 1 while the case still fails, 0 once it passes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "fp8rl", *ARGS, "--out", tmp], capture_output=True, text=True,
                              check=False)
        report = Path(tmp) / "report.json"
        checks = json.loads(report.read_text())["checks"] if report.is_file() else []
    hit = [c for c in checks if (f"{{c['id']}}[{{c['case']}}]" if c.get("case") else c["id"]) == LABEL]
    outcome = hit[0]["outcome"] if hit else "not_run"
    if not hit:  # the run wrote no result for the case: show how it ended
        print((proc.stdout + proc.stderr)[-3000:])
    print(f"{{LABEL}}: {{outcome}}")
    if hit and hit[0].get("message"):
        print(hit[0]["message"])
    return 1 if args.check and outcome in ("failed", "error", "xfailed", "not_run") else 0


if __name__ == "__main__":
    sys.exit(main())
'''


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", label).strip("-")


def default_out(report_json: Path, label: str) -> Path:
    """Where ``fp8rl repro`` writes by default (and where ``fp8rl report upstream`` looks): ``<report dir>/repro/<case>``."""
    return report_json.parent / "repro" / _safe(label)


def _prepare(out: Path) -> None:
    if out.exists():
        if not out.is_dir():
            raise ReproError(f"--out: {str(out)!r} exists and is not a directory")
        names = {p.name for p in out.iterdir()}
        if names and not ({MARKER, FALLBACK_MARKER} & names):
            raise ReproError(f"--out: {str(out)!r} is a non-empty directory that holds no repro folder; expected a "
                             "new or empty directory, or an earlier repro folder to replace")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def _layout_notes(doc: dict) -> list[str]:
    notes = []

    def walk(v: Any, where: str) -> None:
        if isinstance(v, dict) and "__tensor__" in v:
            if not v.get("contiguous", True):
                notes.append(f"{where} was not contiguous in the check (strides {v.get('stride')}); the repro "
                             "restores a transposed layout and passes other layouts as contiguous copies")
        elif isinstance(v, dict):
            for x in v.values():
                walk(x, where)
        elif isinstance(v, list):
            for x in v:
                walk(x, where)

    for i, a in enumerate(doc.get("args", [])):
        walk(a, f"argument {i}")
    for k, a in doc.get("kwargs", {}).items():
        walk(a, f"argument {k!r}")
    return notes


def _header(report: dict, entry: dict, engine: str, label: str) -> dict[str, Any]:
    import fp8rl

    env = report.get("environment", {})
    return {"check": entry["id"], "case": entry.get("case") or "", "label": label, "outcome": entry["outcome"],
            "engine": engine, "engine_version": report["engine"].get("version", ""), "seed": report["seed"],
            "profile": report["profile"], "spec": entry.get("title", ""), "bound": entry.get("bound", ""),
            "bound_derivations": bound_derivations(entry.get("bound", "")), "fp8rl": fp8rl.__version__,
            "environment": {k: env.get(k) for k in ("python", "torch", "torch_cuda", "platform", "cpu", "gpus", "device")
                            if k in env},
            "reproduce": "fp8rl " + " ".join(_quote(a) for a in conformance_args(engine, label, report["seed"],
                                                                                 report["profile"]))}


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def _readme(h: dict, found: Found | None, why: str, files: list[str]) -> str:
    lines = [f"# Reproduction: {h['label']} on {h['engine']}", "",
             f"- check: **{h['check']}** — {h['spec']}",
             f"- bound: {h['bound']}" + "".join(f"\n  - {b}: {d}" for b, d in h["bound_derivations"].items()),
             f"- outcome in the report: {h['outcome']}",
             f"- engine: `{h['engine']}` ({h['engine_version']}); fp8rl {h['fp8rl']}; "
             + ", ".join(f"{k} {v}" for k, v in h["environment"].items() if v not in (None, [], "")),
             f"- the case in the suite: `{h['reproduce']}`", ""]
    if found is None:
        lines += ["## The input was not captured", "",
                  f"{why} So this folder holds no input tensors: `repro.py` reruns the case with fp8rl's own "
                  "check (the command above) and prints its outcome and message; `python repro.py --check` exits 1 "
                  "while the case still fails.", ""]
    else:
        lines += ["## The offending op call", "",
                  f"- op: `{found.call.op}` (the check's call {found.call.doc.get('index', '?')} of the rerun)",
                  f"- input written (call.safetensors + call.json): {found.slice}",
                  "- the check's own call, unshrunk: original.safetensors + original.json", ""]
        if found.tried:
            lines += ["Smaller inputs tried first, which did not disagree:", ""] + [f"- {t}" for t in found.tried] + [""]
        if not found.standalone:
            lines += ["**Not standalone**: called again on a freshly loaded engine, this input gives the oracle's "
                      "answer; the discrepancy the check saw depends on the calls before it in the same run "
                      "(state kept by the engine). `repro.py --check` therefore exits 0; rerun the case with the "
                      "command above.", ""]
        lines += _layout_notes(found.call.doc)
        lines += ["## What repro.py printed when this folder was made", "", "```",
                  found.explanation.text(), "```", ""]
    lines += ["## Files", ""] + [f"- {f}" for f in files] + ["",
              "Run `python repro.py` (add `--check` for an exit status: 1 while the discrepancy holds, 0 once it is "
              "gone). How to read the printout: fp8rl's docs/repro.md.", ""]
    return "\n".join(lines)


@dataclass
class Written:
    out: Path
    captured: bool
    op: str | None
    slice: str
    standalone: bool
    rerun_outcome: str
    n_bad: int


def _model_in_case(case: str) -> str | None:
    """The tiny-model fixture a case label names (the longest fixture name in it), or None."""
    from fp8rl import fixtures

    hits = [m for m in fixtures.TINY_MODELS if m in case]
    return max(hits, key=len) if hits else None


def uncapturable_input(entry: dict, run_seed: int, command: str) -> tuple[str, dict[str, Any]] | None:
    """For a checkpoint or e2e case: (why its input can't be captured as a standalone op call, and which fixture and
    seed rebuild it); None for other areas."""
    from fp8rl import fixtures

    area = entry.get("area") or ""
    if area not in ("checkpoint", "e2e"):
        return None
    model = _model_in_case(entry.get("case") or "")
    info: dict[str, Any] = {"area": area, "model": model, "run_seed": run_seed}
    if model is not None:
        spec = fixtures.tiny_model_spec(model)
        info["model_seed"] = int(spec["seed"])
        weights = (f"the weights are fp8rl's tiny-model fixture {model!r}, generated deterministically by the "
                   f"installed fp8rl from seed {spec['seed']} of fixtures/tiny_models.json "
                   f"(fp8rl.fixtures.tiny_model({model!r}); the trainer's fp32 masters "
                   f"fp8rl.fixtures.master_state_dict({model!r}); after a simulated RL step the 'update' variant of "
                   "the same seed)")
    else:
        weights = (f"the weights are generated inside the check from fixed seeds (conformance/test_{area}.py) by the "
                   "installed fp8rl")
    if area == "checkpoint":
        why = ("Area checkpoint: the op's input or output is a checkpoint directory on disk (checkpoint_write writes "
               "one; checkpoint_load, checkpoint_score and checkpoint_attention_scales read one), not a tensor call "
               f"that can be saved and replayed alone. Nor is there data to capture: {weights}, so `{command}` "
               "rebuilds the exact input.")
    else:
        why = ("Area e2e: the op is a rollout of a whole model — rollout_init(config, state_dict, recipe) builds the "
               "engine's live model and returns a handle, then rollout / rollout_logits / update_weights run on "
               f"it — so its input is engine-side state, not a tensor call that can be replayed alone. {weights}; "
               "the prompts are fixtures/prompts.json (fp8rl.fixtures.prompt_ids) and sampling is seeded by the "
               f"run seed {run_seed}, so `{command}` reruns the exact case.")
    return why, info


@dataclass
class _Job:
    entry: dict
    label: str
    dest: Path


def _plan(report_json: Path, report: dict, labels: list[str], out: str | os.PathLike | None) -> list[_Job]:
    """Validate every label (a failed, error or xfailed case of the report) and prepare each destination."""
    jobs: list[_Job] = []
    seen = set()
    for raw in labels:
        entry = find_case(report, raw)
        label = case_label(entry)
        if label in seen:
            continue
        seen.add(label)
        if entry["outcome"] not in REPRODUCIBLE:
            raise ReproError(f"case: {label} {entry['outcome']} in {str(report_json)!r}; expected a failed, error or "
                             "xfailed case (nothing to reproduce)")
        jobs.append(_Job(entry, label, Path(out) if out is not None else default_out(report_json, label)))
    if not jobs:
        raise ReproError("case: expected at least one CHECK-ID[case]")
    if len(jobs) > 1 and out is not None:
        base = Path(out)
        if base.exists() and not base.is_dir():
            raise ReproError(f"--out: {str(base)!r} exists and is not a directory; with several cases, --out is the "
                             "directory that gets one folder per case")
        for j in jobs:
            j.dest = base / _safe(j.label)
    for j in jobs:
        _prepare(j.dest)
    return jobs


def make_repros(report_path: str | os.PathLike, labels: list[str], out: str | os.PathLike | None = None, *,
                timeout: float = 1800.0, log: Any = print) -> list[Written]:
    """Write the repro folder of each case in ``labels`` (see the module docstring), from ONE rerun of them all.
    With one case, ``out`` is its folder; with several, ``out`` is a directory holding ``<out>/<case>/`` each
    (default: ``<report dir>/repro/<case>``)."""
    report_json, report = load_report_dir(report_path)
    jobs = _plan(report_json, report, list(labels), out)
    engine_name = engine_spec(report)
    names = [j.label for j in jobs]
    log(f"rerunning {', '.join(names)} on {engine_name} (seed {report['seed']}, profile {report['profile']}) with op "
        "capture")
    written = []
    with tempfile.TemporaryDirectory(prefix="fp8rl-repro-") as tmp:
        from fp8rl.repro_capture import iter_calls

        rerun = rerun_with_capture(engine_name, names, int(report["seed"]), str(report["profile"]), Path(tmp),
                                   timeout=timeout)
        calls = list(iter_calls(rerun.calls_dir))
        for j in jobs:
            case = rerun.cases.get(j.label, {"outcome": rerun.outcome, "nodeid": None})
            mine = calls if len(jobs) == 1 else calls_of_case(calls, case.get("nodeid"))
            log(f"rerun: {j.label} {case['outcome']}; {len(mine)} op calls captured")
            written.append(_write_folder(report, j, engine_name, case["outcome"], mine))
    return written


def make_repro(report_path: str | os.PathLike, label: str, out: str | os.PathLike | None = None, *,
               timeout: float = 1800.0, log: Any = print) -> Written:
    """Write the repro folder of one case of a report (see the module docstring)."""
    return make_repros(report_path, [label], out, timeout=timeout, log=log)[0]


def _write_folder(report: dict, job: _Job, engine_name: str, rerun_outcome: str, calls: list) -> Written:
    import fp8rl
    from fp8rl.registry import EngineLoadError, load_engine
    from fp8rl.repro_capture import save_call
    from fp8rl.repro_ops import handler_for

    entry, label, dest = job.entry, job.label, job.dest
    h = _header(report, entry, engine_name, label)
    found: Found | None = None
    why = ""
    engine = None
    if not calls:
        why = (f"The rerun captured no op call (its outcome: {rerun_outcome}; the engine may not be installed "
               "here, or the check calls no engine op through fp8rl's guard).")
    else:
        try:
            engine = load_engine(engine_name)  # a fresh engine per case: no state from another case's calls
        except EngineLoadError as exc:
            why = f"The engine could not be loaded here to compare the captured calls: {exc}."
        if engine is not None:
            found = find_offender(calls, engine)
            if found is None:
                ops = sorted({c.op for c in calls})
                supported = [o for o in ops if handler_for(o) is not None]
                why = (f"No captured call could be singled out: the rerun called {', '.join(ops)}; "
                       + (f"the calls of {', '.join(supported)} agree with the oracle one by one (the check's "
                          "failure is in how it combines them, or in an op fp8rl repro has no comparison for)."
                          if supported else "fp8rl repro has no op-level comparison for these ops."))
    fixture = None
    if found is None:
        unc = uncapturable_input(entry, int(report["seed"]), h["reproduce"])
        if unc is not None:
            why = unc[0] + (" " + why if why else "")
            fixture = unc[1]
    files = ["README.md", "repro.py"]
    if found is not None:
        declared: dict[str, Any] = {}
        hd = handler_for(found.call.op)
        if hd is not None:
            try:
                declared = hd.declared(engine, found.args, found.kwargs)
            except Exception as exc:  # noqa: BLE001 - the declaration is informative only
                declared = {"error": f"{type(exc).__name__}: {exc}"}
        meta = {**h, "op": found.call.op, "slice": found.slice, "standalone": found.standalone,
                "declared": declared, "rerun_outcome": rerun_outcome, "n_bad": found.explanation.n_bad,
                "tried": found.tried}
        save_call(dest / "call", found.call.op, found.args, found.kwargs, result=None, extra={"repro": meta})
        src = found.call.stem
        shutil.copyfile(src.with_suffix(".json"), dest / "original.json")
        shutil.copyfile(src.with_suffix(".safetensors"), dest / "original.safetensors")
        files += ["call.json", "call.safetensors", "original.json", "original.safetensors"]
        imports, body = _RAISES if found.raised or found.call.op not in _BODIES else _BODIES[found.call.op]
        script = _SCRIPT.format(title=f"fp8rl repro: {label} on {engine_name} ({found.call.op})",
                                about=(f"Check {h['check']}: {h['spec']}\nEngine {engine_name} "
                                       f"({h['engine_version']}), run seed {h['seed']}. Input: {found.slice}."),
                                fp8rl_version=fp8rl.__version__, imports=imports, engine=engine_name,
                                op=found.call.op, slice=found.slice, body=body)
    else:
        meta = {**h, "op": None, "captured": False, "why": why, "rerun_outcome": rerun_outcome}
        if fixture is not None:
            meta["fixture"] = fixture
        (dest / FALLBACK_MARKER).write_text(json.dumps(meta, indent=1))
        files.append(FALLBACK_MARKER)
        script = _FALLBACK_SCRIPT.format(title=f"fp8rl repro: {label} on {engine_name} (input not captured)",
                                         why=why.rstrip("."), command=h["reproduce"].removeprefix("fp8rl "),
                                         fp8rl_version=fp8rl.__version__,
                                         args=conformance_args(engine_name, label, int(report["seed"]),
                                                               str(report["profile"])), label=label)
    (dest / "repro.py").write_text(script)
    (dest / "README.md").write_text(_readme(h, found, why, files))
    return Written(dest, found is not None, found.call.op if found else None, found.slice if found else "",
                   bool(found and found.standalone), rerun_outcome, found.explanation.n_bad if found else 0)


def run_script(folder: Path, *extra: str, timeout: float = 1800.0) -> subprocess.CompletedProcess:
    """Run a repro folder's ``repro.py`` (from inside the folder) and return the finished process."""
    return subprocess.run([sys.executable, "repro.py", *extra], cwd=folder, capture_output=True, text=True,
                          timeout=timeout, check=False)


def cmd_repro(args: argparse.Namespace) -> int:
    try:
        written = make_repros(args.report, list(args.case), args.out, timeout=args.timeout)
    except ReproError as exc:
        print(f"fp8rl repro: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"fp8rl repro: --out: can't write the repro folder: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for w in written:
        if w.captured:
            print(f"wrote {w.out}: {w.op}, {w.n_bad} compared values differ on {w.slice}"
                  + ("" if w.standalone else " (NOT standalone: see its README)"))
        else:
            print(f"wrote {w.out}: the input was not captured (see its README); repro.py reruns the case")
    if not args.check:
        return EXIT_OK
    status = EXIT_OK
    for w in written:
        proc = run_script(w.out, "--check", timeout=args.timeout)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        if proc.returncode == 1:
            status = EXIT_FAIL if status == EXIT_OK else status
        elif proc.returncode != 0:
            status = EXIT_USAGE
    return status


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("repro", help="write a standalone reproduction (inputs, repro.py) of failing cases of a report")
    r.add_argument("report", help="report.json, or the directory holding it")
    r.add_argument("case", nargs="+",
                   help="CHECK-ID[case] of a failed, error or xfailed case (CHECK-ID if it has one case); several "
                        "are rerun together, once")
    r.add_argument("--out", default=None,
                   help="the folder to write for one case; with several cases, the directory that gets "
                        "<out>/<case>/ each (default: <report dir>/repro/<case>)")
    r.add_argument("--check", action="store_true",
                   help="then run each folder's repro.py --check: exit 1 while a discrepancy holds, 0 if all are gone")
    r.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="seconds allowed for the rerun of the cases (default 1800)")
    r.set_defaults(func=cmd_repro)


__all__ = ["ReproError", "bound_derivations", "calls_of_case", "case_label", "conformance_args", "default_out",
           "engine_spec", "find_case", "make_repro", "make_repros", "parse_label", "register", "run_script",
           "uncapturable_input"]
