"""Perf result files: schema, environment capture, loading/validation, and vLLM bench ingestion.

A result file (schema ``fp8rl.perf.result`` v1, :file:`result.schema.json`) holds *paired repeats*: for each
``group`` (one workload or GEMM shape) and repeat index ``i``, one run per precision config, executed back to back
(A B A B …). ``runs[].throughput`` is higher-is-better in the unit ``metric`` names. The gate pairs runs of the
baseline config and a candidate config by (group, repeat).
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from fp8rl.environment import cpu_features, cpu_model, environment

SCHEMA = "fp8rl.perf.result"
SCHEMA_VERSION = 1
METRICS = ("output_tokens_per_s", "total_tokens_per_s", "tflops")


class ResultError(ValueError):
    """A result file is missing, malformed, or not a fp8rl perf result (CLI exit code 2)."""


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------------
def detect_hardware(device: str | None = None) -> dict:
    """``{name, class, device}`` of the current accelerator (a hardware.json entry when one matches) or the CPU."""
    from fp8rl.perf.model import match_hardware

    if device is None:
        try:
            import torch

            if torch.cuda.is_available():
                device = torch.cuda.get_device_name(0)
        except ImportError:  # pragma: no cover
            device = None
    if device is None:
        return {"name": None, "class": "cpu", "device": cpu_model(), "cpu_features": cpu_features()}
    hw = match_hardware(device)
    return {"name": hw.name if hw else None, "class": hw.cls if hw else None, "device": device}


def hardware_block(name: str | None) -> dict:
    """The ``hardware`` block for a user-given hardware name (a hardware.json entry), else auto-detected."""
    if name is None:
        return detect_hardware()
    from fp8rl.perf.model import load_hardware

    if name.lower() == "cpu":
        return {"name": None, "class": "cpu", "device": cpu_model(), "cpu_features": cpu_features()}
    hw = load_hardware(name)
    fname = name.partition("#")[0]
    if Path(fname).is_file():  # a probed hardware file: the gate's model ceiling reads it again from "file"
        block: dict[str, Any] = {"name": hw.name, "class": hw.cls,
                                 "device": hw.match[0] if hw.match else hw.name,
                                 "file": str(Path(fname).resolve()) + name[len(fname):]}
        if hw.cls == "cpu":  # probed here and now: this machine's features
            block["cpu_features"] = cpu_features()
        return block
    return {"name": hw.name, "class": hw.cls, "device": name}


# ---------------------------------------------------------------------------------------------------------------
# schema + IO


def _schema() -> dict:
    return json.loads((resources.files("fp8rl.perf") / "result.schema.json").read_text())


def validate(result: dict, where: str = "result") -> dict:
    """Validate against the JSON schema plus the cross-field rules; ResultError on the first problem."""
    import jsonschema

    try:
        jsonschema.validate(result, _schema())
    except jsonschema.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise ResultError(f"{where}: not a valid {SCHEMA} v{SCHEMA_VERSION} file: {exc.message} (at /{path})") from None
    configs = result["configs"]
    if result["baseline_config"] not in configs:
        raise ResultError(f"{where}: baseline_config {result['baseline_config']!r} is not among configs {configs}")
    seen = set()
    for r in result["runs"]:
        if r["config"] not in configs:
            raise ResultError(f"{where}: run of unknown config {r['config']!r} (configs: {configs})")
        key = (r["group"], r["config"], r["repeat"])
        if key in seen:
            raise ResultError(f"{where}: duplicate run {key}")
        seen.add(key)
    return result


def new_result(*, kind: str, source: str, engine: dict, model: dict, hardware: dict, workload: dict, metric: str,
               baseline_config: str, configs: list[str], runs: list[dict] | None = None,
               environment_: dict | None = None, command: list[str] | None = None) -> dict:
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "kind": kind, "created_at": now_iso(), "source": source,
        "command": list(sys.argv if command is None else command), "environment": environment_ or {},
        "engine": engine, "model": model, "hardware": hardware, "workload": workload, "metric": metric,
        "baseline_config": baseline_config, "configs": list(configs), "runs": list(runs or []),
    }


def looks_like_vllm_bench(data: Any) -> bool:
    if isinstance(data, dict):
        return "tokens_per_second" in data and "elapsed_time" in data
    if isinstance(data, list):
        return any(isinstance(r, dict) and "metric" in r and "benchmark" in r for r in data)
    return False


def load_result(path: str | Path) -> dict:
    """Load and validate one result file (ResultError with the reason otherwise)."""
    p = Path(path)
    if not p.is_file():
        raise ResultError(f"{p}: no such file")
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultError(f"{p}: not JSON: {exc}") from None
    if looks_like_vllm_bench(data):
        raise ResultError(f"{p}: this is a raw `vllm bench throughput` file; convert it first with "
                          f"`fp8rl perf ingest --run CONFIG FILE... --out result.json`")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ResultError(f"{p}: not a {SCHEMA} file (schema field: {data.get('schema') if isinstance(data, dict) else None!r})")
    return validate(data, str(p))


def write_result(result: dict, path: str | Path) -> Path:
    validate(result)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return p


# ---------------------------------------------------------------------------------------------------------------
# vLLM bench ingestion


def _config_from_vllm_args(args: dict) -> str | None:
    quant = str(args.get("quantization") or "").lower()
    kv = str(args.get("kv_cache_dtype") or "auto").lower()
    linear = quant.startswith("fp8") or quant in ("fbgemm_fp8", "modelopt") or quant == "deepseek_v4_fp8"
    kv8 = kv.startswith("fp8")
    if quant and not linear and quant not in ("none",):
        return None
    return {(False, False): "bf16", (True, False): "fp8-linear", (False, True): "fp8-kv",
            (True, True): "fp8-all"}[(linear, kv8)]


def read_vllm_bench(path: str | Path) -> dict[str, Any]:
    """One ``vllm bench throughput`` output: ``{tokens_per_second, elapsed_time, num_requests, total_num_tokens,
    config (inferred from args of the PyTorch-benchmark format, else None), args}``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultError(f"{p}: not a readable JSON file: {exc}") from None
    if isinstance(data, dict) and "tokens_per_second" in data:
        try:
            out: dict[str, Any] = {"tokens_per_second": float(data["tokens_per_second"]),
                   "elapsed_time": float(data["elapsed_time"]) if data.get("elapsed_time") is not None else None,
                   "num_requests": int(data["num_requests"]) if data.get("num_requests") is not None else None,
                   "total_num_tokens": (int(data["total_num_tokens"]) if data.get("total_num_tokens") is not None
                                        else None),
                   "config": None, "args": {}}
        except (TypeError, ValueError) as exc:
            raise ResultError(f"{p}: malformed vllm bench throughput JSON: {exc}") from None
        return out
    if isinstance(data, list):  # SAVE_TO_PYTORCH_BENCHMARK_FORMAT records
        vals: dict[str, float] = {}
        args: dict = {}
        for rec in data:
            if not isinstance(rec, dict):
                continue
            metric = rec.get("metric", {})
            bv = metric.get("benchmark_values") or []
            if metric.get("name") and bv:
                vals[metric["name"]] = float(bv[0])
            args = rec.get("benchmark", {}).get("extra_info", {}).get("args", args) or args
        if "tokens_per_second" not in vals:
            raise ResultError(f"{p}: PyTorch-benchmark-format file without a tokens_per_second metric")
        return {"tokens_per_second": vals["tokens_per_second"], "elapsed_time": None,
                "num_requests": args.get("num_prompts"), "total_num_tokens": None,
                "config": _config_from_vllm_args(args), "args": args}
    raise ResultError(f"{p}: not a vllm bench throughput output (expected tokens_per_second)")


def ingest_vllm(runs_by_config: list[tuple[str | None, list[str]]], *, model_name: str, hardware: dict,
                engine_version: str | None = None, prompt_len: int | None = None, gen_len: int | None = None,
                baseline: str = "bf16", command: list[str] | None = None) -> dict:
    """Build a result from vLLM bench files. ``runs_by_config`` is ``[(config or None, [files...]), ...]``; files of
    one config are repeats in execution order (pair repeat i of every config: run them interleaved). A None config
    means "infer from each file" (PyTorch-benchmark format only).

    With ``gen_len`` given and ``num_requests``/``elapsed_time`` present, the metric is output tokens/s
    (``num_requests · gen_len / elapsed``); otherwise vLLM's ``tokens_per_second`` (prompt + output tokens/s).
    """
    from fp8rl.perf.model import get_precision

    per_config: dict[str, list[tuple[str, dict]]] = {}
    for config, files in runs_by_config:
        for f in files:
            rec = read_vllm_bench(f)
            cfg = config or rec["config"]
            if cfg is None:
                raise ResultError(f"{f}: cannot infer the precision config (plain --output-json has no args); "
                                  f"name it: --run CONFIG {f}")
            cfg = get_precision(cfg).name
            per_config.setdefault(cfg, []).append((f, rec))
    if baseline not in per_config:
        raise ResultError(f"ingest: no files for the baseline config {baseline!r} (got {sorted(per_config)})")
    all_recs = [r for lst in per_config.values() for _, r in lst]
    output_metric = gen_len is not None and all(r["num_requests"] and r["elapsed_time"] for r in all_recs)
    metric = "output_tokens_per_s" if output_metric else "total_tokens_per_s"
    runs = []
    n_rep = max(len(v) for v in per_config.values())
    seq = 0
    for i in range(n_rep):
        for cfg, lst in per_config.items():
            if i >= len(lst):
                continue
            f, rec = lst[i]
            tput = (rec["num_requests"] * gen_len / rec["elapsed_time"] if output_metric
                    else rec["tokens_per_second"])
            runs.append({"group": "default", "config": cfg, "repeat": i, "seq": seq, "throughput": tput,
                         "wall_s": rec["elapsed_time"], "tokens": rec["total_num_tokens"], "peak_memory_bytes": None,
                         "peak_memory_kind": None, "kv_capacity_tokens": None, "valid": True, "problems": [],
                         "file": str(f)})
            seq += 1
    args: dict = next((r["args"] for r in all_recs if r["args"]), {})
    workload = {"batch": next((r["num_requests"] for r in all_recs if r["num_requests"]), args.get("num_prompts")),
                "prompt_len": prompt_len if prompt_len is not None else args.get("input_len"),
                "gen_len": gen_len if gen_len is not None else args.get("output_len"),
                "repeats": n_rep, "ignore_eos": True, "order": "as given"}
    configs = [baseline] + [c for c in per_config if c != baseline]
    return new_result(kind="rollout", source="vllm bench throughput",
                      engine={"name": "vllm", "version": engine_version}, model={"name": model_name, "path": None},
                      hardware=hardware, workload=workload, metric=metric, baseline_config=baseline, configs=configs,
                      runs=runs, environment_=environment(), command=command)
