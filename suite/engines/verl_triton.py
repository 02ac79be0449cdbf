"""Engine ``verl-triton``: veRL 0.9.1's Triton blockwise FP8 weight quantizer (its default path,
``verl.utils.kernel.fp8_kernel.scaled_fp8_blockwise_triton``) run by Triton's CPU interpreter with the
faithful-downcast workaround, and the SGLang/TRT-LLM weight sync through it. veRL's imports, its torch-path peer
(engine ``verl``) and the notes on the interpreter's arithmetic live in :mod:`fp8rl.engines.verl`.
"""

from __future__ import annotations

from typing import Any

import torch
from fp8rl.capabilities import WSYNC_FAMILY_KEYS
from fp8rl.engine import QUANT_KINDS, CapabilityMap, Engine, Unsupported
from fp8rl.engines.verl import (
    INSTALL_HINT,
    TRITON_ARITH_NOTE,
    _import_verl_fp8,
    _import_verl_triton,
    _triton_dispatch,
    _weight_sync,
)


class VerlTritonEngine(Engine):
    """veRL's Triton blockwise FP8 weight quantizer (its default path) run by Triton's CPU interpreter."""

    name = "verl-triton"
    description = ("veRL (verl==0.9.1) Triton blockwise FP8 weight quantizer (verl.utils.kernel.fp8_kernel."
                   "scaled_fp8_blockwise_triton, veRL's default path) under Triton's CPU interpreter with the "
                   "faithful-downcast workaround; the SGLang/TRT-LLM weight sync through it")

    def __init__(self, mode: str = "faithful") -> None:
        if mode not in ("raw", "faithful"):
            raise ValueError(f"mode: expected 'raw' or 'faithful', got {mode!r}")
        #: conversions mode of the interpreter (``"raw"`` only for evidence of what the workaround changes)
        self.mode = mode
        self._fk, self._reason = _import_verl_triton()
        self._fp8: Any = None
        self._fp8_reason: str | None = self._reason
        if self._fk is not None:
            self._fp8, self._fp8_reason = _import_verl_fp8(triton=True)

    def version(self) -> str:
        if self._fk is None:
            return "verl-triton unavailable"
        import verl

        from . import _triton_interp as TI

        conv = TI.WORKAROUND if self.mode == "faithful" else "the interpreter's own conversions"
        return (f"verl {getattr(verl, '__version__', '?')} fp8_kernel Triton path under the triton "
                f"{TI.triton_version()} interpreter (TRITON_INTERPRET=1, conversions: {conv})")

    def instrument_notes(self) -> list[str]:
        from . import _triton_interp as TI

        first = TI.WORKAROUND_NOTE if self.mode == "faithful" else (
            "Triton interpreter with its own conversions (no workaround): evidence runs only")
        return [first, TRITON_ARITH_NOTE]

    def capabilities(self) -> CapabilityMap:
        keys = [f"quantize.{k}" for k in QUANT_KINDS] + ["weight_sync", *WSYNC_FAMILY_KEYS]
        corr = ["rollout_correction", "rollout_correction.geometric", "rollout_correction.veto",
                "rollout_correction.loss"]
        if self._fk is None:
            return dict.fromkeys(keys + corr, self._reason or INSTALL_HINT)
        caps: CapabilityMap = {f"quantize.{k}": f"veRL quantizes weights 128x128 blockwise only (no {k!r} quantizer)"
                               for k in ("tensor", "token", "channel", "group")}
        caps["quantize.block"] = True
        caps["weight_sync"] = True if self._fp8 is not None else (self._fp8_reason or INSTALL_HINT)
        caps.update(dict.fromkeys(WSYNC_FAMILY_KEYS, caps["weight_sync"]))  # a name-based filter: any family
        caps.update(dict.fromkeys(corr, "veRL's rollout correction is pure PyTorch (no Triton): engine verl"))
        return caps

    def scale_policy(self, kind: str):
        """veRL's Triton path is the ``verl_triton`` preset (s = max(amax, 1e-10)/448, q = clamp(x·(1/s)))."""
        from fp8rl.reference.presets import get_policy

        if kind != "block":
            raise Unsupported(f"veRL quantizes weights 128x128 blockwise only (no {kind!r} quantizer)")
        return get_policy("verl_triton")

    def quantize(self, x, granularity):
        """``scaled_fp8_blockwise_triton(x, [bm, bn])``: veRL's own zero padding to whole blocks, the kernel
        ``_blockwise_cast_to_fp8_kernel``, the crop; returns the dequant scales as veRL ships them."""
        from fp8rl.reference.quant import QuantizedTensor

        from . import _triton_interp as TI

        if granularity.kind != "block":
            raise Unsupported(str(self.capabilities()[f"quantize.{granularity.kind}"]))
        if self._fk is None:
            raise Unsupported(self._reason or INSTALL_HINT)
        if x.dim() != 2:
            raise Unsupported(f"veRL's scaled_fp8_blockwise takes 2-D weights, got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            x = x.to(torch.float32)
        with TI.conversions(self.mode):
            q, s = self._fk.scaled_fp8_blockwise_triton(x.contiguous(), list(granularity.size))
        return QuantizedTensor(q.view(torch.uint8).contiguous(), s.to(torch.float32).contiguous(), granularity,
                               self.scale_policy("block"))

    def weight_sync(self, state_dict):
        """veRL's SGLang/TRT-LLM trainer-side weight sync (as engine ``verl``) with ``scaled_fp8_blockwise`` on its
        Triton path, under the interpreter."""
        from . import _triton_interp as TI

        if self._fp8 is None:
            raise Unsupported(self._fp8_reason or INSTALL_HINT)
        with _triton_dispatch(self._fk), TI.conversions(self.mode):
            return _weight_sync(self._fp8, state_dict)


__all__ = ["VerlTritonEngine"]
