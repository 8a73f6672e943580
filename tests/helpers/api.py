"""Shared fixtures and helpers for the API tests: a real SingleEngine on the demo model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn

from discovery.framing import free_port
from engines.api import create_app
from engines.core.runner import EngineRunner
from engines.core.service import Service, ServiceLimits
from engines.core.service_registry import ServiceRegistry
from engines.single.engine import SingleEngine

MODEL_ID = "tandem-demo"
CLUSTER = {"strategy": "single", "members": ["127.0.0.1"], "reason": "world size 1"}
HELLO = [{"role": "user", "content": "Hello there"}]
LONG = 3000  # tokens: several seconds of generation on the demo model, to keep the runner busy
MB = 2**20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def start_runner(model_dir: Any, queue_size: int, max_batch: int = 16) -> EngineRunner:
    runner = EngineRunner(SingleEngine(model_dir), queue_size=queue_size, max_batch=max_batch)
    runner.start(load_timeout_s=120)
    return runner


@pytest.fixture(scope="module")
def runner(demo_model_dir: Any) -> Iterator[EngineRunner]:
    runner = start_runner(demo_model_dir, queue_size=8)
    yield runner
    runner.close()


@pytest.fixture(autouse=True)
def idle_runner(request: pytest.FixtureRequest) -> None:
    # A test that leaves work behind must not slow down (or fill the queue of) the next one.
    if "runner" in request.fixturenames:
        wait_idle(request.getfixturevalue("runner"))


def wait_idle(runner: EngineRunner, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not runner.idle:
        assert time.monotonic() < deadline, "the runner did not become idle"
        time.sleep(0.01)


def make_service(
    runner: EngineRunner | None, tokenizer: Any = None, model_id: str = MODEL_ID, **limits: Any
) -> Service:
    return Service(
        model_id=model_id,
        tokenizer=tokenizer if tokenizer is not None else runner.engine.tokenizer,
        limits=ServiceLimits(**limits),
        runner=runner,
        state="ok",
        cluster_status=lambda: dict(CLUSTER),
    )


@asynccontextmanager
async def open_client(
    served: Service | ServiceRegistry, **app_options: Any
) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(served, **app_options))
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
        yield client


@pytest.fixture
async def client(runner: EngineRunner) -> AsyncIterator[httpx.AsyncClient]:
    async with open_client(make_service(runner)) as client:
        yield client


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": HELLO, "max_tokens": 12, "temperature": 0, **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "prompt": "Once upon", "max_tokens": 12, "temperature": 0, **fields}


def parse_sse(text: str) -> list[Any]:
    """The data payloads of an SSE body, "[DONE]" kept as a string; comments skipped."""
    events = []
    for block in text.split("\n\n"):
        if not block or block.startswith(":"):
            continue
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: httpx.Response, status: int, **expected: Any) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    for key, value in expected.items():
        assert error[key] == value, (key, error)
    return error


# -- chat --------------------------------------------------------------------------------------


# Two tools for tool-calling requests: one with a parameter, one without.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@contextmanager
def served_app(
    model_dir: Path, max_body_bytes: int, max_prompt_tokens: int = 4096, engine: bool = False
) -> Iterator[tuple[str, psutil.Process]]:
    """tests/helpers/serve_api_only.py in a process of its own on a free port; stopped on exit."""
    port = free_port()
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "tests.helpers.serve_api_only",
        str(model_dir),
        str(port),
        str(max_body_bytes),
        str(max_prompt_tokens),
        *(["--engine"] if engine else []),
    ]
    process = subprocess.Popen(command, cwd=ROOT, env=environment)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "the test server exited"
            try:
                if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the test server did not come up"
            time.sleep(0.2)
        yield url, psutil.Process(process.pid)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def serve_on_loopback(app: Any) -> Iterator[str]:
    """`app` under a real uvicorn server in a thread on a free 127.0.0.1 port: its base URL.
    The server is stopped (and the stop checked) however the caller ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))  # a free port, held until uvicorn takes the socket
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()
        assert not thread.is_alive(), "uvicorn did not stop"
