"""Cell environments: uv virtualenvs with one Python, one torch and one DeepSpeed build.

uv ignores pip's configuration, so the package sources pip is configured with (find-links,
index and extra index URLs, from ``pip config list`` and ``PIP_*`` variables) are read here
and handed to uv; whatever pip on the host can install, the suite can. A CPU-only torch
(``torch==X+cpu``) that those sources lack comes from PyTorch's CPU wheel index, or the one
``DSMATRIX_TORCH_CPU_INDEX`` names. Interpreters are found locally (PATH, pyenv) and never
downloaded. Files inside an environment are never edited:
uv hardlinks them from its cache, so a patched DeepSpeed is always a separately built wheel.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from dsmatrix.infra import processes
from dsmatrix.infra.cache import materialise
from dsmatrix.infra.errors import ConfigError, FatalError, InstallError, UnknownVersionError
from dsmatrix.infra.interpreters import interpreter_version

UV_ENV = {"UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"}
TORCH_CPU_INDEX = "DSMATRIX_TORCH_CPU_INDEX"  # the setting; the workflows pass their repository variable
DEFAULT_TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MARKER = "dsmatrix-env.json"


_uv_cache: contextvars.ContextVar[Path | None] = contextvars.ContextVar("uv_cache", default=None)


@contextlib.contextmanager
def uv_cache_dir(path: Path | None) -> Iterator[None]:
    """Make uv use ``path`` as its cache in this context (None: uv's default); low-disk mode gives
    each new torch set its own, removed after the set's last cell."""
    token = _uv_cache.set(path)
    try:
        yield
    finally:
        _uv_cache.reset(token)


def uv_executable() -> str:
    """The uv binary installed with this package (falls back to PATH)."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        exe = shutil.which("uv")
        if exe is None:
            raise InstallError("uv not found: install the 'uv' package (pip install uv)") from None
        return exe


def pip_config() -> dict[str, str]:
    """find-links, index-url and extra-index-url as pip on this host sees them (config, then PIP_*)."""
    config: dict[str, str] = {}
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        if m := re.match(r"^([^=]+)='(.*)'$", line.strip()):
            key = m.group(1).split(".", 1)[-1]
            config.setdefault(key, m.group(2))  # the first scope pip prints wins, as in pip
    for key in ("find-links", "index-url", "extra-index-url"):
        env_value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env_value:
            config[key] = env_value
    return {key: config[key] for key in ("find-links", "index-url", "extra-index-url") if config.get(key)}


def pip_sources() -> list[str]:
    """uv arguments for the package sources pip is configured with on this host."""
    config = pip_config()
    args: list[str] = []
    for link in config.get("find-links", "").split():
        args += ["--find-links", link]
    if config.get("index-url"):
        args += ["--default-index", config["index-url"].split()[0]]
    for url in config.get("extra-index-url", "").split():
        args += ["--index", url]
    return args


def run_uv(
    args: Sequence[str], what: str, timeout: float = 1800, stdin: str | None = None, error: type[FatalError] = InstallError
) -> subprocess.CompletedProcess[str]:
    """Run uv; a failure raises ``error`` carrying what uv said about the problem, on one line."""
    env = {**os.environ, **UV_ENV}
    if (cache := _uv_cache.get()) is not None:
        env["UV_CACHE_DIR"] = str(cache)
    try:
        proc = processes.run([uv_executable(), *args], input=stdin, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise error(f"{what}: uv timed out after {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise error(f"{what}: {uv_error(proc.stderr)}")
    return proc


def uv_error(stderr: str) -> str:
    """The informative part of uv's error output, on one line."""
    lines = [ln.strip(" ×╰─▶│") for ln in stderr.splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln and not ln.startswith(("warning:", "Using ", "Resolved", "Prepared"))]
    return " ".join(lines[-3:])[-600:] if lines else "uv failed without a message"


def torch_cpu_index() -> str:
    """The CPU-only torch wheel index: ``DSMATRIX_TORCH_CPU_INDEX``, else PyTorch's."""
    url = os.environ.get(TORCH_CPU_INDEX, "").strip() or DEFAULT_TORCH_CPU_INDEX
    if urlsplit(url).scheme not in ("https", "http", "file") or any(c.isspace() for c in url):
        raise ConfigError(f"{TORCH_CPU_INDEX}: {url[:200]!r} is not one http(s):// or file:// URL")
    return url


_cpu_index_needed: dict[tuple[str, str], bool] = {}  # (torch requirement, X.Y) -> the pip sources lack it


def _cpu_torch(requirements: Sequence[str]) -> str | None:
    return next((r for r in requirements if r.startswith("torch==") and r.endswith("+cpu")), None)


def _resolve(requirement: str, python: str, sources: Sequence[str], what: str) -> None:
    run_uv(
        ["pip", "compile", "-", "--no-deps", "--quiet", "--no-header", "--python-version", python,
         "--index-strategy", "unsafe-best-match", *sources],
        what,
        timeout=300,
        stdin=requirement + "\n",
        error=UnknownVersionError,
    )  # fmt: skip


def check_installable(requirement: str, python: str) -> None:
    """Resolve ``requirement`` alone (no download of wheels); UnknownVersionError if impossible.
    A CPU-only torch the pip sources lack is looked up on the CPU index, and taken from there."""
    what = f"{requirement} for Python {python}: not installable here"
    torch = _cpu_torch([requirement])
    if torch is None:
        _resolve(requirement, python, pip_sources(), what)
        return
    try:
        _resolve(requirement, python, pip_sources(), what)
        _cpu_index_needed[torch, python] = False
        return
    except UnknownVersionError:
        index = torch_cpu_index()
    where = f"neither pip's sources nor the CPU index {index} ({TORCH_CPU_INDEX}) have it"
    _resolve(requirement, python, [*pip_sources(), f"--index={index}"], f"{what}: {where}")
    _cpu_index_needed[torch, python] = True


def package_sources(requirements: Sequence[str], interpreter: Path) -> list[str]:
    """uv's package sources for installing ``requirements`` with ``interpreter``: pip's, and the
    CPU torch index where a CPU-only torch needs it (decided once per torch and Python)."""
    torch = _cpu_torch(requirements)
    if torch is None:
        return pip_sources()
    python = interpreter_version(interpreter)
    if (torch, python) not in _cpu_index_needed:
        check_installable(torch, python)
    return [*pip_sources(), f"--index={torch_cpu_index()}"] if _cpu_index_needed[torch, python] else pip_sources()


@dataclass(frozen=True)
class Environment:
    """A ready virtualenv and what is really installed in it."""

    path: Path
    installed: dict[str, str]

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def installed_versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, platform\n"
        "names = ('torch', 'deepspeed', 'numpy', 'pytest')\n"
        "v = {n: m.version(n) for n in names if any(d.metadata['Name'].lower() == n for d in m.distributions())}\n"
        "v['python'] = platform.python_version()\n"
        "print(json.dumps(v))\n"
    )
    proc = processes.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise InstallError(f"{python}: cannot read installed versions: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def pip_freeze(python: Path) -> list[str]:
    """Every distribution installed in the environment, ``name==version``, sorted (what the report shows)."""
    code = (
        "import importlib.metadata as m\n"
        "print('\\n'.join(sorted({f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions()}, key=str.lower)))\n"
    )
    proc = processes.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise InstallError(f"{python}: cannot list installed distributions: {proc.stderr.strip()[-300:]}")
    return proc.stdout.split()


def ensure_environment(path: Path, interpreter: Path, requirements: Sequence[str], what: str) -> Environment:
    """The uv environment at ``path`` (its path names the request, see ``Cache.environment``),
    created once: in a temporary sibling, relocatable, renamed into place when installed."""
    wanted = {"interpreter": str(interpreter), "requirements": list(requirements)}

    def complete(entry: Path) -> bool:
        return _recorded(entry).get("request") == wanted and (entry / "bin" / "python").exists()

    def create(staging: Path) -> None:
        run_uv(
            ["venv", "--quiet", "--relocatable", "--allow-existing", "--python", str(interpreter), str(staging)],
            f"{what}: create environment",
        )
        run_uv(
            ["pip", "install", "--quiet", "--python", str(staging / "bin" / "python"), "--compile-bytecode",
             "--index-strategy", "unsafe-best-match", *package_sources(requirements, interpreter), *requirements],
            f"{what}: install {' '.join(Path(r).name for r in requirements)}",
        )  # fmt: skip
        installed = installed_versions(staging / "bin" / "python")
        (staging / MARKER).write_text(json.dumps({"request": wanted, "installed": installed}, indent=2))

    materialise(path, complete, create)
    return Environment(path, _recorded(path)["installed"])


def _recorded(path: Path) -> dict:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
