"""matplotlib plots of a report, as PNG bytes (Agg canvas, no pyplot global state; matplotlib imported lazily)."""

from __future__ import annotations

import io
import math
from collections import Counter
from typing import Any

from ._schema import OUTCOMES, as_float

OUTCOME_COLORS = {
    "passed": "#2e7d32",
    "failed": "#c62828",
    "error": "#ef6c00",
    "skipped": "#9e9e9e",
    "xfailed": "#8e24aa",
    "xpassed": "#1565c0",
    "not_run": "#fbc02d",
}
_MAX_TICK_LABELS = 50
_MAX_ANNOTATIONS = 8


def _txt(s: Any) -> str:
    """A user string made safe for matplotlib text (no mathtext, no legend-hiding leading underscore)."""
    s = str(s).replace("$", r"\$")
    return " " + s if s.startswith("_") else s


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def check_label(c: dict) -> str:
    return f"{c['id']}[{c['case']}]" if c.get("case") else c["id"]


def err_over_bound(c: dict) -> float | None:
    """metrics.err_over_bound, else metrics.max_abs_err / metrics.bound when both are there (bound > 0)."""
    m = c.get("metrics") or {}
    v = as_float(m.get("err_over_bound"))
    if v is not None:
        return v
    err, bound = as_float(m.get("max_abs_err")), as_float(m.get("bound"))
    if err is not None and bound is not None and bound > 0 and not math.isnan(err):
        return err / bound
    return None


def plot_err_over_bound(checks: list[dict]) -> bytes | None:
    """Scatter of err/bound per check (log scale, line at 1.0, failures highlighted); None if no data."""
    pts = []
    for c in checks:
        v = err_over_bound(c)
        if v is not None and not math.isnan(v):
            pts.append((check_label(c), c["outcome"], v))
    if not pts:
        return None
    finite_pos = [v for _, _, v in pts if 0 < v < math.inf]
    lo = min(finite_pos + [1.0]) / 10
    hi = max(finite_pos + [1.0]) * 10
    fig = _figure(10, 4.2)
    ax = fig.add_subplot()
    ax.set_yscale("log")
    present = []
    for outcome in OUTCOMES:
        idx = [i for i, (_, o, _) in enumerate(pts) if o == outcome]
        if not idx:
            continue
        present.append(outcome)
        bad = outcome in ("failed", "error", "xpassed")
        for sel, marker in (
            ([i for i in idx if 0 < pts[i][2] < math.inf], "o"),
            ([i for i in idx if pts[i][2] <= 0], "v"),
            ([i for i in idx if pts[i][2] == math.inf], "^"),
        ):
            if sel:
                ax.scatter(
                    sel, [min(max(pts[i][2], lo), hi) for i in sel], marker=marker, s=60 if bad else 22,
                    c=OUTCOME_COLORS[outcome], edgecolors="black" if bad else "none", linewidths=0.8,
                    zorder=3 if bad else 2,
                )
    ax.axhline(1.0, color="#c62828", linestyle="--", linewidth=1.2, zorder=1)
    ax.set_ylim(lo / 2, hi * 2)
    ax.set_xlim(-1, len(pts))
    ax.set_ylabel("error / bound")
    ax.set_title("Per-check error relative to its bound (above the dashed line = bound exceeded)")
    if len(pts) <= _MAX_TICK_LABELS:
        ax.set_xticks(range(len(pts)))
        ax.set_xticklabels([_txt(p[0]) for p in pts], rotation=70, ha="right", fontsize=7)
    else:
        ax.set_xlabel(f"check (n={len(pts)}, in report order)")
        flagged = [i for i, p in enumerate(pts) if p[1] in ("failed", "error") or p[2] > 1]
        if len(flagged) <= _MAX_ANNOTATIONS:  # name the few offenders; many labels would be unreadable
            for i in flagged:
                ax.annotate(_txt(pts[i][0]), (i, min(max(pts[i][2], lo), hi)), fontsize=7, rotation=20,
                            xytext=(4, -10), textcoords="offset points")
    ax.grid(True, axis="y", which="major", alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", linestyle="", color=OUTCOME_COLORS[o], label=o) for o in present]
    handles.append(Line2D([], [], color="#c62828", linestyle="--", label="bound (1.0)"))
    if any(p[2] <= 0 for p in pts):
        handles.append(Line2D([], [], marker="v", linestyle="", color="#555", label="≤ 0 (clipped)"))
    if any(p[2] == math.inf for p in pts):
        handles.append(Line2D([], [], marker="^", linestyle="", color="#555", label="inf (clipped)"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def _ulp_key(k: str) -> tuple[int, int]:
    """Order 0, 1, …, >=2, then "nan" (differing code pairs where either side is a NaN code; identical NaN codes
    agree and count in "0")."""
    if k == "nan":
        return (2, 0)
    return (1, int(k[2:])) if k.startswith(">=") else (0, int(k))


def aggregate_ulp_hist(checks: list[dict]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in checks:
        h = (c.get("metrics") or {}).get("ulp_hist")
        if isinstance(h, dict):
            for k, n in h.items():
                if isinstance(n, int) and not isinstance(n, bool):
                    total[str(k)] += n
    return {k: total[k] for k in sorted(total, key=_ulp_key)}


def plot_ulp_hist(checks: list[dict]) -> bytes | None:
    """Bar chart of the ULP-distance histogram summed over all checks' metrics.ulp_hist; None if no data."""
    hist = aggregate_ulp_hist(checks)
    if not hist or sum(hist.values()) == 0:
        return None
    n_checks = sum(1 for c in checks if isinstance((c.get("metrics") or {}).get("ulp_hist"), dict))
    fig = _figure(7, 3.6)
    ax = fig.add_subplot()
    keys = list(hist)
    vals = [hist[k] for k in keys]
    # colour by agreement with the reference: identical codes (bucket "0", NaN codes included) green, everything
    # else (1 ulp apart, further, or a NaN disagreement) by how far off it is
    colors = ["#2e7d32" if k == "0" else "#f9a825" if k == "1" else "#c62828" for k in keys]
    ax.bar(range(len(keys)), vals, color=colors)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys)
    pos = [v for v in vals if v > 0]
    if pos and max(pos) / min(pos) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("ULP distance from the reference")
    ax.set_ylabel("elements")
    ax.set_title(f"ULP-distance histogram (summed over {n_checks} check(s))")
    for i, v in enumerate(vals):
        ax.annotate(f"{v:,}", (i, v), ha="center", va="bottom", fontsize=8)
    return _png(fig)


def outcomes_by_area(checks: list[dict]) -> dict[str, Counter]:
    areas: dict[str, Counter] = {}
    for c in checks:
        areas.setdefault(c["area"], Counter())[c["outcome"]] += 1
    return areas


def plot_outcomes_by_area(checks: list[dict]) -> bytes | None:
    """Horizontal stacked bars: outcome counts per area; None if there are no checks."""
    areas = outcomes_by_area(checks)
    if not areas:
        return None
    names = list(areas)
    fig = _figure(8, 1.2 + 0.4 * len(names))
    ax = fig.add_subplot()
    left = [0] * len(names)
    for o in OUTCOMES:
        vals = [areas[a].get(o, 0) for a in names]
        if not any(vals):
            continue
        ax.barh(range(len(names)), vals, left=left, color=OUTCOME_COLORS[o], label=o)
        left = [x + v for x, v in zip(left, vals)]
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([_txt(a) for a in names])
    ax.invert_yaxis()
    ax.set_xlabel("checks")
    ax.set_title("Outcomes per area")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def render_plot_spec(spec: dict) -> bytes | None:
    """Render one section plot spec (type "lines", see the package docstring); None when it has no data."""
    if spec.get("type") != "lines":
        raise ValueError(f"unsupported plot type {spec.get('type')!r}; supported: 'lines'")
    xs = list(spec.get("x") or [])
    categorical = any(isinstance(x, str) and as_float(x) is None for x in xs)
    xpos = list(range(len(xs))) if categorical else [as_float(x) for x in xs]
    series = {}
    for name, ys in (spec.get("series") or {}).items():
        parsed = [as_float(y) for y in ys]
        vals = [math.nan if v is None else v for v in parsed]
        if any(math.isfinite(v) for v in vals):
            series[name] = vals
    if not xs or not series:
        return None
    fig = _figure(9, 3.8)
    ax = fig.add_subplot()
    for name, ys in series.items():
        n = min(len(xpos), len(ys))
        ax.plot(xpos[:n], ys[:n], marker="o" if n <= 40 else None, markersize=3, linewidth=1.3, label=_txt(name))
    for h in spec.get("hlines") or []:
        y = as_float(h.get("y"))
        if y is not None and math.isfinite(y):
            ax.axhline(y, color="#c62828", linestyle="--", linewidth=1, label=_txt(h["label"]) if h.get("label") else None)
    if spec.get("yscale") in ("log", "symlog"):
        ax.set_yscale(spec["yscale"])
    if categorical:
        ax.set_xticks(xpos)
        ax.set_xticklabels([_txt(x) for x in xs], rotation=45 if len(xs) > 8 else 0, ha="right" if len(xs) > 8 else "center", fontsize=8)
    ax.set_title(_txt(spec.get("title", "")))
    ax.set_xlabel(_txt(spec.get("xlabel", "")))
    ax.set_ylabel(_txt(spec.get("ylabel", "")))
    ax.grid(True, alpha=0.3)
    if len(series) > 1 or spec.get("hlines"):
        ax.legend(fontsize=8)
    return _png(fig)


def render_section_plots(report: dict) -> list[dict]:
    """Render every plot spec found under ``report["sections"][name]["plot"]`` (a spec or a list of specs).

    Returns, in section order, one dict per spec: ``{"section": name, "title": str, "png": bytes | None,
    "note": str | None}``; ``png`` is None (with a note saying why) when the spec has no finite data or
    cannot be rendered, so one bad section never sinks the whole report.
    """
    out = []
    for name, sec in (report.get("sections") or {}).items():
        if not isinstance(sec, dict) or sec.get("plot") is None:
            continue
        specs = sec["plot"] if isinstance(sec["plot"], list) else [sec["plot"]]
        for spec in specs:
            title = str(spec.get("title") or sec.get("title") or name)
            try:
                png = render_plot_spec(spec)
                note = None if png is not None else "no data to plot"
            except Exception as e:  # a broken extension section must not lose the rest of the report
                png, note = None, f"plot could not be rendered: {type(e).__name__}: {e}"
            out.append({"section": name, "title": title, "png": png, "note": note})
    return out
