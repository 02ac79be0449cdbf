"""The project's own documents stay findable: docs/README.md indexes every document, and every ``docs/<file>.md``
(optionally ``§N``) that the code, tests, vendor files and README cite names a document that exists and a section
heading it has (docs/README.md, "Citing these documents from code")."""

from __future__ import annotations

import re
from pathlib import Path

from support import REPO_ROOT

DOCS = REPO_ROOT / "docs"
THIS = Path(__file__).resolve()  # its own examples of bad citations are not citations
#: where fp8rl cites its own documents (the documents themselves also cite upstream repositories' ``docs/*.md``)
CITING = ("suite", "reference", "conformance", "perf", "reports", "fixtures", "tests")
CITATION = re.compile(r"(?<![\w/.-])docs/([a-z0-9-]+\.md)(?: §(\d+(?:\.\d+)*))?")


def _citing_files():
    for top in CITING:
        for path in (REPO_ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".xfails", ".skips", ".toml", ".md", ".json"} and \
                    path.resolve() != THIS:
                yield path
    yield from (REPO_ROOT / "README.md", REPO_ROOT / "noxfile.py", REPO_ROOT / "pyproject.toml")


def _sections(doc: str) -> set[str]:
    return set(re.findall(r"^#+ §(\d+(?:\.\d+)*)\b", (DOCS / doc).read_text(encoding="utf-8"), flags=re.M))


def test_docs_index_lists_every_document_exact():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"^\| \[([a-z0-9-]+\.md)\]\(\1\) \|", index, flags=re.M))
    present = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert linked == present, f"not indexed: {sorted(present - linked)}; indexed but missing: {sorted(linked - present)}"


def test_citations_name_existing_documents_and_sections_exact():
    present = {p.name for p in DOCS.glob("*.md")}
    sections = {doc: _sections(doc) for doc in present}
    bad = []
    for path in _citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(text):
            doc, sec = m.group(1), m.group(2)
            where = f"{path.relative_to(REPO_ROOT)}: {m.group(0)}"
            if doc not in present:
                bad.append(f"{where} (no such document)")
            elif sec is not None and sec not in sections[doc]:
                bad.append(f"{where} (no heading '§{sec}' in docs/{doc})")
    assert not bad, "\n".join(bad)


def test_citation_pattern_sees_a_stale_reference():
    """The scan is not vacuous: the pattern finds a citation and its section, and skips an upstream repository's
    path such as veRL's ``docs/advance/fp8.md``."""
    hits = [(m.group(1), m.group(2)) for m in CITATION.finditer(
        "see docs/engine-numerics.md §2.2 and docs/nope.md; veRL docs/advance/fp8.md, NeMo-RL ../docs/fp8.md")]
    assert hits == [("engine-numerics.md", "2.2"), ("nope.md", None)]
    assert "2.2" in _sections("engine-numerics.md")


def test_docs_do_not_restate_the_check_catalogue_exact():
    """The check catalogue has one source, the checks (``fp8rl checks [--area A] [--json]``): no document holds a
    table of check ids with what each checks (a findings table, one row per vendor deviation, is not a catalogue)."""
    import re

    from fp8rl.checks import all_checks

    ids = set(all_checks())
    restated = []
    for doc in sorted((REPO_ROOT / "docs").glob("*.md")):
        rows = [m.group(1) for m in re.finditer(r"^\| `?([A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+)`? \|", doc.read_text(), re.M)]
        listed = [r for r in rows if r in ids]
        if len(set(listed)) >= 3 and re.search(r"^\| id \| what", doc.read_text(), re.M):
            restated.append(f"{doc.name}: {sorted(set(listed))}")
    assert not restated, f"documents restating check catalogues (use `fp8rl checks --area A`): {restated}"
