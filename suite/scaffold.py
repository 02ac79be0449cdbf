"""``fp8rl scaffold``: the skeletons of a new check and of a new engine, written into the files the project's
checklists name (docs/commands.md, "Add a check" / "Add an engine"), and nowhere else.

A check (:func:`scaffold_check`) is at most four files: the check in ``conformance/test_<area>.py`` (its spec
sentence, bound and required capabilities), a new bound in the tolerance table ``suite/tolerances/<area module>.py`` (only when it names
one the table lacks; its derivation to write), a mutant with ``kills=`` in ``suite/mutants/<area>.py``, and the vendor xfails of an
engine that deviates (written by hand when a real engine fails it). The skeletons are honest: the check raises
``NotImplementedError`` (an ``error`` outcome, never a pass) and the mutant answers like the reference engine, so
``tests/checks/test_mutants.py`` reports it survived until both are written.

An engine (:func:`scaffold_engine`) is its adapter ``suite/engines/<module>.py`` (the module named after the engine),
one line in ``suite/registry.py`` ``BUILTINS``, its vendor file ``conformance/vendors/<name>.xfails``, its pinned
test ``tests/engines/<tier>/test_<module>_engine.py``, and — with ``tier`` — its conformance run in ``noxfile.py``
``TIERS`` (a new tier also needs an extra in pyproject.toml and ``nox -s lock``; the scaffold says so).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CHECK_ID = re.compile(r"^[A-Z][A-Z0-9]*(-[A-Z0-9]+)+$")
ENGINE_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
#: test-function suffix by how a check is judged
SUFFIX = {"exact": "_exact", "bound": "_bound", "stat": "_stat"}


#: the module of the tolerance table (suite/tolerances/<module>.py) a new bound of an area goes to
TOLERANCE_MODULE = {"formats": "quantization", "weight_sync": "e2e", "checkpoint": "quantization",
                    "invariants": "quantization"}


class ScaffoldError(ValueError):
    """The scaffold can't be written (bad name, existing id, missing area file): the message says which argument."""


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def _camel(text: str) -> str:
    return "".join(p.capitalize() for p in re.split(r"[^A-Za-z0-9]+", text) if p)


def _append(path: Path, text: str) -> None:
    body = path.read_text()
    path.write_text(body.rstrip("\n") + "\n\n\n" + text.strip("\n") + "\n")


def scaffold_check(root: Path, area: str, check_id: str, *, title: str | None = None, bound: str = "exact",
                   judged: str | None = None, requires: tuple[str, ...] = (),
                   new_bound_value: float | None = None) -> list[Path]:
    """Write the skeleton of check ``check_id`` of ``area`` under the repository ``root``; returns the files touched.

    ``bound``: the tolerance-table entry it is judged with; a name the table lacks is added to the area's module of
    suite/tolerances/ with ``new_bound_value`` and a derivation to write (ScaffoldError without a value). ``judged``: exact / bound /
    stat (default: exact for the bound ``exact``, else bound) — the test function's suffix."""
    root = Path(root)
    if not CHECK_ID.match(check_id):
        raise ScaffoldError(f"check id: expected AREA-NAME-00N (upper case, dash-separated), got {check_id!r}")
    checks_file = root / "conformance" / f"test_{area}.py"
    mutants_file = root / "suite" / "mutants" / f"{area}.py"
    for f in (checks_file, mutants_file):
        if not f.is_file():
            raise ScaffoldError(f"area: no {f.relative_to(root)} (known areas: "
                                f"{sorted(p.stem[5:] for p in (root / 'conformance').glob('test_*.py'))})")
    for f in (root / "conformance").glob("test_*.py"):
        text = f.read_text()
        if f'"{check_id}"' in text or f"'{check_id}'" in text:
            raise ScaffoldError(f"check id: {check_id!r} is already declared in {f.relative_to(root)}")
    judged = judged or ("exact" if bound == "exact" else "bound")
    if judged not in SUFFIX:
        raise ScaffoldError(f"judged: expected one of {sorted(SUFFIX)}, got {judged!r}")
    touched = [checks_file]
    tol_dir = root / "suite" / "tolerances"
    known = "".join(f.read_text() for f in sorted(tol_dir.glob("*.py")))
    if f'_register(\n    "{bound}"' not in known and f'_register("{bound}"' not in known:
        if new_bound_value is None:
            raise ScaffoldError(f"bound: {bound!r} is not in the tolerance table (suite/tolerances/); give its value "
                                "(--bound-value) to add it, then write its derivation")
        tol_file = tol_dir / f"{TOLERANCE_MODULE.get(area, area)}.py"
        if not tol_file.is_file():
            tol_file = tol_dir / "quantization.py"
        const = _slug(bound).upper()
        _append(tol_file, f'{const} = _register(\n    "{bound}", {new_bound_value!r},\n'
                          f'    "TODO {check_id}: derive this bound (what it bounds, from which error terms)",\n)')
        touched.append(tol_file)
    fn = f"test_{_slug(check_id)}{SUFFIX[judged]}"
    req = ", ".join(json.dumps(r) for r in requires)
    spec = json.dumps(title or "TODO: one sentence of spec: what must hold, for which inputs.", ensure_ascii=False)
    _append(checks_file, f'''@check("{check_id}", {spec},
       bound="{bound}", requires=[{req}])
def {fn}(engine, rng):
    raise NotImplementedError("{check_id} is a scaffold: write the check (inputs, the engine call, the comparison "
                              "with the oracle under the bound)")''')
    mname = _slug(check_id).replace("_", "-") + "-bug"
    _append(mutants_file, f'''@mutant("{mname}", "TODO: the realistic bug {check_id} must catch", kills=("{check_id}",))
class {_camel(check_id)}Bug(ReferenceEngine):
    """TODO: override the op {check_id} calls with the bug (until then this mutant answers like the reference and
    survives: tests/checks/test_mutants.py says so)."""''')
    touched.append(mutants_file)
    return touched


def scaffold_engine(root: Path, name: str, *, tier: str | None = None) -> list[Path]:
    """Write the skeleton of engine ``name`` under the repository ``root``; returns the files touched."""
    root = Path(root)
    if not ENGINE_NAME.match(name):
        raise ScaffoldError(f"engine name: expected lower-case words joined by '-', got {name!r}")
    module = name.replace("-", "_")
    cls = _camel(name) + "Engine"
    adapter = root / "suite" / "engines" / f"{module}.py"
    registry = root / "suite" / "registry.py"
    vendor = root / "conformance" / "vendors" / f"{name}.xfails"
    test = root / "tests" / "engines" / (tier or "base") / f"test_{module}_engine.py"
    for f in (adapter, vendor, test):
        if f.exists():
            raise ScaffoldError(f"engine name: {f.relative_to(root)} already exists")
    reg = registry.read_text()
    if f'    "{name}": ' in reg:
        raise ScaffoldError(f"engine name: {name!r} is already in suite/registry.py BUILTINS")
    adapter.write_text(f'''"""Engine ``{name}``: TODO: what upstream code it runs (package, version, functions), and what it stands in for."""

from __future__ import annotations

from fp8rl.engine import CapabilityMap, Engine


class {cls}(Engine):
    """TODO: the vendor functions each op calls (cite file and function)."""

    name = "{name}"
    description = "TODO: one line for fp8rl engines"

    def version(self) -> str:
        return "TODO: the upstream package's version"

    def capabilities(self) -> CapabilityMap:
        # declare only what this engine's own code does (keys: fp8rl.capabilities); each unavailable one with its
        # reason. A declared capability none of whose cases runs this code makes the verdict INCOMPLETE.
        return {{}}
''')
    start = reg.index("BUILTINS: dict[str, str] = {")
    end = reg.index("\n}", start)
    registry.write_text(reg[:end] + f'\n    "{name}": "fp8rl.engines.{module}:{cls}",' + reg[end:])
    vendor.write_text(f"# {name} vs the fp8rl spec: one finding a line, `CHECK-ID[case]  # reason` with its numbers and the\n"
                      "# upstream function responsible. The oracle is not bent to match.\n")
    test.parent.mkdir(parents=True, exist_ok=True)
    test.write_text(f'''"""Engine ``{name}``: the adapter's behaviour and the pinned evidence of each finding of its vendor file."""

from __future__ import annotations

from fp8rl.vendor_files import parse_id_file
from fp8rl.registry import load_engine
from support import REPO_ROOT

XFAILS = REPO_ROOT / "conformance" / "vendors" / "{name}.xfails"


def test_engine_loads_exact():
    assert load_engine("{name}").name == "{name}"


def test_vendor_xfails_file_parses_exact():
    # once it holds findings: support.assert_vendor_xfails_valid(XFAILS, min_reason=...) and a pinned test each
    parse_id_file(XFAILS)
''')
    touched = [adapter, registry, vendor, test]
    if tier is not None:
        touched.append(_add_to_tier(root, name, tier))
    return touched


def _add_to_tier(root: Path, name: str, tier: str) -> Path:
    """Add ``Conformance(name)`` to tier ``tier``'s conformance runs in noxfile.py (an existing tier)."""
    nox = root / "noxfile.py"
    text = nox.read_text()
    m = re.search(rf'Tier\("{re.escape(tier)}",.*?conformance=\(', text, re.S)
    if m is None:
        raise ScaffoldError(f"tier: no Tier({tier!r}, ...) in noxfile.py; a new tier is an extra in pyproject.toml, a "
                            "Tier entry in noxfile.py TIERS and `nox -s lock`")
    nox.write_text(text[:m.end()] + f'Conformance("{name}"),\n                      ' + text[m.end():])
    return nox


__all__ = ["ScaffoldError", "scaffold_check", "scaffold_engine"]
