"""One role worker subprocess: payload in on stdin, JSON events out on stdout, stopped by group."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

logger = logging.getLogger(__name__)

STOP_GRACE_S = 3.0
STOPPED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


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
        self.last_stderr_line = ""
        self._on_event = on_event
        self._on_exit = on_exit
        self._stopping = threading.Event()
        self._stopped_since: float | None = None
        self._process: subprocess.Popen[str] | None = None
        self._threads: list[threading.Thread] = []

    @property
    def busy(self) -> bool:
        """Starting, running or being stopped: the agent cannot take another assignment."""
        return self.state in ("starting", "ready", "stopping")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, payload: dict[str, Any]) -> None:
        """Spawn the worker in its own process group and hand it the payload; OSError on failure."""
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # so stop() reaches the worker's own children too
        )
        logger.info("started %s worker pid %d for %s", self.role, self.pid, self.assignment_id)
        stderr_thread = threading.Thread(target=self._read_stderr, daemon=True)
        stdout_thread = threading.Thread(
            target=self._read_stdout, args=(stderr_thread,), daemon=True
        )
        self._threads = [stderr_thread, stdout_thread]
        for thread in self._threads:
            thread.start()
        try:
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(payload) + "\n")
            self._process.stdin.flush()
        except OSError as error:  # it died at once; the stdout reader reports the exit
            logger.warning("could not hand the payload to worker %d: %s", self.pid, error)

    def frozen_for(self) -> float:
        """Seconds a ready worker's process has been stopped (SIGSTOP, a debugger), else 0.

        A stopped rank or stage breaks no socket: its peers would just wait. Asked every
        heartbeat, so the time counts from the first look that found it stopped.
        """
        process = self._process
        if self.state != "ready" or process is None or self._stopping.is_set():
            self._stopped_since = None
            return 0.0
        try:
            stopped = psutil.Process(process.pid).status() in STOPPED_STATES
        except psutil.Error:  # gone: the exit is reported by the stdout reader
            stopped = False
        if not stopped:
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
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "worker %d ignored SIGTERM for %.1f s; killing it", process.pid, grace_s
                )
                self._signal_group(process, signal.SIGKILL)
                process.wait()
        if process.stdin:
            try:
                process.stdin.close()
            except OSError:
                pass
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)

    @staticmethod
    def _signal_group(process: subprocess.Popen[str], signum: int) -> None:
        try:
            os.killpg(process.pid, signum)  # the group id is the pid: start_new_session
        except ProcessLookupError:
            pass
        except PermissionError:
            process.send_signal(signum)

    def _read_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:
            if line.strip():
                self.last_stderr_line = line.strip()
                logger.info("worker %d: %s", self._process.pid, self.last_stderr_line)

    def _read_stdout(self, stderr_thread: threading.Thread) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                logger.debug("worker %d printed non-JSON: %s", self._process.pid, line.rstrip())
                continue
            if not isinstance(event, dict) or self._stopping.is_set():
                continue  # once released, nothing it says matters to the coordinator
            if event.get("event") == "ready":
                self.state = "ready"
            elif event.get("event") == "failed":
                self.state = "failed"
            self._on_event(self, event)
        code = self._process.wait()
        stderr_thread.join(timeout=2.0)
        if self.state != "failed":
            self.state = "exited"
        if not self._stopping.is_set():
            self._on_exit(self, code, self.last_stderr_line)
