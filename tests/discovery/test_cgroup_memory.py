"""A cgroup's memory limit is the machine: read from v1 and v2 trees, and honoured for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from discovery.cgroup_memory import read_cgroup_memory
from discovery.framing import free_port
from tests.helpers.cluster import REPO_ROOT, child_env

MIB = 1024**2
UNLIMITED_V1 = "9223372036854771712"
REAL_V1 = Path("/sys/fs/cgroup/memory")


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def v1_cgroup(root: Path, limit: str, usage: int, inactive: int = 0) -> dict[str, str]:
    return {
        f"{root}/memory.limit_in_bytes": limit,
        f"{root}/memory.usage_in_bytes": str(usage),
        f"{root}/memory.stat": f"cache 1\ntotal_inactive_file {inactive}\n",
    }


def test_v1_the_tightest_limit_on_the_path_applies_and_page_cache_is_not_usage(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/\n4:memory:/outer/inner\n0::/\n")
    root = tmp_path / "sys"
    write_tree(root, {
        **v1_cgroup(Path("memory"), UNLIMITED_V1, 900 * MIB),
        **v1_cgroup(Path("memory/outer"), str(512 * MIB), 300 * MIB, inactive=100 * MIB),
        **v1_cgroup(Path("memory/outer/inner"), str(1024 * MIB), 250 * MIB),
    })
    found = read_cgroup_memory(proc, root)
    assert found is not None
    assert (found.limit, found.usage, found.version) == (512 * MIB, 200 * MIB, 1)
    assert found.available == 312 * MIB
    assert found.path == root / "memory" / "outer"
    assert found.describe() == "cgroup v1 limit"


def test_v2_max_means_no_limit_and_a_number_is_one(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/app\n")
    root = tmp_path / "sys"
    write_tree(root, {"app/memory.max": "max\n", "app/memory.current": "10\n"})
    assert read_cgroup_memory(proc, root) is None
    write_tree(root, {
        "app/memory.max": f"{256 * MIB}\n",
        "app/memory.current": f"{100 * MIB}\n",
        "app/memory.stat": f"anon 5\ninactive_file {20 * MIB}\n",
    })
    found = read_cgroup_memory(proc, root)
    assert found is not None
    assert (found.limit, found.usage, found.version) == (256 * MIB, 80 * MIB, 2)


def test_v2_beside_v1_is_read_from_the_unified_mount(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/\n0::/job\n")  # v1 memory unlimited, v2 (hybrid) limited
    root = tmp_path / "sys"
    write_tree(root, {
        **v1_cgroup(Path("memory"), UNLIMITED_V1, 1),
        "unified/job/memory.max": str(64 * MIB),
        "unified/job/memory.current": str(MIB),
    })
    found = read_cgroup_memory(proc, root)
    assert found is not None and (found.limit, found.version) == (64 * MIB, 2)


def test_no_cgroup_file_means_no_limit(tmp_path):
    assert read_cgroup_memory(tmp_path / "missing", tmp_path) is None


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A real v1 memory cgroup of this test's own (root only), removed afterwards."""
    if os.geteuid() != 0 or not (REAL_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    path = REAL_V1 / f"tandem-test-{os.getpid()}"
    path.mkdir()
    try:
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            subprocess.run(["kill", "-9", pid], check=False)  # only our own children live here
        path.rmdir()


def run_in_cgroup(cgroup: Path, limit: int, argv: list[str]) -> subprocess.CompletedProcess[str]:
    (cgroup / "memory.limit_in_bytes").write_text(str(limit))
    enter = f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"'
    return subprocess.run(
        ["sh", "-c", enter, "sh", *argv], cwd=REPO_ROOT, env=child_env(),
        capture_output=True, text=True, timeout=90, check=False,
    )


def test_a_process_in_a_limited_cgroup_reports_the_limit_as_its_memory(memory_cgroup):
    probe = (
        "import json; from discovery.capabilities import probe_capabilities as p; "
        "c = p(); print(json.dumps([c.memory_total, c.memory_available, c.memory_bound]))"
    )
    result = run_in_cgroup(memory_cgroup, 400 * MIB, [sys.executable, "-c", probe])
    assert result.returncode == 0, result.stderr
    total, available, bound = json.loads(result.stdout)
    assert total == 400 * MIB
    assert 0 < available < 400 * MIB
    assert bound == "cgroup v1 limit"


def test_serve_in_a_cgroup_too_small_for_the_plan_refuses_with_the_limit(
    memory_cgroup, demo_model_dir
):
    """Planned for the host's memory it would load and be OOM-killed; the limit refuses it
    (one sequence of 131072 tokens: 512 MB of the demo's KV, so no smaller batch fits)."""
    argv = [
        sys.executable, "-m", "cli.main", "serve", "--model", str(demo_model_dir),
        "--parallelism", "single", "--port", str(free_port()), "--interface", "127.0.0.1",
        "--discovery-timeout", "0.2", "--context-tokens", "131072",
    ]
    result = run_in_cgroup(memory_cgroup, 400 * MIB, argv)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "refusing to serve" in last and "(cgroup v1 limit)" in last, last
    assert "has 0." in last or "MB (cgroup" in last, last  # the limit's numbers, not the host's
    assert last.endswith("even with one sequence of 131072 tokens"), last
