"""Container images that run the matrix: ``containers/x86_64`` and ``containers/rpi5`` (arm64).

An image is a host, not a second implementation: inside it, ``nox -s matrix`` runs exactly as
on this machine, and its finished cells are imported into this machine's results store.

Everything goes through the docker SDK. Where no docker engine runs, the suite starts one
(no bridge, no iptables, host networking) and stops exactly that daemon when it is done. Where
no registry is reachable, the base image is built here from Debian packages (debootstrap,
minbase) and loaded with an image config that names its real architecture (``docker import
--platform linux/arm64`` labels the image amd64). arm64 runs under qemu-user through binfmt_misc
with ``QEMU_CPU=cortex-a76``, the Raspberry Pi 5's core.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmatrix.infra import parallel, progress
from dsmatrix.infra.debian import install_debian_packages, run_tool
from dsmatrix.infra.errors import ConfigError, EmulationUnavailable, ImageBuildError
from dsmatrix.infra.hosts import native_platform
from dsmatrix.infra.locations import suite_path

SUITE = "bookworm"  # Debian release of the local base; Raspberry Pi OS is bookworm too
BASE_PACKAGES = ("python3", "python3-dev", "python3-venv", "python3-pip", "g++", "make", "patch", "ca-certificates", "procps")
QEMU_PACKAGE = "qemu-user-static"
CA_IN_IMAGE = "/etc/dsmatrix/host-ca.pem"


@dataclass(frozen=True)
class ImageSpec:
    """One image: its Dockerfile folder, platform and what a run inside it gets."""

    name: str
    platform: str
    environment: tuple[tuple[str, str], ...] = ()
    mem_limit: str | None = None
    shm_size: str = "2g"

    @property
    def arch(self) -> str:
        return self.platform.split("/", 1)[1]

    @property
    def dockerfile_dir(self) -> Path:
        return suite_path("containers") / self.name

    @property
    def tag(self) -> str:
        return f"dsmatrix/{self.name}:latest"

    @property
    def local_base(self) -> str:
        return f"dsmatrix/base:{SUITE}-{self.arch}"


IMAGES = {
    "linux/amd64": ImageSpec("x86_64", "linux/amd64"),
    # Raspberry Pi 5: Cortex-A76 (no BF16 instructions), 4 cores, 16 GB class
    "linux/arm64": ImageSpec("rpi5", "linux/arm64", (("QEMU_CPU", "cortex-a76"),), mem_limit="16g"),
}


def image_for(platform: str) -> ImageSpec:
    if platform not in IMAGES:
        raise ConfigError(f"--platform {platform}: no image for it (images: {', '.join(IMAGES)})")
    return IMAGES[platform]


def ensure_emulation(platform: str) -> None:
    """Make sure this kernel runs ``platform`` binaries (binfmt_misc + qemu-user), or say why not."""
    if platform == native_platform():
        return
    arch = {"linux/arm64": "aarch64", "linux/amd64": "x86_64"}.get(platform)
    if arch is None:
        raise EmulationUnavailable(f"--platform {platform}: no qemu-user emulation known for it")
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    entry = binfmt / f"qemu-{arch}"
    if entry.exists() and entry.read_text().startswith("enabled"):
        return
    if not (binfmt / "register").exists():
        run_tool(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)], "mounting binfmt_misc", EmulationUnavailable, 30)
    if shutil.which("update-binfmts") is None or shutil.which(f"qemu-{arch}-static") is None:
        install_debian_packages(["binfmt-support", QEMU_PACKAGE], f"{platform} needs qemu-user emulation", EmulationUnavailable)
    run_tool(["update-binfmts", "--enable", f"qemu-{arch}"], f"update-binfmts --enable qemu-{arch}", EmulationUnavailable, 30)
    if not (entry.exists() and entry.read_text().startswith("enabled")):
        raise EmulationUnavailable(f"{platform}: binfmt_misc still has no enabled qemu-{arch} entry after update-binfmts")


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]
    for path in sources:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                words = line.split()
                if line.startswith("URIs:") and len(words) > 1 and "security" not in words[1]:
                    return words[1]
                if line.startswith("deb ") and len(words) > 2 and "security" not in words[1]:
                    return words[1]
    raise ConfigError("no Debian mirror found in /etc/apt/sources.list(.d): cannot debootstrap a base image")


def _image_tarball(rootfs: Path, spec: ImageSpec, out: Path) -> Path:
    """A ``docker load`` archive of ``rootfs`` whose config names the real architecture."""
    layer = out / "layer.tar"
    run_tool(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(layer), "."], "tar of the base rootfs", ImageBuildError)
    digest = hashlib.sha256()
    with layer.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    config = {
        "architecture": spec.arch,
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": ["/bin/bash"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest.hexdigest()}"]},
        "history": [{"created_by": f"debootstrap --variant=minbase --arch={spec.arch} {SUITE}"}],
    }
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    (out / config_name).write_bytes(config_bytes)
    (out / "manifest.json").write_text(json.dumps([{"Config": config_name, "RepoTags": [spec.local_base], "Layers": ["layer.tar"]}]))
    archive = out / "image.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("manifest.json", config_name, "layer.tar"):
            tar.add(out / name, arcname=name)
    return archive


def ensure_debootstrap(spec: ImageSpec) -> None:
    """Install Debian's debootstrap when it is missing (apt-get takes one caller at a time: call it
    before building bases side by side)."""
    if shutil.which("debootstrap") is None:
        install_debian_packages(["debootstrap"], f"building {spec.local_base} needs debootstrap", ImageBuildError)


def has_local_base(client: Any, spec: ImageSpec) -> bool:
    """Whether ``dsmatrix/base:bookworm-<arch>`` is already in the engine."""
    import docker

    try:
        client.images.get(spec.local_base)
    except docker.errors.ImageNotFound:
        return False
    return True


def build_local_base(client: Any, spec: ImageSpec, work: Path) -> str:
    """``dsmatrix/base:bookworm-<arch>`` from Debian packages, labelled with its architecture."""
    if has_local_base(client, spec):
        return spec.local_base
    ensure_debootstrap(spec)
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work, prefix=f"base-{spec.arch}-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        started = time.monotonic()
        print(f"dsmatrix: debootstrap {SUITE} {spec.arch} (minbase) for {spec.local_base} ...", flush=True)
        progress.stage(f"debootstrap {SUITE} {spec.arch}")
        cmd = ["debootstrap", "--variant=minbase", f"--arch={spec.arch}", f"--include={','.join(BASE_PACKAGES)}"]
        run_tool([*cmd, SUITE, str(rootfs), debian_mirror()], f"debootstrap {SUITE} {spec.arch}", ImageBuildError, 1800)
        with (_image_tarball(rootfs, spec, Path(tmp))).open("rb") as archive:
            client.images.load(archive)
        print(f"dsmatrix: {spec.local_base} built in {time.monotonic() - started:.0f} s", flush=True)
    image = client.images.get(spec.local_base)
    if image.attrs.get("Architecture") != spec.arch:
        raise ImageBuildError(f"{spec.local_base}: loaded as {image.attrs.get('Architecture')}, expected {spec.arch}")
    return spec.local_base


def host_ca_bundle() -> Path | None:
    """The CA bundle this machine trusts (a TLS-intercepting proxy's CA included), if any."""
    for name in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        value = os.environ.get(name)
        if value and Path(value).is_file():
            return Path(value)
    default = Path("/etc/ssl/certs/ca-certificates.crt")
    return default if default.is_file() else None


def build_image(client: Any, spec: ImageSpec, base: str | None, work: Path) -> dict[str, Any]:
    """Build ``spec`` with the docker SDK, streaming the build's progress; returns the image's facts."""
    dockerfile = spec.dockerfile_dir / "Dockerfile"
    if not dockerfile.is_file():
        raise ImageBuildError(f"{dockerfile}: no Dockerfile")
    base = base or build_local_base(client, spec, work)
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work, prefix=f"context-{spec.name}-") as tmp:
        context = Path(tmp)
        shutil.copytree(spec.dockerfile_dir, context, dirs_exist_ok=True)
        ca = host_ca_bundle()  # public certificates only: the build's pip must trust the host's proxy
        (context / "host-ca.pem").write_bytes(ca.read_bytes() if ca else b"")
        started = time.monotonic()
        print(f"dsmatrix: building {spec.tag} ({spec.platform}) FROM {base} ...", flush=True)
        progress.stage(f"docker build {spec.tag}")
        step = "?"
        stream = client.api.build(
            path=str(context), tag=spec.tag, buildargs={"BASE_IMAGE": base}, network_mode="host", rm=True, forcerm=True, decode=True
        )
        for chunk in stream:
            if "error" in chunk:
                raise ImageBuildError(f"{dockerfile}: {step.strip()}: {chunk['error'].strip().splitlines()[-1]}")
            text = chunk.get("stream", "")
            if text.startswith("Step "):
                step = text
                print(f"  [{time.monotonic() - started:5.0f} s] {text.strip()}", flush=True)
    image = client.images.get(spec.tag)
    if image.attrs.get("Architecture") != spec.arch:
        raise ImageBuildError(f"{spec.tag}: built as {image.attrs.get('Architecture')}, expected {spec.arch} (base {base})")
    print(f"dsmatrix: {spec.tag} {image.short_id} ({spec.platform}) ready in {time.monotonic() - started:.0f} s", flush=True)
    return {"tag": spec.tag, "id": image.id, "platform": f"{image.attrs['Os']}/{image.attrs['Architecture']}", "base": base}


def build_images(client: Any, platforms: list[str], base: str | None, work: Path) -> dict[str, dict[str, Any]]:
    """Each platform's image (``build_image``), side by side: the arm64 base's second stage runs
    under qemu on about one core while the x86_64 base and image take the other (in turn they took
    540 s of a fresh CI run here). What apt-get installs (qemu, debootstrap) is installed first,
    one platform at a time (debootstrap only where a base is to be built). Returns each platform's
    image facts."""
    for platform in platforms:
        ensure_emulation(platform)
        if not base and not has_local_base(client, image_for(platform)):
            ensure_debootstrap(image_for(platform))
    return parallel.each(
        platforms,
        lambda platform: build_image(client, image_for(platform), base, work),
        together=True,
        lane_of=lambda platform: f"image {image_for(platform).tag}",
    )
