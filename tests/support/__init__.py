"""Helpers shared by the suite's own tests (not shipped)."""

from pathlib import Path

#: the repository root (tests/support/__init__.py → ../..)
REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_vendor_xfails_valid(path: Path, min_reason: int) -> None:
    """A vendor xfails file (conformance/vendors/<engine>.xfails) has entries, each naming a registered check id
    (every area's checks; the part before any ``[case]``) with a reason of at least ``min_reason`` characters."""
    from fp8rl.checks import all_checks
    from fp8rl.vendor_files import entry_applies, parse_id_file

    entries = parse_id_file(path)
    assert entries, f"{path.name} has no entries"
    checks = all_checks()
    for prefix, reason in entries:
        assert prefix.split("[")[0] in checks, f"{path.name}: stale xfail entry {prefix!r} (no such check)"
        entry_applies(reason, f"{path.name}: {prefix}")  # a [when ...] condition must be a known one
        assert len(reason) >= min_reason, f"{path.name}: {prefix}: the reason must state the finding with its numbers"
