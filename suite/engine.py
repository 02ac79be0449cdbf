"""The engine protocol: what an engine under test exposes to the suite.

An engine is an object with a ``name``, a ``version()`` string, a ``capabilities()`` map and op methods. Each
capability key maps to ``True`` (available) or to a human-readable reason why it is not; a check that needs an
unavailable capability is *skipped with that reason*, never passed.

Capability keys (stable; later areas add theirs):

========================  ====================================================================================
``cast.<fmt>``            ``cast(x, fmt)`` for fmt in e4m3fn, e5m2, e4m3fnuz, e5m2fnuz (fp32 → codes)
``quantize.<kind>``       ``quantize(x, granularity)`` for kind in tensor, token, channel, group, block
``gemm.block``            ``block_gemm(a, w, out_dtype)``: W8A8 GEMM of 1×G activations and B×B weights
``gemm.tensor``           ``block_gemm`` with per-tensor scaled operands
``gemm.row``              ``block_gemm`` with per-token activations and per-channel weights
``kv.store`` …            added by the KV area (``kv.attention``, ``kv.calibrate``, ``kv.update_scales``)
``rollout_correction``    added by the correction area
``weight_sync``/``rollout``  added by the weight-sync / e2e area
========================  ====================================================================================

The engine *declares* the numerics it implements, so that checks compare like with like:
``cast_overflow(fmt)`` names its overflow policy per format, and ``scale_policy(kind)`` returns the
:class:`~fp8rl.reference.quant.ScalePolicy` its quantizer follows for a granularity kind. A check then demands
bit-exact agreement with the oracle *under the declared policy*.

"Bring your kernel": subclass :class:`fp8rl.engines.reference.ReferenceEngine` and override single ops.
"""

from __future__ import annotations

from typing import Any

import torch
from fp8rl.reference.quant import Granularity, QuantizedTensor, ScalePolicy

CapabilityMap = dict[str, "bool | str"]

ELEMENT_FORMATS = ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz")
QUANT_KINDS = ("tensor", "token", "channel", "group", "block")
GEMM_KINDS = ("block", "tensor", "row")


class Unsupported(Exception):
    """Raised by an engine op for an input it cannot handle by design (the check is skipped with the message)."""


class EngineError(Exception):
    """The engine misbehaved (raised, returned the wrong shape/dtype/None/NaN): the check's outcome is ``error``."""


class Engine:
    """Base class (and documentation) of the engine protocol. Subclasses override what they support.

    Every op not overridden raises :class:`Unsupported`; ``capabilities()`` must say so with a reason.
    """

    name: str = "engine"
    #: engine-specific description shown by ``fp8rl engines``
    description: str = ""

    def version(self) -> str:
        return "unknown"

    def capabilities(self) -> CapabilityMap:
        return {}

    # -- declared numerics ---------------------------------------------------------------------------------
    def cast_overflow(self, fmt: str) -> str:
        """Overflow policy of :meth:`cast` for ``fmt`` ("saturate", "nan" or "inf")."""
        raise Unsupported(f"{self.name} declares no cast policy for {fmt}")

    def scale_policy(self, kind: str) -> ScalePolicy:
        """The ScalePolicy this engine's quantizer implements for a granularity kind."""
        raise Unsupported(f"{self.name} declares no scale policy for {kind}")

    # -- ops -------------------------------------------------------------------------------------------------
    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """Round fp32 ``x`` to ``fmt``; return uint8 codes of the same shape."""
        raise Unsupported(f"{self.name} has no cast op")

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        """Quantize ``x`` with the engine's declared policy for ``granularity.kind``."""
        raise Unsupported(f"{self.name} has no quantize op")

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y = dequant(a) @ dequant(w)ᵀ for a (M,K) activations and w (N,K) weights, returned in ``out_dtype``."""
        raise Unsupported(f"{self.name} has no block_gemm op")

    # -- area kv: KV-cache ops (BEGIN kv section; only the KV area edits between these markers) ----------------
    # -- END kv section -----------------------------------------------------------------------------------------

    # -- area correction: rollout-correction ops (BEGIN correction section) -------------------------------------
    # -- END correction section ---------------------------------------------------------------------------------

    # -- area weight_sync / e2e: weight-sync and rollout ops (BEGIN e2e section) ----------------------------------
    # -- END e2e section ----------------------------------------------------------------------------------------

    # -- helpers ---------------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version(), "capabilities": self.capabilities()}


def capability_reason(engine: Engine, key: str) -> str | None:
    """None if ``key`` is available on ``engine``, else the reason it is not (unknown keys get a reason too)."""
    caps = engine.capabilities()
    status = caps.get(key)
    if status is True:
        return None
    if status is None or status is False:
        return f"engine {engine.name!r} does not declare capability {key!r}"
    return str(status)
