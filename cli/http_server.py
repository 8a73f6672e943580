"""uvicorn for `tandem serve`, telling the app the moment shutdown begins (endless streams end)."""

from __future__ import annotations

import threading
from types import FrameType
from typing import Any

import uvicorn

# After a shutdown signal, uvicorn waits this long for open responses (a generation still
# streaming) before it cuts them.
SHUTDOWN_GRACE_S = 5


class StoppingServer(uvicorn.Server):
    """Sets `stopping` on SIGINT/SIGTERM, before uvicorn waits for open responses: the
    dashboard's event streams watch it and end, so they never hold up the shutdown."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)


def run_http_server(app: Any, host: str, port: int, stopping: threading.Event) -> None:
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    StoppingServer(config, stopping).run()
