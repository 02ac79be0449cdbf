"""Rendering of a perf gate report: the markdown table, the speedup-vs-claim plot, and the output files
(``gate.json``, ``gate.md``, ``gate.png``) ``fp8rl perf gate --out`` writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fp8rl.perf.gate import GateReport, exit_code, overall_verdict

__all__ = ["to_markdown", "plot", "write_outputs"]


def _fmt(x: float | None, nd: int = 3) -> str:
    """``nd`` decimals; below 10^-(nd-1) ``nd`` significant digits instead (a 0.0024x claim floor is not "0.00")."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if x != 0 and abs(x) < 10.0 ** -(nd - 1):
        return f"{x:.{nd}g}"
    return f"{x:.{nd}f}"


def to_markdown(report: GateReport) -> str:
    pct = f"{report.confidence:.0%}"
    lines = [f"**perf gate: {overall_verdict(report)}** (exit {exit_code(report)}; {pct} bootstrap CIs)", "",
             f"| file | model | engine | hardware | group | comparison | n | ratio | {pct} CI | claim | band | "
             "ceiling | measured vs model | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        e = r.estimate
        band = (f"{_fmt(r.claim_lower, 2)}–{_fmt(r.claim_upper, 2)}" if r.claim_upper is not None
                else (f"≥ {_fmt(r.claim_lower, 2)}" if r.claim_lower is not None else "–"))
        comp = f"{r.config} / {r.baseline}"
        lines.append(f"| {Path(r.file).name} | {r.model} | {r.engine} | {r.hardware} | {r.group} | {comp} | {e.n} | "
                     f"{_fmt(e.point)}× | [{_fmt(e.lo)}, {_fmt(e.hi)}] | {r.claim_id or '–'} | {band} | "
                     f"{_fmt(r.ceiling, 2)} | {'–' if r.model_error is None else f'{r.model_error:+.1%}'} | "
                     f"**{r.verdict}** |")
    reasons = [f"- `{r.claim_id or r.config}` ({Path(r.file).name}, {r.group}): {r.reason}" for r in report.rows
               if r.reason]
    if reasons:
        lines += ["", "Reasons:", *reasons]
    if report.notes:
        lines += ["", "Notes:", *[f"- {n}" for n in report.notes]]
    return "\n".join(lines) + "\n"


def plot(report: GateReport, path: str | Path) -> Path | None:
    """Speedup with CI bars vs the claim band (shaded) vs the model ceiling (red tick), one column per row."""
    rows = [r for r in report.rows if r.kind == "speedup" and math.isfinite(r.estimate.point)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(rows) + 2), 4.2))
    colors = {"PASS": "tab:green", "FAIL": "tab:red", "SUSPECT": "tab:orange", "INSUFFICIENT": "tab:red", "NOT-RUN": "tab:purple",
              "INFO": "tab:blue", "NO-CLAIM": "tab:gray"}
    for i, r in enumerate(rows):
        e = r.estimate
        if r.claim_lower is not None:
            top = r.claim_upper if r.claim_upper is not None else r.claim_lower
            ax.add_patch(plt.Rectangle((i - 0.35, r.claim_lower), 0.7, max(top - r.claim_lower, 0.004),
                                       color="tab:green", alpha=0.18, lw=0,
                                       label="claim band" if i == 0 else None))
        if r.ceiling is not None:
            ax.plot([i - 0.35, i + 0.35], [r.ceiling, r.ceiling], color="tab:red", ls="--", lw=1.5,
                    label="model ceiling" if i == 0 else None)
        yerr = None
        if math.isfinite(e.lo) and math.isfinite(e.hi):
            yerr = [[e.point - e.lo], [e.hi - e.point]]
        ax.errorbar([i], [e.point], yerr=yerr, fmt="o", color=colors.get(r.verdict, "k"), capsize=5)
        ax.annotate(r.verdict, (i, e.point), textcoords="offset points", xytext=(8, 0), fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r.claim_id or r.model}\n{r.config}/{r.baseline}\n{Path(r.file).name}:{r.group}"
                        for r in rows], fontsize=6)
    ax.set_ylabel("speedup (× baseline throughput)")
    ax.set_title(f"FP8 speedup, {report.confidence:.0%} bootstrap CI")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_outputs(report: GateReport, out_dir: str | Path) -> dict[str, Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / "gate.json", "markdown": d / "gate.md"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=2, default=float) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    png = plot(report, d / "gate.png")
    if png is not None:
        paths["plot"] = png
    return paths
