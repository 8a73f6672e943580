"""Metrics, the request record and log, and the dashboard stream, on a real SingleEngine."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.main import build_parser
from engines.api import create_app
from engines.api.cluster_metrics import MODEL_LABEL, Families, add_prefix_cache
from engines.api.dashboard_view import render_members
from engines.cluster.cluster_status import engine_status
from engines.core.runner import EngineRunner
from engines.core.service_registry import ServiceRegistry
from engines.observability.request_log import RequestLog, RequestLogSettings
from engines.observability.request_timing import SEGMENTS, RequestRecord
from tests.helpers.api import (
    CLUSTER,
    HELLO,
    LONG,
    MODEL_ID,
    anyio_backend,  # noqa: F401
    client,  # noqa: F401
    idle_runner,  # noqa: F401
    make_service,
    open_client,
    runner,  # noqa: F401
    serve_on_loopback,
    start_runner,
    wait_idle,
)

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
ROUNDING_S = 1e-5  # the log rounds every duration to the microsecond


def scrape_text(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


async def scrape(client: Any) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return scrape_text(response.text)


def chat(max_tokens: int = 6, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL_ID, "messages": HELLO, "max_tokens": max_tokens, "stream": stream}
    return body | extra


@pytest.fixture(scope="module")
def second_runner(demo_model_factory: Callable[..., Path]) -> Iterator[EngineRunner]:
    """A second model beside `runner`'s (2 layers, other weights): two models served at once."""
    second = start_runner(demo_model_factory(layers=2, seed=7), queue_size=8)
    yield second
    second.close()


def two_models(first: EngineRunner, second: EngineRunner) -> ServiceRegistry:
    """Model "a" on the demo model and "b" on the second, each planned on a node of its own."""
    services = []
    for model_id, each, node in (("a", first, "node-a"), ("b", second, "node-b")):
        service = make_service(each, model_id=model_id)
        status = CLUSTER | {"state": "ok", "plan": {"ranks": [node]}, "members": []}
        # as the supervisor's status: the plan's nodes, the running engine's batch
        service.cluster_status = lambda status=status, each=each: (
            status | {"engine": engine_status(each)}
        )
        services.append(service)
    return ServiceRegistry(services)


async def test_metrics_move_as_requests_flow(runner: Any) -> None:
    service = make_service(runner)
    async with open_client(service) as client:
        before = await scrape(client)
        completion_tokens = 0
        for max_tokens in (4, 7):
            response = await client.post(CHAT, json=chat(max_tokens))
            assert response.status_code == 200
            completion_tokens += response.json()["usage"]["completion_tokens"]
        streamed = await client.post(CHAT, json=chat(5, stream=True))
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        assert (await client.post(CHAT, json=chat(0))).status_code == 400
        assert (await client.get("/no/such/page")).status_code == 404
        after = await scrape(client)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    ok = "tandem_http_requests_total{method=POST,route=/v1/chat/completions,status=200}"
    assert delta(ok) == 3
    assert delta(ok.replace("200", "400")) == 1
    assert delta("tandem_http_requests_total{method=GET,route=other,status=404}") == 1
    model = f"model={MODEL_ID}"  # one model served: its series carry its id all the same
    assert delta(f"tandem_requests_finished_total{{finish_reason=length,{model}}}") == 3
    assert delta(f"tandem_tokens_total{{kind=completion,{model}}}") == completion_tokens + 5
    assert delta(f"tandem_tokens_total{{kind=prompt,{model}}}") > 0
    assert delta(f"tandem_tokens_total{{kind=cached,{model}}}") == 0
    assert delta(f"tandem_request_duration_seconds_count{{{model}}}") == 3
    assert delta(f"tandem_time_to_first_token_seconds_count{{{model}}}") == 3
    assert delta(f"tandem_inter_token_latency_seconds_count{{{model}}}") == 3
    for segment in SEGMENTS:
        assert delta(f"tandem_request_segment_seconds_count{{{model},segment={segment}}}") == 3
    segments = sum(
        delta(f"tandem_request_segment_seconds_sum{{{model},segment={s}}}") for s in SEGMENTS
    )
    duration = delta(f"tandem_request_duration_seconds_sum{{{model}}}")
    assert segments == pytest.approx(duration, abs=1e-6)
    assert delta(f"tandem_generated_tokens_total{{{model}}}") >= completion_tokens + 5
    assert after[f"tandem_batch_capacity{{{model}}}"] == runner.max_batch
    assert after[f"tandem_queue_capacity{{{model}}}"] == runner.queue_size
    assert after[f"tandem_serving{{{model},state=ok}}"] == 1
    assert after[f"tandem_engine_info{{{model},strategy=single,world_size=1}}"] == 1


async def test_active_sequences_and_queue_show_a_running_request(runner: Any) -> None:
    service = make_service(runner)
    async with open_client(service) as client:
        task = asyncio.create_task(client.post(CHAT, json=chat(LONG)))
        deadline = time.monotonic() + 10
        while runner.active == 0:
            assert time.monotonic() < deadline, "the long request never started"
            await asyncio.sleep(0.02)
        during = await scrape(client)
        for submission in runner.running():
            submission.cancel()
        assert (await task).status_code == 503  # the generation ended "cancelled"
    wait_idle(runner)
    assert during[f"tandem_active_sequences{{model={MODEL_ID}}}"] == 1
    assert during[f"tandem_queue_depth{{model={MODEL_ID}}}"] == 0


@pytest.mark.parametrize(
    ("options", "metrics_status", "dashboard_status"),
    [({}, 401, 401), ({"metrics_open": True, "dashboard_open": True}, 200, 200)],
)
async def test_metrics_and_dashboard_follow_the_api_key(
    runner: Any, options: dict[str, bool], metrics_status: int, dashboard_status: int
) -> None:
    service = make_service(runner, api_key="sesame")
    async with open_client(service, **options) as client:
        assert (await client.get("/metrics")).status_code == metrics_status
        page = await client.get("/")
        assert page.status_code == dashboard_status
        if dashboard_status == 401:  # a browser prompts for the key as a Basic password
            assert page.headers["www-authenticate"].startswith("Basic")
        bearer = {"Authorization": "Bearer sesame"}
        assert (await client.get("/metrics", headers=bearer)).status_code == 200
        basic = "Basic " + base64.b64encode(b"operator:sesame").decode()
        assert (await client.get("/", headers={"Authorization": basic})).status_code == 200
        wrong = "Basic " + base64.b64encode(b"operator:guess").decode()
        status = (await client.get("/dashboard", headers={"Authorization": wrong})).status_code
        assert status == dashboard_status
        assert (await client.get("/v1/models")).status_code == 401  # the API itself stays shut
        assert (await client.get("/health")).status_code == 200


async def test_every_request_leaves_one_log_line_whose_segments_add_up(
    runner: Any, tmp_path: Path
) -> None:
    service = make_service(runner)
    records: list[RequestRecord] = []
    service.request_listeners.append(records.append)
    log_path = tmp_path / "requests.log"
    request_log = RequestLog(RequestLogSettings(path=log_path), tokenizer=lambda model: None)
    service.request_listeners.append(request_log.write)
    walls: dict[str, float] = {}
    try:
        async with open_client(service) as client:

            async def timed(body: dict[str, Any]) -> None:
                began = time.monotonic()
                response = await client.post(CHAT, json=body)
                assert response.status_code == 200
                walls[response.json()["id"]] = time.monotonic() - began

            await asyncio.gather(*(timed(chat(n)) for n in (3, 9, 17, 1)))
    finally:
        request_log.close()
    lines = log_path.read_text().splitlines()
    assert len(lines) == len(records) == 4
    for line in lines:
        entry = json.loads(line)
        assert set(entry) >= {"id", "model", "strategy", "finish_reason", "error", "segments_s"}
        assert "prompt" not in entry and "Hello" not in line
        assert entry["model"] == MODEL_ID and entry["strategy"] == "single"
        assert list(entry["segments_s"]) == list(SEGMENTS)
        parts = sum(entry["segments_s"].values())
        assert parts == pytest.approx(entry["duration_s"], abs=4 * ROUNDING_S)
        # the server's duration lies inside what the client measured around it
        assert entry["duration_s"] <= walls[entry["id"]] + ROUNDING_S
        assert walls[entry["id"]] - entry["duration_s"] < 0.5
        assert entry["time_to_first_token_s"] <= entry["duration_s"] + ROUNDING_S
        assert entry["segments_s"]["prefill"] > 0 and entry["segments_s"]["parse"] > 0
        assert entry["completion_tokens"] in (1, 3, 9, 17)


async def test_a_request_refused_up_front_leaves_one_rejected_record(runner: Any) -> None:
    service = make_service(runner, api_key="sesame")
    records: list[RequestRecord] = []
    service.request_listeners.append(records.append)
    key = {"Authorization": "Bearer sesame"}
    async with open_client(service) as client:
        assert (await client.post(CHAT, json=chat(0), headers=key)).status_code == 400
        assert (await client.post(CHAT, json=chat(2))).status_code == 401
        assert (await client.post(CHAT, json=chat(2), headers=key)).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401  # not a generation
        metrics = scrape_text((await client.get("/metrics", headers=key)).text)
    invalid, unauthorized, served = records
    assert (invalid.finish_reason, invalid.http_status) == ("rejected", 400)
    assert "max_tokens" in (invalid.error or "") and invalid.request_id == ""
    assert (unauthorized.http_status, unauthorized.error) == (401, unauthorized.error)
    assert "Authorization" in (unauthorized.error or "")
    assert served.finish_reason == "length" and served.http_status is None
    for record in records:
        assert record.duration_s == pytest.approx(sum(record.segments().values()))
    assert invalid.to_dict()["id"] is None and invalid.to_dict()["http_status"] == 400
    model = f"model={MODEL_ID}"  # refused before its model was known: the default model
    assert metrics[f"tandem_requests_finished_total{{finish_reason=rejected,{model}}}"] == 2
    assert metrics[f"tandem_request_duration_seconds_count{{{model}}}"] == 1  # rejections out
    route = "tandem_http_requests_total{method=POST,route=/v1/chat/completions,status=401}"
    assert metrics[route] == 1


async def test_the_log_carries_the_prompt_only_when_asked(runner: Any, tmp_path: Path) -> None:
    service = make_service(runner)
    settings = RequestLogSettings(path=tmp_path / "with-prompts.log", include_prompt=True)
    request_log = RequestLog(settings, tokenizer=lambda model: service.tokenizer)
    service.request_listeners.append(request_log.write)
    try:
        async with open_client(service) as client:
            body = {"model": MODEL_ID, "prompt": "the quick brown fox", "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    finally:
        request_log.close()
    (entry,) = [json.loads(line) for line in settings.path.read_text().splitlines()]
    assert "the quick brown fox" in entry["prompt"]
    assert not logging.getLogger("tandem.requests").propagate


async def test_a_cancelled_request_is_logged_with_its_queue_and_prefill_time(runner: Any) -> None:
    service = make_service(runner)
    records: list[RequestRecord] = []
    service.request_listeners.append(records.append)
    async with open_client(service) as client:
        task = asyncio.create_task(client.post(CHAT, json=chat(LONG, stream=True)))
        deadline = time.monotonic() + 10
        while runner.active == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        for submission in runner.running():
            submission.cancel()
        await task
    wait_idle(runner)
    (record,) = records
    assert record.finish_reason == "cancelled"
    assert record.duration_s == pytest.approx(sum(record.segments().values()))
    assert record.queue_s >= 0 and record.prefill_s > 0


async def test_the_dashboard_stream_delivers_updates(runner: Any) -> None:
    service = make_service(runner)
    async with open_client(service, dashboard_interval_s=0.05) as client:
        page = await client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert '<b id="strategy">' in page.text and "/dashboard/static/dashboard.js" in page.text
        script = await client.get("/dashboard/static/dashboard.js")
        assert script.status_code == 200 and "EventSource" in script.text
        assert (await client.get("/dashboard/static/secret.py")).status_code == 404
        done = await client.post(CHAT, json=chat(3))
        events = await client.get("/dashboard/events", params={"updates": 3})
    assert events.headers["content-type"].startswith("text/event-stream")
    updates = [
        json.loads(block.split("data: ", 1)[1])
        for block in events.text.split("\n\n")
        if block.startswith("event: update")
    ]
    assert [update["sequence"] for update in updates] == [1, 2, 3]
    last = updates[-1]["fragments"]
    sections = {"summary", "rules", "members", "charts", "requests", "replans", "predictions"}
    sections.add("models")
    assert set(last) == sections
    assert done.json()["id"][-8:] in last["requests"]
    assert "tokens/s" in last["charts"]


def test_member_and_prefix_cache_metrics(runner: Any) -> None:
    from engines.api.metrics import Metrics

    status = {
        "members": [
            {
                "node_id": "m1",
                "state": "connected",
                "memory_available": 1024,
                "memory_tier": "roomy",
                "last_heartbeat_age_s": 0.25,
                "worker_state": "ready",
            },
            {"node_id": "m2", "state": "lost", "memory_available": 0, "worker_state": None},
        ],
        "replans_by_reason": {"member_lost": 2},
    }
    service = make_service(runner)
    service.cluster_status = lambda: status
    values = scrape_text(Metrics(service).render()[0].decode())
    model = f"model={MODEL_ID}"
    assert values[f"tandem_member_heartbeat_age_seconds{{{model},node=m1}}"] == 0.25
    assert values[f"tandem_member_memory_available_bytes{{{model},node=m1}}"] == 1024
    assert values[f"tandem_member_memory_tier{{{model},node=m1,tier=roomy}}"] == 1
    assert values[f"tandem_member_worker_up{{{model},node=m1}}"] == 1
    assert values[f"tandem_member_worker_up{{{model},node=m2}}"] == 0
    assert values[f"tandem_member_connected{{{model},node=m2}}"] == 0
    assert values[f"tandem_replans_total{{{model},reason=member_lost}}"] == 2
    cache = {"hits": 5, "misses": 2, "bytes": 4096, "entries": 3, "evictions": 1}
    families = Families()
    add_prefix_cache(families, "demo", cache)
    names = {family.name: family.samples[0].value for family in families}
    assert {family.samples[0].labels[MODEL_LABEL] for family in families} == {"demo"}
    assert names == {
        "tandem_prefix_cache_hits": 5,
        "tandem_prefix_cache_misses": 2,
        "tandem_prefix_cache_evictions": 1,
        "tandem_prefix_cache_bytes": 4096,
        "tandem_prefix_cache_entries": 3,
    }
    nothing = Families()
    add_prefix_cache(nothing, "demo", {"hits": "n/a"})
    assert list(nothing) == []


async def test_process_memory_accounts_for_the_weights_next_to_rss(runner: Any) -> None:
    files = Path(runner.engine.model_path).glob("*.safetensors")
    model_bytes = sum(file.stat().st_size for file in files)
    async with open_client(make_service(runner)) as client:
        memory = {
            key.split("kind=")[1].split(",")[0]: value
            for key, value in (await scrape(client)).items()
            if key.startswith("tandem_process_memory_bytes{")
            and key.endswith(f",model={MODEL_ID},process=serve}}")
        }
    # float32 demo weights: what the engine holds is what the files hold, give or take headers
    assert abs(memory["weights"] - model_bytes) < 0.05 * model_bytes
    assert memory["mlx_active"] >= memory["weights"] + memory["prefix_cache"]
    assert memory["mlx_active"] == memory["weights"] + memory["prefix_cache"] + memory["other_mlx"]
    assert memory["rss"] == memory["mlx_active"] + memory["mlx_cache"] + memory["unaccounted"]
    accounting = {"serve": memory}
    html = render_members({"coordinator": {"node_id": "c", "memory_accounting": accounting}})
    rss, weights = int(memory["rss"]) >> 20, int(memory["weights"]) >> 20
    assert f"serve: RSS {rss} MB = weights {weights}" in html


async def test_two_models_each_have_their_series_their_row_and_their_requests(
    runner: Any, second_runner: EngineRunner
) -> None:
    models = two_models(runner, second_runner)
    completion = {"a": 0, "b": 0}
    async with open_client(models, dashboard_interval_s=0.05) as client:
        before = await scrape(client)
        for model_id, max_tokens in (("a", 3), ("a", 4), ("b", 5)):
            answer = await client.post(CHAT, json=chat(max_tokens, model=model_id))
            assert answer.status_code == 200, answer.text
            completion[model_id] += answer.json()["usage"]["completion_tokens"]
        after = await scrape(client)
        events = await client.get("/dashboard/events", params={"updates": 1})
        removed = models.remove("b")
        assert removed is not None
        without_b = await scrape(client)
        models.add(removed)  # loaded again: its live series are back at the next scrape
        with_b = await scrape(client)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    for model_id, requests in (("a", 2), ("b", 1)):
        model = f"model={model_id}"
        assert delta(f"tandem_requests_finished_total{{finish_reason=length,{model}}}") == requests
        assert delta(f"tandem_request_duration_seconds_count{{{model}}}") == requests
        assert delta(f"tandem_tokens_total{{kind=completion,{model}}}") == completion[model_id]
        assert delta(f"tandem_generated_tokens_total{{{model}}}") >= completion[model_id]
        assert after[f"tandem_serving{{{model},state=ok}}"] == 1
        assert after[f"tandem_engine_info{{{model},strategy=single,world_size=1}}"] == 1
    assert after["tandem_batch_capacity{model=b}"] == second_runner.max_batch
    ok = "tandem_http_requests_total{method=POST,route=/v1/chat/completions,status=200}"
    assert delta(ok) == 3  # the HTTP counters stay the server's, unlabelled
    assert "tandem_serving{model=b,state=ok}" not in without_b
    assert "tandem_serving{model=a,state=ok}" in without_b
    assert with_b["tandem_serving{model=b,state=ok}"] == 1
    assert with_b["tandem_requests_finished_total{finish_reason=length,model=b}"] == 1

    (update,) = [
        json.loads(block.split("data: ", 1)[1])
        for block in events.text.split("\n\n")
        if block.startswith("event: update")
    ]
    fragments = update["fragments"]
    rows = fragments["models"]
    assert rows.index('data-model="a"') < rows.index('data-model="b"')
    assert rows.count("<td>single</td>") == 2
    assert "<td>node-a</td>" in rows and "<td>node-b</td>" in rows
    assert f'<td class="num">0/{second_runner.max_batch}</td>' in rows
    requests = fragments["requests"]
    assert "<th>model</th>" in requests
    assert requests.count("<td>a</td>") == 2 and requests.count("<td>b</td>") == 1
    assert '<b id="strategy">single</b>' in fragments["summary"]  # the default model, "a"


def test_status_lists_every_model_beside_the_server_totals(
    runner: Any, second_runner: EngineRunner, capsys: pytest.CaptureFixture[str]
) -> None:
    models = two_models(runner, second_runner)
    with serve_on_loopback(create_app(models)) as url:
        for model_id in ("a", "b"):
            answer = httpx.post(url + CHAT, json=chat(3, model=model_id), timeout=60)
            assert answer.status_code == 200, answer.text
        args = build_parser().parse_args(["status", "--url", url, "--sample", "0"])
        assert args.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("MODEL ")))
    assert [line.split()[:4] for line in lines[header + 1 : header + 3]] == [
        ["a", "ok", "single", "node-a"],
        ["b", "ok", "single", "node-b"],
    ]
    assert lines[header + 2].endswith(f"0/{second_runner.max_batch} active, 0 queued")
    assert "(of a, the default model)" in lines[1]
    (traffic,) = [line for line in lines if line.startswith("traffic ")]
    assert "2 requests (length 2)" in traffic  # the server's: both models' requests
