"""Every dialect on every engine: pp and tp (real `tandem serve` + `tandem join` processes on
127.0.0.1) each answer Messages, Responses and Ollama requests, streamed and not, with the
greedy text chat completions gives on the same server. (single: tests/api.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.cluster import AgentPool
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster

MODEL_ID = "demo"
QUESTION = [{"role": "user", "content": "Where does the road go?"}]
MAX_TOKENS = 10
PLANS = {
    "pp": ["--parallelism", "pp"],
    "tp": ["--parallelism", "tp", "--collective", "ring"],
}


@pytest.fixture(scope="module", params=list(PLANS))
def server(
    request: pytest.FixtureRequest, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """One agent and a server that plans the given strategy over the two of them."""
    tmp = tmp_path_factory.mktemp(request.param)
    pool = AgentPool(tmp / "agents")
    started: ServeProcess | None = None
    try:
        pool.start("member", real_roles=True)
        args = [*PLANS[request.param], "--model-id", MODEL_ID]
        started = start_serve(tmp, demo_model_dir, pool.cluster_key, args)
        cluster = started.cluster()
        assert cluster["strategy"] == request.param, cluster["reason"]
        yield started
    finally:
        if started is not None:
            started.stop()
        pool.stop_all()


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """(event name, data) of each SSE block; comments and [DONE] left out."""
    events = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line.removeprefix("data: "))
        if data is not None:
            events.append((name, data))
    return events


def chat_text(client: httpx.Client, stream: bool) -> str:
    body = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = client.post("/v1/chat/completions", json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    return "".join(
        data["choices"][0]["delta"].get("content") or ""
        for _, data in sse_events(response.text)
        if data.get("choices")
    )


def messages_text(client: httpx.Client, stream: bool) -> str:
    body = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = client.post("/v1/messages", json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        return "".join(b["text"] for b in response.json()["content"] if b["type"] == "text")
    events = sse_events(response.text)
    assert events[-1][0] == "message_stop", events[-3:]
    return "".join(
        data["delta"]["text"]
        for name, data in events
        if name == "content_block_delta" and data["delta"]["type"] == "text_delta"
    )


def responses_text(client: httpx.Client, stream: bool) -> str:
    body = {"model": MODEL_ID, "input": QUESTION, "max_output_tokens": MAX_TOKENS}
    body |= {"temperature": 0, "store": False, "stream": stream}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        return "".join(
            part["text"]
            for item in response.json()["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
    events = sse_events(response.text)
    assert events[-1][1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    return "".join(
        data["delta"] for _, data in events if data["type"] == "response.output_text.delta"
    )


def ollama_text(client: httpx.Client, stream: bool) -> str:
    body = {"model": MODEL_ID, "messages": QUESTION, "stream": stream}
    body["options"] = {"num_predict": MAX_TOKENS, "temperature": 0}
    response = client.post("/api/chat", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["message"]["content"]
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    assert lines[-1]["done"] is True, lines[-1]
    return "".join(line["message"]["content"] for line in lines)


DIALECTS = {"messages": messages_text, "responses": responses_text, "ollama": ollama_text}


def test_each_dialect_answers_as_chat_does(server: ServeProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        expected = chat_text(client, stream=False)
        assert expected and chat_text(client, stream=True) == expected
        answers = {
            (name, stream): text_of(client, stream)
            for name, text_of in DIALECTS.items()
            for stream in (False, True)
        }
    assert answers == dict.fromkeys(answers, expected)
