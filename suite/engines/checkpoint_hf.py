"""``hf-fp8``: transformers' fine-grained FP8 integration as a checkpoint *loader* (area ``checkpoint``).

``checkpoint_load`` calls ``AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)`` on a blockwise-FP8
checkpoint (``quantization_config.quant_method: fp8`` with ``weight_block_size``). On a machine without CUDA/XPU,
``FineGrainedFP8HfQuantizer.validate_environment`` (huggingface/transformers
``src/transformers/quantizers/quantizer_finegrained_fp8.py``, 5.24.0) switches a pre-quantized checkpoint to
``dequantize=True``: every FP8 weight goes through ``Fp8Dequantize._dequantize_one``
(``src/transformers/integrations/finegrained_fp8.py``) into BF16 ``nn.Linear`` weights. The engine returns the
parameters the loaded model holds, under the checkpoint's names (transformers ≥ 5 fuses MoE experts into
``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I); they are split back per expert:
gate rows first, as the experts' forward ``chunk(2, dim=-1)`` reads them).

Writing is not available: transformers quantizes to FP8 on load only with a GPU (``validate_environment`` raises
"No GPU or XPU found" for a non-pre-quantized model), so it has no CPU FP8 writer. Needs ``accelerate`` (the FP8
quantizer imports it): it runs in the ``trl`` tier, whose lock has transformers 5.24.0 and accelerate 1.15.0.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from fp8rl.engine import CapabilityMap, Engine, import_failure

_WRITE_REASON = ("transformers quantizes to FP8 only on a GPU (FineGrainedFP8HfQuantizer.validate_environment "
                 "raises 'No GPU or XPU found' for a model that is not pre-quantized): no CPU FP8 checkpoint writer")
_KV_REASON = ("transformers has no FP8 KV cache: a checkpoint's k_scale / v_scale / q_scale are never used for "
              "attention (from_pretrained of a checkpoint holding them is judged by CKPT-LOAD-004)")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class HfFp8Engine(Engine):
    name = "hf-fp8"
    description = ("transformers' fine-grained FP8 loader: from_pretrained of a weight_block_size checkpoint on CPU "
                   "(dequantize-on-load, Fp8Dequantize)")

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
                "checkpoint.attention_scales": _KV_REASON}

    def checkpoint_load(self, path: Any) -> dict[str, torch.Tensor]:
        """The parameters ``transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)`` holds,
        under the checkpoint's names (fused experts split per expert)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, local_files_only=True)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
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
