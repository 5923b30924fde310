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
from dataclasses import dataclass
from pathlib import Path

from dsmatrix.infra.cache import Cache, lock_for, materialise, safe_name
from dsmatrix.infra.errors import ConfigError, UnknownVersionError

PREFIX = "git:"


@dataclass(frozen=True, order=True)
class GitCommit:
    """One commit of a DeepSpeed repository, as asked for (location and ref) and as resolved."""

    location: str
    ref: str
    commit: str
    version: str  # the commit's version.txt

    @property
    def short(self) -> str:
        return self.commit[:10]

    @property
    def spec(self) -> str:
        return f"{PREFIX}{self.location}@{self.ref}"

    @property
    def by_commit(self) -> bool:
        """Whether the ref is (a prefix of) the commit itself."""
        return len(self.ref) >= 7 and self.commit.startswith(self.ref.lower())

    @property
    def tag(self) -> str:
        """Filesystem-safe: ``<ref>.<short commit>`` (``refs/pull/1/head`` becomes ``refs_pull_1_head``);
        just the short commit when the ref is the commit."""
        return self.short if self.by_commit else f"{safe_name(self.ref).strip('_') or 'ref'}.{self.short}"

    @property
    def named(self) -> str:
        """For labels: ``master@edaa722126``, or ``edaa722126`` when the ref is the commit."""
        return self.short if self.by_commit else f"{self.ref}@{self.short}"

    @property
    def key(self) -> str:
        """What its builds are cached by: the commit."""
        return f"git-{self.commit}"

    def as_dict(self) -> dict[str, str]:
        return {"location": self.location, "ref": self.ref, "commit": self.commit, "version": self.version}


@dataclass(frozen=True, order=True)
class GitSource:
    """A cell's DeepSpeed from git: ``base`` builds stock; ``head`` (PR mode) builds patched with no diff applied."""

    base: GitCommit
    head: GitCommit | None = None

    @property
    def pr(self) -> bool:
        return self.head is not None

    @property
    def tag(self) -> str:
        """Cell-id part: ``git.<ref>.<commit>`` or ``pr.<base ref>.<commit>..<head ref>.<commit>``."""
        return f"pr.{self.base.tag}..{self.head.tag}" if self.head else f"git.{self.base.tag}"

    @property
    def describe(self) -> str:
        """For labels: ``git master@edaa722126`` or ``pr master@edaa722126..fix@1a2b3c4d5e``."""
        if self.head:
            return f"pr {self.base.named}..{self.head.named}"
        return f"git {self.base.named}"

    def commit_for(self, build: str) -> GitCommit:
        """The commit a build comes from: the head for PR mode's patched build, else the base."""
        return self.head if build == "patched" and self.head else self.base

    def as_dict(self) -> dict[str, object]:
        data: dict[str, object] = {"base": self.base.as_dict()}
        if self.head:
            data["head"] = self.head.as_dict()
        return data


def is_git(value: str) -> bool:
    return value.startswith(PREFIX)


def split_spec(value: str, where: str) -> tuple[str, str]:
    """``git:LOCATION@REF`` as (location, ref); the ref is what follows the last ``@`` unless that
    contains ``:`` (``git@host:org/repo`` has no ref). A local location becomes an absolute path."""
    rest = value[len(PREFIX) :]
    location, ref = rest, ""
    if "@" in rest:
        head, tail = rest.rsplit("@", 1)
        if tail and ":" not in tail and head:
            location, ref = head, tail
    if not location or location.startswith("@"):
        raise ConfigError(f"{where}: {value!r}: say which repository (git:URL_OR_PATH@REF)")
    if "://" not in location and not re.match(r"^[\w.-]+@[\w.-]+:", location):
        path = Path(location).expanduser()
        if not path.exists():
            raise UnknownVersionError(f"{where}: {value!r}: {location} does not exist")
        location = str(path.resolve())
    return location, ref


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
            _git(["init", "--quiet", "--bare", str(repo)])
        proc = _git(["fetch", "--quiet", "--force", "--prune", location, "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"], repo)
        if proc.returncode != 0:
            raise UnknownVersionError(f"git:{location}: cannot fetch: {_last_line(proc)}")
        head = _git(["ls-remote", "--symref", location, "HEAD"], repo)
        target = re.search(r"^ref: (refs/heads/\S+)\s+HEAD", head.stdout, re.MULTILINE)
        if target:
            _git(["symbolic-ref", "HEAD", target.group(1)], repo)
    return repo


def resolve(value: str, cache: Cache, where: str, ref: str | None = None) -> GitCommit:
    """Resolve ``git:LOCATION@REF`` (or LOCATION at ``ref``) to a commit with a ``version.txt``."""
    location, own_ref = split_spec(value, where)
    ref = ref or own_ref or "HEAD"
    repo = mirror(location, cache)
    commit = _rev_parse(repo, ref)
    if commit is None:  # a ref outside heads and tags (refs/pull/N/head) or a commit no branch holds
        with lock_for(repo):
            fetched = _git(["fetch", "--quiet", location, ref], repo)
            commit = _rev_parse(repo, "FETCH_HEAD") if fetched.returncode == 0 else None
            if commit is not None:
                _git(["update-ref", f"refs/dsmatrix/{commit}", commit], repo)  # keep it from gc
    if commit is None:
        raise UnknownVersionError(f"{where}: git:{location}@{ref}: no such branch, tag, ref or commit")
    shown = _git(["show", f"{commit}:version.txt"], repo)
    if shown.returncode != 0 or not shown.stdout.strip():
        raise UnknownVersionError(f"{where}: git:{location}@{ref} ({commit[:10]}) is not a DeepSpeed source: no version.txt")
    return GitCommit(location, ref, commit, shown.stdout.strip())


def _rev_parse(repo: Path, ref: str) -> str | None:
    proc = _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], repo)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def source_tarball(commit: GitCommit, cache: Cache) -> Path:
    """The commit's tree as ``deepspeed-git-<commit>.tar.gz`` (one top folder), exported once."""
    name = f"deepspeed-{commit.key}.tar.gz"

    def export(staging: Path) -> None:
        repo = cache.git(commit.location)
        if _rev_parse(repo, commit.commit) is None:  # a cache emptied since the ref was resolved
            repo = mirror(commit.location, cache)
        proc = _git(["archive", "--format=tar.gz", f"--prefix=deepspeed-{commit.short}/", "-o", str(staging / name), commit.commit], repo)
        if proc.returncode != 0:
            raise UnknownVersionError(f"{commit.spec} ({commit.short}): git archive failed: {_last_line(proc)}")

    folder = materialise(cache.sdist(commit.key), lambda entry: (entry / name).is_file(), export)
    return folder / name


def changed_diff(source: GitSource, cache: Cache) -> str:
    """PR mode's change: ``git diff base head`` (unified, no renames folded, binary files marked)."""
    if source.head is None:
        raise ConfigError("changed_diff needs a PR-mode source")
    repo = cache.git(source.base.location)
    proc = _git(["diff", "--no-color", "--no-renames", "--no-ext-diff", source.base.commit, source.head.commit], repo)
    if proc.returncode != 0:
        raise UnknownVersionError(f"{source.base.spec}: git diff {source.base.short} {source.head.short} failed: {_last_line(proc)}")
    return proc.stdout
