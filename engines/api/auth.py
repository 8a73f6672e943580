"""Optional bearer-key check in front of /v1: checked before the body is read or validated."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError

PROTECTED_PREFIX = "/v1"


class BearerKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        supplied = dict(scope["headers"]).get(b"authorization")
        if supplied is not None and hmac.compare_digest(supplied, self._expected):
            await self.app(scope, receive, send)
            return
        message = (
            "missing Authorization header; send 'Authorization: Bearer <key>'"
            if supplied is None
            else "invalid API key"
        )
        error = APIError(
            401,
            message,
            code="invalid_api_key",
            type="authentication_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
