"""Test-suite configuration: hypothesis profiles (``FP8RL_HYPOTHESIS_PROFILE``; ``ci`` when ``CI`` is set) and the
``upstream_pin`` mark (tests/support/upstream.py), written into each pinned test's JUnit properties."""

import pytest
from fp8rl.strategies import load_profile_from_env

HYPOTHESIS_PROFILE = load_profile_from_env()
pytest_plugins = ("pytester",)  # tests of pytest marks run a pytest in a temporary directory


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "upstream_pin(package, spec, behaviour): the test pins a third-party "
                                       "package's behaviour, verified for versions in spec")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for mark in item.iter_markers("upstream_pin"):
            item.user_properties.append(("upstream_pin", f"{mark.kwargs['package']}{mark.kwargs['spec']}"))
