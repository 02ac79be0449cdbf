"""``hf-fp8``: transformers' fine-grained FP8 integration as a checkpoint *loader* (area ``checkpoint``).

``checkpoint_load`` calls ``AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)`` on a blockwise-FP8
checkpoint (``quantization_config.quant_method: fp8`` with ``weight_block_size``). On a machine without CUDA/XPU,
``FineGrainedFP8HfQuantizer.validate_environment`` (huggingface/transformers
``src/transformers/quantizers/quantizer_finegrained_fp8.py``, 5.25.0) switches a pre-quantized checkpoint to
``dequantize=True``: every FP8 weight goes through ``Fp8Dequantize._dequantize_one``
(``src/transformers/integrations/finegrained_fp8.py``) into BF16 ``nn.Linear`` weights. The engine returns the
parameters the loaded model holds, under the checkpoint's names (transformers ≥ 5 fuses MoE experts into
``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I); they are split back per expert:
gate rows first, as the experts' forward ``chunk(2, dim=-1)`` reads them).

Compressed-tensors checkpoints (``quant_method: compressed-tensors``, e.g. writer ``compressed-tensors``) are
loaded too where the compressed-tensors package imports (``checkpoint_formats`` is computed per instance): they go
through transformers' ``CompressedTensorsHfQuantizer`` (``src/transformers/quantizers/quantizer_compressed_tensors.py``)
with ``quantization_config=CompressedTensorsConfig(dequantize=True)`` (the non-deprecated spelling of
``run_compressed=False``). That mode is chosen because it is what a trainer or a reference model loads: the weights
are decompressed once at load (``CompressedTensorsDequantize``, ``src/transformers/integrations/compressed_tensors.py``:
compressed-tensors' compressor ``decompress`` for dense modules, an inline ``quant * scale`` for fused MoE experts)
and the model holds plain ``nn.Linear`` weights in the model dtype, the ones its forward computes with. The default
(``dequantize=False``) keeps ``float8_e4m3fn`` codes next to ``weight_scale`` and decompresses on the first forward,
so its state dict is not what the model computes with. Should a module still hold compressed weights after loading,
the engine decompresses it with compressed-tensors' own ``decompress_module`` (the library's function, never the
oracle's) before reading the parameters. Without compressed-tensors the format is declared not loaded, with the
reason.

``checkpoint_score`` (capability ``checkpoint.score``, CKPT-LOAD-005) scores tokens with the loaded model's own
forward: the log-probs the trainer or reference model that loads the file would compute.

Writing is not available: transformers quantizes to FP8 on load only with a GPU (``validate_environment`` raises
"No GPU or XPU found" for a non-pre-quantized model), so it has no CPU FP8 writer. Needs ``accelerate`` (the FP8
quantizer imports it): it runs in the ``checkpoint`` tier (``nox -s conformance_checkpoint``), whose environment has
transformers 5.25.0, accelerate and compressed-tensors 0.20.1.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from fp8rl.engine import CapabilityMap, Engine, import_failure

_WRITE_REASON = ("transformers quantizes to FP8 only on a GPU (FineGrainedFP8HfQuantizer.validate_environment "
                 "raises 'No GPU or XPU found' for a model that is not pre-quantized): no CPU FP8 checkpoint writer")
_KV_REASON = ("transformers has no FP8 KV cache: a checkpoint's k_scale / v_scale / q_scale are never used for "
              "attention (from_pretrained of a checkpoint holding them is judged by CKPT-LOAD-004)")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _ct_reason() -> str | None:
    """None if the compressed-tensors package imports (transformers' CompressedTensorsHfQuantizer needs it)."""
    return import_failure("compressed_tensors", "pip install compressed-tensors (in the checkpoint tier: "
                                                "nox -s conformance_checkpoint)")


def _quant_method(path: Any) -> str | None:
    qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("quant_method") if isinstance(qc, dict) else None


class _ReportCapture(logging.Handler):
    """Keeps transformers' load report: from_pretrained raises "We encountered some issues during automatic
    conversion" and leaves the conversion errors (function, error text, target parameter) only in the logged
    report, so the engine's error names the first one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(record.getMessage())

    def first_conversion_error(self) -> str | None:
        for text in self.text:
            err = re.search(r"^(\w+(?:Error|Exception): .+)$", text, re.M)
            target = re.search(r"^Error: (\w+) on tensors destined for (\S+?)\.? Ckpt", text, re.M)
            if err is not None:
                where = f" in {target.group(1)} for {target.group(2)}" if target else ""
                return f"conversion error{where}: {err.group(1).strip()}"
        return None


def _decompress_left_over(model: Any) -> None:
    """Decompress, in place, every module that still holds compressed weights after a ``dequantize=True`` load
    (none is expected), with compressed-tensors' own compressor for the module's scheme (``decompress_module``)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationStatus

    qc = getattr(model.config, "quantization_config", None)
    fmt = qc.get("format") if isinstance(qc, dict) else getattr(qc, "format", None)
    for module in model.modules():
        if getattr(module, "quantization_status", None) != QuantizationStatus.COMPRESSED:
            continue
        scheme = module.quantization_scheme
        BaseCompressor.get_value_from_registry(scheme.format or fmt).decompress_module(module)


class HfFp8Engine(Engine):
    name = "hf-fp8"
    description = ("transformers' FP8 loaders: from_pretrained on CPU of a weight_block_size checkpoint "
                   "(dequantize-on-load, Fp8Dequantize) and, with compressed-tensors installed, of a "
                   "compressed-tensors one (CompressedTensorsConfig(dequantize=True))")

    @property
    def checkpoint_formats(self) -> tuple[str, ...]:
        """quant_method of the checkpoints it loads: ``fp8`` always, ``compressed-tensors`` where that package
        imports (fp8rl checkpoint-matrix shows the other cells as not run, with ``checkpoint_format_notes``)."""
        return ("fp8",) if _ct_reason() else ("fp8", "compressed-tensors")

    @property
    def checkpoint_format_notes(self) -> dict[str, str]:
        reason = _ct_reason()
        return {} if reason is None else {
            "compressed-tensors": "transformers reads it through CompressedTensorsHfQuantizer, which needs the "
                                  f"compressed-tensors package: {reason}"}

    def version(self) -> str:
        try:
            import transformers
        except ImportError:
            return "transformers not installed"
        try:
            import accelerate

            acc = f"accelerate {accelerate.__version__}"
        except ImportError:
            acc = "no accelerate"
        return f"transformers {transformers.__version__} ({acc})"

    def _load_reason(self) -> str | None:
        return (import_failure("transformers", "pip install transformers (the trl tier: nox -s conformance_trl)")
                or import_failure("accelerate", "transformers' FP8 loader needs accelerate (validate_environment "
                                                "raises ImportError without it); it is in the trl tier's lock: "
                                                "nox -s conformance_trl"))

    def capabilities(self) -> CapabilityMap:
        reason = self._load_reason()
        return {"checkpoint.load": True if reason is None else reason, "checkpoint.write": _WRITE_REASON,
                "checkpoint.score": True if reason is None else reason,
                "checkpoint.attention_scales": _KV_REASON}

    def _load_model(self, path: Any) -> Any:
        """:meth:`_from_pretrained` of ``path``, the last one kept: checkpoint_load and checkpoint_score of one file
        (CKPT-LOAD-001 then CKPT-LOAD-005, a matrix cell) share one load. The key is the directory and the name,
        size and mtime of each of its files, so a rewritten checkpoint loads again."""
        from pathlib import Path

        p = Path(path).resolve()
        key = (str(p), tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir()
                                    if f.is_file())))
        last = getattr(self, "_last_model", None)
        if last is not None and last[0] == key:
            return last[1]
        self._last_model = None  # a failed load keeps nothing
        model = self._from_pretrained(path)
        self._last_model = (key, model)
        return model

    def _from_pretrained(self, path: Any) -> Any:
        """``transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)`` (a compressed-tensors
        checkpoint with ``quantization_config=CompressedTensorsConfig(dequantize=True)``, see the module docstring);
        a failed weight conversion raises naming transformers' first conversion error."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        kwargs: dict[str, Any] = {}
        compressed = _quant_method(path) == "compressed-tensors"
        if compressed:
            reason = _ct_reason()
            if reason is not None:
                raise RuntimeError(f"a compressed-tensors checkpoint needs the compressed-tensors package: {reason}")
            from transformers import CompressedTensorsConfig

            kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        report = _ReportCapture()
        hf_logging.get_logger("transformers").addHandler(report)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, local_files_only=True,
                                                         **kwargs)
        except RuntimeError as exc:
            first = report.first_conversion_error()
            if first is None:
                raise
            raise RuntimeError(f"from_pretrained: automatic conversion of the weights failed; first {first}") from exc
        finally:
            hf_logging.get_logger("transformers").removeHandler(report)
            if bar:
                hf_logging.enable_progress_bar()
        if compressed:
            _decompress_left_over(model)
        return model.eval()

    def checkpoint_load(self, path: Any) -> dict[str, torch.Tensor]:
        """The parameters the model :meth:`_load_model` loads holds, under the checkpoint's names (fused experts
        split per expert)."""
        model = self._load_model(path)
        out: dict[str, torch.Tensor] = {}
        for name, t in model.state_dict().items():
            m = _EXPERTS.match(name)
            if m is None:
                out[name] = t.detach().clone()
                continue
            base, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "down_proj":
                    out[f"{base}.{e}.down_proj.weight"] = t[e].detach().clone()
                else:
                    inter = t.shape[1] // 2
                    out[f"{base}.{e}.gate_proj.weight"] = t[e, :inter].detach().clone()
                    out[f"{base}.{e}.up_proj.weight"] = t[e, inter:].detach().clone()
        if getattr(model.config, "tie_word_embeddings", False):
            out.pop("lm_head.weight", None)
        return out

    def checkpoint_score(self, path: Any, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """log π(tokens[:, t] | tokens[:, :t]) for t ≥ ``prompt_len`` under the model :meth:`_load_model` loads: one
        teacher-forced forward (its own BF16 modules), log-softmax of the fp32 logits: (B, T − prompt_len) float32."""
        model = self._load_model(path)
        with torch.inference_mode():
            logits = model(input_ids=tokens).logits[:, prompt_len - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, prompt_len:, None]).squeeze(-1)
