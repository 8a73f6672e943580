"""An agent that joins after a set of models was placed is used by the set: within the
rediscovery interval the set is placed again and the model it moves re-plans onto the agent,
while the other model answers every request sent meanwhile; both still answer as before."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.cluster import AgentPool, wait_until
from tests.helpers.demo_models import make_demo_model
from tests.helpers.reference import completions
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

INTERVAL_S = 2.0  # --rediscover-interval
LAUNCH_S = 30.0  # the moved model's pipeline: a stage worker on the agent, on a busy 2-core box
PAUSE_S = 0.2  # between one client's requests: a model is moved only while it is idle


def nodes_of(server: ServeProcess, model_id: str) -> list[str]:
    """The nodes the model serves on now ([] while it is not serving)."""
    body = server.cluster()["models"][model_id]
    return body["plan"]["ranks"] if body["state"] == "ok" and body["plan"] else []


class Client(threading.Thread):
    """Asks one model the same short greedy question until stopped; keeps every outcome."""

    def __init__(self, server: ServeProcess, model_id: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.model_id, self.stop = f"{server.base_url}/v1/completions", model_id, stop
        self.texts: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        body = {"model": self.model_id, "prompt": [5, 60, 61], "max_tokens": 8, "temperature": 0}
        while not self.stop.wait(PAUSE_S):
            try:
                reply = httpx.post(self.url, json=body, timeout=60)
            except httpx.HTTPError as error:
                self.errors.append(repr(error))
                continue
            if reply.status_code == 200:
                self.texts.append(reply.json()["choices"][0]["text"])
            else:
                self.errors.append(f"{reply.status_code} {reply.text}")


def test_an_agent_that_joins_later_takes_a_model_and_the_other_keeps_serving(
    pool: AgentPool, servers: list[ServeProcess], tmp_path: Path
) -> None:
    first = make_demo_model(tmp_path / "models", layers=4)
    second = make_demo_model(tmp_path / "models", layers=2, seed=7)
    server = start_serve(
        tmp_path, first, pool.cluster_key,
        ["--parallelism", "pp", "--model", str(second), "--model-id", "first",
         "--collective", "ring", "--rediscover-interval", str(INTERVAL_S)],
    )  # fmt: skip
    servers.append(server)
    ids = ["first", second.name]
    assert all(len(nodes_of(server, model_id)) == 1 for model_id in ids)  # no agent: both alone
    before = {model_id: completions(server, model_id) for model_id in ids}
    assert before["first"] != before[second.name]  # else a wrong routing could pass

    stop = threading.Event()
    clients = {model_id: Client(server, model_id, stop) for model_id in ids}
    for client in clients.values():
        client.start()
    try:
        agent = pool.start("late", real_roles=True)
        joined = time.monotonic()
        moved_onto_agent = lambda: [m for m in ids if agent.node_id in nodes_of(server, m)]  # noqa: E731
        assert wait_until(moved_onto_agent, INTERVAL_S + LAUNCH_S), (
            server.cluster()["models"],
            server.log_text()[-3000:],
        )
        moved_within_s = time.monotonic() - joined
        time.sleep(1.0)  # requests to both after the move, too
    finally:
        stop.set()
        for client in clients.values():
            client.join(60)

    (moved,) = moved_onto_agent()
    (stayed,) = set(ids) - {moved}
    status = server.cluster()["models"]
    reason = status[moved]["last_replan_reason"]
    assert reason.startswith(f"membership changed: {agent.node_id} joined"), reason
    assert status[moved]["plan"]["decision"]["chosen"] == "pp"
    assert status[stayed]["replans"] == 0 and len(nodes_of(server, stayed)) == 1
    assert clients[stayed].errors == [], clients[stayed].errors  # never a 503, never cut
    assert len(set(clients[stayed].texts)) == 1 and len(clients[stayed].texts) >= 5
    assert clients[moved].texts, clients[moved].errors  # it answered after its move
    assert {model_id: completions(server, model_id) for model_id in ids} == before
    print(f"moved {moved_within_s:.1f} s after the agent was ready")
