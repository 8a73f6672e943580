"""Reasoning over Messages on the thinking demo model: the thought comes back as thinking blocks
(whole, or as thinking_delta events), never as text; thinking `disabled` turns it off; a thinking
block passed back reaches the prompt; a forced call never thinks.

Random weights never close a thought, so with thinking on everything generated is thought."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.core.runner import EngineRunner
from tests.helpers.api import (  # noqa: F401
    MODEL_ID,
    anyio_backend,
    make_service,
    open_client,
    start_runner,
    wait_idle,
)

pytestmark = pytest.mark.anyio
MESSAGES = "/v1/messages"
TOKENS = 8
OFF = {"thinking": {"type": "disabled"}}
CLOCK = {
    "name": "get_time",
    "input_schema": {"type": "object", "properties": {}, "additionalProperties": False},
}


@pytest.fixture(scope="module")
def runner(thinking_model_dir: Path) -> Iterator[EngineRunner]:
    runner = start_runner(thinking_model_dir, queue_size=8)
    yield runner
    runner.close()


@pytest.fixture
async def client(runner: EngineRunner) -> AsyncIterator[httpx.AsyncClient]:
    wait_idle(runner)
    async with open_client(make_service(runner)) as client:
        yield client


def body(**fields: Any) -> dict[str, Any]:
    ask = [{"role": "user", "content": "Hello there"}]
    return {"model": MODEL_ID, "max_tokens": TOKENS, "temperature": 0, "messages": ask, **fields}


async def message(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post(MESSAGES, json=body(**fields))
    assert response.status_code == 200, response.text
    return response.json()


async def streamed(client: httpx.AsyncClient, **fields: Any) -> list[tuple[str, Any]]:
    response = await client.post(MESSAGES, json=body(**fields, stream=True))
    assert response.status_code == 200, response.text
    events = []
    for block in response.text.split("\n\n"):
        if block:
            name, data = block.split("\n")
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def deltas(events: list[tuple[str, Any]], kind: str) -> str:
    key = {"thinking_delta": "thinking", "text_delta": "text"}[kind]
    return "".join(
        payload["delta"][key]
        for name, payload in events
        if name == "content_block_delta" and payload["delta"]["type"] == kind
    )


async def test_a_thought_is_a_thinking_block_never_text(client: httpx.AsyncClient) -> None:
    whole = await message(client)
    [block] = whole["content"]
    assert block["type"] == "thinking" and block["thinking"] and "<think>" not in block["thinking"]
    assert block["signature"] == ""
    assert whole["stop_reason"] == "max_tokens" and whole["usage"]["output_tokens"] == TOKENS
    events = await streamed(client)
    starts = [payload["content_block"] for name, payload in events if name == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}]
    assert deltas(events, "thinking_delta") == block["thinking"]  # greedy: the same thought
    assert deltas(events, "text_delta") == ""


async def test_thinking_disabled_gives_text_only(client: httpx.AsyncClient) -> None:
    whole = await message(client, **OFF)
    [block] = whole["content"]
    assert block["type"] == "text" and block["text"]
    events = await streamed(client, **OFF)
    assert deltas(events, "text_delta") == block["text"]
    assert deltas(events, "thinking_delta") == ""
    # adaptive (Claude Code's) keeps the template's default: it thinks
    adaptive = await message(client, thinking={"type": "adaptive"})
    assert [block["type"] for block in adaptive["content"]] == ["thinking"]


async def test_a_thinking_block_passed_back_is_in_the_prompt(
    client: httpx.AsyncClient, runner: EngineRunner
) -> None:
    thought = "The user greets me; greet back."
    said = [
        {"type": "thinking", "thinking": thought, "signature": ""},
        {"type": "text", "text": "Hi."},
    ]
    turns = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "And again"},
    ]
    without = [*turns[:1], {"role": "assistant", "content": said[1:]}, *turns[2:]]
    counted = []
    for conversation in (turns, without):
        request = {"model": MODEL_ID, "messages": conversation}
        response = await client.post(f"{MESSAGES}/count_tokens", json=request)
        counted.append(response.json()["input_tokens"])
    tokenizer = runner.engine.tokenizer
    thought_tokens = len(tokenizer.encode(thought, add_special_tokens=False))
    assert counted[0] >= counted[1] + thought_tokens


async def test_a_forced_call_never_thinks(client: httpx.AsyncClient) -> None:
    forced = {"tools": [CLOCK], "tool_choice": {"type": "any"}, "max_tokens": 48}
    whole = await message(client, **forced)
    assert whole["stop_reason"] == "tool_use", whole
    [call] = whole["content"]
    assert call["type"] == "tool_use" and call["name"] == "get_time" and call["input"] == {}
    events = await streamed(client, **forced)
    starts = [
        payload["content_block"]["type"]
        for name, payload in events
        if name == "content_block_start"
    ]
    assert starts == ["tool_use"]
