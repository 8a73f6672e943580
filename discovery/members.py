"""What the coordinator knows of each agent: member states, Member snapshots, link bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass

from discovery.control import (
    ControlConnection,
    Heartbeat,
    Hello,
    MemoryReport,
    ModelCache,
    Progress,
)
from discovery.zeroconf_service import PeerRecord

CONNECTED = "connected"  # verified, heartbeating, assignable
BUSY = "busy"  # verified, but serving another coordinator
LOST = "lost"  # was connected, then went silent or closed
UNVERIFIED = "unverified"  # other cluster, failed handshake, or unreachable
CLOSED = "closed"  # this Membership was closed
AGENT_IDLE = "idle"


@dataclass(frozen=True, slots=True)
class Member:
    """A snapshot of one agent as this coordinator knows it."""

    node_id: str
    address: str
    port: int
    state: str
    verified: bool
    reason: str  # why it is unverified, busy or lost; empty when connected
    hello: Hello | None
    record: PeerRecord | None
    last_heartbeat_age_s: float | None
    agent_state: str | None  # the agent's own state: idle / working
    worker_state: str | None
    worker_pid: int | None
    memory_available: int
    assignment_id: str | None
    memory: MemoryReport | None = None  # from the last heartbeat: the agent's memory tier
    model_cache: ModelCache | None = None  # its free cache disk and verified copies
    transfer: Progress | None = None  # the last progress of a model transfer to it
    transfer_age_s: float | None = None


@dataclass(slots=True)
class Link:
    """Mutable bookkeeping for one agent; only touched under Membership._lock."""

    node_id: str
    address: str
    port: int
    state: str
    reason: str = ""
    record: PeerRecord | None = None
    hello: Hello | None = None
    connection: ControlConnection | None = None
    last_heard: float | None = None
    heartbeat: Heartbeat | None = None
    heartbeat_at: float = 0.0  # local monotonic time the last heartbeat arrived
    assignment_id: str | None = None
    transfer: Progress | None = None  # the assignment's last transfer progress
    transfer_at: float = 0.0

    def snapshot(self, now: float) -> Member:
        memory = self.hello.memory_available if self.hello else 0
        if self.heartbeat is not None:
            memory = self.heartbeat.memory_available
        elif self.hello is None and self.record is not None:
            memory = self.record.memory_available
        return Member(
            node_id=self.node_id,
            address=self.address,
            port=self.port,
            state=self.state,
            verified=self.hello is not None,
            reason=self.reason,
            hello=self.hello,
            record=self.record,
            last_heartbeat_age_s=None if self.last_heard is None else now - self.last_heard,
            agent_state=self.heartbeat.state if self.heartbeat else None,
            worker_state=self.heartbeat.worker_state if self.heartbeat else None,
            worker_pid=self.heartbeat.worker_pid if self.heartbeat else None,
            memory_available=memory,
            assignment_id=self.assignment_id,
            memory=self.heartbeat.memory if self.heartbeat else None,
            model_cache=(self.heartbeat and self.heartbeat.model_cache)
            or (self.hello.model_cache if self.hello else None),
            transfer=self.transfer,
            transfer_age_s=now - self.transfer_at if self.transfer else None,
        )

    def has_released(self, since: float) -> bool:
        """Whether a released link said "idle" after `since`, or stopped being connected."""
        if self.state != CONNECTED:
            return True
        heartbeat = self.heartbeat
        return heartbeat is not None and heartbeat.state == AGENT_IDLE and self.heartbeat_at > since
