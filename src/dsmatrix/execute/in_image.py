"""Cells run inside a container image: ``nox -s matrix`` there, exactly as on this machine, its finished
cells imported into this machine's results store."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from dsmatrix.build.images import CA_IN_IMAGE, ImageSpec, host_ca_bundle
from dsmatrix.infra.locations import PACKAGE


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
    client: Any, spec: ImageSpec, argv: list[str], staging: Path, cache_volume: Path, source: Path, matrix: Path, patch: Path
) -> tuple[int, str]:
    """Run ``nox -s matrix -- argv`` inside ``spec``'s image from the suite's ``source`` tree, with
    this run's ``matrix`` file and ``patch``, results into ``staging``.

    The source tree, the matrix file and the patch, a per-image cache volume, this machine's CA
    bundle and its pip package sources are mounted; the container's output streams here. Returns
    the exit code and the last line it printed. Ctrl-C stops the container.
    """
    from dsmatrix.build.environments import pip_config

    config = pip_config()
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
