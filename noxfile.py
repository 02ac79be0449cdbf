"""nox sessions (the source of truth for how to test; tox.ini mirrors `tests`).

    nox -s tests        fast CPU tier (the suite's own tests, hypothesis profile ci)
    nox -s conformance  the main job: fp8rl conformance on the torch engine, report in ./fp8rl-report
    nox -s mutants      mutation testing of the checks
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
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    _install(session, "test,lint")
    session.run("mypy", "reference", "suite/tolerances.py", "suite/engine.py")
