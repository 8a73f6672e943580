"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: every route's
but the dialects' that have their own, and the statuses each kind of route documents."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response

from engines.api.errors import APIError
from engines.api.openai.schemas import ErrorResponse


def documented(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# The statuses each kind of route can answer, for the OpenAPI document (never 422: request
# validation failures are 400s, as OpenAI's).
UNAUTHORIZED = {401: documented("missing or wrong API key (only when the server has --api-key)")}
SERVER_FAILURE = {500: documented("internal server error")}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: documented("invalid or unsupported request field; `param` names it"),
    **UNAUTHORIZED,
    404: documented("the model is not the one this server serves"),
    413: documented("the request body is larger than --max-body-bytes"),
    429: documented("the request queue is full; retry later"),
    **SERVER_FAILURE,
    503: documented("no engine is serving (starting, re-planning, or shutting down)"),
    504: documented("the generation did not finish within --request-timeout"),
}


def error_body(error: APIError) -> dict[str, Any]:
    """The error as OpenAI writes it, in a body or in a stream's last `data:` line."""
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def render_error(error: APIError) -> Response:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)
