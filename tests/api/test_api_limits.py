"""Limits before work: body size (413), prompt characters, messages; memory stays flat under a
burst of oversized requests against a served app on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from engines.api.common_schemas import MAX_MESSAGES
from engines.api.prompts import longest_token_chars
from engines.core.runner import EngineRunner
from tests.helpers.api import (  # noqa: F401
    MB,
    anyio_backend,
    assert_error,
    chat_body,
    client,
    completion_body,
    idle_runner,
    make_service,
    open_client,
    runner,
    served_app,
)

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BURST = 8  # concurrent 40 MB requests
RSS_BOUND = 64 * MB  # the served app may grow by at most this much over the whole burst


async def test_declared_oversized_body_is_413_unread(runner: EngineRunner) -> None:
    async with open_client(make_service(runner), max_body_bytes=1000) as client:
        body = chat_body(messages=[{"role": "user", "content": "x" * 2000}])
        error = assert_error(await client.post(CHAT, json=body), 413, code="request_too_large")
        assert "1000" in error["message"]
        assert (await client.post(CHAT, json=chat_body())).status_code == 200


async def test_chunked_oversized_body_is_413(runner: EngineRunner) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "tandem-demo", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 100

    async with open_client(make_service(runner), max_body_bytes=1000) as client:
        response = await client.post(CHAT, content=chunks())
        assert_error(response, 413, code="request_too_large")


async def test_prompt_characters_are_bounded_before_tokenizing(
    client: httpx.AsyncClient, runner: EngineRunner
) -> None:
    longest = longest_token_chars(runner.engine.tokenizer)
    text = "lorem ipsum " * 300_000  # 3.6 MB: seconds to tokenize, refused before that
    for path, body in (
        (CHAT, chat_body(messages=[{"role": "user", "content": text}])),
        (COMPLETIONS, completion_body(prompt=text)),
    ):
        started = time.monotonic()
        error = assert_error(
            await client.post(path, json=body), 400, code="context_length_exceeded"
        )
        assert time.monotonic() - started < 1.0
        assert str(32768 * longest) in error["message"]


async def test_messages_are_bounded(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    assert_error(await client.post(CHAT, json=chat_body(messages=messages)), 400, param="messages")


# -- a served app under a burst of 40 MB requests ------------------------------------------------


@pytest.fixture
def served(demo_model_dir: Path) -> Iterator[tuple[str, psutil.Process]]:
    with served_app(demo_model_dir, 4 * MB) as server:
        yield server


async def oversized_chat(
    url: str, size: int, expect_continue: bool = False
) -> tuple[int | None, float]:
    """Send a `size`-byte chat body in 1 MB pieces over a raw socket, reading the answer as it
    comes: (the final status, or None when the connection broke without one; seconds to it).

    A raw socket because an HTTP client gives up on a request whose upload the server cut
    short, and never shows the 413 that came first. With `expect_continue` the client asks
    first (`Expect: 100-continue`, as curl does for big bodies) and uploads only after a 100.
    """
    host, port = url.removeprefix("http://").split(":")
    opening = b'{"model": "tandem-demo", "messages": [{"role": "user", "content": "'
    closing = b'"}]}'
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n"
        + ("Expect: 100-continue\r\n" if expect_continue else "")
        + "\r\n"
    ).encode()
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))

    async def upload() -> None:
        writer.write(opening)
        filler = size - len(opening) - len(closing)
        for start in range(0, filler, MB):
            writer.write(b"x" * min(MB, filler - start))
            await writer.drain()
        writer.write(closing)
        await writer.drain()

    async def final_status() -> int | None:
        while True:
            parts = (await reader.readline()).split()
            if len(parts) < 2:
                return None
            if parts[1] != b"100":
                return int(parts[1])
            while (await reader.readline()).strip():  # the rest of the 100's head
                pass
            sending.append(asyncio.create_task(upload()))

    writer.write(head)
    sending = [] if expect_continue else [asyncio.create_task(upload())]
    try:
        status = await asyncio.wait_for(final_status(), timeout=30)
        return status, time.monotonic() - started
    except (ConnectionError, TimeoutError):
        return None, time.monotonic() - started
    finally:
        for task in sending:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, ConnectionError):
                pass
        writer.close()


def test_burst_of_40mb_requests_keeps_memory_flat(served: tuple[str, psutil.Process]) -> None:
    url, server = served

    async def burst() -> list[tuple[int | None, float]]:
        # Half ask before uploading (always see the 413), half upload blindly alongside.
        return await asyncio.gather(
            *(oversized_chat(url, 40 * MB, expect_continue=i % 2 == 0) for i in range(BURST))
        )

    async def near_limit() -> list[tuple[int | None, float]]:
        # Bodies just under the cap whose prompt the character bound refuses untokenized.
        return await asyncio.gather(*(oversized_chat(url, 4 * MB - 100) for _ in range(4)))

    asyncio.run(near_limit())  # warm up: the first parse of a big body sizes the allocator
    before = server.memory_info().rss
    results = asyncio.run(burst())
    statuses = [status for status, _ in results]
    # The server answers from the headers and closes; a client still uploading may see the
    # connection reset before it reads the 413 (TCP drops unread data), never another status.
    # One that asked first never uploads, so it always reads the 413.
    assert set(statuses) <= {413, None}, results
    assert all(status == 413 for status in statuses[::2]), results
    assert max(seconds for _, seconds in results) < 2.0, results
    refused = asyncio.run(near_limit())
    assert all(status == 400 for status, _ in refused), refused
    grown = server.memory_info().rss - before
    print(f"server RSS {before / MB:.0f} MB -> +{grown / MB:.1f} MB over {BURST} x 40 MB")
    assert grown < RSS_BOUND
