"""The official anthropic client against a real uvicorn server on 127.0.0.1 (demo model)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from engines.api import create_app
from engines.core.runner import EngineRunner
from engines.core.service import Service, ServiceLimits
from tests.helpers.api import LONG, MODEL_ID, WEATHER, serve_on_loopback, start_runner, wait_idle

API_KEY = "test-key"
SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "Say something."}]
TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
CITIES = WEATHER["function"]["parameters"]["properties"]["city"]["enum"]
GREEDY = {"temperature": 0}  # the client's create() has no temperature: it goes in the body
CALL_TOKENS = 100  # room for a whole forced call in the demo tokenizer's small tokens


@pytest.fixture(scope="module")
def runner(demo_model_dir: Any) -> Iterator[EngineRunner]:
    # One sequence at a time and one waiting: two long requests fill it, so a 429 is cheap.
    runner = start_runner(demo_model_dir, queue_size=1, max_batch=1)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def base_url(runner: EngineRunner) -> Iterator[str]:
    service = Service(
        model_id=MODEL_ID,
        tokenizer=runner.engine.tokenizer,
        model_aliases=(("claude-*", MODEL_ID),),
        limits=ServiceLimits(api_key=API_KEY),
        runner=runner,
        state="ok",
        cluster_status=lambda: {"strategy": "single"},
    )
    with serve_on_loopback(create_app(service)) as url:
        yield url


@pytest.fixture
def client(base_url: str, runner: EngineRunner) -> Iterator[anthropic.Anthropic]:
    wait_idle(runner)
    with anthropic.Anthropic(
        base_url=base_url, api_key=API_KEY, max_retries=0, timeout=30
    ) as client:
        yield client


def create(client: anthropic.Anthropic, **fields: Any) -> anthropic.types.Message:
    request = {"model": MODEL_ID, "max_tokens": 10, "messages": ASK, "extra_body": GREEDY}
    return client.messages.create(**(request | fields))


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create(client: anthropic.Anthropic) -> None:
    message = create(client, system=SYSTEM)
    assert message.id.startswith("msg_")
    assert message.type == "message" and message.role == "assistant"
    assert message.model == MODEL_ID
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 10
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 5
    assert message.usage.cache_creation_input_tokens == 0


def test_stream_says_what_create_says(client: anthropic.Anthropic) -> None:
    whole = create(client, system=SYSTEM)
    request = {"model": MODEL_ID, "max_tokens": 10, "messages": ASK, "system": SYSTEM}
    with client.messages.stream(**request, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole)
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    prompt = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert prompt == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_greedy_answer_equals_chat_completions(base_url: str, client: anthropic.Anthropic) -> None:
    message = create(client, system=SYSTEM, max_tokens=16)
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": MODEL_ID,
            "messages": [{"role": "system", "content": SYSTEM}, *ASK],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=30,
    ).json()
    assert text_of(message) == chat["choices"][0]["message"]["content"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"] == 16


def test_forced_tool_call_round_trip(client: anthropic.Anthropic) -> None:
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = create(
        client, messages=asked, tools=[TOOL], tool_choice={"type": "any"}, max_tokens=CALL_TOKENS
    )
    assert called.stop_reason == "tool_use"
    [call] = [block for block in called.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in CITIES
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
    answer = create(
        client,
        messages=[
            *asked,
            {"role": "assistant", "content": called.content},
            {"role": "user", "content": [result]},
        ],
        tools=[TOOL],
        tool_choice={"type": "none"},
    )
    assert answer.stop_reason == "max_tokens" and text_of(answer)
    assert [block.type for block in answer.content] == ["text"]


def test_streamed_forced_call_reaches_the_client_as_input(client: anthropic.Anthropic) -> None:
    request = {
        "model": MODEL_ID,
        "max_tokens": CALL_TOKENS,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    }
    with client.messages.stream(**request, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [call] = final.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input["city"] in CITIES  # parsed from the input_json_delta by the client


def test_count_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL_ID, messages=ASK, system=SYSTEM)
    message = create(client, system=SYSTEM, max_tokens=1)
    assert (
        counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    )
    with_tools = client.messages.count_tokens(
        model=MODEL_ID, messages=ASK, system=SYSTEM, tools=[TOOL]
    )
    assert with_tools.input_tokens > counted.input_tokens + 20  # the tool's schema is counted


def test_stop_sequence_names_the_string(client: anthropic.Anthropic) -> None:
    text = text_of(create(client, max_tokens=16))
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    message = create(client, max_tokens=16, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text.startswith(text_of(message)) and stop not in text_of(message)
    request = {"model": MODEL_ID, "max_tokens": 16, "messages": ASK, "stop_sequences": [stop]}
    with client.messages.stream(**request, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert text_of(final) == text_of(message)


def test_fields_with_no_local_meaning_are_accepted(client: anthropic.Anthropic) -> None:
    """What Claude Code and the newest SDKs send beside the prompt; an alias reaches the model."""
    cached = {"type": "ephemeral"}
    message = client.messages.create(
        model="claude-local",
        max_tokens=4,
        system=[{"type": "text", "text": SYSTEM, "cache_control": cached}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": cached}]}
        ],
        tools=[{**TOOL, "cache_control": cached, "strict": True}],
        metadata={"user_id": "someone"},
        thinking={"type": "adaptive"},
        service_tier="auto",
        extra_headers={"anthropic-beta": "context-management-2025-06-27,effort-2025-11-24"},
        extra_body={
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "container": None,
            "diagnostics": {"enabled": False},
            "inference_geo": "eu",
            "speed": "standard",
            "user_profile_id": "profile",
            "workspace_id": "workspace",
            "a_field_from_next_month": {"anything": [1, 2]},
        },
    )
    assert message.model == "claude-local"  # the name the client asked for
    assert message.usage.output_tokens <= 4


def test_bearer_auth_and_errors_reach_the_client_typed(
    base_url: str, client: anthropic.Anthropic
) -> None:
    with anthropic.Anthropic(base_url=base_url, auth_token=API_KEY, max_retries=0) as bearer:
        assert create(bearer, max_tokens=2).usage.output_tokens == 2
    with anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            create(stranger)
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(client, model="gpt-4o")
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "gpt-4o" in missing.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, messages=[{"role": "user", "content": [image]}])
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages.0.content.0: images are not supported: this server's model "
            "reads text only",
        },
    }


def test_full_queue_is_a_rate_limit_error(
    base_url: str, client: anthropic.Anthropic, runner: EngineRunner
) -> None:
    long = {"model": MODEL_ID, "max_tokens": LONG, "messages": ASK, "stream": True}
    headers = {"x-api-key": API_KEY}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as raw:
        with raw.stream("POST", "/v1/messages", json=long) as running:
            assert running.status_code == 200
            wait_for(lambda: runner.active == 1)
            with raw.stream("POST", "/v1/messages", json=long) as waiting:
                assert waiting.status_code == 200
                wait_for(lambda: runner.queued == 1)
                with pytest.raises(anthropic.RateLimitError) as limited:
                    create(client)
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    wait_idle(runner, timeout_s=10)  # both streams were closed: both generations cancelled


def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
