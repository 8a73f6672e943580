"""Bad input and failures on the Ollama API: each a 4xx/5xx in Ollama's `{"error": "..."}`
shape with a message that says what to fix, and no engine touched."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import ollama
import pytest
from fastapi import FastAPI

from engines.api import create_app
from engines.core.runner import EngineRunner
from tests.helpers.api import (  # noqa: F401
    MODEL_ID,
    anyio_backend,
    make_service,
    open_client,
    start_runner,
    wait_idle,
)

pytestmark = pytest.mark.anyio
CHAT = "/api/chat"
GENERATE = "/api/generate"
HELLO = [{"role": "user", "content": "Hello there"}]
LONG = 3000  # tokens: seconds of generation, to keep the runner busy


@pytest.fixture(scope="module")
def runner(demo_model_dir: Any) -> Iterator[EngineRunner]:
    runner = start_runner(demo_model_dir, queue_size=8)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def app(runner: EngineRunner) -> FastAPI:
    """One app for the tables (building one takes a while on a busy machine)."""
    return create_app(make_service(runner), max_prompt_tokens=512)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
        yield client


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": HELLO, "stream": False, **fields}


def generate(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": "Once upon", "stream": False, **fields}


def assert_error(response: httpx.Response, status: int, *words: str) -> str:
    """Ollama's shape: one key, "error", a message naming what is wrong."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert "Traceback" not in body["error"]
    for word in words:
        assert word in body["error"], (word, body["error"])
    return body["error"]


SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
BAD_REQUESTS = [
    # wrong types and shapes
    (CHAT, chat(messages="hello"), 400, "messages"),
    (CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages.0.role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(options={"temperature": "hot"}), 400, "options.temperature"),
    (CHAT, chat(options={"num_predict": "ten"}), 400, "options.num_predict"),
    (CHAT, chat(options={"stop": [1]}), 400, "options.stop"),
    (CHAT, chat(options=[1]), 400, "options"),
    (CHAT, chat(format="xml"), 400, "format"),
    (CHAT, chat(think="extreme"), 400, "think"),
    (CHAT, chat(tools=[{"type": "function", "function": {"description": "x"}}]), 400, "name"),
    (CHAT, chat(model=""), 400, "model"),
    (CHAT, {"messages": HELLO}, 400, "model"),
    (CHAT, "{bad json", 400, "not valid JSON"),
    (CHAT, "[1, 2]", 400, "JSON object"),
    (GENERATE, generate(prompt=["a"]), 400, "prompt"),
    (GENERATE, generate(raw="no"), 400, "raw"),
    # values out of range, named by the option
    (CHAT, chat(options={"temperature": 5}), 400, "options.temperature"),
    (CHAT, chat(options={"top_p": 0}), 400, "options.top_p"),
    (CHAT, chat(options={"repeat_penalty": 0}), 400, "options.repeat_penalty"),
    (CHAT, chat(options={"stop": ["a", "b", "c", "d", "e"]}), 400, "options.stop"),
    (CHAT, chat(options={"num_predict": 0}), 400, "options.num_predict"),
    (CHAT, chat(options={"num_predict": 10**6}), 400, "options.num_predict"),
    (CHAT, chat(options={"num_ctx": 0}), 400, "options.num_ctx"),
    (CHAT, chat(options={"num_ctx": 4}), 400, "num_ctx=4"),  # the prompt alone fills it
    (GENERATE, generate(prompt="word " * 600), 400, "prompt"),  # past --context-tokens
    (CHAT, chat(format=SCHEMA), 400, "format"),
    # what tandem cannot do, said plainly
    (CHAT, chat(think=True), 400, "think"),  # the demo model does not think
    (CHAT, chat(messages=[{**HELLO[0], "images": ["aGk="]}]), 400, "messages.0.images"),
    (GENERATE, generate(images=["aGk="]), 400, "images"),
    (GENERATE, generate(suffix="return x"), 400, "suffix"),
    (GENERATE, generate(template="{{ .Prompt }}"), 400, "template"),
    (GENERATE, generate(context=[1, 2, 3]), 400, "context"),
    (CHAT, chat(model="llama3.2:8b"), 404, "llama3.2:8b"),
    (GENERATE, generate(model="tandem-demo:7b"), 404, "tandem-demo:latest"),
]


@pytest.mark.parametrize(("path", "body", "status", "word"), BAD_REQUESTS)
async def test_bad_input_gets_ollama_error(
    runner: EngineRunner,
    client: httpx.AsyncClient,
    path: str,
    body: Any,
    status: int,
    word: str,
) -> None:
    wait_idle(runner)
    generated = runner.generated_tokens
    if isinstance(body, str):
        response = await client.post(path, content=body)
    else:
        response = await client.post(path, json=body)
    assert_error(response, status, word)
    assert runner.idle and runner.generated_tokens == generated  # the engine never saw it


ROUTES = [
    ("POST", "/api/pull", 501, "pull"),
    ("POST", "/api/push", 501, "push"),
    ("POST", "/api/create", 501, "create"),
    ("POST", "/api/copy", 501, "copy"),
    ("DELETE", "/api/delete", 501, "delete"),
    ("POST", "/api/embed", 501, "embeddings"),
    ("POST", "/api/embeddings", 501, "embeddings"),
    ("POST", "/api/blobs/sha256:abc", 501, "blobs"),
    ("POST", "/api/unheard-of", 404, "POST /api/chat"),
    ("GET", "/api/chat", 405, "POST /api/chat"),
    ("POST", "/api/tags", 405, "GET /api/tags"),
]


@pytest.mark.parametrize(("method", "path", "status", "word"), ROUTES)
async def test_routes_tandem_does_not_serve(
    client: httpx.AsyncClient, method: str, path: str, status: int, word: str
) -> None:
    response = await client.request(method, path, json={"model": MODEL_ID})
    assert_error(response, status, word)


async def test_show_of_another_model_is_a_404(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/api/show", json={"model": "mistral"}), 404, "mistral")
    shown = await client.post("/api/show", json={"name": f"{MODEL_ID}:latest"})
    assert shown.status_code == 200  # Ollama's older field name


async def test_middleware_errors_take_ollama_shape(runner: EngineRunner) -> None:
    service = make_service(runner, api_key="s3cret")
    async with open_client(service, max_body_bytes=4096) as client:
        assert_error(await client.post(CHAT, json=chat()), 401, "API key")
        assert_error(await client.get("/api/tags"), 401, "API key")
        key = {"Authorization": "Bearer s3cret"}
        huge = chat(messages=[{"role": "user", "content": "word " * 2000}])
        assert_error(await client.post(CHAT, json=huge, headers=key), 413, "4096")
        assert (await client.get("/api/tags", headers=key)).status_code == 200
        # other routes keep their own shape
        assert set((await client.get("/v1/models")).json()["error"]) >= {"message", "type"}


async def test_no_engine_is_a_503(runner: EngineRunner) -> None:
    service = make_service(None, tokenizer=runner.engine.tokenizer)
    service.swap_runner(None, "starting", "loading the model")
    async with open_client(service) as client:
        assert_error(await client.post(CHAT, json=chat()), 503, "loading the model")
        assert_error(await client.post(GENERATE, json=generate()), 503, "loading the model")
        assert (await client.get("/api/ps")).json() == {"models": []}
        # the model to be served is listed, its details empty until an engine has loaded it
        [listed] = ollama.ListResponse(**(await client.get("/api/tags")).json()).models
        assert listed.model == f"{MODEL_ID}:latest" and listed.modified_at is None
        assert_error(await client.post("/api/show", json={}), 400, "model")


async def test_timeout_mid_stream_is_an_error_line(runner: EngineRunner) -> None:
    wait_idle(runner)
    async with open_client(make_service(runner, request_timeout_s=1.0)) as client:
        long = {"num_predict": LONG}
        assert_error(await client.post(CHAT, json=chat(options=long)), 504, "timed out")
        streamed = await client.post(CHAT, json=chat(options=long, stream=True))
    assert streamed.status_code == 200
    assert streamed.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    # the lines before (none on a machine too busy to prefill in time) are text, not done
    assert all(line["done"] is False for line in lines[:-1])
    assert set(lines[-1]) == {"error"} and "timed out" in lines[-1]["error"]


async def test_queue_full_is_a_429(demo_model_dir: Any) -> None:
    runner = start_runner(demo_model_dir, queue_size=1, max_batch=1)
    try:
        async with open_client(make_service(runner)) as client:
            long = chat(options={"num_predict": LONG})
            running = asyncio.create_task(client.post(CHAT, json=long))
            await wait_until(lambda: runner.active == 1)
            waiting = asyncio.create_task(client.post(GENERATE, json=generate(options=long)))
            await wait_until(lambda: runner.queued == 1)
            assert_error(await client.post(CHAT, json=chat()), 429, "queue")
            assert_error(await client.post(GENERATE, json=generate(stream=True)), 429, "queue")
            for task in (running, waiting):
                task.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
        await asyncio.to_thread(wait_idle, runner)
    finally:
        await asyncio.to_thread(runner.close)


async def wait_until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
