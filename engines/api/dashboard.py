"""GET / (and /dashboard): the live cluster page; /dashboard/events streams its fragments (SSE)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from html import escape
from importlib import resources
from string import Template

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response
from starlette.responses import StreamingResponse

from engines.api import dashboard_view as view
from engines.api.errors import APIError
from engines.core.service import Service
from engines.observability.request_timing import RequestRecord

UPDATE_INTERVAL_S = 1.0
SAMPLE_INTERVAL_S = 0.9  # every viewer shares one sample per second
SAMPLES_KEPT = 120  # two minutes of charts
RECENT_REQUESTS = 20
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css"}
STATIC_FILES = ("dashboard.js", "dashboard.css")


class DashboardState:
    """What the page shows beyond /v1/cluster: recent requests and a short live history."""

    def __init__(
        self,
        service: Service,
        interval_s: float = UPDATE_INTERVAL_S,
        stopping: threading.Event | None = None,
    ) -> None:
        self.service = service
        self.interval_s = interval_s
        self.stopping = stopping or threading.Event()
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self.samples: deque[view.Sample] = deque(maxlen=SAMPLES_KEPT)
        service.request_listeners.append(self.recent.append)  # deque.append is thread-safe

    def sample(self) -> None:
        now = time.monotonic()
        if self.samples and now - self.samples[-1].at < min(SAMPLE_INTERVAL_S, self.interval_s):
            return
        runner = self.service.runner
        self.samples.append(
            view.Sample(
                at=now,
                generated_tokens=self.service.generated_tokens,
                queued=runner.queued if runner else 0,
                active=runner.active if runner else 0,
                capacity=runner.max_batch if runner else 0,
            )
        )

    def fragments(self) -> dict[str, str]:
        """Every section of the page, by element id."""
        self.sample()
        status = self.service.cluster_status()
        health = self.service.health()
        return {
            "summary": view.render_summary(status, health, self.service.model_id),
            "rules": view.render_rules(status),
            "members": view.render_members(status),
            "charts": view.render_charts(list(self.samples)),
            "requests": view.render_requests(list(self.recent)),
            "replans": view.render_replans(status),
            "predictions": view.render_predictions(status),
        }

    async def events(self, updates: int | None) -> AsyncIterator[str]:
        """SSE: one `update` event per interval, until the server stops (or `updates` times)."""
        sent = 0
        yield f"retry: {int(self.interval_s * 1000)}\n\n"
        while (updates is None or sent < updates) and not self.stopping.is_set():
            fragments = await asyncio.to_thread(self.fragments)  # cluster status takes locks
            sent += 1
            payload = json.dumps({"sequence": sent, "fragments": fragments})
            yield f"event: update\ndata: {payload}\n\n"
            if updates is None or sent < updates:
                await asyncio.sleep(self.interval_s)


def create_router(
    service: Service,
    interval_s: float = UPDATE_INTERVAL_S,
    stopping: threading.Event | None = None,
) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    state = DashboardState(service, interval_s, stopping)
    page = Template(_static_text("dashboard.html"))

    async def dashboard() -> HTMLResponse:
        fragments = await asyncio.to_thread(state.fragments)
        return HTMLResponse(page.substitute(title=_title(service), **fragments))

    router.add_api_route("/", dashboard, methods=["GET"])
    router.add_api_route("/dashboard", dashboard, methods=["GET"])

    @router.get("/dashboard/events")
    async def dashboard_events(updates: int | None = Query(None, ge=1)) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            state.events(updates), media_type="text/event-stream", headers=headers
        )

    @router.get("/dashboard/static/{name}")
    async def dashboard_static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no dashboard file {name!r}", code="not_found")
        media_type = STATIC_TYPES[name[name.rindex(".") :]]
        headers = {"Cache-Control": "max-age=300"}
        return Response(_static_text(name), media_type=media_type, headers=headers)

    return router


def _title(service: Service) -> str:
    return escape(f"tandem · {service.model_id}")


def _static_text(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")
