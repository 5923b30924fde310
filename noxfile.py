"""Entry points: ``nox -s matrix``, ``nox -s tests``, ``nox -s report``, ``nox -s lint``.

Thin by design: each session installs the package and calls ``python -m dsmatrix``.
"""

import nox

nox.needs_version = ">=2024.3.2"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

DRIVER_PYTHON = "3.11"


@nox.session(python=DRIVER_PYTHON)
def matrix(session: nox.Session) -> None:
    """Run the matrix (default tier): stock vs patched DeepSpeed, a verdict per cell."""
    session.install("-e", ".")
    session.run("python", "-m", "dsmatrix", "matrix", *session.posargs)


@nox.session(python=DRIVER_PYTHON)
def report(session: nox.Session) -> None:
    """Render the release-qualification report from results/latest."""
    session.install("-e", ".")
    session.run("python", "-m", "dsmatrix", "report", *session.posargs)


@nox.session(python=DRIVER_PYTHON)
def tests(session: nox.Session) -> None:
    """The suite's own tests, including one end-to-end cell on DeepSpeed 0.19.8."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=DRIVER_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff on the package, the tests and this file."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "noxfile.py")
