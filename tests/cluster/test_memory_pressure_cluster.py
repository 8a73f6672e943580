"""End to end: an agent over its --memory-budget is critical in /v1/cluster and /health, the
coordinator asks for eviction and answers 503 with Retry-After, and serves again once the
pressure is gone."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

# Far below what a python process holds: tandem on that agent counts as over its budget.
TINY_BUDGET = "16M"
WAIT_S = 60.0


def post_chat(server: ServeProcess, model_id: str) -> tuple[int, Any, dict[str, Any]]:
    """(status, headers (case-insensitive), JSON body) of one small chat request."""
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Hello under pressure"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read() or b"{}")


def wait_for(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def member_of(cluster: dict[str, Any], node_id: str) -> dict[str, Any]:
    [member] = [m for m in cluster["members"] if m["node_id"] == node_id]
    return member


def test_an_agent_over_its_budget_evicts_refuses_and_the_server_recovers(
    demo_model_dir: Path, pool: AgentPool, servers: list[ServeProcess], tmp_path: Path
) -> None:
    agent = pool.start("pressed", real_roles=True, extra_args=["--memory-budget", TINY_BUDGET])
    server = start_serve(
        tmp_path,
        demo_model_dir,
        pool.cluster_key,
        ["--parallelism", "pp", "--model-id", "demo", "--rediscover-interval", "2"],
        wait=False,
    )
    servers.append(server)
    # Critical from the start: /health answers 503 "overloaded" instead of "ok".
    health = wait_for(
        lambda: server.get("/health")[1].get("status") == "overloaded" and server.get("/health"),
        "serve to come up overloaded",
        timeout_s=90,
    )
    status, body = health
    assert status == 503
    assert body["memory_tier"] == "critical"
    assert body["memory_tiers"][agent.node_id] == "critical"
    assert agent.node_id in body["reason"]

    cluster = server.cluster()
    assert cluster["strategy"] == "pp"
    pressed = member_of(cluster, agent.node_id)
    assert pressed["memory_tier"] == "critical"
    assert pressed["memory"]["budget"] == 16 * 1024**2
    assert pressed["memory"]["tandem_bytes"] > pressed["memory"]["budget"]
    assert cluster["coordinator"]["memory_tier"] == "ok"
    assert cluster["coordinator"]["memory"]["total"] > 0
    pressure = wait_for(
        lambda: (
            server.cluster()["memory_pressure"]["engine_evictions"] >= 2
            and server.cluster()["memory_pressure"]
        ),
        "the engine to evict twice",
    )
    assert pressure["tier"] == "critical" and pressure["refusing_new_requests"]
    assert pressure["eviction_requests"] >= 2 and pressure["episodes"] == 1

    status, headers, error = post_chat(server, "demo")
    assert status == 503, error
    assert headers.get("Retry-After") == "5"
    assert error["error"]["code"] == "memory_pressure"
    assert error["error"]["type"] == "server_error"
    assert agent.node_id in error["error"]["message"]
    assert server.cluster()["memory_pressure"]["refused_requests"] >= 1

    # The agent leaves (its budget goes with it): the plan shrinks to the coordinator alone,
    # whose memory is fine, and requests are served again.
    agent.stop()
    wait_for(lambda: server.get("/health")[1].get("status") == "ok", "serving again")
    after = server.cluster()
    assert after["strategy"] == "single"
    assert after["memory_pressure"]["tier"] == "ok"
    assert not after["memory_pressure"]["refusing_new_requests"]
    status, _, reply = post_chat(server, "demo")
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"]

    log = server.log_text()
    assert log.count(f"node {agent.node_id} memory tier ok -> critical") == 1
    assert log.count("refusing new requests") == 1
    assert "accepting new requests again" in log
    assert agent.log_text().count("memory on node") == 1  # the agent logged its own tier once

    # The same node back without the budget: planned in again, ok, and serving through it.
    again = pool.start("pressed", real_roles=True)
    assert again.node_id == agent.node_id
    wait_for(lambda: server.cluster()["strategy"] == "pp", "the agent to be planned in again")
    wait_for(lambda: server.get("/health")[1].get("status") == "ok", "serving as pp")
    back = server.cluster()
    assert member_of(back, agent.node_id)["memory_tier"] == "ok"
    assert back["memory_pressure"]["tiers"] == {
        back["coordinator"]["node_id"]: "ok",
        agent.node_id: "ok",
    }
    status, _, reply = post_chat(server, "demo")
    assert status == 200, reply
