"""Prometheus metrics: request counters and latency histograms, plus the live cluster at scrape."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.core.service import Service
from engines.observability.process_memory import process_memory
from engines.observability.request_timing import REJECTED, SEGMENTS, RequestRecord, rejected_record

RECEIVED_AT = "tandem.received_at"  # key in the ASGI scope state: monotonic arrival time
SUBMITTED = "tandem.submitted"  # set in the scope state once the request reached the queue
OTHER_ROUTE = "other"  # unmatched paths share one label, so scanners cannot grow the series
GENERATION_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/responses",
        "/api/chat",
        "/api/generate",
    }
)
# Paths answered before routing (a 401 from the key check) keep their name when they are these.
KNOWN_PATHS = GENERATION_ROUTES | {"/v1/models", "/v1/cluster", "/metrics", "/", "/dashboard"}
ERROR_BODY_LIMIT = 4096  # bytes of an error response kept to find its message

FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SEGMENT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 120, 300)
# engine.info().detail["prefix_cache"] keys: counters grow, gauges go up and down
PREFIX_CACHE_COUNTERS = ("hits", "misses", "evictions", "disk_hits", "spills", "disk_failures")
PREFIX_CACHE_GAUGES = ("bytes", "entries", "disk_bytes", "disk_entries")
SPECULATION_COUNTERS = (  # engine.info().detail["speculation"] keys
    ("drafted", "Tokens drafted by prompt lookup for the model to check"),
    ("accepted", "Drafted tokens the model agreed with (each saved one decoding pass)"),
    ("steps", "Verifying passes (each checks one draft, or decodes plainly without one)"),
)
RUNNER_GAUGES = (  # (metric, help, EngineRunner attribute)
    ("tandem_queue_depth", "Requests waiting for a batch slot", "queued"),
    ("tandem_queue_capacity", "Waiting requests before 429 (--queue-size)", "queue_size"),
    ("tandem_active_sequences", "Sequences in the running batch", "active"),
    ("tandem_batch_capacity", "Largest running batch (--max-batch)", "max_batch"),
)


class Metrics:
    """One registry per app (tests build many apps in one process), fed by finished requests."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        registry = self.registry
        self.http_requests = Counter(
            "tandem_http_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.finished = Counter(
            "tandem_requests_finished",
            "Generations that ended, by finish reason (stop, length, cancelled, error)",
            ["finish_reason"],
            registry=registry,
        )
        self.first_token = Histogram(
            "tandem_time_to_first_token_seconds",
            "HTTP request arrival to its first generated token",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "tandem_inter_token_latency_seconds",
            "Mean gap between two generated tokens, one observation per request",
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "tandem_request_duration_seconds",
            "End-to-end latency of a generation: arrival to final event",
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.segments = Histogram(
            "tandem_request_segment_seconds",
            "Latency breakdown of a generation: " + ", ".join(SEGMENTS),
            ["segment"],
            buckets=SEGMENT_BUCKETS,
            registry=registry,
        )
        self.engine_segments = Histogram(
            "tandem_request_engine_seconds",
            "A generation's share of the engine's step segments (tp all_sum, pp hops and "
            "sealing), summed over the steps that carried it; steps are shared by the batch",
            ["segment"],
            buckets=SEGMENT_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "tandem_tokens",
            "Tokens of finished generations, by kind (prompt, completion, cached)",
            ["kind"],
            registry=registry,
        )
        for kind in ("prompt", "completion", "cached"):
            self.tokens.labels(kind)  # present from the first scrape, at zero
        for segment in SEGMENTS:
            self.segments.labels(segment)
        registry.register(ClusterCollector(service))
        service.request_listeners.append(self.observe)

    def observe(self, record: RequestRecord) -> None:
        """A finished generation (scheduler thread): count it and its latencies."""
        self.finished.labels(record.finish_reason).inc()
        if record.finish_reason == REJECTED:  # refused up front: no latency worth a histogram
            return
        self.tokens.labels("prompt").inc(record.prompt_tokens)
        self.tokens.labels("completion").inc(record.completion_tokens)
        self.tokens.labels("cached").inc(record.cached_tokens)
        self.duration.observe(record.duration_s)
        for segment, seconds in record.segments().items():
            self.segments.labels(segment).observe(seconds)
        for segment, seconds in record.engine_s:
            self.engine_segments.labels(segment).observe(seconds)
        if record.time_to_first_token_s is not None:
            self.first_token.observe(record.time_to_first_token_s)
        if record.inter_token_s is not None:
            self.inter_token.observe(record.inter_token_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ClusterCollector:
    """Read at every scrape: batch and queue, prefix cache, members, re-plans."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: its series depend on the cluster of the moment

    def collect(self) -> Iterator[Metric]:
        service = self.service
        runner = service.runner
        for name, documentation, attribute in RUNNER_GAUGES:
            value = getattr(runner, attribute) if runner is not None else 0
            yield GaugeMetricFamily(name, documentation, value=value)
        generated = CounterMetricFamily(
            "tandem_generated_tokens", "Tokens produced by the engine steps, live"
        )
        generated.add_metric([], service.generated_tokens)
        yield generated
        serving = GaugeMetricFamily(
            "tandem_serving", "1 for the service's current state", labels=["state"]
        )
        serving.add_metric([service.state], 1)
        yield serving
        if runner is not None:
            info = runner.engine.info()
            strategy = GaugeMetricFamily(
                "tandem_engine_info", "The running engine", labels=["strategy", "world_size"]
            )
            strategy.add_metric([info.strategy, str(info.world_size)], 1)
            yield strategy
            cache = info.detail.get("prefix_cache")
            if isinstance(cache, dict):
                yield from _prefix_cache(cache)
            speculation = info.detail.get("speculation")
            if isinstance(speculation, dict):
                yield from _speculation(speculation)
            timing = info.detail.get("step_timing")
            if isinstance(timing, dict):
                yield from _step_timing(timing)
        accounting = GaugeMetricFamily(
            "tandem_process_memory_bytes",
            "Each serving process's memory by kind (process: serve, or api and engine_core "
            "when the engine core runs apart): rss; mlx_active (= weights + prefix_cache + "
            "other_mlx: KV and scratch); mlx_cache; unaccounted (rss - mlx, its growth is a leak)",
            labels=["process", "kind"],
        )
        processes = runner.memory_accounting() if runner else {"serve": process_memory(None)}
        for process, memory in processes.items():
            for kind, value in memory.items():
                accounting.add_metric([process, kind], value)
        yield accounting
        status = _cluster_status(service)
        yield from _members(status.get("members") or [])
        replans = CounterMetricFamily(
            "tandem_replans", "Re-plans, by kind of reason", labels=["reason"]
        )
        for reason, count in (status.get("replans_by_reason") or {}).items():
            replans.add_metric([reason], count)
        yield replans


def _prefix_cache(cache: dict[str, Any]) -> Iterator[Metric]:
    for key in PREFIX_CACHE_COUNTERS:
        if isinstance(cache.get(key), int | float):
            family = CounterMetricFamily(f"tandem_prefix_cache_{key}", f"Prefix cache {key}")
            family.add_metric([], cache[key])
            yield family
    for key in PREFIX_CACHE_GAUGES:
        if isinstance(cache.get(key), int | float):
            yield GaugeMetricFamily(
                f"tandem_prefix_cache_{key}", f"Prefix cache {key} now", value=cache[key]
            )


def _speculation(counts: dict[str, Any]) -> Iterator[Metric]:
    """Speculative decoding's drafts (engines/speculation/lane.py SpeculationCounts)."""
    for key, documentation in SPECULATION_COUNTERS:
        family = CounterMetricFamily(f"tandem_speculation_{key}", documentation)
        family.add_metric([], counts.get(key) or 0)
        yield family


def _step_timing(timing: dict[str, Any]) -> Iterator[Metric]:
    """The engine's step histograms (engines/observability/step_timing.py StepTimes.snapshot)."""
    steps = CounterMetricFamily("tandem_engine_steps", "Engine steps timed (tp steps, pp frames)")
    steps.add_metric([], timing.get("steps") or 0)
    yield steps
    family = HistogramMetricFamily(
        "tandem_engine_step_seconds",
        "Seconds of each engine step segment, one observation per step (tp) or frame (pp)",
        labels=["segment"],
    )
    for segment, values in (timing.get("segments") or {}).items():
        buckets = [(str(bound), count) for bound, count in values["buckets"]]
        family.add_metric([segment], buckets, values["sum"])
    yield family


def _members(members: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["node"]
    age = GaugeMetricFamily(
        "tandem_member_heartbeat_age_seconds",
        "Seconds since the member's last heartbeat",
        labels=labels,
    )
    memory = GaugeMetricFamily(
        "tandem_member_memory_available_bytes", "Memory the member offers", labels=labels
    )
    connected = GaugeMetricFamily(
        "tandem_member_connected", "1 when the member is verified and heartbeating", labels=labels
    )
    worker = GaugeMetricFamily(
        "tandem_member_worker_up", "1 when the member's worker process is ready", labels=labels
    )
    tier = GaugeMetricFamily(
        "tandem_member_memory_tier", "1 for the member's memory tier", labels=["node", "tier"]
    )
    for member in members:
        if not isinstance(member, dict):  # a hand-written cluster status (tests) may list names
            continue
        node = [str(member.get("node_id"))]
        if member.get("last_heartbeat_age_s") is not None:
            age.add_metric(node, member["last_heartbeat_age_s"])
        memory.add_metric(node, member.get("memory_available") or 0)
        connected.add_metric(node, 1 if member.get("state") == "connected" else 0)
        worker.add_metric(node, 1 if member.get("worker_state") == "ready" else 0)
        if member.get("memory_tier"):
            tier.add_metric([*node, str(member["memory_tier"])], 1)
    yield from (age, memory, connected, worker, tier)


def _cluster_status(service: Service) -> dict[str, Any]:
    try:
        status = service.cluster_status()
    except Exception:  # a scrape must still answer with what it has
        return {}
    return status if isinstance(status, dict) else {}


class MetricsMiddleware:
    """Counts every answered HTTP request and stamps its arrival time for the latency breakdown.

    Plain ASGI, outermost, so streaming responses pass through untouched; the route label
    is the matched route's template (/v1/models/{model_id:path}), never the raw path, which
    needs every middleware inside this one to pass the scope on, not a copy.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.monotonic()
        state = scope.setdefault("state", {})
        state[RECEIVED_AT] = arrived
        answer: dict[str, Any] = {"body": b""}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = status = message["status"]
                answer["route"] = route = self._route_of(scope)
                self.metrics.http_requests.labels(route, scope.get("method", ""), status).inc()
            elif message["type"] == "http.response.body" and answer.get("status", 200) >= 400:
                answer["body"] = (answer["body"] + message.get("body", b""))[:ERROR_BODY_LIMIT]
            await send(message)

        await self.app(scope, receive, counting_send)
        status = answer.get("status", 0)
        if answer.get("route") in GENERATION_ROUTES and status >= 400 and not state.get(SUBMITTED):
            self._publish_rejection(arrived, status, answer["body"])

    @staticmethod
    def _route_of(scope: Scope) -> str:
        """The matched route's template (the router put it in the scope), or a known path."""
        route = getattr(scope.get("route"), "path", None)
        if route is None:
            path = scope.get("path", "")
            route = path if path in KNOWN_PATHS else OTHER_ROUTE
        return route

    def _publish_rejection(self, arrived: float, status: int, body: bytes) -> None:
        service = self.metrics.service
        runner = service.runner
        strategy = runner.engine.info().strategy if runner is not None else service.state
        record = rejected_record(
            arrived, status, _error_message(body, status), service.model_id, strategy
        )
        service.publish(record)


def _error_message(body: bytes, status: int) -> str:
    """An error body's message, in any dialect's shape (`{"error": {"message": ...}}`, or
    Ollama's `{"error": "..."}`); the bare status when the body is neither."""
    try:
        error = json.loads(body)["error"]
        message = error if isinstance(error, str) else error["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"
    return str(message)


def mark_submitted(scope: Scope) -> None:
    """The request reached the queue: its record comes from the scheduler, not the middleware."""
    state = scope.get("state")
    if isinstance(state, dict):
        state[SUBMITTED] = True


def received_at(scope: Scope) -> float | None:
    """When the middleware saw the request arrive (monotonic), if it did."""
    state = scope.get("state")
    return state.get(RECEIVED_AT) if isinstance(state, dict) else None
