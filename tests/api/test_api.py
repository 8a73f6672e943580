"""The OpenAI-compatible API over a real SingleEngine: shapes, streaming, sampling, limits."""

from __future__ import annotations

import time

import httpx
import pytest

from engines.core.runner import EngineRunner
from tests.helpers.api import (  # noqa: F401
    HELLO,
    MODEL_ID,
    anyio_backend,
    chat_body,
    client,
    completion_body,
    idle_runner,
    make_service,
    open_client,
    parse_sse,
    runner,
)

pytestmark = pytest.mark.anyio


async def test_chat_completion_has_openai_shape_and_usage(
    client: httpx.AsyncClient, runner: EngineRunner
) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(user="someone"))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > len("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL_ID
    assert abs(body["created"] - time.time()) < 60
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["finish_reason"] == "length"  # the demo model never samples EOS
    prompt = runner.engine.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True)
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 12,
        "total_tokens": len(prompt) + 12,
        "prompt_tokens_details": {"cached_tokens": 0},  # this runner keeps no prefix cache
        "completion_tokens_details": {  # nothing drafted: this runner does not speculate
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


async def test_chat_stream_chunks_done_and_usage(client: httpx.AsyncClient) -> None:
    plain = (await client.post("/v1/chat/completions", json=chat_body())).json()
    body = chat_body(stream=True, stream_options={"include_usage": True})
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *middle, final, usage = chunks[1:]
    assert all(set(chunk["choices"][0]["delta"]) == {"content"} for chunk in middle)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in middle)
    text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in middle)
    assert text == plain["choices"][0]["message"]["content"]
    assert final["choices"][0] == {
        "index": 0,
        "delta": {},
        "finish_reason": "length",
        "logprobs": None,
    }
    assert usage["choices"] == []
    assert usage["usage"] == plain["usage"]


async def test_chat_stream_without_usage_option_sends_no_usage(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    assert all(event["usage"] is None and event["choices"] for event in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_chat_text_parts_equal_string_content(client: httpx.AsyncClient) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
        }
    ]
    joined = await client.post("/v1/chat/completions", json=chat_body(messages=parts))
    plain = await client.post("/v1/chat/completions", json=chat_body())
    assert joined.status_code == 200, joined.text
    assert joined.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


async def test_unknown_fields_are_refused_by_name(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(whatever=[1]))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "whatever"
    assert "whatever" in response.json()["error"]["message"]


# -- completions -------------------------------------------------------------------------------


async def test_completion_non_streaming(client: httpx.AsyncClient, runner: EngineRunner) -> None:
    response = await client.post("/v1/completions", json=completion_body())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL_ID
    [choice] = body["choices"]
    assert choice["text"] and choice["finish_reason"] == "length"
    prompt_tokens = len(runner.engine.tokenizer.encode("Once upon"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {  # nothing drafted: this runner does not speculate
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


async def test_completion_prompt_forms_agree(
    client: httpx.AsyncClient, runner: EngineRunner
) -> None:
    ids = runner.engine.tokenizer.encode("Once upon")
    texts = []
    for prompt in ("Once upon", ["Once upon"], ids):
        response = await client.post("/v1/completions", json=completion_body(prompt=prompt))
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2]


async def test_completion_stream(client: httpx.AsyncClient) -> None:
    plain = (await client.post("/v1/completions", json=completion_body())).json()
    body = completion_body(stream=True, stream_options={"include_usage": True})
    events = parse_sse((await client.post("/v1/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    *content, final, usage = events[:-1]
    assert all(chunk["object"] == "text_completion" for chunk in events[:-1])
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in content)
    text = "".join(chunk["choices"][0]["text"] for chunk in content)
    assert text == plain["choices"][0]["text"]
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]


# -- sampling and limits -----------------------------------------------------------------------


async def test_greedy_is_deterministic(client: httpx.AsyncClient) -> None:
    first = await client.post("/v1/chat/completions", json=chat_body(max_tokens=24))
    second = await client.post("/v1/chat/completions", json=chat_body(max_tokens=24))
    assert first.json()["choices"][0] == second.json()["choices"][0]


async def test_seed_makes_sampling_repeatable(client: httpx.AsyncClient) -> None:
    async def sample(seed: int) -> str:
        body = completion_body(temperature=1.0, seed=seed, max_tokens=24)
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    first = await sample(7)
    assert await sample(7) == first
    assert {await sample(seed) for seed in (1, 2, 3)} != {first}


async def test_stop_sequence_cuts_the_text(client: httpx.AsyncClient) -> None:
    full = (await client.post("/v1/completions", json=completion_body(max_tokens=40))).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        body = completion_body(max_tokens=40, stop=[stop, "\u2603"], stream=stream)
        response = await client.post("/v1/completions", json=body)
        if stream:
            chunks = parse_sse(response.text)[:-1]
            cut = "".join(chunk["choices"][0]["text"] for chunk in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            cut = response.json()["choices"][0]["text"]
            reason = response.json()["choices"][0]["finish_reason"]
        assert stop not in cut
        assert cut == expected
        assert reason == "stop"


async def test_max_tokens_gives_length(client: httpx.AsyncClient) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        body = chat_body(**{"max_tokens": None, field: 5})
        response = await client.post("/v1/chat/completions", json=body)
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        assert choice["finish_reason"] == "length"
        assert usage["completion_tokens"] == 5


async def test_default_max_tokens_is_capped(runner: EngineRunner) -> None:
    for limits, expected in (
        ({"default_max_tokens": 6}, 6),
        ({"default_max_tokens": 9, "max_tokens_cap": 4}, 4),
    ):
        async with open_client(make_service(runner, **limits)) as client:
            body = {"model": MODEL_ID, "messages": HELLO, "temperature": 0}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.json()["usage"]["completion_tokens"] == expected
