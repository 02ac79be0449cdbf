"""``fp8rl checkpoint-matrix``: the writer × loader interop matrix of FP8 checkpoints (docs/checkpoint.md).

    fp8rl checkpoint-matrix --writer reference --loader reference --loader hf-fp8 --out fp8rl-checkpoint-matrix

Each writer writes a checkpoint of each model (``tiny-qwen3``: hidden 320, intermediate 384, not multiples of 128;
``tiny-qwen3-moe``) into ``--checkpoints DIR/<writer>/<model>``: an engine with ``checkpoint.write`` through
``checkpoint_write``; an engine with only ``weight_sync`` (e.g. ``verl``) as its synced tensors in the oracle's file
layout and ``quantization_config`` (the dict verl injects into vLLM). A writer unavailable here whose checkpoints
already exist under ``--checkpoints`` (written by a run in the writer's own environment) is read from there. Each
loader with ``checkpoint.load`` loads each checkpoint; a cell is **conformant** when the file is a valid blockwise-FP8
checkpoint, every weight the loader holds equals codes × block scales of the file exactly (rounded once to the
held dtype) and, for a loader with ``checkpoint.score``, its model's log-probs of a rollout sampled from the oracle's
dequantized model are within the e2e bf16 budgets of the oracle's (CKPT-LOAD-005's statement), a **deviation** (with counts and the max error), **error** (the loader raised) or **not run** (the
reason). Writes ``matrix.json``, ``matrix.md`` and a self-contained ``matrix.html`` heat map.

Formats: blockwise FP8 (``quant_method: fp8``, fp8rl.reference.checkpoint), per-tensor FP8 (``quant_method: fp8``
with ``weight_block_size: null`` and one ``<m>.weight_scale`` per projection: writer ``reference-per-tensor``, the
oracle writer's per-tensor layout) and compressed-tensors FP8 (``quant_method: compressed-tensors``, e.g. writer
``compressed-tensors``, block strategy, writer ``reference-channel``, the oracle writer's channel strategy with
dynamic per-token activations, llm-compressor's FP8_DYNAMIC, and writer ``compressed-tensors-channel``, the
compressed-tensors library writing that scheme; fp8rl.reference.checkpoint_ct); the file and cell
judges read all of them. A loader runs only on the formats its engine lists in ``checkpoint_formats`` (default
``("fp8",)``) and the layouts it can load here (fp8rl.engine.checkpoint_layout_reason: vLLM on CPU loads the
block layouts only with AMX); other cells are **not run**, with the reason. A channel-layout cell's log-probs are
held to the e2e fp8-linear-ptpc budgets (its file prescribes per-token FP8 activations), the others' to bf16.

Exit: 0 when every cell that ran is conformant or a known deviation (the loader's vendor xfails list
``CKPT-LOAD-001[<format>:<model>]``, ``<format>`` the file's ``quant_method``, ``per-tensor`` or
``compressed-tensors-channel``; for a ``fp8`` file the plain
``CKPT-LOAD-001[<model>]`` of the conformance check, whose checkpoints are blockwise, counts too) and every file is within bound or a known deviation (the writer's vendor xfails list
``WSYNC-BOUND-001[<model>]``, the same bound), 1 otherwise, 2 on a usage or engine-load error.
"""

from __future__ import annotations

import argparse
import html
import json
import time
from pathlib import Path
from typing import Any

from fp8rl.exitcodes import EXIT_FAIL, EXIT_OK, EXIT_USAGE

MODELS = ("tiny-qwen3", "tiny-qwen3-moe")
#: the oracle writer in the per-tensor layout (weight_block_size null, one ``<m>.weight_scale`` per projection): a
#: writer name of its own, so that the matrix has a row for it
PER_TENSOR_WRITER = "reference-per-tensor"
#: the oracle writer in the compressed-tensors channel layout (fp8rl.reference.checkpoint_ct.write_channel_checkpoint)
CHANNEL_WRITER = "reference-channel"
#: compressed-tensors' own FP8_DYNAMIC writer (engine compressed-tensors, ``checkpoint_write_channel``)
CT_CHANNEL_WRITER = "compressed-tensors-channel"
#: the pseudo-writers: an engine writing a layout other than its ``checkpoint_write`` one → (engine, layout)
LAYOUT_WRITERS = {PER_TENSOR_WRITER: ("reference", "fp8-per-tensor"),
                  CHANNEL_WRITER: ("reference", "compressed-tensors-channel"),
                  CT_CHANNEL_WRITER: ("compressed-tensors", "compressed-tensors-channel")}


def register(subparsers: Any) -> None:
    """Add the ``checkpoint-matrix`` subcommand (called by fp8rl.cli for every module in EXTRA_COMMAND_MODULES)."""
    p = subparsers.add_parser("checkpoint-matrix", help="writer x loader interop matrix of FP8 checkpoints "
                                                        "(blockwise, per-tensor and compressed-tensors; "
                                                        "tiny-qwen3, tiny-qwen3-moe)")
    p.add_argument("--writer", action="append", default=None,
                   help=f"writer engine (repeatable; default: reference, {PER_TENSOR_WRITER} and {CHANNEL_WRITER}, "
                        "the oracle writer's per-tensor and compressed-tensors channel layouts; "
                        f"{CT_CHANNEL_WRITER}: compressed-tensors' own FP8_DYNAMIC writer)")
    p.add_argument("--loader", action="append", default=None,
                   help="loader engine (repeatable; default: reference and hf-fp8)")
    p.add_argument("--model", action="append", default=None, choices=MODELS, help="model (repeatable; default both)")
    p.add_argument("--checkpoints", default=None,
                   help="where checkpoints are written / read (default <out>/checkpoints)")
    p.add_argument("--out", default="fp8rl-checkpoint-matrix", help="output directory")
    p.set_defaults(func=cmd_checkpoint_matrix)


def _write(engine: Any, root: Path, model: str, layout: str | None = None) -> Path:
    """The writer's checkpoint of ``model`` under ``root/model``; ``layout`` (the second item of a
    :data:`LAYOUT_WRITERS` value): the oracle writer's per-tensor layout under the engine's block policy, or the
    engine's channel-strategy writer (``checkpoint_write_channel``)."""
    from fp8rl import capabilities as _caps  # noqa: F401  (the table the keys below come from)
    from fp8rl import fixtures
    from fp8rl.engine import capability_reason
    from fp8rl.reference import checkpoint as ck

    tm = fixtures.tiny_model(model)
    out = root / model
    if layout == "fp8-per-tensor":
        return ck.write_checkpoint(out, tm.config, tm.state_dict,
                                   ck.CheckpointSpec(block=None, policy=engine.scale_policy("block")))
    if layout == "compressed-tensors-channel":
        return Path(engine.checkpoint_write_channel(out, tm.config, tm.state_dict))
    if capability_reason(engine, "checkpoint.write") is None:
        return Path(engine.checkpoint_write(out, tm.config, tm.state_dict))
    spec = ck.CheckpointSpec(policy=engine.scale_policy("block"))
    tensors = engine.weight_sync(tm.state_dict)
    return ck.write_tensors(out, tm.config, tensors, ck.quantization_config(spec, ck.ignored_modules(tm.state_dict,
                                                                                                     spec)))


def _writer_reason(engine: Any, layout: str | None = None) -> str | None:
    from fp8rl.engine import capability_reason

    if layout == "compressed-tensors-channel":
        return capability_reason(engine, "checkpoint.write_channel")
    w = capability_reason(engine, "checkpoint.write")
    s = capability_reason(engine, "weight_sync")
    return None if w is None or s is None else f"checkpoint.write: {w}; weight_sync: {s}"


def judge(held: Any, path: Path) -> dict[str, Any]:
    """One cell: the loader's held weights vs codes × scales of the file (fp8rl.checkpoint_compare, CKPT-LOAD-001's
    comparison); tensors the loader holds beyond the file's are not judged here."""
    from fp8rl.checkpoint_compare import compare_held

    c = compare_held(held, path)
    if c.invalid:
        return {"status": "deviation", "detail": f"the file is {c.invalid}"}
    if c.missing:
        return {"status": "deviation", "detail": f"{len(c.missing)} tensors not held, e.g. {c.missing[0]}"}
    if c.differences:
        return {"status": "deviation", "values_differ": c.values_differ, "values": c.values,
                "tensors_differ": len(c.differences), "max_abs_err": c.max_abs_err,
                "detail": c.differences[0].text()}
    return {"status": "conformant", "values": c.values, "tensors": c.tensors}


def judge_logprobs(engine: Any, path: Path, model: str) -> dict[str, Any]:
    """The loader's model vs the oracle's dequantized model of the file (CKPT-LOAD-005's statement): the e2e prompts
    and 20 tokens sampled from the oracle's model (fp8rl.conformance._e2e.checkpoint_oracle_scored, sampling seed
    1234), scored teacher-forced by both; conformant when k3 KL, token_mult_prob_error and max |dlogp| are within
    the e2e area's budgets of the model: bf16, fp8-linear-ptpc for the channel layout (per-token FP8 activations)."""
    from fp8rl.conformance import _e2e as E
    from fp8rl.reference.rollout import mismatch_metrics

    tokens, lp_oracle = E.checkpoint_oracle_scored(str(path))
    m = mismatch_metrics(engine.checkpoint_score(path, tokens, E.prompt_len()), lp_oracle)
    recipe = E.checkpoint_recipe(_file_format(path))
    over = E.budget_violations(m, model, recipe)
    out: dict[str, Any] = {k: m[k] for k in (*E.METRICS, "mean_abs_dlogp")}
    if over:
        return {**out, "status": "deviation", "detail": f"log-probs vs the oracle's dequantized model ({recipe} "
                f"budgets): " + "; ".join(over)}
    return {**out, "status": "conformant"}


def judge_file(path: Path, model: str) -> dict[str, Any]:
    """The writer's side of a row: every FP8 weight of the file (codes x its scales, blockwise or compressed-tensors)
    within the quantization round-trip bound (tolerance ``quant_roundtrip``) of the model's BF16 weight, every other
    weight unchanged (fp8rl.checkpoint_compare.compare_roundtrip, CKPT-WRITE-006's comparison)."""
    from fp8rl import fixtures
    from fp8rl.checkpoint_compare import compare_roundtrip
    from fp8rl.reference import checkpoint as ck

    try:
        r = compare_roundtrip(*ck.read_checkpoint(path), fixtures.tiny_model(model).state_dict)
    except ck.CheckpointError as exc:
        return {"status": "deviation", "detail": str(exc)}
    bad = r.problems + [f"{w.name}: error/bound {w.worst:.3g}" for w in r.over]
    if bad:
        return {"status": "deviation", "detail": f"{len(bad)} weights: " + "; ".join(bad[:3])}
    return {"status": "conformant", "err_over_bound": r.worst}


def _file_format(path: Path) -> str | None:
    """The cell's format: the file's ``quant_method``; ``per-tensor`` for an ``fp8`` file whose
    ``weight_block_size`` is null and ``compressed-tensors-channel`` for a compressed-tensors file of the channel
    strategy (their findings are keyed ``CKPT-LOAD-001[<format>:<model>]``, as the conformance check's cases)."""
    qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    if not isinstance(qc, dict):
        return None
    fmt = qc.get("quant_method")
    if fmt == "fp8" and "weight_block_size" in qc and qc["weight_block_size"] is None:
        return "per-tensor"
    if fmt == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        strategies = {(g.get("weights") or {}).get("strategy") for g in groups.values() if isinstance(g, dict)}
        if strategies == {"channel"}:
            return "compressed-tensors-channel"
    return fmt


def _layout(fmt: str | None) -> str | None:
    """The fp8rl.engine.CHECKPOINT_LAYOUTS key of a cell format (None: a format no layout names)."""
    from fp8rl.engine import CHECKPOINT_LAYOUTS

    layout = "fp8-per-tensor" if fmt == "per-tensor" else fmt
    return layout if layout in CHECKPOINT_LAYOUTS else None


def _format_reason(engine: Any, fmt: str | None) -> str | None:
    """None if the loader reads a file of cell format ``fmt`` (:func:`_file_format`) here, else why not
    (fp8rl.engine.checkpoint_layout_reason; for a format no layout names, which is then the file's quant_method,
    fp8rl.engine.checkpoint_format_reason)."""
    from fp8rl.engine import checkpoint_format_reason, checkpoint_layout_reason

    layout = _layout(fmt)
    if layout is None:
        return checkpoint_format_reason(engine, fmt)
    return checkpoint_layout_reason(engine, layout)


def known_keys(check: str, model: str, fmt: str | None = None) -> set[str]:
    """The vendor-xfails entries that make a deviation of ``check`` on ``model`` known: ``<check>[<fmt>:<model>]``
    for a file of format ``fmt`` (its ``quant_method``); the plain ``<check>[<model>]`` (the conformance check's own
    case, on blockwise ``fp8`` files) only where the format is ``fp8`` or not given, so an fp8 finding never
    vouches for a compressed-tensors cell."""
    keys = {f"{check}[{fmt}:{model}]"} if fmt else set()
    if fmt in (None, "fp8"):
        keys.add(f"{check}[{model}]")
    return keys


def _known(engine: str, model: str, check: str = "CKPT-LOAD-001", fmt: str | None = None) -> bool:
    """The engine's vendor xfails have an entry that one of ``known_keys(check, model, fmt)`` starts with (an entry
    is a check-id prefix, as in a conformance run: ``WSYNC-BOUND-001[tiny-qwen3-moe`` covers
    ``WSYNC-BOUND-001[tiny-qwen3-moe]``)."""
    from fp8rl.vendor_files import entry_applies, packaged_vendor_file, parse_id_file

    f = packaged_vendor_file(engine, "xfails")
    keys = known_keys(check, model, fmt)
    return f is not None and any(k.startswith(p) for p, r in parse_id_file(f) if entry_applies(r) for k in keys)


def cmd_checkpoint_matrix(args: argparse.Namespace) -> int:
    from fp8rl.engine import capability_reason
    from fp8rl.registry import EngineLoadError, load_engine

    writers = args.writer or ["reference", PER_TENSOR_WRITER, CHANNEL_WRITER]
    loaders = args.loader or ["reference", "hf-fp8"]
    models = args.model or list(MODELS)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"--out: cannot create {out}: {exc}")
        return EXIT_USAGE
    ckroot = Path(args.checkpoints) if args.checkpoints else out / "checkpoints"
    t0 = time.perf_counter()
    engines: dict[str, Any] = {}
    try:
        for name in dict.fromkeys(writers + loaders):
            engines[name] = load_engine(LAYOUT_WRITERS[name][0] if name in LAYOUT_WRITERS else name)
    except EngineLoadError as exc:
        print(str(exc))
        return EXIT_USAGE
    written: dict[tuple[str, str], Path | str] = {}
    for w in writers:
        layout = LAYOUT_WRITERS[w][1] if w in LAYOUT_WRITERS else None
        reason = _writer_reason(engines[w], layout)
        for m in models:
            target = ckroot / w.replace(":", "_") / m
            if reason is not None:
                written[(w, m)] = target if (target / "config.json").is_file() else f"writer not available: {reason}"
                continue
            try:
                written[(w, m)] = _write(engines[w], ckroot / w.replace(":", "_"), m, layout)
            except Exception as exc:  # noqa: BLE001 - a writer failure is a cell outcome
                written[(w, m)] = f"writer raised {type(exc).__name__}: {str(exc)[:300]}"
    files: dict[tuple[str, str], dict[str, Any]] = {
        k: judge_file(v, k[1]) if not isinstance(v, str) else {"status": "not run", "detail": v}
        for k, v in written.items()}
    for (w, m), f in files.items():  # the file judge is WSYNC-BOUND-001's statement (CKPT-WRITE-006's for a channel
        # writer): a writer's xfail of it is known (a pseudo-writer's entries are in its engine's vendor file)
        eng, layout = LAYOUT_WRITERS.get(w, (w, None))
        f["known"] = f["status"] == "deviation" and _known(
            eng, m, "CKPT-WRITE-006" if layout == "compressed-tensors-channel" else "WSYNC-BOUND-001")
    cells = []
    for w in writers:
        for ld in loaders:
            for m in models:
                cell: dict[str, Any] = {"writer": w, "loader": ld, "model": m, "file": files[(w, m)]}
                src = written[(w, m)]
                fmt = None if isinstance(src, str) else _file_format(src)
                cell["format"] = fmt
                lr = capability_reason(engines[ld], "checkpoint.load")
                fr = None if isinstance(src, str) else _format_reason(engines[ld], fmt)
                if isinstance(src, str):
                    cell.update(status="not run", detail=src)
                elif fr is not None and (lr is None or hasattr(engines[ld], "checkpoint_formats")):
                    cell.update(status="not run", detail=f"loader: {fr}")  # a declared format limit comes first
                elif lr is not None:
                    cell.update(status="not run", detail=f"loader: {lr}")
                else:
                    try:
                        cell.update(judge(engines[ld].checkpoint_load(src), src))
                        if capability_reason(engines[ld], "checkpoint.score") is None:
                            cell["logprobs"] = judge_logprobs(engines[ld], src, m)
                            if cell["logprobs"]["status"] != "conformant" and cell["status"] == "conformant":
                                cell.update(status="deviation", detail=cell["logprobs"]["detail"])
                    except Exception as exc:  # noqa: BLE001 - a loader failure is a cell outcome
                        cell.update(status="error", detail=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                by_logprobs = cell.get("logprobs", {}).get("status") == "deviation" and "values_differ" not in cell
                cell["known"] = cell["status"] in ("deviation", "error") and _known(
                    ld, m, "CKPT-LOAD-005" if by_logprobs else "CKPT-LOAD-001", fmt=fmt)
                cells.append(cell)
    doc = {"writers": {w: str(engines[w].version()) for w in writers},
           "loaders": {ld: str(engines[ld].version()) for ld in loaders}, "models": models, "cells": cells,
           "wall_s": round(time.perf_counter() - t0, 2)}
    (out / "matrix.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "matrix.md").write_text(render_md(doc))
    (out / "matrix.html").write_text(render_html(doc))
    print(render_md(doc))
    print(f"wall time {doc['wall_s']} s; matrix: {out}/matrix.json, matrix.md, matrix.html")
    bad = [c for c in cells if c["status"] in ("deviation", "error") and not c["known"]]
    bad += [f for f in files.values() if f["status"] == "deviation" and not f["known"]]
    return EXIT_FAIL if bad else EXIT_OK


def _label(c: dict[str, Any]) -> str:
    if c["status"] == "conformant":
        lp = c.get("logprobs")
        return "conformant" + (f" (log-probs: max Δlogp {lp['max_abs_dlogp']:.3g}, k3 KL {lp['k3_kl']:.3g})"
                               if lp else "")
    if c["status"] == "deviation" and "values_differ" in c:
        return f"deviation{' (known)' if c['known'] else ''}: {c['values_differ']}/{c['values']} values in " \
               f"{c['tensors_differ']} tensors, max err {c['max_abs_err']:.3g}"
    return f"{c['status']}{' (known)' if c.get('known') else ''}: {c.get('detail', '')}"


def _file_label(c: dict[str, Any]) -> str:
    f = c["file"]
    if f["status"] == "conformant":
        return f"within bound (max error/bound {f['err_over_bound']:.3g})"
    known = " (known)" if f.get("known") else ""
    return f"{f['status']}{known}: {f.get('detail', '')}".replace("|", "/")[:200]


def render_md(doc: dict[str, Any]) -> str:
    lines = ["# fp8rl checkpoint interop matrix (writer x loader)", "",
             "writers: " + ", ".join(f"{k} ({v})" for k, v in doc["writers"].items()),
             "loaders: " + ", ".join(f"{k} ({v})" for k, v in doc["loaders"].items()), "",
             "| writer \\ loader | model | file vs BF16 weights | " + " | ".join(doc["loaders"]) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in doc["loaders"]) + " |"]
    by = {(c["writer"], c["loader"], c["model"]): c for c in doc["cells"]}
    for w in doc["writers"]:
        for m in doc["models"]:
            row = [_label(by[(w, ld, m)]).replace("|", "/") for ld in doc["loaders"]]
            lines.append(f"| {w} | {m} | {_file_label(by[(w, doc['loaders'] and next(iter(doc['loaders'])), m)])} | "
                         + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


_COLORS = {"conformant": "#2e7d32", "deviation": "#c62828", "error": "#6a1b9a", "not run": "#9e9e9e"}


def render_html(doc: dict[str, Any]) -> str:
    by = {(c["writer"], c["loader"], c["model"]): c for c in doc["cells"]}
    head = "".join(f"<th>{html.escape(ld)}<br><small>{html.escape(v)}</small></th>" for ld, v in doc["loaders"].items())
    rows = []
    for w, wv in doc["writers"].items():
        for m in doc["models"]:
            tds = []
            for ld in doc["loaders"]:
                c = by[(w, ld, m)]
                color = "#ef6c00" if c.get("known") else _COLORS.get(c["status"], "#9e9e9e")
                tds.append(f'<td style="background:{color};color:#fff" title="{html.escape(json.dumps(c))}">'
                           f"{html.escape(_label(c))}</td>")
            ff = by[(w, next(iter(doc["loaders"])), m)]["file"]
            fc = "#ef6c00" if ff.get("known") else _COLORS.get(ff["status"], "#9e9e9e")
            ftd = f'<td style="background:{fc};color:#fff">{html.escape(_file_label(by[(w, next(iter(doc["loaders"])), m)]))}</td>'
            rows.append(f"<tr><th>{html.escape(w)}<br><small>{html.escape(wv)}</small></th><td>{html.escape(m)}</td>{ftd}"
                        + "".join(tds) + "</tr>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>fp8rl checkpoint interop matrix</title>"
            "<style>body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:6px;font-size:13px;"
            "max-width:28em}table{border-collapse:collapse}</style></head><body>"
            "<h1>Checkpoint interop matrix: writer &times; loader</h1>"
            "<p>green: every held weight = codes &times; block scales of the file, exactly; red: deviation; orange: "
            "known deviation (vendor xfails); purple: the loader raised; grey: not run.</p>"
            f"<table><tr><th>writer</th><th>model</th><th>file vs BF16 weights</th>{head}</tr>{''.join(rows)}</table>"
            f"<p>wall time {doc['wall_s']} s</p></body></html>\n")
