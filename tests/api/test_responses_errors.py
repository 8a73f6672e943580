"""Bad Responses requests: each is a 4xx in OpenAI's error shape naming the Responses field,
and none reaches an engine (the service has none: anything that got through would be a 503).
Also the store's bound."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from engines.api.responses.objects import Response
from engines.api.responses.store import ResponseStore
from engines.core.service import Service, ServiceLimits
from tests.helpers.api import MODEL_ID, anyio_backend, assert_error, open_client  # noqa: F401

pytestmark = pytest.mark.anyio
RESPONSES = "/v1/responses"
FUNCTION = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "input": "Hello", "max_output_tokens": 8, **fields}


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


TEXT = {"type": "input_text", "text": "look"}
BAD_REQUESTS = [
    # (body (str: raw bytes), status, param, code, words the message must hold)
    ("{not json", 400, None, "invalid_value", "not valid JSON"),
    ({"input": "Hello"}, 400, "model", "invalid_value", "required"),
    (body(model="gpt-5-codex"), 404, "model", "model_not_found", "gpt-5-codex"),
    ({"model": MODEL_ID}, 400, "input", "invalid_value", "required"),
    (body(input=5), 400, "input", "invalid_value", "input"),
    (body(input=[]), 400, "input", "invalid_value", "empty"),
    (body(input=[{"role": "robot", "content": "x"}]), 400, "input.0.role", "invalid_value", "role"),
    (body(input=[{"role": "user"}]), 400, "input.0.content", "invalid_value", "required"),
    (
        body(input=[{"type": "message", "role": "user", "content": [{"type": "input_text"}]}]),
        400,
        "input.0.content.0.text",
        "invalid_value",
        "required",
    ),
    (
        body(input=user(TEXT, {"type": "input_image", "image_url": "data:image/png;base64,AA"})),
        400,
        "input.0.content.1.type",
        "invalid_value",
        "input_image",
    ),
    (
        body(input=user({"type": "input_file", "file_id": "file-1"})),
        400,
        "input.0.content.0.type",
        "invalid_value",
        "input_file",
    ),
    (
        body(input=[{"type": "item_reference", "id": "msg_1"}]),
        400,
        "input.0.type",
        "invalid_value",
        "item_reference",
    ),
    (
        body(input=[{"type": "function_call_output", "call_id": "call_9", "output": "12:00"}]),
        400,
        "input.0.call_id",
        "invalid_value",
        "call_9",
    ),
    (
        body(input=[CALL, {"type": "function_call_output", "call_id": "call_2", "output": "x"}]),
        400,
        "input.1.call_id",
        "invalid_value",
        "call_2",
    ),
    (body(input=[{**CALL, "arguments": {}}]), 400, "input.0.arguments", "invalid_value", "string"),
    (body(input=[{"type": {}}]), 400, "input.0.type", "invalid_value", "message"),
    (body(tools=[{"type": {}}]), 400, "tools.0.type", "invalid_value", "string"),
    (body(tool_choice={"type": []}), 400, "tool_choice.type", "invalid_value", "string"),
    (body(max_output_tokens="8"), 400, "max_output_tokens", "invalid_value", "integer"),
    (body(max_output_tokens=0), 400, "max_output_tokens", "invalid_value", "between"),
    (body(temperature="hot"), 400, "temperature", "invalid_value", "number"),
    (body(temperature=3), 400, "temperature", "invalid_value", "2"),
    (body(top_logprobs=50), 400, "top_logprobs", "invalid_value", "20"),
    (body(store="yes"), 400, "store", "invalid_value", "boolean"),
    (body(tools=[{"type": "function"}]), 400, "tools.0.name", "invalid_value", "required"),
    (body(tool_choice="sometimes"), 400, "tool_choice", "invalid_value", "auto"),
    (body(tool_choice="required"), 400, "tool_choice", "invalid_value", "function tools"),
    (
        body(tools=[FUNCTION], tool_choice={"type": "function", "name": "get_weather"}),
        400,
        "tool_choice",
        "invalid_value",
        "get_weather",
    ),
    (
        body(tools=[{"type": "file_search"}], tool_choice={"type": "file_search"}),
        400,
        "tool_choice",
        "unsupported_parameter",
        "file_search",
    ),
    (
        body(tools=[FUNCTION], tool_choice="required", text={"format": {"type": "json_object"}}),
        400,
        "text.format",
        "invalid_value",
        "tool_choice",
    ),
    (
        body(text={"format": {"type": "json_schema", "name": "x"}}),
        400,
        "text.format.schema",
        "invalid_value",
        "required",
    ),
    (body(text={"format": {"type": "yaml"}}), 400, "text.format", "invalid_value", "json_schema"),
    (body(reasoning={"effort": "extreme"}), 400, "reasoning.effort", "invalid_value", "none"),
    (body(truncation="sometimes"), 400, "truncation", "invalid_value", "auto"),
    (body(background=True), 400, "background", "unsupported_parameter", "background"),
    (body(conversation="conv_1"), 400, "conversation", "unsupported_parameter", "previous"),
    (
        body(previous_response_id="resp_unknown"),
        400,
        "previous_response_id",
        "previous_response_not_found",
        "resp_unknown",
    ),
    (body(input="word " * 80), 400, "input", "context_length_exceeded", "input"),
]


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Any:
    return load_tokenizer(demo_model_dir)


@pytest.fixture
async def client(tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    # No runner: a request that got past the checks would meet no engine and get a 503.
    service = Service(MODEL_ID, tokenizer, limits=ServiceLimits(), state="ok")
    async with open_client(service, max_prompt_tokens=64, max_body_bytes=4096) as client:
        yield client


@pytest.mark.parametrize(("request_body", "status", "param", "code", "words"), BAD_REQUESTS)
async def test_bad_input_gets_openai_error(
    client: httpx.AsyncClient,
    request_body: Any,
    status: int,
    param: str | None,
    code: str,
    words: str,
) -> None:
    if isinstance(request_body, str):
        headers = {"content-type": "application/json"}
        response = await client.post(RESPONSES, content=request_body, headers=headers)
    else:
        response = await client.post(RESPONSES, json=request_body)
    error = assert_error(response, status, param=param, code=code)
    assert error["type"] == "invalid_request_error"
    assert words in error["message"], error["message"]


async def test_oversized_body_is_413_in_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.post(RESPONSES, json=body(input="x" * 5000))
    assert_error(response, 413)


async def test_unknown_stored_response_is_404(client: httpx.AsyncClient) -> None:
    for method in ("GET", "DELETE"):
        response = await client.request(method, f"{RESPONSES}/resp_nothing")
        error = assert_error(response, 404, param="response_id", code="not_found")
        assert "resp_nothing" in error["message"]
    other = await client.request("PUT", f"{RESPONSES}/resp_nothing")
    assert_error(other, 405, code="method_not_allowed")
    assert other.headers["allow"] == "GET, DELETE"


async def test_a_valid_request_would_reach_the_engine(client: httpx.AsyncClient) -> None:
    # the control: this service has no engine, so a request that passes every check is a 503
    assert_error(await client.post(RESPONSES, json=body()), 503, code="engine_unavailable")


def test_the_store_forgets_the_least_recently_used() -> None:
    store = ResponseStore(capacity=2)
    made = [
        Response(id=f"resp_{index}", created_at=0, status="completed", model=MODEL_ID)
        for index in range(3)
    ]
    store.put(made[0], ())
    store.put(made[1], ())
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(made[2], ())
    assert [store.get(f"resp_{index}") is not None for index in range(3)] == [True, False, True]
    assert len(store) == 2
    assert store.delete("resp_0") and not store.delete("resp_0")
