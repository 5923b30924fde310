"""Local Python interpreters, found by version: PATH first, then pyenv's versions folder; never
downloaded. One discovery for the cells' environments and for the noxfile's driver (which imports
this module from nox's own environment: standard library only)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from dsmatrix.infra.errors import InterpreterNotFound


def _probe(exe: str) -> tuple[str, str] | None:
    """(X.Y, real executable) of the interpreter ``exe`` runs: a pyenv shim or a venv's symlink
    gives the interpreter behind it."""
    code = "import os, sys; print('%d.%d' % sys.version_info[:2]); print(os.path.realpath(sys.executable))"
    try:
        out = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split("\n")
    return (lines[0].strip(), lines[1].strip()) if out.returncode == 0 and len(lines) > 1 and lines[1].strip() else None


def find_interpreter(version: str) -> Path:
    """A local interpreter for ``version`` (PATH first, then pyenv's versions folder), as its real
    executable: environments are keyed by it, so a shim, a venv of it (setup-python's tool cache
    under act) and the interpreter itself reuse the same environments."""
    candidates: list[str] = []
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append(on_path)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += [str(p) for p in sorted((pyenv_root / "versions").glob(f"{version}.*/bin/python{version}"), reverse=True)]
    for exe in candidates:
        found = _probe(exe)
        if found and found[0] == version:
            return Path(found[1])
    raise InterpreterNotFound(
        f"Python {version}: no interpreter found (python{version} on PATH, {pyenv_root}/versions/{version}.*); "
        "install it or drop it from the matrix"
    )


def interpreter_version(interpreter: Path) -> str:
    """X.Y of ``interpreter``, as ``find_interpreter`` returned it."""
    found = _probe(str(interpreter))
    if found is None:
        raise InterpreterNotFound(f"{interpreter}: does not run")
    return found[0]


def headers_missing(interpreter: Path) -> str | None:
    """Where ``interpreter``'s C headers should be, when its ``Python.h`` is not there (None: found)."""
    code = "import os, sysconfig; p = sysconfig.get_path('include'); print(p if not os.path.isfile(os.path.join(p, 'Python.h')) else '')"
    out = subprocess.run([str(interpreter), "-c", code], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return str(interpreter)
    return out.stdout.strip() or None
