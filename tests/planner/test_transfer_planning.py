"""Agents report their model cache to the planner, and transfer progress extends the ready wait:
real `tandem join` processes on 127.0.0.1 (a fake role worker stands in for the transfer)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from discovery.cluster_key import parse_key
from discovery.control import HeldModel
from discovery.membership import Membership
from engines.weights.holdings import with_holdings
from errors import PeerError
from planner import NodeResources
from tests.helpers.cluster import LOOPBACK, AgentPool

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
WHOLE = "a" * 64
SHARE = "b" * 64


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[AgentPool]:
    agents = AgentPool(tmp_path)
    try:
        yield agents
    finally:
        agents.stop_all()


@pytest.fixture
def membership(pool: AgentPool) -> Iterator[Membership]:
    with Membership(
        parse_key(pool.cluster_key), interface=LOOPBACK, lost_after_s=3.0, heartbeat_interval_s=0.5
    ) as members:
        yield members


def plant_copy(models: Path, content_hash: str, subset: str = "", size: int = 10) -> None:
    """A copy as engines/weights/fetch.py leaves it: its files, then the manifest."""
    directory = models / content_hash
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"x" * size)
    files = [{"name": "model.safetensors", "size": 10, "sha256": "0" * 64}]
    (directory / "tandem-manifest.json").write_text(json.dumps({"files": files, "subset": subset}))


def test_the_agent_reports_free_disk_and_verified_copies(
    pool: AgentPool, membership: Membership, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    plant_copy(cache / "models", WHOLE)
    plant_copy(cache / "models", SHARE, subset=f"layers 2-3 + head of {WHOLE}")
    plant_copy(cache / "models", "c" * 64, size=4)  # a file cut short: not a verified copy
    plant_copy(cache / "models", "e" * 64, subset=f"tp rank 1 of 2 of {WHOLE}")
    agent = pool.start("holder", extra_args=["--cache-dir", str(cache)])
    membership.discover(2.0)
    (member,) = [m for m in membership.members() if m.node_id == agent.node_id]
    assert member.model_cache is not None and member.model_cache.free_bytes > 0
    assert member.model_cache.models == [
        HeldModel(content_hash=WHOLE),
        HeldModel(content_hash=SHARE, share_of=WHOLE, layers=[2, 4]),
        HeldModel(content_hash="e" * 64, share_of=WHOLE, tp_rank=[1, 2]),
    ]
    (resources,) = [r for r in membership.to_resources() if r.node_id == agent.node_id]
    assert resources.disk_free_bytes == member.model_cache.free_bytes
    coordinator = NodeResources("coord", LOOPBACK, 2**30, ())
    planned = with_holdings([coordinator, resources], membership.members(), lambda: WHOLE)
    assert planned[0].holds_model
    assert planned[1].holds_model and planned[1].held_stages == ((2, 4),)
    assert planned[1].held_ranks == ((1, 2),)
    other = with_holdings([coordinator, resources], membership.members(), lambda: "d" * 64)
    assert not other[1].holds_model and other[1].held_stages == () == other[1].held_ranks


def test_progress_extends_the_ready_wait_and_a_stall_ends_it(
    pool: AgentPool, membership: Membership
) -> None:
    agent = pool.start("receiver")
    membership.discover(2.0)
    # 2 s of progress, a ready timeout of 0.5 s: the wait goes on while bytes arrive.
    payload = {"mode": "progress", "steps": 10, "every_s": 0.2}
    started = time.monotonic()
    ready = membership.wait_ready(membership.assign(agent.node_id, "pp_stage", payload), 0.5, 1.5)
    assert time.monotonic() - started >= 1.9 and ready.detail["echo"] == payload
    (member,) = [m for m in membership.members() if m.node_id == agent.node_id]
    assert member.transfer is not None and member.transfer.done_bytes == 10_000
    assert membership.release(agent.node_id, "next", wait_s=5.0)
    # Progress that stops: the wait ends one stall timeout after the last event.
    stalled = {"mode": "progress", "steps": 3, "every_s": 0.2, "total": 9000, "then": "stall"}
    started = time.monotonic()
    with pytest.raises(PeerError, match="transfer stalled: no progress for 1 s"):
        membership.wait_ready(membership.assign(agent.node_id, "pp_stage", stalled), 0.5, 1.0)
    assert 1.5 <= time.monotonic() - started < 4.0
    assert membership.release(agent.node_id, "next", wait_s=5.0)
    # tp: the coordinator waits for the model in place (all of it arrived), then for ready.
    assignment = membership.assign(agent.node_id, "tp_rank", payload)
    membership.wait_model(assignment, 0.5, 1.5)
    (member,) = [m for m in membership.members() if m.node_id == agent.node_id]
    assert member.transfer is not None and member.transfer.done_bytes == 10_000
    assert membership.wait_ready(assignment, 5.0).detail["echo"] == payload


def test_serve_refuses_or_plans_around_an_agent_short_on_disk(
    pool: AgentPool, demo_model_dir: Path, tmp_path: Path
) -> None:
    """`tandem join --disk-limit 1M`: an explicit pp is refused with the numbers, auto serves
    without that agent."""
    from tests.helpers.serve import start_serve

    cache = tmp_path / "agent-cache"
    agent = pool.start("tight", extra_args=["--cache-dir", str(cache), "--disk-limit", "1M"])
    refused = start_serve(
        tmp_path, demo_model_dir, pool.cluster_key, ["--parallelism", "pp"], wait=False, name="pp"
    )
    try:
        assert refused.process.wait(timeout=60) == 2
    finally:
        refused.stop()
    assert re.search(
        rf"refusing to serve: pp disk: {agent.node_id} lacks layers \d+-\d+ \+ head: needs "
        r"[\d.]+ MB of disk to receive it, has 1\.0 MB free \(short by [\d.]+ MB\)",
        refused.log_text(),
    ), refused.log_text()
    server = start_serve(
        tmp_path, demo_model_dir, pool.cluster_key, ["--parallelism", "auto"], name="auto"
    )
    try:
        cluster = server.cluster()
        assert cluster["strategy"] == "single"
        assert cluster["reason"].startswith(
            f"auto without {agent.node_id} (too little disk to receive the model); "
        )
        assert not next(c for c in cluster["plan"]["checks"] if c["name"] == "pp disk")["passed"]
    finally:
        server.stop()


def run_plan(pool: AgentPool, model: Path, tmp_path: Path, *extra: str):
    command = [
        sys.executable, "-m", "cli.main", "plan", "--model", str(model),
        "--cluster-key", pool.cluster_key, "--interface", LOOPBACK, "--discovery-timeout", "3",
        "--state-dir", str(tmp_path / "plan-state"), "--cache-dir", str(tmp_path / "plan-cache"),
        "--memory-limit", "8G", *extra,
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_tandem_plan_plans_the_live_cluster_as_serve_would(
    pool: AgentPool, demo_model_dir: Path, tmp_path: Path
) -> None:
    """Prefix cache, precision and the disk rule: the same planning function as `serve`."""
    pool.start("roomy", memory_limit="8G", extra_args=["--cache-dir", str(tmp_path / "c1")])
    result = run_plan(pool, demo_model_dir, tmp_path, "--parallelism", "pp")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(
        r"PASS pp disk: \S+ holds layers 0-1; \S+ receives layers 2-3 \+ head: needs", result.stdout
    )
    assert "prefix cache: off" not in result.stdout  # auto, as serve plans it
    off = run_plan(
        pool, demo_model_dir, tmp_path, "--parallelism", "pp", "--prefix-cache-bytes", "0"
    )
    assert "prefix cache: off" in off.stdout

    pool.stop_all()
    pool.start(
        "cramped",
        memory_limit="8G",
        extra_args=["--cache-dir", str(tmp_path / "c2"), "--disk-limit", "1K"],
    )
    refused = run_plan(pool, demo_model_dir, tmp_path, "--parallelism", "pp")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "FAIL pp disk:" in refused.stdout and "lacks" in refused.stdout


def test_a_failure_can_be_seen_before_the_wait_that_settles_it(
    pool: AgentPool, membership: Membership
) -> None:
    agent = pool.start("failing")
    membership.discover(2.0)
    assignment = membership.assign(agent.node_id, "pp_stage", {"mode": "fail"})
    deadline = time.monotonic() + 10.0
    while membership.failure_of(assignment) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = membership.failure_of(assignment)
    assert seen is not None and "fake failure" in seen
    # looking did not settle it: the wait still returns the same failure, then forgets it
    with pytest.raises(PeerError, match="fake failure"):
        membership.wait_ready(assignment, 1.0)
    assert membership.failure_of(assignment) is None
    assert membership.release(agent.node_id, "next", wait_s=5.0)
