"""The OpenAI Responses dialect, driven by the official openai client against a real uvicorn
server on 127.0.0.1 (demo model): create, stream, a function-tool round trip, json_schema, the
store and previous_response_id, hosted tools; greedy equals chat completions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engines.api import create_app
from engines.core.runner import EngineRunner
from tests.helpers.api import (
    LONG,
    MODEL_ID,
    assert_error,
    make_service,
    open_client,
    serve_on_loopback,  # noqa: F401
    start_runner,
    wait_idle,
)

TOKENS = 8
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
# What Codex CLI offers beside its function tools: tandem runs none of them.
HOSTED = [
    {"type": "web_search", "external_web_access": False},
    {"type": "local_shell"},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark"}},
]
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "label": {"type": "string", "maxLength": 5}},
    "required": ["x", "label"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def runner(demo_model_dir: Any) -> Iterator[EngineRunner]:
    runner = start_runner(demo_model_dir, queue_size=8)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def base_url(runner: EngineRunner) -> Iterator[str]:
    with serve_on_loopback(create_app(make_service(runner))) as url:
        yield url


@pytest.fixture
def client(base_url: str, runner: EngineRunner) -> Iterator[openai.OpenAI]:
    wait_idle(runner)
    with openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30
    ) as client:
        yield client


def create(client: openai.OpenAI, **fields: Any) -> Any:
    options = {"model": MODEL_ID, "max_output_tokens": TOKENS, "temperature": 0, **fields}
    return client.responses.create(**options)


def test_create_from_a_string(client: openai.OpenAI) -> None:
    response = create(client, input="Say something.", instructions="You are terse.")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL_ID
    # random weights never stop on their own: the answer runs out of tokens
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    assert response.output_text == part.text and part.text
    usage = response.usage
    assert usage.output_tokens == TOKENS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == "You are terse." and response.max_output_tokens == TOKENS
    # the instructions are the first turn: without them the prompt is shorter
    bare = create(client, input="Say something.")
    assert bare.usage.input_tokens < usage.input_tokens


def test_items_input(client: openai.OpenAI) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
        },
        {"role": "user", "content": "Again?"},
    ]
    response = create(client, input=items)
    assert response.output_text
    plain = create(client, input="Again?")
    assert response.usage.input_tokens > plain.usage.input_tokens


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    whole = create(client, input="Say something.")
    events = list(create(client, input="Say something.", stream=True))
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text  # greedy: the same text
    assert final.output[0].id == events[2].item.id
    assert final.usage.output_tokens == TOKENS and final.status == "incomplete"
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    asked = create(
        client,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
    )
    assert asked.status == "completed"
    [call] = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    answer = create(
        client,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
    )
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    plain = create(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="none")
    assert answer.usage.input_tokens > plain.usage.input_tokens  # the call and its output
    # the SDK's own way: the call's output alone, continuing the stored response
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    follow = create(
        client, input=[output], previous_response_id=asked.id, tools=[WEATHER], tool_choice="none"
    )
    assert follow.output_text == answer.output_text  # greedy, and the same prompt
    assert follow.usage.input_tokens == answer.usage.input_tokens


def test_streamed_tool_call_with_the_sdk_stream_helper(client: openai.OpenAI) -> None:
    options = {"model": MODEL_ID, "temperature": 0, "max_output_tokens": 64}
    choice = {"type": "function", "name": "get_weather"}
    with client.responses.stream(
        input="Weather?", tools=[WEATHER, *HOSTED], tool_choice=choice, **options
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert types[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert [tool.type for tool in final.tools] == [
        "function",
        "web_search",
        "local_shell",
        "custom",
    ]


def test_json_schema_output(client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}}
    response = create(client, input="A point.", text=text, max_output_tokens=64)
    assert response.status == "completed"
    point = json.loads(response.output_text)
    assert set(point) == {"x", "label"}
    assert isinstance(point["x"], int) and isinstance(point["label"], str)
    assert len(point["label"]) <= 5
    assert response.text.format.type == "json_schema"
    anything = create(
        client, input="JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=64
    )
    assert isinstance(json.loads(anything.output_text), dict)


def test_stored_responses_continue_and_can_be_deleted(client: openai.OpenAI) -> None:
    first = create(client, input="Remember this.")  # store defaults to true, as OpenAI's
    assert first.store is True
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    follow = create(client, input="And then?", previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    alone = create(client, input="And then?")
    assert follow.usage.input_tokens > alone.usage.input_tokens  # the earlier turns came along
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as raised:
        create(client, input="More?", previous_response_id=first.id)
    assert raised.value.body["param"] == "previous_response_id"
    unstored = create(client, input="Forget this.", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_hosted_tools_are_not_offered_and_cannot_be_forced(client: openai.OpenAI) -> None:
    plain = create(client, input="Search.")
    offered = create(client, input="Search.", tools=HOSTED, include=["reasoning.encrypted_content"])
    assert offered.output_text == plain.output_text  # the model saw no tools at all
    assert offered.usage.input_tokens == plain.usage.input_tokens
    assert [tool.type for tool in offered.tools] == ["web_search", "local_shell", "custom"]
    with pytest.raises(openai.BadRequestError) as raised:
        create(client, input="Search.", tools=HOSTED, tool_choice={"type": "web_search"})
    assert raised.value.body["param"] == "tool_choice"
    assert "web_search" in raised.value.body["message"]


def test_codex_style_request_with_fields_nobody_knows_yet(base_url: str) -> None:
    body = {
        "model": MODEL_ID,
        "instructions": "You are a coding agent.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "sandbox"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
        ],
        "tools": [WEATHER, *HOSTED],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0198-session",
        "text": {"verbosity": "low"},
        "max_output_tokens": TOKENS,
        "client_metadata": {"terminal": "xterm"},  # a field tandem has never heard of
    }
    response = httpx.post(f"{base_url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [
        line.removeprefix("event: ")
        for line in response.text.splitlines()
        if line.startswith("event: ")
    ]
    assert names[0] == "response.created" and names[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert "[DONE]" not in response.text


def test_greedy_answer_equals_chat_completions(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=12, temperature=0
    )
    response = create(client, instructions="Terse.", input="Hello there", max_output_tokens=12)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def named_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of a named-event SSE body; comments skipped."""
    events = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("event: "):
            events.append(
                (lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: ")))
            )
    return events


@pytest.mark.anyio
async def test_a_generation_that_fails_mid_stream_ends_in_response_failed(
    runner: EngineRunner, anyio_backend: str
) -> None:
    wait_idle(runner)
    async with open_client(make_service(runner, request_timeout_s=0.2)) as client:
        whole = await client.post(
            "/v1/responses", json={"model": MODEL_ID, "input": "Hi", "max_output_tokens": LONG}
        )
        assert_error(whole, 504, type="timeout_error", code="timeout")
        body = {"model": MODEL_ID, "input": "Hi", "max_output_tokens": LONG, "stream": True}
        streamed = await client.post("/v1/responses", json=body)
    events = named_events(streamed.text)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    error = data["response"]["error"]
    assert error["code"] == "server_error" and "timed out" in error["message"]
    for item in data["response"]["output"]:  # what was written before the failure, closed
        assert item["status"] == "incomplete"


@pytest.mark.anyio
async def test_without_max_output_tokens_as_much_as_fits(
    runner: EngineRunner, anyio_backend: str
) -> None:
    wait_idle(runner)
    body = {"model": MODEL_ID, "input": "Hi", "temperature": 0}
    async with open_client(make_service(runner, max_tokens_cap=20)) as client:
        capped = (await client.post("/v1/responses", json=body)).json()
    assert capped["usage"]["output_tokens"] == 20  # --max-tokens-cap, not the default 256
    assert capped["max_output_tokens"] is None and capped["status"] == "incomplete"
    async with open_client(make_service(runner), max_prompt_tokens=60) as client:
        roomy = (await client.post("/v1/responses", json=body)).json()
    usage = roomy["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == 60  # the room the prompt leaves


def test_logprobs_come_with_the_text(client: openai.OpenAI) -> None:
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = create(client, input="Hi", **asked)
    [part] = response.output[0].content
    assert len(part.logprobs) == TOKENS
    # each token decoded alone (a first token's leading space stays; the text drops it)
    assert "".join(token.token for token in part.logprobs).strip() == part.text.strip()
    assert all(len(token.top_logprobs) == 2 for token in part.logprobs)
    events = list(create(client, input="Hi", stream=True, **asked))
    streamed = [
        token.logprob
        for event in events
        if event.type == "response.output_text.delta"
        for token in event.logprobs
    ]
    assert streamed == [token.logprob for token in part.logprobs]  # greedy: the same tokens
    assert not create(client, input="Hi").output[0].content[0].logprobs  # off unless asked
