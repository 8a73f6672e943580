"""Errors in Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`,
the error types Anthropic's clients map by status, and the named-event SSE framing."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse
from starlette.responses import Response

from engines.api.errors import APIError
from engines.api.streaming import Framing

# Anthropic's error type for each status tandem answers with; statuses stay tandem's own
# (503 while no engine serves or memory is critical, as on every other route), which
# Anthropic's clients retry as they do 529.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
PING = {"type": "ping"}
# Named events; a ping goes out while nothing else did for a while (a long prefill).
ANTHROPIC_SSE = Framing("sse", f"event: ping\ndata: {json.dumps(PING)}\n\n")


def error_type(status: int) -> str:
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def error_payload(error: APIError) -> dict[str, object]:
    """The error as Anthropic writes it, in a body or in a stream's `error` event; with no
    `param` in this shape, the message names the field ("messages.0.content.1: ...")."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": error_type(error.status), "message": message}}


def render_error(error: APIError) -> Response:
    return JSONResponse(error_payload(error), status_code=error.status, headers=error.headers)
