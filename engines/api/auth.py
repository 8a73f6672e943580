"""Optional API-key check in front of /v1 and /api: checked before the body is read or
validated. The key comes as `Authorization: Bearer <key>` or, as Anthropic's clients send it,
`x-api-key: <key>`."""

from __future__ import annotations

import base64
import binascii
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from engines.api.dialect import Dialects
from engines.api.errors import APIError

PROTECTED_PREFIXES = ("/v1", "/api")


class BearerKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        prefixes: tuple[str, ...] = PROTECTED_PREFIXES,
        browser_paths: tuple[str, ...] = (),
        *,
        dialects: Dialects,
    ) -> None:
        """`prefixes` need the key; `browser_paths` (also protected, exact or as a prefix)
        accept it as the password of HTTP Basic auth too, so a browser can prompt for it."""
        self.app = app
        self._key = api_key.encode()
        self._expected = f"Bearer {api_key}".encode()
        self._prefixes = prefixes
        self._browser_paths = browser_paths
        self._dialects = dialects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        browser = any(_under(path, prefix) for prefix in self._browser_paths)
        if not browser and not any(_under(path, prefix) for prefix in self._prefixes):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        supplied = headers.get(b"authorization")
        key_header = headers.get(b"x-api-key")
        if (key_header is not None and hmac.compare_digest(key_header, self._key)) or (
            supplied is not None
            and (
                hmac.compare_digest(supplied, self._expected)
                or (browser and hmac.compare_digest(_basic_password(supplied), self._key))
            )
        ):
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            if supplied is None and key_header is None
            else "invalid API key"
        )
        error = APIError(
            401,
            message,
            code="invalid_api_key",
            type="authentication_error",
            headers={"WWW-Authenticate": 'Basic realm="tandem"' if browser else "Bearer"},
        )
        await self._dialects.response(path, error)(scope, receive, send)


def _under(path: str, prefix: str) -> bool:
    """`path` is `prefix` or below it ("/" matches only itself)."""
    return path == prefix or (prefix != "/" and path.startswith(prefix + "/"))


def _basic_password(header: bytes) -> bytes:
    """The password of `Basic base64(user:password)`; empty when the header is not that."""
    scheme, _, encoded = header.partition(b" ")
    if scheme.lower() != b"basic":
        return b""
    try:
        decoded = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return b""
    return decoded.partition(b":")[2]
