"""The oracle's definition of dynamic scaled-FP8 quantization: the plain amax → scale → cast pipeline.

:func:`quantize_plain` is what :func:`fp8rl.reference.quant.quantize` means: three small pure steps, each a direct
transcription of the :class:`~fp8rl.reference.policy.ScalePolicy` docstring and of the pipeline in the
:mod:`fp8rl.reference.quant` module docstring, on whole tensors — one torch operation per formula, no strips, no
threads, no fused numpy kernels, no lookup tables:

1. :func:`compute_amax_plain`: ``amax = max |x|`` over each group of the :class:`~fp8rl.reference.quant.Granularity`
   (pipeline step 1);
2. :func:`~fp8rl.reference.quant.scale_from_amax`: the fp32 dequant scale ``s`` from the amax — eps floor, scale op,
   power-of-two rounding, zero-amax rule, compute dtype (steps 2–6); already plain, so shared with the fast path;
3. :func:`quantize_with_scale_plain`: ``q = R(x/s)``, ``R(x·R(1/s))`` or ``R(x·m)`` (``quant_op``),
   ``clamp(q, -T, T)``, then the bit-level round-to-nearest-even cast of :mod:`fp8rl.reference.formats` (step 7).

:func:`fp8rl.reference.quant.quantize` (with its steps ``compute_amax`` and ``quantize_with_scale``) is the fast
path: the same formulas with the fp32 amax and quotients evaluated strip by strip in numpy on several threads and
the cast through the encoder's lookup table. It must equal :func:`quantize_plain` bit for bit, codes and scales, on
every input class, granularity and preset (tests/oracle/test_quant_fast_path.py). The one freedom: where both
factors of the quotient are NaN (a NaN element in a group whose reciprocal ``R(1/s)`` or multiplier ``m`` is NaN),
IEEE 754 does not say which NaN — so which sign — the product carries, and torch's CPU multiply returns the second
operand's while numpy's returns the first's; both give a NaN code.

Notation as in :mod:`fp8rl.reference.quant`: ``T`` = ``policy.max_value``, ``fl`` = fp32 rounding, ``R`` = fl then
the compute-dtype rounding (to a bf16/fp16 input's own dtype under ``compute_dtype="input"``; the identity for fp32
and for fp32 inputs). Needs only torch and numpy.
"""

from __future__ import annotations

import torch
from fp8rl.reference.formats import _encode_codes_direct, get_format
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import (
    Granularity,
    QuantizedTensor,
    _as_input,
    _compute_dtype,
    _quotient_dtype,
    _round,
    expand_scale,
    quant_multiplier_from_amax,
    scale_from_amax,
)

__all__ = ["compute_amax_plain", "quantize_plain", "quantize_with_scale_plain"]


def compute_amax_plain(x: torch.Tensor, g: Granularity) -> torch.Tensor:
    """amax = max |x| over each group of ``g``: fp32, shape ``g.scale_shape(x.shape)``.

    * ``tensor``: one max over every element;  ``token`` / ``channel``: one max per row (last dim);
    * ``group`` (1×G): one max per slice ``x[..., j:j+G]``;  ``block`` (Bm×Bn): one per tile
      ``x[i:i+Bm, j:j+Bn]``. Edge groups and tiles of non-divisible shapes hold only their real elements.

    The max of absolute values is exact (no rounding), so its order is immaterial. A NaN anywhere in a group makes
    its amax NaN (torch's max propagates NaN); |−0| = +0.
    """
    x = _as_input(x)
    shape = g.check_shape(tuple(x.shape))
    a = x.abs()
    if g.kind == "tensor":
        return a.amax().reshape(1)
    if g.kind in ("token", "channel"):
        return a.amax(dim=-1, keepdim=True)
    if g.kind == "group":
        gs = g.size[1]
        return torch.stack([a[..., j:j + gs].amax(dim=-1) for j in range(0, shape[-1], gs)], dim=-1)
    bm, bn = g.size
    return torch.stack([torch.stack([a[i:i + bm, j:j + bn].amax() for j in range(0, shape[1], bn)])
                        for i in range(0, shape[0], bm)])


def quantize_with_scale_plain(x: torch.Tensor, scale: torch.Tensor, g: Granularity,
                              policy: ScalePolicy | str = "reference", *,
                              amax: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes of ``x`` for the fp32 dequant ``scale`` (shape ``g.scale_shape(x.shape)``), elementwise with the
    scale of the element's group (:func:`~fp8rl.reference.quant.expand_scale`):

    * quotient by ``quant_op``: ``q = R(x/s)`` ("div"), ``q = R(x·R(1/s))`` ("mul_recip") or ``q = R(x·m)``
      ("mul_max_over_amax"; m = :func:`~fp8rl.reference.quant.quant_multiplier_from_amax` of ``amax``, computed
      from x by :func:`compute_amax_plain` when not given). R rounds to x's own dtype under
      ``compute_dtype="input"``; under ``"scale_input"`` only R(1/s) and m are (q is fl32); otherwise R = fl;
    * ``q = clamp(q, -T, T)`` if ``policy.clamp`` (NaN stays NaN);
    * codes = the round-to-nearest-even cast of q to ``policy.fmt`` with ``policy.overflow``, by the bit-level
      encoder of :func:`~fp8rl.reference.formats.encode_codes` (integer arithmetic on the fp32 bits; not its
      lookup table, which is an optimisation of it).
    """
    policy = get_policy(policy)
    in_dtype = x.dtype if isinstance(x, torch.Tensor) else None
    x = _as_input(x)
    shape = g.check_shape(tuple(x.shape))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"scale: expected a torch.float32 tensor, got {got}")
    rd = _compute_dtype(policy, in_dtype)  # R of the scale side: R(1/s), m
    rq = _quotient_dtype(policy, in_dtype)  # R of the quotient q
    if policy.quant_op == "div":
        q = _round(x / expand_scale(scale.cpu(), g, shape), rq)
    elif policy.quant_op == "mul_recip":
        recip = _round(torch.tensor(1.0, dtype=torch.float32) / scale.cpu(), rd)
        q = _round(x * expand_scale(recip, g, shape), rq)
    else:
        if amax is None:
            amax = compute_amax_plain(x, g)
        m = quant_multiplier_from_amax(amax, policy, input_dtype=in_dtype)
        q = _round(x * expand_scale(m, g, shape), rq)
    if policy.clamp:
        q = torch.clamp(q, -policy.max_value, policy.max_value)
    codes = _encode_codes_direct(q.contiguous().numpy(), get_format(policy.fmt), policy.overflow, "nearest_ties_up")
    return torch.from_numpy(codes).reshape(shape)


def quantize_plain(x: torch.Tensor, granularity: Granularity, policy: ScalePolicy | str = "reference"
                   ) -> QuantizedTensor:
    """Dynamic quantization as the oracle defines it: amax → scale → codes.

    ``amax = compute_amax_plain(x, g)``; ``s = scale_from_amax(amax, policy, input_dtype=x.dtype)``;
    ``codes = quantize_with_scale_plain(x, s, g, policy, amax=amax)``. ``x``: fp32, bf16 or fp16 (upcast to fp32
    exactly; its dtype is the input dtype of ``compute_dtype="input"`` and ``multiplier_overflow="input_max"``).
    :func:`fp8rl.reference.quant.quantize` returns the same codes and scale bit for bit, faster.
    """
    if not isinstance(granularity, Granularity):
        raise TypeError(f"granularity: expected a Granularity, got {type(granularity).__name__}")
    policy = get_policy(policy)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    amax = compute_amax_plain(x, granularity)
    scale = scale_from_amax(amax, policy, input_dtype=x.dtype)
    codes = quantize_with_scale_plain(x, scale, granularity, policy, amax=amax)
    return QuantizedTensor(codes, scale.contiguous(), granularity, policy)
