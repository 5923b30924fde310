"""Where a cell's packages come from: pip's own sources as configured, and for a CPU-only torch
pin those sources lack, the CPU wheel index (``DSMATRIX_TORCH_CPU_INDEX``, PyTorch's by default).
Local file:// indexes stand in for both; nothing is downloaded."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import hide_pip_configuration, simple_index

from dsmatrix.build import environments
from dsmatrix.infra.errors import ConfigError, UnknownVersionError

TORCH = "torch==2.13.0+cpu"


def fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel with only its metadata: enough for uv to resolve it, never installed."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        tag = "cp311-cp311-manylinux_2_28_x86_64"
        archive.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def plain_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip configured with nothing but an empty index (the public index's stand-in, offline)."""
    for key in [k for k in os.environ if k.startswith(("PIP_", "UV_"))]:
        monkeypatch.delenv(key)
    for key, value in hide_pip_configuration({}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PIP_INDEX_URL", simple_index(tmp_path / "public", []))
    monkeypatch.setattr(environments, "_cpu_index_needed", {})
    return tmp_path


def test_a_cpu_torch_that_pips_sources_lack_comes_from_the_cpu_index(plain_machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = simple_index(plain_machine / "cpu", [fake_wheel(plain_machine / "wheels", "torch", "2.13.0+cpu")])
    monkeypatch.setenv("DSMATRIX_TORCH_CPU_INDEX", index)
    environments.check_installable(TORCH, "3.11")
    public = ["--default-index", (plain_machine / "public").as_uri()]
    assert environments.package_sources([TORCH, "pytest"], Path(sys.executable)) == [*public, f"--index={index}"]
    assert environments.package_sources(["torch==2.9.1", "pytest"], Path(sys.executable)) == public


def test_pips_own_sources_win_and_the_cpu_index_is_never_asked(plain_machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake_wheel(plain_machine / "local", "torch", "2.13.0+cpu").parent))
    monkeypatch.setenv("DSMATRIX_TORCH_CPU_INDEX", simple_index(plain_machine / "unreachable-never-read", []))
    environments.check_installable(TORCH, "3.11")
    assert not any(arg.startswith("--index=") for arg in environments.package_sources([TORCH], Path(sys.executable)))


def test_a_torch_on_neither_is_one_line_naming_the_setting(plain_machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSMATRIX_TORCH_CPU_INDEX", simple_index(plain_machine / "cpu", []))
    with pytest.raises(UnknownVersionError) as caught:
        environments.check_installable(TORCH, "3.11")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{TORCH} for Python 3.11: not installable here: neither pip's sources nor")
    assert "(DSMATRIX_TORCH_CPU_INDEX) have it" in message


@pytest.mark.parametrize("value", ["-x", "--index-url=evil", "ftp://mirror/whl/cpu", "https://a/cpu https://b/cpu", "https://a/cpu\nB=1"])
def test_the_cpu_index_setting_must_be_one_url(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DSMATRIX_TORCH_CPU_INDEX", value)
    with pytest.raises(ConfigError, match="^DSMATRIX_TORCH_CPU_INDEX: .* is not one http\\(s\\):// or file:// URL$"):
        environments.torch_cpu_index()


def test_the_cpu_index_defaults_to_pytorchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSMATRIX_TORCH_CPU_INDEX", "")
    assert environments.torch_cpu_index() == environments.DEFAULT_TORCH_CPU_INDEX
