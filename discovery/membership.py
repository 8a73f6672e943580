"""The coordinator's view of the cluster: find agents, verify them, watch heartbeats, assign roles.

Blocking calls (`discover`, `wait_ready`) are meant for a worker thread; from asyncio use
`await asyncio.to_thread(membership.discover, 3.0)`. Receiving, heartbeats and loss detection
run on background threads, and callbacks are called from them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from discovery import cluster_key as cluster_keys
from discovery.assignment_waits import AssignmentWaits, _Pending
from discovery.capabilities import MACHINE_BOUND
from discovery.control import (
    AssignRole,
    ControlConnection,
    Failed,
    Heartbeat,
    Hello,
    Pong,
    Progress,
    Ready,
    Release,
    dial_control,
)
from discovery.framing import ChannelTimeout
from discovery.link_probe import LinkProbes
from discovery.members import BUSY, CLOSED, CONNECTED, LOST, UNVERIFIED, Link, Member
from discovery.zeroconf_service import PeerRecord, browse_records, open_zeroconf
from errors import ChannelError, PeerError
from planner import NodeResources

# Member and its states are imported from here too.
__all__ = [
    "BUSY",
    "CLOSED",
    "CONNECTED",
    "LOST",
    "UNVERIFIED",
    "Member",
    "Membership",
    "browse_peers",
]

logger = logging.getLogger(__name__)

COORDINATOR_STATE = "coordinating"
RELEASE_POLL_S = 0.05

MemberLostCallback = Callable[[str, str], None]
AssignmentFailedCallback = Callable[[str, str, str], None]


def browse_peers(interface: str | None, timeout_s: float) -> list[PeerRecord]:
    """What zeroconf shows right now: every tandem agent that answers within timeout_s."""
    zeroconf = open_zeroconf(interface)
    try:
        return browse_records(zeroconf, timeout_s)
    finally:
        zeroconf.close()


class Membership(AssignmentWaits, LinkProbes):
    """Verified connections to the cluster's agents, kept alive by heartbeats both ways."""

    def __init__(
        self,
        cluster_key: bytes,
        *,
        interface: str | None = None,
        lost_after_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        dial_timeout_s: float = 3.0,
        on_member_lost: MemberLostCallback | None = None,
        on_assignment_failed: AssignmentFailedCallback | None = None,
        coordinator_id: str = "coordinator",
    ) -> None:
        self.cluster_key = cluster_key
        self.cluster_id = cluster_keys.cluster_id(cluster_key)
        self.interface = interface
        self.lost_after_s = lost_after_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dial_timeout_s = dial_timeout_s
        self.on_member_lost = on_member_lost
        self.on_assignment_failed = on_assignment_failed
        self.coordinator_id = coordinator_id
        self._links: dict[str, Link] = {}
        self._pending: dict[str, _Pending] = {}
        self._pings: dict[int, threading.Event] = {}  # link probes awaiting their Pong
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- finding and verifying agents ---------------------------------------------------------

    def discover(
        self, timeout_s: float = 3.0, addresses: Sequence[tuple[str, int]] | None = None
    ) -> list[Member]:
        """Browse zeroconf for timeout_s (or dial `addresses`, e.g. from a hostfile), verify
        every agent of this cluster, and return all members. Connected members are kept."""
        if addresses is None:
            records = browse_peers(self.interface, timeout_s)
            targets = [(record.address, record.port, record) for record in records]
        else:
            targets = [(host, port, None) for host, port in addresses]
        dials = []
        for address, port, record in targets:
            if self._is_connected(record.node_id if record else None, address, port):
                continue
            if record is not None and record.cluster_id != self.cluster_id:
                reason = (
                    f"cluster id mismatch: it advertises {record.cluster_id or 'none'}, this "
                    f"cluster is {self.cluster_id} (it holds another cluster key)"
                )
                self._put_unverified(address, port, record, reason)
                continue
            thread = threading.Thread(
                target=self._verify, args=(address, port, record), daemon=True
            )
            thread.start()
            dials.append(thread)
        deadline = time.monotonic() + 2 * self.dial_timeout_s + 1.0
        for thread in dials:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return self.members()

    def _verify(self, address: str, port: int, record: PeerRecord | None) -> None:
        """Dial one agent, prove the key both ways, read Hello and its first state message."""
        try:
            connection = dial_control(address, port, self.cluster_key, self.dial_timeout_s)
        except ChannelError as error:
            self._put_unverified(address, port, record, f"handshake failed: {error}")
            return
        try:
            hello = connection.recv(self.dial_timeout_s)
            first = connection.recv(self.dial_timeout_s)
            problem = self._check_hello(hello, record)
        except ChannelError as error:
            problem = f"handshake passed, but no Hello and state followed: {error}"
        if problem:
            connection.close()
            self._put_unverified(address, port, record, problem)
            return
        assert isinstance(hello, Hello)
        link = Link(hello.node_id, address, port, CONNECTED, record=record, hello=hello)
        if isinstance(first, Release):  # the agent serves another coordinator
            connection.close()
            link.state, link.reason = BUSY, first.reason
            self._put(link)
            return
        link.connection = connection
        link.last_heard = time.monotonic()
        if isinstance(first, Heartbeat):
            link.heartbeat, link.heartbeat_at = first, link.last_heard
        if not self._put(link):
            connection.close()
            return
        logger.info("member %s verified at %s:%d", hello.node_id, address, port)
        receiver = threading.Thread(
            target=self._receive, args=(link, connection), name=f"member-{link.node_id}"
        )
        receiver.daemon = True
        receiver.start()
        self._ensure_monitor()

    def _check_hello(self, hello: Any, record: PeerRecord | None) -> str:
        if not isinstance(hello, Hello):
            return f"protocol error: expected Hello, got {getattr(hello, 'type', hello)!r}"
        if hello.cluster_id != self.cluster_id:
            return f"cluster id mismatch in Hello: {hello.cluster_id} != {self.cluster_id}"
        if record is not None and hello.node_id != record.node_id:
            return f"node id mismatch: zeroconf says {record.node_id}, Hello says {hello.node_id}"
        return ""

    def _put_unverified(
        self, address: str, port: int, record: PeerRecord | None, reason: str
    ) -> None:
        name = record.node_id if record else f"{address}:{port}"
        logger.info("member %s unverified: %s", name, reason)
        self._put(Link(name, address, port, UNVERIFIED, reason=reason, record=record))

    def _put(self, link: Link) -> bool:
        """Record a link; False (and nothing recorded) once closed or when a connected link
        for the same node already exists."""
        with self._lock:
            previous = self._links.get(link.node_id)
            if self._closed.is_set() or (previous is not None and previous.state == CONNECTED):
                return False
            self._links[link.node_id] = link
            return True

    def _is_connected(self, node_id: str | None, address: str, port: int) -> bool:
        """Whether a connected link already covers this node id (or, without one, address)."""
        with self._lock:
            for link in self._links.values():
                if link.state != CONNECTED:
                    continue
                if link.node_id == node_id or (
                    node_id is None and (link.address, link.port) == (address, port)
                ):
                    return True
            return False

    # -- background: receiving, heartbeats, loss ----------------------------------------------

    def _receive(self, link: Link, connection: ControlConnection) -> None:
        # Long waits: close() closes the connection, which wakes recv at once; silence is the
        # heartbeat thread's business.
        while not self._closed.is_set():
            try:
                message = connection.recv(self.lost_after_s)
            except ChannelTimeout:
                continue
            except ChannelError as error:
                self._declare_lost(link, f"connection closed: {error}")
                return
            with self._lock:
                link.last_heard = time.monotonic()
                if isinstance(message, Heartbeat):
                    link.heartbeat, link.heartbeat_at = message, link.last_heard
            if isinstance(message, Progress):
                self._progress(link, message)
            elif isinstance(message, Ready):
                self._settle(message.assignment_id, detail=dict(message.detail))
            elif isinstance(message, Failed):
                self._assignment_failed(link, message)
            elif isinstance(message, Pong):
                self._pong(message)
            elif isinstance(message, Release):
                self._declare_lost(link, f"the agent released us: {message.reason}")
                return

    def _progress(self, link: Link, message: Progress) -> None:
        with self._lock:
            link.transfer, link.transfer_at = message, time.monotonic()
            pending = self._pending.get(message.assignment_id)
            if pending is not None:
                pending.progress_at = link.transfer_at
                if message.done_bytes >= message.total_bytes:  # all here (0 of 0: nothing to send)
                    pending.arrived.set()

    def _ensure_monitor(self) -> None:
        with self._lock:
            if self._monitor is not None or self._closed.is_set():
                return
            self._monitor = threading.Thread(
                target=self._watch, name="membership-heartbeat", daemon=True
            )
            self._monitor.start()

    def _watch(self) -> None:
        """Send a heartbeat to every connected agent and declare silent ones lost."""
        while not self._closed.wait(self.heartbeat_interval_s):
            now = time.monotonic()
            with self._lock:
                links = [link for link in self._links.values() if link.state == CONNECTED]
            for link in links:
                silence = now - (link.last_heard or now)
                if silence > self.lost_after_s:
                    self._declare_lost(link, f"no heartbeat for {silence:.1f} s")
                    continue
                try:
                    assert link.connection is not None
                    link.connection.send(
                        Heartbeat(
                            node_id=self.coordinator_id,
                            state=COORDINATOR_STATE,
                            memory_available=0,
                            sent_at=time.time(),
                        )
                    )
                except ChannelError as error:
                    self._declare_lost(link, f"heartbeat could not be sent: {error}")

    def _declare_lost(self, link: Link, reason: str) -> None:
        with self._lock:
            if link.state != CONNECTED or self._closed.is_set():
                return
            link.state, link.reason = LOST, reason
            pending = [key for key, wait in self._pending.items() if wait.node_id == link.node_id]
        logger.warning("member %s lost: %s", link.node_id, reason)
        if link.connection is not None:
            link.connection.close()
        for assignment_id in pending:
            self._settle(assignment_id, failure=f"node {link.node_id} was lost: {reason}")
        if self.on_member_lost is not None:
            try:
                self.on_member_lost(link.node_id, reason)
            except Exception:  # noqa: BLE001 - a callback bug must not kill the heartbeat thread
                logger.exception("on_member_lost callback failed for %s", link.node_id)

    def _assignment_failed(self, link: Link, message: Failed) -> None:
        logger.warning(
            "member %s: assignment %s failed: %s",
            link.node_id,
            message.assignment_id,
            message.reason,
        )
        with self._lock:
            if link.assignment_id == message.assignment_id:
                link.assignment_id = None
        # A caller blocked in wait_ready hears it there; a later failure goes to the callback.
        if not self._settle(message.assignment_id, failure=message.reason) and (
            self.on_assignment_failed is not None
        ):
            try:
                self.on_assignment_failed(link.node_id, message.assignment_id, message.reason)
            except Exception:  # noqa: BLE001 - as above
                logger.exception("on_assignment_failed callback failed for %s", link.node_id)

    # -- what the coordinator calls -----------------------------------------------------------

    def members(self) -> list[Member]:
        """Every agent seen, verified or not, sorted by node id."""
        now = time.monotonic()
        with self._lock:
            return [self._links[key].snapshot(now) for key in sorted(self._links)]

    def to_resources(self) -> list[NodeResources]:
        """Planner inputs for the connected, verified members."""
        return [
            NodeResources(
                node_id=member.node_id,
                address=member.address,
                memory_bytes=member.memory_available,
                backends=tuple(member.hello.backends),
                disk_free_bytes=member.model_cache.free_bytes if member.model_cache else None,
                memory_bound=_bound_of(member.hello.memory_bound),
            )
            for member in self.members()
            if member.state == CONNECTED and member.hello is not None
        ]

    def assign(self, node_id: str, role: str, payload: dict[str, Any]) -> str:
        """Ask a connected member to start a worker for `role`; returns the assignment id."""
        assignment_id = uuid.uuid4().hex
        try:
            message = AssignRole(role=role, assignment_id=assignment_id, payload=payload)
        except ValidationError as error:
            raise PeerError(f"cannot assign {role!r} to node {node_id}: {error}") from None
        with self._lock:
            link = self._links.get(node_id)
            if link is None or link.state != CONNECTED or link.connection is None:
                state = "unknown" if link is None else f"{link.state}: {link.reason}"
                raise PeerError(f"cannot assign {role} to node {node_id}: it is {state}")
            connection = link.connection
            link.assignment_id, link.transfer = assignment_id, None
            self._pending[assignment_id] = _Pending(node_id)
        try:
            connection.send(message)
        except ChannelError as error:
            self._declare_lost(link, f"assignment could not be sent: {error}")
            raise PeerError(f"cannot assign {role} to node {node_id}: {error}") from error
        logger.info("assigned %s to %s as %s", role, node_id, assignment_id)
        return assignment_id

    def release(
        self, node_id: str, reason: str = "released by the coordinator", wait_s: float = 0.0
    ) -> bool:
        """Tell a member to stop its worker. With wait_s, block until it reports idle;
        True when it did (or had nothing to release). An unreachable member is declared lost."""
        return self._release_nodes([node_id], reason, wait_s)

    def release_all(self, reason: str = "released by the coordinator", wait_s: float = 0.0) -> bool:
        """release() every connected member at once; True when all reported idle in time."""
        return self._release_nodes([member.node_id for member in self.members()], reason, wait_s)

    def release_nodes(
        self, node_ids: list[str], reason: str = "released by the coordinator", wait_s: float = 0.0
    ) -> bool:
        """release() these members at once (those connected); True when all reported idle."""
        return self._release_nodes(node_ids, reason, wait_s)

    def _release_nodes(self, node_ids: list[str], reason: str, wait_s: float) -> bool:
        sent_at = time.monotonic()
        released = []
        for node_id in node_ids:
            with self._lock:
                link = self._links.get(node_id)
                if link is None or link.state != CONNECTED or link.connection is None:
                    continue
                link.assignment_id = None
                connection = link.connection
            try:
                connection.send(Release(assignment_id=None, reason=reason))
                released.append(link)
            except ChannelError as error:
                self._declare_lost(link, f"release could not be sent: {error}")
        if wait_s <= 0:
            return True
        deadline = sent_at + wait_s
        while True:
            with self._lock:
                waiting = [link.node_id for link in released if not link.has_released(sent_at)]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(RELEASE_POLL_S)
        if waiting:
            logger.warning("no idle heartbeat within %.1f s from %s", wait_s, ", ".join(waiting))
        return not waiting

    def close(self) -> None:
        """Close every connection (agents then release their workers); no callbacks fire."""
        with self._lock:
            self._closed.set()
            links = list(self._links.values())
            monitor = self._monitor
            for link in links:
                if link.state == CONNECTED:
                    link.state, link.reason = CLOSED, "membership closed"
        for link in links:
            if link.connection is not None:
                link.connection.close()
        for pending_id in list(self._pending):
            self._settle(pending_id, failure="membership closed")
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=2.0)

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _bound_of(memory_bound: str) -> str:
    """The planner names a bound only where something caps the machine's memory."""
    return "" if memory_bound == MACHINE_BOUND else memory_bound
