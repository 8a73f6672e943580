"""Two models of a set that swap agents when the set is placed again: each releases only its
own old worker, and neither launches on its new agent before the other has left it."""

from __future__ import annotations

import threading
import time

from engines.cluster.group_move import group_moves
from planner import NodeResources
from tests.helpers.supervision import GiB, Members, ScriptedEngine, make_supervisor

SLOW_RELEASE_S = 1.0  # model B takes this long to release its old agent
WAIT_S = 10.0


class RecordingMembers(Members):
    """Releases take a while on agent-1; every release ends at a recorded time."""

    def __init__(self) -> None:
        super().__init__()
        self.released_at: dict[str, float] = {}
        self.releases: list[tuple[str, ...]] = []

    def release_nodes(self, node_ids: list[str], reason: str = "", wait_s: float = 0.0) -> bool:
        self.releases.append(tuple(node_ids))
        if "agent-1" in node_ids:
            time.sleep(SLOW_RELEASE_S)
        for node in node_ids:
            self.released_at[node] = time.monotonic()
        return True


def test_two_models_swapping_agents_wait_for_each_other_to_leave(demo_model_dir) -> None:
    members = RecordingMembers()
    launched: dict[str, tuple[tuple[str, ...], float]] = {}
    served = threading.Event()

    def supervisor_for(name: str, group: str):
        def factory(plan):
            launched[name] = (plan.ranks, time.monotonic())
            if len(launched) == 2:
                served.set()
            return ScriptedEngine()

        supervisor = make_supervisor(demo_model_dir, factory, members)
        supervisor.member_group = frozenset({group})
        return supervisor

    a, b = supervisor_for("a", "agent-0"), supervisor_for("b", "agent-1")
    try:
        a.start(), b.start()
        assert a.plan.ranks == ("coordinator", "agent-0") and b.plan.ranks[1] == "agent-1"
        launched.clear(), served.clear()
        coordinator = NodeResources("coordinator", "127.0.0.1", 64 * GiB, ("ring",))
        moves = group_moves(
            {"a": frozenset({"agent-1"}), "b": frozenset({"agent-0"})},
            {"a": coordinator, "b": coordinator},
        )
        a.request_move(moves["a"], "membership changed: agent-2 joined: placed again")
        b.request_move(moves["b"], "membership changed: agent-2 joined: placed again")
        assert served.wait(WAIT_S), launched
        assert launched["a"][0] == ("coordinator", "agent-1")
        assert launched["b"][0] == ("coordinator", "agent-0")
        assert sorted(members.releases) == [("agent-0",), ("agent-1",)]  # each its own, once
        assert launched["a"][1] >= members.released_at["agent-1"]  # b had left it
        assert launched["b"][1] >= members.released_at["agent-0"]
        assert a.member_group == {"agent-1"} and b.member_group == {"agent-0"}
    finally:
        a.close(), b.close()
