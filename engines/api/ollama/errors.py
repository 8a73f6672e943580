"""Errors in Ollama's shape: `{"error": "message"}`, with the status."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.responses import Response

from engines.api.errors import APIError


def render_error(error: APIError) -> Response:
    """The message names the field to fix, since the shape has no `param` of its own."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return JSONResponse({"error": message}, status_code=error.status, headers=error.headers)
