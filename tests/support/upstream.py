"""Tests that pin a third-party package's behaviour say so, with the version range in which it holds.

A "known difference" test (torch's e8m0 rounding, an ml_dtypes NaN code, a vLLM finding) is a statement about one
package in one range of versions. ``pinned(package, spec, behaviour)`` marks such a test: it runs only when the
installed version is in ``spec`` and otherwise skips with the reason "re-verify", so that a lock bump lists exactly
the pins to re-check, and never fails for a behaviour upstream changed on purpose. ``holds(package, spec)`` is the
same test for a version-dependent *expectation* inside a test (the expected codes under 0.6 and under 0.7).

The pin is also written into the test's JUnit properties (``upstream_pin``), which the nightly drift report
(``nox -s upstream``) reads to list the pinned tests whose outcome changed.
"""

from __future__ import annotations

import functools
from importlib import metadata

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version


@functools.cache
def installed_version(package: str) -> str | None:
    """The installed distribution's version (None if it is not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def holds(package: str, spec: str) -> bool:
    """True iff ``package`` is installed at a version in ``spec`` (PEP 440, local labels ignored: 2.13.0+cpu is
    2.13.0)."""
    v = installed_version(package)
    return v is not None and Version(Version(v).public) in SpecifierSet(spec)


def pin_marks(package: str, spec: str, behaviour: str) -> list[pytest.MarkDecorator]:
    """The marks of a test that pins ``behaviour`` of ``package``, verified for versions in ``spec``: an
    ``upstream_pin`` mark and a skip outside ``spec`` (use as ``pytestmark = pin_marks(...)``)."""
    v = installed_version(package)
    reason = (f"pins {package}{spec} behaviour ({behaviour}); installed: {v or 'not installed'}"
              + ("" if v is None else ": re-verify the pin for this version"))
    return [pytest.mark.upstream_pin(package=package, spec=spec, behaviour=behaviour),
            pytest.mark.skipif(not holds(package, spec), reason=reason)]


def pinned(package: str, spec: str, behaviour: str):
    """Decorator form of :func:`pin_marks` for one test function or class."""

    def deco(target):
        for mark in pin_marks(package, spec, behaviour):
            target = mark(target)
        return target

    return deco
