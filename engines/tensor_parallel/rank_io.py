"""A rank process's I/O around the lockstep: rank 0 reads the engine's commands from stdin on a
thread, so that it can still ping the group on time while idle, and every rank has a watchdog
that ends its process when a collective stalls, because an mlx collective has no timeout.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from typing import IO, Any

WATCHDOG_POLL_S = 0.25


class CommandReader:
    """Reads rank 0's stdin on a thread, so an idle rank 0 can ping the group on time."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._commands: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, name="command-reader", daemon=True).start()

    def _read(self) -> None:
        for raw in self._stream:
            try:
                message = json.loads(raw)
                if not isinstance(message, dict):
                    raise ValueError("not a JSON object")
            except ValueError as error:
                message = {"cmd": "invalid", "reason": f"{error}: {raw[:80]!r}"}
            self._commands.put(message)
        self._commands.put({"cmd": "eof"})

    def next(self, timeout_s: float | None) -> dict[str, Any] | None:
        """The next command, or None when none came within `timeout_s`."""
        try:
            return self._commands.get(timeout=timeout_s)
        except queue.Empty:
            return None


class Watchdog:
    """Kills this process when a collective stalls: mlx collectives have no timeout."""

    def __init__(self, on_expire: Callable[[str], None]) -> None:
        self._on_expire = on_expire
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        with self._lock:
            self._deadline = time.monotonic() + seconds
            self._what = f"{what} made no progress for {seconds:g} s"

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(WATCHDOG_POLL_S)
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if expired:
                self._on_expire(f"stalled: {what}; a peer is frozen or cut off")
                return
