"""DeepSpeed from git: a repository (URL or local checkout) at a ref, resolved to one commit.

``--deepspeed git:LOCATION@REF`` names a git source; REF is a branch, tag, commit or any ref the
repository serves (``refs/pull/N/head``), HEAD when left out. The repository is mirrored once into
the cache (a bare clone, fetched again on every run), REF is resolved to its commit, and that
commit's tree is exported (``git archive``) as a source tarball cached by commit: the builds then
treat it like a release sdist. The commit's ``version.txt`` is the version the matrix rules and
the patch manifest see.

PR mode (``--base REF --head REF``): stock is built from the base commit, patched from the head
commit with no diff applied; the change under test is ``git diff base head``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from packaging.version import InvalidVersion, Version

from dsmatrix.infra.cache import Cache, lock_for, materialise
from dsmatrix.infra.errors import ConfigError, UnknownVersionError
from dsmatrix.plan.git_source import GitCommit, GitSource, check_ref, split_spec
from dsmatrix.plan.matrix import MAX_VERSION_LENGTH

MIRRORED = ("+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*")


def _git(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env_free = ["-c", "protocol.file.allow=always", "-c", "advice.detachedHead=false"]
    return subprocess.run(["git", *env_free, *args], cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def mirror(location: str, cache: Cache) -> Path:
    """The cache's bare mirror of ``location``, with every branch and tag fetched now."""
    repo = cache.git(location)
    with lock_for(repo):
        if not (repo / "HEAD").is_file():
            repo.mkdir(parents=True, exist_ok=True)
            _git(["init", "--quiet", "--bare", "--end-of-options", str(repo)])
        proc = _git(["fetch", "--quiet", "--force", "--prune", "--end-of-options", location, *MIRRORED], repo)
        if proc.returncode != 0:
            raise UnknownVersionError(f"git:{location}: cannot fetch: {_last_line(proc)}")
        head = _git(["ls-remote", "--symref", "--end-of-options", location, "HEAD"], repo)
        target = re.search(r"^ref: (refs/heads/\S+)\s+HEAD", head.stdout, re.MULTILINE)
        if target:
            _git(["symbolic-ref", "--end-of-options", "HEAD", target.group(1)], repo)
    return repo


def resolve(value: str, cache: Cache, where: str, ref: str | None = None) -> GitCommit:
    """Resolve ``git:LOCATION@REF`` (or LOCATION at ``ref``) to a commit with a ``version.txt``."""
    location, own_ref = split_spec(value, where)
    ref = check_ref(ref or own_ref or "HEAD", where)
    repo = mirror(location, cache)
    commit = _rev_parse(repo, ref)
    if commit is None:  # a ref outside heads and tags (refs/pull/N/head) or a commit no branch holds
        with lock_for(repo):
            fetched = _git(["fetch", "--quiet", "--end-of-options", location, ref], repo)
            commit = _rev_parse(repo, "FETCH_HEAD") if fetched.returncode == 0 else None
            if commit is not None:
                _git(["update-ref", "--end-of-options", f"refs/dsmatrix/{commit}", commit], repo)  # keep it from gc
    if commit is None:
        raise UnknownVersionError(f"{where}: git:{location}@{ref}: no such branch, tag, ref or commit")
    shown = _git(["show", "--end-of-options", f"{commit}:version.txt"], repo)
    if shown.returncode != 0 or not shown.stdout.strip():
        raise UnknownVersionError(f"{where}: git:{location}@{ref} ({commit[:10]}) is not a DeepSpeed source: no version.txt")
    return GitCommit(location, ref, commit, _deepspeed_version(shown.stdout.strip(), f"{where}: git:{location}@{ref} ({commit[:10]})"))


def _deepspeed_version(text: str, where: str) -> str:
    """A commit's ``version.txt`` as a DeepSpeed version (it names cells, caches and wheels)."""
    try:  # the length first: a 5000-digit release number is beyond int() itself
        version = Version(text) if len(text) <= MAX_VERSION_LENGTH else None
    except (InvalidVersion, ValueError):
        version = None
    if version is None or str(version) != text:
        raise UnknownVersionError(f"{where}: version.txt {text[:40]!r} is not a DeepSpeed version such as 0.19.8")
    return text


def _rev_parse(repo: Path, ref: str) -> str | None:
    proc = _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"], repo)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def source_tarball(commit: GitCommit, cache: Cache) -> Path:
    """The commit's tree as ``deepspeed-git-<commit>.tar.gz`` (one top folder), exported once."""
    name = f"deepspeed-{commit.key}.tar.gz"

    def export(staging: Path) -> None:
        repo = cache.git(commit.location)
        if _rev_parse(repo, commit.commit) is None:  # a cache emptied since the ref was resolved
            repo = mirror(commit.location, cache)
        archive = ["archive", "--format=tar.gz", f"--prefix=deepspeed-{commit.short}/", "-o", str(staging / name)]
        proc = _git([*archive, "--end-of-options", commit.commit], repo)
        if proc.returncode != 0:
            raise UnknownVersionError(f"{commit.spec} ({commit.short}): git archive failed: {_last_line(proc)}")

    folder = materialise(cache.sdist(commit.key), lambda entry: (entry / name).is_file(), export)
    return folder / name


def changed_diff(source: GitSource, cache: Cache) -> str:
    """PR mode's change: ``git diff base head`` (unified, no renames folded, binary files marked)."""
    if source.head is None:
        raise ConfigError("changed_diff needs a PR-mode source")
    repo = cache.git(source.base.location)
    proc = _git(["diff", "--no-color", "--no-renames", "--no-ext-diff", "--end-of-options", source.base.commit, source.head.commit], repo)
    if proc.returncode != 0:
        raise UnknownVersionError(f"{source.base.spec}: git diff {source.base.short} {source.head.short} failed: {_last_line(proc)}")
    return proc.stdout
