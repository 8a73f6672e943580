"""The agent behind `tandem join`: advertise, serve one coordinator at a time, run its worker."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from discovery import cluster_key as cluster_keys
from discovery.capabilities import Capabilities, probe_capabilities, read_tandem_version
from discovery.capabilities import refresh_memory as read_fresh_memory
from discovery.control import (
    AssignRole,
    ControlConnection,
    Failed,
    Heartbeat,
    Hello,
    MemoryReport,
    ModelCache,
    Progress,
    Ready,
    Release,
    control_listener,
    prove_control,
)
from discovery.control import RdmaDevice as WireRdmaDevice
from discovery.framing import ChannelTimeout
from discovery.handshake_gate import DEFAULT_DEADLINE_S, HandshakeGate
from discovery.memory_monitor import MemoryMonitor
from discovery.model_cache import ModelCacheReader
from discovery.node_identity import StateDirLock, load_or_create_node_id
from discovery.role_worker import RoleWorker
from discovery.zeroconf_service import (
    Advertisement,
    PeerRecord,
    advertised_addresses,
    check_not_advertised,
    open_zeroconf,
)
from planner.errors import ChannelError, ConfigError

logger = logging.getLogger(__name__)

# Which module runs each role; an agent can be given another table (tests point a role at a fake).
DEFAULT_ROLE_MODULES: Mapping[str, str] = {
    "tp_rank": "engines.tensor_parallel.worker",
    "pp_stage": "engines.pipeline.stage_worker",
}
STATE_IDLE = "idle"
STATE_WORKING = "working"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything an agent needs; built by cli/join.py from flags and TANDEM_* twins."""

    cluster_key: bytes
    state_dir: Path
    interface: str | None = None  # None: every interface
    port: int = 0  # control port; 0 picks a free one (zeroconf advertises it)
    memory_limit: int | None = None
    memory_budget: int | None = None  # what the memory monitor measures tiers against
    heartbeat_interval_s: float = 1.0
    coordinator_timeout_s: float = 5.0
    worker_frozen_s: float = 3.0  # a ready worker whose process is stopped this long has failed
    handshake_timeout_s: float = DEFAULT_DEADLINE_S  # a coordinator proving the key
    duplicate_check_s: float = 1.5
    role_modules: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_MODULES))
    cache_dir: Path | None = None  # where models fetched from a coordinator are kept
    disk_limit: int | None = None  # bytes the models there may take (None: the free disk)


class CoordinatorSession:
    """One verified coordinator: Hello, heartbeats both ways, assignments, release on loss."""

    def __init__(self, agent: Agent, connection: ControlConnection) -> None:
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
        payload = dict(message.payload)
        if isinstance(payload.get("weights"), dict) and self.agent.config.cache_dir is not None:
            # The coordinator says where to fetch from; this machine says where to keep it.
            payload["weights"] = {
                **payload["weights"],
                "cache_dir": str(self.agent.config.cache_dir / "models"),
                "disk_limit": self.agent.config.disk_limit,
            }
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


class Agent:
    """Advertise this machine and serve one coordinator at a time; start() then stop()."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.cluster_id = cluster_keys.cluster_id(config.cluster_key)
        self.version = read_tandem_version()
        self.hostname = socket.gethostname()
        self.node_id = ""
        self.control_port = 0
        self.capabilities: Capabilities | None = None
        self.memory_monitor: MemoryMonitor | None = None
        self._state_lock = StateDirLock(config.state_dir)
        self._zeroconf: Any = None
        self._advertisement: Advertisement | None = None
        self._listener: socket.socket | None = None
        self._session: CoordinatorSession | None = None
        self._session_lock = threading.Lock()
        self._stopping = threading.Event()
        self._gate: HandshakeGate[ControlConnection] | None = None
        cache = config.cache_dir
        self.model_cache = (
            ModelCacheReader(cache / "models", config.disk_limit) if cache is not None else None
        )

    @property
    def bind_host(self) -> str:
        return self.config.interface or "0.0.0.0"

    def start(self) -> None:
        """Take the node id, refuse duplicates, listen, advertise; ConfigError on failure."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        node_id, created = load_or_create_node_id(self.config.state_dir)
        self.node_id = node_id
        self._state_lock.acquire(node_id)
        self.capabilities = probe_capabilities(self.config.memory_limit)
        self.memory_monitor = MemoryMonitor(
            self.config.memory_budget, self.config.heartbeat_interval_s, f"node {node_id}"
        ).start()
        self._zeroconf = open_zeroconf(self.config.interface)
        if not created:  # a fresh id cannot be on the network yet
            check_not_advertised(self._zeroconf, node_id, self.config.duplicate_check_s)
        try:
            self._listener = control_listener(self.bind_host, self.config.port)
        except ChannelError as error:
            raise ConfigError(f"{error}; choose another --port (0 picks a free one)") from None
        self.control_port = self._listener.getsockname()[1]
        self._advertisement = Advertisement(self._zeroconf, self.record())
        # Coordinators prove the key off the accepting thread: strangers cannot hold it.
        key, deadline = self.config.cluster_key, self.config.handshake_timeout_s
        self._gate = HandshakeGate(
            self._listener,
            lambda sock, timeout_s: prove_control(sock, key, timeout_s),
            lambda connection, _address: self._admit(connection),
            "control port",
            deadline_s=deadline,
        ).start()
        logger.info(
            "agent %s (cluster %s) listening on %s:%d, backends %s",
            node_id,
            self.cluster_id,
            self.bind_host,
            self.control_port,
            ",".join(self.capabilities.backends),
        )

    def stop(self) -> None:
        """Withdraw the advertisement, end the session (stopping its worker), close everything."""
        self._stopping.set()
        if self._advertisement is not None:  # first, so nobody new finds us
            self._advertisement.withdraw()
            self._advertisement = None
        with self._session_lock:
            session = self._session
        if session is not None:
            session.end("agent stopping")
        if self._gate is not None:
            self._gate.stop()
        if self._zeroconf is not None:
            self._zeroconf.close()
            self._zeroconf = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.memory_monitor is not None:
            self.memory_monitor.stop()
        self._state_lock.release()

    def wait(self, stop: threading.Event) -> None:
        """Block until `stop` is set (signal handlers set it)."""
        while not stop.wait(0.5):
            pass

    def record(self) -> PeerRecord:
        """What zeroconf announces about this agent."""
        capabilities = self._require_capabilities()
        return PeerRecord(
            node_id=self.node_id,
            addresses=tuple(advertised_addresses(self.config.interface)),
            port=self.control_port,
            cluster_id=self.cluster_id,
            version=self.version,
            platform=capabilities.platform,
            memory_total=capabilities.memory_total,
            memory_available=capabilities.memory_available,
            backends=capabilities.backends,
            rdma_devices=capabilities.rdma_devices,
        )

    def hello(self) -> Hello:
        capabilities = self._refresh_capabilities()
        return Hello(
            node_id=self.node_id,
            cluster_id=self.cluster_id,
            version=self.version,
            platform=capabilities.platform,
            memory_total=capabilities.memory_total,
            memory_available=capabilities.memory_available,
            memory_bound=capabilities.memory_bound,
            backends=list(capabilities.backends),
            rdma_devices=[
                WireRdmaDevice(name=device.name, port_state=device.port_state)
                for device in capabilities.rdma_devices
            ],
            control_port=self.control_port,
            hostname=self.hostname,
            model_cache=self._model_cache(fresh=True),
        )

    def heartbeat(self, worker: RoleWorker | None) -> Heartbeat:
        capabilities = self._refresh_capabilities()
        return Heartbeat(
            node_id=self.node_id,
            state=STATE_WORKING if worker is not None and worker.busy else STATE_IDLE,
            memory_available=capabilities.memory_available,
            worker_state=worker.state if worker is not None else None,
            worker_pid=worker.pid if worker is not None else None,
            sent_at=time.time(),
            memory=self._memory_report(),
            model_cache=self._model_cache(),
        )

    def _model_cache(self, fresh: bool = False) -> ModelCache | None:
        return self.model_cache.latest(fresh) if self.model_cache is not None else None

    def _memory_report(self) -> MemoryReport | None:
        if self.memory_monitor is None:
            return None
        return MemoryReport(**self.memory_monitor.latest().to_dict())

    def _require_capabilities(self) -> Capabilities:
        if self.capabilities is None:
            raise ConfigError("the agent has not been started")
        return self.capabilities

    def _refresh_capabilities(self) -> Capabilities:
        self.capabilities = read_fresh_memory(
            self._require_capabilities(), self.config.memory_limit
        )
        return self.capabilities

    def _admit(self, connection: ControlConnection) -> None:
        """Serve a verified coordinator, or tell it this agent is busy with another one."""
        with self._session_lock:
            busy = self._session
            if busy is None and not self._stopping.is_set():
                session = CoordinatorSession(self, connection)
                self._session = session
                threading.Thread(target=self._run_session, args=(session,), daemon=True).start()
                return
        try:
            connection.send(self.hello())
            reason = f"busy: serving coordinator {busy.peer}" if busy else "agent is stopping"
            connection.send(Release(reason=reason))
        except ChannelError as error:
            logger.debug("could not tell a second coordinator we are busy: %s", error)
        finally:
            connection.close()

    def _run_session(self, session: CoordinatorSession) -> None:
        try:
            session.run()
        finally:
            with self._session_lock:
                if self._session is session:
                    self._session = None
