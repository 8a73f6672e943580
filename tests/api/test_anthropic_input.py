"""Messages input mapped in and refused: each bad body gets Anthropic's error shape and a 4xx
before any request reaches the engine; max_tokens cut to the room; errors mid-stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engines.api.anthropic.mapping import chat_input_of, sampling_of
from engines.api.anthropic.schemas import MessagesRequest
from engines.core.runner import EngineRunner, Submission
from engines.core.service import Service, ServiceLimits
from tests.helpers.api import (  # noqa: F401
    LONG,
    MODEL_ID,
    WEATHER,
    anyio_backend,
    idle_runner,
    make_service,
    open_client,
    runner,
)

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Hello there"}]
TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
CALLED = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}],
}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


class CountingService(Service):
    """A Service that counts what reaches its runner."""

    submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Submission:
        self.submitted += 1
        return super().submit(*args, **kwargs)


def counting_service(runner: EngineRunner, **limits: Any) -> CountingService:
    plain = make_service(runner, **limits)
    return CountingService(
        model_id=plain.model_id,
        tokenizer=plain.tokenizer,
        limits=plain.limits,
        runner=runner,
        state="ok",
    )


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "messages": ASK, **fields}


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def result(tool_use_id: str = "toolu_1", content: Any = "sunny") -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content}


@pytest.fixture
async def guarded(runner: EngineRunner) -> AsyncIterator[tuple[httpx.AsyncClient, CountingService]]:
    service = counting_service(runner)
    async with open_client(service, max_body_bytes=64 * 1024) as client:
        yield client, service


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    payload = response.json()
    assert set(payload) == {"type", "error"} and payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == kind
    message = payload["error"]["message"]
    assert message and "Traceback" not in message
    return message


BAD_BODIES = [
    ("image", body(messages=[user(IMAGE)]), "messages.0.content.0: images are not supported"),
    (
        "document",
        body(messages=[user({"type": "document", "source": {}})]),
        "messages.0.content.0: documents are not supported",
    ),
    (
        "image in a tool result",
        body(messages=[ASK[0], CALLED, user(result(content=[IMAGE]))]),
        "messages.2.content.0.content.0: images",
    ),
    (
        "server tool result",
        body(messages=[user({"type": "web_search_tool_result", "tool_use_id": "x"})]),
        "'web_search_tool_result' blocks are not supported",
    ),
    (
        "tool result for an unknown id",
        body(messages=[ASK[0], CALLED, user(result("toolu_2"))]),
        "messages.2.content.0.tool_use_id: tool_result answers tool_use_id 'toolu_2'",
    ),
    (
        "tool result before any call",
        body(messages=[user(result())]),
        "no earlier assistant message has a tool_use block",
    ),
    ("tool_use from the user", body(messages=[user(CALLED["content"][0])]), "in a user message"),
    (
        "tool result in the system prompt",
        body(system=[result()]),
        "cannot appear in the system prompt",
    ),
    (
        "server tool",
        body(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]),
        "tools.0.type: 'web_search_20250305' (web_search) is a tool Anthropic's servers define",
    ),
    ("tool without a schema", body(tools=[{"name": "x"}]), "'tools.0.input_schema' is required"),
    (
        "mcp servers",
        body(mcp_servers=[{"type": "url", "url": "http://127.0.0.1", "name": "x"}]),
        "mcp_servers: MCP servers are not supported",
    ),
    ("text block without text", body(messages=[user({"type": "text"})]), "text' is required"),
    ("block not an object", body(messages=[user("hi")]), "messages.0.content"),
    ("block type an object", body(messages=[user({"type": {}})]), "messages.0.content.0.type"),
    ("content a number", body(messages=[{"role": "user", "content": 3}]), "messages.0.content"),
    ("unknown role", body(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
    ("no messages", body(messages=[]), "messages"),
    ("no max_tokens", {"model": MODEL_ID, "messages": ASK}, "'max_tokens' is required"),
    ("max_tokens as text", body(max_tokens="8"), "max_tokens"),
    ("max_tokens zero", body(max_tokens=0), "max_tokens"),
    ("temperature above Anthropic's 1", body(temperature=1.5), "temperature"),
    ("top_k negative", body(top_k=-1), "top_k"),
    ("stream as text", body(stream="yes"), "stream"),
    ("too many stop sequences", body(stop_sequences=list("abcde")), "stop_sequences"),
    ("unknown tool choice", body(tool_choice={"type": "some"}), "tool_choice.type"),
    ("forced call without tools", body(tool_choice={"type": "any"}), "needs tools"),
    (
        "forced tool not offered",
        body(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}),
        "'nope', which is not in tools",
    ),
    (
        "forced tool without a name",
        body(tools=[TOOL], tool_choice={"type": "tool"}),
        "'tool_choice.name' is required",
    ),
    (
        "prefilled assistant turn",
        body(messages=[*ASK, {"role": "assistant", "content": "Sure"}]),
        "prefilled assistant turn is not supported",
    ),
    ("thinking without a type", body(thinking={"budget_tokens": 2048}), "thinking.type"),
    (
        "bad output schema",
        body(output_config={"format": {"type": "json_schema", "schema": {"type": 3}}}),
        "output_config.format.schema",
    ),
]

# Fields only generation reads: count_tokens takes these bodies (and ignores the field).
SAMPLING_CASES = {
    "no max_tokens",
    "max_tokens as text",
    "max_tokens zero",
    "temperature above Anthropic's 1",
    "top_k negative",
    "stream as text",
    "too many stop sequences",
}


@pytest.mark.parametrize(("case", "sent", "expected"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
async def test_bad_input_is_a_400_in_anthropic_shape_and_never_reaches_the_engine(
    guarded: tuple[httpx.AsyncClient, CountingService],
    case: str,
    sent: dict[str, Any],
    expected: str,
) -> None:
    client, service = guarded
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = await client.post(path, json=sent)
        if path.endswith("count_tokens") and case in SAMPLING_CASES:
            assert response.status_code == 200, response.text  # it samples nothing
            continue
        message = assert_anthropic_error(response, 400, "invalid_request_error")
        assert expected in message, (case, path, message)
    assert service.submitted == 0


async def test_malformed_and_oversized_bodies(
    guarded: tuple[httpx.AsyncClient, CountingService],
) -> None:
    client, service = guarded
    broken = await client.post("/v1/messages", content=b'{"model": ', headers=JSON)
    assert "not valid JSON" in assert_anthropic_error(broken, 400, "invalid_request_error")
    listed = await client.post("/v1/messages", json=[body()])
    assert_anthropic_error(listed, 400, "invalid_request_error")
    huge = body(messages=[{"role": "user", "content": "x" * 70_000}])
    too_large = await client.post("/v1/messages", json=huge)
    assert "--max-body-bytes" in assert_anthropic_error(too_large, 413, "request_too_large")
    missing = await client.post("/v1/messages", json=body(model="claude-opus-4-7"))
    assert "claude-opus-4-7" in assert_anthropic_error(missing, 404, "not_found_error")
    wrong_method = await client.get("/v1/messages")
    assert_anthropic_error(wrong_method, 405, "invalid_request_error")
    assert service.submitted == 0


JSON = {"content-type": "application/json"}


async def test_a_key_is_needed_by_either_header(runner: EngineRunner) -> None:
    service = counting_service(runner, api_key="sesame")
    async with open_client(service) as client:
        missing = await client.post("/v1/messages", json=body())
        assert "missing API key" in assert_anthropic_error(missing, 401, "authentication_error")
        wrong = await client.post("/v1/messages", json=body(), headers={"x-api-key": "nope"})
        assert_anthropic_error(wrong, 401, "authentication_error")
        assert service.submitted == 0
        by_key = await client.post("/v1/messages", json=body(), headers={"x-api-key": "sesame"})
        bearer = {"authorization": "Bearer sesame"}
        by_bearer = await client.post("/v1/messages/count_tokens", json=body(), headers=bearer)
    assert by_key.status_code == 200 and by_bearer.status_code == 200
    assert by_key.json()["usage"]["input_tokens"] == by_bearer.json()["input_tokens"]


async def test_max_tokens_is_cut_to_the_cap_and_to_the_room_left(runner: EngineRunner) -> None:
    async with open_client(counting_service(runner, max_tokens_cap=6)) as client:
        capped = await client.post("/v1/messages", json=body(max_tokens=128_000))
    assert capped.status_code == 200, capped.text
    assert capped.json()["usage"]["output_tokens"] == 6
    assert capped.json()["stop_reason"] == "max_tokens"
    service = counting_service(runner)
    async with open_client(service, max_prompt_tokens=24) as client:
        prompt = (await client.post("/v1/messages/count_tokens", json=body())).json()
        roomy = await client.post("/v1/messages", json=body(max_tokens=128_000))
    assert roomy.status_code == 200, roomy.text
    room = 24 - prompt["input_tokens"]
    assert 0 < roomy.json()["usage"]["output_tokens"] <= room


async def test_a_failure_mid_stream_is_an_error_event(runner: EngineRunner) -> None:
    service = counting_service(runner, request_timeout_s=0.5)
    async with open_client(service) as client:
        response = await client.post("/v1/messages", json=body(max_tokens=LONG, stream=True))
    assert response.status_code == 200
    events = named_events(response.text)
    assert events[0][0] == "message_start"
    name, payload = events[-1]
    assert name == "error" and payload["type"] == "error"
    assert payload["error"]["type"] == "timeout_error" and payload["error"]["message"]


async def test_conversation_maps_onto_chat_turns() -> None:
    """Blocks become the turns a chat template reads: calls, thoughts, results, system."""
    request = MessagesRequest.model_validate(
        body(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            messages=[
                ASK[0],
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "They want weather.", "signature": "s"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Checking."},
                        CALLED["content"][0],
                    ],
                },
                user(
                    {**result(content=[{"type": "text", "text": "rain"}]), "is_error": True},
                    {"type": "text", "text": "And "},
                    {"type": "text", "text": "tomorrow?"},
                ),
                {"role": "system", "content": "Mid-conversation note."},
            ],
            tools=[TOOL],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            thinking={"type": "disabled"},
        )
    )
    chat = chat_input_of(request)
    assert [(turn.role, turn.content) for turn in chat.turns] == [
        ("system", "Be brief.\n\nBe kind."),
        ("user", "Hello there"),
        ("assistant", "Checking."),
        ("tool", "Error: rain"),
        ("user", "And tomorrow?"),
        ("system", "Mid-conversation note."),
    ]
    assistant = chat.turns[2]
    assert assistant.reasoning == "They want weather."
    assert [(call.id, call.name, call.arguments) for call in assistant.tool_calls] == [
        ("toolu_1", "get_weather", "{}")
    ]
    assert chat.turns[3].tool_call_id == "toolu_1"
    assert chat.tool_mode == "auto" and not chat.parallel_tool_calls
    assert chat.thinking is False
    assert chat.template_tools()[0]["function"]["parameters"] == TOOL["input_schema"]


async def test_sampling_defaults_are_anthropics() -> None:
    sampling = sampling_of(MessagesRequest.model_validate(body(temperature=None)), ServiceLimits())
    assert (
        sampling.temperature is None and sampling.given()["temperature"] == 1.0
    )  # Anthropic's default: its SDK sends none
    assert sampling.clamp_max_tokens and sampling.max_tokens == 8
    forced = MessagesRequest.model_validate(
        body(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"})
    )
    chat = chat_input_of(forced)
    assert chat.forces_call() and chat.forced_tool == "get_weather"
    assert (
        chat_input_of(MessagesRequest.model_validate(body(thinking={"type": "adaptive"}))).thinking
        is None
    )


def named_events(text: str) -> list[tuple[str, Any]]:
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events
