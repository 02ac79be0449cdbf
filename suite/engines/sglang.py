"""``sglang``: SGLang's own FP8 code (``sglang==0.5.23``) on CPU, its Triton kernels in Triton's interpreter.

Every op calls the SGLang function named below, as SGLang calls it on a non-CUDA platform; the adapter only maps
the suite's tensors onto SGLang's calling conventions. Triton kernels run under ``TRITON_INTERPRET=1``
(:func:`fp8rl.engines._triton_interp.enable_interpreter`, called before any SGLang module is imported) inside
``with _triton_interp.conversions("faithful"):`` — the interpreter's own fp32→fp8/bf16 conversions are wrong, so
every report names :data:`~fp8rl.engines._triton_interp.WORKAROUND_NOTE` (``instrument_notes()``).

Ops and the SGLang code behind each (module paths inside the wheel):

* ``quantize`` group (1×128): ``sglang.kernels.ops.quantization.fp8_kernel.per_token_group_quant_fp8(x, 128)`` —
  on every non-CUDA platform this is ``_per_token_group_quant_8bit_raw`` with row-major scales, i.e. the Triton
  kernel ``_per_token_group_quant_8bit`` (what ``triton_w8a8_block_fp8_linear`` calls with
  ``column_major_scales=False``) → preset ``sglang_triton_group`` (amax floor 1e-10, s = amax/448,
  q = clamp(x·(1/s))). SGLang asserts K % 128 == 0; for other K the adapter zero-pads the last dim to a multiple
  of 128 and drops the padding (zeros never change an amax, so the real elements' codes and scales are the ones
  SGLang computes). CUDA's production path, the JIT ``sglang_per_token_group_quant_fp8``, is preset
  ``sglang_group`` (not reachable here). Column-major scales (``column_major_scales=True``,
  ``_per_token_group_quant_8bit_colmajor``) divide instead of multiplying → preset
  ``sglang_triton_group_colmajor``; its ``SCALE_UE8M0`` variant → ``sglang_triton_group_ue8m0`` (reachable only by
  launching the kernel: the Python entry then needs ``deep_gemm.transform_sf_into_required_layout``). Both are
  pinned in tests/engines/triton/test_sglang_engine.py.
* ``quantize`` token: ``per_token_group_quant_fp8(x, group_size=K)`` — exactly the dynamic activation quant of
  ``srt/layers/quantization/fp8_utils.py::apply_fp8_linear`` when neither CUDA nor HIP (CUDA uses the JIT
  ``sglang_per_token_quant_fp8``, ROCm ``scaled_fp8_quant``) → ``sglang_triton_group`` with one group per row.
* ``quantize`` channel: ``per_token_group_quant_fp8(w, w.shape[-1])`` — the online per-channel weight quant of
  ``Fp8LinearMethod`` / ``W8A8Fp8LinearMethod.process_weights_after_loading`` → ``sglang_triton_group``.
* ``quantize`` tensor: ``fp8_kernel.per_tensor_quant_mla_fp8(x[None], x_s_out=zeros(1))`` — the Triton per-tensor
  activation quant of DeepSeek MLA (``forward_mla.py`` passes a zeroed 1-element scale buffer; stage 1 takes the
  atomic max of max(row amax, 1e-12)/448, stage 2 q = clamp(x·(1/s))) → preset ``sglang_mla_tensor``. The torch
  ``srt/layers/quantization/fp8_utils.py::input_to_float8`` (per-tensor *weight* quant off CUDA) is not expressible
  as a ScalePolicy: it writes ``scale = fp_max / amax`` with a Python-float numerator, which torch evaluates as
  ``amax.reciprocal() * 448`` (``Tensor.__rdiv__``), i.e. m = fl(fl(1/amax)·448), not fl(448/amax); its returned
  m differs by one ulp from fl(448/amax) (the ``torchao`` preset's multiplier) for some amaxes (pinned in the
  tests), so no preset matches it bit for bit.
* ``quantize`` block (128×128): ``srt/layers/quantization/fp8_utils.py::per_block_cast_to_fp8`` (pure torch,
  always UE8M0, used by ``quant_weight_ue8m0``) → preset ``deepgemm_ue8m0`` (SGLang's copy of DeepGEMM's).
* ``cast`` e4m3fn: fp32 input → ``static_quant_fp8(x, scale=1.0)`` (q = clamp(x·1).to(e4m3fn)); bf16/fp16 input
  → ``fp8_quantize(x, scale_inv=1.0)`` (SGLang's "cast a BF16/FP16 tensor to FP8" kernel, no clamp, satfinite).
  ``cast`` e5m2: ``fp8_quantize(x, fp8_dtype=float8_e5m2)``, bf16/fp16 input only (fp32 input: Unsupported —
  SGLang has no fp32→e5m2 entry). Overflow: saturate (clamp resp. the satfinite conversion). NaN: finding
  (conformance/vendors/sglang.xfails): ``tl.clamp`` with its default ``propagate_nan=NONE`` turns NaN into -448 in
  the interpreter (``np.fmin(np.fmax(x, lo), hi)``), in every SGLang kernel that clamps (static, group, per-token,
  MLA); whether the compiled GPU min/max does the same is not verified here. ``fp8_quantize`` (no clamp) keeps NaN.
* ``block_gemm`` block: ``sglang.kernels.ops.gemm.fp8_kernel.w8a8_block_fp8_matmul_triton`` (Triton kernel
  ``_w8a8_block_fp8_matmul``, default config 64×128×128). **Shim**: it looks up tuned configs by
  ``get_device_name()``, which returns None on CPU (``None.replace`` fails); during the call the adapter patches
  that one module-level name to return ``"fp8rl-cpu-interpreter"`` (no config file matches, so SGLang uses its
  default config).
* ``block_gemm`` tensor / row: ``apply_fp8_linear`` with pre-quantized input (``input_scale`` given,
  ``cutlass_fp8_supported=False`` as on CPU): per-tensor → ``torch._scaled_mm(…, scale_a, scale_b)``; per-token ×
  per-channel → ``_apply_fallback_scaled_mm`` (unit-scale ``_scaled_mm`` into fp32, then ``out · s_x · s_wᵀ``).
* ``kv_store`` (e4m3fn, per-tensor scale): ``srt/layers/quantization/fp4_kv_cache_quant_method.py::
  CPUFP8KVCacheMethod.quantize_and_store`` — SGLang's CPU FP8 KV-cache write, ``(cache_k / k_scale).to(
  float8_e4m3fn)`` into the buffers of its own ``create_buffers`` (true division, no clamp, torch's saturating
  cast). e5m2 is refused on CPU; the CPU attention that reads the cache is an sgl_kernel op (not installed).

Not reachable on CPU (capability reasons): ``sglang_per_token_group_quant_fp8`` / ``sglang_per_token_quant_fp8`` /
``scaled_fp8_quant`` (their kernels are imported only ``if _is_cuda:`` → NameError); the torch fallbacks
``_native_dynamic_per_token_quant_fp8``, ``_native_dynamic_per_tensor_quant_fp8``, ``_native_static_quant_fp8``
(defined only inside ``if _is_hip:``; the suite does not fake the platform, so they are not engine ops — the tests
compile those three definitions from the installed ``fp8_kernel.py`` source and pin them against preset
``sglang_native``, labelled as source-extracted); DeepGEMM and CUTLASS GEMMs.

Raw interpreter (``conversions("raw")``, measured on triton 3.9.0): the same kernels without the workaround give
codes that differ from the oracle while the scales stay bit-exact: 668 of 32,768 group-quant codes (2.0%) on a
64×512 input (0 with the workaround); in a cast sweep 1.0625 → 1.125 (ties rounded up), 17 → 18, 31.6 → 16 (lost
mantissa carry), 3·2^-10 → 2^-9 (truncated subnormal). Overflow never reaches the conversion (the kernels clamp to
±448 first). The block GEMM with bf16 output: 2,092 of 4,096 outputs (51%) differ from the RNE-rounded fp32
accumulator (raw fp32→bf16 truncates), 0 with the workaround. :func:`raw_vs_faithful` reproduces the numbers
(``python -m fp8rl.engines.sglang``); :data:`RAW_MEASUREMENT` records them.

Explicit shims: the faithful-downcast workaround (the one arithmetic workaround; ``instrument_notes()`` names it in
every report), the ``get_device_name`` patch above (:data:`DEVICE_NAME_NOTE`) and :mod:`fp8rl.engines._sglang_shim`
(:data:`TORCHVISION_NOTE`: a torchvision stand-in visible only to SGLang's own module-level imports while the
engine imports SGLang; no FP8 op uses it).

Install (own venv): ``nox -s conformance_triton`` builds the locked environment (``locks/triton.txt``); by hand,
``pip install -c constraints.txt -e '.[test,sglang]'`` then ``pip install --no-deps sglang==0.5.23``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
from fp8rl.engine import (
    ELEMENT_FORMATS,
    CapabilityMap,
    Engine,
    EngineError,
    Unsupported,
    import_failure,
    per_tensor_kv_input,
)
from fp8rl.engines import _triton_interp
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, QuantizedTensor

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (f"sglang not installed: pip install -c constraints.txt -e '.[sglang]' then pip install --no-deps "
                f"sglang=={SGLANG_VERSION} (own venv; nox -s conformance_triton)")

#: granularity kind → the PRESETS entry SGLang's quantizer for that kind implements (see the module docstring)
POLICIES: dict[str, str] = {
    "tensor": "sglang_mla_tensor",
    "token": "sglang_triton_group",
    "channel": "sglang_triton_group",
    "group": "sglang_triton_group",
    "block": "deepgemm_ue8m0",
}
GROUP = 128
BLOCK = 128
#: what get_device_name() is made to return during w8a8_block_fp8_matmul_triton (no tuned config matches it)
DEVICE_NAME = "fp8rl-cpu-interpreter"
DEVICE_NAME_NOTE = (
    "sglang w8a8_block_fp8_matmul_triton: get_device_name() (None on CPU) is patched to return "
    f"{DEVICE_NAME!r} during the call, so SGLang takes its default kernel config (no tuned config file matches)")

TORCHVISION_NOTE = (
    "sglang import: torchvision stand-in (fp8rl.engines._sglang_shim) answering only SGLang's module-level "
    "multimodal imports (torchvision, torchvision.transforms, torchvision.transforms.functional) during the import; "
    "removed from sys.modules afterwards and used by no FP8 op")

#: measured with conversions("raw") by raw_vs_faithful() (triton 3.9.0, seed 0)
RAW_MEASUREMENT = (
    "raw interpreter conversions: per_token_group_quant_fp8 on 64x512 N(0,1)·2^U(-8,8): scales bit-exact, 668 of "
    "32,768 codes (2.0%) differ from sglang_triton_group (0 with the workaround); static_quant_fp8 with s = 1: "
    "1.0625 → 0x39 (1.125, tie rounded up; RNE 0x38), 17 → 0x59 (18; RNE 16), 31.6 → 0x58 (16: the mantissa carry "
    "is lost; RNE 32), 3·2^-10 → 0x01 (truncated subnormal; RNE 0x02); overflow is clamped by the kernel first, so "
    "500/1e6/inf give 448 in both modes; w8a8_block_fp8_matmul_triton with bf16 output (16x512 @ 512x256): 2,092 "
    "of 4,096 outputs (51%) differ from the RNE-rounded fp32 accumulator (the interpreter truncates fp32→bf16), 0 "
    "with the workaround")


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, str | None]:
    """(namespace of SGLang's FP8 modules, or None; the reason when unusable)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:  # checked without importing: triton must not load before the
        return None, INSTALL_HINT                   # interpreter is requested
    reason = _triton_interp.enable_interpreter()
    if reason:
        return None, f"Triton interpreter unavailable: {reason}"
    reason = import_failure("sglang", INSTALL_HINT)
    if reason:
        return None, reason
    import sglang
    from fp8rl.engines._sglang_shim import torchvision_stub

    try:
        with torchvision_stub() as stubbed:
            import sglang.kernels.ops.gemm.fp8_kernel as gemm
            import sglang.kernels.ops.quantization.fp8_kernel as qk
            import sglang.kernels.ops.quantization.fp8_quantize as fq
            import sglang.srt.layers.quantization.fp8_utils as fu
            from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import CPUFP8KVCacheMethod
    except Exception as exc:  # noqa: BLE001
        return None, (f"SGLang's FP8 modules do not import ({type(exc).__name__}: {exc}); install the [sglang] extra "
                      "(docs/triton-interpreter.md)")
    ns = types.SimpleNamespace(qk=qk, fq=fq, fu=fu, gemm=gemm, kv_method=CPUFP8KVCacheMethod,
                               version=str(getattr(sglang, "__version__", "?")), stubbed=tuple(stubbed), triton=_triton_interp.triton_version())
    return ns, None


def sglang_reason() -> str | None:
    """None if SGLang's FP8 code is usable here, else why not (every capability then carries this reason)."""
    return _load()[1]


def _mods() -> Any:
    ns, reason = _load()
    if ns is None:
        raise Unsupported(reason or INSTALL_HINT)
    return ns


@contextlib.contextmanager
def device_name_shim(ns: Any):
    """Patch ``sglang.kernels.ops.gemm.fp8_kernel.get_device_name`` for the duration of one call (see docstring)."""
    original = ns.gemm.get_device_name
    ns.gemm.get_device_name = lambda *a, **k: DEVICE_NAME
    try:
        yield
    finally:
        ns.gemm.get_device_name = original


def _pad_k(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)).contiguous() if pad else x.contiguous()


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).contiguous() if q.dtype != torch.uint8 else q.contiguous()


class SglangEngine(Engine):
    name = "sglang"
    description = ("SGLang's own FP8 code on CPU (sglang 0.5.23): Triton 1x128 group / per-token / MLA per-tensor "
                   "quant, static_quant_fp8, fp8_quantize and the block-scaled GEMM in Triton's interpreter "
                   "(faithful-downcast), per_block_cast_to_fp8, apply_fp8_linear's torch._scaled_mm paths, the CPU "
                   "FP8 KV-cache write")

    def version(self) -> str:
        ns, _ = _load()
        if ns is None:
            return "sglang not installed"
        return f"sglang {ns.version} (CPU, Triton {ns.triton} interpreter, torch {torch.__version__})"

    def instrument_notes(self) -> list[str]:
        """The interpreter workaround every Triton result relies on, and the two import/config shims (they change no
        arithmetic, but a report must say the code ran with them)."""
        return [_triton_interp.WORKAROUND_NOTE, DEVICE_NAME_NOTE, TORCHVISION_NOTE]

    # -- capabilities ----------------------------------------------------------------------------------------
    def capabilities(self) -> CapabilityMap:
        keys = [f"cast.{f}" for f in ELEMENT_FORMATS] + ["cast.bf16"] + [f"quantize.{k}" for k in POLICIES]
        keys += ["gemm.block", "gemm.tensor", "gemm.row", "kv.store", "kv.attention", "kv.calibrate",
                 "kv.update_scales"]
        reason = sglang_reason()
        if reason:
            return dict.fromkeys(keys, reason)
        v = _load()[0].version
        caps: CapabilityMap = {"cast.e4m3fn": True, "cast.e5m2": True}
        for f in ("e4m3fnuz", "e5m2fnuz"):
            caps[f"cast.{f}"] = (f"sglang {v}: fp8_dtype is float8_e4m3fn off ROCm; e4m3fnuz (clamped at 224) is used "
                                 "only on ROCm gfx94x, e5m2fnuz never")
        caps["cast.bf16"] = f"sglang {v}: no standalone fp32→bf16 rounding op"
        caps.update({f"quantize.{k}": True for k in POLICIES})
        caps.update({"gemm.block": True, "gemm.tensor": True, "gemm.row": True})
        caps["kv.store"] = True
        caps["kv.attention"] = (f"sglang {v}: the CPU FP8 KV cache is read by the intel_amx attention backend "
                                "(sgl_kernel CPU ops, not installed here); not driven by this adapter")
        caps["kv.calibrate"] = (f"sglang {v}: no KV-scale calibration: k/v scales come from the checkpoint or "
                                "--quantization-param-path, else 1.0 (docs/engine-numerics.md §3.3; SGLang never had "
                                "calculate_kv_scales, issue #6518)")
        caps["kv.update_scales"] = f"sglang {v}: no runtime KV-scale recalibration or push API"
        return caps

    # -- declared numerics -------------------------------------------------------------------------------------
    def cast_overflow(self, fmt: str) -> str:
        if fmt in ("e4m3fn", "e5m2"):
            return "saturate"
        raise Unsupported(self.capabilities().get(f"cast.{fmt}", f"no cast for {fmt}"))

    def scale_policy(self, kind: str) -> ScalePolicy:
        if kind not in POLICIES:
            raise Unsupported(f"sglang: no quantizer for granularity {kind!r}")
        return get_policy(POLICIES[kind])

    # -- ops -----------------------------------------------------------------------------------------------------
    def cast(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        ns = _mods()
        if fmt not in ("e4m3fn", "e5m2"):
            raise Unsupported(self.capabilities().get(f"cast.{fmt}", f"no cast for {fmt}"))
        shape = tuple(x.shape)
        flat = x.detach().reshape(1, -1).contiguous()
        with _triton_interp.conversions("faithful"):
            if x.dtype in (torch.bfloat16, torch.float16):
                # fp8_quantize's kernel spans a row with tl.arange(0, N): N must be a power of two (a Triton rule,
                # compiled or interpreted). The cast is elementwise, so the adapter casts rows of 128, zero-padded.
                n = flat.numel()
                rows = torch.nn.functional.pad(flat, (0, -n % 128)).reshape(-1, 128)
                dt = torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2
                q = ns.fq.fp8_quantize(rows, scale_inv=1.0, fp8_dtype=dt).reshape(1, -1)[:, :n]
            elif fmt == "e4m3fn":
                q, _ = ns.qk.static_quant_fp8(flat.to(torch.float32), torch.ones(1, dtype=torch.float32))
            else:
                raise Unsupported("sglang: no fp32→e5m2 cast (fp8_quantize, SGLang's only e5m2 quantizer, takes "
                                  "bf16/fp16 input; static_quant_fp8 and the group quant are e4m3fn only)")
        return _codes(q).reshape(shape)

    def quantize(self, x: torch.Tensor, granularity: Granularity) -> QuantizedTensor:
        ns = _mods()
        kind = granularity.kind
        x32 = x.detach().to(torch.float32).contiguous()
        if x32.dim() != 2:
            raise Unsupported(f"sglang quantizers take 2-D tensors here, got shape {tuple(x32.shape)}")
        k = x32.shape[-1]
        if kind == "group":
            if granularity.size[1] != GROUP:
                raise Unsupported(f"sglang: group size {granularity.size[1]} (the suite's SGLang path is 1x{GROUP})")
            xp = _pad_k(x32, GROUP)
            with _triton_interp.conversions("faithful"):
                q, s = ns.qk.per_token_group_quant_fp8(xp, GROUP)
            q, s = q[:, :k], s[:, : -(-k // GROUP)]
        elif kind in ("token", "channel"):
            with _triton_interp.conversions("faithful"):
                q, s = ns.qk.per_token_group_quant_fp8(x32, k)
        elif kind == "tensor":
            with _triton_interp.conversions("faithful"):
                q, s = ns.qk.per_tensor_quant_mla_fp8(x32[None], torch.zeros(1, dtype=torch.float32))
            q, s = q[0], s.reshape(1)
        elif kind == "block":
            if tuple(granularity.size) != (BLOCK, BLOCK):
                raise Unsupported(f"sglang per_block_cast_to_fp8 is 128x128 only, got {granularity.size}")
            q, s = ns.fu.per_block_cast_to_fp8(x32)
        else:
            raise Unsupported(f"sglang: no quantizer for granularity {kind!r}")
        return QuantizedTensor(_codes(q), s.to(torch.float32).contiguous(), granularity, self.scale_policy(kind))

    def block_gemm(self, a: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        ns = _mods()
        ka, kw = a.granularity.kind, w.granularity.kind
        a8 = a.codes.view(torch.float8_e4m3fn).contiguous()
        w8 = w.codes.view(torch.float8_e4m3fn).contiguous()
        if a.fmt != "e4m3fn" or w.fmt != "e4m3fn":
            raise Unsupported("sglang FP8 GEMMs take float8_e4m3fn operands only")
        m, n = a8.shape[0], w8.shape[0]
        if ka == "group" and kw == "block":
            if a.granularity.size[1] != GROUP or tuple(w.granularity.size) != (BLOCK, BLOCK):
                raise Unsupported("sglang w8a8_block_fp8_matmul_triton: the suite drives 1x128 / 128x128 only")
            with device_name_shim(ns), _triton_interp.conversions("faithful"):
                out = ns.gemm.w8a8_block_fp8_matmul_triton(a8, w8, a.scale.contiguous(), w.scale.contiguous(),
                                                           [BLOCK, GROUP], output_dtype=out_dtype)
            return out
        if (ka, kw) in (("tensor", "tensor"), ("token", "channel")):
            x_scale = a.scale.reshape(1) if ka == "tensor" else a.scale.reshape(m, 1)
            w_scale = w.scale.reshape(1) if kw == "tensor" else w.scale.reshape(n, 1)
            out = ns.fu.apply_fp8_linear(a8, w8.t(), w_scale, input_scale=x_scale, cutlass_fp8_supported=False,
                                         pre_quant_output_dtype=out_dtype)
            if out.dtype != out_dtype:
                raise EngineError(f"sglang apply_fp8_linear returned {out.dtype}, asked for {out_dtype}")
            return out
        raise Unsupported(f"sglang: no GEMM for {ka} activations x {kw} weights")

    # -- area kv: the CPU FP8 KV-cache write -----------------------------------------------------------------------
    def kv_policy(self, fmt: str, layout: str):
        from fp8rl.reference.kv import KVPolicy

        v = _mods().version
        if fmt != "e4m3fn":
            raise Unsupported(f"sglang {v}: the CPU FP8 KV cache (CPUFP8KVCacheMethod) is e4m3 only; --kv-cache-dtype "
                              "fp8_e5m2 is refused on CPU")
        if layout != "tensor":
            raise Unsupported(f"sglang {v}: KV scales are per layer (k_scale/v_scale), layout {layout!r} does not exist")
        # (cache_k / k_scale).to(float8_e4m3fn): true division, no clamp, torch's saturating e4m3fn cast
        return KVPolicy(fmt="e4m3fn", layout="tensor", quant_op="div", clamp=False, overflow="saturate",
                        quantize_q=False)

    def kv_store(self, x, scale, *, fmt, layout):
        """``CPUFP8KVCacheMethod.quantize_and_store`` into a [slots, H, D] float8_e4m3fn buffer of
        ``create_buffers`` (``srt/layers/quantization/fp4_kv_cache_quant_method.py``), slots = every token."""
        from fp8rl.reference.kv import KVCache

        ns = _mods()
        self.kv_policy(fmt, layout)
        x3, s, shape = per_tensor_kv_input(x, scale)
        h, d = shape[-2], shape[-1]
        flat = x3.contiguous()
        n = flat.shape[0]
        method = ns.kv_method()
        bufs = method.create_buffers(n, h, d, 1, "cpu")
        loc = torch.arange(n, dtype=torch.int64)
        # k_scale as a Python float (SGLang passes a float or a 1-element fp32 tensor: the same fp32 division);
        # the cache_v slot gets a copy of the same tensor
        method.quantize_and_store(bufs["k_buffer"][0], bufs["v_buffer"][0], None, None, loc, flat, flat.clone(),
                                  k_scale=float(s), v_scale=float(s))
        k_codes = bufs["k_buffer"][0].view(torch.uint8)
        if not torch.equal(k_codes, bufs["v_buffer"][0].view(torch.uint8)):
            raise EngineError("sglang CPUFP8KVCacheMethod stored different codes for the same K and V input")
        return KVCache(k_codes.reshape(shape).contiguous(), s.reshape(()), fmt, "tensor")

    def _kv_unsupported(self, key: str):
        raise Unsupported(self.capabilities().get(key, f"sglang: no {key}"))

    def kv_attention(self, *args, **kwargs):
        self._kv_unsupported("kv.attention")

    def kv_calibrate(self, *args, **kwargs):
        self._kv_unsupported("kv.calibrate")

    def kv_update_scales(self, *args, **kwargs):
        self._kv_unsupported("kv.update_scales")

    def kv_forward(self, *args, **kwargs):
        self._kv_unsupported("kv.update_scales")


def raw_vs_faithful(seed: int = 0) -> dict[str, Any]:  # pragma: no cover - evidence script (needs sglang)
    """Run the group quant and the e4m3fn cast with the interpreter's raw conversions and with the workaround;
    count disagreements with the oracle under the declared presets."""
    import numpy as np
    from fp8rl.reference.formats import encode
    from fp8rl.reference.quant import quantize

    ns = _mods()
    rng = np.random.default_rng(seed)
    x = torch.from_numpy((rng.standard_normal((64, 512)) * np.exp2(rng.uniform(-8, 8, (64, 1)))).astype(np.float32))
    ref = quantize(x, Granularity.group(GROUP), get_policy("sglang_triton_group"))
    sweep = torch.tensor([0.0, 1.0625, 1.1875, 17.0, 19.0, 31.6, 464.0, 500.0, 1e6, float("inf"), -float("inf"),
                          float("nan"), 2.0**-10, 3 * 2.0**-10], dtype=torch.float32)
    # block GEMM with bf16 output: A = the group quant of x[:16], W 256x512 128x128 blocks (oracle-quantized)
    xa = x[:16].contiguous()
    wt = torch.from_numpy((rng.standard_normal((256, 512)) * 0.05).astype(np.float32))
    qa_ref = quantize(xa, Granularity.group(GROUP), get_policy("sglang_triton_group"))
    qw_ref = quantize(wt, Granularity.block(BLOCK), get_policy("reference"))
    qa, sa, qw, sw = qa_ref.codes, qa_ref.scale, qw_ref.codes, qw_ref.scale
    with _triton_interp.conversions("faithful"), device_name_shim(ns):
        y32 = ns.gemm.w8a8_block_fp8_matmul_triton(qa.view(torch.float8_e4m3fn), qw.view(torch.float8_e4m3fn), sa,
                                                    sw, [BLOCK, GROUP], output_dtype=torch.float32)
    y_ref = y32.to(torch.bfloat16)  # the same fp32 accumulator, rounded to nearest even by torch
    out: dict[str, Any] = {}
    for mode in ("raw", "faithful"):
        with _triton_interp.conversions(mode):
            q, s = ns.qk.per_token_group_quant_fp8(x, GROUP)
            c, _ = ns.qk.static_quant_fp8(sweep.reshape(1, -1), torch.ones(1))
        with _triton_interp.conversions(mode), device_name_shim(ns):
            y = ns.gemm.w8a8_block_fp8_matmul_triton(_codes(qa).view(torch.float8_e4m3fn), _codes(qw).view(
                torch.float8_e4m3fn), sa, sw, [BLOCK, GROUP], output_dtype=torch.bfloat16)
        codes = _codes(q)
        out[mode] = {
            "gemm_bf16_differ": int((y.view(torch.int16) != y_ref.view(torch.int16)).sum()), "gemm_total": y.numel(),
            "group_scales_equal": bool(torch.equal(s, ref.scale)),
            "group_codes_differ": int((codes != ref.codes).sum()), "group_codes_total": codes.numel(),
            "cast_sweep_codes": _codes(c).flatten().tolist(),
        }
    out["cast_sweep_oracle"] = encode(sweep, "e4m3fn", "saturate").tolist()
    out["cast_sweep_inputs"] = sweep.tolist()
    return out


__all__ = ["DEVICE_NAME", "DEVICE_NAME_NOTE", "GROUP", "TORCHVISION_NOTE", "INSTALL_HINT", "POLICIES", "SglangEngine", "device_name_shim", "raw_vs_faithful",
           "sglang_reason"]


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(raw_vs_faithful(), indent=1))
