"""The pieces of /v1/cluster that describe the cluster rather than the plan: each member as
membership sees it, the running engine's batch and detail, and a node's planner resources."""

from __future__ import annotations

from typing import Any

from engines.core.runner import EngineRunner
from planner import NodeResources


def members_status(membership: Any | None) -> list[dict[str, Any]]:
    if membership is None:
        return []
    return [
        {
            "node_id": m.node_id,
            "address": f"{m.address}:{m.port}",
            "state": m.state,
            "verified": m.verified,
            "reason": m.reason,
            "memory_available": m.memory_available,
            "memory_total": m.hello.memory_total if m.hello else None,
            "memory_bound": m.hello.memory_bound if m.hello else None,
            "backends": list(m.hello.backends) if m.hello else [],
            "last_heartbeat_age_s": m.last_heartbeat_age_s,
            "worker_state": m.worker_state,
            "worker_pid": m.worker_pid,
            "memory_tier": m.memory.tier if m.memory else None,
            "memory": m.memory.model_dump() if m.memory else None,
            "disk_free_bytes": m.model_cache.free_bytes if m.model_cache else None,
            "transfer": transfer_status(m),
        }
        for m in membership.members()
    ]


def transfer_status(member: Any) -> dict[str, Any] | None:
    """The member's last model transfer progress (engines/weights/fetch.py), if any."""
    progress = member.transfer
    if progress is None:
        return None
    return {
        "done_bytes": progress.done_bytes,
        "total_bytes": progress.total_bytes,
        "age_s": member.transfer_age_s,
    }


def engine_status(runner: EngineRunner | None) -> dict[str, Any] | None:
    if runner is None:
        return None
    info = runner.engine.info()
    batch = {"active": runner.active, "capacity": runner.max_batch, "queued": runner.queued}
    return {"strategy": info.strategy, "world_size": info.world_size, "batch": batch, **info.detail}


def resources_status(node: NodeResources) -> dict[str, Any]:
    return {
        "node_id": node.node_id,
        "address": node.address,
        "memory_available": node.memory_bytes,
        "memory_bound": node.memory_bound or "machine",
        "backends": list(node.backends),
    }
