"""A base model (a GGUF with no tokenizer.chat_template, imported by tandem): every dialect's
chat route answers 400 in its own shape, naming /v1/completions and --chat-template, before
the engine sees anything; completions and Ollama's raw generate answer; a template given at
load (what `serve --chat-template` does) renders its chats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.api.prompts import NO_CHAT_TEMPLATE
from engines.core.runner import EngineRunner
from engines.model.tokenizer_loading import load_serving_tokenizer
from tests.helpers.api import (  # noqa: F401
    HELLO,
    MODEL_ID,
    anyio_backend,
    idle_runner,
    make_service,
    open_client,
    start_runner,
)
from tests.helpers.demo_models import BASE_CHAT_RENDERED, BASE_CHAT_TEMPLATE

pytestmark = pytest.mark.anyio

ASK = {"model": MODEL_ID, "max_tokens": 4}


def openai_error(param: str) -> dict[str, Any]:
    return {
        "error": {
            "message": NO_CHAT_TEMPLATE,
            "type": "invalid_request_error",
            "param": param,
            "code": "chat_template_missing",
        }
    }


ANTHROPIC_ERROR = {
    "type": "error",
    "error": {"type": "invalid_request_error", "message": NO_CHAT_TEMPLATE},
}
OLLAMA_ERROR = {"error": NO_CHAT_TEMPLATE}  # the shape names no param: the message does
# (route, body, the whole error body): every route that renders a chat template.
CHAT_ROUTES = [
    ("/v1/chat/completions", {**ASK, "messages": HELLO}, openai_error("messages")),
    ("/v1/chat/completions", {**ASK, "messages": HELLO, "stream": True}, openai_error("messages")),
    ("/v1/messages", {**ASK, "messages": HELLO}, ANTHROPIC_ERROR),
    ("/v1/messages", {**ASK, "messages": HELLO, "stream": True}, ANTHROPIC_ERROR),
    ("/v1/messages/count_tokens", {"model": MODEL_ID, "messages": HELLO}, ANTHROPIC_ERROR),
    ("/v1/responses", {"model": MODEL_ID, "input": "Hello there"}, openai_error("input")),
    ("/api/chat", {"model": MODEL_ID, "messages": HELLO, "stream": False}, OLLAMA_ERROR),
    ("/api/generate", {"model": MODEL_ID, "prompt": "Hello there", "stream": False}, OLLAMA_ERROR),
]


@pytest.fixture(scope="module")
def runner(base_model_dir: Path) -> Iterator[EngineRunner]:
    runner = start_runner(base_model_dir, queue_size=8)
    yield runner
    runner.close()


def test_the_message_names_the_way_to_a_prompt_and_the_flag(runner: EngineRunner) -> None:
    assert not runner.engine.tokenizer.has_chat_template  # a base model, as imported
    assert "/v1/completions" in NO_CHAT_TEMPLATE and "--chat-template FILE" in NO_CHAT_TEMPLATE


@pytest.mark.parametrize(("route", "body", "error"), CHAT_ROUTES)
async def test_every_chat_route_answers_400_in_its_dialect(
    runner: EngineRunner, route: str, body: dict[str, Any], error: dict[str, Any]
) -> None:
    async with open_client(make_service(runner)) as client:
        response = await client.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json() == error


async def test_completions_and_raw_generate_answer(runner: EngineRunner) -> None:
    prompt_tokens = len(runner.engine.tokenizer.encode("Once upon"))
    async with open_client(make_service(runner)) as client:
        completion = await client.post("/v1/completions", json={**ASK, "prompt": "Once upon"})
        raw = await client.post(
            "/api/generate",
            json={"model": MODEL_ID, "prompt": "Once upon", "raw": True, "stream": False},
        )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == prompt_tokens
    assert raw.status_code == 200, raw.text
    assert raw.json()["done"] is True and raw.json()["prompt_eval_count"] == prompt_tokens


async def test_a_template_given_at_load_renders_the_chats(
    runner: EngineRunner, base_model_dir: Path
) -> None:
    """The chat's prompt is the template's rendering: the same tokens, and so the same greedy
    answer, as the rendered text sent as a completion."""
    tokenizer = load_serving_tokenizer(base_model_dir, chat_template=BASE_CHAT_TEMPLATE)
    greedy = {**ASK, "max_tokens": 8, "temperature": 0}
    async with open_client(make_service(runner, tokenizer=tokenizer)) as client:
        chat = await client.post("/v1/chat/completions", json={**greedy, "messages": HELLO})
        completion = await client.post(
            "/v1/completions", json={**greedy, "prompt": BASE_CHAT_RENDERED}
        )
    assert chat.status_code == 200, chat.text
    assert completion.status_code == 200, completion.text
    expected = len(tokenizer.encode(BASE_CHAT_RENDERED, add_special_tokens=False))
    assert chat.json()["usage"]["prompt_tokens"] == expected
    assert completion.json()["usage"]["prompt_tokens"] == expected
    answer = chat.json()["choices"][0]["message"]["content"]
    assert answer == completion.json()["choices"][0]["text"]
