"""What this machine can contribute: memory, platform, collective backends and RDMA devices."""

from __future__ import annotations

import logging
import os
import platform
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from discovery.cgroup_memory import read_cgroup_memory
from errors import ConfigError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0
# RDMA over Thunderbolt (what JACCL runs on) ships with macOS 26.2.
JACCL_MIN_MACOS = (26, 2)
BACKEND_RING = "ring"
BACKEND_JACCL = "jaccl"
PORT_ACTIVE = "PORT_ACTIVE"
MACHINE_BOUND = "machine"
OPERATOR_BOUND = "--memory-limit"
MEMORY_UNITS = {
    "": 1,
    "K": 1024,
    "M": 1024**2,
    "G": 1024**3,
    "T": 1024**4,
}
MEMORY_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    """One RDMA device as `ibv_devinfo` reports it, e.g. rdma_en4 / PORT_ACTIVE."""

    name: str
    port_state: str

    @property
    def active(self) -> bool:
        return self.port_state == PORT_ACTIVE


@dataclass(frozen=True, slots=True)
class Capabilities:
    """One probe of this machine; memory already capped by the operator's limit."""

    platform: str
    macos_version: str | None
    memory_total: int
    memory_available: int
    backends: tuple[str, ...]
    rdma_devices: tuple[RdmaDevice, ...]
    jaccl_reason: str
    memory_bound: str = MACHINE_BOUND  # what set memory_total: the machine, a cgroup, the operator


def parse_memory_size(text: str) -> int:
    """Bytes from '512M', '2G', '1.5GiB' or '1073741824' (binary units); ConfigError otherwise."""
    match = MEMORY_SIZE_PATTERN.match(text or "")
    if match is None:
        raise ConfigError(
            f"invalid memory size {text!r}: use bytes or a number with K, M, G or T (e.g. 512M, 2G)"
        )
    number, unit = match.groups()
    size = int(float(number) * MEMORY_UNITS[unit.upper()])
    if size <= 0:
        raise ConfigError(f"invalid memory size {text!r}: it must be more than zero bytes")
    return size


def format_memory_size(size: int) -> str:
    """Human-readable binary size, e.g. 2.0G."""
    for unit in ("T", "G", "M", "K"):
        if size >= MEMORY_UNITS[unit]:
            return f"{size / MEMORY_UNITS[unit]:.1f}{unit}"
    return f"{size}B"


def parse_meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from the text of Linux /proc/meminfo."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * 1024  # values are in kB
    total = fields.get("MemTotal", 0)
    available = fields.get("MemAvailable")
    if available is None:  # kernels before 3.14
        available = fields.get("MemFree", 0) + fields.get("Cached", 0)
    return total, available


def parse_vm_stat(text: str) -> int:
    """Available bytes from macOS `vm_stat`: free + inactive + speculative + purgeable pages."""
    page_size_match = re.search(r"page size of (\d+) bytes", text)
    page_size = int(page_size_match.group(1)) if page_size_match else 16384
    pages = 0
    for name in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable"):
        match = re.search(rf"^{name}:\s+(\d+)", text, re.MULTILINE)
        if match:
            pages += int(match.group(1))
    return pages * page_size


def run_probe(command: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """stdout of a probe command, or None when it is missing, fails, or times out."""
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError) as error:
        logger.debug("probe %s unavailable: %s", command[0], error)
        return None
    if result.returncode != 0:
        logger.debug("probe %s exited %d: %s", command[0], result.returncode, result.stderr.strip())
        return None
    return result.stdout


def read_sysconf_memory() -> tuple[int, int]:
    """(total, available) from POSIX sysconf; available is 0 where the OS does not say."""
    try:
        page_size = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page_size
    except (ValueError, OSError):
        return 0, 0
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * page_size
    except (ValueError, OSError):
        available = 0
    return total, available


def read_memory() -> tuple[int, int]:
    """(total, available) bytes of physical memory on this machine."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                total, available = parse_meminfo(meminfo.read())
            if total > 0:
                return total, available
        except OSError as error:
            logger.debug("cannot read /proc/meminfo: %s", error)
    total, available = read_sysconf_memory()
    if sys.platform == "darwin":
        memsize = run_probe(["sysctl", "-n", "hw.memsize"])
        if memsize and memsize.strip().isdigit():
            total = int(memsize.strip())
        vm_stat = run_probe(["vm_stat"])
        if vm_stat:
            available = parse_vm_stat(vm_stat) or available
    return total, min(available, total) if total else available


def apply_memory_limit(total: int, available: int, limit: int | None) -> tuple[int, int]:
    """Cap (total, available) at the operator's limit, to simulate a smaller machine."""
    if limit is None:
        return total, available
    return min(total, limit), min(available, limit)


def read_bounded_memory(memory_limit: int | None) -> tuple[int, int, str]:
    """(total, available, bound): the machine's memory, within this process's cgroup limit and
    the operator's --memory-limit; `bound` names the smallest of the three."""
    total, available = read_memory()
    bound = MACHINE_BOUND
    cgroup = read_cgroup_memory()
    if cgroup is not None and cgroup.limit < total:
        total, available, bound = cgroup.limit, min(available, cgroup.available), cgroup.describe()
    if memory_limit is not None and memory_limit < total:
        bound = OPERATOR_BOUND
    total, available = apply_memory_limit(total, available, memory_limit)
    return total, available, bound


def read_tandem_version() -> str:
    """The installed tandem version, or the source tree's pyproject version, or 'unknown'."""
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        pass
    try:
        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as pyproject:
            return str(tomllib.load(pyproject)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def read_macos_version() -> str | None:
    """'26.2' on macOS, None elsewhere."""
    if sys.platform != "darwin":
        return None
    return platform.mac_ver()[0] or None


def parse_version(text: str) -> tuple[int, ...]:
    """(26, 2) from '26.2'; the leading numeric parts only."""
    numbers: list[int] = []
    for part in text.split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


def describe_platform(macos_version: str | None) -> str:
    """A short platform string, e.g. 'macOS-26.2-arm64' or 'Linux-6.8.0-x86_64'."""
    if macos_version:
        return f"macOS-{macos_version}-{platform.machine()}"
    return f"{platform.system()}-{platform.release()}-{platform.machine()}"


def parse_ibv_devinfo(text: str) -> tuple[RdmaDevice, ...]:
    """Devices and their first port state from `ibv_devinfo` output."""
    devices: list[RdmaDevice] = []
    name: str | None = None
    state: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("hca_id:"):
            if name is not None:
                devices.append(RdmaDevice(name, state or "UNKNOWN"))
            name, state = stripped.split(":", 1)[1].strip(), None
        elif stripped.startswith("state:") and name is not None and state is None:
            state = stripped.split(":", 1)[1].split()[0].strip()
    if name is not None:
        devices.append(RdmaDevice(name, state or "UNKNOWN"))
    return tuple(devices)


def probe_rdma_devices() -> tuple[RdmaDevice, ...]:
    """RDMA devices from `ibv_devinfo`; empty when the tool is absent or fails."""
    output = run_probe(["ibv_devinfo"])
    return parse_ibv_devinfo(output) if output else ()


def check_jaccl(
    macos_version: str | None, rdma_status: str | None, devices: tuple[RdmaDevice, ...]
) -> str:
    """'' when JACCL can run here, otherwise the reason it cannot."""
    if macos_version is None:
        return "JACCL needs macOS (RDMA over Thunderbolt)"
    if parse_version(macos_version) < JACCL_MIN_MACOS:
        return f"JACCL needs macOS >= 26.2, this is {macos_version}"
    if rdma_status is None:
        return "rdma_ctl status did not answer"
    if rdma_status.strip().lower() != "enabled":
        return f"RDMA is {rdma_status.strip()!r}: run `rdma_ctl enable` from macOS Recovery"
    if not any(device.active for device in devices):
        return "no RDMA device has an active port (check the Thunderbolt cables)"
    return ""


def probe_capabilities(memory_limit: int | None = None) -> Capabilities:
    """Probe memory, platform, RDMA and backends; every probe is bounded and never raises."""
    total, available, bound = read_bounded_memory(memory_limit)
    macos_version = read_macos_version()
    devices = probe_rdma_devices()
    rdma_status = run_probe(["rdma_ctl", "status"]) if macos_version else None
    jaccl_reason = check_jaccl(macos_version, rdma_status, devices)
    backends = (BACKEND_RING,) if jaccl_reason else (BACKEND_JACCL, BACKEND_RING)
    return Capabilities(
        platform=describe_platform(macos_version),
        macos_version=macos_version,
        memory_total=total,
        memory_available=available,
        backends=backends,
        rdma_devices=devices,
        jaccl_reason=jaccl_reason,
        memory_bound=bound,
    )


def refresh_memory(capabilities: Capabilities, memory_limit: int | None) -> Capabilities:
    """The same capabilities with memory read again (for heartbeats)."""
    total, available, bound = read_bounded_memory(memory_limit)
    return replace(
        capabilities, memory_total=total, memory_available=available, memory_bound=bound
    )
