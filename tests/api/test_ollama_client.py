"""The official `ollama` client against a real uvicorn server on 127.0.0.1 (demo model): chat,
generate (whole and streamed), list, show, ps, version, tools, format, options."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from engines.api import create_app
from engines.api.conversation import ChatInput, FunctionTool, Turn
from engines.api.generation import Outcome
from engines.api.ollama.replies import OllamaReplies
from engines.api.reply import ReplyStream
from engines.api.tools import tool_format_for
from engines.core.engine import Finish, TokenEvent
from engines.core.request import GenerationRequest
from engines.core.runner import EngineRunner, Submission
from tests.helpers.api import WEATHER, make_service, serve_on_loopback, start_runner, wait_idle
from tests.helpers.grammar import REPLY_SCHEMA, completes_to_object

MODEL = "tandem-demo"
API_KEY = "test-key"
CONTEXT = 512  # --context-tokens of the server
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def runner(demo_model_dir: Any) -> Iterator[EngineRunner]:
    runner = start_runner(demo_model_dir, queue_size=8)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def base_url(runner: EngineRunner) -> Iterator[str]:
    app = create_app(make_service(runner, api_key=API_KEY), max_prompt_tokens=CONTEXT)
    with serve_on_loopback(app) as url:
        yield url


@pytest.fixture
def client(base_url: str, runner: EngineRunner) -> Iterator[ollama.Client]:
    wait_idle(runner)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with ollama.Client(host=base_url, headers=headers, timeout=30) as client:
        yield client


def assert_counted(final: Any, eval_count: int) -> None:
    """The final object's counts, and durations that add up to the total."""
    assert final.done is True
    assert final.eval_count == eval_count and final.prompt_eval_count > 0
    assert final.prompt_eval_duration > 0 and final.eval_duration > 0
    parts = final.load_duration + final.prompt_eval_duration + final.eval_duration
    assert abs(final.total_duration - parts) <= 3  # each rounded down to a nanosecond
    assert final.total_duration < 30 * 10**9


def test_chat(client: ollama.Client) -> None:
    response = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert response.model == MODEL
    assert response.message.role == "assistant" and response.message.content
    assert response.message.thinking is None and response.message.tool_calls is None
    assert response.done_reason == "length"
    assert_counted(response, 8)


def test_chat_stream_equals_whole(client: ollama.Client) -> None:
    whole = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    parts = list(
        client.chat(model=f"{MODEL}:latest", messages=MESSAGES, stream=True, options=GREEDY)
    )
    assert all(part.done is False for part in parts[:-1]) and len(parts) > 2
    assert all(part.model == f"{MODEL}:latest" for part in parts)
    assert "".join(part.message.content or "" for part in parts) == whole.message.content
    final = parts[-1]
    assert final.message.content == "" and final.done_reason == "length"
    assert_counted(final, 8)
    assert final.prompt_eval_count == whole.prompt_eval_count


def test_generate_whole_and_streamed(client: ollama.Client) -> None:
    whole = client.generate(model=MODEL, prompt="Once upon", options=GREEDY)
    assert whole.response and whole.done_reason == "length" and whole.context is None
    assert_counted(whole, 8)
    parts = list(client.generate(model=MODEL, prompt="Once upon", stream=True, options=GREEDY))
    assert "".join(part.response for part in parts) == whole.response
    assert_counted(parts[-1], 8)
    # with `system` the template renders two turns: a longer prompt
    told = client.generate(model=MODEL, prompt="Once upon", system="Be brief.", options=GREEDY)
    assert told.prompt_eval_count > whole.prompt_eval_count
    # raw: the prompt as it is, without the chat template
    raw = client.generate(model=MODEL, prompt="Once upon", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < whole.prompt_eval_count
    assert_counted(raw, 8)


def test_greedy_answer_equals_chat_completions(client: ollama.Client, base_url: str) -> None:
    answer = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    completion = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["message"]["content"] == answer.message.content


def test_empty_request_loads_the_model(client: ollama.Client) -> None:
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"
    assert client.generate(model=MODEL, keep_alive=0).done_reason == "load"


def test_list_show_ps(client: ollama.Client) -> None:
    [listed] = client.list().models
    assert listed.model == f"{MODEL}:latest"
    assert listed.size > 0 and len(listed.digest) == 64 and listed.modified_at is not None
    assert listed.details.family == "llama" and listed.details.format == "safetensors"
    assert listed.details.parameter_size.endswith("M")  # a few million random weights
    assert listed.details.quantization_level == "F32"
    shown = client.show(listed.model)
    assert shown.details == listed.details
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.block_count"] == 4
    assert shown.modelinfo["llama.embedding_length"] == 256
    assert shown.modelinfo["llama.attention.head_count_kv"] == 4
    assert "tools" in shown.capabilities and "thinking" not in shown.capabilities
    assert "tools" in shown.template  # the model's own chat template
    [running] = client.ps().models
    assert running.model == listed.model and running.context_length == CONTEXT
    assert running.expires_at.year == 9999


def test_version(base_url: str) -> None:
    response = httpx.get(f"{base_url}/api/version", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200
    assert tuple(int(part) for part in response.json()["version"].split(".")) >= (0, 9, 0)


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
      city: the city
    """
    return f"sunny in {city}"


def test_tools_reach_the_prompt_and_calls_replay(client: ollama.Client) -> None:
    plain = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    offered = client.chat(model=MODEL, messages=MESSAGES, tools=[WEATHER], options=GREEDY)
    assert offered.prompt_eval_count > plain.prompt_eval_count + 20  # the tool is rendered
    as_function = client.chat(model=MODEL, messages=MESSAGES, tools=[get_weather], options=GREEDY)
    assert as_function.prompt_eval_count > plain.prompt_eval_count + 20
    for call in offered.message.tool_calls or ():  # random weights rarely call
        assert isinstance(call.function.arguments, dict)
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    replayed = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    answer = client.chat(model=MODEL, messages=replayed, tools=[WEATHER], options=GREEDY)
    assert answer.done and answer.prompt_eval_count > offered.prompt_eval_count
    parts = list(
        client.chat(model=MODEL, messages=replayed, tools=[WEATHER], stream=True, options=GREEDY)
    )
    assert parts[-1].done and parts[-1].prompt_eval_count == answer.prompt_eval_count


def test_format_json_and_schema(client: ollama.Client) -> None:
    # Random weights write long keys in free JSON: an object, whole or cut by num_predict.
    anything = client.chat(
        model=MODEL, messages=MESSAGES, format="json", options={"num_predict": 24}
    )
    if anything.done_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)
    else:
        assert completes_to_object(anything.message.content), anything.message.content
    for stream in (False, True):
        options = {"num_predict": 64, "seed": 3}
        reply = client.generate(
            model=MODEL, prompt="JSON", format=REPLY_SCHEMA, options=options, stream=stream
        )
        text = reply.response if not stream else "".join(part.response for part in reply)
        value = json.loads(text)
        assert set(value) == {"answer", "mood", "count"} and value["mood"] in ("calm", "wild")


def test_options_are_honoured(client: ollama.Client) -> None:
    sampled = {"temperature": 1.0, "num_predict": 6}
    first = client.generate(model=MODEL, prompt="Once", options={**sampled, "seed": 7})
    again = client.generate(model=MODEL, prompt="Once", options={**sampled, "seed": 7})
    assert first.response == again.response and first.eval_count == 6
    others = {
        client.generate(model=MODEL, prompt="Once", options={**sampled, "seed": seed}).response
        for seed in range(4)
    }
    assert len(others) > 1  # the seed, not the temperature, made them equal
    # stop: a greedy answer cut where its third word begins
    greedy = client.generate(
        model=MODEL, prompt="Once", options={"temperature": 0, "num_predict": 16}
    )
    word = greedy.response.split()[2]
    stopped = client.generate(
        model=MODEL, prompt="Once", options={"temperature": 0, "num_predict": 16, "stop": [word]}
    )
    assert stopped.done_reason == "stop" and word not in stopped.response
    assert greedy.response.startswith(stopped.response)
    # -1: no limit but the room left; num_ctx below --context-tokens bounds the room
    small = {"temperature": 0, "num_predict": -1, "num_ctx": 40}
    filled = client.generate(model=MODEL, prompt="Once", options=small)
    assert filled.done_reason == "length"
    assert filled.prompt_eval_count + filled.eval_count == 40
    # options Ollama knows that tandem cannot use, and names nobody knows, are ignored
    ignored = {"temperature": 0, "num_predict": 16, "mirostat": 1, "num_gpu": 99, "novel": 1}
    assert client.generate(model=MODEL, prompt="Once", options=ignored).response == greedy.response
    # a num_ctx beyond --context-tokens is cut to it, as Ollama cuts to the trained context
    wide = {"temperature": 0, "num_predict": 16, "num_ctx": 10 * CONTEXT}
    assert client.generate(model=MODEL, prompt="Once", options=wide).response == greedy.response


def test_errors_reach_the_client_as_response_errors(client: ollama.Client, base_url: str) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="llama3.2", messages=MESSAGES)
    assert raised.value.status_code == 404 and "tandem-demo:latest" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        list(client.chat(model="llama3.2", messages=MESSAGES, stream=True))
    assert raised.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as raised:
        client.pull(MODEL)
    assert raised.value.status_code == 501 and "pull" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        client.embed(model=MODEL, input="hello")
    assert raised.value.status_code == 501 and "embeddings" in raised.value.error
    with ollama.Client(host=base_url, timeout=30) as keyless:
        with pytest.raises(ollama.ResponseError) as raised:
            keyless.list()
    assert raised.value.status_code == 401 and "API key" in raised.value.error


def test_a_call_the_model_writes_has_object_arguments(runner: EngineRunner) -> None:
    # Random weights do not call tools, so the reply is fed a call as the model would write it.
    tokenizer = runner.engine.tokenizer
    chat = ChatInput(turns=(Turn("user", "Weather?"),), tools=(FunctionTool("get_weather"),))
    request = GenerationRequest("ollama-test", (1, 2, 3), max_tokens=32)
    written = ["Let me look. <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": ']
    written.append('"Paris"}}\n</tool_call>')
    final = TokenEvent(finish_reason=Finish.STOP, prompt_tokens=3, completion_tokens=20)
    loop = asyncio.new_event_loop()  # a Submission's home; nothing runs on it here
    try:
        for stream in (True, False):
            submission = Submission(request, loop)
            reply = ReplyStream.of(tokenizer, chat, tool_format_for(chat, tokenizer), (1, 2, 3))
            replies = OllamaReplies(MODEL, reply, submission, chat=True)
            if stream:
                lines = [line for text in written for _, line in replies.content(text, [])]
                lines += [line for _, line in replies.finish(final)]
            else:
                lines = [replies.whole(Outcome("".join(written), "stop", 3, 20, []))]
            assert "".join(line["message"]["content"] for line in lines) == "Let me look. "
            [called] = [line for line in lines if "tool_calls" in line["message"]]
            [call] = called["message"]["tool_calls"]
            assert call["function"] == {
                "index": 0,
                "name": "get_weather",
                "arguments": {"city": "Paris"},
            }
            assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
            parsed = ollama.ChatResponse(**called)  # as the client reads it
            assert parsed.message.tool_calls[0].function.arguments == {"city": "Paris"}
    finally:
        loop.close()
