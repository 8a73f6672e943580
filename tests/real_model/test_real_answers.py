"""SmolLM2-135M-Instruct on the single engine: mlx-lm's own greedy tokens, right answers to
factual questions through the OpenAI API, valid JSON on real weights, and tools refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.core.engine_options import EngineOptions
from engines.core.runner import EngineRunner
from engines.single.engine import SingleEngine
from tests.helpers.api import MODEL_ID, assert_error, make_service, open_client
from tests.helpers.engine import run_one
from tests.helpers.real_model import QUESTIONS, Greedy, engine_request

pytestmark = pytest.mark.anyio

CAPITAL = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}
FRANCE = QUESTIONS[0].messages
JSON_TOKENS = 24  # each answer below closes its object well within this
PREFIX_CACHE_BYTES = 64 * 1024**2


@pytest.fixture(scope="module")
def runner(smollm2_dir: Path) -> Iterator[EngineRunner]:
    """One engine for the module, with a prefix cache: after the first test each question's
    prompt is cached, so the later ones pay for their answers only."""
    runner = EngineRunner(
        SingleEngine(smollm2_dir, EngineOptions(prefix_cache_bytes=PREFIX_CACHE_BYTES))
    )
    runner.start(load_timeout_s=120)
    yield runner
    runner.close()


@pytest.fixture
async def client(runner: EngineRunner) -> AsyncIterator[httpx.AsyncClient]:
    async with open_client(make_service(runner)) as client:
        yield client


async def chat(client: httpx.AsyncClient, messages: list[dict[str, str]], **fields: Any) -> Any:
    body = {"model": MODEL_ID, "messages": messages, "temperature": 0, **fields}
    return await client.post("/v1/chat/completions", json=body, timeout=300)


def test_the_single_engine_gives_mlx_lm_greedy_tokens(
    runner: EngineRunner, mlx_lm_answers: list[Greedy]
) -> None:
    for question, expected in zip(QUESTIONS, mlx_lm_answers, strict=True):
        got = run_one(runner, engine_request(runner.engine.tokenizer, question))
        assert (tuple(got.tokens), got.text) == (expected.tokens, expected.text), question.text
        assert got.finish == expected.finish, question.text
        assert len(got.tokens) >= 5


async def test_factual_questions_are_answered_right_through_the_openai_api(
    client: httpx.AsyncClient, mlx_lm_answers: list[Greedy]
) -> None:
    for question, expected in zip(QUESTIONS, mlx_lm_answers, strict=True):
        assert question.answer in expected.text  # mlx-lm itself answers it right
        response = await chat(client, question.messages, max_tokens=question.max_tokens)
        assert response.status_code == 200, response.text
        [choice] = response.json()["choices"]
        answer = choice["message"]["content"]
        assert answer == expected.text and question.answer in answer, question.text
        assert choice["finish_reason"] == expected.finish, question.text
    assert [answer.finish for answer in mlx_lm_answers] == ["stop"] * len(QUESTIONS)  # EOS


async def test_json_mode_and_a_json_schema_give_valid_json_on_real_weights(
    client: httpx.AsyncClient,
) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL}}
    any_object, capital = await asyncio.gather(
        chat(client, FRANCE, max_tokens=JSON_TOKENS, response_format={"type": "json_object"}),
        chat(client, FRANCE, max_tokens=JSON_TOKENS, response_format=schema),
    )
    for response in (any_object, capital):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "stop", response.text
    assert isinstance(json.loads(any_object.json()["choices"][0]["message"]["content"]), dict)
    answer = json.loads(capital.json()["choices"][0]["message"]["content"])
    assert set(answer) == {"country", "capital"}
    assert answer["capital"] == "Paris", answer


async def test_tools_are_refused_because_its_template_has_no_tool_calls(
    client: httpx.AsyncClient,
) -> None:
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    response = await chat(client, FRANCE, max_tokens=4, tools=[tool])
    error = assert_error(response, 400, param="tools", code="unsupported_parameter")
    assert "chat template has no tool-call support" in error["message"]
