"""The check naming rule: a check's test function says how it is judged — ``*_exact`` (bit-exact or an exact
property), ``*_bound`` (within a derived bound of the tolerance table), ``*_stat`` (a statistical test or a budget
measured with a stated false-alarm rate) — and the suffix agrees with the bounds the check declares."""

from __future__ import annotations

from fp8rl.checks import all_checks

SUFFIXES = ("_exact", "_bound", "_stat")


def test_every_check_function_names_its_comparison_exact():
    bad = sorted(f"{s.id}: {s.module}.{s.function}" for s in all_checks().values()
                 if not s.function.endswith(SUFFIXES))
    assert not bad, f"check functions not named *_exact / *_bound / *_stat: {bad}"


def test_suffix_agrees_with_declared_bounds_exact():
    """``*_exact`` checks are judged (at least in part) exactly; ``*_bound`` checks have a bound besides ``exact``."""
    bad = []
    for s in all_checks().values():
        if s.function.endswith("_exact") and "exact" not in s.bounds:
            bad.append(f"{s.id} {s.function}: bounds {s.bounds} has no 'exact'")
        if s.function.endswith("_bound") and set(s.bounds) <= {"exact"}:
            bad.append(f"{s.id} {s.function}: judged exactly, name it *_exact")
    assert not bad, bad
