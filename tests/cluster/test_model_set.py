"""Several models on one server: each answers as it does alone, in every dialect; loaded and
unloaded through the API with their memory returned; loaded on demand and unloaded when
idle; and a lost agent re-plans only the model it served."""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from cli.main import build_parser
from tests.helpers.cluster import AgentPool, wait_until
from tests.helpers.demo_models import make_demo_model
from tests.helpers.reference import MAX_TOKENS, PROMPTS, completions, single_outputs
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

LOAD_WITHIN_S = 60.0
MEMORY_RETURNED_BYTES = 50 * 1024 * 1024
# Too small for the first model (~310 MB: weights and 16 x 4096 tokens of KV), not the second
# (~170 MB); a fixed prefix cache, so that the first model planned does not take half of it.
TIGHT_COORDINATOR = ["--prefix-cache-bytes", "16M", "--memory-limit", "300M"]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two different demo models: their answers to the same prompts differ."""
    root = tmp_path_factory.mktemp("models")
    return make_demo_model(root, layers=4), make_demo_model(root, layers=2, seed=7)


@pytest.fixture(scope="module")
def references(two_models: tuple[Path, Path]) -> tuple[list[str], list[str]]:
    first, second = (single_outputs(model) for model in two_models)
    assert first != second  # else a wrong routing could pass
    return first, second


def tree_rss(pid: int) -> int:
    """Resident bytes of serve and every process under it (its engine cores)."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def model_state(server: ServeProcess, model_id: str, key: str = "") -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10).json()
    listed = {card["id"]: card for card in body["data"]}
    return listed[model_id]["state"] if model_id in listed else "absent"


def ask_both_at_once(server: ServeProcess, *model_ids: str) -> dict[str, list[str]]:
    """Every model's greedy completions of PROMPTS, the models asked concurrently."""
    answers: dict[str, list[str]] = {}

    def ask(model_id: str) -> None:
        answers[model_id] = completions(server, model_id)

    threads = [threading.Thread(target=ask, args=(m,)) for m in model_ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return answers


def test_two_models_answer_as_each_alone_at_once_in_every_dialect(
    two_models: tuple[Path, Path],
    references: tuple[list[str], list[str]],
    servers: list[ServeProcess],
    tmp_path: Path,
) -> None:
    first, second = two_models
    server = start_serve(
        tmp_path, first, "", ["--parallelism", "single", "--model", str(second),
                              "--model-id", "first", "--model-alias", "smol=first"],
    )  # fmt: skip
    servers.append(server)
    second_id = second.name
    assert [card["id"] for card in server.get("/v1/models")[1]["data"]] == ["first", second_id]

    assert ask_both_at_once(server, "first", second_id) == {
        "first": references[0],
        second_id: references[1],
    }
    assert completions(server, "smol") == references[0]  # an alias reaches its own model

    base = server.base_url
    prompt = [{"role": "user", "content": "hello"}]
    openai = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": second_id, "messages": prompt, "max_tokens": 8, "temperature": 0})  # fmt: skip
    claude = httpx.post(f"{base}/v1/messages", timeout=60, json={
        "model": second_id, "messages": prompt, "max_tokens": 8, "temperature": 0})  # fmt: skip
    ollama = httpx.post(f"{base}/api/chat", timeout=60, json={
        "model": second_id, "messages": prompt, "stream": False,
        "options": {"num_predict": 8, "temperature": 0}})  # fmt: skip
    text = openai.json()["choices"][0]["message"]["content"]
    assert claude.json()["content"][0]["text"] == text
    assert ollama.json()["message"]["content"] == text
    tags = {entry["name"] for entry in httpx.get(f"{base}/api/tags").json()["models"]}
    assert tags == {"first:latest", f"{second_id}:latest"}

    placements = httpx.get(f"{base}/v1/placements", timeout=60).json()
    assert set(placements["current"]) == {"first", second_id}
    preview = placements["preview"]
    assert preview["refusal"] is None and preview["candidate_count"] >= 1
    assert {m["model_id"]: m["strategy"] for m in preview["models"]} == {
        "first": "single",
        second_id: "single",
    }
    (coordinator,) = preview["memory"]  # both on the coordinator, its memory counted once
    assert set(coordinator["needs"]) == {"first", second_id}
    assert coordinator["left_bytes"] == coordinator["available_bytes"] - sum(
        coordinator["needs"].values()
    )

    unknown = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404
    assert f"this server serves 'first' and '{second_id}'" in unknown.json()["error"]["message"]


def test_load_and_unload_through_the_api_return_the_memory(
    two_models: tuple[Path, Path],
    references: tuple[list[str], list[str]],
    servers: list[ServeProcess],
    tmp_path: Path,
) -> None:
    first, second = two_models
    key = "k" * 24
    server = start_serve(
        tmp_path, first, "", ["--parallelism", "single", "--model-id", "first",
                              "--api-key", key, "--memory-limit", "1G"],
    )  # fmt: skip
    servers.append(server)
    base, auth = server.base_url, {"Authorization": f"Bearer {key}"}
    before = tree_rss(server.process.pid)

    refused = httpx.post(f"{base}/v1/models", json={"model": str(second)})
    assert refused.status_code == 401  # the API key guards loading as every /v1 route

    started = time.monotonic()
    loaded = httpx.post(f"{base}/v1/models", headers=auth, json={"model": str(second)})
    assert loaded.status_code == 202, loaded.text
    second_id = loaded.json()["id"]
    assert wait_until(lambda: model_state(server, second_id, key) == "ok", LOAD_WITHIN_S)
    client = OpenAI(base_url=f"{base}/v1", api_key=key, timeout=60)
    reply = client.completions.create(
        model=second_id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    first_answer_s = time.monotonic() - started
    assert reply.choices[0].text == references[1][0]

    again = httpx.post(f"{base}/v1/models", headers=auth, json={"model": str(second)})
    assert again.status_code == 409 and again.json()["error"]["code"] == "model_exists"

    gone = httpx.delete(f"{base}/v1/models/{second_id}", headers=auth)
    assert gone.json() == {"id": second_id, "object": "model", "deleted": True}
    assert model_state(server, second_id, key) == "absent"
    assert wait_until(lambda: tree_rss(server.process.pid) - before < MEMORY_RETURNED_BYTES, 30), (
        f"RSS {tree_rss(server.process.pid) - before} bytes above before the load"
    )
    client_first = client.completions.create(
        model="first", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert client_first.choices[0].text == references[0][0]
    assert first_answer_s < LOAD_WITHIN_S


def test_a_model_that_does_not_fit_is_refused_with_the_numbers_and_disturbs_nothing(
    two_models: tuple[Path, Path],
    references: tuple[list[str], list[str]],
    servers: list[ServeProcess],
    tmp_path: Path,
) -> None:
    first, _ = two_models
    big = make_demo_model(tmp_path / "big", layers=8, hidden=512, heads=8, kv_heads=8)
    server = start_serve(
        tmp_path, first, "", ["--parallelism", "single", "--model-id", "first",
                              "--memory-limit", "120M", "--context-tokens", "512"],
    )  # fmt: skip
    servers.append(server)
    refused = httpx.post(f"{server.base_url}/v1/models", json={"model": str(big)}, timeout=60)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_does_not_fit"
    assert "does not fit beside the models served" in error["message"]
    assert "MB" in error["message"] or "GB" in error["message"]  # the planner's numbers
    assert [card["id"] for card in server.get("/v1/models")[1]["data"]] == ["first"]
    assert completions(server, "first") == references[0]


def test_a_model_loads_when_a_request_names_it_and_unloads_when_idle(
    two_models: tuple[Path, Path],
    references: tuple[list[str], list[str]],
    servers: list[ServeProcess],
    tmp_path: Path,
) -> None:
    first, _ = two_models
    server = start_serve(
        tmp_path, first, "", ["--parallelism", "single", "--model-id", "first",
                              "--load-on-demand", "--keep-alive", "2"],
    )  # fmt: skip
    servers.append(server)
    assert model_state(server, "first") == "unloaded"
    assert completions(server, "first") == references[0]  # the first request loaded it
    assert model_state(server, "first") == "ok"
    (running,) = httpx.get(f"{server.base_url}/api/ps", timeout=10).json()["models"]
    expires = datetime.datetime.fromisoformat(running["expires_at"])
    now = datetime.datetime.now(datetime.UTC)
    assert now - datetime.timedelta(seconds=1) < expires <= now + datetime.timedelta(seconds=2)
    assert wait_until(lambda: model_state(server, "first") == "unloaded", 15)
    assert completions(server, "first") == references[0]  # and the next loads it again


def test_an_agent_lost_by_one_model_leaves_the_other_serving(
    two_models: tuple[Path, Path],
    references: tuple[list[str], list[str]],
    pool: AgentPool,
    servers: list[ServeProcess],
    tmp_path: Path,
) -> None:
    first, second = two_models
    agents = [pool.start(name, real_roles=True) for name in ("one", "two")]
    server = start_serve(
        tmp_path, first, pool.cluster_key,
        ["--parallelism", "pp", "--model", str(second), "--model-id", "first",
         "--collective", "ring"],
    )  # fmt: skip
    servers.append(server)
    status = server.cluster()["models"]
    second_id = second.name
    groups = {
        model_id: {stage["node_id"] for stage in body["plan"]["stages"]}
        for model_id, body in status.items()
    }
    by_node = {agent.node_id: agent for agent in agents}
    first_agents = groups["first"] & by_node.keys()
    second_agents = groups[second_id] & by_node.keys()
    assert first_agents and second_agents and not first_agents & second_agents, groups
    assert completions(server, "first") == references[0]
    assert completions(server, second_id) == references[1]

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)
    finished: list[str] = []
    flowing = threading.Barrier(5, timeout=60)

    def stream_first(index: int) -> None:
        stream = client.chat.completions.create(
            model="first", messages=[{"role": "user", "content": f"go {index}"}],
            max_tokens=200, temperature=0, stream=True,
        )  # fmt: skip
        for count, chunk in enumerate(stream):
            if count == 3:
                flowing.wait()
            if chunk.choices and chunk.choices[0].finish_reason:
                finished.append(chunk.choices[0].finish_reason)

    threads = [threading.Thread(target=stream_first, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    flowing.wait()
    victim = by_node[next(iter(second_agents))]
    victim.kill()
    for thread in threads:
        thread.join(120)
    assert finished == ["length"] * 4  # none of the first model's streams broke

    def replans() -> dict[str, tuple[int, str]]:
        status = server.cluster()["models"]
        return {m: (body["replans"], body["last_replan_reason"]) for m, body in status.items()}

    # the second model lost its stage and re-planned (it may serve again, or still be trying)
    assert wait_until(lambda: victim.node_id in replans()[second_id][1], 30), replans()
    assert replans()["first"] == (0, "")  # the first never did
    assert model_state(server, "first") == "ok"
    assert completions(server, "first") == references[0]


def test_models_alone_on_agents_answer_as_alone_and_one_falls_back_when_its_agent_dies(
    two_models: tuple[Path, Path],
    references: tuple[list[str], list[str]],
    pool: AgentPool,
    servers: list[ServeProcess],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Single for both over a coordinator of 300 MB, which cannot hold the first model's
    ~310 MB (weights and 16 x 4096 tokens of KV), and two agents: each model runs alone on an
    agent, the coordinator only relaying (planner/relay.py), which leaves the most memory on
    the tightest machine. Each answers as it does alone; killing the second one's agent leaves
    the first serving and re-plans the second (~170 MB) onto the coordinator."""
    first, second = two_models
    agents = [pool.start(name, real_roles=True) for name in ("one", "two")]
    server = start_serve(
        tmp_path, first, pool.cluster_key,
        ["--parallelism", "single", "--model", str(second), "--model-id", "first",
         *TIGHT_COORDINATOR],
    )  # fmt: skip
    servers.append(server)
    second_id = second.name
    by_node = {agent.node_id: agent for agent in agents}
    models = server.get("/v1/placements")[1]["current"]
    for model in models.values():
        assert model["relayed"] and model["nodes"][1] in by_node, models
    assert models["first"]["nodes"][1] != models[second_id]["nodes"][1]
    plan = server.cluster()["models"][second_id]["plan"]
    assert plan["decision"]["chosen"] == "single"
    assert [stage["layers"] for stage in plan["stages"]] == [[0, 0], [0, 2]]
    coordinator, second_agent = models[second_id]["nodes"]
    args = build_parser().parse_args(["status", "--url", server.base_url, "--sample", "0"])
    assert args.run(args) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(second_id)]
    assert f"single    {second_agent} (relayed by {coordinator})" in line
    page = httpx.get(f"{server.base_url}/dashboard", timeout=30).text
    assert "single: relays (embedding)" in page and "single: every layer" in page
    assert ask_both_at_once(server, "first", second_id) == {
        "first": references[0],
        second_id: references[1],
    }

    victim = by_node[models[second_id]["nodes"][1]]
    victim.kill()

    def second_model() -> dict:
        return server.cluster()["models"][second_id]

    assert wait_until(lambda: victim.node_id in second_model()["last_replan_reason"], 30)
    assert wait_until(lambda: model_state(server, second_id) == "ok", LOAD_WITHIN_S)
    assert second_model()["plan"]["ranks"] == [coordinator]
    assert completions(server, second_id) == references[1]  # now single on the coordinator
    assert server.cluster()["models"]["first"]["replans"] == 0
    assert completions(server, "first") == references[0]


def test_a_model_loaded_on_demand_that_fits_only_on_an_agent_runs_there_alone(
    two_models: tuple[Path, Path],
    references: tuple[list[str], list[str]],
    pool: AgentPool,
    servers: list[ServeProcess],
    tmp_path: Path,
) -> None:
    """Loaded at run time (--load-on-demand), the first model (~310 MB) fits neither on the
    coordinator of 300 MB nor, as single, with it: it runs alone on an agent, relayed; the
    second (~170 MB) still fits on the coordinator and runs there."""
    first, second = two_models
    for name in ("one", "two"):
        pool.start(name, real_roles=True)
    server = start_serve(
        tmp_path, first, pool.cluster_key,
        ["--parallelism", "single", "--model", str(second), "--model-id", "first",
         *TIGHT_COORDINATOR, "--load-on-demand"],
    )  # fmt: skip
    servers.append(server)
    second_id = second.name
    assert completions(server, "first") == references[0]  # loads it, then answers
    assert completions(server, second_id) == references[1]
    current = server.get("/v1/placements")[1]["current"]
    assert current["first"]["relayed"] and len(current["first"]["nodes"]) == 2, current
    assert not current[second_id]["relayed"] and len(current[second_id]["nodes"]) == 1, current
