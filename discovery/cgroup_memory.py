"""This process's cgroup memory limit (v1 or v2): in a container, the limit is the machine.

psutil reports the host's memory even inside a container, so a node limited to 8 GB on a 64 GB
host would be planned for 64 GB and killed by the OOM killer. The JVM, the Go runtime and Node
read the cgroup limit for the same reason. The effective limit is the smallest one on the path
from this process's cgroup up to the hierarchy's root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from discovery.cgroups import CGROUP_ROOT, PROC_CGROUP, directories_up, read_cgroup_paths

# v1 writes "no limit" as the largest page-aligned 64-bit value; anything this large is none.
UNLIMITED_FROM = 1 << 60


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The tightest memory limit over this process's cgroups, and what that cgroup uses now."""

    limit: int  # bytes
    usage: int  # bytes in use, reclaimable page cache (inactive files) not counted
    version: int  # 1 or 2
    path: Path  # the cgroup directory whose limit applies

    @property
    def available(self) -> int:
        return max(0, self.limit - self.usage)

    def describe(self) -> str:
        return f"cgroup v{self.version} limit"


def read_cgroup_memory(
    proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT
) -> CgroupMemory | None:
    """The limit that applies to this process, or None when no cgroup limits its memory."""
    paths = read_cgroup_paths(proc_cgroup)
    if paths is None:
        return None  # not Linux, or no cgroups
    if "memory" in paths.v1:
        found = _tightest(
            root / "memory", paths.v1["memory"], "memory.limit_in_bytes", _read_v1_usage
        )
        if found:
            return CgroupMemory(found[0], found[1], 1, found[2])
    if paths.v2 is not None:
        for mount in (root, root / "unified"):  # unified alone, or beside v1 (hybrid)
            found = _tightest(mount, paths.v2, "memory.max", _read_v2_usage)
            if found:
                return CgroupMemory(found[0], found[1], 2, found[2])
    return None


def _tightest(
    mount: Path, cgroup: str, limit_file: str, read_usage: Callable[[Path], int | None]
) -> tuple[int, int, Path] | None:
    """(limit, usage, directory) of the smallest limit from `cgroup` up to `mount`, or None."""
    best: tuple[int, int, Path] | None = None
    for directory in directories_up(mount, cgroup):
        limit = _read_limit(directory / limit_file)
        if limit is not None and (best is None or limit < best[0]):
            usage = read_usage(directory)
            if usage is not None:
                best = (limit, usage, directory)
    return best


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= UNLIMITED_FROM:
        return None
    return int(text)


def _read_v1_usage(directory: Path) -> int | None:
    usage = _read_int(directory / "memory.usage_in_bytes")
    if usage is None:
        return None
    return max(0, usage - _read_stat(directory / "memory.stat", "total_inactive_file"))


def _read_v2_usage(directory: Path) -> int | None:
    usage = _read_int(directory / "memory.current")
    if usage is None:
        return None
    return max(0, usage - _read_stat(directory / "memory.stat", "inactive_file"))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None


def _read_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0
