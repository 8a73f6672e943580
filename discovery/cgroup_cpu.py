"""The share of a core this process keeps when busy: its cgroup's CPU quota (v1 or v2) over the
cores it may run on. A machine (a container, a lab machine) held to 0.3 of a core runs a short
burst at full speed and is throttled when busy, which the cost model needs to know."""

from __future__ import annotations

import os
from pathlib import Path

from discovery.cgroup_memory import CGROUP_ROOT, PROC_CGROUP


def read_cpu_share(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float:
    """The tightest quota from this process's cgroup up to the root, in cores, over the cores
    its affinity allows; 1.0 when no quota holds it."""
    cores = _quota_cores(proc_cgroup, root)
    if cores is None:
        return 1.0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(min(cores / max(usable or 1, 1), 1.0), 0.001)


def _quota_cores(proc_cgroup: Path, root: Path) -> float | None:
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    tightest = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "cpu" in controllers.split(","):  # v1: cpu.cfs_quota_us / cpu.cfs_period_us
            mount = next((m for m in (root / "cpu", root / "cpu,cpuacct") if m.is_dir()), None)
            if mount is not None:
                tightest = _least(tightest, _walk(mount, path, _v1_cores))
        elif hierarchy == "0" and controllers == "":  # v2: cpu.max "quota period" or "max ..."
            for mount in (root, root / "unified"):
                if mount.is_dir():
                    tightest = _least(tightest, _walk(mount, path, _v2_cores))
    return tightest


def _walk(mount: Path, cgroup: str, read) -> float | None:
    """The smallest quota from `cgroup` up to `mount` (a namespace may show "/" only)."""
    directory = mount / cgroup.lstrip("/")
    if not directory.is_dir():
        directory = mount
    tightest = None
    while True:
        tightest = _least(tightest, read(directory))
        if directory == mount or mount not in directory.parents:
            return tightest
        directory = directory.parent


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


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
