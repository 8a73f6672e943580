"""HttpLimits: how long a request's headers may take, how many connections are served at once."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """How long a request's headers may take, and how many connections are served at once."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
