"""The order a pipeline's stages are started in, against a scripted membership: every share is
on its way before any stage is waited for, and a middle stage starts only once its weights
worker is released."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from engines.cluster.launch import PP_ROLE, WEIGHTS_ROLE, LaunchSettings, _assign_stages
from planner import ClusterPlan, Decision, Parallelism, StageAssignment


class ScriptedMembership:
    """Records assignments, waits and releases; every worker is ready at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self._assignments: dict[str, tuple[str, str]] = {}

    def assign(self, node_id: str, role: str, payload: dict[str, Any]) -> str:
        assignment = f"a{len(self._assignments)}"
        self._assignments[assignment] = (node_id, role)
        self.calls.append(("assign", node_id, role))
        return assignment

    def wait_ready(self, assignment_id: str, timeout_s: float, stall_s: float | None) -> Any:
        node_id, role = self._assignments[assignment_id]
        self.calls.append(("ready", node_id, role))
        return type("Ready", (), {"detail": {"port": 7000 + len(self.calls)}})()

    def release(self, node_id: str, reason: str = "", wait_s: float = 0.0) -> bool:
        self.calls.append(("release", node_id))
        return True


class Offers:
    """A WeightSource's offers, named by their layers."""

    def offer(self, layers: range | None = None, is_last: bool = False) -> dict[str, Any]:
        return {"host": "127.0.0.1", "port": 1, "content_hash": f"{layers}-{is_last}"}


def plan_of(stages: int) -> ClusterPlan:
    assignments = tuple(
        StageAssignment(f"n{index}", range(index * 2, index * 2 + 2), 1, 2)
        for index in range(stages)
    )
    decision = Decision(Parallelism.PP, "test")
    return ClusterPlan(decision, (), tuple(s.node_id for s in assignments), assignments, ())


def test_every_share_moves_before_any_stage_is_waited_for() -> None:
    membership = ScriptedMembership()
    settings = LaunchSettings(Path("/m"), b"k" * 32, "127.0.0.1", weights=Offers())
    addresses = {f"n{index}": "127.0.0.1" for index in range(4)}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        remote = _assign_stages(plan_of(4), settings, membership, addresses, 0, listener)
    assert [stage["node"] for stage in remote] == ["n1", "n2", "n3"]
    first_wait = membership.calls.index(("ready", "n3", PP_ROLE))
    started = membership.calls[:first_wait]
    # the middle stages' weights and the last stage itself, all before the first wait
    assert started == [
        ("assign", "n1", WEIGHTS_ROLE),
        ("assign", "n2", WEIGHTS_ROLE),
        ("assign", "n3", PP_ROLE),
    ]
    assert membership.calls[first_wait:] == [
        ("ready", "n3", PP_ROLE),
        ("ready", "n2", WEIGHTS_ROLE),
        ("release", "n2"),
        ("assign", "n2", PP_ROLE),
        ("ready", "n2", PP_ROLE),
        ("ready", "n1", WEIGHTS_ROLE),
        ("release", "n1"),
        ("assign", "n1", PP_ROLE),
        ("ready", "n1", PP_ROLE),
    ]


def test_without_weight_transfers_stages_start_as_before() -> None:
    membership = ScriptedMembership()
    settings = LaunchSettings(Path("/m"), b"k" * 32, "127.0.0.1")
    addresses = {f"n{index}": "127.0.0.1" for index in range(3)}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        _assign_stages(plan_of(3), settings, membership, addresses, 0, listener)
    assert [call for call in membership.calls if call[0] == "assign"] == [
        ("assign", "n2", PP_ROLE),
        ("assign", "n1", PP_ROLE),
    ]
