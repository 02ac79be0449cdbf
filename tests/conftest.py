"""Test-suite configuration: hypothesis profiles (``FP8RL_HYPOTHESIS_PROFILE``; ``ci`` when ``CI`` is set)."""

from fp8rl.strategies import load_profile_from_env

HYPOTHESIS_PROFILE = load_profile_from_env()
