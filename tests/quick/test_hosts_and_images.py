"""Hosts and images without a docker engine: what a cell records about its CPU, how the base
image is labelled, and the one-line errors when docker or emulation is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dsmatrix.build.images import IMAGES, _image_tarball, debian_mirror, ensure_emulation, image_for
from dsmatrix.execute.in_image import _local_source_dirs
from dsmatrix.infra.errors import ConfigError, EmulationUnavailable
from dsmatrix.infra.hosts import decode_hwcaps, describe, is_emulated, native_platform

REPO = Path(__file__).resolve().parents[2]
# AT_HWCAP / AT_HWCAP2 that qemu-user 7.2 reports for QEMU_CPU=cortex-a76 (read inside the rpi5 image)
CORTEX_A76 = (0x119FFB, 0)


def test_cortex_a76_features_have_no_bf16() -> None:
    features = decode_hwcaps(*CORTEX_A76)
    expected = "fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
    assert features == expected.split()  # as `nox -s images` printed from inside the rpi5 image
    assert "bf16" not in features and "sve" not in features


def test_bf16_bit_is_decoded() -> None:
    assert "bf16" in decode_hwcaps(0, 1 << 14) and "i8mm" in decode_hwcaps(0, 1 << 13)


def test_emulation_is_read_from_a_cpuinfo_that_disagrees() -> None:
    x86 = {"vendor_id": "AuthenticAMD", "flags": "fpu sse2 avx2"}
    arm = {"CPU implementer": "0x41", "CPU part": "0xd0b", "Features": "fp asimd"}
    assert is_emulated("aarch64", x86) and not is_emulated("aarch64", arm)
    assert not is_emulated("x86_64", x86) and is_emulated("x86_64", arm)


def test_describe_this_machine() -> None:
    host = describe()
    assert host["platform"] == native_platform() and host["emulated"] is False
    assert isinstance(host["bf16"], bool) and host["cpu_features"] and host["kernel"]


def test_image_for_each_platform() -> None:
    assert image_for("linux/amd64").name == "x86_64" and image_for("linux/arm64").name == "rpi5"
    assert dict(IMAGES["linux/arm64"].environment)["QEMU_CPU"] == "cortex-a76"
    for spec in IMAGES.values():
        assert (spec.dockerfile_dir / "Dockerfile").is_file()
    with pytest.raises(ConfigError, match="linux/s390x"):
        image_for("linux/s390x")


def test_base_image_archive_names_its_architecture(tmp_path: Path) -> None:
    """``docker import --platform linux/arm64`` labels amd64; the suite's own archive says arm64."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "os-release").write_text('PRETTY_NAME="test"\n')
    archive = _image_tarball(rootfs, IMAGES["linux/arm64"], tmp_path)
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        config = json.load(tar.extractfile(manifest[0]["Config"]))
        assert manifest[0]["RepoTags"] == ["dsmatrix/base:bookworm-arm64"]
        assert (config["architecture"], config["os"]) == ("arm64", "linux")
        assert config["rootfs"]["diff_ids"][0].startswith("sha256:")


def test_pip_sources_are_mounted_by_folder(tmp_path: Path) -> None:
    (tmp_path / "index" / "simple").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    config = {"find-links": str(tmp_path / "wheels"), "extra-index-url": f"file://{tmp_path}/index/simple https://example.invalid/simple"}
    assert sorted(_local_source_dirs(config)) == [tmp_path / "index", tmp_path / "wheels"]


def test_debian_mirror_comes_from_apt_sources() -> None:
    if not Path("/etc/apt").is_dir():
        pytest.skip("not a Debian machine")
    assert "://" in debian_mirror()


def test_unknown_emulation_is_one_line() -> None:
    with pytest.raises(EmulationUnavailable, match="linux/s390x"):
        ensure_emulation("linux/s390x")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsmatrix", *args], capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})}, timeout=120
    )


def _fake_tools(tmp_path: Path, dockerd: str | None) -> dict[str, str]:
    """A PATH with this dockerd script (or none) and a docker socket nothing listens on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {"dockerd": dockerd}
    for tool, body in tools.items():
        if body is not None:
            (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / tool).chmod(0o755)
    return {"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock", "PATH": f"{bin_dir}:/bin"}


def test_docker_not_installable_is_one_line(tmp_path: Path) -> None:
    """No engine answers, dockerd is missing and cannot be installed (no apt-get): one line, exit 3."""
    env = _fake_tools(tmp_path, dockerd=None)
    env["PATH"] = str(tmp_path / "bin")  # no apt-get either
    proc = _cli("images", "--platform", "linux/amd64", "--cache-dir", str(tmp_path / "cache"), env=env)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "docker.io" in lines[0], proc.stderr


def test_daemon_that_fails_to_start_is_one_line(tmp_path: Path) -> None:
    """dockerd exits at once: its last log line is reported, exit 3, and no daemon is left behind."""
    env = _fake_tools(tmp_path, dockerd='echo "failed to start daemon: no overlay2 here" >&2; exit 1')
    proc = _cli("images", "--platform", "linux/amd64", "--cache-dir", str(tmp_path / "cache"), env=env)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "dockerd exited with code 1: failed to start daemon: no overlay2 here" in lines[0], proc.stderr


def test_unknown_platform_in_matrix_is_one_line() -> None:
    proc = _cli("matrix", "--platform", "linux/s390x", "--plan")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "linux/s390x" in proc.stderr


def test_arm64_plan_uses_the_tier_values_for_arm64() -> None:
    proc = _cli("matrix", "--platform", "linux/arm64", "--plan", "--json")
    cells = json.loads(proc.stdout)["include"]
    assert [(c["torch"], c["platform"]) for c in cells] == [("2.9.1", "linux/arm64")] * 2
    assert cells[0]["id"].endswith("-arm64")


def test_docker_errors_inside_the_engine_block_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An API error while using an answering engine is a HostError line, and no daemon is started for it."""
    import docker

    from dsmatrix.infra import docker_engine
    from dsmatrix.infra.errors import DockerUnavailable

    class Answering:
        def ping(self) -> bool:
            return True

    monkeypatch.setattr(docker_engine, "new_client", Answering)
    monkeypatch.setattr(docker_engine.subprocess, "Popen", lambda *a, **k: pytest.fail("no daemon may be started"))
    with pytest.raises(DockerUnavailable, match="docker: ImageNotFound: no such image"):
        with docker_engine.docker_engine(tmp_path):
            raise docker.errors.ImageNotFound("no such image")


def test_the_suites_daemon_is_shared_and_stopped_by_its_last_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run A starts the daemon while run B also uses it: A leaving keeps it; B gone, the last user stops it.
    The daemon and run B are real processes (sleep; the daemon's executed as ``dockerd``, the name a
    run checks before it stops a recorded daemon), the docker API is not needed for the rule."""
    import shutil
    import subprocess

    from dsmatrix.infra import docker_engine
    from dsmatrix.infra.processes import start_time

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dockerd").symlink_to(shutil.which("sleep") or "/bin/sleep")
    daemon = subprocess.Popen([str(tmp_path / "bin" / "dockerd"), "300"])
    other_run = subprocess.Popen(["sleep", "300"])
    answering: list[object] = []

    def start(state_dir: Path) -> object:
        (state_dir / "daemon.json").write_text(json.dumps({"pid": daemon.pid, "start": start_time(daemon.pid)}))
        answering.append(object())
        return answering[0]

    monkeypatch.setattr(docker_engine, "_answering_client", lambda: answering[0] if answering else None)
    monkeypatch.setattr(docker_engine, "_start_daemon", start)
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / f"{other_run.pid}.json").write_text(json.dumps({"pid": other_run.pid, "start": start_time(other_run.pid)}))
    with docker_engine.docker_engine(tmp_path) as client:  # run A: nothing answers, it starts the daemon
        assert client is answering[0]
    assert daemon.poll() is None, "run B still uses the daemon: A must not stop it"
    other_run.kill()
    other_run.wait()
    with docker_engine.docker_engine(tmp_path):  # run C: the daemon answers and is the suite's: C registers
        pass
    assert daemon.wait(timeout=30) is not None, "the last user must stop the suite's daemon"
    assert not (tmp_path / "daemon.json").exists() and not list((tmp_path / "users").glob("*.json"))


def test_an_engine_the_suite_did_not_start_is_never_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsmatrix.infra import docker_engine

    class Answering:
        def ping(self) -> bool:
            return True

    monkeypatch.setattr(docker_engine, "_answering_client", Answering)
    monkeypatch.setattr(docker_engine, "_stop_daemon", lambda state_dir: pytest.fail("a foreign engine was stopped"))
    with docker_engine.docker_engine(tmp_path):
        pass
    assert not list((tmp_path / "users").glob("*.json"))


def test_images_are_built_side_by_side_after_apt_installs_in_turn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Both platforms' builds overlap in time; qemu and debootstrap (apt-get, one caller at a time) come first."""
    import threading

    from dsmatrix.build import images

    events: list[str] = []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=60)  # each build waits for the other: builds in turn never get past it

    def log(what: str) -> None:
        with lock:
            events.append(what)

    def fake_build(client: object, spec: images.ImageSpec, base: str | None, work: Path) -> dict[str, str]:
        log(f"start {spec.platform}")
        both.wait()
        log(f"end {spec.platform}")
        return {"tag": spec.tag}

    monkeypatch.setattr(images, "ensure_emulation", lambda platform: log(f"emulation {platform}"))
    monkeypatch.setattr(images, "ensure_debootstrap", lambda spec: log(f"debootstrap {spec.platform}"))
    monkeypatch.setattr(images, "build_image", fake_build)
    monkeypatch.setattr(images, "has_local_base", lambda client, spec: False)
    platforms = ["linux/amd64", "linux/arm64"]
    built = images.build_images(object(), platforms, None, tmp_path)
    assert {p: facts["tag"] for p, facts in built.items()} == {p: image_for(p).tag for p in platforms}
    assert all(e.split()[0] in ("emulation", "debootstrap") for e in events[:4]), events
    assert [e.split()[0] for e in events[4:6]] == ["start", "start"], f"the second build waited for the first: {events}"

    events.clear()  # a base already built: no debootstrap to install (a machine without apt-get still builds)
    both.reset()
    monkeypatch.setattr(images, "has_local_base", lambda client, spec: spec.platform == "linux/arm64")
    images.build_images(object(), platforms, None, tmp_path)
    assert [e for e in events if e.startswith("debootstrap")] == ["debootstrap linux/amd64"], events
