"""Turn a ClusterPlan into a running Engine: start agents' workers, then the coordinator's part."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from discovery.framing import free_port
from engines.core.engine_options import EngineOptions
from engines.core.engine_spec import EngineSpec
from engines.tensor_parallel.jaccl import RdmaRow
from errors import EngineError, PeerError
from planner import ClusterPlan, Parallelism
from planner.cluster_plan import JACCL, RING
from planner.relay import is_relayed

log = logging.getLogger(__name__)

TP_ROLE = "tp_rank"
PP_ROLE = "pp_stage"
WEIGHTS_ROLE = "weights"  # engines/weights/fetch_worker.py
RELEASE_WAIT_S = 10.0
DEFAULT_RING_PORT_BASE = 52400  # ranks on other machines listen on base + rank


class MembershipLike(Protocol):
    """The part of discovery.membership.Membership that launching needs."""

    def assign(self, node_id: str, role: str, payload: dict[str, Any]) -> str: ...
    def wait_ready(self, assignment_id: str, timeout_s: float, stall_s: float | None) -> Any: ...
    def wait_model(self, assignment_id: str, timeout_s: float, stall_s: float | None) -> None: ...
    def release(self, node_id: str, reason: str = ..., wait_s: float = ...) -> bool: ...
    def release_all(self, reason: str = ...) -> None: ...


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """What every engine needs beyond the plan."""

    model_path: Path
    cluster_key: bytes | None
    coordinator_address: str  # where other members reach this machine
    ready_timeout_s: float = 120.0
    # A worker receiving the model reports progress: the wait goes on past ready_timeout_s
    # until no progress came for this long.
    transfer_stall_s: float = 60.0
    token_timeout_s: float = 10.0
    ring_port_base: int = DEFAULT_RING_PORT_BASE
    # How every engine runs, as the flags asked; each spec gets them with what the plan
    # decided (planned_options) and its process's BLAS threads.
    options: EngineOptions = EngineOptions()
    # What other machines resolve to the same files (repo@commit through their own Hugging
    # Face cache, or a path that must exist there); None: model_path.
    model_reference: str | None = None
    # The coordinator's weight server (engines/weights/source.py): agents that lack the model
    # fetch it from here. None: every machine must find it itself.
    weights: Any = None
    # For a JACCL plan: --hostfile's rows (which device reaches which machine), and the active
    # RDMA devices of every node by node id (tensor_parallel/jaccl.py).
    rdma_rows: tuple[RdmaRow, ...] = ()
    rdma_devices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Where the coordinator's part runs: PROCESS_CORE (an engine-core process beside the
    # API's, engines/core/core_process.py) or THREAD_CORE (a thread of serve itself).
    engine_core: str = "process"
    core_lost_after_s: float = 5.0  # a core silent this long is frozen: killed, re-planned
    chat_template: str | None = None  # --chat-template: the API renders chats with it

    @property
    def remote_model(self) -> str:
        return self.model_reference or str(self.model_path)


def build_engine(
    plan: ClusterPlan,
    settings: LaunchSettings,
    membership: MembershipLike | None,
    addresses: dict[str, str],
) -> EngineSpec:
    """Describe the coordinator's part of the plan; remote workers are assigned before
    returning.

    `addresses` maps node id -> address; the coordinator's entry is where others reach it.
    The spec is built and loaded by the engine core (engines/core/core_process.py, or a
    thread here): load() for tp/pp also waits for the remote workers to meet it.
    """
    chosen = plan.decision.chosen
    if chosen == Parallelism.SINGLE and not is_relayed(plan):
        arguments = {"model_path": str(settings.model_path)}
        return _spec("single", arguments, plan, settings, addresses)
    if membership is None or settings.cluster_key is None:
        raise EngineError(
            f"a {chosen.value} plan over other machines needs cluster membership and a cluster key"
        )
    if chosen == Parallelism.TP:
        return _build_tensor_parallel(plan, settings, membership, addresses)
    return _build_pipeline(plan, settings, membership, addresses)  # a relay too (stage 0 empty)


def _build_tensor_parallel(
    plan: ClusterPlan,
    settings: LaunchSettings,
    membership: MembershipLike,
    addresses: dict[str, str],
) -> EngineSpec:
    rank_addresses = [addresses[node_id] for node_id in plan.ranks]
    ports = [_ring_port(address, rank, settings) for rank, address in enumerate(rank_addresses)]
    here = options_here(plan, settings, addresses)
    specs = _group_specs(plan, settings, addresses, rank_addresses, ports, here)
    share = _share_cores(plan, addresses, settings.coordinator_address)
    for spec, address in zip(specs[1:], rank_addresses[1:], strict=True):
        spec["options"] = _remote_options(here, address, share, settings).document()
    if settings.weights is not None:
        from discovery.cluster_key import format_key

        # Ranks that lack the model fetch only their share: what Model.shard keeps there.
        for rank, spec in enumerate(specs[1:], start=1):
            spec["weights"] = settings.weights.offer_rank(rank, len(specs))
            spec["cluster_key"] = format_key(settings.cluster_key)
    assignments = [
        membership.assign(node_id, TP_ROLE, specs[rank])
        for rank, node_id in enumerate(plan.ranks[1:], start=1)
    ]
    if settings.weights is not None:
        # Rank 0 joins the group once every rank has its model, so the load timeout counts
        # the group and the load, not a transfer (which takes as long as it progresses).
        for assignment, node_id in zip(assignments, plan.ranks[1:], strict=True):
            try:
                membership.wait_model(
                    assignment, settings.ready_timeout_s, settings.transfer_stall_s
                )
            except PeerError as error:
                raise EngineError(f"tensor-parallel rank on {node_id}: {error}") from error
    endpoints = ", ".join(f"{a}:{p}" for a, p in zip(rank_addresses, ports, strict=True))
    log.info("tp: %d ranks over %s on %s", len(specs), plan.backend or RING, endpoints)
    arguments = {
        "model_path": str(settings.model_path),
        "rank0_spec": specs[0],
        "token_timeout_s": settings.token_timeout_s,
        "rank_nodes": list(plan.ranks),
    }
    return _spec("tensor_parallel", arguments, plan, settings, addresses)


def _group_specs(
    plan: ClusterPlan,
    settings: LaunchSettings,
    addresses: dict[str, str],
    rank_addresses: list[str],
    ports: list[int],
    options: EngineOptions,
) -> list[dict[str, Any]]:
    """The rank specs for the collective the plan chose: JACCL's device matrix and rank 0's
    coordinator port, or the ring's listening addresses."""
    from engines.tensor_parallel.group import jaccl_specs, ring_specs
    from engines.tensor_parallel.jaccl import device_matrix

    if plan.backend == JACCL:
        matrix = device_matrix(plan.ranks, addresses, settings.rdma_devices, settings.rdma_rows)
        coordinator = f"{rank_addresses[0]}:{ports[0]}"
        return jaccl_specs(matrix, coordinator, settings.remote_model, options)
    return ring_specs(rank_addresses, ports, settings.remote_model, options)


def _build_pipeline(
    plan: ClusterPlan,
    settings: LaunchSettings,
    membership: MembershipLike,
    addresses: dict[str, str],
) -> EngineSpec:
    share = _share_cores(plan, addresses, settings.coordinator_address)
    # Bound now and handed to the engine: no other process can take the port meanwhile.
    try:
        listener = socket.create_server((settings.coordinator_address, 0), backlog=4)
    except OSError as error:
        raise EngineError(f"cannot listen for the last pipeline stage: {error}") from error
    try:
        remote = _assign_stages(plan, settings, membership, addresses, share, listener)
    except BaseException:
        listener.close()
        raise
    first = plan.stages[0]
    ranges = [[s.layers.start, s.layers.stop] for s in plan.stages]
    log.info("pp: %d stages %s", len(plan.stages), ranges)
    arguments = {
        "model_path": str(settings.model_path),
        "layers": [first.layers.start, first.layers.stop],
        "stages": remote,
        "return_listen_host": settings.coordinator_address,
        "cluster_key": settings.cluster_key,
        "token_timeout_s": settings.token_timeout_s,
    }
    spec = _spec("pipeline", arguments, plan, settings, addresses)
    return replace(spec, listener=listener)


def _assign_stages(
    plan: ClusterPlan,
    settings: LaunchSettings,
    membership: MembershipLike,
    addresses: dict[str, str],
    share: int,
    listener: socket.socket,
) -> list[dict[str, Any]]:
    """Start stages n-1 .. 1 on their agents; each learns where the next one listens.

    Their weights do not wait for that order: every stage's share is fetched at once (the
    last stage's by its own worker, the others' by a `weights` worker released just before
    the stage starts), so a plan whose agents lack the model waits for its largest share,
    not for the sum of them.
    """
    from discovery.cluster_key import format_key

    next_hop = (settings.coordinator_address, listener.getsockname()[1])
    here = options_here(plan, settings, addresses)
    remote: list[dict[str, Any]] = []
    fetching = _fetch_ahead(plan, settings, membership)
    for index in range(len(plan.stages) - 1, 0, -1):
        stage = plan.stages[index]
        address = addresses[stage.node_id]
        if index in fetching:
            _finish_fetch(membership, stage.node_id, fetching.pop(index), settings, index)
        spec = {
            "model_path": settings.remote_model,
            "layers": [stage.layers.start, stage.layers.stop],
            "is_last": index == len(plan.stages) - 1,
            "listen_host": address,
            "listen_port": 0,
            "next_host": next_hop[0],
            "next_port": next_hop[1],
            "cluster_key": format_key(settings.cluster_key),
            "read_timeout_s": settings.token_timeout_s,
            "options": _remote_options(here, address, share, settings).document(),
        }
        if settings.weights is not None:
            spec["weights"] = settings.weights.offer(stage.layers, spec["is_last"])
        assignment = membership.assign(stage.node_id, PP_ROLE, spec)
        try:
            ready = membership.wait_ready(
                assignment, settings.ready_timeout_s, settings.transfer_stall_s
            )
        except PeerError as error:
            message = f"pipeline stage {index} on {stage.node_id} failed: {error}"
            raise EngineError(message) from error
        next_hop = (address, int(ready.detail["port"]))
        layers = [stage.layers.start, stage.layers.stop]
        remote.insert(
            0, {"host": next_hop[0], "port": next_hop[1], "layers": layers, "node": stage.node_id}
        )
    return remote


def _fetch_ahead(
    plan: ClusterPlan, settings: LaunchSettings, membership: MembershipLike
) -> dict[int, str]:
    """Start fetching the shares of stages 1 .. n-2 now: stage index -> assignment id."""
    from discovery.cluster_key import format_key

    if settings.weights is None or settings.cluster_key is None:
        return {}
    fetching = {}
    for index in range(1, len(plan.stages) - 1):
        stage = plan.stages[index]
        payload = {
            "model_path": settings.remote_model,
            "weights": settings.weights.offer(stage.layers, False),
            "cluster_key": format_key(settings.cluster_key),
        }
        fetching[index] = membership.assign(stage.node_id, WEIGHTS_ROLE, payload)
    return fetching


def _finish_fetch(
    membership: MembershipLike,
    node_id: str,
    assignment: str,
    settings: LaunchSettings,
    index: int,
) -> None:
    """Wait until stage `index`'s share is in place on `node_id`, then free the agent."""
    try:
        membership.wait_ready(assignment, settings.ready_timeout_s, settings.transfer_stall_s)
    except PeerError as error:
        raise EngineError(f"pipeline stage {index} on {node_id}: {error}") from error
    if not membership.release(node_id, "its weights are in place", wait_s=RELEASE_WAIT_S):
        raise EngineError(
            f"pipeline stage {index} on {node_id}: its weights worker did not stop within "
            f"{RELEASE_WAIT_S:g} s"
        )


def _spec(
    factory: str,
    arguments: dict[str, Any],
    plan: ClusterPlan,
    settings: LaunchSettings,
    addresses: dict[str, str],
) -> EngineSpec:
    """An engine_factories function, with the plan's options and this machine's BLAS threads
    (its share when plan members share it, else as the flags said)."""
    options = options_here(plan, settings, addresses)
    return EngineSpec(f"engines.cluster.engine_factories:{factory}", arguments, options)


def options_here(
    plan: ClusterPlan, settings: LaunchSettings, addresses: dict[str, str]
) -> EngineOptions:
    """The flags' options with what the plan decided (the batch that fits, the prefix cache's
    budget, float32 weights when it counted them: each worker upcasts only on its CPU) and
    this machine's BLAS threads: its share when plan members share it, else as flagged."""
    options = settings.options
    share = _share_cores(plan, addresses, settings.coordinator_address)
    return replace(
        options,
        max_batch=plan.batch_capacity,  # what fits (planner/batch.py)
        prefix_cache_bytes=plan.prefix_cache_bytes,
        upcast=_upcast(plan),
        # a disk tier needs a directory here; agents then name their own
        prefix_cache_disk_bytes=options.prefix_cache_disk_bytes if options.prefix_cache_dir else 0,
        blas_threads=share or options.blas_threads,
    )


def _remote_options(
    here: EngineOptions, address: str, share: int, settings: LaunchSettings
) -> EngineOptions:
    """A worker's options: this machine's, less what only names this machine (the agent
    puts its own prefix_cache_dir in), with its BLAS threads."""
    threads = _threads_at(address, share, settings)
    return replace(here, prefix_cache_dir=None, draft_model_path=None, blas_threads=threads)


def _upcast(plan: ClusterPlan) -> bool:
    return plan.compute_dtype == "float32"


def _share_cores(plan: ClusterPlan, addresses: dict[str, str], here: str) -> int:
    """Cores per mlx process when plan members share this machine (a loopback cluster), so
    they do not run n x all-cores BLAS threads against each other; 0 when alone here."""
    members = set(plan.ranks) | {stage.node_id for stage in plan.stages}
    local = [node for node in members if _on_this_machine(addresses.get(node, ""), here)]
    if len(local) < 2:
        return 0
    return max(1, (os.cpu_count() or 1) // len(local))


def _threads_at(address: str, share: int, settings: LaunchSettings) -> int:
    """A worker's BLAS threads: its share here, 0 (its machine's default) elsewhere."""
    return share if _on_this_machine(address, settings.coordinator_address) else 0


def _on_this_machine(address: str, here: str) -> bool:
    return _is_loopback(address) or address == here


def _ring_port(address: str, rank: int, settings: LaunchSettings) -> int:
    return ring_port(address, rank, settings.ring_port_base)


def ring_port(address: str, rank: int, base: int = DEFAULT_RING_PORT_BASE) -> int:
    """Where ring rank `rank` listens at `address`. On loopback every rank shares this
    machine, so any free port works; elsewhere the remote machine's free ports are unknown
    here, so ranks use a fixed, configurable base."""
    if _is_loopback(address):
        return free_port(address)
    return base + rank


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
