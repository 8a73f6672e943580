"""uvicorn for `tandem serve`: limits that keep idle and trickling clients from starving others,
and the app told the moment shutdown begins (endless streams end)."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .http_limits import HttpLimits

log = logging.getLogger(__name__)

# After a shutdown signal, uvicorn waits this long for open responses (a generation still
# streaming) before it cuts them.
SHUTDOWN_GRACE_S = 5
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's default)
SPARE_FILES = 256  # file descriptors kept for models, logs and the cluster's own sockets


class StoppingServer(uvicorn.Server):
    """Sets `stopping` on SIGINT/SIGTERM, before uvicorn waits for open responses: the
    dashboard's event streams watch it and end, so they never hold up the shutdown."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once it has shut down, and SIGTERM's default action
        # would end the process there, before the coordinator closes its engine, workers,
        # agents' sessions and caches; run() returns instead and the caller exits.
        self._captured_signals.clear()


def guarded_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline on each request's headers: uvicorn closes
    idle keep-alive connections, but not one that connects and sends nothing, or trickles its
    headers a byte at a time (slowloris); this closes those after `header_timeout_s`."""

    class GuardedHttpProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHttpProtocol


def raise_file_limit(wanted: int) -> None:
    """Let the process hold `wanted` open files where the hard limit allows (macOS's soft
    default is 256): past it accept() fails and every client is refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("open files limit raised from %d to %d", soft, target)


def run_http_server(
    app: Any, listener: socket.socket, stopping: threading.Event, limits: HttpLimits
) -> None:
    """Serve `app` on `listener`, bound at start-up (cli/public_address.py)."""
    raise_file_limit(limits.max_connections + SPARE_FILES)
    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=guarded_protocol(limits.header_timeout_s),
        # Past this many connections (or running requests) uvicorn answers 503 at once.
        limit_concurrency=limits.max_connections,
    )
    StoppingServer(config, stopping).run(sockets=[listener])
