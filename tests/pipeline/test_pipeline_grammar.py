"""Output grammars on the sealed pipeline: JSON mode and forced tool calls give the single
engine's tokens; a grammar that cannot run fails its own request and no other."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from llguidance import LLMatcher

from discovery.cluster_key import generate_key
from engines.api.constraints import ANY_OBJECT, JSON_OPTIONS
from engines.core.request import GenerationRequest
from engines.pipeline import sequence_documents
from planner import allocate_layers
from tests.helpers.api import CLOCK, WEATHER, assert_error, chat_body, make_service, open_client
from tests.helpers.grammar import REPLY_SCHEMA, completes_to_object
from tests.helpers.pipeline import (
    PROMPTS,
    Outcome,
    Pipeline,
    assert_same,
    make_request,
    open_pipeline,
    run,
    run_all,
)

pytestmark = pytest.mark.cluster

JSON_OBJECT = LLMatcher.grammar_from_json_schema(ANY_OBJECT, overrides=JSON_OPTIONS)
REPLY = LLMatcher.grammar_from_json_schema(REPLY_SCHEMA, overrides=JSON_OPTIONS)
# Valid without a tokenizer (what the API checks), but token 999999 is not in the vocabulary.
UNKNOWN_TOKEN = LLMatcher.grammar_from_lark('start: "a" <[999999]>')
# Over the 64 KiB a pipeline BEGIN frame carries once compiled.
TOO_LARGE_SCHEMA = {"enum": [f"{n:05d}" * 40 for n in range(400)]}
NOT_A_GRAMMAR = LLMatcher.grammar_from_lark("start: nope")


@pytest.fixture(scope="module")
def grammar_pipeline(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """The 4-layer demo model as [0, 2) here and [2, 4) in the last stage's worker."""
    ranges = allocate_layers(4, [8, 8])
    yield from open_pipeline(
        demo_model_dir, ranges, generate_key(), tmp_path_factory.mktemp("grammar")
    )


def json_request(
    pipeline: Pipeline, prompt: str, grammar: str, **options: Any
) -> GenerationRequest:
    return make_request(pipeline.runner, prompt, max_tokens=24, grammar=grammar, **options)


def assert_json(outcome: Outcome) -> None:
    """A JSON object, or one that max_tokens cut short."""
    if outcome.finish == "stop":  # the grammar closed the object, then EOS
        assert isinstance(json.loads(outcome.text), dict), outcome.text
    else:
        assert outcome.finish == "length" and completes_to_object(outcome.text), outcome.text


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_json_mode_gives_the_single_engines_tokens(grammar_pipeline: Pipeline, prompt: str) -> None:
    outcome = assert_same(grammar_pipeline, json_request(grammar_pipeline, prompt, JSON_OBJECT))
    assert outcome.text.startswith("{")
    assert_json(outcome)
    free = run(grammar_pipeline.runner, make_request(grammar_pipeline.runner, prompt, 24))
    assert not completes_to_object(free.text)  # the grammar is what made it JSON


def test_a_schema_is_followed_to_the_end(grammar_pipeline: Pipeline) -> None:
    request = make_request(grammar_pipeline.runner, PROMPTS[2], max_tokens=64, grammar=REPLY)
    outcome = assert_same(grammar_pipeline, request)
    assert outcome.finish == "stop"
    value = json.loads(outcome.text)
    assert set(value) == {"answer", "mood", "count"} and value["mood"] in ("calm", "wild")


def test_grammar_after_penalties_with_logprobs_and_sampling(grammar_pipeline: Pipeline) -> None:
    """The grammar masks last (no penalty lifts it); logprobs are taken after both."""
    options = {"frequency_penalty": 1.5, "repetition_penalty": 1.3, "logprobs": 2}
    for sampling in ({}, {"temperature": 1.0, "seed": 11}):
        request = json_request(grammar_pipeline, PROMPTS[1], JSON_OBJECT, **options, **sampling)
        outcome = assert_same(grammar_pipeline, request)
        assert_json(outcome)


def test_a_batch_mixes_grammars_and_free_text(grammar_pipeline: Pipeline) -> None:
    requests = [
        json_request(grammar_pipeline, PROMPTS[0], JSON_OBJECT),
        make_request(grammar_pipeline.runner, PROMPTS[1], 24),
        make_request(grammar_pipeline.runner, PROMPTS[2], 64, grammar=REPLY),
        json_request(grammar_pipeline, PROMPTS[3], JSON_OBJECT, temperature=0.9, seed=5),
    ]
    alone = [run(grammar_pipeline.reference, request) for request in requests]
    together = run_all(grammar_pipeline.runner, requests)
    assert [outcome.tokens for outcome in together] == [outcome.tokens for outcome in alone]
    for index in (0, 2, 3):
        assert_json(together[index])


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (UNKNOWN_TOKEN, "the output grammar is invalid"),
        (NOT_A_GRAMMAR, "the output grammar is invalid"),
        (
            LLMatcher.grammar_from_json_schema(TOO_LARGE_SCHEMA),
            "does not fit in a pipeline BEGIN frame",
        ),
    ],
    ids=["unknown-token", "unknown-rule", "too-large"],
)
def test_a_bad_grammar_fails_its_request_alone(
    grammar_pipeline: Pipeline, grammar: str, message: str
) -> None:
    """Refused by the coordinator's insert, before anything reaches the chain."""
    good = [json_request(grammar_pipeline, prompt, JSON_OBJECT) for prompt in PROMPTS[:2]]
    bad = json_request(grammar_pipeline, PROMPTS[2], grammar)
    first, refused, second = run_all(grammar_pipeline.runner, [good[0], bad, good[1]])
    assert refused.finish == "error" and message in (refused.error or ""), refused
    assert refused.tokens == []
    for outcome, request in zip((first, second), good, strict=True):
        assert outcome.tokens == run(grammar_pipeline.reference, request).tokens
    assert grammar_pipeline.engine.healthy()


def test_a_grammar_the_last_stage_refuses_ends_that_sequence_alone(
    grammar_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a grammar reach the last stage and not compile there, that stage refuses the
    sequence in its TOKEN answer; the others in the micro-batch go on, the session too."""
    engine = grammar_pipeline.engine
    monkeypatch.setattr(engine, "_check_grammar", lambda request: None)
    good = [json_request(grammar_pipeline, prompt, JSON_OBJECT) for prompt in PROMPTS[:2]]
    plain = make_request(grammar_pipeline.runner, PROMPTS[3], 24)
    bad = json_request(grammar_pipeline, PROMPTS[2], UNKNOWN_TOKEN)
    outcomes = run_all(grammar_pipeline.runner, [good[0], bad, plain, good[1]])
    refused = outcomes[1]
    assert refused.finish == "error" and refused.tokens == [], refused
    assert "the last pipeline stage refused the sequence" in (refused.error or "")
    assert "the output grammar is invalid" in (refused.error or "")
    for outcome, request in zip(
        (outcomes[0], outcomes[2], outcomes[3]), (good[0], plain, good[1]), strict=True
    ):
        assert outcome.tokens == run(grammar_pipeline.reference, request).tokens
    assert engine.healthy()
    monkeypatch.undo()
    assert_same(grammar_pipeline, json_request(grammar_pipeline, PROMPTS[0], JSON_OBJECT))


# -- through the API ---------------------------------------------------------------------------


def chat(pipeline_runner: Any, body: dict[str, Any]) -> dict[str, Any]:
    async def post() -> dict[str, Any]:
        async with open_client(make_service(pipeline_runner)) as client:
            response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    return asyncio.run(asyncio.wait_for(post(), 60))


def calls(choice: dict[str, Any]) -> list[Any]:
    """The tool calls without their ids (random per response)."""
    return [call["function"] for call in choice["message"].get("tool_calls") or []]


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": REPLY_SCHEMA},
            },
            "max_tokens": 64,
        },
        {"tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 64},
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 64,
        },
    ],
    ids=["json_object", "json_schema", "tool-required", "tool-named"],
)
def test_the_api_honours_constraints_on_the_pipeline(
    grammar_pipeline: Pipeline, fields: dict[str, Any]
) -> None:
    """No 400 for the pipeline any more, and the answer is the single engine's."""
    body = chat_body(**fields)
    got = chat(grammar_pipeline.runner, body)
    expected = chat(grammar_pipeline.reference, body)
    assert got["message"]["content"] == expected["message"]["content"]
    assert got["finish_reason"] == expected["finish_reason"]
    assert calls(got) == calls(expected)
    if "tools" in fields:
        assert got["finish_reason"] == "tool_calls", got
        [call] = got["message"]["tool_calls"]
        if call["function"]["name"] == "get_weather":
            assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    elif got["finish_reason"] == "stop":
        assert isinstance(json.loads(got["message"]["content"]), dict)
    else:
        assert completes_to_object(got["message"]["content"])


def test_begin_documents_carry_the_grammar() -> None:
    request = GenerationRequest("x", (1, 2), 4, seed=3, logprobs=1, grammar=JSON_OBJECT)
    assert sequence_documents.begin_request(request.document()) == request
    free = replace(request, grammar=None).document()
    assert sequence_documents.begin_request(free).grammar is None


def test_a_schema_too_large_for_the_wire_is_a_400_before_queueing(
    grammar_pipeline: Pipeline,
) -> None:
    """The engine's own limit (Engine.refusal), asked by the API: nothing reaches the queue."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "big", "schema": TOO_LARGE_SCHEMA},
    }
    body = chat_body(response_format=response_format, max_tokens=8)
    runner = grammar_pipeline.runner
    steps = runner.steps

    async def post() -> httpx.Response:
        async with open_client(make_service(runner)) as client:
            return await client.post("/v1/chat/completions", json=body)

    response = asyncio.run(asyncio.wait_for(post(), 60))
    error = assert_error(response, 400, param="response_format", code="invalid_value")
    assert "does not fit in a pipeline BEGIN frame" in error["message"]
    assert runner.steps == steps and runner.queued == 0
