"""A DeepSpeed version given as a git source: ``--deepspeed git:LOCATION@REF`` parsed, and the
commits it names once ``build.sources`` resolved them (a cell carries them: stock from one commit,
patched from the same or, in PR mode, from the head commit)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from dsmatrix.infra.cache import safe_name
from dsmatrix.infra.errors import ConfigError, UnknownVersionError

PREFIX = "git:"
URL_SCHEMES = ("https", "http", "ssh", "git", "file")
_SCP_LIKE = re.compile(r"^[\w.-]+@(?P<host>[\w.-]+):")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_REMOTE_HELPER = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*::")
# git-check-ref-format(1), rule 4, 5 and 10: control characters, space, ~ ^ : ? * [ and backslash
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


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


def ref_problem(ref: str) -> str | None:
    """What makes ``ref`` unusable, by git-check-ref-format(1) (one-level names allowed, as for a
    branch, tag or commit given on the command line), and never an option or a refspec; None if fine."""
    if not ref:
        return "it is empty"
    if ref.startswith("-"):
        return "it starts with '-'"
    if ":" in ref:
        return "':' would make it a refspec"
    if _REF_FORBIDDEN.search(ref):
        return "it holds a space, a control character or one of ~ ^ ? * [ \\"
    if ref == "@" or "@{" in ref or ".." in ref:
        return "'@', '@{' and '..' are not allowed"
    if ref.startswith("/") or ref.endswith(("/", ".")) or "//" in ref:
        return "it starts or ends with '/', ends with '.' or holds '//'"
    if any(part.startswith(".") or part.endswith(".lock") for part in ref.split("/")):
        return "a part starts with '.' or ends with '.lock'"
    return None


def check_ref(ref: str, where: str) -> str:
    """``ref`` unchanged, or a one-line ConfigError naming ``where`` and why git would refuse it."""
    problem = ref_problem(ref)
    if problem:
        raise ConfigError(f"{where}: {ref!r} is not a git ref: {problem}")
    return ref


def _check_location(location: str, value: str, where: str) -> None:
    """A URL of a known scheme whose host is not an option, an scp-like ``user@host:path``, or a path."""
    if location.startswith("-") or _CONTROL.search(location):
        raise ConfigError(f"{where}: {value!r}: a repository location cannot start with '-' or hold control characters")
    scp = _SCP_LIKE.match(location)
    if _REMOTE_HELPER.match(location):  # git's <transport>::<address> runs a helper program (ext:: runs any command)
        raise ConfigError(f"{where}: {value!r}: a <transport>::<address> location runs a git remote helper: not accepted")
    if "://" in location:
        url = urlsplit(location)
        if url.scheme not in URL_SCHEMES or any((part or "").startswith("-") for part in (url.hostname, url.username)):
            schemes = ", ".join(f"{s}://" for s in URL_SCHEMES)
            raise ConfigError(f"{where}: {value!r}: a repository URL is {schemes} with a host not starting with '-'")
    elif scp and scp.group("host").startswith("-"):
        raise ConfigError(f"{where}: {value!r}: a repository host cannot start with '-'")


def split_spec(value: str, where: str) -> tuple[str, str]:
    """``git:LOCATION@REF`` as (location, ref); the ref is what follows the last ``@`` past the
    location's own user part (``ssh://git@host/x``, ``git@host:org/repo`` have no ref). A local
    location becomes an absolute path. Both are checked (``check_ref``: ``@a:b`` is a ref with a
    refspec colon; a location is never an option): a one-line ConfigError."""
    rest = value[len(PREFIX) :]
    location, ref = rest, ""
    if "://" in rest:
        path_start = rest.find("/", rest.index("://") + 3)
        user_part = len(rest) if path_start == -1 else path_start
    else:
        scp = _SCP_LIKE.match(rest)
        user_part = scp.end() if scp else 0
    at = rest.rfind("@", user_part)
    if at > 0:
        location, ref = rest[:at], rest[at + 1 :]
        if not ref:
            raise ConfigError(f"{where}: {value!r}: nothing after '@' (git:URL_OR_PATH@REF)")
    if not location or location.startswith("@"):
        raise ConfigError(f"{where}: {value!r}: say which repository (git:URL_OR_PATH@REF)")
    _check_location(location, value, where)
    if ref:
        check_ref(ref, f"{where} {value!r}")
    if "://" not in location and not _SCP_LIKE.match(location):
        path = Path(location).expanduser()
        if not path.exists():
            raise UnknownVersionError(f"{where}: {value!r}: {location} does not exist")
        location = str(path.resolve())
    return location, ref
