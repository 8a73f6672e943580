"""create_app(service): the one OpenAI-compatible FastAPI app, plus /health and /v1/cluster."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from ..service import Service
from . import chat, completions
from .auth import BearerKeyMiddleware
from .body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from .errors import (
    SERVER_FAILURE,
    UNAUTHORIZED,
    documented,
    install_error_handlers,
    model_not_found,
)
from .openapi import install_openapi
from .prompts import DEFAULT_MAX_PROMPT_TOKENS
from .schemas import ModelCard, ModelList


def create_app(
    service: Service,
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Build the app around `service`; nothing here touches mlx or blocks the event loop."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    # strict_content_type off: a JSON body without a Content-Type (curl -d ...) is still read.
    app = FastAPI(
        title="tandem",
        summary="One model served by a cluster, OpenAI-compatible.",
        strict_content_type=False,
    )
    install_error_handlers(app)
    app.add_middleware(FormBodyAsJsonMiddleware)
    if service.limits.api_key:
        app.add_middleware(BearerKeyMiddleware, api_key=service.limits.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # last added: outermost
    install_openapi(app, service)
    app.include_router(chat.create_router(service, max_prompt_tokens))
    app.include_router(completions.create_router(service, max_prompt_tokens))
    app.include_router(create_info_router(service))
    return app


def create_info_router(service: Service) -> APIRouter:
    router = APIRouter()
    started = int(time.time())

    def model_card() -> ModelCard:
        return ModelCard(id=service.model_id, created=started)

    @router.get("/v1/models", responses={**UNAUTHORIZED, **SERVER_FAILURE})
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @router.get(
        "/v1/models/{model_id:path}",
        responses={**UNAUTHORIZED, 404: documented("no such model"), **SERVER_FAILURE},
    )
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id != service.model_id:
            raise model_not_found(model_id, service.model_id)
        return model_card()

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
        status = service.health()
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
        return JSONResponse(service.cluster_status())

    return router


FORM_CONTENT_TYPE = b"application/x-www-form-urlencoded"


class FormBodyAsJsonMiddleware:
    """`curl -d '{...}'` labels a JSON body as a form; every body here is JSON, so read it so."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            scope = dict(scope)
            scope["headers"] = [
                (name, b"application/json")
                if name == b"content-type" and value.startswith(FORM_CONTENT_TYPE)
                else (name, value)
                for name, value in scope["headers"]
            ]
        await self.app(scope, receive, send)
