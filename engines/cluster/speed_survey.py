"""Measuring the cluster for the planner: the link to every member (pings over its control
channel), then every node's speed for the model (an agent runs the `speed_probe` role, the
coordinator the same module in a child process, last, having imported mlx meanwhile), one at
a time, each bounded, cached per node;
and, when tp is possible, the all_sum tp would run between the coordinator and each member,
and a tp layer of the model over the same 2 ranks, all_sums included
(engines/cluster/all_sum_survey.py), which pings over the control channel only estimate.
One at a time because a padded ping keeps both ends' CPUs busy sealing and opening, and because
machines that share a host (a lab, VMs) share its memory bandwidth: a probe timed beside
another reads its machine slower than it serves alone.

A node that cannot be measured in time is named in `problems` and left out of the speeds, so
auto plans by the decision rules alone rather than on a guess; no node's probe waits longer than
PROBE_TIMEOUT_S (a few seconds each when they answer). An all_sum that cannot be measured is
named there too, and leaves that link's tp prediction on the pings.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from discovery.json_child import ChildNotReady, JsonChild
from engines.cluster.all_sum_survey import AllSumProbe, GroupProbe
from engines.core.engine import DEFAULT_PREFILL_CHUNK
from engines.model.info import ModelFacts, read_config
from engines.model.precision import on_cpu
from errors import PeerError
from planner import NodeResources
from planner.decision import can_shard
from planner.speed import ClusterSpeeds, Curve, LinkSpeed, NodeSpeed

log = logging.getLogger(__name__)

PROBE_MODULE = "engines.model.speed_probe"
PROBE_TIMEOUT_S = 60.0  # a node's probe; the first one on a machine also imports mlx
RELEASE_WAIT_S = 5.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]
MEASURE_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """What every node measures: the model's config, batch sizes, tp sizes, precision."""

    config: dict[str, Any]
    rows: tuple[int, ...]
    tp_sizes: tuple[int, ...]
    float32: bool
    hidden_size: int = 0

    def all_sum(self) -> AllSumProbe:
        """The all_sums tp would run, and its decode step: one stream, and a full batch."""
        rows = tuple(sorted({1, max(self.rows)}))
        return AllSumProbe(self.hidden_size, rows, self.float32, self.config)

    def payload(self, blas_threads: int = 0) -> dict[str, Any]:
        return {
            "config": self.config,
            "rows": list(self.rows),
            "tp_sizes": list(self.tp_sizes),
            "prefill_chunk": DEFAULT_PREFILL_CHUNK,
            "float32": self.float32,
            "blas_threads": blas_threads,
        }


def probe_spec(
    facts: ModelFacts, world_size: int, max_batch: int, float32: bool, tp: bool = True
) -> ProbeSpec:
    """What to measure; with `tp` False (the operator chose pp or single, which a re-plan keeps)
    no tp shard and no all_sum: seconds of measuring no candidate would use."""
    rows = tuple(sorted({1, *(r for r in (4, 8, 16) if r < max_batch), max_batch}))
    tp_sizes = tuple(
        ranks
        for ranks in range(2, world_size + 1)
        if tp
        and can_shard(facts.attention_heads, ranks)
        and can_shard(facts.kv_heads, ranks)
        and (facts.intermediate_size == 0 or facts.intermediate_size % ranks == 0)
    )
    return ProbeSpec(read_config(facts.path), rows, tp_sizes, float32, facts.hidden_size)


def wants_measuring(measure: str, nodes: list[NodeResources]) -> bool:
    """Whether to measure `nodes` (the coordinator first) for the planner: always under "on"
    (alone too: the plan then shows its prediction beside what it serves), never under "off";
    under "auto" only when a member is another machine (members on this machine's loopback
    share its cores, and what they measure says nothing of a cluster; alone, there is nothing
    to choose between).
    """
    if not nodes or measure == "off":
        return False
    if measure == "on":
        return True
    return len(nodes) > 1 and not all(_on_loopback(node.address) for node in nodes[1:])


def _on_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def node_speed(node_id: str, measured: dict[str, Any]) -> NodeSpeed:
    """The probe's JSON as the planner reads it; ValueError (via PlanError) when malformed."""
    return NodeSpeed(
        node_id,
        Curve.from_json(measured["layer"]),
        Curve.from_json(measured["head"]),
        float(measured["prefill_layer_s"]),
        int(measured["prefill_chunk"]),
        tuple(
            (int(ranks), Curve.from_json(points)) for ranks, points in measured.get("shards", [])
        ),
        float(measured.get("cpu_share", 1.0)),
    )


class SpeedSurvey:
    """The measured speeds of the nodes seen so far, and why any could not be measured."""

    def __init__(
        self, membership: Any | None, coordinator_id: str, coordinator_address: str | None = None
    ) -> None:
        self.membership = membership  # None: a coordinator alone, which measures only itself
        self.coordinator_id = coordinator_id
        # Where members reach this machine (tp's rank 0); None: no all_sum is measured.
        self.coordinator_address = coordinator_address
        self._nodes: dict[str, NodeSpeed] = {}
        self._links: dict[str, LinkSpeed] = {}
        self.problems: dict[str, str] = {}
        self.measured_in_s: float | None = None  # the last measuring of new nodes, whole
        self._lock = threading.Lock()

    def for_plan(
        self, facts: ModelFacts, nodes: list[NodeResources], max_batch: int, tp: bool = True
    ) -> ClusterSpeeds:
        """The speeds of `nodes` for planning `facts` at `max_batch` (float32 on the CPU),
        measuring every node not measured yet at once (only then is the config read); tp's
        shards and all_sums only when tp may be planned (`tp`)."""
        with self._lock:
            missing = [node.node_id for node in nodes if node.node_id not in self._nodes]
        if missing:
            spec = probe_spec(facts, len(nodes), max_batch, on_cpu(), tp)
            log.info("measuring %s for the planner", ", ".join(missing))
            started = time.monotonic()
            links = {node_id: self._measure_link(node_id) for node_id in missing}
            addresses = {node.node_id: node.address for node in nodes}
            self._measure_in_turn(missing, links, addresses, spec)
            with self._lock:
                self.measured_in_s = time.monotonic() - started
            log.info("measured %d node(s) in %.1f s", len(missing), self.measured_in_s)
        with self._lock:
            return ClusterSpeeds(dict(self._nodes), dict(self._links))

    def _measure_in_turn(
        self,
        missing: list[str],
        links: dict[str, LinkSpeed | None],
        addresses: dict[str, str],
        spec: ProbeSpec,
    ) -> None:
        """Each member, then the coordinator, one at a time; and each member's all_sum with
        the coordinator once the next machine has measured itself. Processes start (and
        import mlx, a second and more) on machines that are idle meanwhile: the coordinator's
        probe and this side's rank of each member's group here while a member measures, the
        member's rank there while the next machine measures."""
        here = start_probe_here() if self.coordinator_id in missing else None
        started: list[GroupProbe] = []
        pending: GroupProbe | None = None  # its member's rank starts while the next measures
        try:
            for node_id in missing:
                if node_id == self.coordinator_id or links[node_id] is None:
                    continue
                group = self._group_probe(node_id, addresses[node_id], spec)
                if group is not None:
                    started.append(group)
                self._measure(node_id, spec, links[node_id])
                if pending is not None:
                    self._finish_group(pending)
                pending = None
                if group is not None and node_id in self._links:
                    pending = self._begin_group(group)
            if here is not None:
                self._measure(self.coordinator_id, spec, None, here)
            if pending is not None:
                self._finish_group(pending)
        finally:
            for group in started:
                group.close()
            if here is not None:
                here.stop(5.0, ask=here.close_stdin)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "nodes": {
                    node_id: {
                        "layer_ms": _ms_by_rows(speed.layer),
                        "head_ms": _ms_by_rows(speed.head),
                        "prefill_layer_ms": round(speed.prefill_layer_s * 1000, 2),
                        "cpu_share": speed.cpu_share,
                    }
                    for node_id, speed in self._nodes.items()
                },
                "links": {node_id: _link_status(link) for node_id, link in self._links.items()},
                "problems": dict(self.problems),
                "measured_in_s": None
                if self.measured_in_s is None
                else round(self.measured_in_s, 1),
            }

    def describe(self) -> list[str]:
        """Human lines for `tandem plan`: what was measured, and what could not be."""
        status = self.status()
        lines = [
            f"measured {node_id}: a layer {speed['layer_ms']} ms by rows, head "
            f"{speed['head_ms']} ms, a prefill chunk {speed['prefill_layer_ms']} ms a layer, "
            f"{speed['cpu_share']:g} of a core sustained"
            for node_id, speed in status["nodes"].items()
        ]
        lines += [
            f"measured link to {node_id}: {link['latency_us']} us one way, "
            f"{link['mbit_per_s']} Mbit/s{_describe_all_sum(link.get('all_sum_ms'))}"
            f"{_describe_tp_layer(link.get('tp_layer_ms'), link.get('tp_rest_ms'))}"
            for node_id, link in status["links"].items()
        ]
        lines += [f"not measured {node_id}: {why}" for node_id, why in status["problems"].items()]
        if status["measured_in_s"] is not None:
            lines.append(f"measuring took {status['measured_in_s']:g} s")
        return lines

    def _measure_link(self, node_id: str) -> LinkSpeed | None:
        """The link to a member (None for the coordinator, or when it failed: then named in
        `problems`, and the node is not probed)."""
        if node_id == self.coordinator_id:
            return None
        try:
            measurement = self.membership.measure_link(node_id)
        except Exception as error:  # noqa: BLE001 - any failure leaves this node unmeasured
            self._failed(node_id, error)
            return None
        return LinkSpeed(node_id, measurement.latency_s, measurement.bytes_per_s)

    def _measure(
        self,
        node_id: str,
        spec: ProbeSpec,
        link: LinkSpeed | None,
        here: JsonChild | None = None,
    ) -> None:
        """`node_id`'s speed (the coordinator's in `here`, its started probe process)."""
        try:
            if here is not None:
                speed = node_speed(node_id, measure_here(spec, here))
            else:
                speed = node_speed(node_id, self._measure_member(node_id, spec))
        except Exception as error:  # noqa: BLE001 - any failure leaves this node unmeasured
            self._failed(node_id, error)
            return
        with self._lock:
            self._nodes[node_id] = speed
            if link is not None:
                self._links[node_id] = link
            self.problems.pop(node_id, None)

    def _group_probe(self, node_id: str, address: str, spec: ProbeSpec) -> GroupProbe | None:
        """The all_sum (and tp layer) probe with `node_id`, this side's rank started here;
        None when tp is not possible or that rank cannot start (named in `problems`)."""
        if not spec.tp_sizes or self.coordinator_address is None:
            return None
        group = GroupProbe(
            self.membership, node_id, self.coordinator_address, address, spec.all_sum()
        )
        try:
            group.prepare()
        except OSError as error:
            self._failed(node_id, PeerError(f"all_sum not measured: {error}"))
            return None
        return group

    def _begin_group(self, group: GroupProbe) -> GroupProbe | None:
        """Assign the member its rank (None when it refused: named in `problems`)."""
        try:
            group.begin(head_start_s=PROBE_TIMEOUT_S)  # the next machine's probe comes first
        except Exception as error:  # noqa: BLE001 - any failure leaves the pings' estimate
            self._failed(group.node_id, PeerError(f"all_sum not measured: {error}"))
            return None
        return group

    def _finish_group(self, group: GroupProbe) -> None:
        """The 2-rank all_sum (and tp layer) onto the member's link; a failure is named in
        `problems` and leaves the link on its pings."""
        try:
            measured = group.finish()
        except Exception as error:  # noqa: BLE001 - any failure leaves the pings' estimate
            self._failed(group.node_id, PeerError(f"all_sum not measured: {error}"))
            return
        with self._lock:
            self._links[group.node_id] = replace(
                self._links[group.node_id],
                all_sum=measured.all_sum,
                tp_layer=measured.tp_layer,
                tp_rest=measured.tp_rest,
                tp_cpu=measured.tp_cpu,
            )

    def _failed(self, node_id: str, error: Exception) -> None:
        log.warning("could not measure %s: %s", node_id, error)
        with self._lock:
            self.problems[node_id] = str(error)

    def _measure_member(self, node_id: str, spec: ProbeSpec) -> dict[str, Any]:
        assignment = self.membership.assign(node_id, "speed_probe", spec.payload())
        try:
            result = self.membership.wait_ready(assignment, PROBE_TIMEOUT_S)
        finally:
            self.membership.release(node_id, "speed measured", wait_s=RELEASE_WAIT_S)
        measured = result.detail.get("speed")
        if not isinstance(measured, dict):
            raise PeerError(f"node {node_id}'s speed probe answered no measurement")
        return measured


def _link_status(link: LinkSpeed) -> dict[str, Any]:
    status: dict[str, Any] = {
        "latency_us": round(link.latency_s * 1e6, 1),
        "mbit_per_s": round(link.bytes_per_s * 8 / 1e6, 1),
    }
    if link.all_sum is not None:
        status["all_sum_ms"] = _ms_by_rows(link.all_sum)
    if link.tp_layer is not None and link.tp_rest is not None:
        status["tp_layer_ms"] = _ms_by_rows(link.tp_layer)
        status["tp_rest_ms"] = _ms_by_rows(link.tp_rest)
    if link.tp_cpu is not None:  # each rank's own CPU time a tp layer: coordinator, member
        status["tp_layer_cpu_ms"] = [_ms_by_rows(rank.layer) for rank in link.tp_cpu]
    return status


def _ms_by_rows(curve: Curve) -> dict[int, float]:
    return {rows: round(seconds * 1000, 3) for rows, seconds in curve.points}


def _describe_all_sum(by_rows: dict[int, float] | None) -> str:
    """ "; all_sum 2 ranks: 0.48 ms at 1 row, 0.61 ms at 8 rows" when it was measured."""
    if not by_rows:
        return ""
    points = ", ".join(f"{ms:g} ms at {_rows(rows)}" for rows, ms in by_rows.items())
    return f"; all_sum 2 ranks: {points}"


def _describe_tp_layer(layer: dict[int, float] | None, rest: dict[int, float] | None) -> str:
    """ "; a tp layer of 2 ranks, all_sums included: 1.31 ms at 1 row (rest 2.4 ms), ..."."""
    if not layer or not rest:
        return ""
    points = ", ".join(
        f"{ms:g} ms at {_rows(rows)} (rest {rest[rows]:g} ms)" for rows, ms in layer.items()
    )
    return f"; a tp layer of 2 ranks, all_sums included: {points}"


def start_probe_here() -> JsonChild:
    """This machine's speed probe process, started without its spec: it imports mlx and waits
    for measure_here(). The caller stops it. A process of its own, not this one: run in the
    serve process, the probe left the model loaded after it decoding 12-15% slower (its freed
    buffers change where the weights land; with glibc's mmap threshold fixed, they did not)."""
    child = JsonChild([sys.executable, "-m", PROBE_MODULE], name="speed probe", cwd=PROJECT_ROOT)
    child.start(None)
    return child


def measure_here(spec: ProbeSpec, child: JsonChild) -> dict[str, Any]:
    """This machine's speed, measured in `child` (a process of its own, as a worker runs)."""
    try:
        child.send(spec.payload())
        return child.wait_ready(PROBE_TIMEOUT_S)["speed"]
    except (ChildNotReady, OSError, ValueError) as error:
        raise PeerError(f"the coordinator's speed probe failed: {error}") from None


def _rows(count: int) -> str:
    return f"{count} row{'s' if count != 1 else ''}"
