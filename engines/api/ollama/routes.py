"""The dialect's routes (a skeleton until the dialect is written)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from engines.api.errors import APIError
from engines.core.service import Service

ERROR_PREFIX = "/api"


def render_error(error: APIError) -> Response:
    return error.response()


def create_router(service: Service, max_prompt_tokens: int) -> APIRouter:
    return APIRouter()
