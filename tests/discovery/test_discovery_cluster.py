"""Discovery end to end: real `tandem join` processes, zeroconf and control over 127.0.0.1."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from discovery.capabilities import RdmaDevice
from discovery.cluster_key import parse_key
from discovery.control import AssignRole, Hello, Ready, dial_control
from discovery.framing import ChannelTimeout
from discovery.membership import BUSY, CONNECTED, LOST, UNVERIFIED, Member, Membership, browse_peers
from discovery.node_identity import StateDirLock, load_or_create_node_id
from discovery.zeroconf_service import PeerRecord, decode_txt, encode_txt
from errors import ChannelError, ConfigError, PeerError
from tests.helpers.cluster import (
    LOOPBACK,
    AgentPool,
    new_key_text,
    pid_exists,
    run_cli,
    wait_until,
)

pytestmark = pytest.mark.cluster

MIB = 1024**2
DISCOVERY_S = 2.0
LOST_AFTER_S = 2.0
HEARTBEAT_S = 0.5
READY_TIMEOUT_S = 15.0


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[AgentPool]:
    agents = AgentPool(tmp_path)
    try:
        yield agents
    finally:
        agents.stop_all()


@contextmanager
def membership_for(pool: AgentPool, key_text: str | None = None, **options) -> Iterator[Membership]:
    options.setdefault("lost_after_s", LOST_AFTER_S)
    options.setdefault("heartbeat_interval_s", HEARTBEAT_S)
    membership = Membership(parse_key(key_text or pool.cluster_key), interface=LOOPBACK, **options)
    try:
        yield membership
    finally:
        membership.close()


def by_id(members: list[Member]) -> dict[str, Member]:
    return {member.node_id: member for member in members}


def start_agents(pool: AgentPool, *names: str, **options):
    """Start several agents at once (their startups overlap), then wait for each."""
    started = [pool.start(name, wait_ready=False, **options) for name in names]
    return [agent.wait_ready() for agent in started]


def member_of(membership: Membership, node_id: str) -> Member:
    return by_id(membership.members())[node_id]


# -- single-process pieces ----------------------------------------------------------------------


def test_node_id_is_created_once_and_kept(tmp_path: Path) -> None:
    node_id, created = load_or_create_node_id(tmp_path / "state")
    again, created_again = load_or_create_node_id(tmp_path / "state")
    assert created and not created_again
    assert node_id == again
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "node-id").write_text("Not A Valid/Id\n")
    with pytest.raises(ConfigError, match="not a valid node id"):
        load_or_create_node_id(tmp_path / "bad")


def test_state_dir_lock_refuses_a_second_holder(tmp_path: Path) -> None:
    first, second = StateDirLock(tmp_path), StateDirLock(tmp_path)
    first.acquire("node-a")
    try:
        with pytest.raises(ConfigError, match="duplicate node id node-a"):
            second.acquire("node-a")
    finally:
        first.release()
    second.acquire("node-a")  # free again once released
    second.release()


def test_txt_record_round_trip_carries_no_key() -> None:
    record = PeerRecord(
        node_id="mac-1a2b3c4d",
        addresses=("10.0.0.2",),
        port=7070,
        cluster_id="00ff00ff00ff00ff",
        version="0.1.0",
        platform="macOS-26.2-arm64",
        memory_total=64 * 1024**3,
        memory_available=50 * 1024**3,
        backends=("jaccl", "ring"),
        rdma_devices=(RdmaDevice("rdma_en3", "PORT_ACTIVE"), RdmaDevice("rdma_en4", "PORT_DOWN")),
    )
    properties = {key.encode(): value.encode() for key, value in encode_txt(record).items()}
    assert decode_txt(properties, record.addresses, 0) == record
    assert all(len(value) < 255 for value in properties.values())
    assert not any(value.startswith(b"tandem-") for value in properties.values())


# -- real agents ---------------------------------------------------------------------------------


def test_membership_finds_and_verifies_agents_with_memory_limit(pool: AgentPool) -> None:
    big = pool.start("big", wait_ready=False)
    small = pool.start("small", memory_limit="512M", wait_ready=False)
    big.wait_ready(), small.wait_ready()
    with membership_for(pool) as membership:
        members = by_id(membership.discover(DISCOVERY_S))
        assert {big.node_id, small.node_id} <= set(members), pool.logs()
        for agent in (big, small):
            member = members[agent.node_id]
            assert member.state == CONNECTED and member.verified, member
            assert (member.address, member.port) == (LOOPBACK, agent.port)
            assert member.hello is not None and "ring" in member.hello.backends
        limited = members[small.node_id]
        assert 0 < limited.hello.memory_total <= 512 * MIB
        assert 0 < limited.memory_available <= 512 * MIB
        assert limited.record is not None and limited.record.memory_available <= 512 * MIB
        assert members[big.node_id].hello.memory_total > 512 * MIB
        resources = {resource.node_id: resource for resource in membership.to_resources()}
        assert resources[small.node_id].memory_bytes <= 512 * MIB
        assert resources[big.node_id].backends == ("ring",)
        # Heartbeats keep arriving.
        time.sleep(3 * HEARTBEAT_S)
        age = member_of(membership, big.node_id).last_heartbeat_age_s
        assert age is not None and age < 3 * HEARTBEAT_S


def test_agent_of_another_cluster_is_unverified_and_never_assigned(pool: AgentPool) -> None:
    ours = pool.start("ours")
    theirs = pool.start("theirs", cluster_key=new_key_text())
    with membership_for(pool) as membership:
        members = by_id(membership.discover(DISCOVERY_S))
        assert members[ours.node_id].state == CONNECTED, pool.logs()
        stranger = members[theirs.node_id]
        assert stranger.state == UNVERIFIED and not stranger.verified
        assert "cluster id mismatch" in stranger.reason
        assert theirs.node_id not in {r.node_id for r in membership.to_resources()}
        with pytest.raises(PeerError, match="cannot assign"):
            membership.assign(theirs.node_id, "tp_rank", {"mode": "ready"})
    # Dialled directly (as from a hostfile), the other cluster fails the handshake itself.
    # Ours may still be ending the first session (busy) for a moment: dial again until free.
    deadline = time.monotonic() + 5
    while True:
        with membership_for(pool) as membership:
            addresses = [(LOOPBACK, theirs.port), (LOOPBACK, ours.port)]
            states = {member.node_id: member for member in membership.discover(addresses=addresses)}
            stranger = states[f"{LOOPBACK}:{theirs.port}"]
            assert stranger.state == UNVERIFIED and "handshake failed" in stranger.reason
            if states[ours.node_id].state == CONNECTED:
                break
            assert states[ours.node_id].state == BUSY and time.monotonic() < deadline
        time.sleep(0.2)


def test_stopped_and_frozen_agents_are_declared_lost(pool: AgentPool) -> None:
    stopped, frozen, steady = start_agents(pool, "stopped", "frozen", "steady")
    lost: queue.Queue[tuple[str, str, float]] = queue.Queue()
    with membership_for(pool, on_member_lost=lambda n, r: lost.put((n, r, time.monotonic()))) as m:
        members = by_id(m.discover(DISCOVERY_S))
        assert all(members[a.node_id].state == CONNECTED for a in (stopped, frozen, steady))
        began = time.monotonic()
        stopped.stop()
        node_id, reason, at = lost.get(timeout=LOST_AFTER_S + 3)
        assert node_id == stopped.node_id and at - began < LOST_AFTER_S + 2, reason
        # A frozen process keeps its socket open: only the missing heartbeats reveal it.
        frozen.signal(signal.SIGSTOP)
        began = time.monotonic()
        node_id, reason, at = lost.get(timeout=LOST_AFTER_S + 4)
        assert node_id == frozen.node_id and "no heartbeat" in reason
        assert LOST_AFTER_S - HEARTBEAT_S <= at - began < LOST_AFTER_S + 2.5
        assert member_of(m, frozen.node_id).state == LOST
        assert member_of(m, steady.node_id).state == CONNECTED
        assert {r.node_id for r in m.to_resources()} == {steady.node_id}
        with pytest.raises(queue.Empty):
            lost.get(timeout=2 * HEARTBEAT_S)


def test_duplicate_node_ids_are_refused(pool: AgentPool, tmp_path: Path) -> None:
    first = pool.start("first")
    same_dir = pool.start("again", state_dir=first.state_dir, wait_ready=False)
    assert same_dir.wait_exit(20) != 0
    assert "duplicate node id " + first.node_id in same_dir.log_text()
    # A cloned machine: another state dir holding the same node id; zeroconf reveals it.
    clone_dir = tmp_path / "clone"
    clone_dir.mkdir()
    (clone_dir / "node-id").write_text((first.state_dir / "node-id").read_text())
    clone = pool.start("clone", state_dir=clone_dir, wait_ready=False)
    assert clone.wait_exit(20) != 0
    log = clone.log_text()
    assert f"duplicate node id {first.node_id}" in log and f"{LOOPBACK}:{first.port}" in log
    assert len([line for line in log.splitlines() if "error" in line]) == 1
    assert first.alive


def test_join_without_a_key_is_a_one_line_error(tmp_path: Path) -> None:
    result = run_cli(["join", "--interface", LOOPBACK, "--state-dir", str(tmp_path)], timeout_s=30)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0
    assert "needs the cluster key" in result.stderr


def test_peers_lists_what_discovery_sees(pool: AgentPool) -> None:
    ours = pool.start("ours", memory_limit="512M")
    theirs = pool.start("theirs", cluster_key=new_key_text())
    common = ["peers", "--interface", LOOPBACK, "--discovery-timeout", str(DISCOVERY_S)]
    with_key = run_cli([*common, "--cluster-key", pool.cluster_key])
    assert with_key.returncode == 0, with_key.stderr
    lines = {line.split()[0]: line for line in with_key.stdout.splitlines() if line.strip()}
    assert "verified" in lines[ours.node_id] and "512.0M/512.0M" in lines[ours.node_id]
    assert f"{LOOPBACK}:{ours.port}" in lines[ours.node_id]
    assert "ring" in lines[ours.node_id]
    assert "cluster id mismatch" in lines[theirs.node_id]
    without_key = run_cli(common)
    assert without_key.returncode == 0, without_key.stderr
    assert ours.node_id in without_key.stdout and theirs.node_id in without_key.stdout
    assert "not checked" in without_key.stdout
    # `tandem peers` let go of the agents: a coordinator can claim them.
    with membership_for(pool) as membership:
        members = by_id(membership.discover(DISCOVERY_S))
        assert members[ours.node_id].state == CONNECTED


def test_browse_peers_sees_registration_and_removal(pool: AgentPool) -> None:
    agent = pool.start("agent")
    assert agent.node_id in {r.node_id for r in browse_peers(LOOPBACK, DISCOVERY_S)}
    assert agent.stop() == 0
    assert "stopped" in agent.log_text()
    assert agent.node_id not in {r.node_id for r in browse_peers(LOOPBACK, DISCOVERY_S)}


def test_assign_ready_release_stops_the_worker(pool: AgentPool) -> None:
    agent = pool.start("worker-host")
    with membership_for(pool) as membership:
        membership.discover(DISCOVERY_S)
        payload = {"mode": "ready", "tag": "rank-1"}
        assignment_id = membership.assign(agent.node_id, "tp_rank", payload)
        result = membership.wait_ready(assignment_id, READY_TIMEOUT_S)
        assert result.node_id == agent.node_id and result.detail["echo"] == payload
        worker_pid = result.detail["pid"]
        assert pid_exists(worker_pid)
        assert wait_until(
            lambda: (
                (
                    member_of(membership, agent.node_id).worker_pid,
                    member_of(membership, agent.node_id).worker_state,
                )
                == (worker_pid, "ready")
            ),
            5,
        ), member_of(membership, agent.node_id)
        # One assignment at a time.
        second = membership.assign(agent.node_id, "pp_stage", payload)
        with pytest.raises(PeerError, match="already running"):
            membership.wait_ready(second, READY_TIMEOUT_S)
        # The agent reports idle only once the worker process is gone.
        assert membership.release(agent.node_id, wait_s=5)
        assert not pid_exists(worker_pid), "worker still running"
        assert member_of(membership, agent.node_id).agent_state == "idle"
        # Released, the agent takes a new assignment.
        again = membership.assign(agent.node_id, "pp_stage", {"mode": "ready"})
        new_pid = membership.wait_ready(again, READY_TIMEOUT_S).detail["pid"]
        assert new_pid != worker_pid and pid_exists(new_pid)
    # The coordinator went away: the agent stops the worker by itself.
    assert wait_until(lambda: not pid_exists(new_pid), 10), "worker outlived its coordinator"
    assert agent.alive


def test_worker_failures_are_relayed(pool: AgentPool) -> None:
    agent = pool.start("failing-host")
    failures: queue.Queue[tuple[str, str, str]] = queue.Queue()
    with membership_for(pool, on_assignment_failed=lambda *args: failures.put(args)) as membership:
        membership.discover(DISCOVERY_S)
        reported = membership.assign(agent.node_id, "tp_rank", {"mode": "fail", "tag": "x1"})
        with pytest.raises(PeerError, match="fake failure for x1"):
            membership.wait_ready(reported, READY_TIMEOUT_S)
        crashed = membership.assign(agent.node_id, "tp_rank", {"mode": "crash"})
        with pytest.raises(PeerError, match="exited with code 3: fake worker crashed on purpose"):
            membership.wait_ready(crashed, READY_TIMEOUT_S)
        # A stubborn worker ignores SIGTERM; release escalates to SIGKILL.
        stubborn = membership.assign(agent.node_id, "tp_rank", {"mode": "stubborn"})
        pid = membership.wait_ready(stubborn, READY_TIMEOUT_S).detail["pid"]
        began = time.monotonic()
        assert membership.release_all("test", wait_s=10)
        assert not pid_exists(pid), "stubborn worker survived release"
        assert time.monotonic() - began >= 2.5  # SIGTERM was ignored for the grace period
        # A worker that dies after ready is reported through the callback.
        late = membership.assign(agent.node_id, "tp_rank", {"mode": "ready"})
        pid = membership.wait_ready(late, READY_TIMEOUT_S).detail["pid"]
        os.kill(pid, signal.SIGKILL)
        node_id, assignment_id, reason = failures.get(timeout=10)
        assert (node_id, assignment_id) == (agent.node_id, late)
        assert "exited with code -9 (SIGKILL)" in reason
        assert member_of(membership, agent.node_id).state == CONNECTED


def test_agent_serves_one_coordinator_and_can_be_claimed_again(pool: AgentPool) -> None:
    agent = pool.start("shared")
    with membership_for(pool) as first:
        assert member_of_discovered(first, agent.node_id).state == CONNECTED
        with membership_for(pool) as second:
            busy = member_of_discovered(second, agent.node_id)
            assert busy.state == BUSY and busy.verified and "busy" in busy.reason
            assert second.to_resources() == []
        assignment_id = first.assign(agent.node_id, "tp_rank", {"mode": "ready"})
        pid = first.wait_ready(assignment_id, READY_TIMEOUT_S).detail["pid"]
    assert wait_until(lambda: not pid_exists(pid), 10)
    with membership_for(pool) as third:
        assert wait_until(
            lambda: member_of_discovered(third, agent.node_id).state == CONNECTED, 10
        ), pool.logs()
        assignment_id = third.assign(agent.node_id, "tp_rank", {"mode": "ready"})
        assert third.wait_ready(assignment_id, READY_TIMEOUT_S).detail["pid"]


def member_of_discovered(membership: Membership, node_id: str) -> Member:
    return by_id(membership.discover(DISCOVERY_S))[node_id]


def test_sigterm_stops_agent_and_its_worker(pool: AgentPool) -> None:
    agent = pool.start("terminated")
    lost: queue.Queue[str] = queue.Queue()
    with membership_for(pool, on_member_lost=lambda node_id, reason: lost.put(node_id)) as m:
        m.discover(DISCOVERY_S)
        pid = m.wait_ready(m.assign(agent.node_id, "tp_rank", {"mode": "ready"}), READY_TIMEOUT_S)
        pid = pid.detail["pid"]
        agent.signal(signal.SIGTERM)
        assert agent.wait_exit(15) == 0, agent.log_text()
        assert lost.get(timeout=5) == agent.node_id
        assert not pid_exists(pid)


def test_silent_coordinator_is_dropped_and_its_worker_stopped(pool: AgentPool) -> None:
    agent = pool.start("abandoned", lost_after_s=LOST_AFTER_S)
    connection = dial_control(LOOPBACK, agent.port, parse_key(pool.cluster_key), 5.0)
    try:
        hello = connection.recv(5.0)
        assert isinstance(hello, Hello) and hello.node_id == agent.node_id
        connection.send(AssignRole(role="tp_rank", assignment_id="a1", payload={"mode": "ready"}))
        assigned = time.monotonic()
        pid = None
        while pid is None:  # heartbeats first, then Ready; never answer any of them
            message = connection.recv(READY_TIMEOUT_S)
            if isinstance(message, Ready):
                pid = message.detail["pid"]
        closed = None
        while closed is None and time.monotonic() - assigned < LOST_AFTER_S + 5:
            try:
                connection.recv(1.0)
            except ChannelTimeout:
                continue
            except ChannelError as error:  # the agent hung up on us
                closed = error
        assert closed is not None, "the agent kept talking to a silent coordinator"
        assert LOST_AFTER_S - 0.5 <= time.monotonic() - assigned < LOST_AFTER_S + 3
        assert not pid_exists(pid), "the agent kept the worker of a silent coordinator"
    finally:
        connection.close()
    assert "no message from the coordinator" in agent.log_text()
    with membership_for(pool) as membership:
        assert member_of_discovered(membership, agent.node_id).state == CONNECTED
