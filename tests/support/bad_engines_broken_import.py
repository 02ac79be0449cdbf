"""A module that is found but fails to import (a dependency is missing): engines report the error, not the hint."""

import no_such_dependency_fp8rl  # noqa: F401
