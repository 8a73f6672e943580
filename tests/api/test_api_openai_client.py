"""The official openai client against a real uvicorn server on 127.0.0.1 (demo model)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from engines.api import create_app
from engines.core.runner import EngineRunner
from engines.core.service import Service, ServiceLimits
from engines.single.engine import SingleEngine
from tests.helpers.api import serve_on_loopback

MODEL_ID = "tandem-demo"
API_KEY = "test-key"
LONG = 3000  # tokens: several seconds of generation, so a disconnect lands mid-request
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


@pytest.fixture(scope="module")
def runner(demo_model_dir: Any) -> Iterator[EngineRunner]:
    runner = EngineRunner(SingleEngine(demo_model_dir), queue_size=4)
    runner.start(load_timeout_s=120)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def base_url(runner: EngineRunner) -> Iterator[str]:
    service = Service(
        model_id=MODEL_ID,
        tokenizer=runner.engine.tokenizer,
        limits=ServiceLimits(api_key=API_KEY),
        runner=runner,
        state="ok",
        cluster_status=lambda: {"strategy": "single"},
    )
    with serve_on_loopback(create_app(service)) as url:
        yield url


@pytest.fixture
def client(base_url: str, runner: EngineRunner) -> Iterator[openai.OpenAI]:
    wait_idle(runner)
    with openai.OpenAI(
        base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30
    ) as client:
        yield client


def wait_idle(runner: EngineRunner, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not runner.idle:
        assert time.monotonic() < deadline, "the runner did not become idle"
        time.sleep(0.01)


def wait_busy(runner: EngineRunner, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not runner.active:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    return runner.running()[0]


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models] == [MODEL_ID]
    assert models.data[0].owned_by == "tandem"
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 10
    total = completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert completion.usage.total_tokens == total


def test_chat_stream(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == plain.choices[0].message.content
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_logprobs_json_and_tools_reach_the_client_typed(client: openai.OpenAI) -> None:
    scored = client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = scored.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 2 for entry in content)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    shaped = client.chat.completions.create(
        model=MODEL_ID,
        messages=MESSAGES,
        max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    assert isinstance(json.loads(shaped.choices[0].message.content)["ok"], bool)
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["id"],
                "additionalProperties": False,
            },
        },
    }
    called = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=96, tools=[tool], tool_choice="required"
    )
    assert called.choices[0].finish_reason == "tool_calls", repr(called.choices[0].message.content)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "lookup"
    assert 0 <= json.loads(call.function.arguments)["id"] <= 9
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=5, extra_body={"mirostat_tau": 3.0}
        )
    assert refused.value.body["param"] == "mirostat_tau"
    filtered = client.chat.completions.create(  # vLLM's extensions, as its clients send them
        model=MODEL_ID, messages=MESSAGES, max_tokens=5, extra_body={"top_k": 3, "min_p": 0.1}
    )
    assert filtered.choices[0].message.content is not None


def test_completions(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL_ID, prompt="The quick brown", max_tokens=8, temperature=0
    )
    assert completion.id.startswith("cmpl-")
    assert completion.choices[0].text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    stream = client.completions.create(
        model=MODEL_ID, prompt="The quick brown", max_tokens=8, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == completion.choices[0].text


def test_errors_reach_the_client_typed(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=0)
    assert bad.value.param == "max_tokens"
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError):
            intruder.models.list()
    assert httpx.get(f"{base_url}/health", timeout=5).status_code == 200


def test_closing_a_stream_cancels_the_generation(
    client: openai.OpenAI, runner: EngineRunner
) -> None:
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=LONG, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # the role chunk
    next(chunks)  # generation is under way
    submission = wait_busy(runner)
    stream.close()
    wait_idle(runner, timeout_s=2.0)  # the full request would take several seconds
    assert submission.cancelled.is_set()


def test_abandoned_request_is_cancelled(base_url: str, runner: EngineRunner) -> None:
    outcome: list[BaseException] = []

    def ask_impatiently() -> None:
        with openai.OpenAI(
            base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=0.5
        ) as impatient:
            try:
                impatient.completions.create(model=MODEL_ID, prompt="Once", max_tokens=LONG)
            except openai.APITimeoutError as error:  # the client hangs up after 0.5 s
                outcome.append(error)

    asker = threading.Thread(target=ask_impatiently)
    asker.start()
    submission = wait_busy(runner)
    asker.join(timeout=10)
    assert outcome, "the client should have timed out"
    wait_idle(runner, timeout_s=2.0)  # the full request would take several seconds
    assert submission.cancelled.is_set()
