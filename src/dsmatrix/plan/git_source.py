"""A DeepSpeed version given as a git source: ``--deepspeed git:LOCATION@REF`` parsed, and the
commits it names once ``build.sources`` resolved them (a cell carries them: stock from one commit,
patched from the same or, in PR mode, from the head commit)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dsmatrix.infra.cache import safe_name
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
