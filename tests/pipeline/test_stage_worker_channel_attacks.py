"""Attacks on a live stage's sealed hop: tampered, replayed, reordered, truncated, misbound or
late frames and bad handshakes are refused; the stage keeps running and serves the next
session."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from discovery.cluster_key import generate_key
from engines.pipeline import wire
from engines.pipeline.wire import Frame, Kind, Row
from errors import ChannelError
from tests.helpers.live_stage import (
    GREEDY,
    HOST,
    READ_TIMEOUT_S,
    UPSTREAM,
    Chain,
    LiveStage,
    activation,
    assert_fresh_session_serves,
    cut_body,
    flip_byte,
    reject,
)

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("where", [12, 30, -1])  # ciphertext start, middle, tag
def test_tampered_byte(stage: LiveStage, chain: Chain, where: int) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.sock.rewrite = flip_byte(where)
        chain.decode(0, [Row(1, 0)])

    reject(stage, chain, attack, "failed authentication")


def test_tampered_counter(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        chain.sock.rewrite = flip_byte(4 + 7)  # the last byte of the clear counter
        chain.begin(1)

    reject(stage, chain, attack, "out of order")


def test_replayed_frame(stage: LiveStage, chain: Chain, baseline: list[int]) -> None:
    chain.begin(1)
    assert chain.tokens(chain.decode(0, [Row(1, 0)])) == baseline[:1]
    reject(stage, chain, lambda: chain.sock.send_raw(chain.sock.frames[-1]), "out of order")


def test_reordered_frames(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.begin(2)
        chain.sock.rewrite = lambda data: b""  # hold micro-batch 0 back ...
        chain.decode(0, [Row(1, 0)])
        held = chain.sock.frames[-1]
        chain.decode(1, [Row(2, 0)])  # ... so micro-batch 1 arrives first
        chain.sock.send_raw(held)

    reject(stage, chain, attack, "out of order")


@pytest.mark.parametrize(
    ("rewrite", "logged"),
    [
        (cut_body(5), "failed authentication"),
        (lambda data: (10).to_bytes(4, "big") + data[4:14], "shorter than"),
    ],
    ids=["shortened", "stub"],
)
def test_truncated_frame(
    stage: LiveStage, chain: Chain, rewrite: Callable[[bytes], bytes], logged: str
) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.sock.rewrite = rewrite
        chain.decode(0, [Row(1, 0)])

    reject(stage, chain, attack, logged)


def test_silence_while_sequences_are_active_times_out(stage: LiveStage, chain: Chain) -> None:
    started = time.monotonic()
    reject(stage, chain, lambda: chain.begin(1), f"no frame arrived within {READ_TIMEOUT_S:g} s")
    assert time.monotonic() - started < READ_TIMEOUT_S + 2


def test_an_idle_session_waits_without_limit(stage: LiveStage, chain: Chain) -> None:
    time.sleep(READ_TIMEOUT_S + 1)  # no sequence: silence is no failure
    chain.begin(1)
    assert len(chain.tokens(chain.decode(0, [Row(1, 0)]))) == 1


@pytest.mark.parametrize(
    ("number", "sender"),
    [(2, UPSTREAM), (1, range(2, 4)), (1, wire.SETUP_SENDER)],
    ids=["other-number", "other-stage", "unbound-sender"],
)
def test_frame_bound_to_something_else(
    stage: LiveStage, chain: Chain, number: int, sender: range
) -> None:
    def attack() -> None:
        frame = wire.document_frame(Kind.BEGIN, number, GREEDY, [Row(1, 0)])
        chain.out.send(wire.encode(frame), wire.associated_data(number, sender))

    reject(stage, chain, attack, "failed authentication")


def test_header_that_disagrees_with_its_binding(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        frame = wire.hidden_frame(7, 0, 1, [Row(1, 0)], activation(0))
        chain.out.send(wire.encode(frame), wire.associated_data(1, UPSTREAM))

    reject(stage, chain, attack, "header says number 7")


# Each attack: sequences 1 and 2 began, 1 decoded once in micro-batch 0 (at position 1 now),


def test_answer_for_another_micro_batch_does_not_open(stage: LiveStage, chain: Chain) -> None:
    """The coordinator opens an answer with the micro-batch, step and rows it waits for."""
    chain.begin(1)
    chain.begin(2)
    sent = chain.decode(0, [Row(1, 0), Row(2, 0)])
    expected = Frame(Kind.TOKEN, sent.number, 1, sent.step, sent.rows)  # waits for batch 1
    with pytest.raises(ChannelError, match="failed authentication"):
        chain.tokens(expected)


def test_wrong_cluster_key_fails_the_handshake(stage: LiveStage, baseline: list[int]) -> None:
    since = stage.log_size()
    with pytest.raises(ChannelError, match="prove the cluster key"):
        Chain(stage, key=generate_key())
    stage.wait_for_log("handshake .* failed", since)
    assert stage.worker.popen.poll() is None
    assert_fresh_session_serves(stage, baseline)


def test_garbage_instead_of_a_handshake(stage: LiveStage, baseline: list[int]) -> None:
    with socket.create_connection((HOST, stage.worker.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: stage\r\n\r\n")
        # Refused and closed by the stage (logged once per source and minute, so not asserted).
        assert sock.recv(64) == b""
    assert_fresh_session_serves(stage, baseline)


def test_a_new_session_takes_over_from_a_silent_one(stage: LiveStage, baseline: list[int]) -> None:
    old = Chain(stage)
    old.setup()
    new = Chain(stage)  # the coordinator re-planned without closing the old hop
    try:
        new.setup()
        assert new.first_tokens() == baseline
        old.assert_closed_by_stage()
    finally:
        old.close()
        new.close()
