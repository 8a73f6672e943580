"""A live pp `tandem serve` with one agent: request log lines, `tandem status`, the dashboard's
SSE over HTTP, and the page in a real headless chromium."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.http_server import SHUTDOWN_GRACE_S
from engines.observability.request_timing import SEGMENTS
from tests.helpers.browser import Browser, find_browser
from tests.helpers.cluster import AgentPool, run_cli
from tests.helpers.serve import ServeProcess, start_serve

pytestmark = pytest.mark.cluster
MODEL_ID = "tandem-demo"
REQUESTS = 3
SCREENSHOT_ENV = "TANDEM_DASHBOARD_SCREENSHOT"  # also save the browser's screenshot here


@pytest.fixture(scope="module")
def live(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(server, agent, request log path): a two-stage pipeline on loopback."""
    root = tmp_path_factory.mktemp("live")
    pool = AgentPool(root / "agents")
    server: ServeProcess | None = None
    try:
        agent = pool.start("stage1", real_roles=True)
        request_log = root / "requests.log"
        server = start_serve(
            root,
            demo_model_dir,
            pool.cluster_key,
            ["--parallelism", "pp", "--model-id", MODEL_ID, "--request-log", str(request_log)],
        )
        yield server, agent, request_log
    finally:
        if server is not None:
            server.stop()
        pool.stop_all()


def post_chat(server: ServeProcess, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Hello over the pipeline"}],
        "max_tokens": max_tokens,
    }
    request = urllib.request.Request(
        server.base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def read_log(path: Path, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        time.sleep(0.1)
    pytest.fail(f"the request log has fewer than {count} lines after {timeout_s} s")


def test_every_request_leaves_a_log_line_with_its_breakdown(live: Any) -> None:
    server, _, request_log = live
    ids = {post_chat(server, max_tokens)["id"] for max_tokens in (2, 5, 9)}
    entries = [entry for entry in read_log(request_log, REQUESTS) if entry["id"] in ids]
    assert len(entries) == REQUESTS
    for entry in entries:
        assert entry["strategy"] == "pp" and entry["finish_reason"] == "length"
        assert entry["completion_tokens"] in (2, 5, 9)
        assert list(entry["segments_s"]) == list(SEGMENTS)
        assert sum(entry["segments_s"].values()) == pytest.approx(entry["duration_s"], abs=5e-5)
        assert "prompt" not in entry
        # the coordinator's layers, the agent's stage, sealing and the hops, from a real serve
        assert {"stage0", "stage1", "seal", "transit", "round_trip"} <= set(entry["engine_s"])
        assert entry["engine_s"]["stage1"] > 0 and entry["engine_s"]["seal"] > 0


def test_status_prints_the_cluster_at_a_glance(live: Any) -> None:
    server, agent, _ = live
    post_chat(server, 2)  # at least one step to time
    result = run_cli(["status", "--url", server.base_url, "--sample", "0.5"])
    assert result.returncode == 0, result.stderr
    assert "strategy  pp" in result.stdout
    assert "seal " in result.stdout  # the engine step timing line
    assert agent.node_id in result.stdout and "connected" in result.stdout
    assert "MODEL " not in result.stdout  # one model: no line for each
    refused = run_cli(["status", "--url", "http://127.0.0.1:9", "--sample", "0"])
    assert refused.returncode != 0 and "cannot reach" in refused.stderr


def test_the_dashboard_stream_delivers_updates_over_http(live: Any) -> None:
    server, agent, _ = live
    updates: list[dict[str, Any]] = []
    url = server.base_url + "/dashboard/events"
    with urllib.request.urlopen(url, timeout=10) as stream:  # the endless stream of a browser
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        data = None
        while len(updates) < 2:
            line = stream.readline().decode().rstrip("\n")
            if line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
            elif line == "" and data is not None:
                updates.append(data)
                data = None
    assert [update["sequence"] for update in updates] == [1, 2]
    assert agent.node_id in updates[-1]["fragments"]["members"]
    assert "pp stage 1" in updates[-1]["fragments"]["members"]
    models = updates[-1]["fragments"]["models"]  # the one model's row: its plan and nodes
    assert models.count("<tr data-model=") == 1 and f'data-model="{MODEL_ID}"' in models
    assert "<td>pp</td>" in models and agent.node_id in models


def test_the_dashboard_in_a_real_browser(live: Any, tmp_path: Path) -> None:
    binary = find_browser()
    if binary is None:
        pytest.skip("no chromium installed (apt-get install chromium): browser test not run")
    server, agent, _ = live
    post_chat(server, 6)  # a request for the "last requests" table
    browser = Browser(binary, tmp_path / "profile")
    try:
        browser.call("Page.navigate", url=server.base_url + "/")
        browser.wait_until("Number(document.body.dataset.updates) >= 2", timeout_s=20)
        text = browser.evaluate("document.body.innerText")
        strategy = browser.evaluate("document.getElementById('strategy').textContent")
        members = browser.evaluate(
            "[...document.querySelectorAll('.member')].map(m => m.dataset.node)"
        )
        live_label = browser.evaluate("document.getElementById('live').textContent")
        rows = browser.evaluate("document.querySelectorAll('table.requests tr').length")
        shot = browser.screenshot(tmp_path / "dashboard.png")
        if os.environ.get(SCREENSHOT_ENV):
            browser.screenshot(Path(os.environ[SCREENSHOT_ENV]))
    finally:
        browser.close()
    assert strategy == "pp"
    # other agents on this machine (other clusters) show up too, as unverified members
    assert members[0].endswith("coordinator") and agent.node_id in members
    assert "PASS" in text and "pp stage 0" in text
    assert live_label.startswith("live")
    assert rows >= 2  # the header and at least one request
    assert browser.console_errors == []
    assert shot.read_bytes().startswith(b"\x89PNG")


def test_shutdown_ends_an_open_dashboard_stream_at_once(live: Any) -> None:
    """Last in this module: it stops the server. An endless event stream must not hold up
    the shutdown for uvicorn's grace period."""
    server, _, _ = live
    with urllib.request.urlopen(server.base_url + "/dashboard/events", timeout=10) as stream:
        while not stream.readline().startswith(b"event: update"):
            pass
        began = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=SHUTDOWN_GRACE_S + 10)
        elapsed = time.monotonic() - began
        stream.read()  # the stream ended cleanly: no reset, no hang
    assert elapsed < SHUTDOWN_GRACE_S - 2, f"shutdown took {elapsed:.1f} s with a stream open"
