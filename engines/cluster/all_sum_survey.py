"""The measured 2-rank all_sum between the coordinator and one member, for the planner's tp
prediction: rank 0 runs here in a child process, rank 1 on the member as its agent's
`collective_probe` role (engines/model/collective_probe.py), joined in a ring over the
addresses tp would use. Given the model's config, the same two ranks then time a tp layer of
it, all_sums included (engines/model/tp_step_probe.py). Bounded: a peer that never joins fails
within ALL_SUM_TIMEOUT_S, and a member whose rank fails ends the wait at once.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery.framing import free_port
from discovery.json_child import ChildNotReady, JsonChild
from engines.cluster.launch import DEFAULT_RING_PORT_BASE, ring_port
from planner.errors import PeerError
from planner.speed import Curve, RankCpu

log = logging.getLogger(__name__)

COLLECTIVE_ROLE = "collective_probe"
COLLECTIVE_MODULE = "engines.model.collective_probe"
ALL_SUM_TIMEOUT_S = 30.0  # both ranks start, join the ring, time their all_sums and tp steps
# Each rank ends itself this much later than the coordinator stops waiting, so the wait, not
# the rank's own watchdog, names what went wrong.
RANK_GRACE_S = 5.0
MEMBER_CHECK_S = 0.25  # how often rank 0's wait looks at whether the member's rank failed
PEER_ANSWER_S = 2.0  # the member's own outcome, once rank 0 is done (or failed)
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


def measure_all_sum(
    membership: Any,
    node_id: str,
    here: str,
    member_address: str,
    probe: AllSumProbe,
    port_base: int = DEFAULT_RING_PORT_BASE,
) -> GroupSpeed:
    """The median seconds of one 2-rank all_sum (and tp layer) by rows between this machine
    (reached at `here`) and `node_id`; PeerError naming the ranks and addresses when it was not
    measured."""
    # Rank 0 runs here, so any free port works (tp's own rank 0 may hold the base port);
    # the member's free ports are unknown here, so rank 1 takes the one tp would use.
    member_port = ring_port(member_address, 1, port_base)
    hosts = [[f"{here}:{free_port(here)}"], [f"{member_address}:{member_port}"]]
    what = f"the all_sum probe between here ({hosts[0][0]}) and {node_id} ({hosts[1][0]})"
    assignment = membership.assign(node_id, COLLECTIVE_ROLE, probe.payload(1, hosts))
    command = [sys.executable, "-m", COLLECTIVE_MODULE]
    child = JsonChild(command, name="all_sum probe", cwd=PROJECT_ROOT)
    ready = None
    try:
        try:
            child.start(probe.payload(0, hosts))
            ready = _rank0_ready(child, membership, assignment, ALL_SUM_TIMEOUT_S)
        except ChildNotReady as error:
            _, member = _member_outcome(membership, assignment)
            raise PeerError(f"{what} failed: {error}{member}") from None
        # settles the member's assignment; its rank's own CPU times come with it
        member_measured, _ = _member_outcome(membership, assignment)
    finally:
        # A rank still joining holds the GIL and never reads stdin: SIGTERM ends it.
        child.stop(STOP_GRACE_S, ask=child.close_stdin if ready else None)
        membership.release(node_id, "all_sum measured", wait_s=STOP_GRACE_S)
    measured = ready.get("collective", {})
    points = measured.get("all_sum")
    if not isinstance(points, list) or not points:
        raise PeerError(f"{what} answered no measurement: {ready}")
    if "tp_layer" not in measured:
        return GroupSpeed(Curve.from_json(points))
    layer, rest = (Curve.from_json(measured[key]) for key in ("tp_layer", "tp_rest"))
    here_cpu, member_cpu = _rank_cpu(measured), _rank_cpu(member_measured)
    both = None if here_cpu is None or member_cpu is None else (here_cpu, member_cpu)
    return GroupSpeed(Curve.from_json(points), layer, rest, both)


def _rank0_ready(
    child: JsonChild, membership: Any, assignment: str, timeout_s: float
) -> dict[str, Any]:
    """Rank 0's ready line; ChildNotReady when `timeout_s` passes, or as soon as the member's
    rank has failed (rank 0 would only go on waiting for it to join the ring)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            return child.wait_ready(max(min(MEMBER_CHECK_S, remaining), 0.0))
        except ChildNotReady as error:
            if not error.timed_out:
                raise
        if membership.failure_of(assignment) is not None:
            raise ChildNotReady("stopped waiting for rank 0: the member's rank failed")
        if remaining <= MEMBER_CHECK_S:
            reason = f"no ready line within {timeout_s:g} s; last log: {child.last_log()}"
            raise ChildNotReady(reason, timed_out=True)


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
