"""Control messages on the wire, and dialing/accepting the control channel over 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from discovery.cluster_key import cluster_id, generate_key
from discovery.control import (
    MAX_PING_PADDING,
    AssignRole,
    ControlConnection,
    Failed,
    Heartbeat,
    HeldModel,
    Hello,
    ModelCache,
    Ping,
    Pong,
    Progress,
    Ready,
    Release,
    control_listener,
    decode,
    dial_control,
    encode,
    prove_control,
)
from discovery.framing import ChannelTimeout, connect
from discovery.secure_channel import SecureChannel
from errors import ChannelError
from tests.helpers.threads import run_in_thread

KEY = bytes(range(32))
WAIT_S = 5.0

HELLO = Hello(
    node_id="node-a1",
    cluster_id=cluster_id(KEY),
    version="0.1.0",
    platform="darwin-arm64",
    memory_total=64 * 2**30,
    memory_available=48 * 2**30,
    backends=["jaccl", "ring"],
    rdma_devices=[{"name": "rdma_en4", "port_state": "PORT_ACTIVE"}],
    control_port=18081,
    hostname="mac2.local",
)
MESSAGES = [
    HELLO,
    AssignRole(
        role="pp_stage",
        assignment_id="as-1",
        payload={"model": "demo", "layers": [0, 16], "peers": ["127.0.0.1:7001"]},
    ),
    AssignRole(role="tp_rank", assignment_id="as-2", payload={}),
    Ready(assignment_id="as-1", detail={"pid": 4242, "port": 7001}),
    Ready(assignment_id="as-1"),
    Failed(assignment_id="as-1", reason="out of memory loading layers 0-16"),
    Heartbeat(node_id="node-a1", state="serving", memory_available=1024, sent_at=1.5e9),
    Heartbeat(
        node_id="node-a1",
        state="serving",
        memory_available=1024,
        worker_state="running",
        worker_pid=4242,
        sent_at=1700000000.25,
    ),
    Release(assignment_id="as-1", reason="re-plan"),
    Release(reason="coordinator shutting down"),
    Progress(assignment_id="as-1", done_bytes=10, total_bytes=40),
    Ping(nonce=7, padding="x" * MAX_PING_PADDING),
    Pong(nonce=7),
    HELLO.model_copy(
        update={
            "model_cache": ModelCache(
                free_bytes=2**30,
                models=[HeldModel(content_hash="b" * 64, share_of="a" * 64, layers=[2, 4])],
            )
        }
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda message: type(message).__name__)
def test_every_message_round_trips(message: object) -> None:
    data = encode(message)  # type: ignore[arg-type]
    assert json.loads(data)["type"] == message.type  # type: ignore[attr-defined]
    assert decode(data) == message


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "Invalid JSON"),
        (b"{", "Invalid JSON"),
        (b"\xff\xfe\x00", "Invalid JSON"),
        (b"[1, 2]", "message"),
        (b'"hello"', "message"),
        (b"{}", "Unable to extract tag"),
        (b'{"type": "shutdown_everything"}', "does not match any of the expected tags"),
        (b'{"type": "failed", "assignment_id": "a"}', "failed.reason: Field required"),
        (b'{"type": "failed", "assignment_id": 7, "reason": "x"}', "should be a valid string"),
        (
            b'{"type": "heartbeat", "node_id": "n", "state": "s", "memory_available": "lots",'
            b' "sent_at": 1}',
            "heartbeat.memory_available: Input should be a valid integer",
        ),
        (
            b'{"type": "heartbeat", "node_id": "n", "state": "s", "memory_available": -1,'
            b' "sent_at": 1}',
            "greater than or equal to 0",
        ),
        (b'{"type": "assign_role", "role": "boss", "assignment_id": "a", "payload": {}}', "role"),
        (b'{"type": "release", "reason": "x", "sudo": true}', "Extra inputs are not permitted"),
    ],
)
def test_malformed_messages_raise_channel_error(data: bytes, match: str) -> None:
    with pytest.raises(ChannelError, match=match) as raised:
        decode(data)
    assert raised.value.__cause__ is None  # no pydantic exception leaks through


def accept_control(listener: socket.socket, key: bytes, timeout_s: float) -> ControlConnection:
    """One connection, proven the way the agent's HandshakeGate proves each of its own."""
    listener.settimeout(timeout_s)
    try:
        sock, _ = listener.accept()
    except TimeoutError:
        raise ChannelTimeout(f"no control connection arrived within {timeout_s} s") from None
    return prove_control(sock, key, timeout_s)


def test_a_ping_larger_than_a_link_probe_is_refused() -> None:
    data = encode(Ping(nonce=1)).replace(
        b'"padding":""', b'"padding":"' + b"x" * (2**18 + 1) + b'"'
    )
    with pytest.raises(ChannelError, match="padding"):
        decode(data)


def test_hello_port_out_of_range_is_refused() -> None:
    raw = json.loads(encode(HELLO))
    raw["control_port"] = 70000
    with pytest.raises(ChannelError, match="hello.control_port"):
        decode(json.dumps(raw).encode())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_random_input_raises_only_channel_error(data: bytes) -> None:
    try:
        decode(data)
    except ChannelError:
        pass


# --- dial / accept over 127.0.0.1 ----------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = control_listener("127.0.0.1", 0)
    yield sock
    sock.close()


def test_listener_on_port_zero_gets_a_real_port(listener: socket.socket) -> None:
    host, port = listener.getsockname()
    assert host == "127.0.0.1" and port > 0


def test_dial_and_accept_with_the_right_key(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    join = run_in_thread(lambda: accept_control(listener, KEY, WAIT_S))
    agent_side = dial_control("127.0.0.1", port, KEY, WAIT_S)
    coordinator_side = join()
    assert isinstance(coordinator_side, ControlConnection)
    with agent_side, coordinator_side:
        assert agent_side.session_id == coordinator_side.session_id
        assert agent_side.cluster_id == cluster_id(KEY)
        assert agent_side.peer_address == ("127.0.0.1", port)
        agent_side.send(HELLO)
        assert coordinator_side.recv(WAIT_S) == HELLO
        coordinator_side.send(MESSAGES[1])
        assert agent_side.recv(WAIT_S) == MESSAGES[1]


def test_dial_with_a_wrong_key_fails_on_both_sides(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    join = run_in_thread(lambda: accept_control(listener, KEY, WAIT_S))
    with pytest.raises(ChannelError, match="peer failed to prove the cluster key"):
        dial_control("127.0.0.1", port, generate_key(), WAIT_S)
    with pytest.raises(ChannelError, match="failed to prove the cluster key"):
        join()
    # The listener survives a failed handshake and accepts the next, honest peer.
    join = run_in_thread(lambda: accept_control(listener, KEY, WAIT_S))
    with dial_control("127.0.0.1", port, KEY, WAIT_S) as honest:
        honest.send(Release(reason="bye"))
        accepted = join()
        assert isinstance(accepted, ControlConnection)
        with accepted:
            assert accepted.recv(WAIT_S) == Release(reason="bye")


def test_a_pipeline_channel_cannot_talk_to_the_control_port(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    join = run_in_thread(lambda: accept_control(listener, KEY, WAIT_S))
    with pytest.raises(ChannelError, match="handshake"):
        SecureChannel.client(connect("127.0.0.1", port, WAIT_S), KEY, b"pipeline", WAIT_S)
    with pytest.raises(ChannelError, match="serves b'control'"):
        join()


def test_accept_times_out_when_nobody_dials(listener: socket.socket) -> None:
    started = time.monotonic()
    with pytest.raises(ChannelTimeout, match="no control connection arrived within 0.2 s"):
        accept_control(listener, KEY, 0.2)
    assert time.monotonic() - started < 2.0


def test_dial_to_a_closed_port_fails_cleanly() -> None:
    sock = control_listener("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(ChannelError, match=f"cannot connect to 127.0.0.1:{port}"):
        dial_control("127.0.0.1", port, KEY, 1.0)


def test_garbage_from_an_authenticated_peer_closes_the_connection(
    listener: socket.socket,
) -> None:
    port = listener.getsockname()[1]
    join = run_in_thread(lambda: accept_control(listener, KEY, WAIT_S))
    with dial_control("127.0.0.1", port, KEY, WAIT_S) as agent_side:
        coordinator_side = join()
        assert isinstance(coordinator_side, ControlConnection)
        agent_side.channel.send(b'{"type": "format_disk"}')
        with pytest.raises(ChannelError, match="malformed control message"):
            coordinator_side.recv(WAIT_S)
        assert coordinator_side.closed


def test_recv_timeout_keeps_the_connection(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    join = run_in_thread(lambda: accept_control(listener, KEY, WAIT_S))
    with dial_control("127.0.0.1", port, KEY, WAIT_S) as agent_side:
        coordinator_side = join()
        assert isinstance(coordinator_side, ControlConnection)
        with coordinator_side:
            with pytest.raises(ChannelTimeout):
                coordinator_side.recv(0.1)
            agent_side.send(MESSAGES[6])
            assert coordinator_side.recv(WAIT_S) == MESSAGES[6]
