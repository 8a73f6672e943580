"""The app's exception handlers: every error leaves the API as OpenAI-shaped JSON."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.api.errors import (
    SERVER_ERROR,
    APIError,
    describe_validation,
    engine_unavailable,
    error_body,
    overloaded,
    queue_full,
)
from engines.api.fields import refusal_of
from planner.errors import EngineError, OverloadedError, QueueFullError

log = logging.getLogger(__name__)


async def handle_api_error(_: Request, error: APIError) -> JSONResponse:
    return error.response()


async def handle_validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    message, param = describe_validation(error.errors())
    refusal = refusal_of(param)
    if refusal is not None:  # a field the schema only allows at its default
        return APIError(400, refusal, param=param, code="unsupported_parameter").response()
    return APIError(400, message, param=param, code="invalid_value").response()


async def handle_http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed"}
    api_error = APIError(
        error.status_code,
        str(error.detail),
        code=codes.get(error.status_code),
        headers=dict(error.headers or {}),
    )
    return api_error.response()


async def handle_queue_full(_: Request, error: QueueFullError) -> JSONResponse:
    return queue_full(error).response()


async def handle_engine_error(_: Request, error: EngineError) -> JSONResponse:
    return engine_unavailable(str(error)).response()


async def handle_overloaded(_: Request, error: OverloadedError) -> JSONResponse:
    return overloaded(error).response()


async def handle_unexpected(request: Request, error: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    body = error_body("internal server error; see the server log", type=SERVER_ERROR)
    return JSONResponse(body, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app as OpenAI-shaped JSON, never as a traceback."""
    # Starlette types handlers as taking `Exception`; each of ours takes the class it is
    # registered for, which is what Starlette passes.
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_exception_handler(QueueFullError, handle_queue_full)
    app.add_exception_handler(EngineError, handle_engine_error)
    app.add_exception_handler(OverloadedError, handle_overloaded)
    app.add_exception_handler(Exception, handle_unexpected)
