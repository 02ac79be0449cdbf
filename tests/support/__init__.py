"""Helpers shared by the suite's own tests (not shipped)."""

from pathlib import Path

#: the repository root (tests/support/__init__.py → ../..)
REPO_ROOT = Path(__file__).resolve().parents[2]
