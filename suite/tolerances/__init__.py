"""The one tolerance table of fp8rl.

Every bound used anywhere in the suite (conformance checks, the suite's own tests, perf gates) is defined in this
package, with its derivation. Nothing else in the code base hard-codes a tolerance: code asks this package by name
(``tolerances.get(name)``, or the names re-exported here: ``tolerances.EXACT``, ``tolerances.quant_roundtrip_bound``).

Layout: one table (``_registry.py``: :class:`Tolerance`, ``TOLERANCES``, ``_register``, :func:`get`) and one module
per area, each registering its entries when imported: ``exact`` (bit-exact comparisons; the fp64 evaluation slack of
every bound), ``quantization``, ``gemm``, ``microscaling``, ``correction``, ``kv``, ``e2e`` (weight sync, the e2e
budgets, rollout self-consistency) and ``learning``. This package imports them in that order, which is the table's
order (``fp8rl checks`` lists it).

Two kinds of entries:

* constants (``Tolerance``): a number plus the derivation of why that number;
* bound functions: a pure function of the inputs (shapes, magnitudes, formats) returning an elementwise bound,
  whose docstring is the derivation.

The formulas the oracle itself needs (unit roundoffs, γ_n, eval_slack, the GEMM error bound) live in
:mod:`fp8rl.reference.bounds` (the oracle imports nothing from the harness); this package imports them and registers
their named entries with the derivations, so it stays the one place where named bounds and derivations live.

Unit roundoff notation: for a binary floating-point format with p significand bits (implicit bit included),
u = 2^-p is the maximal relative error of round-to-nearest; fp32 p = 24, bf16 p = 8, fp16 p = 11, fp64 p = 53.
"""

from __future__ import annotations

from fp8rl.reference.bounds import (  # noqa: F401  (re-exported: tolerances.gamma, tolerances.UNIT_ROUNDOFF, ...)
    EVAL_SLACK_EXTRA_OPS,
    GEMM_PRODUCT_ROUNDINGS,
    MAX_FINITE,
    MIN_SUBNORMAL,
    UNIT_ROUNDOFF,
    eval_slack,
    gamma,
    gemm_fp32_accum_bound,
)
from fp8rl.reference.bounds import dtype_name as _dtype_name  # noqa: F401

# The registry first, then the area modules in this fixed order: it is the order of the table (TOLERANCES), so
# these imports must not be sorted.
# isort: off
from ._registry import TOLERANCES, Tolerance, _register, get  # noqa: F401
from .exact import BOUND_EVAL_SLACK, EXACT  # noqa: F401
from .quantization import (  # noqa: F401
    QUANT_ROUNDTRIP,
    QUANT_ROUNDTRIP_FP32_SLACK,
    QUANT_ROUNDTRIP_INPUT_DTYPE_SLACK,
    REQUANT_SCALE_ULPS,
    UE8M0_CEIL_LOG2_OVERSHOOT,
    quant_roundtrip_bound,
    quant_roundtrip_input_dtype_bound,
)
from .gemm import (  # noqa: F401
    FP64_GEMM_AGREEMENT,
    GEMM_FP32_ACCUM,
    GEMM_FP32_PRODUCT_ROUNDINGS,
    fp64_gemm_agreement_bound,
)
from .microscaling import (  # noqa: F401
    MX_GEMM_FP32,
    MX_GEMM_PRODUCT_ROUNDINGS,
    MX_ROUNDTRIP,
    mx_roundtrip_bound,
)
from .correction import (  # noqa: F401
    CORR_DECISION_BAND,
    CORR_ESS_RANGE,
    CORR_EXP_ULPS,
    CORR_KL_STAT_Z,
    CORR_LOSS,
    CORR_LOSS_HEADROOM,
    CORR_METRIC,
    CORR_NORM_FACTOR_FLOOR,
    CORR_PROX,
    CORR_RUN_PAIR,
    CORR_STAT,
    CORR_WEIGHT,
    corr_decision_band,
    corr_ess_max,
    corr_kl_stat_tokens,
    corr_log_weight_err,
    corr_loss_bound,
    corr_metric_bound,
    corr_metric_magnitude,
    corr_metric_magnitudes,
    corr_metric_pair_bound,
    corr_prox_bound,
    corr_rounded_threshold_max,
    corr_stat_err,
    corr_weight_pair_rel,
    corr_weight_rel_bound,
)
from .kv import (  # noqa: F401
    KV_ATTENTION_ARITH,
    KV_ATTENTION_QUANT,
    KV_ATTENTION_VS_FRESH,
    KV_DRIFT_LOGPROB_VS_FRESH,
    KV_EXP_ULPS,
    kv_attention_arith_bound,
    kv_attention_quant_bound,
)
from .e2e import (  # noqa: F401
    E2E_BUDGETS,
    E2E_BUDGETS_FILE,
    E2E_BUDGETS_FORMAT,
    E2E_MARGINS,
    E2E_MEASURED,
    E2E_MISMATCH,
    ROLLOUT_GOF,
    ROLLOUT_LOGPROB_FP32,
    ROLLOUT_LOGPROB_SLACK,
    REFIT_KV_SCALE,
    _calibration_line,
    e2e_budget,
    e2e_budget_value,
    load_e2e_budgets,
    rollout_gof_power,
    rollout_gof_threshold,
    rollout_logprob_fp32_bound,
)
from .learning import (  # noqa: F401
    LEARNING_GRAD_ARITH,
    LEARNING_SAMPLE_Z,
    LEARNING_TIS_BIAS,
    learning_arith_bound,
)
# isort: on
