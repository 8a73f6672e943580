"""The chat page (/chat) in a real headless chromium against a uvicorn server with an API key,
on the thinking demo model: the key as the dashboard takes it, a streamed reply, stop (the
server cancels the generation), the markdown renderer (fed by hand: random weights write no
markdown), and a thought folded in <details>."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.api import create_app
from engines.core.runner import EngineRunner
from engines.observability.request_timing import RequestRecord
from tests.helpers.api import MODEL_ID, make_service, serve_on_loopback, start_runner, wait_idle
from tests.helpers.browser import Browser, find_browser

KEY = "chat-page-key"
SCREENSHOT_ENV = "TANDEM_CHAT_SCREENSHOT"  # also save the browser's screenshot here
LAST_REPLY = "[...document.querySelectorAll('.message.assistant')].at(-1)"
MARKDOWN = """## A heading
Some **bold**, *italic*, ~~gone~~ and `x < y` code.

- one
- two

1. first
2. second

> quoted

```python
print("<b>not bold</b>")
```
[a link](https://example.com/?a=1&b=2) and [a trap](javascript:alert(1))
<script>window.injected = 1</script><img src=x onerror="window.injected = 2">"""


@pytest.fixture(scope="module")
def runner(thinking_model_dir: Path) -> Iterator[EngineRunner]:
    runner = start_runner(thinking_model_dir, queue_size=4)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def records(runner: EngineRunner) -> list[RequestRecord]:
    return []


@pytest.fixture(scope="module")
def base_url(runner: EngineRunner, records: list[RequestRecord]) -> Iterator[str]:
    service = make_service(runner, api_key=KEY)
    service.request_listeners.append(records.append)
    with serve_on_loopback(create_app(service)) as url:
        yield url


@pytest.fixture(scope="module")
def page(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """The chat page, opened with the key as Basic auth, the key given to the page, ready."""
    binary = find_browser()
    if binary is None:
        pytest.skip("no chromium installed (apt-get install chromium): browser test not run")
    browser = Browser(binary, tmp_path_factory.mktemp("chat-browser") / "profile")
    try:
        # user:password in the address: chromium answers the page's Basic challenge with it
        browser.call("Page.navigate", url=base_url.replace("//", f"//tandem:{KEY}@") + "/chat")
        # the page cannot read the browser's Basic password: it asks for the key for /v1
        browser.wait_until("document.body.dataset.state === 'key'", timeout_s=20)
        browser.evaluate(
            f"document.getElementById('key').value = {json.dumps(KEY)};"
            "document.getElementById('key-form').requestSubmit()"
        )
        browser.wait_until("document.body.dataset.state === 'ready'", timeout_s=10)
        assert browser.evaluate("document.getElementById('key-form').offsetParent") is None
        yield browser
    finally:
        browser.close()


@pytest.fixture
def fresh(page: Browser, runner: EngineRunner) -> Browser:
    wait_idle(runner)
    page.evaluate("tandemChat.clear()")
    page.console_errors.clear()
    return page


def settle(page: Browser, thinking: bool, max_tokens: int) -> None:
    page.evaluate(
        f"document.getElementById('thinking').checked = {json.dumps(thinking)};"
        f"document.getElementById('max-tokens').value = '{max_tokens}';"
        "document.getElementById('temperature').value = '0'"
    )


def type_and_send(page: Browser, text: str) -> None:
    page.evaluate(
        f"document.getElementById('prompt').value = {json.dumps(text)};"
        "document.getElementById('send').click()"
    )


def greedy(base_url: str, messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    """The API's own non-streamed answer, for what the page should have shown."""
    body = {"model": MODEL_ID, "messages": messages, "temperature": 0, **fields}
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def test_the_page_takes_the_key_as_the_dashboard_does(base_url: str) -> None:
    page = httpx.get(f"{base_url}/chat")
    assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
    for path in ("/chat", "/chat/static/chat.js", "/chat/static/markdown.js"):
        assert httpx.get(base_url + path, auth=("anyone", KEY)).status_code == 200, path
    assert httpx.get(f"{base_url}/chat/static/nope.js", auth=("x", KEY)).status_code == 404
    # Basic is for the browser pages only: /v1 wants the key as Bearer
    assert httpx.get(f"{base_url}/v1/models", auth=("x", KEY)).status_code == 401
    dashboard = httpx.get(f"{base_url}/", auth=("x", KEY))
    assert 'href="/chat"' in dashboard.text


def test_a_reply_streams_in_and_the_conversation_is_kept(
    fresh: Browser, base_url: str, records: list[RequestRecord]
) -> None:
    settle(fresh, thinking=False, max_tokens=24)
    assert fresh.evaluate("document.getElementById('model').value") == MODEL_ID
    first = len(records)
    for text in ("Hello there", "And again"):
        type_and_send(fresh, text)
        fresh.wait_until("document.body.dataset.state === 'streaming'", timeout_s=5)
        fresh.wait_until("document.body.dataset.state === 'ready'", timeout_s=30)
        deltas = int(fresh.evaluate("document.body.dataset.deltas"))
        assert deltas >= 24  # a chunk per token at least, each drawn as it came
        note = fresh.evaluate(f"{LAST_REPLY}.querySelector('.note').textContent")
        assert note == "length · 24 tokens"
    conversation = fresh.evaluate("tandemChat.conversation")
    assert [turn["role"] for turn in conversation] == ["user", "assistant"] * 2
    # what the page shows is the API's own greedy answer to the same conversation
    expected = greedy(base_url, conversation[:3], max_tokens=24, reasoning_effort="none")
    assert conversation[3]["content"] == expected["content"]
    shown = fresh.evaluate(f"{LAST_REPLY}.querySelector('.content').innerHTML")
    assert shown == fresh.evaluate("tandemChat.renderMarkdown(tandemChat.conversation[3].content)")
    served = records[first : first + 2]
    assert served[1].prompt_tokens > served[0].prompt_tokens  # the first exchange went along
    assert fresh.console_errors == []


def test_stop_cancels_the_generation_on_the_server(
    fresh: Browser, runner: EngineRunner, records: list[RequestRecord]
) -> None:
    settle(fresh, thinking=False, max_tokens=3000)
    first = len(records)
    type_and_send(fresh, "Tell me a long story")
    fresh.wait_until("Number(document.body.dataset.deltas) >= 5", timeout_s=30)
    fresh.evaluate("document.getElementById('stop').click()")
    fresh.wait_until("document.body.dataset.state === 'ready'", timeout_s=10)
    assert fresh.evaluate(f"{LAST_REPLY}.querySelector('.note').textContent") == "stopped"
    deadline = time.monotonic() + 10
    while len(records) == first:
        assert time.monotonic() < deadline, "the server kept no record of the request"
        time.sleep(0.05)
    [record] = records[first:]
    assert record.finish_reason == "cancelled" and record.completion_tokens < 3000
    wait_idle(runner)
    # the partial reply stays in the conversation, as it was shown
    assert fresh.evaluate("tandemChat.conversation.at(-1).content")
    assert fresh.console_errors == []


def test_markdown_is_rendered_and_cannot_inject(fresh: Browser) -> None:
    fresh.evaluate(f"tandemChat.show({{role: 'assistant', content: {json.dumps(MARKDOWN)}}})")
    reply = f"{LAST_REPLY}.querySelector('.content')"

    def tags(selector: str) -> list[str]:
        return fresh.evaluate(
            f"[...{reply}.querySelectorAll({json.dumps(selector)})].map(e => e.textContent)"
        )

    assert tags("h2") == ["A heading"]
    assert tags("strong") == ["bold"] and tags("em") == ["italic"] and tags("del") == ["gone"]
    assert tags("p > code") == ["x < y"]
    assert tags("ul > li") == ["one", "two"] and tags("ol > li") == ["first", "second"]
    assert tags("blockquote") == ["quoted"]
    assert tags("pre > code.language-python") == ['print("<b>not bold</b>")']
    links = fresh.evaluate(
        f"[...{reply}.querySelectorAll('a')].map(a => [a.getAttribute('href'), a.rel])"
    )
    assert links == [["https://example.com/?a=1&b=2", "noopener noreferrer"]]
    # model output is text: no element it spelled out exists, no script of it ran
    assert tags("script, img, b") == []
    assert fresh.evaluate("window.injected === undefined")
    text = fresh.evaluate(f"{reply}.textContent")
    assert "<script>window.injected = 1</script>" in text and "a trap" in text
    # a reply cut inside a code fence (still streaming) is already a code block
    assert fresh.evaluate("tandemChat.renderMarkdown('```\\nx = 1')") == (
        "<pre><code>x = 1</code></pre>"
    )
    assert fresh.console_errors == []


def test_a_thought_is_shown_folded(fresh: Browser, base_url: str, tmp_path: Path) -> None:
    settle(fresh, thinking=True, max_tokens=16)
    type_and_send(fresh, "Hello there")
    fresh.wait_until("document.body.dataset.state === 'ready'", timeout_s=30)
    details = f"{LAST_REPLY}.querySelector('details')"
    assert fresh.evaluate(f"{details}.open") is False
    assert fresh.evaluate(f"{details}.querySelector('summary').textContent") == "thinking"
    thought = fresh.evaluate(f"{details}.querySelector('.thought').textContent")
    expected = greedy(base_url, [{"role": "user", "content": "Hello there"}], max_tokens=16)
    assert thought == expected["reasoning_content"] and expected["content"] == ""
    assert fresh.evaluate(f"{LAST_REPLY}.querySelector('.content').textContent") == ""
    fresh.evaluate(f"tandemChat.show({{role: 'assistant', content: {json.dumps(MARKDOWN)}}})")
    shot = fresh.screenshot(tmp_path / "chat.png")
    if os.environ.get(SCREENSHOT_ENV):
        fresh.screenshot(Path(os.environ[SCREENSHOT_ENV]))
    assert shot.read_bytes().startswith(b"\x89PNG")
    assert fresh.console_errors == []


def test_a_refused_request_is_shown_and_not_sent_again(fresh: Browser) -> None:
    settle(fresh, thinking=False, max_tokens=10**9)  # over the server's cap: a 400
    type_and_send(fresh, "Hello there")
    fresh.wait_until(f"!!{LAST_REPLY}.querySelector('.note.error')", timeout_s=10)
    note = fresh.evaluate(f"{LAST_REPLY}.querySelector('.note').textContent")
    assert note.startswith("error: ") and "max_tokens" in note
    assert fresh.evaluate("document.body.dataset.state") == "ready"
    assert fresh.evaluate("tandemChat.conversation") == []
    # the browser logs the 400 itself; the page threw nothing
    assert all("status of 400" in error for error in fresh.console_errors), fresh.console_errors
