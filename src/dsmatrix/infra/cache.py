"""The shared cache (``~/.cache/dsmatrix`` or ``DSMATRIX_CACHE``): its layout, and how entries appear.

Several runs may use one cache at once (two terminals, two nox sessions, a runner with several
jobs). Every entry (an sdist, a wheel folder, an environment, a stock test result) is built in a
temporary sibling under a lock of its own and renamed into place when complete: a reader sees a
whole entry or none, and an entry is never deleted or replaced while it exists, because its path
names everything it was built from. Temporary siblings a killed run left are removed by the next
one to hold the entry's lock. A torch-extensions folder is used under its lock for a whole test
run, so a torch ``lock`` file found in it then belongs to nobody and is cleared.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from dsmatrix.infra.processes import stop_orphans, track_in


def default_root() -> Path:
    return Path(os.environ.get("DSMATRIX_CACHE", Path.home() / ".cache" / "dsmatrix"))


def digest(data: object, length: int = 12) -> str:
    """A short stable hash of JSON-able ``data`` (what an entry's path is keyed by)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:length]


def safe_name(text: str) -> str:
    """``text`` with every run of characters a file name should not hold replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def extensions_folder(environment: Path) -> Path:
    """``TORCH_EXTENSIONS_DIR`` of one environment: inside it, so that the ninja files torch writes
    for DeepSpeed's JIT-built ops (the comm op, the Adam ops) name the environment's headers and
    sources by the same relative paths in every environment, and ccache (``CCACHE_BASEDIR`` the
    environment) compiles each op once for all environments with the same torch and op sources.
    A folder shared by two environments would be rebuilt whenever they alternate (measured: 60 s
    each time), since the compile commands name each environment's absolute paths."""
    return environment / "torch-extensions"


def lock_for(entry: Path) -> FileLock:
    """The lock of one entry: ``<entry>.lock`` beside it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{entry}.lock")


def _staging_prefix(entry: Path) -> str:
    return f".{entry.name}.partial-"


def materialise(entry: Path, complete: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """``entry`` once ``complete(entry)``: else ``build(staging)`` in a temporary sibling, renamed into place.

    Under the entry's lock. An entry that exists but is not complete (a cache written by an older
    suite) is moved aside before it is replaced, never deleted in place."""
    with lock_for(entry):
        if complete(entry):
            return entry
        for stale in entry.parent.glob(_staging_prefix(entry) + "*"):  # a killed builder's leftovers: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = entry.parent / f"{_staging_prefix(entry)}{secrets.token_hex(4)}"
        staging.mkdir()
        try:
            build(staging)
            if entry.exists():
                aside = entry.parent / f"{_staging_prefix(entry)}old-{secrets.token_hex(4)}"
                os.replace(entry, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.replace(staging, entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return entry


TORCH_LOCK = "lock"  # torch.utils.file_baton's file in each extension's build folder


@dataclass(frozen=True)
class Cache:
    """The paths of everything the suite caches, below ``root``."""

    root: Path

    def sdist(self, deepspeed: str) -> Path:
        return self.root / "sdists" / f"deepspeed-{deepspeed}"

    def git(self, location: str) -> Path:
        """The bare mirror of one git repository (URL or path)."""
        name = safe_name(location.rstrip("/").rsplit("/", 1)[-1])[:40]
        return self.root / "git" / f"{name}-{digest(location)}.git"

    def builder(self, python: str, torch: str, request: object) -> Path:
        """The wheel-building environment for (Python, torch)."""
        return self.root / "builders" / f"py{python}-torch{torch}-{digest(request)}"

    def builders(self, python: str, torch: str) -> list[Path]:
        """Every wheel-building environment of (Python, torch), whatever its request."""
        return sorted((self.root / "builders").glob(f"py{python}-torch{torch}-*"))

    def has_builder(self, python: str, torch: str) -> bool:
        """Whether a builder for (Python, torch) exists: that torch set is then in uv's cache."""
        return any((b / "bin" / "python").exists() for b in self.builders(python, torch))

    def wheel(self, deepspeed: str, python: str, torch: str, build_key: str) -> Path:
        """The folder holding one DeepSpeed wheel and its ``build.json``."""
        return self.root / "wheels" / f"deepspeed-{deepspeed}" / f"py{python}-torch{torch}" / build_key

    def environment(self, cell_id: str, build_key: str, request: object) -> Path:
        """A cell's environment for one build, keyed by everything it is created from."""
        return self.root / "envs" / cell_id / f"{build_key}-{digest(request)}"

    def environments(self, cell_id: str) -> Path:
        """Every environment of one cell (each build, each request)."""
        return self.root / "envs" / cell_id

    def uv_set(self, name: str) -> Path:
        """The uv cache of one torch set in low-disk mode."""
        return self.root / "uv-sets" / name

    def git_changes(self) -> Path:
        """The diffs of pull requests' changes (PR mode)."""
        return self.root / "git" / "changes"

    def stock_results(self, cell_id: str, key: object) -> Path:
        return self.root / "stock-results" / cell_id / digest(key, 16)

    def images(self, name: str | None = None) -> Path:
        """Image build work (``images/``), or one image's cache volume (``images/<name>``)."""
        return self.root / "images" / name if name else self.root / "images"

    def in_image(self, name: str) -> Cache:
        """The cache a container of image ``name`` uses (inside its volume)."""
        return Cache(self.images(name) / "dsmatrix")

    @property
    def docker(self) -> Path:
        return self.root / "docker"

    @property
    def processes(self) -> Path:
        return self.root / "processes"

    def open(self) -> list[dict[str, object]]:
        """Start using the cache: write this run's process groups into it, stop the ones runs
        killed earlier left behind (returned). ccache, where installed, keeps its compiler cache
        here too (``CCACHE_DIR``, unless set already)."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("CCACHE_DIR", str(self.root / "ccache"))
        stopped = stop_orphans(self.processes)
        track_in(self.processes)
        return stopped

    @contextlib.contextmanager
    def using_extensions(self, folders: Sequence[Path]) -> Iterator[None]:
        """Hold the locks of ``folders`` (torch-extensions folders) while their builds run; any torch
        lock file in them is then stale (its owner was killed) and is cleared."""
        with contextlib.ExitStack() as stack:
            for folder in sorted(set(folders)):
                stack.enter_context(lock_for(folder))
                folder.mkdir(parents=True, exist_ok=True)
                for stale in folder.glob(f"*/{TORCH_LOCK}"):
                    stale.unlink(missing_ok=True)
            yield
