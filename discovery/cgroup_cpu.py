"""The share of a core this process keeps when busy: its cgroup's CPU quota (v1 or v2) over the
cores it may run on. A machine (a container, a lab machine) held to 0.3 of a core runs a short
burst at full speed and is throttled when busy, which the cost model needs to know."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from discovery.cgroups import CGROUP_ROOT, PROC_CGROUP, directories_up, read_cgroup_paths


def read_cpu_share(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float:
    """The tightest quota from this process's cgroup up to the root, in cores, over the cores
    its affinity allows; 1.0 when no quota holds it."""
    cores = _quota_cores(proc_cgroup, root)
    if cores is None:
        return 1.0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(min(cores / max(usable or 1, 1), 1.0), 0.001)


def _quota_cores(proc_cgroup: Path, root: Path) -> float | None:
    paths = read_cgroup_paths(proc_cgroup)
    if paths is None:
        return None
    quotas = []
    if "cpu" in paths.v1:  # v1: cpu.cfs_quota_us / cpu.cfs_period_us
        quotas += _quotas((root / "cpu", root / "cpu,cpuacct"), paths.v1["cpu"], _v1_cores)
    if paths.v2 is not None:  # v2: cpu.max, "quota period" or "max period"
        quotas += _quotas((root, root / "unified"), paths.v2, _v2_cores)
    return min(quotas, default=None)


def _quotas(
    mounts: tuple[Path, ...], cgroup: str, read: Callable[[Path], float | None]
) -> list[float]:
    """Every quota set on the way from `cgroup` up, in whichever of `mounts` exists."""
    found = [read(directory) for mount in mounts for directory in directories_up(mount, cgroup)]
    return [quota for quota in found if quota is not None]


def _v1_cores(directory: Path) -> float | None:
    quota = _number(directory / "cpu.cfs_quota_us")
    period = _number(directory / "cpu.cfs_period_us")
    return quota / period if quota is not None and quota > 0 and period else None


def _v2_cores(directory: Path) -> float | None:
    try:
        quota, _, period = (directory / "cpu.max").read_text(encoding="ascii").partition(" ")
    except OSError:
        return None
    try:
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except ValueError:
        return None


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None
