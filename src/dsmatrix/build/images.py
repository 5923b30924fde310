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
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmatrix.infra import parallel, progress
from dsmatrix.infra.errors import ConfigError, DockerUnavailable, EmulationUnavailable, ImageBuildError
from dsmatrix.infra.hosts import native_platform
from dsmatrix.infra.locations import suite_path

PACKAGE = Path(__file__).resolve().parents[1]
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


def _run(cmd: list[str], what: str, error: type[Exception], timeout: float = 900) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise error(f"{what}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()[-1]
        raise error(f"{what}: {last}")
    return proc.stdout


def install_debian_packages(packages: list[str], why: str, error: type[Exception]) -> None:
    """Install ``packages`` from Debian (as root), or raise ``error`` saying what to install."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise error(f"{why}: install {' '.join(packages)} (apt-get install {' '.join(packages)}) as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    print(f"dsmatrix: {why}: installing {', '.join(packages)} from Debian ...", flush=True)
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)  # a fresh machine has no package lists
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
            raise error(f"{why}: apt-get install {' '.join(packages)} failed: {' '.join(tail)}")


def _client() -> Any:
    import docker  # imported here: the rest of the suite runs without the docker SDK

    return docker.from_env(timeout=600)


@contextlib.contextmanager
def _docker_errors() -> Iterator[None]:
    """A docker API error (a failed container start, a lost daemon) as one line, not a traceback."""
    import docker

    try:
        yield
    except docker.errors.DockerException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DockerUnavailable(f"docker: {type(exc).__name__}: {first}") from None


@contextlib.contextmanager
def docker_engine(state_dir: Path) -> Iterator[Any]:
    """A docker client. An engine that answers and was not started by this suite is used as it is.
    Otherwise the suite's own daemon is shared between runs: under ``state_dir/daemon.lock`` a run
    starts it when none answers and registers itself in ``state_dir/users/``; on leaving, the last
    registered run still alive stops it. A run killed outright leaves its entry, which the next
    run sees is dead and drops."""
    from filelock import FileLock

    state_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(state_dir / "daemon.lock"))
    me = _register_user(state_dir)
    try:
        with lock:
            client = _answering_client()
            if client is None:
                client = _start_daemon(state_dir)
            elif not _ours(state_dir):  # an engine the suite did not start: use it, stop nothing
                _unregister_user(me)
        with _docker_errors():
            yield client
    finally:
        with lock:
            _unregister_user(me)
            if _ours(state_dir) and not _live_users(state_dir):
                _stop_daemon(state_dir)


def _answering_client() -> Any | None:
    import docker

    try:
        client = _client()
        client.ping()
    except docker.errors.DockerException:
        return None
    return client


def _register_user(state_dir: Path) -> Path:
    from dsmatrix.infra.processes import start_time

    users = state_dir / "users"
    users.mkdir(parents=True, exist_ok=True)
    entry = users / f"{os.getpid()}.json"
    entry.write_text(json.dumps({"pid": os.getpid(), "start": start_time(os.getpid())}))
    return entry


def _unregister_user(entry: Path) -> None:
    entry.unlink(missing_ok=True)


def _live_users(state_dir: Path) -> list[int]:
    """The runs registered as users of the suite's daemon that are still alive (dead entries dropped)."""
    from dsmatrix.infra.processes import alive

    live = []
    for entry in sorted((state_dir / "users").glob("*.json")):
        try:
            data = json.loads(entry.read_text())
        except (OSError, ValueError):
            data = {}
        if data and alive(int(data["pid"]), data.get("start")):
            live.append(int(data["pid"]))
        else:
            entry.unlink(missing_ok=True)
    return live


def _ours(state_dir: Path) -> bool:
    """Whether the suite's own daemon (``state_dir/daemon.json``) is running."""
    from dsmatrix.infra.processes import alive

    try:
        data = json.loads((state_dir / "daemon.json").read_text())
    except (OSError, ValueError):
        return False
    return alive(int(data["pid"]), data.get("start"))


def _start_daemon(state_dir: Path) -> Any:
    from dsmatrix.infra.processes import start_time

    if shutil.which("dockerd") is None:
        install_debian_packages(["docker.io"], "no docker engine answers and dockerd is not installed", DockerUnavailable)
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise DockerUnavailable("no docker engine answers and docker.io installed no dockerd")
    log = state_dir / "dockerd.log"
    cmd = [dockerd, "--bridge=none", "--iptables=false", "--ip-masq=false", "--storage-driver=overlay2"]
    with log.open("ab") as out:  # its own session, and not a child the run stops: other runs may share it
        daemon = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = _wait_for_engine(daemon, log)
    except BaseException:
        _terminate(daemon.pid)
        raise
    (state_dir / "daemon.json").write_text(json.dumps({"pid": daemon.pid, "start": start_time(daemon.pid)}))
    print(f"dsmatrix: started dockerd (pid {daemon.pid}, log {log}); the last run using it stops it", flush=True)
    return client


def _stop_daemon(state_dir: Path) -> None:
    data = json.loads((state_dir / "daemon.json").read_text())
    _terminate(int(data["pid"]))
    (state_dir / "daemon.json").unlink(missing_ok=True)


def _terminate(pid: int, timeout_s: float = 60.0) -> None:
    """SIGTERM ``pid`` (dockerd stops its containers), SIGKILL after ``timeout_s``; reap it if it is our child."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_for_engine(daemon: subprocess.Popen[bytes], log: Path) -> Any:
    import docker

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DockerUnavailable(f"dockerd exited with code {daemon.returncode}: {last[0]} (log {log})")
        with contextlib.suppress(docker.errors.DockerException):
            client = _client()
            client.ping()
            return client
        time.sleep(1)
    daemon.terminate()
    raise DockerUnavailable(f"dockerd did not answer within 60 s (log {log})")


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
        _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)], "mounting binfmt_misc", EmulationUnavailable, 30)
    if shutil.which("update-binfmts") is None or shutil.which(f"qemu-{arch}-static") is None:
        install_debian_packages(["binfmt-support", QEMU_PACKAGE], f"{platform} needs qemu-user emulation", EmulationUnavailable)
    _run(["update-binfmts", "--enable", f"qemu-{arch}"], f"update-binfmts --enable qemu-{arch}", EmulationUnavailable, 30)
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
    _run(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(layer), "."], "tar of the base rootfs", ImageBuildError)
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
        _run([*cmd, SUITE, str(rootfs), debian_mirror()], f"debootstrap {SUITE} {spec.arch}", ImageBuildError, 1800)
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


def _local_source_dirs(config: dict[str, str]) -> list[Path]:
    """Folders on this machine that pip's sources point at: find-links paths, and a file://
    index's parent (its pages link to files beside the ``simple`` folder)."""
    dirs = []
    for value in " ".join(config.values()).split():
        path = Path(value[len("file://") :]).parent if value.startswith("file://") else Path(value)
        if path.is_absolute() and path.exists() and path != Path("/"):
            dirs.append(path)
    return dirs


def run_in_image(
    client: Any, spec: ImageSpec, argv: list[str], staging: Path, cache: Path, source: Path, matrix: Path, patch: Path
) -> tuple[int, str]:
    """Run ``nox -s matrix -- argv`` inside ``spec``'s image from the suite's ``source`` tree, with
    this run's ``matrix`` file and ``patch``, results into ``staging``.

    The source tree, the matrix file and the patch, a per-image cache volume, this machine's CA
    bundle and its pip package sources are mounted; the container's output streams here. Returns
    the exit code and the last line it printed. Ctrl-C stops the container.
    """
    from dsmatrix.build.environments import pip_config

    config = pip_config()
    cache_volume = cache / "images" / spec.name
    cache_volume.mkdir(parents=True, exist_ok=True)
    staging.mkdir(parents=True, exist_ok=True)
    volumes = {str(source): {"bind": "/src", "mode": "rw"}, str(staging): {"bind": "/results", "mode": "rw"}}
    volumes[str(matrix)] = {"bind": "/inputs/matrix.toml", "mode": "ro"}
    volumes[str(patch)] = {"bind": f"/inputs/patch/{patch.name}", "mode": "ro"}
    argv = [*argv, "--matrix", "/inputs/matrix.toml", "--patch", f"/inputs/patch/{patch.name}"]
    volumes[str(cache_volume)] = {"bind": "/cache", "mode": "rw"}
    for path in _local_source_dirs(config):
        volumes[str(path)] = {"bind": str(path), "mode": "ro"}
    environment = {"PYTHONUNBUFFERED": "1", "DSMATRIX_IMAGE": spec.tag, "HOME": "/cache/home", **dict(spec.environment)}
    environment.update({f"PIP_{key.upper().replace('-', '_')}": value for key, value in config.items()})
    ca = host_ca_bundle()
    if ca is not None:
        volumes[str(ca)] = {"bind": CA_IN_IMAGE, "mode": "ro"}
        environment.update(PIP_CERT=CA_IN_IMAGE, SSL_CERT_FILE=CA_IN_IMAGE, REQUESTS_CA_BUNDLE=CA_IN_IMAGE)
    command = ["nox", "--envdir", "/cache/nox", "-s", "matrix", "--", *argv, "--results", "/results", "--cache-dir", "/cache/dsmatrix"]
    container = client.containers.run(
        spec.tag,
        command,
        detach=True,
        network_mode="host",
        volumes=volumes,
        environment=environment,
        working_dir="/src",
        mem_limit=spec.mem_limit,
        shm_size=spec.shm_size,  # DeepSpeed's CPU comm op maps 64 MiB per process: docker's default is 64 MiB in all
        init=True,
        user=f"{os.getuid()}:{os.getgid()}",  # files it writes into the checkout and results are the user's
    )
    last = ""
    try:
        for raw in container.logs(stream=True, follow=True):
            for line in raw.decode(errors="replace").splitlines():
                print(f"[{spec.name}] {line}", flush=True)
                if line.strip():
                    last = line.strip()
        code = int(container.wait().get("StatusCode", 1))
    except KeyboardInterrupt:
        container.stop(timeout=30)
        raise
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    return code, last


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


def inside_view(client: Any, spec: ImageSpec) -> dict[str, Any]:
    """What a cell in ``spec``'s image will see: ``hosts.describe()`` run inside it (stdlib only)."""
    code = "import json, sys; sys.path.insert(0, '/pkg'); from dsmatrix.infra.hosts import describe; print(json.dumps(describe()))"
    output = client.containers.run(
        spec.tag,
        ["python3", "-c", code],
        remove=True,
        network_mode="none",
        environment=dict(spec.environment),
        volumes={str(PACKAGE): {"bind": "/pkg/dsmatrix", "mode": "ro"}},
    )
    return json.loads(output.decode().strip().splitlines()[-1])
