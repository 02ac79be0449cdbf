"""OpenRLHF (``openrlhf==0.11.2``) as a rollout-correction engine: registered so that ``fp8rl engines`` says why it
does not run on CPU.

OpenRLHF's train/rollout mismatch correction lives in ``openrlhf.models.loss.PolicyLoss`` (options
``--algo.advantage.is_correction_level`` off/token/seq, ``_mode`` mask/clip, ``_gating`` ratio/binary_kl/tv,
``_threshold`` LOW HIGH or HIGH; docs/rl-frameworks-correction.md §4 describes its conventions from the 0.11.2
source). The module cannot be imported without CUDA: the package ``openrlhf.models`` imports ``.actor`` →
``.ring_attn_utils`` → ``flash_attn`` (OpenRLHF requires flash-attn==2.8.3, published as a source distribution whose
build needs nvcc; there is no wheel, and ``import flash_attn`` loads its compiled ``flash_attn_2_cuda`` extension) and
``.utils`` imports ``deepspeed``. The adapter does not stub them, so every capability carries that reason; where the
module does import (a CUDA machine with OpenRLHF installed) it still reports the reason: the adapter has no code path
that was not verified here.
"""

from __future__ import annotations

import importlib.util

from fp8rl.engine import CapabilityMap, Engine

OPENRLHF_VERSION = "0.11.2"
REASON = (f"not run on CPU: openrlhf=={OPENRLHF_VERSION}'s PolicyLoss (openrlhf.models.loss) is importable only "
          "through the package openrlhf.models, which imports flash_attn (flash-attn==2.8.3: a CUDA-only source "
          "build, no wheel) and deepspeed; see docs/rl-frameworks-correction.md §4 for its conventions")


class OpenRlhfEngine(Engine):
    """Placeholder that names why OpenRLHF's correction is not run (no op is implemented)."""

    name = "openrlhf"
    description = "OpenRLHF (openrlhf==0.11.2) PolicyLoss IS correction — not run on CPU (flash_attn/deepspeed imports)"

    def version(self) -> str:
        if importlib.util.find_spec("openrlhf") is None:
            return "openrlhf not installed"
        from importlib.metadata import version

        return f"openrlhf {version('openrlhf')} (not run)"

    def capabilities(self) -> CapabilityMap:
        return dict.fromkeys(("rollout_correction", "rollout_correction.geometric", "rollout_correction.veto",
                              "rollout_correction.loss"), REASON)


__all__ = ["OPENRLHF_VERSION", "OpenRlhfEngine", "REASON"]
