"""A DeepSpeed git repository made from the master snapshot, for git-source and PR-mode runs without network.

``master`` is the snapshot as one commit; ``fix`` commits the bundled diff for 0.19.3 and later;
``never-release`` adds one line to ``fix`` that empties every release set (a harmful change). Names
and dates are fixed, so the same snapshot gives the same commits in every run: builds and stock
results, cached by commit, are shared by every run on one machine.

The snapshot: ``$DSMATRIX_DEEPSPEED_SNAPSHOT`` (a folder), else ``shared/deepspeed-src`` beside the
checkout. A GitHub runner has neither: the tests that need it are skipped there with that reason
(they run in the acceptance session, where a missing snapshot fails).
As a command: ``python tests/deepspeed_repo.py DIR`` makes the repository in DIR and prints
its path and commits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "patches" / "zero3-release-cache" / "deepspeed-0.19.3-and-later.diff"
COORDINATOR = "deepspeed/runtime/zero/partitioned_param_coordinator.py"
RELEASE_ANCHOR = "        free_data = not z3_leaf_module(submodule) or not self.fast_sharding_for_leaf_module\n"
HARMFUL = "        params_to_release = frozenset()  # harmful: never release\n"
IDENTITY = (("NAME", "dsmatrix"), ("EMAIL", "dsmatrix@example.invalid"), ("DATE", "2026-08-22T00:00:00Z"))
GIT_ENV = {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER") for what, value in IDENTITY}


def snapshot() -> Path:
    folders = [os.environ.get("DSMATRIX_DEEPSPEED_SNAPSHOT", ""), REPO.parent / "shared" / "deepspeed-src"]
    for folder in filter(None, map(str, folders)):
        found = sorted(Path(folder).glob("deepspeed-master-*.tar.gz"))
        if found:
            return found[-1]
    raise FileNotFoundError(f"a DeepSpeed master snapshot (deepspeed-master-*.tar.gz, in $DSMATRIX_DEEPSPEED_SNAPSHOT or {folders[1]})")


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env={**os.environ, **GIT_ENV}, check=True)
    return proc.stdout.strip()


def version(repo: Path) -> str:
    """The DeepSpeed version the repository's checked-out commit says it is (``version.txt``)."""
    return (repo / "version.txt").read_text().strip()


def make_repo(root: Path) -> Path:
    """The repository in ``root/DeepSpeed``, with branches master, fix and never-release."""
    with tarfile.open(snapshot()) as tar:
        tar.extractall(root, filter="data")
    repo = root / "DeepSpeed"
    git(repo, "init", "-q", "-b", "master")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "master snapshot")
    git(repo, "checkout", "-qb", "fix")
    subprocess.run(["patch", "-p1", "--fuzz=0", "-s", "-i", str(BUNDLED)], cwd=repo, check=True)
    git(repo, "commit", "-qam", "ZeRO-3: per-instance release cache")
    git(repo, "checkout", "-qb", "never-release")
    source = (repo / COORDINATOR).read_text()
    if source.count(RELEASE_ANCHOR) != 1:
        raise RuntimeError(f"{COORDINATOR}: release_sub_module moved in this snapshot: update RELEASE_ANCHOR")
    (repo / COORDINATOR).write_text(source.replace(RELEASE_ANCHOR, HARMFUL + RELEASE_ANCHOR))
    git(repo, "commit", "-qam", "never release a parameter")
    git(repo, "checkout", "-q", "master")
    return repo


if __name__ == "__main__":
    made = make_repo(Path(sys.argv[1]).resolve())
    print(made)
    for branch in ("master", "fix", "never-release"):
        print(f"{branch} {git(made, 'rev-parse', branch)}")
