"""SkyRL (``skyrl==0.4.0``) as a rollout-correction engine: registered so that ``fp8rl engines`` says why it does
not run here.

SkyRL's off-policy correction is a set of pure tensor functions,
``skyrl.backends.skyrl_train.utils.off_policy_correction_utils.compute_off_policy_correction`` (token/sequence TIS,
geometric/product sequence masks, outlier-token and token masks; docs/rl-frameworks-correction.md §5 describes its
conventions from the 0.4.0 source). skyrl 0.4.0 declares ``Requires-Python >=3.12,<3.15`` and does not import on the
suite's CPython 3.11: ``skyrl.backends`` imports ``skyrl.backends.backend`` → ``skyrl.tinker.types``, whose pydantic
models use ``typing.TypedDict``, which pydantic rejects on Python < 3.12 ("Please use typing_extensions.TypedDict").
The suite's environments are locked for CPython 3.11 because the CPU torch build it pins (2.13.0+cpu) is not on PyPI
for 3.12 (PyPI's Linux torch wheels are the CUDA builds), so no CPU tier can hold it.
"""

from __future__ import annotations

import importlib.util
import sys

from fp8rl.engine import CapabilityMap, Engine

SKYRL_VERSION = "0.4.0"
REASON = (f"not run: skyrl=={SKYRL_VERSION} requires Python >=3.12 (this is {sys.version_info.major}."
          f"{sys.version_info.minor}) and on 3.11 its skyrl.backends import fails in skyrl.tinker.types (pydantic "
          "rejects typing.TypedDict before 3.12); the suite's CPU torch (2.13.0+cpu) is locked for CPython 3.11 only. "
          "See docs/rl-frameworks-correction.md §5 for its conventions")


class SkyrlEngine(Engine):
    """Placeholder that names why SkyRL's correction is not run (no op is implemented)."""

    name = "skyrl"
    description = "SkyRL (skyrl==0.4.0) off-policy correction — not run (Python >= 3.12 only)"

    def version(self) -> str:
        if importlib.util.find_spec("skyrl") is None:
            return "skyrl not installed"
        from importlib.metadata import version

        return f"skyrl {version('skyrl')} (not run)"

    def capabilities(self) -> CapabilityMap:
        return dict.fromkeys(("rollout_correction", "rollout_correction.geometric", "rollout_correction.veto",
                              "rollout_correction.loss"), REASON)


__all__ = ["REASON", "SKYRL_VERSION", "SkyrlEngine"]
