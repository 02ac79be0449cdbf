"""The vendor guide (docs/vendor-guide.md) is executed, and the generated regions of docs/ are what fp8rl.docs_gen
makes of the code.

* The guide's adapter and ``pyproject.toml`` (its code blocks whose info string names a file, ``file=<path>``) are
  written beside the toy kernel package ``toykern`` (tests/support/toykern) into a project directory outside the
  repository; the guide's ``bash run`` block runs there, verbatim, in a fresh virtual environment (one that reuses
  this interpreter's installed packages, fp8rl included, and has ``pip`` and ``fp8rl`` on its PATH), installing the
  project with its ``fp8rl.engines`` entry point; its output must hold every line of the guide's ``text output``
  block (… matching timings) — the verdict, the scope and the exit code the guide states.
* Every generated region of docs/ equals fp8rl.docs_gen's output (``python -m fp8rl.docs_gen --write`` fixes them),
  and the generator itself refuses an undocumented field, an unknown region and a region without its end.

Supersedes test_verdict_scope.py's test of the guide's former inline example (the same claims: CONFORMANT, the scope
holds exactly the declared capabilities, each run on the engine's own code).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from fp8rl import docs_gen
from support import REPO_ROOT

GUIDE = REPO_ROOT / "docs" / "vendor-guide.md"
TOYKERN = REPO_ROOT / "tests" / "support" / "toykern"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def fenced_blocks(text: str) -> list[tuple[list[str], str]]:
    """(info-string words, body) of every fenced code block of a Markdown text."""
    return [(m.group(1).split(), m.group(2)) for m in FENCE.finditer(text)]


def guide_files(text: str) -> dict[str, str]:
    """path → body of the blocks whose info string names a file (```python file=toykern/fp8rl_engine.py)."""
    out: dict[str, str] = {}
    for words, body in fenced_blocks(text):
        for w in words[1:]:
            if w.startswith("file="):
                assert w[5:] not in out, f"two blocks write {w[5:]}"
                out[w[5:]] = body
    return out


def guide_block(text: str, lang: str, tag: str) -> str:
    found = [body for words, body in fenced_blocks(text) if words[:1] == [lang] and tag in words[1:]]
    assert len(found) == 1, f"docs/vendor-guide.md: expected one ```{lang} {tag} block, found {len(found)}"
    return found[0]


def make_venv(dest: Path) -> Path:
    """A virtual environment at ``dest`` that reuses this interpreter's installed packages (a path line to its
    site-packages, fp8rl's editable finder included), with ``pip`` and ``fp8rl`` launchers in its bin/ as pip writes
    them: installing into it never touches this environment, and nothing is reinstalled."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    base = Path(sysconfig.get_paths()["purelib"])
    py = dest / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "00-base-packages.pth").write_text(f"{base}\n")  # sorts before the finder's .pth, which imports from it
    for pth in base.glob("__editable__*fp8rl*.pth"):
        shutil.copy(pth, site / pth.name)
    for name, target in (("pip", "from pip._internal.cli.main import main"), ("fp8rl", "from fp8rl.cli import main")):
        launcher = dest / "bin" / name
        launcher.write_text(f"#!{py}\nimport sys\n{target}\nsys.exit(main())\n")
        launcher.chmod(0o755)
    return dest


def venv_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    return env


def line_patterns(expected: str) -> list[re.Pattern]:
    """Each non-empty line of an expected-output block as a pattern: literal text, … for any text."""
    return [re.compile(".*".join(re.escape(part) for part in line.rstrip().split("…")))
            for line in expected.splitlines() if line.strip()]


def missing_lines(expected: str, output: str) -> list[str]:
    """The expected lines that the output lacks, in order (each must match a whole line after the previous one)."""
    lines = [ln.rstrip() for ln in output.splitlines()]
    missing, at = [], 0
    for pat in line_patterns(expected):
        hit = next((i for i in range(at, len(lines)) if pat.fullmatch(lines[i])), None)
        if hit is None:
            missing.append(pat.pattern)
        else:
            at = hit + 1
    return missing


# ---- the guide, executed ----------------------------------------------------------------------------------------


def test_guide_worked_example_runs_to_the_verdict_it_states_exact(tmp_path):
    """§1 of the guide, as a new user follows it: the toy kernel package plus the guide's files, installed with the
    guide's commands into a fresh environment, give the guide's verdict, scope lines and exit code; the report's
    scope holds exactly the capabilities the adapter declares, each with cases on its own code and none on the
    oracle's."""
    text = GUIDE.read_text(encoding="utf-8")
    files = guide_files(text)
    assert set(files) == {"toykern/fp8rl_engine.py", "pyproject.toml"}, sorted(files)
    proj = tmp_path / "toykern-project"
    shutil.copytree(TOYKERN, proj, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    for rel, body in files.items():
        (proj / rel).write_text(body)
    venv = make_venv(tmp_path / "venv")
    run = guide_block(text, "bash", "run")
    r = subprocess.run(["bash", "-c", run], cwd=proj, env=venv_env(venv), capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Error processing line" not in r.stderr, r.stderr[-2000:]  # the environment's .pth files all loaded
    expected = guide_block(text, "text", "output")
    assert "exit code" in expected and "verdict:" in expected, "the guide's output block states no verdict"
    missing = missing_lines(expected, r.stdout)
    assert not missing, f"the guide's output lines not printed: {missing}\n--- output:\n{r.stdout[-4000:]}"
    assert re.search(r"^│ quantization +│ quantize\.group +│ available", r.stdout, re.M), r.stdout[:3000]

    report = json.loads((proj / "fp8rl-report" / "report.json").read_text())
    cmd = report["command"]
    assert cmd[cmd.index("--fp8rl-engine") + 1] == "toykern"  # loaded through the entry point the guide declares
    declared = [k for k, v in report["engine"]["capabilities"].items() if v is True]
    assert declared == ["quantize.group", "kv.store"]
    scope = report["summary"]["scope"]
    assert sorted(scope["capabilities"]) == sorted(declared)
    assert scope["oracle_cases"] == 0 and scope["untested"] == [] and scope["inherited"] == []
    assert all(c["engine"] > 0 and c["oracle"] == 0 for c in scope["capabilities"].values()), scope
    assert report["summary"]["verdict"] == "conformant"


def test_expected_output_matching_is_not_vacuous():
    """The output comparison fails on a changed verdict, a changed count or a missing line, and … spans timings."""
    expected = "verdict: CONFORMANT (0 failed; seed 0, … s)\nscope: 56 cases\nexit code 0\n"
    good = "table\nverdict: CONFORMANT (0 failed; seed 0, 9.4 s)\nscope: 56 cases\nwall\nexit code 0\n"
    assert missing_lines(expected, good) == []
    assert missing_lines(expected, good.replace("CONFORMANT", "INCOMPLETE")) != []
    assert missing_lines(expected, good.replace("56", "57")) != []
    assert missing_lines(expected, good.replace("exit code 0", "exit code 4")) != []
    assert missing_lines(expected, "exit code 0\n" + good.replace("\nexit code 0", "")) != []  # order matters


def test_guide_names_what_the_kv_ops_receive_and_return_exact():
    """The issue's gaps, closed in the guide: the KV types by name with their field tables, and kv_store's input
    classes (fp32/bf16/fp16, 3-D and batched, every layout) as the input model lists them."""
    from fp8rl.inputspace import MODEL

    text = GUIDE.read_text(encoding="utf-8")
    for name in ("KVCache", "KVPolicy", "QuantizedTensor", "Unsupported", '[project.entry-points."fp8rl.engines"]'):
        assert name in text, name
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("| `kv_store` | kv |"))
    n = len(MODEL["kv_store"].axes)
    block = [lines[first]] + [ln for ln in lines[first + 1:first + n] if ln.startswith("|  | |")]
    rows = dict(m.groups() for ln in block if (m := re.search(r"\| `([\w.]+)` \([^|]*\) \| ([^|]*) \|$", ln)))
    assert list(rows) == [a.name for a in MODEL["kv_store"].axes], rows
    assert rows["dtype.x"].strip() == "`fp32`, `bf16`, `fp16`"
    assert rows["rank.x"].strip() == "`3d+`"
    for qualname in ("fp8rl.reference.kv.KVPolicy", "fp8rl.reference.kv.KVCache", "fp8rl.reference.policy.ScalePolicy",
                     "fp8rl.reference.microscaling.MXPolicy"):
        assert f"`{qualname}`:\n\n| field | type | default | meaning |" in text, qualname


# ---- generated regions ------------------------------------------------------------------------------------------


def test_generated_regions_match_their_generators_exact():
    problems = docs_gen.stale(REPO_ROOT)
    assert not problems, f"{problems}: run `python -m fp8rl.docs_gen --write`"


def test_formats_and_recipes_scale_policy_table_lists_every_field_exact():
    """docs/formats-and-recipes.md §3.3 has a row for every ScalePolicy field (it lacked compute_dtype)."""
    from fp8rl.reference.policy import ScalePolicy

    text = (REPO_ROOT / "docs" / "formats-and-recipes.md").read_text(encoding="utf-8")
    section = text.split("### §3.3 `ScalePolicy` fields", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert rows == [f.name for f in dataclasses.fields(ScalePolicy)]
    assert "compute_dtype" in rows and "floor_order" in rows


@dataclasses.dataclass(frozen=True)
class _Documented:
    """A toy.

    * ``alpha``: the first
      field, on two lines.
    * ``beta`` B: the second.
    """

    alpha: int
    beta: str = "b"


def test_field_docs_reads_each_bullet_and_refuses_gaps():
    assert docs_gen.field_docs(_Documented) == {"alpha": "the first field, on two lines.", "beta": "B: the second."}

    @dataclasses.dataclass
    class Undocumented:
        """* ``alpha``: documented.
        * ``gamma``: no such field."""

        alpha: int
        beta: int

    with pytest.raises(ValueError, match=r"without a meaning: \['beta'\].*naming no field: \['gamma'\]"):
        docs_gen.field_docs(Undocumented)
    with pytest.raises(TypeError, match="cls: expected a dataclass"):
        docs_gen.field_docs(int)
    table = docs_gen.fields_table(_Documented)
    assert "| `alpha` | int | required | the first field, on two lines. |" in table
    assert '| `beta` | str | `"b"` | B: the second. |' in table


def test_render_replaces_region_bodies_and_refuses_malformed_regions():
    begin, end = docs_gen.BEGIN.format(name="x"), docs_gen.END.format(name="x")
    gens = {"x": lambda: "NEW"}
    text = f"head\n{begin}\nold table\n{end}\ntail\n"
    done = docs_gen.render(text, gens)
    assert done == f"head\n{begin}\n\nNEW\n\n{end}\ntail\n"
    assert docs_gen.render(done, gens) == done
    with pytest.raises(ValueError, match="unknown generated region 'x'"):
        docs_gen.render(text, {})
    with pytest.raises(ValueError, match="region 'x' has no end marker"):
        docs_gen.render(f"{begin}\nold\n", gens)
    with pytest.raises(ValueError, match=r"\['x'\] appear more than once"):
        docs_gen.render(text + text, gens)


def test_check_and_write_commands_on_a_drifted_copy(tmp_path):
    """``--check`` names a document whose table was edited by hand (exit 1); ``--write`` restores it (exit 0)."""
    for rel in docs_gen.DOCUMENTS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / rel, tmp_path / rel)
    guide = tmp_path / "docs" / "vendor-guide.md"
    good = guide.read_text(encoding="utf-8")
    guide.write_text(good.replace("| `compute_dtype` |", "| `compute_dtype_renamed` |"), encoding="utf-8")

    def cmd(*args):
        return subprocess.run([sys.executable, "-m", "fp8rl.docs_gen", *args, "--root", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)

    r = cmd("--check")
    assert r.returncode == 1 and "docs/vendor-guide.md: differs" in r.stderr, r.stderr
    assert "formats-and-recipes" not in r.stderr
    assert cmd("--write").returncode == 0
    assert guide.read_text(encoding="utf-8") == good
    assert cmd("--check").returncode == 0
    r = subprocess.run([sys.executable, "-m", "fp8rl.docs_gen", "--check", "--root", str(tmp_path / "nowhere")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--root:" in r.stderr
