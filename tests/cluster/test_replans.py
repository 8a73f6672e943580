"""Re-plans only when the cluster really changed: a healthy cluster, rediscovering all the while,
keeps its plan."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from openai import OpenAI

from planner import NodeResources
from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve
from tests.helpers.supervision import GiB, Members, ScriptedEngine, make_supervisor

pytestmark = pytest.mark.cluster

HEALTHY_S = 15.0  # fifteen rediscoveries at one a second


class DriftingMembers(Members):
    """Two agents whose free memory moves a little between two readings, as a node's does
    when it loads its share: the memory-proportional split moves a layer boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.readings = 0

    def to_resources(self) -> list[NodeResources]:
        self.readings += 1
        drift = GiB if self.readings % 2 else -GiB
        return [
            NodeResources("agent-0", "127.0.0.2", 64 * GiB + drift, ("ring",)),
            NodeResources("agent-1", "127.0.0.3", 64 * GiB - drift, ("ring",)),
        ]


def test_rediscovering_the_planned_members_is_no_change(demo_model_dir: Path) -> None:
    members = DriftingMembers()
    engines: list[ScriptedEngine] = []
    supervisor = make_supervisor(
        demo_model_dir, lambda plan: engines.append(ScriptedEngine()) or engines[-1], members
    )
    try:
        first = supervisor.start()
        assert len(first.stages) == 3
        again, once_more = supervisor.make_plan(), supervisor.make_plan()  # the same members
        assert [s.layers for s in again.stages] != [s.layers for s in once_more.stages]
        for _ in range(4):
            supervisor._adopt_new_members()  # what the watch thread does every interval
        assert not supervisor.last_replan_reason  # before: "membership changed: 3 ..."
        assert supervisor.service.state == "ok" and len(engines) == 1
    finally:
        supervisor.close()


def test_a_healthy_pipeline_never_replans_while_rediscovering(
    demo_model_dir: Path, pool: AgentPool, servers: list[ServeProcess], tmp_path: Path
) -> None:
    """Three equal nodes split four layers 2/1/1: which node gets the extra layer follows
    their free memory, which moves as they load; re-planning on that cut the service."""
    pool.start("a1", real_roles=True)
    pool.start("a2", real_roles=True)
    server = start_serve(
        tmp_path, demo_model_dir, pool.cluster_key,
        ["--parallelism", "pp", "--model-id", "demo", "--rediscover-interval", "1"],
    )
    servers.append(server)
    assert len(server.cluster()["plan"]["stages"]) == 3
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=30, max_retries=0)
    deadline = time.monotonic() + HEALTHY_S
    while time.monotonic() < deadline:
        reply = client.completions.create(model="demo", prompt="Still here?", max_tokens=4)
        assert reply.choices[0].text
        time.sleep(1.5)  # idle in between: rediscovery runs only while nothing is in flight
    cluster = server.cluster()
    assert cluster["replans"] == 0, cluster["last_replan_reason"]
    assert cluster["state"] == "ok"
