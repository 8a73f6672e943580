"""One role worker subprocess: payload in on stdin, JSON events out on stdout, stopped by group."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from discovery.json_child import JsonChild

logger = logging.getLogger(__name__)

STOP_GRACE_S = 3.0


class RoleWorker:
    """One worker subprocess: payload as the first stdin line, JSON events on stdout.

    stdin stays open while the agent lives, so a worker can treat EOF as "the agent is gone".
    """

    def __init__(
        self,
        assignment_id: str,
        role: str,
        command: list[str],
        on_event: Callable[[RoleWorker, dict[str, Any]], None],
        on_exit: Callable[[RoleWorker, int, str], None],
    ) -> None:
        self.assignment_id = assignment_id
        self.role = role
        self.command = command
        self.state = "starting"
        self._on_event = on_event
        self._on_exit = on_exit
        self._stopping = threading.Event()
        self._stopped_since: float | None = None
        # Its own process group, so stop() reaches the worker's own children too.
        self._child = JsonChild(
            command,
            name=f"{role} worker",
            own_group=True,
            keep_messages=False,
            on_message=self._relay_message,
            on_exit=self._relay_exit,
        )

    @property
    def busy(self) -> bool:
        """Starting, running or being stopped: the agent cannot take another assignment."""
        return self.state in ("starting", "ready", "stopping")

    @property
    def pid(self) -> int | None:
        return self._child.pid

    @property
    def last_stderr_line(self) -> str:
        line = self._child.last_log()
        return "" if line == "(none)" else line

    def start(self, payload: dict[str, Any]) -> None:
        """Spawn the worker in its own process group and hand it the payload; OSError on failure."""
        self._child.start(payload)

    def frozen_for(self) -> float:
        """Seconds a ready worker's process has been stopped (SIGSTOP, a debugger), else 0.

        A stopped rank or stage breaks no socket: its peers would just wait. Asked every
        heartbeat, so the time counts from the first look that found it stopped.
        """
        if self.state != "ready" or self._stopping.is_set() or not self._child.is_stopped():
            self._stopped_since = None
            return 0.0
        now = time.monotonic()
        if self._stopped_since is None:
            self._stopped_since = now
        return now - self._stopped_since

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the worker's process group, SIGKILL after grace_s; idempotent."""
        self._stopping.set()
        if self.state in ("starting", "ready"):
            self.state = "stopping"
        self._child.stop(grace_s)

    def _relay_message(self, event: dict[str, Any]) -> None:
        if self._stopping.is_set():
            return  # once released, nothing it says matters to the coordinator
        if event.get("event") == "ready":
            self.state = "ready"
        elif event.get("event") == "failed":
            self.state = "failed"
        self._on_event(self, event)

    def _relay_exit(self, code: int) -> None:
        if self.state != "failed":
            self.state = "exited"
        if not self._stopping.is_set():
            self._on_exit(self, code, self.last_stderr_line)
