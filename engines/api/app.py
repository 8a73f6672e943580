"""create_app(service): the one OpenAI-compatible FastAPI app, plus /health, /v1/cluster,
/metrics, the dashboard and the chat page."""

from __future__ import annotations

import threading
import time
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from engines.api import (
    anthropic,
    chat_page,
    dashboard,
    model_admin,
    ollama,
    openai,
    responses,
)
from engines.api.auth import PROTECTED_PREFIXES, BearerKeyMiddleware
from engines.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from engines.api.dialect import Dialects
from engines.api.error_handlers import install_error_handlers
from engines.api.errors import model_not_found
from engines.api.metrics import Metrics, MetricsMiddleware
from engines.api.model_admin import ModelLoader, card_of
from engines.api.openai.errors import SERVER_FAILURE, UNAUTHORIZED, documented
from engines.api.openai.schemas import ModelCard, ModelList
from engines.api.openapi import install_openapi
from engines.api.prompts import DEFAULT_MAX_PROMPT_TOKENS
from engines.api.shared_path import shared_path_route
from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry

METRICS_PATH = "/metrics"
DASHBOARD_PATHS = ("/", "/dashboard", chat_page.PAGE_PATH)  # the browser pages
# Every dialect the API speaks, their routes in this order; OpenAI's error shape is the one
# of every path no dialect claims (/health, the pages).
DIALECTS = Dialects(
    (openai.DIALECT, anthropic.DIALECT, responses.DIALECT, ollama.DIALECT),
    default=openai.DIALECT,
)


def create_app(
    served: Service | ServiceRegistry,
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    metrics_open: bool = False,
    dashboard_open: bool = False,
    dashboard_interval_s: float = dashboard.UPDATE_INTERVAL_S,
    stopping: threading.Event | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_loader: ModelLoader | None = None,
) -> FastAPI:
    """Build the app around `service`; nothing here touches mlx or blocks the event loop.

    With an API key, /metrics and the dashboard need it too unless `metrics_open` /
    `dashboard_open` leave them open (a trusted network). Once `stopping` is set (the server
    is shutting down) the dashboard's endless event streams end. Bodies over
    `max_body_bytes` get 413 before they are read in full. With `model_loader`, models
    are loaded and unloaded at run time (POST and DELETE /v1/models).
    """
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    models = served if isinstance(served, ServiceRegistry) else ServiceRegistry([served])
    service = models.default  # limits are the server's, the same for every model
    # strict_content_type off: a JSON body without a Content-Type (curl -d ...) is still read.
    app = FastAPI(
        title="tandem",
        summary="One model served by a cluster, OpenAI-compatible.",
        strict_content_type=False,
    )
    install_error_handlers(app, DIALECTS)
    metrics = Metrics(models)
    install_middlewares(
        app,
        metrics,
        service.limits.api_key,
        metrics_open=metrics_open,
        dashboard_open=dashboard_open,
        max_body_bytes=max_body_bytes,
    )
    install_openapi(app, service, None if model_loader is not None else models.ids())
    for dialect in DIALECTS.served:
        app.include_router(dialect.router(models, max_prompt_tokens))
    app.include_router(create_info_router(models, loads=model_loader is not None))
    if model_loader is not None:  # serve's; an app around fixed models has none
        app.include_router(model_admin.create_router(models, model_loader))
    app.include_router(dashboard.create_router(models, dashboard_interval_s, stopping))
    app.include_router(chat_page.create_router(service))
    add_metrics_route(app, metrics)
    return app


def install_middlewares(
    app: FastAPI,
    metrics: Metrics,
    api_key: str | None,
    *,
    metrics_open: bool,
    dashboard_open: bool,
    max_body_bytes: int,
) -> None:
    """Each middleware added wraps those before it: the key check and the body limit answer
    before the body is read, in the dialect of the path; the metrics, outermost, count
    their refusals too."""
    app.add_middleware(FormBodyAsJsonMiddleware)
    if api_key:
        app.add_middleware(
            BearerKeyMiddleware,
            api_key=api_key,
            prefixes=PROTECTED_PREFIXES + (() if metrics_open else (METRICS_PATH,)),
            browser_paths=() if dashboard_open else DASHBOARD_PATHS,
            dialects=DIALECTS,
        )
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, dialects=DIALECTS)
    app.add_middleware(
        MetricsMiddleware, metrics=metrics, generation_routes=DIALECTS.generation_paths()
    )


def add_metrics_route(app: FastAPI, metrics: Metrics) -> None:
    @app.get(METRICS_PATH, include_in_schema=False)
    async def scrape() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


def create_info_router(models: ServiceRegistry, loads: bool = False) -> APIRouter:
    """/v1/models and /v1/models/{id} (with `loads`, model_admin answers POST and DELETE on
    them: their 405s allow those too), /health and /v1/cluster."""
    router = _status_router(models)
    for model_router in _model_routers(models, loads):
        router.include_router(model_router)
    return router


def _model_routers(models: ServiceRegistry, loads: bool) -> tuple[APIRouter, APIRouter]:
    """GET /v1/models and GET /v1/models/{id}, each on a path of its own that `loads` shares
    with model_admin's POST or DELETE."""
    listing = APIRouter(route_class=shared_path_route(("GET", "POST") if loads else ("GET",)))
    one = APIRouter(route_class=shared_path_route(("GET", "DELETE") if loads else ("GET",)))
    started = int(time.time())

    def model_card(service: Service) -> ModelCard:
        return card_of(service, started)

    @listing.get("/v1/models", responses={**UNAUTHORIZED, **SERVER_FAILURE})
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(service) for service in models.all()])

    @one.get(
        "/v1/models/{model_id:path}",
        responses={**UNAUTHORIZED, 404: documented("no such model"), **SERVER_FAILURE},
    )
    async def retrieve_model(model_id: str) -> ModelCard:
        service = models.find(model_id)
        if service is None:
            raise model_not_found(model_id, models.describe_ids())
        return model_card(service)

    return listing, one


def _status_router(models: ServiceRegistry) -> APIRouter:
    """/health (200 when serving, else 503) and /v1/cluster (the plan and members)."""
    router = APIRouter()

    @router.get(
        "/health",
        response_model=None,
        responses={
            200: {"description": "serving", "content": {"application/json": {}}},
            503: {"description": "starting or degraded", "content": {"application/json": {}}},
            **SERVER_FAILURE,
        },
    )
    async def health() -> JSONResponse:
        status = server_health(models)
        return JSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)

    @router.get(
        "/v1/cluster",
        response_model=None,
        responses={
            200: {"description": "the plan and members", "content": {"application/json": {}}},
            **UNAUTHORIZED,
            **SERVER_FAILURE,
        },
    )
    async def cluster() -> JSONResponse:
        return JSONResponse(cluster_status(models))

    return router


HEALTHY = ("ok", "unloaded")  # an unloaded model loads when a request names it


def server_health(models: ServiceRegistry) -> dict[str, Any]:
    """The default model's health; with several models each one's under "models". The
    server is "ok" while every model is ok or unloaded; else the first that is not says why
    (a model loading or re-planning does not answer)."""
    services = models.all()
    if not services:
        return {"status": "ok", "reason": "no model is served", "models": {}}
    each = {service.model_id: service.health() for service in services}
    first = each[services[0].model_id]
    status = dict(first)
    if len(services) > 1:
        status["models"] = each
    worst = next((h for h in each.values() if h["status"] not in HEALTHY), None)
    if worst is None:
        status["status"] = "ok"
    elif worst is not first:
        status |= {"status": worst["status"], "reason": f"{worst['model']}: {worst['reason']}"}
    return status


def cluster_status(models: ServiceRegistry) -> dict[str, Any]:
    """The /v1/cluster body: the default model's, and with several, each one's by id."""
    services = models.all()
    if not services:
        return {"state": "ok", "state_reason": "no model is served", "models": {}}
    status = services[0].cluster_status()
    if len(services) > 1:
        status["models"] = {service.model_id: service.cluster_status() for service in services}
    return status


FORM_CONTENT_TYPE = b"application/x-www-form-urlencoded"


class FormBodyAsJsonMiddleware:
    """`curl -d '{...}'` labels a JSON body as a form; every body here is JSON, so read it so."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            # In place, not a copy: the metrics middleware reads the matched route from it.
            scope["headers"] = [
                (name, b"application/json")
                if name == b"content-type" and value.startswith(FORM_CONTENT_TYPE)
                else (name, value)
                for name, value in scope["headers"]
            ]
        await self.app(scope, receive, send)
