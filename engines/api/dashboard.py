"""GET / (and /dashboard): the live cluster page; /dashboard/events streams its fragments (SSE).

It lists every served model; the sections below show the default model (the first)."""

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
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response
from starlette.responses import StreamingResponse

from engines.api import dashboard_view as view
from engines.api.errors import APIError
from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry
from engines.observability.request_timing import RequestRecord

UPDATE_INTERVAL_S = 1.0
SAMPLE_INTERVAL_S = 0.9  # every viewer shares one sample per second
SAMPLES_KEPT = 120  # two minutes of charts
RECENT_REQUESTS = 20
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css"}
STATIC_FILES = ("dashboard.js", "dashboard.css")


class DashboardState:
    """What the page shows beyond /v1/cluster: recent requests of every model and a short
    live history of the default one."""

    def __init__(
        self,
        models: ServiceRegistry,
        interval_s: float = UPDATE_INTERVAL_S,
        stopping: threading.Event | None = None,
    ) -> None:
        self.models = models
        self.interval_s = interval_s
        self.stopping = stopping or threading.Event()
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self.samples: deque[view.Sample] = deque(maxlen=SAMPLES_KEPT)
        models.listen(self.recent.append)  # deque.append is thread-safe

    def sample(self, service: Service) -> None:
        now = time.monotonic()
        if self.samples and now - self.samples[-1].at < min(SAMPLE_INTERVAL_S, self.interval_s):
            return
        runner = service.runner
        self.samples.append(
            view.Sample(
                at=now,
                generated_tokens=service.generated_tokens,
                queued=runner.queued if runner else 0,
                active=runner.active if runner else 0,
                capacity=runner.max_batch if runner else 0,
            )
        )

    def fragments(self) -> dict[str, str]:
        """Every section of the page, by element id."""
        services = self.models.all()
        looks = [(service, service.cluster_status(), service.health()) for service in services]
        rows = [model_row(*look) for look in looks]
        if looks:
            default, status, health = looks[0]
            self.sample(default)
            model = default.model_id
        else:
            status, health, model = {}, {"status": "ok", "reason": "no model is served"}, "—"
        return {
            "summary": view.render_summary(status, health, model),
            "models": view.render_models(rows),
            "rules": view.render_rules(status),
            "members": view.render_members(status),
            "charts": view.render_charts(list(self.samples)),
            "requests": view.render_requests(list(self.recent), by_model=len(services) > 1),
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


def model_row(service: Service, status: dict[str, Any], health: dict[str, Any]) -> view.ModelRow:
    """A model's line in the Models section: its state, its plan, its runner's load."""
    return view.ModelRow(
        model_id=service.model_id,
        state=str(health.get("status", service.state)),
        reason=str(health.get("reason") or ""),
        strategy=status.get("strategy"),
        nodes=tuple(map(str, (status.get("plan") or {}).get("ranks") or ())),
        active=int(health.get("active", 0)),
        capacity=int(health.get("max_batch", 0)),
        queued=int(health.get("queued", 0)),
        generated_tokens=service.generated_tokens,
    )


def create_router(
    served: Service | ServiceRegistry,
    interval_s: float = UPDATE_INTERVAL_S,
    stopping: threading.Event | None = None,
) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    models = served if isinstance(served, ServiceRegistry) else ServiceRegistry([served])
    state = DashboardState(models, interval_s, stopping)
    page = Template(_static_text("dashboard.html"))

    async def dashboard() -> HTMLResponse:
        fragments = await asyncio.to_thread(state.fragments)
        return HTMLResponse(page.substitute(title=_title(models), **fragments))

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


def _title(models: ServiceRegistry) -> str:
    return escape(f"tandem · {', '.join(models.ids()) or 'no model'}")


def _static_text(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")
