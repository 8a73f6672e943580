"""A cap on request bodies: 413 before an oversized body is read, whatever its framing."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.api.dialect import Dialects
from engines.api.errors import APIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyLimitMiddleware:
    """Plain ASGI, outermost: a declared Content-Length over the cap is refused from the
    headers alone; a chunked body is counted as it arrives and refused at the first byte over.

    Either way no more than `max_bytes` of a body is ever held, and the app never sees an
    oversized one.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        *,
        dialects: Dialects,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"the body limit must be at least 1 byte, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self._dialects = dialects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"{size} bytes")
                return
            await self.app(scope, receive, send)
            return
        # No length declared (chunked): buffer up to the cap, then replay to the app.
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (
            f"the request body ({size}) is larger than the {self.max_bytes} bytes this server "
            "accepts (--max-body-bytes)"
        )
        error = APIError(413, message, code="request_too_large", headers={"Connection": "close"})
        await self._dialects.response(scope["path"], error)(scope, receive, send)
