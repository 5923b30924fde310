"""The host a cell runs on: this machine, or a container image (``containers/``) on it.

A cell result records what its tests really ran on, read from inside: platform, CPU model and
features (BF16 among them), kernel, OS image, and whether the CPU was emulated. Under qemu-user
``/proc/cpuinfo`` still describes the host's CPU, so on aarch64 the features come from the
auxiliary vector (``getauxval(AT_HWCAP)``), which qemu fills in for the CPU it emulates
(``QEMU_CPU=cortex-a76`` for the Raspberry Pi 5).
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

LOCAL = "local"  # a cell's host when it runs on this machine itself (else ``image:<name>``)
MACHINE_PLATFORMS = {"x86_64": "linux/amd64", "amd64": "linux/amd64", "aarch64": "linux/arm64", "arm64": "linux/arm64"}
AT_HWCAP, AT_HWCAP2 = 16, 26
# Linux arch/arm64/include/uapi/asm/hwcap.h, in bit order
AARCH64_HWCAP = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc "
    "dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg"
).split()
AARCH64_HWCAP2 = (
    "dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 i8mm bf16 dgh rng bti mte"
).split()
# MIDR part numbers of Arm cores a release engineer is likely to meet (implementer 0x41)
ARM_PARTS = {
    "0xd03": "Cortex-A53",
    "0xd08": "Cortex-A72",
    "0xd0b": "Cortex-A76",
    "0xd0c": "Neoverse-N1",
    "0xd40": "Neoverse-V1",
    "0xd4f": "Neoverse-V2",
}
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def native_platform() -> str:
    """This machine's platform in docker's spelling (``linux/amd64``, ``linux/arm64``)."""
    return MACHINE_PLATFORMS.get(platform.machine(), f"linux/{platform.machine()}")


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _aarch64_features() -> list[str]:
    libc = ctypes.CDLL(None)
    libc.getauxval.restype = ctypes.c_ulong
    return decode_hwcaps(libc.getauxval(AT_HWCAP), libc.getauxval(AT_HWCAP2))


def decode_hwcaps(hwcap: int, hwcap2: int) -> list[str]:
    """aarch64 feature names (as ``/proc/cpuinfo`` spells them) from the AT_HWCAP/AT_HWCAP2 bits."""
    names = [name for bit, name in enumerate(AARCH64_HWCAP) if hwcap >> bit & 1]
    return names + [name for bit, name in enumerate(AARCH64_HWCAP2) if hwcap2 >> bit & 1]


def is_emulated(machine: str, cpuinfo: dict[str, str]) -> bool:
    """qemu-user: the kernel's ``/proc/cpuinfo`` describes the host's CPU, not our own machine's."""
    kernel_cpu_is_x86 = "vendor_id" in cpuinfo and "flags" in cpuinfo
    kernel_cpu_is_arm = "CPU implementer" in cpuinfo
    return machine == "aarch64" and kernel_cpu_is_x86 or machine == "x86_64" and kernel_cpu_is_arm


def _os_image() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return "unknown"


def describe() -> dict[str, object]:
    """What this process runs on, read from inside (JSON-ready)."""
    info = _cpuinfo()
    machine = platform.machine()
    emulated = is_emulated(machine, info)
    if machine == "aarch64":
        features = _aarch64_features()
        qemu_cpu = os.environ.get("QEMU_CPU", "")
        if emulated:
            model = f"{qemu_cpu or 'default'} (qemu-user CPU model)"
        else:
            part = info.get("CPU part", "")
            model = ARM_PARTS.get(part, f"Arm part {part or 'unknown'}")
    else:
        features = info.get("flags", "").split()
        model = info.get("model name", "unknown")
    return {
        "platform": MACHINE_PLATFORMS.get(machine, f"linux/{machine}"),
        "machine": machine,
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpu_features": features,
        "bf16": bool(BF16_FLAGS & set(features)),
        "emulated": emulated,
        "emulator": "qemu-user" if emulated else None,
        "kernel": platform.release(),
        "os_image": _os_image(),
        "in_container": Path("/.dockerenv").exists(),
        "python": platform.python_version(),
    }
