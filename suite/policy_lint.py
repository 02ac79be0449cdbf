"""Policy lint: is a declared :class:`~fp8rl.reference.policy.ScalePolicy` / :class:`~fp8rl.reference.kv.KVPolicy`
sound in the dtypes it computes in? Run at engine load (:func:`lint_engine`).

An engine declares the numerics it implements and the checks demand bit-exact agreement with the oracle *under the
declared policy*. That cannot catch a declaration whose guard does not exist in the dtype the engine computes in: a
vendor quantizer computed s = max(amax/448, 1e-12) in the input dtype; in fp16 1e-12 rounds to 0, so an all-zero
block got scale 0 and NaN codes and a block of 1e-6 got scale 0 and every code 448. Declared as
``ScalePolicy(floor="scale", eps=1e-12, compute_dtype="input")`` the oracle reproduced the NaNs and the exact checks
passed. The lint finds such declarations.

Outcome (:class:`PolicyLint`):

* ``errors``: the engine must not load. A floor the declarer meant as a guard (``floor != "none"`` and ``eps > 0``)
  that vanishes or overflows in a compute dtype (:func:`lint_scale_policy`, :func:`lint_kv_policy`).
* ``deviations``: accepted, listed in the report under "declared deviations from single rounding": a policy that
  rounds the quotient twice (``compute_dtype="input"``), with the extra error it allows (:func:`double_rounding_bound`).
* ``warnings``: accepted, listed: guard failures the suite accepts as declared (an amax floor under an input-dtype
  compute dtype, see :func:`lint_scale_policy` for why).

Compute dtypes (:func:`compute_dtypes`): fp32 always; bf16 and fp16 too when ``compute_dtype`` is ``"input"`` or
``"scale_input"`` (a bf16/fp16 input rounds every scale step, R_d below, to its own dtype). R_d(v): v rounded to
fp32, then round-to-nearest-even to d (the oracle's R). fp16 has 11 significand bits and range [2^-24, 65504]: every
v ≤ 2^-25 rounds to 0 (2^-25 itself is a tie that goes to the even 0); bf16 has fp32's range (8 significand bits).

Everything is a small pure function; the consequences quoted in messages (the scale and codes of an all-zero group
and of a group of the dtype's smallest positive value) are computed by the oracle itself
(:func:`fp8rl.reference.quant.quantize`, :func:`fp8rl.reference.kv.quantize_kv`), so a message states what the
declared engine does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from fp8rl.reference.formats import decode_codes, get_format
from fp8rl.reference.kv import KV_FORMATS, LAYOUTS, KVPolicy, quantize_kv
from fp8rl.reference.policy import ScalePolicy
from fp8rl.reference.presets import get_policy
from fp8rl.reference.quant import Granularity, quantize

__all__ = ["DTYPES", "SIGNIFICAND_BITS", "PolicyLint", "compute_dtypes", "double_rounding_bound",
           "double_rounding_deviation", "lint_engine", "lint_kv_policy", "lint_scale_policy", "round_to"]

#: compute dtype name → torch dtype
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: significand bits p (implicit bit included): a normal v rounds with |R(v) − v| ≤ 2^-p·|v|
SIGNIFICAND_BITS: dict[str, int] = {"fp32": 24, "bf16": 8, "fp16": 11}

_NARROW = ("bf16", "fp16")
_KV_FMTS = KV_FORMATS
_KV_LAYOUTS = LAYOUTS


@dataclass(frozen=True)
class PolicyLint:
    """What the lint found: ``errors`` (the engine must not load), ``deviations`` (accepted, reported under
    "declared deviations from single rounding"; dicts with keys kind, policy, field, value, dtypes, what,
    extra_error) and ``warnings`` (accepted, reported)."""

    errors: tuple[str, ...] = ()
    deviations: tuple[dict, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when nothing forbids loading the engine (no errors)."""
        return not self.errors

    def as_dict(self) -> dict[str, list]:
        """JSON form (report.json)."""
        return {"errors": list(self.errors), "deviations": [dict(d) for d in self.deviations],
                "warnings": list(self.warnings)}

    def merged(self, other: PolicyLint, prefix: str = "") -> PolicyLint:
        """This lint plus ``other``'s (its errors and warnings prefixed with ``prefix``), identical entries once."""
        return PolicyLint(_unique(self.errors + tuple(prefix + e for e in other.errors)),
                          _unique(self.deviations + other.deviations),
                          _unique(self.warnings + tuple(prefix + w for w in other.warnings)))


def _unique(items: tuple) -> tuple:
    out: list = []
    for it in items:
        if it not in out:
            out.append(it)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# helpers


def round_to(v: float, dtype: str) -> float:
    """R_d(v): v rounded to fp32, then to nearest even in ``dtype`` ("fp32", "bf16", "fp16"), as a Python float."""
    t = torch.tensor(float(v), dtype=torch.float64).to(torch.float32)
    return float(t.to(DTYPES[dtype]).to(torch.float64).item())


def compute_dtypes(policy: ScalePolicy) -> tuple[str, ...]:
    """The dtypes the scale arithmetic of ``policy`` can run in: ("fp32",) for ``compute_dtype="fp32"``; ("fp32",
    "bf16", "fp16") for ``"input"`` and ``"scale_input"`` (an fp32 input computes in fp32 under every policy)."""
    return ("fp32",) if policy.compute_dtype == "fp32" else ("fp32", *_NARROW)


def _num(v: float) -> str:
    """Integers below 10^6 as they are (448, 65504), else 3 significant digits without exponent padding (5.96e-8)."""
    if not math.isfinite(v):
        return str(v)
    if float(v).is_integer() and abs(v) < 1e6:
        return str(int(v))
    s = f"{v:.3g}"
    if "e" in s:
        mant, exp = s.split("e")
        s = f"{mant}e{int(exp)}"
    return s


def _pow2(k: int) -> str:
    return f"2^{k} ({_num(2.0 ** k)})"


def _smallest_positive(dtype: str) -> float:
    """The dtype's smallest positive (subnormal) value: 2^-149 fp32, 2^-133 bf16, 2^-24 fp16."""
    return float(torch.finfo(DTYPES[dtype]).smallest_normal) * float(torch.finfo(DTYPES[dtype]).eps)


def _max_finite(dtype: str) -> float:
    return float(torch.finfo(DTYPES[dtype]).max)


def _where(policy: ScalePolicy, dtype: str) -> str:
    return f"{dtype} (compute_dtype={policy.compute_dtype!r})" if dtype != "fp32" else "fp32"


# ---------------------------------------------------------------------------------------------------------------
# scale policies


@dataclass(frozen=True)
class _Group:
    """The oracle's outcome for one group: its scale and whether its codes hold NaN / inf / the clamp value ±T."""

    amax: float
    scale: float
    nan: bool
    inf: bool
    at_max: bool


def _outcome(policy: ScalePolicy, dtype: str, value: float) -> _Group:
    """quantize([[value, -value]] in ``dtype``) under ``policy`` (one tensor-wide group) by the oracle."""
    x = torch.tensor([[value, -value]], dtype=torch.float64).to(DTYPES[dtype])
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        q = quantize(x, Granularity.tensor(), policy)
    vals = decode_codes(q.codes.numpy(), policy.fmt)
    return _Group(abs(float(x[0, 0])), float(q.scale.item()), bool(np.isnan(vals).any()),
                  bool(np.isinf(vals).any()), bool((np.abs(vals) == policy.max_value).any()))


def _guard_outcomes(policy: ScalePolicy, dtype: str) -> tuple[_Group, _Group]:
    """(all-zero group, group of the dtype's smallest positive value): the groups where the floor acts."""
    return _outcome(policy, dtype, 0.0), _outcome(policy, dtype, _smallest_positive(dtype))


def _guard_fails(zero: _Group, tiny: _Group) -> bool:
    """The floor does not guard: a group gets scale 0, or the all-zero group gets NaN/inf codes (0·inf, 0/0)."""
    return zero.scale == 0 or tiny.scale == 0 or zero.nan or zero.inf or not math.isfinite(zero.scale)


def _cause(policy: ScalePolicy, dtype: str, zero: _Group, tiny: _Group) -> str:
    """Which value of the declared pipeline vanishes or overflows in ``dtype`` (formulas in
    :func:`lint_scale_policy`)."""
    eps, t, where = policy.eps, policy.max_value, _where(policy, dtype)
    e = round_to(eps, dtype)
    if e == 0:
        return f"eps={eps:g} rounds to 0 in {where}"
    if policy.floor == "scale" and policy.quant_op == "mul_max_over_amax" and policy.pow2 == "none":
        return (f"floor='scale' (eps={eps:g}) does not reach the multiplier m = T/amax of "
                "quant_op='mul_max_over_amax': m = T/0 = inf for an all-zero group")
    s_min = tiny.scale if policy.floor == "scale" else min(zero.scale, tiny.scale)
    if s_min == 0:
        return f"eps={eps:g} gives the smallest scale R(eps/T) = R({eps:g}/{t:g}) = 0 in {where}"
    big = _max_finite(dtype)
    if policy.quant_op == "mul_recip":
        return (f"eps={eps:g} gives the smallest scale s_min = {_num(s_min)}, whose reciprocal 1/s_min = "
                f"{_num(1.0 / s_min)} exceeds {_num(big)}, the max finite of {where}, so R(1/s_min) = inf")
    return (f"eps={eps:g} gives the multiplier m = T/max(amax, eps) = {_num(t / e)}, beyond {_num(big)}, "
            f"the max finite of {where} (multiplier_overflow={policy.multiplier_overflow!r}), so m = inf")


def _consequence(policy: ScalePolicy, dtype: str, zero: _Group, tiny: _Group) -> str:
    parts = []
    if zero.nan or zero.inf or zero.scale == 0:
        codes = "NaN codes" if zero.nan else ("inf codes" if zero.inf else "codes 0")
        parts.append(f"an all-zero group gets scale {_num(zero.scale)} and {codes}")
    if tiny.scale == 0 or tiny.nan or tiny.inf:
        k = round(math.log2(tiny.amax))
        codes = ("NaN codes" if tiny.nan else "inf codes" if tiny.inf else
                 f"codes ±{_num(policy.max_value)}" if tiny.at_max else "wrong codes")
        parts.append(f"a group of amax 2^{k} ({_num(tiny.amax)}) gets scale {_num(tiny.scale)} and {codes}")
    return ", ".join(parts) if parts else "the floor does not keep the scale positive"


def _smallest_sound_eps(policy: ScalePolicy, dtype: str) -> int | None:
    """The least k in [-160, 0] such that eps = 2^k guards in ``dtype`` (binary search; None if none does)."""
    def ok(k: int) -> bool:
        return not _guard_fails(*_guard_outcomes(replace(policy, eps=2.0 ** k), dtype))

    lo, hi = -160, 0
    if not ok(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _guard_message(policy: ScalePolicy, dtype: str) -> str | None:
    zero, tiny = _guard_outcomes(policy, dtype)
    if not _guard_fails(zero, tiny):
        return None
    why = _cause(policy, dtype, zero, tiny)
    k = _smallest_sound_eps(policy, dtype)
    if k is None:
        fix = "no eps fixes it: declare floor='amax' or zero_amax='one' / 'nan' for what a zero amax gives"
    else:
        fix = f"use an eps >= {_pow2(k)} that is representable"
        if dtype != "fp32":
            fix += ", or compute the scale in fp32"
    return f"{why}: {_consequence(policy, dtype, zero, tiny)}; {fix}"


def double_rounding_bound(fmt: str, in_dtype: str) -> float:
    """The relative bound c = 2^-p_fp8 + 2^-p_in of double rounding: |deq − x| ≤ s·c·|x/s| (see
    :func:`double_rounding_deviation`; p_fp8 = man_bits + 1, p_in = :data:`SIGNIFICAND_BITS`)."""
    return 2.0 ** -(get_format(fmt).man_bits + 1) + 2.0 ** -SIGNIFICAND_BITS[in_dtype]


def double_rounding_deviation(policy: ScalePolicy, kind: str) -> dict | None:
    """The declared double rounding of ``compute_dtype="input"`` (None for any other compute dtype).

    Under ``"input"`` a bf16/fp16 input's quotient is rounded to the input dtype before the FP8 cast:
    c = RNE_fp8(R_in(z)), z = x/s (or x·R(1/s), x·m: the exact quotient of the declared quant op; the fp32 step
    before R_in is innocuous: an fp32 product of two ≤ 11-bit significands is exact, and a quotient rounded to fp32
    then to p_in ≤ 11 bits is correctly rounded as 24 ≥ 2·p_in + 2). Single rounding is c₁ = RNE_fp8(z).

    Derivation. Let a ≤ z ≤ b be the two FP8 neighbours of z (b − a = ulp_fp8). Every FP8 value is a bf16 and an
    fp16 value (p_fp8 < p_in, FP8's exponent range inside theirs), and R_in is monotone, so a = R_in(a) ≤ R_in(z) ≤
    R_in(b) = b: c ∈ {a, b}, a code differs from single rounding by at most 1 FP8 ulp. It differs only when R_in
    moves z across (or onto) the midpoint m = (a + b)/2, i.e. |z − m| ≤ |R_in(z) − z| ≤ ½ulp_in(z) — z within
    2^-p_in relative of an FP8 rounding midpoint. Then |c − z| = ½ulp_fp8 + |z − m| ≤ ½ulp_fp8 + ½ulp_in(z). In
    the normal ranges (2^e ≤ a ≤ |z|), ½ulp_fp8 = 2^(e − p_fp8) ≤ 2^-p_fp8·|z| and ½ulp_in(z) ≤ 2^-p_in·|z|, so

        |c − z| ≤ (2^-p_fp8 + 2^-p_in)·|z|,   i.e.   |deq − x| ≤ s·(2^-p_fp8 + 2^-p_in)·|x/s|   (quant_op "div")

    against s·2^-p_fp8·|x/s| for single rounding (p_fp8: e4m3 4, e5m2 3; p_in: bf16 8, fp16 11). In FP8's subnormal
    range replace 2^-p_fp8·|z| by half the subnormal step 2^(emin − p_fp8). The clamp at ±T is unchanged (T is
    an input-dtype value: z > T ⇒ R_in(z) ≥ T).
    """
    if policy.compute_dtype != "input":
        return None
    return _deviation(kind, policy.name, policy.fmt)


def _deviation(kind: str, name: str, fmt: str) -> dict:
    f = get_format(fmt)
    p8 = f.man_bits + 1
    bounds = "; ".join(f"{d}: |deq − x| ≤ s·(2^-{p8} + 2^-{SIGNIFICAND_BITS[d]})·|x/s| = "
                       f"{_num(double_rounding_bound(fmt, d))}·s·|x/s|" for d in _NARROW)
    extra = (f"a code may be the other FP8 neighbour of x/s, 1 {fmt} ulp from single rounding, when x/s lies "
             f"within 2^-p_in relative of an FP8 rounding midpoint; {bounds} in {fmt}'s normal range (single "
             f"rounding: s·2^-{p8}·|x/s|)")
    return {"kind": kind, "policy": name, "field": "compute_dtype", "value": "input", "dtypes": list(_NARROW),
            "what": f"x/s is rounded to bf16/fp16 before the cast to {fmt} (double rounding)", "extra_error": extra}


def lint_scale_policy(policy: ScalePolicy | str, kind: str) -> PolicyLint:
    """Lint a declared scale policy for granularity ``kind`` (a preset name is accepted too).

    Rule (errors and warnings). A floor is a declared guard when ``floor != "none"`` and ``eps > 0``; policies
    without one (``floor="none"`` with ``zero_amax`` "nan", "one*" or "scale_dtype_eps") state what a zero amax gives
    explicitly and are not linted. For each compute dtype d (:func:`compute_dtypes`) the guard must keep the scale
    positive and the reciprocal-style step finite, with R = R_d and T = ``max_value``:

    * the floor's value R(eps) ≠ 0 (fp16: eps > 2^-25; bf16: eps > 2^-134; fp32: eps > 2^-150);
    * the smallest scale s_min ≠ 0: s_min = R(max(R(amax/T), R(eps))) = R(eps) for ``floor="scale"``;
      s_min = R(R(eps)/T) (or R(R(eps)·R(1/T)), fl(1/R(T/R(eps)))) for ``floor="amax"`` — then pow2 rounding;
    * the step that multiplies: R(1/s_min) ≤ max finite of d (``quant_op="mul_recip"``), and the multiplier
      m = R(T/R(eps)) finite where ``multiplier_overflow="inf"`` keeps it (``"mul_max_over_amax"``); a scale floor
      does not reach m = T/amax at all (m = inf for an all-zero group).

    Else a zero group gets s = 0 or R(1/s) = inf and NaN codes (0/0, 0·inf), and a group below the floor s = 0 and
    codes ±T. The check is made on the oracle's own outcome for an all-zero group and a group of d's smallest
    positive value (2^-149, 2^-133, 2^-24), where the floor acts: s = 0 in either, or NaN/inf codes in the zero
    group, is a failed guard; the message names the field, its value, the dtype, what it rounds to, the
    consequence and the smallest power-of-two eps that guards.

    Errors: a failed guard in fp32 (every policy computes in fp32 for fp32 inputs), and a failed **scale** floor
    (``floor="scale"``: s = max(s, eps) declares s ≥ eps > 0) in any compute dtype. Warnings: a failed **amax** floor in
    bf16/fp16 (amax' = max(amax, eps), then s = R(amax'/T) in the input dtype). Why the split: an amax floor in the
    input dtype is the declared formula of presets checked against upstream code (in fp32 and bf16): SGLang
    ``_native_dynamic_per_token_quant_fp8`` (``sglang_native``) and vLLM ``scaled_quantize`` / ``input_to_float8``
    (``vllm_scaled_quantize``) clamp the input-dtype amax at 1e-12, which is 0 in fp16. The oracle gives them scale 0
    and NaN codes for an all-zero fp16 group, as it does the vendor's scale floor; in fp16 an amax floor guards only
    when R(eps/T) ≠ 0, i.e. eps above about T·2^-25 (1.3e-5 for T = 448), which no engine's fp32-era eps meets. The
    suite accepts these as declared, as it accepts ``floor="none"``/``zero_amax="nan"``, and lists them. A vendor
    that declares an amax floor (instead of a scale floor) in the input dtype is therefore only warned about.

    Deviations: :func:`double_rounding_deviation` (``compute_dtype="input"``).
    """
    policy = get_policy(policy)
    errors: list[str] = []
    warns: list[str] = []
    if policy.floor != "none" and policy.eps > 0:
        for dtype in compute_dtypes(policy):
            msg = _guard_message(policy, dtype)
            if msg is None:
                continue
            if dtype == "fp32" or policy.floor == "scale":
                errors.append(msg)
            else:
                warns.append(msg)
    dev = double_rounding_deviation(policy, kind)
    return PolicyLint(tuple(errors), (dev,) if dev else (), tuple(warns))


# ---------------------------------------------------------------------------------------------------------------
# KV policies


def lint_kv_policy(policy: KVPolicy, fmt: str, layout: str) -> PolicyLint:
    """Lint a declared KV-cache policy (for the ``kv_policy(fmt, layout)`` call that returned it).

    KV scales are fp32 always: the store upcasts K/V to fp32 and computes s and y = x/s or x·fl32(1/s) in fp32
    (:func:`fp8rl.reference.kv.quantize_kv`; static layouts take the given scale, no floor), so there is one compute
    dtype, fp32, and no double rounding (no deviations). Only layout ``"token_head"`` has a floor: s = max(fl32(amax /
    max), f) with f = fl32(``token_head_floor``), so s_min = f. Errors:

    * f = 0 (token_head_floor < 2^-150, about 7e-46): an all-zero (token, head) gets scale 0 and NaN codes (0/0);
    * ``quant_op="mul_recip"`` and fl32(1/f) = inf (token_head_floor below 1/FLT_MAX ≈ 2.94e-39): 0·inf = NaN codes.

    (With ``quant_op="div"`` a positive f cannot overflow: for s = f ≥ amax/max, |x/s| ≤ max.) The consequence is the
    oracle's store of an all-zero (token, head).
    """
    if not isinstance(policy, KVPolicy):
        raise TypeError(f"policy: expected a KVPolicy, got {type(policy).__name__}")
    if policy.layout != "token_head":
        return PolicyLint()
    floor = policy.token_head_floor
    f = round_to(floor, "fp32")
    x = torch.zeros(1, 1, 2)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        cache = quantize_kv(x, None, policy)
    vals = decode_codes(cache.codes.numpy(), policy.fmt)
    s0 = float(cache.scale.flatten()[0])
    if not (s0 == 0 or np.isnan(vals).any() or np.isinf(vals).any()):
        return PolicyLint()
    codes = "NaN codes" if np.isnan(vals).any() else "inf codes" if np.isinf(vals).any() else "codes 0"
    if f == 0:
        why = f"token_head_floor={floor:g} rounds to 0 in fp32"
        fix = f"use a token_head_floor >= {_pow2(-149)}"
    else:
        why = (f"token_head_floor={floor:g} (fp32 {_num(f)}) has 1/floor = {_num(1.0 / f)} beyond "
               f"{_num(_max_finite('fp32'))}, the max finite of fp32, so fl32(1/s) = inf (quant_op='mul_recip')")
        fix = f"use a token_head_floor >= {_pow2(-127)}"
    return PolicyLint((f"{why}: an all-zero (token, head) gets scale {_num(s0)} and {codes}; {fix}",))


# ---------------------------------------------------------------------------------------------------------------
# engines


def lint_engine(engine: Any, caps: Mapping[str, Any] | None = None) -> PolicyLint:
    """Lint every policy an engine declares for what it says it can do (``caps``: its capability map; None →
    ``engine.capabilities()``).

    ``scale_policy(kind)`` for each ``quantize.<kind>`` declared True; ``kv_policy(fmt, layout)`` for fmt in
    ("e4m3fn", "e5m2") × layout in ("tensor", "head", "token_head") when any ``kv.*`` capability is True. A call
    that raises :class:`fp8rl.engine.Unsupported` is skipped, and so is a result that is not a ScalePolicy /
    KVPolicy (the load check reports those); any other exception propagates. Errors and warnings are prefixed
    ``scale_policy('block') 'acme-block': `` / ``kv_policy('e4m3fn', 'token_head'): ``; identical deviations are
    listed once. ``lint_engine(e).ok`` False → the engine must not load.
    """
    from fp8rl.engine import Unsupported

    caps = engine.capabilities() if caps is None else caps
    out = PolicyLint()
    for key, status in caps.items():
        family, _, kind = key.partition(".")
        if family != "quantize" or status is not True:
            continue
        try:
            policy = engine.scale_policy(kind)
        except Unsupported:
            continue
        if isinstance(policy, ScalePolicy):
            out = out.merged(lint_scale_policy(policy, kind), f"scale_policy({kind!r}) {policy.name!r}: ")
    if any(k.startswith("kv.") and v is True for k, v in caps.items()):
        for fmt in _KV_FMTS:
            for layout in _KV_LAYOUTS:
                try:
                    kp = engine.kv_policy(fmt, layout)
                except Unsupported:
                    continue
                if isinstance(kp, KVPolicy):
                    out = out.merged(lint_kv_policy(kp, fmt, layout), f"kv_policy({fmt!r}, {layout!r}): ")
    return out
