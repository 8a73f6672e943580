"""One coordinator as the agent serves it: Hello and heartbeats both ways, role assignments
turned into a worker process, the worker's events relayed back, and the worker released
when the coordinator goes away or its process freezes. The agent admits one session at a
time; everything a session does with the coordinator lives here.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

from discovery.agent_config import AgentConfig
from discovery.control import (
    AssignRole,
    ControlConnection,
    Failed,
    Heartbeat,
    Hello,
    Ping,
    Pong,
    Progress,
    Ready,
    Release,
)
from discovery.framing import ChannelTimeout
from discovery.role_worker import RoleWorker
from errors import ChannelError

logger = logging.getLogger(__name__)


class SessionAgent(Protocol):
    """What a coordinator session needs from its agent (discovery/agent.py's Agent)."""

    config: AgentConfig

    def hello(self) -> Hello: ...

    def heartbeat(self, worker: RoleWorker | None) -> Heartbeat: ...


class CoordinatorSession:
    """One verified coordinator: Hello, heartbeats both ways, assignments, release on loss."""

    def __init__(self, agent: SessionAgent, connection: ControlConnection) -> None:
        self.agent = agent
        self.connection = connection
        self.peer = "%s:%s" % (connection.peer_address or ("?", "?"))
        self.worker: RoleWorker | None = None
        self._lock = threading.Lock()
        self._ended = threading.Event()

    def run(self) -> None:
        """Serve until the coordinator goes away or the agent stops; always releases the worker."""
        logger.info("coordinator %s connected", self.peer)
        heartbeats = threading.Thread(target=self._send_heartbeats, daemon=True)
        try:
            # Hello, then a heartbeat at once: the coordinator learns our state without waiting.
            self._send(self.agent.hello())
            self._send(self.agent.heartbeat(None))
            heartbeats.start()
            reason = self._receive_loop()
        except ChannelError as error:
            reason = f"connection failed: {error}"
        self.end(reason)
        if heartbeats.is_alive():
            heartbeats.join(timeout=2.0)

    def end(self, reason: str) -> None:
        """Stop the worker and close the connection; idempotent, callable from any thread."""
        with self._lock:
            if self._ended.is_set():
                return
            self._ended.set()
        logger.info(
            "coordinator %s gone (%s); releasing and waiting for a coordinator", self.peer, reason
        )
        self._stop_worker()
        self.connection.close()

    def _receive_loop(self) -> str:
        # One long wait per message: end() closes the connection, which wakes recv at once.
        timeout_s = self.agent.config.coordinator_timeout_s
        while not self._ended.is_set():
            try:
                message = self.connection.recv(timeout_s)
            except ChannelTimeout:
                return f"no message from the coordinator for {timeout_s:.1f} s"
            except ChannelError as error:
                return f"connection closed: {error}"
            if isinstance(message, AssignRole):
                self._assign(message)
            elif isinstance(message, Release):
                self._release(message)
            elif isinstance(message, Ping):  # a link probe: answer before anything else
                self._send_quietly(Pong(nonce=message.nonce, padding=message.padding))
            elif not isinstance(message, Heartbeat):
                logger.warning("unexpected %s from coordinator %s", message.type, self.peer)
        return "agent stopping"

    def _assign(self, message: AssignRole) -> None:
        module = self.agent.config.role_modules.get(message.role)
        if module is None:
            known = ", ".join(sorted(self.agent.config.role_modules))
            self._send_quietly(
                Failed(
                    assignment_id=message.assignment_id,
                    reason=(f"this agent cannot run role {message.role!r} (it runs: {known})"),
                )
            )
            return
        with self._lock:
            current = self.worker
            if current is not None and current.state in ("starting", "ready"):
                self._send_quietly(
                    Failed(
                        assignment_id=message.assignment_id,
                        reason=(
                            f"already running assignment {current.assignment_id} ({current.role}); "
                            "release it first"
                        ),
                    )
                )
                return
            if current is not None:
                current.stop()  # it failed or exited; make sure no process lingers
            worker = RoleWorker(
                message.assignment_id,
                message.role,
                [sys.executable, "-m", module],
                on_event=self._relay_event,
                on_exit=self._relay_exit,
            )
            self.worker = worker
        payload = payload_here(
            message.payload, self.agent.config.cache_dir, self.agent.config.disk_limit
        )
        try:
            worker.start(payload)
        except OSError as error:
            worker.state = "failed"
            self._send_quietly(
                Failed(
                    assignment_id=message.assignment_id, reason=f"cannot start {module}: {error}"
                )
            )
            return
        self._send_quietly(self.agent.heartbeat(worker))

    def _release(self, message: Release) -> None:
        with self._lock:
            worker = self.worker
        if worker is None:
            return
        if message.assignment_id not in (None, worker.assignment_id):
            logger.info("ignoring release of unknown assignment %s", message.assignment_id)
            return
        logger.info("releasing %s (%s)", worker.assignment_id, message.reason)
        self._stop_worker()
        with self._lock:
            current = self.worker
        self._send_quietly(self.agent.heartbeat(current))

    def _stop_worker(self) -> None:
        # The worker stays visible (as "stopping") until it is gone, so no heartbeat says
        # "idle" while its process may still hold ports or memory.
        with self._lock:
            worker = self.worker
        if worker is None:
            return
        worker.stop()
        logger.info("stopped worker pid %s of %s", worker.pid, worker.assignment_id)
        with self._lock:
            if self.worker is worker:
                self.worker = None

    def _relay_event(self, worker: RoleWorker, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "ready":
            detail = {key: value for key, value in event.items() if key != "event"}
            detail.setdefault("pid", worker.pid)
            self._send_quietly(Ready(assignment_id=worker.assignment_id, detail=detail))
        elif kind == "failed":
            reason = str(event.get("reason") or "worker reported failure without a reason")
            self._send_quietly(Failed(assignment_id=worker.assignment_id, reason=reason))
        elif kind == "progress":  # receiving the model: the coordinator's wait goes on
            done, total = int(event.get("done_bytes", 0)), int(event.get("total_bytes", 0))
            progress = Progress(
                assignment_id=worker.assignment_id, done_bytes=done, total_bytes=total
            )
            self._send_quietly(progress)

    def _relay_exit(self, worker: RoleWorker, code: int, last_stderr: str) -> None:
        if worker.state == "failed":  # it already said why
            return
        reason = f"{worker.role} worker pid {worker.pid} exited with code {code}"
        if code < 0:  # killed: its last log line says what it was doing, not why it ended
            reason += (
                f" ({signal.Signals(-code).name}); its last log line: {last_stderr or '(none)'}"
            )
        elif last_stderr:
            reason += f": {last_stderr}"
        self._send_quietly(Failed(assignment_id=worker.assignment_id, reason=reason))

    def _send_heartbeats(self) -> None:
        interval_s = self.agent.config.heartbeat_interval_s
        while not self._ended.wait(interval_s):
            with self._lock:
                worker = self.worker
            if worker is not None:
                self._stop_if_frozen(worker)
            try:
                self._send(self.agent.heartbeat(worker))
            except ChannelError as error:
                self.end(f"heartbeat failed: {error}")

    def _stop_if_frozen(self, worker: RoleWorker) -> None:
        """A worker stopped for longer than the limit will not come back in time: stop it
        and say so, so the coordinator re-plans instead of waiting on it."""
        frozen_s = worker.frozen_for()
        limit_s = self.agent.config.worker_frozen_s
        if frozen_s <= limit_s:
            return
        reason = (
            f"{worker.role} worker pid {worker.pid} froze: its process has been stopped for "
            f"{frozen_s:.1f} s (limit {limit_s:g} s)"
        )
        logger.error("%s; stopping it", reason)
        worker.state = "failed"
        self._send_quietly(Failed(assignment_id=worker.assignment_id, reason=reason))
        threading.Thread(target=worker.stop, name="stop-frozen-worker", daemon=True).start()

    def _send(self, message: Any) -> None:
        self.connection.send(message)

    def _send_quietly(self, message: Any) -> None:
        try:
            self.connection.send(message)
        except ChannelError as error:
            logger.warning(
                "could not send %s to coordinator %s: %s", message.type, self.peer, error
            )


def payload_here(
    payload: dict[str, Any], cache_dir: Path | None, disk_limit: int | None
) -> dict[str, Any]:
    """An assignment's payload with what only this machine knows: where its models are kept
    (a weights offer) and its prefix cache's disk tier (the engine options' directory)."""
    payload = dict(payload)
    if cache_dir is None:
        return payload
    if isinstance(payload.get("weights"), dict):
        # The coordinator says where to fetch from; this machine says where to keep it.
        payload["weights"] = {
            **payload["weights"],
            "cache_dir": str(cache_dir / "models"),
            "disk_limit": disk_limit,
        }
    options = payload.get("options")  # engines/core/engine_options.py's document
    if isinstance(options, dict) and options.get("prefix_cache_disk_bytes"):
        # the prefix cache's disk tier lives in this machine's cache, as its models do
        payload["options"] = {**options, "prefix_cache_dir": str(cache_dir / "prefix-cache")}
    return payload
