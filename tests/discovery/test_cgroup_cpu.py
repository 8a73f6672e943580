"""The share of a core a cgroup's CPU quota leaves this process, from fake cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from discovery.cgroup_cpu import read_cpu_share

CORES = len(os.sched_getaffinity(0))


def tree(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_line + "\n")
    return proc, root


def test_v1_the_tightest_quota_on_the_path_over_the_usable_cores(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, "4:cpu,cpuacct:/lab/m1", {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
        "cpu/lab/cpu.cfs_quota_us": "50000", "cpu/lab/cpu.cfs_period_us": "100000",
        "cpu/lab/m1/cpu.cfs_quota_us": "30000", "cpu/lab/m1/cpu.cfs_period_us": "100000",
    })  # fmt: skip
    assert read_cpu_share(proc, root) == pytest.approx(min(0.3 / CORES, 1.0))


def test_v2_max_is_no_quota_and_a_number_is_one(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, "0::/box", {"box/cpu.max": "max 100000"})
    assert read_cpu_share(proc, root) == 1.0
    (root / "box" / "cpu.max").write_text("25000 100000\n")
    assert read_cpu_share(proc, root) == pytest.approx(min(0.25 / CORES, 1.0))


def test_no_cgroup_or_no_quota_is_a_whole_core(tmp_path: Path) -> None:
    assert read_cpu_share(tmp_path / "absent", tmp_path) == 1.0
    proc, root = tree(tmp_path, "4:cpu:/", {"cpu/cpu.cfs_quota_us": "-1"})
    assert read_cpu_share(proc, root) == 1.0
