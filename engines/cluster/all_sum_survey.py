"""The measured 2-rank all_sum between the coordinator and one member, for the planner's tp
prediction: rank 0 runs on the member as its agent's `collective_probe` role
(engines/tensor_parallel/collective_probe.py), rank 1 here in a child process, joined in a ring
over the addresses tp would use. The member is rank 0 because mlx's rank 0 listens first and waits,
while the last rank connects, retrying after 1, 2, 4 and 8 s: the member's rank can start
early and wait, and this side connects at once when it comes. Given the model's config, the
same two ranks then time a tp layer of it, all_sums included (engines/model/tp_step_probe.py).
Bounded: a peer that never joins fails within ALL_SUM_TIMEOUT_S, and a member whose rank fails
ends the wait at once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery.framing import free_port
from discovery.json_child import ChildNotReady, JsonChild
from engines.cluster.launch import DEFAULT_RING_PORT_BASE, ring_port
from errors import PeerError
from planner.speed import Curve, RankCpu

log = logging.getLogger(__name__)

COLLECTIVE_ROLE = "collective_probe"
COLLECTIVE_MODULE = "engines.tensor_parallel.collective_probe"
ALL_SUM_TIMEOUT_S = 30.0  # both ranks join the ring, time their all_sums and tp steps
# Starting Python and mlx for the rank here, apart: on a loaded machine it alone can take
# seconds, and none of it is the peer's time.
RANK_START_S = 30.0
# Each rank ends itself this much later than the coordinator stops waiting, so the wait, not
# the rank's own watchdog, names what went wrong.
RANK_GRACE_S = 5.0
MEMBER_CHECK_S = 0.25  # how often the wait here looks at whether the member's rank failed
PEER_ANSWER_S = 2.0  # the member's own outcome, once the rank here is done (or failed)
STOP_GRACE_S = 5.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class AllSumProbe:
    """What both ranks time: all_sums of (rows, hidden_size) in float32 or bfloat16, and, with
    the model's `config`, its decode step sharded over both at those rows."""

    hidden_size: int
    rows: tuple[int, ...]
    float32: bool
    config: dict[str, Any] | None = None

    def payload(self, rank: int, hosts: list[list[str]]) -> dict[str, Any]:
        payload = {
            "rank": rank,
            "hosts": hosts,
            "hidden_size": self.hidden_size,
            "rows": list(self.rows),
            "float32": self.float32,
            "timeout_s": ALL_SUM_TIMEOUT_S + RANK_GRACE_S,
        }
        if self.config is not None:
            payload["config"] = self.config
        return payload


@dataclass(frozen=True, slots=True)
class GroupSpeed:
    """A 2-rank group's measurement, by rows: its all_sum, and one tp layer and the rest of
    the step, in wall time and each rank's CPU time (None unless the probe had a config)."""

    all_sum: Curve
    tp_layer: Curve | None = None
    tp_rest: Curve | None = None
    tp_cpu: tuple[RankCpu, RankCpu] | None = None  # each rank's own CPU time: here, the member


class GroupProbe:
    """One member's 2-rank probe in three steps, so that both ranks' processes can start (and
    import mlx) while other machines measure themselves: prepare() starts this side's rank
    here, idle until its spec comes (call it while this machine has nothing to time); begin()
    assigns rank 0 to the member, which starts it there and waits for this side; finish()
    hands the rank here its spec, waits for both and releases the member. close() ends
    whatever was started, in any state."""

    def __init__(
        self,
        membership: Any,
        node_id: str,
        here: str,
        member_address: str,
        probe: AllSumProbe,
        port_base: int = DEFAULT_RING_PORT_BASE,
    ) -> None:
        self.membership = membership
        self.node_id = node_id
        self.probe = probe
        # Any free port works here (tp's own rank 0 may hold the base port); the member's
        # free ports are unknown here, so its rank takes the one tp's rank 1 would use there.
        member_port = ring_port(member_address, 1, port_base)
        self.hosts = [[f"{member_address}:{member_port}"], [f"{here}:{free_port(here)}"]]
        self.what = (
            f"the all_sum probe between here ({self.hosts[1][0]}) and {node_id} "
            f"({self.hosts[0][0]})"
        )
        command = [sys.executable, "-m", COLLECTIVE_MODULE]
        self._here = JsonChild(command, name="all_sum probe", cwd=PROJECT_ROOT)
        self._assignment: str | None = None
        self._ready: dict[str, Any] | None = None

    def measure(self) -> GroupSpeed:
        """All three steps at once: the median seconds of one 2-rank all_sum (and tp layer) by
        rows; PeerError naming both ends and their addresses when it was not measured."""
        self.prepare()
        self.begin()
        return self.finish()

    def prepare(self) -> None:
        """Start this side's rank; it waits for its spec (OSError if it cannot start)."""
        self._here.start(None)

    def begin(self, head_start_s: float = 0.0) -> None:
        """Assign rank 0 to the member; it waits up to `head_start_s` more for this side (the
        time finish() may come later than now). PeerError when the member refuses at once."""
        payload = self.probe.payload(0, self.hosts)
        payload["timeout_s"] += head_start_s
        self._assignment = self.membership.assign(self.node_id, COLLECTIVE_ROLE, payload)

    def finish(self) -> GroupSpeed:
        """Run the rank here with the member's, then release the member; the group's speed, or
        PeerError naming both ends."""
        try:
            return self._run()
        finally:
            self.close()

    def close(self) -> None:
        # A rank still joining holds the GIL and never reads stdin: SIGTERM ends it.
        if self._here.process is not None:
            ready = self._ready is not None
            self._here.stop(STOP_GRACE_S, ask=self._here.close_stdin if ready else None)
        if self._assignment is not None:
            self._assignment = None
            self.membership.release(self.node_id, "all_sum measured", wait_s=STOP_GRACE_S)

    def _run(self) -> GroupSpeed:
        assignment = self._assignment
        if assignment is None:
            raise PeerError(f"{self.what} was never begun")
        try:
            with contextlib.suppress(OSError, ValueError):  # a rank gone says how, below
                self._here.send(self.probe.payload(1, self.hosts))
            self._ready = _ready_here(self._here, self.membership, assignment, ALL_SUM_TIMEOUT_S)
        except ChildNotReady as error:
            _, member = _member_outcome(self.membership, assignment)
            raise PeerError(f"{self.what} failed: {error}{member}") from None
        # settles the member's assignment; its rank's own CPU times come with it
        member_measured, _ = _member_outcome(self.membership, assignment)
        measured = self._ready.get("collective", {})
        points = measured.get("all_sum")
        if not isinstance(points, list) or not points:
            raise PeerError(f"{self.what} answered no measurement: {self._ready}")
        if "tp_layer" not in measured:
            return GroupSpeed(Curve.from_json(points))
        layer, rest = (Curve.from_json(measured[key]) for key in ("tp_layer", "tp_rest"))
        here_cpu, member_cpu = _rank_cpu(measured), _rank_cpu(member_measured)
        both = None if here_cpu is None or member_cpu is None else (here_cpu, member_cpu)
        return GroupSpeed(Curve.from_json(points), layer, rest, both)


def _ready_here(
    child: JsonChild, membership: Any, assignment: str, timeout_s: float
) -> dict[str, Any]:
    """The ready line of the rank here; ChildNotReady when `timeout_s` passes after it started,
    or as soon as the member's rank has failed (the rank here would only go on trying to
    join it)."""
    _wait_started(child, membership, assignment)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            return child.wait_ready(max(min(MEMBER_CHECK_S, remaining), 0.0))
        except ChildNotReady as error:
            if not error.timed_out:
                raise
        if membership.failure_of(assignment) is not None:
            raise ChildNotReady("stopped waiting: the member's rank failed")
        if remaining <= MEMBER_CHECK_S:
            reason = f"no ready line within {timeout_s:g} s; last log: {child.last_log()}"
            raise ChildNotReady(reason, timed_out=True)


def _wait_started(child: JsonChild, membership: Any, assignment: str) -> None:
    """Until the rank here says it started (its imports done, its spec read); ChildNotReady
    when it failed or exited first, did not start within RANK_START_S, or the member's rank
    failed meanwhile."""
    deadline = time.monotonic() + RANK_START_S
    while True:
        try:
            message = child.next_message(MEMBER_CHECK_S)
        except TimeoutError:
            if membership.failure_of(assignment) is not None:
                raise ChildNotReady("stopped waiting: the member's rank failed") from None
            if time.monotonic() >= deadline:
                reason = f"the rank here did not start within {RANK_START_S:g} s"
                raise ChildNotReady(reason, timed_out=True) from None
            continue
        if message is None:
            raise ChildNotReady(f"it {child.exit_description()}")
        if message.get("event") == "started":
            return
        if message.get("event") != "progress":
            raise ChildNotReady(str(message.get("reason", message)))


def _rank_cpu(measured: dict[str, Any]) -> RankCpu | None:
    """A rank's own CPU time in the tp steps (None from a rank that did not report it)."""
    if "tp_layer_cpu" not in measured or "tp_rest_cpu" not in measured:
        return None
    layer, rest = (Curve.from_json(measured[key]) for key in ("tp_layer_cpu", "tp_rest_cpu"))
    return RankCpu(layer, rest)


def _member_outcome(membership: Any, assignment: str) -> tuple[dict[str, Any], str]:
    """(the member rank's measurement, '') when it answered; ({}, '; the member: <why>') when
    it failed."""
    try:
        result = membership.wait_ready(assignment, PEER_ANSWER_S)
    except PeerError as error:
        return {}, f"; the member: {error}"
    measured = result.detail.get("collective")
    return (measured if isinstance(measured, dict) else {}), ""
