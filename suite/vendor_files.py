"""Vendor files: a vendor's known deviations (``<engine>.xfails``) and skips (``<engine>.skips``), one check-id
prefix a line with its ``# reason``, read by the pytest plugin, the checkpoint matrix and the tests.

An entry names a check id (``QUANT-EXACT-001``), a case (``QUANT-EXACT-001[block]``, or a prefix of one) or a node
id; its reason may start with a condition, ``[when cpu:amx]`` or ``[when not cpu:amx]`` (:data:`ENTRY_CONDITIONS`),
so that one file gives the same verdict on machines where a finding shows and where it does not. The files fp8rl
ships live in ``conformance/vendors/`` (:func:`packaged_vendor_file`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest


def _cpu_amx() -> bool:
    from fp8rl.environment import cpu_features

    return "amx" in cpu_features()


#: conditions a vendor-file entry may be scoped to: its reason starts with ``[when NAME]`` or ``[when not NAME]``.
#: An engine whose behaviour depends on the machine (vLLM's CPU kernels pick AMX code paths where the CPU has AMX
#: tiles) records each finding on the machines where it shows, so one file gives the same verdict on every machine.
ENTRY_CONDITIONS: dict[str, Any] = {"cpu:amx": _cpu_amx}
_WHEN = re.compile(r"^\[when (not )?([\w:.-]+)\]")


def entry_applies(reason: str, where: str = "entry") -> bool:
    """Whether a vendor-file entry applies on this machine: True unless its reason starts with a ``[when ...]``
    condition that does not hold (:data:`ENTRY_CONDITIONS`); an unknown condition is a usage error."""
    m = _WHEN.match(reason)
    if m is None:
        return True
    name = m.group(2)
    if name not in ENTRY_CONDITIONS:
        raise pytest.UsageError(f"fp8rl: {where}: unknown condition {name!r} in '[when ...]'; known: "
                                f"{sorted(ENTRY_CONDITIONS)}")
    return bool(ENTRY_CONDITIONS[name]()) != bool(m.group(1))


def parse_id_file(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Parse a vendor file: one check-id prefix per line, then ``# reason``. Blank/comment lines are ignored.

    A line without a reason is an error: every xfail/skip must say why.
    """
    entries = []
    p = Path(path)
    if not p.is_file():
        raise pytest.UsageError(f"fp8rl: id file {str(p)!r} does not exist")
    for lineno, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        prefix, sep, reason = line.partition("#")
        prefix, reason = prefix.strip(), reason.strip()
        if not sep or not reason:
            raise pytest.UsageError(f"fp8rl: {p}:{lineno}: entry {prefix!r} has no '# reason'")
        entries.append((prefix, reason))
    return entries


def matches(prefix: str, check_id: str, nodeid: str, case: str) -> bool:
    """Whether an entry ``prefix`` names a check case: its id, its node id, or ``ID[case]``, each by prefix."""
    return check_id.startswith(prefix) or nodeid.startswith(prefix) or f"{check_id}[{case}]".startswith(prefix)


def entry_is_stale(prefix: str, nodeids: Iterable[str], known_ids: Iterable[str], run_ids: set[str]) -> bool:
    """Whether a vendor-file entry that matched nothing is stale: it names no check of the suite (``known_ids``), or
    its check ran in this run (``run_ids``) and none of its cases matched. An entry for a check this run did not
    select (``--area``, ``-k``) is not: a vendor file covers every area while CI runs them in parts. A node-id entry
    is stale only if nothing of its file was collected (``nodeids``)."""
    if "::" in prefix or "/" in prefix:
        return not any(n.startswith(prefix.split("::")[0]) for n in nodeids)
    named = {cid for cid in known_ids if cid.startswith(prefix) or prefix.startswith(f"{cid}[")}
    return not named or bool(named & run_ids)


def packaged_vendor_file(engine: str, kind: str) -> Path | None:
    """The packaged vendor file ``conformance/vendors/<engine>.<kind>`` (kind: xfails|skips), if any."""
    safe = engine.replace(":", "_")
    try:
        p = resources.files("fp8rl.conformance").joinpath("vendors", f"{safe}.{kind}")
    except ModuleNotFoundError:
        return None
    return Path(str(p)) if p.is_file() else None


__all__ = ["ENTRY_CONDITIONS", "entry_applies", "entry_is_stale", "matches", "packaged_vendor_file",
           "parse_id_file"]
