"""Where this process's cgroups are: the paths /proc/self/cgroup names (v1 per controller, v2
one unified path), and the directories from one up to its hierarchy's mount, where limits
set higher up also hold. The memory limit and the CPU quota read them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True, slots=True)
class CgroupPaths:
    """This process's cgroup in each v1 controller's hierarchy, and in v2's (None: none)."""

    v1: dict[str, str] = field(default_factory=dict)  # controller -> path
    v2: str | None = None


def read_cgroup_paths(proc_cgroup: Path = PROC_CGROUP) -> CgroupPaths | None:
    """None when there are no cgroups to read (not Linux)."""
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    v1: dict[str, str] = {}
    v2 = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        for controller in controllers.split(","):
            if controller:
                v1[controller] = path
    return CgroupPaths(v1, v2)


def directories_up(mount: Path, cgroup: str) -> Iterator[Path]:
    """`cgroup`'s directory under `mount`, then each parent up to `mount` itself. A cgroup
    namespace shows "/" for a directory we cannot see: then only the mount."""
    if not mount.is_dir():
        return
    directory = mount / cgroup.lstrip("/")
    if not directory.is_dir():
        directory = mount
    while True:
        yield directory
        if directory == mount or mount not in directory.parents:
            return
        directory = directory.parent
