"""Reasoning in the Responses dialect on the thinking demo model, through the official openai
client: the thought is a reasoning item (whole or streamed as reasoning_text events), never
output_text; effort "none" turns it off; a reasoning item passed back, or a stored response
continued, puts the thought in the prompt.

Random weights never close a thought (engines/model/demo_tokenizer.py), so with thinking on
everything generated is reasoning and the message is empty."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.api import create_app
from engines.core.runner import EngineRunner
from tests.helpers.api import (  # noqa: F401
    MODEL_ID,
    anyio_backend,
    make_service,
    start_runner,
    wait_idle,
)

pytestmark = pytest.mark.anyio
TOKENS = 8
THOUGHT = "The user greets me; greet back."


@pytest.fixture(scope="module")
def runner(thinking_model_dir: Path) -> Iterator[EngineRunner]:
    runner = start_runner(thinking_model_dir, queue_size=8)
    yield runner
    runner.close()


@pytest.fixture
async def client(runner: EngineRunner) -> AsyncIterator[openai.AsyncOpenAI]:
    wait_idle(runner)
    transport = httpx.ASGITransport(app=create_app(make_service(runner)))
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test/v1") as http:
        yield openai.AsyncOpenAI(
            base_url="http://tandem.test/v1", api_key="unused", http_client=http, max_retries=0
        )


async def create(client: openai.AsyncOpenAI, **fields: Any) -> Any:
    options = {"model": MODEL_ID, "input": "Hello there", "max_output_tokens": TOKENS}
    return await client.responses.create(**{**options, "temperature": 0, **fields})


async def test_a_thought_is_a_reasoning_item_never_output_text(
    client: openai.AsyncOpenAI, runner: EngineRunner
) -> None:
    response = await create(client)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    [thought] = reasoning.content
    assert thought.type == "reasoning_text" and thought.text and "<think>" not in thought.text
    assert message.type == "message" and response.output_text == ""
    counted = len(runner.engine.tokenizer.encode(thought.text, add_special_tokens=False))
    assert response.usage.output_tokens_details.reasoning_tokens == counted
    assert 0 < counted <= response.usage.output_tokens == TOKENS
    stream = await create(client, stream=True)
    events = [event async for event in stream]
    types = [event.type for event in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought.text  # greedy: the same thought
    assert "response.output_text.delta" not in types
    done = [event for event in events if event.type == "response.reasoning_text.done"]
    assert [event.text for event in done] == [thought.text]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].id == events[2].item.id


async def test_effort_none_turns_thinking_off(client: openai.AsyncOpenAI) -> None:
    response = await create(client, reasoning={"effort": "none"})
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.reasoning.effort == "none"
    medium = await create(client, reasoning={"effort": "medium", "summary": "auto"})
    assert [item.type for item in medium.output] == ["reasoning", "message"]


async def test_a_reasoning_item_passed_back_is_in_the_prompt(client: openai.AsyncOpenAI) -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": THOUGHT}],
    }
    turns = [
        {"role": "user", "content": "Hello there"},
        reasoning,
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And again"},
    ]
    with_thought = await create(client, input=turns)
    without = await create(client, input=[turn for turn in turns if turn is not reasoning])
    assert with_thought.usage.input_tokens > without.usage.input_tokens


async def test_a_stored_response_continues_with_its_thought(client: openai.AsyncOpenAI) -> None:
    first = await create(client)
    follow = await create(client, input="And again", previous_response_id=first.id)
    [reasoning, message] = first.output
    replayed = [
        {"role": "user", "content": "Hello there"},
        reasoning.model_dump(exclude_none=True),
        {"role": "assistant", "content": message.content[0].text},
        {"role": "user", "content": "And again"},
    ]
    by_hand = await create(client, input=replayed)
    assert follow.usage.input_tokens == by_hand.usage.input_tokens
    assert follow.output[0].content[0].text == by_hand.output[0].content[0].text


async def test_a_sealed_thought_comes_back_as_codex_sends_it(client: openai.AsyncOpenAI) -> None:
    # Codex asks for encrypted_content and passes a reasoning item back without its content
    first = await create(client, include=["reasoning.encrypted_content"])
    reasoning, message = first.output
    assert reasoning.encrypted_content.endswith(reasoning.content[0].text)
    assert (await create(client)).output[0].encrypted_content is None  # only when included
    turns = [
        {"role": "user", "content": "Hello there"},
        {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content},
        {"role": "assistant", "content": message.content[0].text},
        {"role": "user", "content": "And again"},
    ]
    sealed = await create(client, input=turns)
    turns[1] = reasoning.model_dump(exclude_none=True, exclude={"encrypted_content"})
    plain = await create(client, input=turns)
    assert sealed.usage.input_tokens == plain.usage.input_tokens
    turns[1] = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-openai-blob"}
    foreign = await create(client, input=turns)  # another server's: not a thought of ours
    assert foreign.usage.input_tokens < plain.usage.input_tokens
