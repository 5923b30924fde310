"""Patch sets: which unified diff fits which DeepSpeed release, and applying it strictly.

A patch set is either a folder with ``manifest.toml`` (one diff per version range, the bundled
fix), a single diff file (``--patch my-revision.patch``, used for every version) or, in PR mode,
the change between two commits (``pr_change``: described, measured, never applied). Diffs are
applied with GNU patch at zero fuzz: a hunk whose context moved is an error naming the
version, file and hunk, never a silently unpatched build.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from dsmatrix.infra.errors import PatchDoesNotApply, PatchError

MANIFEST = "manifest.toml"
# a git diff's mode line for a symbolic link (120000) or a submodule (160000): GNU patch would create it
LINK_MODE = re.compile(r"^(?:new file |new |old |deleted file )?mode 1[26]0000\b", re.MULTILINE)


@dataclass(frozen=True)
class RangeDiff:
    versions: SpecifierSet
    path: Path


@dataclass(frozen=True)
class PatchSet:
    """A candidate fix: its source, identity (sha256) and version-range diffs."""

    source: Path
    sha256: str
    diffs: tuple[RangeDiff, ...]
    pr: str = ""  # "<base>..<head>" commits: a PR's change, which its head commit carries (never applied)

    @property
    def short(self) -> str:
        return self.sha256[:12]

    def diff_for(self, deepspeed: str) -> Path:
        """The diff covering ``deepspeed``; PatchError if none or several do."""
        matches = [d.path for d in self.diffs if Version(deepspeed) in d.versions]
        if len(matches) != 1:
            ranges = ", ".join(f"{d.versions} -> {d.path.name}" for d in self.diffs)
            what = "no diff covers it" if not matches else f"{len(matches)} diffs cover it"
            raise PatchError(f"DeepSpeed {deepspeed}: {what} in {self.source} ({ranges})")
        return matches[0]

    def describe(self) -> dict[str, object]:
        data: dict[str, object] = {
            "source": self.source.name,  # named by its name and sha256: no path of the machine that ran it
            "sha256": self.sha256,
            "diffs": [{"versions": str(d.versions), "file": d.path.name} for d in self.diffs],
        }
        if self.pr:
            data["pr"] = self.pr
        return data


def _digest(paths: list[Path]) -> str:
    sha = hashlib.sha256()
    for path in paths:
        sha.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return sha.hexdigest()


def load_patch_set(source: Path) -> PatchSet:
    """Load a manifest folder or a single diff file."""
    if source.is_file():
        _check_is_diff(source)
        return PatchSet(source, _digest([source]), (RangeDiff(SpecifierSet(""), source),))
    manifest = source / MANIFEST
    if not manifest.is_file():
        raise PatchError(f"{source}: neither a diff file nor a folder with {MANIFEST}")
    try:
        data = tomllib.loads(manifest.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PatchError(f"{manifest}: not valid TOML: {exc}") from None
    entries = data.get("diff")
    if not isinstance(entries, list) or not entries:
        raise PatchError(f"{manifest}: needs at least one [[diff]] with versions and file")
    diffs = []
    for i, entry in enumerate(entries):
        try:
            versions = SpecifierSet(entry["versions"])
            path = source / entry["file"]
        except (KeyError, TypeError):
            raise PatchError(f"{manifest}: diff #{i + 1} needs 'versions' and 'file'") from None
        except InvalidSpecifier:
            raise PatchError(f"{manifest}: diff #{i + 1}: bad versions {entry['versions']!r}") from None
        if not path.is_file():
            raise PatchError(f"{manifest}: diff #{i + 1}: {path.name} not found in {source}")
        _check_is_diff(path)
        diffs.append(RangeDiff(versions, path))
    return PatchSet(source, _digest([manifest, *[d.path for d in diffs]]), tuple(diffs))


def pr_change(diff: str, base: str, head: str, folder: Path) -> PatchSet:
    """A PR's change (``git diff base head``) kept as ``<folder>/pr-<base12>-<head12>.diff``."""
    if not diff.strip():
        raise PatchError(f"--base {base[:10]} --head {head[:10]}: the two commits have the same tree: nothing to qualify")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"pr-{base[:12]}-{head[:12]}.diff"
    path.write_text(diff)
    return PatchSet(path, _digest([path]), (RangeDiff(SpecifierSet(""), path),), pr=f"{base}..{head}")


def _check_is_diff(path: Path) -> None:
    text = path.read_text(errors="replace")
    if not re.search(r"^--- .*\n\+\+\+ .*\n@@ ", text, re.MULTILINE):
        raise PatchError(f"{path}: not a unified diff (no ---/+++/@@ header)")


def _patch_command() -> str:
    exe = shutil.which("patch")
    if exe is None:
        raise PatchError("GNU patch not found on PATH (Debian package 'patch')")
    return exe


def apply_diff(diff: Path, source_tree: Path, deepspeed: str) -> None:
    """Apply ``diff`` to an unpacked DeepSpeed source tree, all hunks or nothing."""
    links = LINK_MODE.findall(diff.read_text(errors="replace"))
    if links:
        made = f"it makes {len(links)} symbolic link(s) or submodule(s), which the suite never applies"
        raise PatchDoesNotApply(f"DeepSpeed {deepspeed}: {diff.name} does not apply: {made}")
    base = [_patch_command(), "-p1", "--forward", "--fuzz=0", "--batch", "--no-backup-if-mismatch", "-i", str(diff.resolve())]
    check = subprocess.run([*base, "--dry-run"], cwd=source_tree, capture_output=True, text=True)
    if check.returncode != 0:
        raise PatchDoesNotApply(f"DeepSpeed {deepspeed}: {diff.name} does not apply: {_failed_hunks(check.stdout + check.stderr)}")
    applied = subprocess.run(base, cwd=source_tree, capture_output=True, text=True)
    if applied.returncode != 0:  # the tree is a scratch copy: the caller discards it with the error
        raise PatchDoesNotApply(f"DeepSpeed {deepspeed}: {diff.name} does not apply: {_failed_hunks(applied.stdout + applied.stderr)}")


def _failed_hunks(output: str) -> str:
    """Summarise GNU patch's output as 'file: hunk #N FAILED at L, ...'."""
    current = "?"
    failures: list[str] = []
    for line in output.splitlines():
        if m := re.match(r"(?:checking|patching) file (.+)", line):
            current = m.group(1).strip("'")
        elif m := re.match(r"\|\+\+\+ (?:b/)?(\S+)", line):  # the header GNU patch quotes for a file it cannot find
            current = m.group(1)
        elif m := re.match(r"Hunk #(\d+) FAILED at (\d+)", line):
            failures.append(f"{current} hunk #{m.group(1)} FAILED at line {m.group(2)}")
        elif "No file to patch" in line:
            failures.append(f"{current}: file not found in the source tree")
        elif "Reversed (or previously applied) patch detected" in line:
            failures.append(f"{current}: already applied (reversed patch detected)")
    if failures:
        return "; ".join(failures)
    lines = output.strip().splitlines()
    return lines[-1] if lines else "patch failed"
