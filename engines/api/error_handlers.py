"""The app's exception handlers: every error leaves the API as JSON in the shape of the
dialect whose path it answers (the default dialect's where none claims the path)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from engines.api.dialect import Dialects
from engines.api.errors import (
    SERVER_ERROR,
    APIError,
    describe_validation,
    engine_unavailable,
    overloaded,
    queue_full,
)
from errors import EngineError, OverloadedError, QueueFullError

log = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI, dialects: Dialects) -> None:
    """Every error leaves the app as its dialect's JSON, never as a traceback."""

    def render(request: Request, error: APIError) -> Response:
        return dialects.response(request.url.path, error)

    async def handle_api_error(request: Request, error: APIError) -> Response:
        return render(request, error)

    async def handle_validation_error(request: Request, error: RequestValidationError) -> Response:
        message, param = describe_validation(error.errors())
        refusal = dialects.refusal_of(request.url.path, param)
        if refusal is not None:  # a field the schema only allows at its default
            refused = APIError(400, refusal, param=param, code="unsupported_parameter")
            return render(request, refused)
        return render(request, APIError(400, message, param=param, code="invalid_value"))

    async def handle_http_error(request: Request, error: StarletteHTTPException) -> Response:
        codes = {404: "not_found", 405: "method_not_allowed"}
        api_error = APIError(
            error.status_code,
            str(error.detail),
            code=codes.get(error.status_code),
            headers=dict(error.headers or {}),
        )
        return render(request, api_error)

    async def handle_queue_full(request: Request, error: QueueFullError) -> Response:
        return render(request, queue_full(error))

    async def handle_engine_error(request: Request, error: EngineError) -> Response:
        return render(request, engine_unavailable(str(error)))

    async def handle_overloaded(request: Request, error: OverloadedError) -> Response:
        return render(request, overloaded(error))

    async def handle_unexpected(request: Request, error: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
        internal = APIError(500, "internal server error; see the server log", type=SERVER_ERROR)
        return render(request, internal)

    # Starlette types handlers as taking `Exception`; each of ours takes the class it is
    # registered for, which is what Starlette passes.
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_exception_handler(QueueFullError, handle_queue_full)
    app.add_exception_handler(EngineError, handle_engine_error)
    app.add_exception_handler(OverloadedError, handle_overloaded)
    app.add_exception_handler(Exception, handle_unexpected)
