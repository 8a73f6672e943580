"""Thinking over the Ollama API, with the official client on the thinking demo model: the thought
comes back as `thinking` (chat's message, generate's top level), never in the content;
think false turns it off; a thought passed back reaches the prompt.

Random weights never close a thought (engines/model/demo_tokenizer.py), so with thinking on
everything generated is thinking."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from engines.api import create_app
from engines.core.runner import EngineRunner
from tests.helpers.api import anyio_backend, make_service, start_runner, wait_idle  # noqa: F401

pytestmark = pytest.mark.anyio
MODEL = "tandem-demo"
HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def runner(thinking_model_dir: Path) -> Iterator[EngineRunner]:
    runner = start_runner(thinking_model_dir, queue_size=8)
    yield runner
    runner.close()


@pytest.fixture
async def client(runner: EngineRunner) -> AsyncIterator[ollama.AsyncClient]:
    wait_idle(runner)
    transport = httpx.ASGITransport(app=create_app(make_service(runner)))
    yield ollama.AsyncClient(host="http://tandem.test", transport=transport)


async def streamed(client: ollama.AsyncClient, **fields: Any) -> tuple[str, str, Any]:
    """(thinking, content, final object) of a streamed chat."""
    parts = [part async for part in await client.chat(MODEL, HELLO, stream=True, **fields)]
    thinking = "".join(part.message.thinking or "" for part in parts)
    content = "".join(part.message.content or "" for part in parts)
    return thinking, content, parts[-1]


async def test_a_thought_is_thinking_never_content(client: ollama.AsyncClient) -> None:
    whole = await client.chat(MODEL, HELLO, options=GREEDY)
    assert whole.message.thinking and whole.message.content == ""
    assert "<think>" not in whole.message.thinking and whole.eval_count == 8
    thinking, content, final = await streamed(client, options=GREEDY)
    assert (thinking, content) == (whole.message.thinking, "")
    assert final.done_reason == "length" and final.eval_count == 8
    # think true asks for what the template does anyway
    assert (await client.chat(MODEL, HELLO, think=True, options=GREEDY)).message == whole.message
    generated = await client.generate(MODEL, "Once upon", options=GREEDY)
    assert generated.thinking and generated.response == ""
    parts = [
        p async for p in await client.generate(MODEL, "Once upon", stream=True, options=GREEDY)
    ]
    assert "".join(p.thinking or "" for p in parts) == generated.thinking
    assert "".join(p.response for p in parts) == ""


async def test_think_false_gives_content_only(client: ollama.AsyncClient) -> None:
    whole = await client.chat(MODEL, HELLO, think=False, options=GREEDY)
    assert whole.message.content and whole.message.thinking is None
    thinking, content, final = await streamed(client, think=False, options=GREEDY)
    assert (thinking, content) == ("", whole.message.content) and final.eval_count == 8
    generated = await client.generate(MODEL, "Once upon", think=False, options=GREEDY)
    assert generated.response and generated.thinking is None


async def test_a_thought_passed_back_is_in_the_prompt(client: ollama.AsyncClient) -> None:
    thought = "The user greets me; greet back."
    turns = [
        *HELLO,
        {"role": "assistant", "content": "Hi.", "thinking": thought},
        {"role": "user", "content": "And again"},
    ]
    without = [{**turn, "thinking": None} for turn in turns]
    counted = [
        (await client.chat(MODEL, m, options=GREEDY)).prompt_eval_count for m in (turns, without)
    ]
    assert counted[0] >= counted[1] + 5


async def test_show_says_the_model_thinks(client: ollama.AsyncClient) -> None:
    assert "thinking" in (await client.show(MODEL)).capabilities
