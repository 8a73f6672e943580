"""Grammars over tensor parallel: JSON mode, schemas and forced tool calls give SingleEngine's
tokens; a bad grammar is refused for its sequence only."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from llguidance import LLMatcher

from engines.api.constraints import JSON_OPTIONS
from engines.core.runner import EngineRunner
from tests.helpers.api import chat_body, make_service, open_client
from tests.helpers.engine import make_request, run_all, run_one
from tests.helpers.grammar import REPLY_SCHEMA, completes_to_object
from tests.helpers.tensor_parallel import GRAMMAR, PROMPTS

pytestmark = pytest.mark.cluster

# A forced tool call's shape (engines/api/constraints.py): text markers around a JSON call.
CALL = {**REPLY_SCHEMA, "x-guidance": JSON_OPTIONS}
TOOL_CALL = (
    f'start: "<tool_call>" "\\n" call "\\n" "</tool_call>"\ncall: %json {json.dumps(CALL)}\n'
)


def test_grammars_give_the_tokens_single_gives(tp_runner, single_runner):
    """JSON mode, a JSON schema and a forced tool call's grammar cross the lockstep: every rank
    masks the same tokens, so the output equals the single engine's, token for token."""
    assert "grammar" in tp_runner.engine.features
    schema = LLMatcher.grammar_from_json_schema(REPLY_SCHEMA, overrides=JSON_OPTIONS)
    tool_call = LLMatcher.grammar_from_lark(TOOL_CALL)
    cases = [
        (PROMPTS[0], 24, {"grammar": GRAMMAR}),
        (PROMPTS[1], 24, {"grammar": GRAMMAR, "temperature": 1.0, "seed": 3}),
        (PROMPTS[2], 48, {"grammar": schema}),
        (PROMPTS[0], 64, {"grammar": tool_call}),
        (PROMPTS[1], 24, {}),  # in the same batch, a sequence without a grammar stays free
    ]
    requests = [make_request(single_runner.engine, p, n, **o) for p, n, o in cases]
    expected = [run_one(single_runner, request) for request in requests]
    got = run_all(tp_runner, requests)
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    assert [(g.text, g.finish) for g in got] == [(e.text, e.finish) for e in expected]
    json_object, sampled, answer, call, free = got
    for outcome in (json_object, sampled):
        if outcome.finish == "stop":  # the grammar closed the object, then EOS
            assert isinstance(json.loads(outcome.text), dict)
        else:
            assert completes_to_object(outcome.text), outcome.text
    value = json.loads(answer.text)
    assert set(value) == {"answer", "mood", "count"} and value["mood"] in ("calm", "wild")
    assert call.text.startswith("<tool_call>\n{") and call.text.endswith("}\n</tool_call>")
    assert json.loads(call.text.split("\n")[1])["mood"] in ("calm", "wild")
    assert not completes_to_object(free.text)


def test_a_bad_grammar_is_refused_for_its_sequence_only(tp_runner, single_runner):
    expected = run_one(single_runner, make_request(single_runner.engine, PROMPTS[0], 12))
    bad = [
        "not a grammar",
        LLMatcher.grammar_from_lark('start: "a" <[999999]>\n'),  # a token id the model lacks
    ]
    requests = [make_request(tp_runner.engine, PROMPTS[0], 12, grammar=g) for g in bad]
    *refused, good = run_all(tp_runner, [*requests, make_request(tp_runner.engine, PROMPTS[0], 12)])
    for outcome in refused:
        assert outcome.finish == "error" and "grammar" in outcome.error, outcome.error
        assert not outcome.tokens
    assert good.tokens == expected.tokens


def test_the_api_answers_json_mode_and_forced_tool_calls_over_tp(tp_runner, single_runner):
    """Through the API: tp no longer refuses the fields and answers what single answers."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    bodies = [
        chat_body(response_format={"type": "json_object"}, max_tokens=24),
        chat_body(tools=[weather], tool_choice="required", max_tokens=64),
    ]

    async def answers(runner: EngineRunner) -> list[dict[str, Any]]:
        async with open_client(make_service(runner)) as client:
            responses = [await client.post("/v1/chat/completions", json=b) for b in bodies]
        assert all(response.status_code == 200 for response in responses), responses[0].text
        choices = [response.json()["choices"][0] for response in responses]
        for choice in choices:  # call ids are random
            for call in choice["message"].get("tool_calls") or []:
                call.pop("id")
        return choices

    expected = asyncio.run(answers(single_runner))
    json_mode, tool_call = asyncio.run(answers(tp_runner))
    assert [json_mode, tool_call] == expected
    assert completes_to_object(json_mode["message"]["content"])
    assert tool_call["finish_reason"] == "tool_calls"
    [call] = tool_call["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
