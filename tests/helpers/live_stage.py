"""The test as coordinator of one live stage worker: its sealed hops, the frames it sends
and how a refused attack shows (the tamper tests of tests/pipeline), and a sealed session
for the codec tests."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher

from discovery.framing import ChannelTimeout
from discovery.sealing import derive_session_keys
from discovery.secure_channel import SecureChannel
from engines.core.request import GenerationRequest
from engines.pipeline import wire
from engines.pipeline.sequence_documents import end_frame
from engines.pipeline.stage_worker import StageProcess
from engines.pipeline.wire import PURPOSE, Frame, Kind, Row
from errors import ChannelError

HOST = "127.0.0.1"
UPSTREAM = range(0, 4)  # the test plays every stage before the live one
LAST = range(4, 5)
HIDDEN_SIZE = 256
READ_TIMEOUT_S = 2.0
JSON_OBJECT = LLMatcher.grammar_from_json_schema(
    {"type": "object"}, overrides={"whitespace_flexible": False}
)
# Valid without a tokenizer, but token 999999 is not in the demo model's vocabulary.
UNKNOWN_TOKEN = LLMatcher.grammar_from_lark('start: "a" <[999999]>')
# What a BEGIN carries: a request's document (greedy, seeded, the prompt's tail)
GREEDY = GenerationRequest("tamper", (0,), 1, seed=0).document()


class RecordingSocket(socket.socket):
    """A client socket that keeps every frame it sends and can rewrite the next one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.frames: list[bytes] = []
        self.rewrite: Callable[[bytes], bytes] | None = None

    def sendall(self, data: bytes, flags: int = 0) -> None:
        data = bytes(data)
        self.frames.append(data)
        if self.rewrite is not None:
            rewrite, self.rewrite = self.rewrite, None
            data = rewrite(data)
        if data:
            super().sendall(data, flags)

    def send_raw(self, data: bytes) -> None:
        super().sendall(data)


@dataclass
class LiveStage:
    worker: StageProcess
    listener: socket.socket
    log_path: Path
    key: bytes

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def wait_for_log(self, pattern: str, since: int, timeout_s: float = 5.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log_path.read_bytes()[since:].decode(errors="replace")
            if re.search(pattern, text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"stage log never matched {pattern!r}; it says:\n{text}")
            time.sleep(0.05)


class Chain:
    """The test as coordinator: a sealed hop into the live stage and its return hop back."""

    def __init__(self, stage: LiveStage, key: bytes | None = None) -> None:
        raw = socket.create_connection((HOST, stage.worker.port), timeout=5)
        self.sock = RecordingSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out = SecureChannel.client(self.sock, key or stage.key, PURPOSE, 5.0)
        self.back: SecureChannel | None = None
        stage.listener.settimeout(5.0)
        connection, _ = stage.listener.accept()
        self.back = SecureChannel.server(connection, stage.key, PURPOSE, 5.0)
        self.number = 0  # the last frame number sent
        self.steps: dict[int, int] = {}  # micro-batch -> its last step

    def setup(self) -> list[dict]:
        roll_call = {"reports": [{"layers": [UPSTREAM.start, UPSTREAM.stop]}]}
        wire.send(self.out, wire.document_frame(Kind.SETUP, 0, roll_call), wire.SETUP_SENDER)
        ready = wire.receive_answer(self.back, 5.0, Frame(Kind.READY, 0), wire.SETUP_SENDER)
        return ready.document()["reports"]

    def take(self) -> int:
        self.number += 1
        return self.number

    def send(self, frame: Frame) -> None:
        wire.send(self.out, frame, UPSTREAM)

    def begin(
        self, uid: int, position: int = 0, entry: object = None, grammar: str | None = None
    ) -> None:
        """BEGIN `uid`, from the first `position` tokens of prefix entry `entry` if given."""
        document = dict(GREEDY)
        if entry is not None:
            document["prefix_entry"] = entry
        if grammar is not None:
            document["grammar"] = grammar
        self.send(wire.document_frame(Kind.BEGIN, self.take(), document, [Row(uid, position)]))

    def decode(
        self, group: int, rows: list[Row], width: int = HIDDEN_SIZE, step: int | None = None
    ) -> Frame:
        """Send one decode step of micro-batch `group`; returns the answer to expect."""
        if step is None:
            step = self.steps.get(group, 0) + 1
        self.steps[group] = step
        number = self.take()
        self.send(wire.hidden_frame(number, group, step, rows, activations(rows, width)))
        return Frame(Kind.TOKEN, number, group, step, tuple(rows))

    def tokens(self, expected: Frame) -> list[int]:
        return self.answer(expected).tokens()

    def answer(self, expected: Frame) -> Frame:
        return wire.receive_answer(self.back, 5.0, expected, LAST)

    def end(self, uids: list[int], keep: list[tuple[int, int]] = (), evict: list[int] = ()) -> None:
        self.send(end_frame(self.take(), uids, keep, evict))

    def status(self) -> dict:
        """A STATUS roll call: the live stage's report."""
        number = self.take()
        roll_call = {"reports": [{"layers": [UPSTREAM.start, UPSTREAM.stop]}]}
        self.send(wire.document_frame(Kind.STATUS, number, roll_call))
        ready = wire.receive_answer(self.back, 5.0, Frame(Kind.READY, number), LAST)
        return ready.document()["reports"][-1]

    def first_tokens(self, uid: int = 1) -> list[int]:
        """A whole sequence: BEGIN, two decode steps alone in micro-batch 0, END."""
        self.begin(uid)
        tokens = []
        for position in (0, 1):
            tokens += self.tokens(self.decode(0, [Row(uid, position)]))
        self.end([uid])
        return tokens

    def assert_closed_by_stage(self) -> None:
        """The stage dropped the session: the return hop ends (not merely a quiet timeout)."""
        with pytest.raises(ChannelError) as failure:
            self.back.recv(5.0)
        assert not isinstance(failure.value, ChannelTimeout), failure.value

    def close(self) -> None:
        self.out.close()
        if self.back is not None:
            self.back.close()


def assert_fresh_session_serves(stage: LiveStage, baseline: list[int]) -> None:
    """A new session set up on `stage` answers exactly `baseline`: the stage survived."""
    fresh = Chain(stage)
    try:
        fresh.setup()
        assert fresh.first_tokens() == baseline
    finally:
        fresh.close()


def activation(position: int, width: int = HIDDEN_SIZE) -> mx.array:
    """The (1, 1, D) activation every test sends for a sequence at `position`."""
    values = np.random.default_rng(position).standard_normal((1, 1, width), dtype=np.float32)
    return mx.array(values)


def activations(rows: list[Row], width: int = HIDDEN_SIZE) -> mx.array:
    """(B, 1, D): each row's activation depends on its position only, as if run alone."""
    return mx.concatenate([activation(row.position, width) for row in rows], axis=0)


def flip_byte(index: int) -> Callable[[bytes], bytes]:
    def rewrite(data: bytes) -> bytes:
        mutated = bytearray(data)
        mutated[index % len(mutated)] ^= 0x20
        return bytes(mutated)

    return rewrite


def cut_body(count: int) -> Callable[[bytes], bytes]:
    """Drop the last `count` bytes and fix the length prefix: a well-framed, short frame."""

    def rewrite(data: bytes) -> bytes:
        body = data[4:-count]
        return len(body).to_bytes(4, "big") + body

    return rewrite


def reject(stage: LiveStage, chain: Chain, attack: Callable[[], None], logged: str) -> None:
    since = stage.log_size()
    attack()
    chain.assert_closed_by_stage()
    stage.wait_for_log(logged, since)


KEY = bytes(range(32))
SESSION = derive_session_keys(os.urandom(32), KEY, os.urandom(32))
