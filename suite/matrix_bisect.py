"""Bisection over a version list: which cells of a version matrix to run, and where each finding changes.

A *finding* is a check case whose outcome is bad (``failed`` or ``xfailed``) in at least one cell that ran. Each
cell's outcome of a finding is classed as ``bad``, ``good`` (``passed``) or *uninformative* (not applicable,
crashed, timed out, not installable, absent, not run).

**The monotonicity assumption.** Over the version list (oldest first), a finding's class changes at most once:
either it is present from the oldest version up to a fix (bad…bad good…good), or it appears at some version and
stays (good…good bad…bad), or it never changes. Under it, one cell at each end and a binary search between two
cells of different class find the version where it changes in at most ``ceil(log2(n - 1))`` further cells for
``n`` versions. The boundary where a cell (or a finding's case) stops giving an outcome — releases that don't
install with the tier's pins, an API the adapter calls that older releases lack — is bisected the same way. The assumption is *checked* on the cells that ran: a finding whose ran cells change class more
than once is flagged ``monotone: false`` (and each change among the ran cells is still bisected to adjacent
versions, so the transitions reported are exact for the cells that ran). A finding that is bad only strictly
inside the range (good at both ends) is seen only if a cell bisecting another finding lands on it: run the full
matrix (``fp8rl matrix --all``) to rule that out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

BAD = frozenset({"failed", "xfailed"})
GOOD = frozenset({"passed"})


def classify(outcome: str | None) -> str | None:
    """``"bad"``, ``"good"`` or None (uninformative) for a finding's outcome in one cell."""
    if outcome in BAD:
        return "bad"
    if outcome in GOOD:
        return "good"
    return None


#: a ran cell, as bisection sees it: whether the cell itself ran (False: not installable, crashed, timed out) and
#: the outcome of each case it ran
@dataclass(frozen=True)
class Observed:
    ran: bool
    outcomes: Mapping[str, str] = field(default_factory=dict)


def findings_of(observed: Mapping[int, Observed]) -> list[str]:
    """Every case that is bad in some cell that ran, in first-seen order (cells by index)."""
    seen: dict[str, None] = {}
    for i in sorted(observed):
        for key, outcome in observed[i].outcomes.items():
            if classify(outcome) == "bad":
                seen.setdefault(key, None)
    return list(seen)


def _informative(key: str, observed: Mapping[int, Observed]) -> list[tuple[int, str]]:
    out = []
    for i in sorted(observed):
        cls = classify(observed[i].outcomes.get(key)) if observed[i].ran else None
        if cls is not None:
            out.append((i, cls))
    return out


def next_cells(n: int, observed: Mapping[int, Observed]) -> list[int]:
    """The indices (of ``n`` versions) to run next, given the cells that ran so far; [] when bisection is done.

    First the oldest and newest version. Then every boundary is bisected: between two consecutive run cells where
    one could run and the other not (not installable, crashed, timed out), and, for every finding, between two
    consecutive run cells whose classes differ (bad, good, or no outcome: a crash of that case, not applicable,
    absent), the middle one of the unrun versions between them. (No cell could run at all: the middle unrun one.)"""
    if n < 1:
        raise ValueError(f"n: expected at least one version, got {n}")
    if not observed:
        return sorted({0, n - 1})
    unrun = [i for i in range(n) if i not in observed]
    cells = sorted(observed)
    want: set[int] = set()

    def bisect(seq: list[tuple[int, object]]) -> None:
        for (i, a), (j, b) in zip(seq, seq[1:]):
            if a != b:
                between = [k for k in unrun if i < k < j]
                if between:
                    want.add(between[len(between) // 2])

    bisect([(i, observed[i].ran) for i in cells])
    if unrun and not any(observed[i].ran for i in cells):
        want.add(unrun[len(unrun) // 2])
    for key in findings_of(observed):
        bisect([(i, classify(observed[i].outcomes.get(key)) if observed[i].ran else None) for i in cells])
    return sorted(want)


@dataclass(frozen=True)
class Transition:
    """The finding's class changes between versions ``after`` (the last cell of the old class) and ``at`` (the
    first of the new); ``exact``: every version between them ran (an uninformative cell between them leaves the
    change somewhere in (after, at])."""

    kind: str  # "introduced" (good -> bad) or "fixed" (bad -> good)
    after: int
    at: int
    exact: bool


@dataclass(frozen=True)
class Bisected:
    key: str
    transitions: tuple[Transition, ...]
    #: bad at the oldest informative cell (present from there on, up to the first fix)
    bad_at_start: bool
    #: bad at the newest informative cell (not fixed in the range)
    bad_at_end: bool
    monotone: bool
    informative: tuple[int, ...]

    def first_bad(self) -> int | None:
        """Index of the first bad version, None if bad at the oldest informative cell (it may be older)."""
        intro = [t for t in self.transitions if t.kind == "introduced"]
        return None if self.bad_at_start or not intro else intro[0].at

    def first_fixed(self) -> int | None:
        """Index of the first version that no longer has it (the first bad -> good change), None if none."""
        fixed = [t for t in self.transitions if t.kind == "fixed"]
        return fixed[0].at if fixed else None


def bisected(key: str, observed: Mapping[int, Observed]) -> Bisected:
    seq = _informative(key, observed)
    trans = []
    for (i, a), (j, b) in zip(seq, seq[1:]):
        if a != b:
            exact = all(k in observed for k in range(i + 1, j))
            trans.append(Transition("introduced" if b == "bad" else "fixed", i, j, exact))
    return Bisected(key, tuple(trans), bool(seq) and seq[0][1] == "bad", bool(seq) and seq[-1][1] == "bad",
                    len(trans) <= 1, tuple(i for i, _ in seq))


def run_bisection(n: int, run: Callable[[list[int]], Mapping[int, Observed]], *,
                  start: Iterable[int] = ()) -> dict[int, Observed]:
    """Run rounds of :func:`next_cells` until none is left: ``run(indices)`` runs one round (in parallel, as the
    caller likes) and returns each index's :class:`Observed`. ``start``: indices to run in the first round as
    well (``fp8rl matrix --all`` passes every index)."""
    observed: dict[int, Observed] = {}
    todo = sorted(set(start) | set(next_cells(n, observed)))
    while todo:
        got = run(todo)
        missing = set(todo) - set(got)
        if missing:
            raise RuntimeError(f"run: returned no result for cells {sorted(missing)}")
        observed.update({i: got[i] for i in todo})
        todo = next_cells(n, observed)
    return observed


__all__ = ["BAD", "GOOD", "Bisected", "Observed", "Transition", "bisected", "classify", "findings_of", "next_cells",
           "run_bisection"]
