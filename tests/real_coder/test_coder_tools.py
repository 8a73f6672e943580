"""Tool calls on real weights, in every dialect with its official client, streamed and not:
Qwen2.5-Coder-0.5B-Instruct answers a tool request with the bare JSON of the call (no
<tool_call> tags), which each dialect returns as its call; a forced call cut short by the token
limit comes back in the dialect's truncated-call shape, never as markup."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest

from engines.api import create_app
from engines.api.loose_calls import fence_body
from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from tests.helpers.api import make_service, serve_on_loopback

MODEL = "qwen-coder"
ASK = "What is the weather in Paris right now?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "Get the current weather in a city"
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA},
}
MESSAGES_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": DESCRIPTION,
                  "parameters": SCHEMA}  # fmt: skip
PARIS = {"city": "Paris"}
PARIS_PREFIX = '{"city":"Paris"}'  # a forced call's compact arguments, cut somewhere inside
# Anthropic's client has no temperature argument here, and the API samples at 1.0 by default
GREEDY = {"temperature": 0}
ROOM = 80  # tokens: the call is ~20
CUT = 12  # tokens: a forced call is cut inside its arguments


@pytest.fixture(scope="module")
def url(qwen_dir: Path) -> Iterator[str]:
    runner = EngineRunner(SingleEngine(qwen_dir, EngineOptions(prefix_cache_bytes=64 * 1024**2)))
    runner.start(load_timeout_s=180)
    service = make_service(runner, model_id=MODEL, max_tokens_cap=256, request_timeout_s=300)
    try:
        with serve_on_loopback(create_app(service)) as base:
            yield base
    finally:
        runner.close()


def test_the_model_writes_the_call_without_the_template_tags(url: str, qwen_dir: Path) -> None:
    """What the tests below rest on, seen on the raw completion of the templated prompt."""
    from mlx_lm.utils import load_tokenizer

    prompt = load_tokenizer(qwen_dir).apply_chat_template(
        [{"role": "user", "content": ASK}], tools=[CHAT_TOOL], add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    text = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=ROOM)
    raw = text.choices[0].text
    assert "<tool_call>" not in raw
    # the 0.5B writes the bare object, the 1.5B the same object in a ```json fence
    assert json.loads(fence_body(raw) or raw) == {"name": "get_weather", "arguments": PARIS}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_returns_the_call(url: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    request: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": ASK}], "tools": [CHAT_TOOL],
        "temperature": 0, "max_tokens": ROOM,
    }  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**request, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert text.strip() == "" and reasons[-1] == "tool_calls"
        [call] = calls
    else:
        choice = client.chat.completions.create(**request).choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert openai_arguments(call.function.arguments) == PARIS


@pytest.mark.parametrize("stream", [False, True])
def test_messages_returns_tool_use(url: str, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="none")
    request: dict[str, Any] = {
        "model": MODEL, "max_tokens": ROOM, "messages": [{"role": "user", "content": ASK}],
        "tools": [MESSAGES_TOOL], "extra_body": GREEDY,
    }  # fmt: skip
    if stream:
        with client.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", PARIS)
    assert not any(block.type == "text" and block.text.strip() for block in message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_returns_a_function_call(url: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    request: dict[str, Any] = {
        "model": MODEL, "input": ASK, "tools": [RESPONSES_TOOL], "temperature": 0,
        "max_output_tokens": ROOM,
    }  # fmt: skip
    if stream:
        events = list(client.responses.create(**request, stream=True))
        response = events[-1].response
    else:
        response = client.responses.create(**request)
    assert response.status == "completed"
    [call] = [item for item in response.output if item.type == "function_call"]
    assert (call.name, openai_arguments(call.arguments)) == ("get_weather", PARIS)
    assert call.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_returns_tool_calls(url: str, stream: bool) -> None:
    client = ollama.Client(host=url)
    request: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": ASK}], "tools": [CHAT_TOOL],
        "options": {"temperature": 0, "num_predict": ROOM},
    }  # fmt: skip
    if stream:
        parts = list(client.chat(**request, stream=True))
        calls = [call for part in parts for call in part.message.tool_calls or []]
        text = "".join(part.message.content or "" for part in parts)
        reason = parts[-1].done_reason
    else:
        reply = client.chat(**request)
        calls, text = reply.message.tool_calls or [], reply.message.content
        reason = reply.done_reason
    assert text.strip() == "" and reason == "stop"
    [call] = calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", PARIS)


def test_a_forced_call_cut_short_is_each_dialects_truncated_shape(url: str) -> None:
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    choice = chat.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL],
        tool_choice="required", max_tokens=CUT,
    ).choices[0]  # fmt: skip
    [call] = choice.message.tool_calls
    assert (choice.finish_reason, choice.message.content, call.function.name) == (
        "length",
        None,
        "get_weather",
    )
    assert PARIS_PREFIX.startswith(call.function.arguments.replace(" ", ""))

    messages = anthropic.Anthropic(base_url=url, api_key="none").messages.create(
        model=MODEL, max_tokens=CUT, messages=[{"role": "user", "content": ASK}],
        tools=[MESSAGES_TOOL], tool_choice={"type": "any"}, extra_body=GREEDY,
    )  # fmt: skip
    assert messages.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in messages.content] == [("tool_use", "get_weather")]

    response = chat.responses.create(
        model=MODEL, input=ASK, tools=[RESPONSES_TOOL], tool_choice="required",
        max_output_tokens=CUT,
    )  # fmt: skip
    assert (response.status, response.incomplete_details.reason) == (
        "incomplete",
        "max_output_tokens",
    )
    [item] = response.output
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "incomplete")
    for said in (str(choice.message), str(messages.content), str(response.output)):
        assert "<tool_call>" not in said


def openai_arguments(text: str) -> Any:
    return json.loads(text)
