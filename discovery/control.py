"""Coordinator <-> agent control messages and the secure connection that carries them."""

from __future__ import annotations

import logging
import socket
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from discovery.framing import connect
from discovery.secure_channel import SecureChannel
from errors import ChannelError

logger = logging.getLogger(__name__)

CONTROL_PURPOSE = b"control"
CONTROL_MAX_BYTES = 1024 * 1024  # control messages are small; a bigger frame is an attack
MAX_PING_PADDING = 256 * 1024  # a link probe's payload, well inside CONTROL_MAX_BYTES
LISTEN_BACKLOG = 16
ERROR_DETAIL_CHARS = 300


class _Message(BaseModel):
    # Wire messages are exact: unknown fields or loose types mean a version mismatch or a bug.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class RdmaDevice(_Message):
    name: str
    port_state: str  # as ibv_devinfo prints it, e.g. "PORT_ACTIVE"


class HeldModel(_Message):
    """A verified copy in an agent's model cache; a share names its model and its layers
    (a pipeline stage's) or its rank (a tp rank's)."""

    content_hash: str
    share_of: str = ""  # the whole model's content hash, for a share
    layers: list[int] = Field(default_factory=list)  # [start, stop) of a stage's share
    tp_rank: list[int] = Field(default_factory=list)  # [rank, world size] of a tp rank's share


class ModelCache(_Message):
    """An agent's model cache (discovery/model_cache.py): free disk and what it holds."""

    free_bytes: int = Field(ge=0)
    models: list[HeldModel] = Field(default_factory=list)


class Hello(_Message):
    """Agent -> coordinator, first message: who this node is and what it can do."""

    type: Literal["hello"] = "hello"
    node_id: str
    cluster_id: str
    version: str
    platform: str
    memory_total: int = Field(ge=0)
    memory_available: int = Field(ge=0)
    # What caps memory_total: "machine", a cgroup limit, or the agent's --memory-limit.
    memory_bound: str = Field(default="machine", max_length=64)
    backends: list[str]
    rdma_devices: list[RdmaDevice]
    control_port: int = Field(ge=0, le=65535)
    hostname: str
    model_cache: ModelCache | None = None  # None: the agent keeps no cache (cannot receive)


class AssignRole(_Message):
    """Coordinator -> agent: start a worker as a tensor-parallel rank or a pipeline stage, one
    that fetches a stage's weights ahead of it, or one that measures the machine's speed or
    its all_sum (and a tp layer of the model) with the coordinator."""

    type: Literal["assign_role"] = "assign_role"
    role: Literal["tp_rank", "pp_stage", "speed_probe", "collective_probe", "weights"]
    assignment_id: str
    payload: dict[str, Any]


class Ready(_Message):
    """Agent -> coordinator: the assigned worker is up."""

    type: Literal["ready"] = "ready"
    assignment_id: str
    detail: dict[str, Any] = Field(default_factory=dict)


class Failed(_Message):
    """Agent -> coordinator: the assigned worker could not start or died."""

    type: Literal["failed"] = "failed"
    assignment_id: str
    reason: str


class MemoryReport(_Message):
    """A node's memory as its monitor sees it (discovery/memory_monitor.py)."""

    total: int = Field(ge=0)
    available: int = Field(ge=0)
    tandem_bytes: int = Field(ge=0)
    tier: Literal["ok", "warn", "critical"]
    budget: int | None = Field(default=None, gt=0)


class Heartbeat(_Message):
    """Agent -> coordinator, periodically: alive, memory, worker state."""

    type: Literal["heartbeat"] = "heartbeat"
    node_id: str
    state: str
    memory_available: int = Field(ge=0)
    worker_state: str | None = None
    worker_pid: int | None = None
    sent_at: float  # seconds since the epoch, sender's clock
    memory: MemoryReport | None = None  # the agent's memory tier; None from a coordinator
    model_cache: ModelCache | None = None  # refreshed every few seconds by an agent


class Progress(_Message):
    """Agent -> coordinator: the worker of `assignment_id` is receiving the model."""

    type: Literal["progress"] = "progress"
    assignment_id: str
    done_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)


class Release(_Message):
    """Coordinator -> agent: stop the worker of `assignment_id` (None: everything)."""

    type: Literal["release"] = "release"
    assignment_id: str | None = None
    reason: str


class Ping(_Message):
    """Coordinator -> agent: answer at once with a Pong of the same nonce and padding (the
    padding, sent both ways, measures the link's bandwidth; discovery/link_probe.py)."""

    type: Literal["ping"] = "ping"
    nonce: int = Field(ge=0)
    padding: str = Field(default="", max_length=MAX_PING_PADDING)


class Pong(_Message):
    """Agent -> coordinator: the answer to a Ping."""

    type: Literal["pong"] = "pong"
    nonce: int = Field(ge=0)
    padding: str = Field(default="", max_length=MAX_PING_PADDING)


Message = Annotated[
    Hello | AssignRole | Ready | Failed | Heartbeat | Release | Progress | Ping | Pong,
    Field(discriminator="type"),
]
_MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def encode(message: Message) -> bytes:
    """JSON bytes of one control message."""
    return message.model_dump_json().encode("utf-8")


def decode(data: bytes) -> Message:
    """The control message in `data`; ChannelError for malformed JSON, unknown types or fields."""
    try:
        return _MESSAGE_ADAPTER.validate_json(data)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or 'message'}: {problem['msg']}"
            for problem in error.errors(include_url=False, include_input=False)
        )
        raise ChannelError(
            f"malformed control message ({len(data)} bytes): {problems[:ERROR_DETAIL_CHARS]}"
        ) from None


class ControlConnection:
    """Control messages over one SecureChannel; send is thread-safe, one thread receives."""

    def __init__(self, channel: SecureChannel) -> None:
        self.channel = channel

    @property
    def peer_address(self) -> tuple[str, int] | None:
        return self.channel.peer_address

    @property
    def cluster_id(self) -> str:
        return self.channel.cluster_id

    @property
    def session_id(self) -> bytes:
        return self.channel.session_id

    @property
    def closed(self) -> bool:
        return self.channel.closed

    def send(self, message: Message) -> None:
        self.channel.send(encode(message))

    def recv(self, timeout_s: float) -> Message:
        """The next message; ChannelTimeout if none came (still open), ChannelError otherwise."""
        data = self.channel.recv(timeout_s)
        try:
            return decode(data)
        except ChannelError:
            # An authenticated peer sent garbage: a bug or a version mismatch, not recoverable.
            self.channel.close()
            raise

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ControlConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def control_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (read getsockname())."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        raise ChannelError(
            f"cannot listen for control connections on {host}:{port}: {error}"
        ) from error
    return sock


def dial_control(host: str, port: int, cluster_key: bytes, timeout_s: float) -> ControlConnection:
    """Connect to a control endpoint and prove the cluster key as the client."""
    sock = connect(host, port, timeout_s)
    return ControlConnection(
        SecureChannel.client(sock, cluster_key, CONTROL_PURPOSE, timeout_s, CONTROL_MAX_BYTES)
    )


def prove_control(sock: socket.socket, cluster_key: bytes, timeout_s: float) -> ControlConnection:
    """The server side of the control handshake on an accepted socket (ChannelError: refused)."""
    return ControlConnection(
        SecureChannel.server(sock, cluster_key, CONTROL_PURPOSE, timeout_s, CONTROL_MAX_BYTES)
    )
