"""The handshake gate: strangers that are silent, trickle, or cannot prove the key never delay
a peer that can, are dropped at their deadline or past the caps, and leave nothing behind."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from discovery.cluster_key import generate_key
from discovery.handshake_gate import HandshakeGate, RefusalLog
from discovery.secure_channel import SecureChannel
from tests.helpers.strangers import open_strangers

PURPOSE = b"tandem-test-gate"
HOST = "127.0.0.1"


@pytest.fixture
def gate_setup() -> Iterator[tuple[HandshakeGate, bytes, queue.SimpleQueue]]:
    key = generate_key()
    listener = socket.create_server((HOST, 0), backlog=128)
    admitted: queue.SimpleQueue = queue.SimpleQueue()

    def prove(sock: socket.socket, deadline_s: float) -> SecureChannel:
        return SecureChannel.server(sock, key, PURPOSE, deadline_s)

    gate = HandshakeGate(
        listener, prove, lambda channel, _: admitted.put(channel), "test gate",
        deadline_s=1.0, max_pending=64, max_per_source=48,
    ).start()
    try:
        yield gate, key, admitted
    finally:
        gate.stop()
        listener.close()
        while not admitted.empty():
            admitted.get_nowait().close()


def prove_as_client(port: int, key: bytes) -> float:
    started = time.monotonic()
    sock = socket.create_connection((HOST, port), timeout=5)
    channel = SecureChannel.client(sock, key, PURPOSE, 5.0)
    elapsed = time.monotonic() - started
    channel.close()
    return elapsed


def test_a_peer_with_the_key_is_admitted_at_once_among_strangers(gate_setup):
    gate, key, admitted = gate_setup
    port = gate.listener.getsockname()[1]
    baseline_threads = threading.active_count()
    strangers = open_strangers(port)
    try:
        time.sleep(0.2)  # let the gate accept them all: they are pending now
        assert gate.pending > 0
        assert prove_as_client(port, key) < 0.5  # the inline handshake made it wait 10 s
        assert admitted.get(timeout=2) is not None
    finally:
        for sock in strangers:
            sock.close()
    deadline = time.monotonic() + 5
    while (gate.pending or threading.active_count() > baseline_threads) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert gate.pending == 0
    assert threading.active_count() <= baseline_threads  # no handshake thread left behind
    assert gate.refusals.refused >= len(strangers)


def test_silent_strangers_are_dropped_at_the_deadline(gate_setup):
    gate, _, _ = gate_setup
    port = gate.listener.getsockname()[1]
    sock = socket.create_connection((HOST, port), timeout=5)
    started = time.monotonic()
    assert sock.recv(64) == b""  # the gate closed it
    assert 0.8 < time.monotonic() - started < 3.0
    sock.close()


def test_past_the_per_source_cap_the_oldest_pending_is_dropped() -> None:
    key = generate_key()
    listener = socket.create_server((HOST, 0), backlog=64)

    def prove(sock: socket.socket, deadline_s: float) -> SecureChannel:
        return SecureChannel.server(sock, key, PURPOSE, deadline_s)

    gate = HandshakeGate(
        listener, prove, lambda channel, _: channel.close(), "capped",
        deadline_s=30.0, max_pending=100, max_per_source=4,
    ).start()
    port = listener.getsockname()[1]
    first = socket.create_connection((HOST, port), timeout=5)
    others = []
    try:
        time.sleep(0.1)
        others = [socket.create_connection((HOST, port)) for _ in range(4)]
        assert first.recv(64) == b""  # the oldest went to make room, long before 30 s
        time.sleep(0.1)
        assert gate.pending == 4
        assert prove_as_client(port, key) < 0.5  # the newest, a real peer, still gets in
    finally:
        for sock in [first, *others]:
            sock.close()
        gate.stop()
        listener.close()


def test_refusals_are_logged_once_per_source_and_minute(caplog):
    refusals = RefusalLog("test listener")
    with caplog.at_level(logging.WARNING, logger="discovery.handshake_gate"):
        for _ in range(20):
            refusals.note("198.18.0.9", "bad hello")
        refusals.note("198.18.0.10", "bad hello")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "198.18.0.9" in lines[0] and "198.18.0.10" in lines[1]
    assert refusals.refused == 21
