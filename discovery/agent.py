"""The agent behind `tandem join`: advertise, serve one coordinator at a time, run its worker."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from discovery import cluster_key as cluster_keys
from discovery.agent_config import AgentConfig
from discovery.capabilities import Capabilities, probe_capabilities, read_tandem_version
from discovery.capabilities import refresh_memory as read_fresh_memory
from discovery.control import (
    ControlConnection,
    Heartbeat,
    Hello,
    MemoryReport,
    ModelCache,
    Release,
    control_listener,
    prove_control,
)
from discovery.control import RdmaDevice as WireRdmaDevice
from discovery.coordinator_session import CoordinatorSession
from discovery.handshake_gate import HandshakeGate
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
from errors import ChannelError, ConfigError

logger = logging.getLogger(__name__)

STATE_IDLE = "idle"
STATE_WORKING = "working"


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
