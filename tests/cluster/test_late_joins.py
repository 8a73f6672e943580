"""Agents that join one after another, some while a re-plan runs, are each planned in within
the rediscovery interval + 1 s of being ready: one that joins during a re-plan is taken into
the plan that follows it, not one interval later."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

from planner import NodeResources
from tests.helpers.supervision import GiB, Members, ScriptedEngine, make_supervisor

INTERVAL_S = 2.0  # --rediscover-interval
LOAD_S = 2.0  # how long a launch takes: a re-plan lasts about the interval
BROWSE_S = 1.0  # what a zeroconf browse takes (REDISCOVER_BROWSE_S)


class JoiningMembers(Members):
    """agent-0 from the start; the others become ready at given times, and a browse finds
    every agent that was ready by the time it ends, as zeroconf does."""

    def __init__(self, ready_at: dict[str, float]) -> None:
        super().__init__()
        self.ready_at = ready_at
        self.verified = {"agent-0"}
        self.lock = threading.Lock()

    def discover(self, timeout_s: float) -> list:
        time.sleep(timeout_s)
        now = time.monotonic()
        with self.lock:
            self.verified |= {node for node, at in self.ready_at.items() if at <= now}
        return []

    def to_resources(self) -> list[NodeResources]:
        with self.lock:
            names = sorted(self.verified)
        return [
            NodeResources(name, f"127.0.0.{n + 2}", 64 * GiB, ("ring",))
            for n, name in enumerate(names)
        ]


class SlowLoad(ScriptedEngine):
    def load(self) -> None:
        time.sleep(LOAD_S)
        super().load()


def test_agents_joining_during_a_replan_are_planned_in_within_the_interval(
    demo_model_dir: Path,
) -> None:
    members = JoiningMembers({})
    supervisor = make_supervisor(demo_model_dir, lambda plan: SlowLoad(), members, 30.0)
    supervisor.plan_settings = replace(supervisor.plan_settings, rediscover_interval_s=INTERVAL_S)
    planned_in: dict[str, float] = {}
    make_plan = supervisor.make_plan

    def recording() -> object:
        plan = make_plan()
        for stage in plan.stages:
            planned_in.setdefault(stage.node_id, time.monotonic())
        return plan

    supervisor.make_plan = recording  # type: ignore[method-assign]
    try:
        supervisor.start()
        started = time.monotonic()
        # agent-1 starts a re-plan at the first rediscovery; agent-2 is ready while it runs
        members.ready_at = {"agent-1": started + 0.5, "agent-2": started + INTERVAL_S + 1.2}
        deadline = time.monotonic() + 30
        while len(planned_in) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        for node, ready in members.ready_at.items():
            assert node in planned_in, f"{node} never planned in ({supervisor.last_replan_reason})"
            waited = planned_in[node] - ready
            assert waited <= INTERVAL_S + 1.0, f"{node} planned in {waited:.1f} s after ready"
    finally:
        supervisor.close()
