"""Every dialect on every engine: pp and tp (real `tandem serve` + `tandem join` processes on
127.0.0.1, serving the thinking demo model) each answer Messages, Responses and Ollama
requests, streamed and not, thinking and not, with the greedy thought and text chat
completions give on the same server. (single: tests/api.)"""

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
    request: pytest.FixtureRequest,
    thinking_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServeProcess]:
    """One agent and a server that plans the given strategy over the two of them."""
    tmp = tmp_path_factory.mktemp(request.param)
    pool = AgentPool(tmp / "agents")
    started: ServeProcess | None = None
    try:
        pool.start("member", real_roles=True)
        args = [*PLANS[request.param], "--model-id", MODEL_ID]
        started = start_serve(tmp, thinking_model_dir, pool.cluster_key, args)
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


Answer = tuple[str, str]  # (the thought, the text)


def joined(parts: list[tuple[str, str]]) -> Answer:
    """(thought, text) from ("reasoning" | "content", piece) parts."""
    return (
        "".join(text for kind, text in parts if kind == "reasoning"),
        "".join(text for kind, text in parts if kind == "content"),
    )


def chat_answer(client: httpx.Client, stream: bool, thinking: bool) -> Answer:
    body = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"stream": stream} | ({} if thinking else {"reasoning_effort": "none"})
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        message = response.json()["choices"][0]["message"]
        return message.get("reasoning_content") or "", message["content"] or ""
    deltas = [data["choices"][0]["delta"] for _, data in sse_events(response.text)]
    return joined(
        [(kind, delta[field]) for delta in deltas
         for kind, field in (("reasoning", "reasoning_content"), ("content", "content"))
         if delta.get(field)]
    )  # fmt: skip


def messages_answer(client: httpx.Client, stream: bool, thinking: bool) -> Answer:
    body = {"model": MODEL_ID, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"stream": stream} | ({} if thinking else {"thinking": {"type": "disabled"}})
    response = client.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        blocks = response.json()["content"]
        return joined(
            [("reasoning", b["thinking"]) for b in blocks if b["type"] == "thinking"]
            + [("content", b["text"]) for b in blocks if b["type"] == "text"]
        )
    events = sse_events(response.text)
    assert events[-1][0] == "message_stop", events[-3:]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    return joined(
        [("reasoning", d["thinking"]) for d in deltas if d["type"] == "thinking_delta"]
        + [("content", d["text"]) for d in deltas if d["type"] == "text_delta"]
    )


def responses_answer(client: httpx.Client, stream: bool, thinking: bool) -> Answer:
    body = {"model": MODEL_ID, "input": QUESTION, "max_output_tokens": MAX_TOKENS}
    body |= {"temperature": 0, "store": False, "stream": stream}
    body |= {} if thinking else {"reasoning": {"effort": "none"}}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        items = response.json()["output"]
        return joined(
            [("reasoning", part["text"]) for item in items if item["type"] == "reasoning"
             for part in item.get("content") or ()]
            + [("content", part["text"]) for item in items if item["type"] == "message"
               for part in item["content"]]
        )  # fmt: skip
    events = sse_events(response.text)
    assert events[-1][1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    kinds = {"response.reasoning_text.delta": "reasoning", "response.output_text.delta": "content"}
    return joined([(kinds[d["type"]], d["delta"]) for _, d in events if d["type"] in kinds])


def ollama_answer(client: httpx.Client, stream: bool, thinking: bool) -> Answer:
    body = {"model": MODEL_ID, "messages": QUESTION, "stream": stream, "think": thinking}
    body["options"] = {"num_predict": MAX_TOKENS, "temperature": 0}
    response = client.post("/api/chat", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        message = response.json()["message"]
        return message.get("thinking") or "", message["content"]
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    assert lines[-1]["done"] is True, lines[-1]
    return joined(
        [("reasoning", line["message"].get("thinking") or "") for line in lines]
        + [("content", line["message"]["content"]) for line in lines]
    )


DIALECTS = {"messages": messages_answer, "responses": responses_answer, "ollama": ollama_answer}


def test_each_dialect_answers_as_chat_does(server: ServeProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        expected = {thinking: chat_answer(client, False, thinking) for thinking in (True, False)}
        thought, text = expected[True]
        assert thought and not text  # the template opens a thought the demo never closes
        assert expected[False][1] and not expected[False][0]
        assert all(
            chat_answer(client, True, thinking) == expected[thinking] for thinking in expected
        )
        answers = {
            (name, stream, thinking): answer_of(client, stream, thinking)
            for name, answer_of in DIALECTS.items()
            for stream in (False, True)
            for thinking in (True, False)
        }
    assert answers == {key: expected[key[2]] for key in answers}
