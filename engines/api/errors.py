"""APIError, the one exception every route raises to answer with an error status, and the
errors the dialects share; each dialect writes them in its own shape."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from starlette.responses import Response

from errors import OverloadedError, QueueFullError

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


# pydantic names union members in error locations ("str", "list[TextPart]"); a user never
# typed those, so they are dropped from the `param` we report.
_UNION_TAGS = {"str", "int", "float", "bool"}


class APIError(Exception):
    """An error the API reports as `{"error": {...}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


ErrorRenderer = Callable[[APIError], Response]


def queue_full(error: QueueFullError) -> APIError:
    return APIError(429, str(error), type="rate_limit_error", code="queue_full")


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, type=SERVER_ERROR, code="engine_unavailable")


def overloaded(error: OverloadedError) -> APIError:
    headers = {"Retry-After": str(error.retry_after_s)}
    return APIError(503, str(error), type=SERVER_ERROR, code="memory_pressure", headers=headers)


def model_not_found(requested: str, served: str, param: str = "model") -> APIError:
    """`served`: what is served, quoted ('a', or 'a' and 'b': ServiceRegistry.describe_ids)."""
    message = (
        f"the model '{requested}' does not exist; this server serves {served} "
        "(--model-alias gives it other names)"
    )
    return APIError(404, message, param=param, code="model_not_found")


def generation_timeout(message: str) -> APIError:
    return APIError(504, message, type="timeout_error", code="timeout")


def describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The (message, param) for pydantic errors: the deepest one names the field to fix."""
    if not errors:
        return "invalid request", None
    found = [(_param_of(error.get("loc", ())), error) for error in errors]
    depth = max(len(path) for path, _ in found)
    deepest = [(path, error) for path, error in found if len(path) == depth]
    path = deepest[0][0]
    param = ".".join(str(part) for part in path) or None
    first = deepest[0][1]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error")
        return "the request body is not valid JSON" + (f": {reason}" if reason else ""), None
    if not path:
        return "the request body must be a JSON object (Content-Type: application/json)", None
    if first.get("type") == "missing":
        return f"'{param}' is required", param
    if first.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: '{param}'", param
    messages = dict.fromkeys(_plain_message(error) for p, error in deepest if p == path)
    return f"invalid value for '{param}': {' or '.join(messages)}", param


def _param_of(loc: Sequence[Any]) -> tuple[Any, ...]:
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    return tuple(part for part in parts if not _is_union_tag(part))


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        "[" in part
        or part in _UNION_TAGS
        or part[:1].isupper()
        or part.startswith("constrained-")  # an Annotated member: "constrained-str"
    )


def _plain_message(error: Any) -> str:
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ")
