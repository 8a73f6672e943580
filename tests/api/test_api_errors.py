"""The OpenAI-compatible API when things go wrong: bad input, auth, 429, timeouts, disconnects."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from engines.api import create_app
from engines.api.generation import failure_of
from engines.core.engine import Failure, Finish, TokenEvent
from engines.core.runner import EngineRunner
from tests.helpers.api import (  # noqa: F401
    CLUSTER,
    HELLO,
    LONG,
    MODEL_ID,
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
    start_runner,
    wait_idle,
)

pytestmark = pytest.mark.anyio


# -- bad input ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_REQUESTS = [
    # (path, body (str = raw bytes), status, param, code)
    (CHAT, "{not json", 400, None, "invalid_value"),
    (CHAT, "[1, 2]", 400, None, "invalid_value"),
    (CHAT, "", 400, None, "invalid_value"),
    (CHAT, {"messages": HELLO}, 400, "model", "invalid_value"),
    (CHAT, chat_body(model="gpt-4o"), 404, "model", "model_not_found"),
    (CHAT, chat_body(messages="hi"), 400, "messages", "invalid_value"),
    (CHAT, chat_body(messages=[]), 400, "messages", "invalid_value"),
    (
        CHAT,
        chat_body(messages=[{"role": "robot", "content": "x"}]),
        400,
        "messages.0.role",
        "invalid_value",
    ),
    (CHAT, chat_body(messages=[{"role": "user"}]), 400, "messages.0.content", "invalid_value"),
    (
        CHAT,
        chat_body(messages=[{"role": "user", "content": 5}]),
        400,
        "messages.0.content",
        "invalid_value",
    ),
    (
        CHAT,
        chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages.0.content.0.type",
        "invalid_value",
    ),
    (CHAT, chat_body(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (CHAT, chat_body(max_tokens=4097), 400, "max_tokens", "invalid_value"),
    (CHAT, chat_body(max_completion_tokens=0), 400, "max_completion_tokens", "invalid_value"),
    (CHAT, chat_body(max_tokens="10"), 400, "max_tokens", "invalid_value"),
    (CHAT, chat_body(max_tokens=True), 400, "max_tokens", "invalid_value"),
    (CHAT, chat_body(temperature=2.5), 400, "temperature", "invalid_value"),
    (CHAT, chat_body(temperature=-0.1), 400, "temperature", "invalid_value"),
    (CHAT, chat_body(temperature="hot"), 400, "temperature", "invalid_value"),
    (CHAT, chat_body(top_p=0), 400, "top_p", "invalid_value"),
    (CHAT, chat_body(top_p=1.5), 400, "top_p", "invalid_value"),
    (CHAT, chat_body(top_k=-1), 400, "top_k", "invalid_value"),
    (CHAT, chat_body(min_p=2), 400, "min_p", "invalid_value"),
    (CHAT, chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
    (CHAT, chat_body(stop=7), 400, "stop", "invalid_value"),
    (CHAT, chat_body(seed=-1), 400, "seed", "invalid_value"),
    (CHAT, chat_body(n=2), 400, "n", "invalid_value"),
    (CHAT, chat_body(stream="yes"), 400, "stream", "invalid_value"),
    (
        CHAT,
        chat_body(stream_options={"include_usage": "yes"}),
        400,
        "stream_options.include_usage",
        "invalid_value",
    ),
    (
        CHAT,
        chat_body(messages=[{"role": "user", "content": "word " * 80}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    (COMPLETIONS, {"model": MODEL_ID}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, completion_body(prompt=""), 400, "prompt", "invalid_value"),
    (COMPLETIONS, completion_body(prompt=[]), 400, "prompt", "invalid_value"),
    (COMPLETIONS, completion_body(prompt=["a", "b"]), 400, "prompt", "invalid_value"),
    (COMPLETIONS, completion_body(prompt=[1, "a"]), 400, "prompt", "invalid_value"),
    (COMPLETIONS, completion_body(prompt=[True]), 400, "prompt", "invalid_value"),
    (COMPLETIONS, completion_body(prompt=[5, 10**6]), 400, "prompt", "invalid_value"),
    (COMPLETIONS, completion_body(prompt="word " * 80), 400, "prompt", "context_length_exceeded"),
    (
        COMPLETIONS,
        completion_body(prompt=list(range(65))),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (COMPLETIONS, completion_body(model="other"), 404, "model", "model_not_found"),
    (COMPLETIONS, completion_body(n=3), 400, "n", "invalid_value"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS)
async def test_bad_input_gets_openai_error(
    runner: EngineRunner, path: str, body: Any, status: int, param: str | None, code: str
) -> None:
    async with open_client(make_service(runner), max_prompt_tokens=64) as client:
        if isinstance(body, str):
            headers = {"content-type": "application/json"}
            response = await client.post(path, content=body, headers=headers)
        else:
            response = await client.post(path, json=body)
    error = assert_error(response, status, param=param, code=code)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert param in error["message"] or param.split(".")[-1] in error["message"]
    assert runner.idle  # nothing reached the engine


async def test_json_body_needs_no_content_type_but_not_a_wrong_one(
    client: httpx.AsyncClient,
) -> None:
    raw = json.dumps(chat_body(max_tokens=2))
    assert (await client.post(CHAT, content=raw)).status_code == 200
    wrong = await client.post(CHAT, content=raw, headers={"content-type": "text/plain"})
    error = assert_error(wrong, 400, param=None)
    assert "application/json" in error["message"]


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404, code="not_found")
    assert_error(await client.get("/v1/chat/completions"), 405, code="method_not_allowed")


async def test_unexpected_exception_is_a_500_without_traceback(runner: EngineRunner) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("secret internals")

    service = make_service(runner)
    service.cluster_status = broken
    transport = httpx.ASGITransport(app=create_app(service), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
        response = await client.get("/v1/cluster")
    assert_error(response, 500, type="server_error")
    assert "secret" not in response.text


# -- models, health, cluster, auth -------------------------------------------------------------


async def test_models(client: httpx.AsyncClient) -> None:
    listing = (await client.get("/v1/models")).json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert card["id"] == MODEL_ID and card["object"] == "model" and card["owned_by"] == "tandem"
    assert isinstance(card["created"], int)
    assert (await client.get(f"/v1/models/{MODEL_ID}")).json() == card
    assert_error(await client.get("/v1/models/nope"), 404, code="model_not_found")


async def test_health_and_cluster(runner: EngineRunner) -> None:
    service = make_service(runner)
    async with open_client(service) as client:
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ok" and health.json()["model"] == MODEL_ID
        assert (await client.get("/v1/cluster")).json() == CLUSTER
        service.state, service.state_reason = "degraded", "rank 1 lost"
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded"
        assert health.json()["reason"] == "rank 1 lost"


async def test_no_engine_means_503(runner: EngineRunner) -> None:
    service = make_service(None, tokenizer=runner.engine.tokenizer)
    service.swap_runner(None, "starting", "loading the model")
    async with open_client(service) as client:
        assert (await client.get("/health")).status_code == 503
        response = await client.post(CHAT, json=chat_body())
    error = assert_error(response, 503, type="server_error", code="engine_unavailable")
    assert "loading the model" in error["message"]
    service.tokenizer = None  # how the coordinator starts, before any engine has loaded
    async with open_client(service) as client:
        for path, body in ((CHAT, chat_body()), (COMPLETIONS, completion_body())):
            error = assert_error(await client.post(path, json=body), 503, code="engine_unavailable")
            assert "not loaded yet" in error["message"]


async def test_bearer_key(runner: EngineRunner) -> None:
    async with open_client(make_service(runner, api_key="s3cret")) as client:
        missing = await client.get("/v1/models")
        assert_error(missing, 401, type="authentication_error", code="invalid_api_key")
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401, code="invalid_api_key")
        # The key is checked before the body is even parsed.
        unparsed = await client.post(
            CHAT, content="{bad", headers={"content-type": "application/json"}
        )
        assert_error(unparsed, 401, code="invalid_api_key")
        good = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        assert (await client.post(CHAT, json=chat_body(), headers=good)).status_code == 200
        assert (await client.get("/health")).status_code == 200


# -- queue, timeouts, failures, disconnects ----------------------------------------------------


async def wait_until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_queue_full_is_429_while_health_stays_up(demo_model_dir: Any) -> None:
    runner = start_runner(demo_model_dir, queue_size=1, max_batch=1)
    try:
        async with open_client(make_service(runner)) as client:
            long = chat_body(max_tokens=LONG)
            running = asyncio.create_task(client.post(CHAT, json=long))
            await wait_until(lambda: runner.active == 1)
            waiting = asyncio.create_task(client.post(CHAT, json=long))
            await wait_until(lambda: runner.queued == 1)
            rejected = await client.post(CHAT, json=chat_body())
            assert_error(rejected, 429, type="rate_limit_error", code="queue_full")
            rejected = await client.post(COMPLETIONS, json=completion_body(stream=True))
            assert_error(rejected, 429, code="queue_full")
            started = time.monotonic()
            health = await client.get("/health")
            assert time.monotonic() - started < 1.0  # the event loop is not blocked by mlx
            assert health.status_code == 200
            assert health.json()["queued"] == 1 and health.json()["queue_size"] == 1
            for task in (running, waiting):
                task.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
        await asyncio.to_thread(wait_idle, runner)
    finally:
        await asyncio.to_thread(runner.close)


async def test_engine_timeout_is_504_or_error_event(runner: EngineRunner) -> None:
    async with open_client(make_service(runner, request_timeout_s=0.2)) as client:
        response = await client.post(CHAT, json=chat_body(max_tokens=LONG))
        error = assert_error(response, 504, type="timeout_error", code="timeout")
        assert "timed out" in error["message"]
        streamed = await client.post(CHAT, json=chat_body(max_tokens=LONG, stream=True))
    events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["error"]["code"] == "timeout"
    assert set(events[-2]["error"]) == {"message", "type", "param", "code"}


async def test_api_deadline_cancels_a_request_stuck_in_the_queue(demo_model_dir: Any) -> None:
    runner = start_runner(demo_model_dir, queue_size=2, max_batch=1)  # the batch is full
    async with open_client(make_service(runner)) as patient:
        blocker = asyncio.create_task(patient.post(CHAT, json=chat_body(max_tokens=LONG)))
        await wait_until(lambda: runner.active == 1)
        async with open_client(make_service(runner, request_timeout_s=0.1)) as hurried:
            started = time.monotonic()
            response = await hurried.post(COMPLETIONS, json=completion_body())
            assert time.monotonic() - started < 3.0
        assert_error(response, 504, code="timeout")
        assert not blocker.done()  # the long request was running the whole time
        blocker.cancel()
        await asyncio.gather(blocker, return_exceptions=True)
    await asyncio.to_thread(runner.close)


async def test_engine_shutdown_fails_requests_with_503(demo_model_dir: Any) -> None:
    runner = start_runner(demo_model_dir, queue_size=2, max_batch=1)
    async with open_client(make_service(runner)) as client:
        running = asyncio.create_task(client.post(CHAT, json=chat_body(max_tokens=LONG)))
        await wait_until(lambda: runner.active == 1)
        streamed = asyncio.create_task(
            client.post(CHAT, json=chat_body(max_tokens=LONG, stream=True))
        )
        await wait_until(lambda: runner.queued == 1)
        await asyncio.to_thread(runner.close)
        assert_error(await running, 503, type="server_error", code="engine_unavailable")
        events = parse_sse((await streamed).text)
        assert events[-1] == "[DONE]"
        assert "shutting down" in events[-2]["error"]["message"]
        assert_error(await client.post(CHAT, json=chat_body()), 503, code="engine_unavailable")


async def call_then_disconnect(
    app: Any, path: str, body: dict[str, Any], gone: asyncio.Event
) -> list[dict]:
    """Drive the ASGI app as a server would, and report http.disconnect once `gone` is set."""
    payload = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    messages: list[dict] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"tandem.test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return messages


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_cancels_generation(runner: EngineRunner, stream: bool) -> None:
    app = create_app(make_service(runner))
    gone = asyncio.Event()
    body = chat_body(max_tokens=LONG, stream=stream)
    call = asyncio.create_task(call_then_disconnect(app, CHAT, body, gone))
    await wait_until(lambda: runner.active == 1)
    (submission,) = runner.running()
    await asyncio.sleep(0.2)  # let tokens flow (and, streaming, reach the client)
    gone.set()
    started = time.monotonic()
    await asyncio.wait_for(call, timeout=5)
    await wait_until(lambda: runner.idle, timeout_s=2.0)
    assert submission.cancelled.is_set()
    assert time.monotonic() - started < 2.0  # far less than the ~7 s the full request takes


async def test_curl_style_form_content_type_is_read_as_json(client) -> None:
    # `curl -d '{...}'` labels the body application/x-www-form-urlencoded.
    response = await client.post(
        "/v1/completions",
        content=b'{"model": "tandem-demo", "prompt": "Hello", "max_tokens": 3, "temperature": 0}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


# -- the planned context, and the event loop ----------------------------------------------------


async def test_prompt_plus_max_tokens_must_fit_the_planned_context(runner: EngineRunner) -> None:
    async with open_client(make_service(runner), max_prompt_tokens=64) as client:
        prompt = list(range(10, 50))  # 40 tokens of a 64-token context
        too_many = await client.post(
            COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=25)
        )
        error = assert_error(too_many, 400, param="max_tokens", code="context_length_exceeded")
        assert "room for 24 tokens" in error["message"]
        fits = await client.post(COMPLETIONS, json=completion_body(prompt=prompt, max_tokens=24))
        assert fits.status_code == 200, fits.text
        unspecified = completion_body(prompt=prompt)
        unspecified.pop("max_tokens", None)
        clamped = await client.post(COMPLETIONS, json=unspecified)
        assert clamped.status_code == 200, clamped.text
        assert clamped.json()["usage"]["completion_tokens"] <= 24
        full = await client.post(COMPLETIONS, json=completion_body(prompt=list(range(64))))
        assert_error(full, 400, param="prompt", code="context_length_exceeded")


async def test_tokenizing_a_huge_prompt_does_not_stall_the_event_loop(runner: EngineRunner) -> None:
    huge = "lorem ipsum dolor sit amet " * 200_000  # ~5 MB: seconds of tokenizing
    # Limits high enough that the body and the character bound let it through to the tokenizer.
    limits = {"max_prompt_tokens": 1_000_000, "max_body_bytes": 64 * 2**20}
    async with open_client(make_service(runner), **limits) as client:
        big = asyncio.create_task(
            client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": huge}]))
        )
        await asyncio.sleep(0.2)  # the request is being tokenized now
        latencies = []
        while not big.done():
            started = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.05)
        assert_error(await big, 400, param="messages", code="context_length_exceeded")
    assert latencies and max(latencies) < 0.5


def test_a_timeout_is_known_by_its_kind_not_by_its_words() -> None:
    """The request's own deadline is a 504; an engine failure whose message happens to say
    'timed out' (a stage's socket, a rank's collective) is still a 503."""
    deadline = TokenEvent(
        finish_reason=Finish.ERROR, error="request timed out after 2 s", failure=Failure.TIMEOUT
    )
    stage = TokenEvent(
        finish_reason=Finish.ERROR,
        error="pipeline stage 1 timed out reading a frame",
        failure=Failure.ENGINE,
    )
    assert failure_of(deadline).status == 504
    assert failure_of(stage).status == 503
