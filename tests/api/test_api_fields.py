"""Every OpenAI request field is honoured (and changes the output as it should) or refused by
name: logprobs, penalties, JSON mode and schemas, tools; over a real SingleEngine."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engines.api.errors import APIError
from engines.api.generation import check_features
from engines.api.openai.fields import check_chat_fields
from engines.api.openai.mapping import chat_input_of, chat_sampling_of, completion_sampling_of
from engines.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from engines.core.runner import EngineRunner
from engines.core.service import Service
from tests.helpers.api import (  # noqa: F401
    CLOCK,
    WEATHER,
    anyio_backend,
    assert_error,
    chat_body,
    client,
    completion_body,
    idle_runner,
    make_service,
    open_client,
    parse_sse,
    runner,
)
from tests.helpers.grammar import REPLY_SCHEMA, completes_to_object

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# -- logprobs ----------------------------------------------------------------------------------


async def test_chat_logprobs_shape_and_values(client: httpx.AsyncClient) -> None:
    body = chat_body(logprobs=True, top_logprobs=3, max_tokens=10)
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    completion = response.json()
    content = completion["choices"][0]["logprobs"]["content"]
    assert len(content) == completion["usage"]["completion_tokens"] == 10
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        values = [top["logprob"] for top in tops]
        assert values == sorted(values, reverse=True) and all(value <= 0 for value in values)
        assert sum(math.exp(value) for value in values) <= 1.0 + 1e-4
        # temperature 0: the chosen token is the most likely one
        assert entry["token"] == tops[0]["token"]
        assert entry["logprob"] == pytest.approx(tops[0]["logprob"], abs=1e-5)
        assert bytes(entry["bytes"]).decode() == entry["token"]
    text = completion["choices"][0]["message"]["content"]
    assert "".join(entry["token"] for entry in content) == text

    plain = (await client.post(CHAT, json=chat_body(max_tokens=10))).json()
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("logprobs", [{"logprobs": True}, {}], ids=["with", "top_alone"])
async def test_chat_logprobs_stream_equal_the_whole_answer(
    client: httpx.AsyncClient, logprobs: dict
) -> None:
    # top_logprobs alone asks for logprobs too, streamed or not (the whole answer once
    # dropped them)
    body = chat_body(**logprobs, top_logprobs=2, max_tokens=8)
    whole = (await client.post(CHAT, json=body)).json()["choices"][0]["logprobs"]["content"]
    response = await client.post(CHAT, json={**body, "stream": True})
    chunks = parse_sse(response.text)[:-1]
    streamed = [
        entry
        for chunk in chunks
        for choice in chunk["choices"]
        if choice["logprobs"] is not None
        for entry in choice["logprobs"]["content"]
    ]
    assert streamed == whole


async def test_completion_logprobs_stream_and_whole(client: httpx.AsyncClient) -> None:
    body = completion_body(logprobs=2, max_tokens=8)
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 8
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    # (the detokenizer drops the first token's leading space, as mlx-lm does)
    assert "".join(logprobs["tokens"]).lstrip() == choice["text"].lstrip()
    assert logprobs["text_offset"][0] == 0
    streamed = parse_sse((await client.post(COMPLETIONS, json={**body, "stream": True})).text)
    tokens = [
        token
        for chunk in streamed[:-1]
        for part in chunk["choices"]
        if part["logprobs"] is not None
        for token in part["logprobs"]["tokens"]
    ]
    assert tokens == logprobs["tokens"]


# -- penalties ---------------------------------------------------------------------------------


def repeats(tokens: list[str]) -> int:
    return len(tokens) - len(set(tokens))


@pytest.mark.parametrize(
    "penalty",
    [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}],
    ids=lambda value: next(iter(value)),
)
async def test_penalties_reduce_repetition(client: httpx.AsyncClient, penalty: dict) -> None:
    prompt = "the the the the the the the the the the the the the the the the"
    body = completion_body(prompt=prompt, max_tokens=20, logprobs=0)
    plain = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["logprobs"]
    penalised = await client.post(COMPLETIONS, json={**body, **penalty})
    assert penalised.status_code == 200, penalised.text
    tokens = penalised.json()["choices"][0]["logprobs"]["tokens"]
    assert repeats(tokens) < repeats(plain["tokens"]), (tokens, plain["tokens"])


# -- response_format ---------------------------------------------------------------------------


async def test_json_object_mode_gives_json_objects(client: httpx.AsyncClient) -> None:
    # The demo model's random weights write long keys; most answers end by max_tokens.
    for seed in range(4):
        body = chat_body(
            response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=24
        )
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":  # the grammar closed the object, then EOS
            assert isinstance(json.loads(text), dict)
        else:
            assert completes_to_object(text), text
        plain = await client.post(CHAT, json={**body, "response_format": {"type": "text"}})
        assert not completes_to_object(plain.json()["choices"][0]["message"]["content"])


async def test_json_schema_is_followed(client: httpx.AsyncClient) -> None:
    json_schema = {"name": "reply", "schema": REPLY_SCHEMA}
    response_format = {"type": "json_schema", "json_schema": json_schema}
    for stream in (False, True):
        body = chat_body(response_format=response_format, max_tokens=64, stream=stream)
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        if stream:
            chunks = parse_sse(response.text)[:-1]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        else:
            text = response.json()["choices"][0]["message"]["content"]
        value = json.loads(text)
        assert set(value) == {"answer", "mood", "count"}
        assert isinstance(value["answer"], bool) and value["mood"] in ("calm", "wild")
        assert 0 <= value["count"] <= 9


async def test_invalid_json_schema_is_a_400(client: httpx.AsyncClient) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    response = await client.post(CHAT, json=chat_body(response_format=bad))
    assert_error(response, 400, param="response_format.json_schema.schema")


# -- tools -------------------------------------------------------------------------------------


async def test_forced_tool_call_comes_back_as_tool_calls(client: httpx.AsyncClient) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = chat_body(tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=64)
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]
        assert answer["finish_reason"] == "tool_calls", answer
        [call] = answer["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert arguments["city"] in ("Paris", "Oslo")
        else:
            assert choice == "required" and call["function"]["name"] == "get_time"


async def test_forced_tool_call_streams_as_one_delta(client: httpx.AsyncClient) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = chat_body(tools=[WEATHER], tool_choice=choice, max_tokens=64, stream=True)
    chunks = parse_sse((await client.post(CHAT, json=body)).text)[:-1]
    calls = [
        c["choices"][0]["delta"]["tool_calls"]
        for c in chunks
        if "tool_calls" in c["choices"][0]["delta"]
    ]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0][0]["function"]["arguments"])["city"] in ("Paris", "Oslo")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert "<tool_call>" not in text


async def test_tool_round_trip_renders_with_the_template(client: httpx.AsyncClient) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"},
    ]
    body = chat_body(messages=messages, tools=[WEATHER], tool_choice="auto")
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


async def test_tools_refused_for_a_template_without_tool_support(
    runner: EngineRunner, demo_model_dir: Path, tmp_path: Path
) -> None:
    plain = tmp_path / "no-tools"
    shutil.copytree(demo_model_dir, plain)
    config_path = plain / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    config_path.write_text(json.dumps(config))
    async with open_client(make_service(runner, tokenizer=load_tokenizer(plain))) as client:
        response = await client.post(CHAT, json=chat_body(tools=[WEATHER]))
        assert_error(response, 400, param="tools", code="unsupported_parameter")
        plain_chat = await client.post(CHAT, json=chat_body())
        assert plain_chat.status_code == 200, plain_chat.text


# -- refusals ----------------------------------------------------------------------------------

REFUSED = [
    (CHAT, {"logit_bias": {"5": 1.0}}, "logit_bias"),
    (CHAT, {"store": True}, "store"),
    (CHAT, {"metadata": {"a": "b"}}, "metadata"),
    (CHAT, {"service_tier": "flex"}, "service_tier"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"audio": {"voice": "x", "format": "mp3"}}, "audio"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"reasoning_effort": "extreme"}, "reasoning_effort"),
    (CHAT, {"verbosity": "low"}, "verbosity"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (
        CHAT,
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (CHAT, {"frequency_penalty": 3.0}, "frequency_penalty"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
    (CHAT, {"mirostat_tau": 5.0}, "mirostat_tau"),
    (COMPLETIONS, {"echo": True}, "echo"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"suffix": "end"}, "suffix"),
    (COMPLETIONS, {"logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"logit_bias": {"1": -100}}, "logit_bias"),
    (COMPLETIONS, {"tools": [WEATHER]}, "tools"),
]


@pytest.mark.parametrize(("path", "fields", "param"), REFUSED, ids=[r[2] for r in REFUSED])
async def test_refused_fields_are_named(
    client: httpx.AsyncClient, path: str, fields: dict, param: str
) -> None:
    body = (chat_body if path == CHAT else completion_body)(**fields)
    error = assert_error(await client.post(path, json=body), 400)
    assert error["param"] is not None and error["param"].startswith(param), error


HARMLESS = [
    {"store": False, "service_tier": "auto", "modalities": ["text"], "logit_bias": {}},
    {"user": "u-1", "safety_identifier": "s", "prompt_cache_key": "k", "parallel_tool_calls": True},
    {"response_format": {"type": "text"}, "tool_choice": "none"},
]


@pytest.mark.parametrize("fields", HARMLESS)
async def test_default_values_of_refused_fields_pass(
    client: httpx.AsyncClient, fields: dict
) -> None:
    response = await client.post(CHAT, json=chat_body(**fields))
    assert response.status_code == 200, response.text


SERVICE = Service(model_id="m", tokenizer=None)  # its limits are all the sampling mapping reads


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_an_engine_without_a_feature_refuses_the_field(fields: dict, param: str) -> None:
    # An engine that declares none of the features (every engine declares all three today).
    body = ChatCompletionRequest.model_validate(chat_body(**fields))
    check_chat_fields(body)
    sampling, constrained = chat_sampling_of(body, SERVICE), chat_input_of(body).grammar_param()
    with pytest.raises(APIError) as refused:
        check_features(frozenset(), sampling, constrained)
    assert refused.value.status == 400 and refused.value.param == param
    check_features(frozenset({"penalties", "logprobs", "grammar"}), sampling, constrained)
    completion = CompletionRequest.model_validate(completion_body(logprobs=1))
    with pytest.raises(APIError):
        check_features(frozenset(), completion_sampling_of(completion, SERVICE))


# -- the server's temperature ------------------------------------------------------------------


async def test_a_request_without_temperature_takes_the_server_s(runner: EngineRunner) -> None:
    """`tandem serve --temperature 0`: what agents that send none (Claude Code, Codex) get.
    Each dialect's own default otherwise: seeded sampling at 1.0 on random weights."""
    unset = {name: value for name, value in chat_body(seed=7).items() if name != "temperature"}

    async def answer(**limits: float) -> str:
        async with open_client(make_service(runner, **limits)) as client:
            response = await client.post(CHAT, json=unset)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]

    async with open_client(make_service(runner)) as client:
        greedy = (await client.post(CHAT, json=chat_body(seed=7))).json()
    assert await answer(temperature=0.0) == greedy["choices"][0]["message"]["content"]
    assert await answer() != greedy["choices"][0]["message"]["content"]
