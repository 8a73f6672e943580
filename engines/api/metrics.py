"""Prometheus metrics: request counters and latency histograms by model, plus the live
cluster at scrape (cluster_metrics.py)."""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.api.cluster_metrics import MODEL_LABEL, ClusterCollector
from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry
from engines.observability.request_timing import REJECTED, SEGMENTS, RequestRecord, rejected_record

RECEIVED_AT = "tandem.received_at"  # key in the ASGI scope state: monotonic arrival time
SUBMITTED = "tandem.submitted"  # set in the scope state once the request reached the queue
OTHER_ROUTE = "other"  # unmatched paths share one label, so scanners cannot grow the series
# Paths answered before routing (a 401 from the key check) keep their name when they are
# these, or the dialects' generation routes.
KNOWN_PATHS = frozenset({"/v1/models", "/v1/cluster", "/metrics", "/", "/dashboard"})
ERROR_BODY_LIMIT = 4096  # bytes of an error response kept to find its message

FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SEGMENT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 120, 300)
TOKEN_KINDS = ("prompt", "completion", "cached")


class Metrics:
    """One registry per app (tests build many apps in one process), fed by the finished
    requests of every served model; each request series carries the request's model."""

    def __init__(self, served: Service | ServiceRegistry) -> None:
        self.models = served if isinstance(served, ServiceRegistry) else ServiceRegistry([served])
        self.registry = CollectorRegistry()
        registry = self.registry
        by_model = [MODEL_LABEL]
        self.http_requests = Counter(
            "tandem_http_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self.finished = Counter(
            "tandem_requests_finished",
            "Generations that ended, by finish reason (stop, length, cancelled, error)",
            [*by_model, "finish_reason"],
            registry=registry,
        )
        self.first_token = Histogram(
            "tandem_time_to_first_token_seconds",
            "HTTP request arrival to its first generated token",
            by_model,
            buckets=FIRST_TOKEN_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "tandem_inter_token_latency_seconds",
            "Mean gap between two generated tokens, one observation per request",
            by_model,
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "tandem_request_duration_seconds",
            "End-to-end latency of a generation: arrival to final event",
            by_model,
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.segments = Histogram(
            "tandem_request_segment_seconds",
            "Latency breakdown of a generation: " + ", ".join(SEGMENTS),
            [*by_model, "segment"],
            buckets=SEGMENT_BUCKETS,
            registry=registry,
        )
        self.engine_segments = Histogram(
            "tandem_request_engine_seconds",
            "A generation's share of the engine's step segments (tp all_sum, pp hops and "
            "sealing), summed over the steps that carried it; steps are shared by the batch",
            [*by_model, "segment"],
            buckets=SEGMENT_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "tandem_tokens",
            "Tokens of finished generations, by kind (" + ", ".join(TOKEN_KINDS) + ")",
            [*by_model, "kind"],
            registry=registry,
        )
        registry.register(ClusterCollector(self.models))
        self.models.listen(self.observe)

    def observe(self, record: RequestRecord) -> None:
        """A finished generation (scheduler thread): count it and its latencies."""
        model = record.model
        self.finished.labels(model, record.finish_reason).inc()
        if record.finish_reason == REJECTED:  # refused up front: no latency worth a histogram
            return
        self.tokens.labels(model, "prompt").inc(record.prompt_tokens)
        self.tokens.labels(model, "completion").inc(record.completion_tokens)
        self.tokens.labels(model, "cached").inc(record.cached_tokens)
        self.duration.labels(model).observe(record.duration_s)
        for segment, seconds in record.segments().items():
            self.segments.labels(model, segment).observe(seconds)
        for segment, seconds in record.engine_s:
            self.engine_segments.labels(model, segment).observe(seconds)
        if record.time_to_first_token_s is not None:
            self.first_token.labels(model).observe(record.time_to_first_token_s)
        if record.inter_token_s is not None:
            self.inter_token.labels(model).observe(record.inter_token_s)

    def render(self) -> tuple[bytes, str]:
        for service in self.models.all():
            self._create_series(service.model_id)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _create_series(self, model: str) -> None:
        """A served model's token and segment series, present from its first scrape at zero
        (a model loaded later gets them at the scrape after it)."""
        for kind in TOKEN_KINDS:
            self.tokens.labels(model, kind)
        for segment in SEGMENTS:
            self.segments.labels(model, segment)


class MetricsMiddleware:
    """Counts every answered HTTP request and stamps its arrival time for the latency breakdown.

    Plain ASGI, outermost, so streaming responses pass through untouched; the route label
    is the matched route's template (/v1/models/{model_id:path}), never the raw path, which
    needs every middleware inside this one to pass the scope on, not a copy. A refusal on one
    of `generation_routes` (the dialects') that never reached the queue is a rejected request.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, generation_routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self._generation_routes = generation_routes
        self._known_paths = KNOWN_PATHS | generation_routes

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
        refused = status >= 400 and not state.get(SUBMITTED)
        if refused and answer.get("route") in self._generation_routes:
            self._publish_rejection(arrived, status, answer["body"])

    def _route_of(self, scope: Scope) -> str:
        """The matched route's template (the router put it in the scope), or a known path."""
        route = getattr(scope.get("route"), "path", None)
        if route is None:
            path = scope.get("path", "")
            route = path if path in self._known_paths else OTHER_ROUTE
        return route

    def _publish_rejection(self, arrived: float, status: int, body: bytes) -> None:
        """A request refused before it was queued counts for the default model: the body
        naming its model was not read here (it may not even have been JSON)."""
        try:
            service = self.metrics.models.default
        except LookupError:  # no model is served: none to count it for
            return
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
