"""Reasoning on the thinking demo model, end to end over chat completions: the thought comes back
as reasoning_content (whole or streamed), never in content; reasoning_effort "none" and
chat_template_kwargs turn it off; a thought passed back reaches the prompt; a grammar (JSON
mode, a forced tool call) turns thinking off.

Random weights never close a thought (engines/model/demo_tokenizer.py), so with thinking on
everything generated is reasoning; tests/api/test_reply.py covers a thought that ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.core.runner import EngineRunner
from tests.helpers.api import (  # noqa: F401
    CLOCK,
    WEATHER,
    anyio_backend,
    chat_body,
    make_service,
    open_client,
    parse_sse,
    start_runner,
    wait_idle,
)

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
TOKENS = 8
OFF = {"reasoning_effort": "none"}
TEMPLATE_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


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


async def answer(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post(CHAT, json=chat_body(**{"max_tokens": TOKENS, **fields}))
    assert response.status_code == 200, response.text
    return response.json()


async def streamed(client: httpx.AsyncClient, **fields: Any) -> tuple[str, str, list[Any]]:
    """(reasoning, content, chunks) of a streamed answer."""
    body = chat_body(**{"max_tokens": TOKENS, **fields}, stream=True)
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    chunks = [chunk for chunk in parse_sse(response.text) if chunk != "[DONE]"]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    reasoning = "".join(delta.get("reasoning_content") or "" for delta in deltas)
    content = "".join(delta.get("content") or "" for delta in deltas)
    return reasoning, content, chunks


async def test_a_thought_is_reasoning_content_never_content(client: httpx.AsyncClient) -> None:
    body = await answer(client)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == ""
    assert "<think>" not in message["reasoning_content"]
    assert body["usage"]["completion_tokens"] == TOKENS
    reasoning, content, chunks = await streamed(client)
    assert (reasoning, content) == (message["reasoning_content"], "")  # greedy: the same text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("switch", [OFF, TEMPLATE_OFF], ids=["reasoning_effort", "template"])
async def test_thinking_off_gives_content_only(client: httpx.AsyncClient, switch: Any) -> None:
    message = (await answer(client, **switch))["choices"][0]["message"]
    assert message["content"] and "reasoning_content" not in message
    reasoning, content, _ = await streamed(client, **switch)
    assert (reasoning, content) == ("", message["content"])
    # off, the prompt ends after an empty thought: a different prompt from thinking on
    thinking = (await answer(client))["choices"][0]["message"]
    assert message["content"] != thinking["reasoning_content"]


async def test_both_switches_give_the_same_prompt(client: httpx.AsyncClient) -> None:
    by_effort, by_template = await answer(client, **OFF), await answer(client, **TEMPLATE_OFF)
    assert by_effort["usage"] == by_template["usage"]
    assert by_effort["choices"][0]["message"] == by_template["choices"][0]["message"]


async def test_other_efforts_keep_the_templates_thinking(client: httpx.AsyncClient) -> None:
    message = (await answer(client, reasoning_effort="low"))["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == ""


async def test_a_thought_passed_back_is_in_the_prompt(
    client: httpx.AsyncClient, runner: EngineRunner
) -> None:
    thought = "The user greets me; greet back."
    turns = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi.", "reasoning_content": thought},
        {"role": "user", "content": "And again"},
    ]
    without = [
        {key: value for key, value in turn.items() if key != "reasoning_content"} for turn in turns
    ]
    counted = [
        (await answer(client, messages=m))["usage"]["prompt_tokens"] for m in (turns, without)
    ]
    tokenizer = runner.engine.tokenizer
    prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
    assert f"<think>\n{thought}\n</think>\n\nHi." in tokenizer.decode(prompt)
    assert counted[0] == len(prompt)
    assert counted[0] >= counted[1] + len(tokenizer.encode(thought, add_special_tokens=False))


async def test_json_mode_turns_thinking_off(client: httpx.AsyncClient) -> None:
    json_mode = {"response_format": {"type": "json_object"}, "max_tokens": 16}
    body = await answer(client, **json_mode)
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("{")
    reasoning, content, _ = await streamed(client, **json_mode)
    assert (reasoning, content) == ("", message["content"])
    # the prompt is the one thinking off gives: the grammar binds from the first token
    thinking_off = await answer(client, **OFF, max_tokens=1)
    assert body["usage"]["prompt_tokens"] == thinking_off["usage"]["prompt_tokens"]


async def test_a_forced_tool_call_beside_thinking(client: httpx.AsyncClient) -> None:
    # the call without arguments: the shortest a grammar can force
    forced = {"tools": [CLOCK], "tool_choice": "required", "max_tokens": 48}
    choice = (await answer(client, **forced))["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert "reasoning_content" not in choice["message"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and call["function"]["arguments"] == "{}"
    chunks = parse_sse((await client.post(CHAT, json=chat_body(**forced, stream=True))).text)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks[:-1]]
    assert not any(delta.get("reasoning_content") for delta in deltas)
    [streamed_call] = [call for delta in deltas for call in delta.get("tool_calls") or ()]
    assert streamed_call["function"]["name"] == "get_time"


async def test_tools_on_offer_keep_thinking_on(client: httpx.AsyncClient) -> None:
    message = (await answer(client, tools=[WEATHER]))["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == ""
    assert "tool_calls" not in message
