"""Attacks on a live stage worker and on the frame codec: every bad frame is refused, and the
stage keeps running and serves the next session."""

from __future__ import annotations

import os
import random
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from discovery.cluster_key import generate_key
from discovery.framing import ChannelTimeout
from discovery.sealing import derive_session_keys
from discovery.secure_channel import SecureChannel
from engines.pipeline import wire
from engines.pipeline.stage_worker import StageProcess
from engines.pipeline.wire import PURPOSE, Frame, Kind, WireError
from planner.errors import ChannelError

pytestmark = pytest.mark.cluster

HOST = "127.0.0.1"
UPSTREAM = range(0, 4)  # the test plays every stage before the live one
LAST = range(4, 5)
HIDDEN_SIZE = 256
READ_TIMEOUT_S = 2.0


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

    def setup(self) -> list[dict]:
        roll_call = {"reports": [{"layers": [UPSTREAM.start, UPSTREAM.stop]}]}
        wire.send(self.out, wire.document_frame(Kind.SETUP, 0, 0, roll_call), wire.SETUP_SENDER)
        ready = wire.receive(self.back, 5.0, 0, wire.SETUP_SENDER, 0, (Kind.READY,))
        return ready.document()["reports"]

    def begin(self, request: int) -> None:
        document = {"id": "tamper", "temperature": 0.0, "top_p": 1.0, "seed": 0}
        wire.send(self.out, wire.document_frame(Kind.BEGIN, request, 0, document), UPSTREAM)

    def hidden(self, request: int, step: int, width: int = HIDDEN_SIZE) -> None:
        wire.send(
            self.out, wire.hidden_frame(request, step, activation(step, width), True), UPSTREAM
        )

    def token(self, request: int, step: int) -> int:
        return wire.receive(self.back, 5.0, request, LAST, step, (Kind.TOKEN,)).token()

    def first_tokens(self, request: int = 1) -> list[int]:
        """A whole request: BEGIN, two sampled steps, END."""
        self.begin(request)
        tokens = []
        for step in (1, 2):
            self.hidden(request, step)
            tokens.append(self.token(request, step))
        wire.send(self.out, Frame(Kind.END, request, 3), UPSTREAM)
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


def activation(step: int, width: int = HIDDEN_SIZE) -> mx.array:
    values = np.random.default_rng(step).standard_normal((1, 1, width), dtype=np.float32)
    return mx.array(values)


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


# -- the live stage ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage(demo_model_factory: Callable[..., Path], tmp_path_factory) -> Iterator[LiveStage]:
    model = demo_model_factory(layers=5)
    key = generate_key()
    listener = socket.create_server((HOST, 0))
    log_path = tmp_path_factory.mktemp("tamper") / "stage.log"
    spec = {
        "model_path": str(model),
        "layers": [LAST.start, LAST.stop],
        "is_last": True,
        "listen_host": HOST,
        "listen_port": 0,
        "next_host": HOST,
        "next_port": listener.getsockname()[1],
        "cluster_key": key.hex(),
        "read_timeout_s": READ_TIMEOUT_S,
    }
    with open(log_path, "ab") as log:
        worker = StageProcess.start(spec, stderr=log, ready_timeout_s=60)
    try:
        yield LiveStage(worker, listener, log_path, key)
    finally:
        worker.stop(timeout_s=5)
        listener.close()


@pytest.fixture(scope="module")
def baseline(stage: LiveStage) -> list[int]:
    chain = Chain(stage)
    try:
        assert chain.setup() == [
            {"layers": [0, 4]},
            {
                "layers": [4, 5],
                "peak_memory_bytes": stage.worker.peak_memory_bytes,
                "active_requests": 0,
                "served_requests": 0,
            },
        ]
        return chain.first_tokens()
    finally:
        chain.close()


@pytest.fixture
def chain(stage: LiveStage, baseline: list[int]) -> Iterator[Chain]:
    """A set-up session; afterwards the stage must still run and serve a fresh one exactly."""
    session = Chain(stage)
    try:
        session.setup()
        yield session
    finally:
        session.close()
    assert stage.worker.popen.poll() is None, "the stage worker died"
    fresh = Chain(stage)
    try:
        fresh.setup()
        assert fresh.first_tokens() == baseline
    finally:
        fresh.close()


def reject(stage: LiveStage, chain: Chain, attack: Callable[[], None], logged: str) -> None:
    since = stage.log_size()
    attack()
    chain.assert_closed_by_stage()
    stage.wait_for_log(logged, since)


# -- attacks -------------------------------------------------------------------------------------


def test_a_valid_session_is_served_twice_the_same(chain: Chain, baseline: list[int]) -> None:
    assert chain.first_tokens() == baseline
    chain.begin(2)
    chain.hidden(2, 1)
    assert chain.token(2, 1) == baseline[0]  # a new request starts from an empty cache


@pytest.mark.parametrize("where", [12, 30, -1])  # ciphertext start, middle, tag
def test_tampered_byte(stage: LiveStage, chain: Chain, where: int) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.sock.rewrite = flip_byte(where)
        chain.hidden(1, 1)

    reject(stage, chain, attack, "failed authentication")


def test_tampered_counter(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        chain.sock.rewrite = flip_byte(4 + 7)  # the last byte of the clear counter
        chain.begin(1)

    reject(stage, chain, attack, "out of order")


def test_replayed_frame(stage: LiveStage, chain: Chain, baseline: list[int]) -> None:
    chain.begin(1)
    chain.hidden(1, 1)
    assert chain.token(1, 1) == baseline[0]
    reject(stage, chain, lambda: chain.sock.send_raw(chain.sock.frames[-1]), "out of order")


def test_reordered_frames(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.sock.rewrite = lambda data: b""  # hold step 1 back ...
        chain.hidden(1, 1)
        held = chain.sock.frames[-1]
        chain.hidden(1, 2)  # ... so step 2 arrives first
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
        chain.hidden(1, 1)

    reject(stage, chain, attack, logged)


def test_silence_inside_a_request_times_out(stage: LiveStage, chain: Chain) -> None:
    started = time.monotonic()
    reject(stage, chain, lambda: chain.begin(1), f"no frame arrived within {READ_TIMEOUT_S}")
    assert time.monotonic() - started < READ_TIMEOUT_S + 2


@pytest.mark.parametrize(
    ("request_number", "sender", "step"),
    [(2, UPSTREAM, 1), (1, range(2, 4), 1), (1, UPSTREAM, 2), (1, wire.SETUP_SENDER, 1)],
    ids=["other-request", "other-stage", "skipped-step", "unbound-sender"],
)
def test_frame_bound_to_something_else(
    stage: LiveStage, chain: Chain, request_number: int, sender: range, step: int
) -> None:
    def attack() -> None:
        chain.begin(1)
        frame = wire.hidden_frame(request_number, step, activation(1), True)
        chain.out.send(wire.encode(frame), wire.associated_data(request_number, sender, step))

    reject(stage, chain, attack, "failed authentication")


def test_header_that_disagrees_with_its_binding(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        chain.begin(1)
        frame = wire.hidden_frame(7, 1, activation(1), True)
        chain.out.send(wire.encode(frame), wire.associated_data(1, UPSTREAM, 1))

    reject(stage, chain, attack, "header says request 7")


@pytest.mark.parametrize(
    ("frame", "logged"),
    [
        (Frame(Kind.BEGIN, 1, 0, body=b"{not json"), "not UTF-8 JSON"),
        (Frame(Kind.BEGIN, 1, 0, body=b'{"temperature": 0}'), "malformed BEGIN"),
        (Frame(Kind.TOKEN, 1, 0, body=b"\0\0\0\1"), "expected a BEGIN or STATUS"),
        (Frame(Kind.HIDDEN, 1, 0, dtype=1, shape=(1, 1, 2), body=b"\0" * 8), "expected a BEGIN"),
    ],
    ids=["json", "fields", "kind", "hidden-before-begin"],
)
def test_malformed_control_frames(
    stage: LiveStage, chain: Chain, frame: Frame, logged: str
) -> None:
    reject(stage, chain, lambda: wire.send(chain.out, frame, UPSTREAM), logged)


def test_activation_of_the_wrong_width(stage: LiveStage, chain: Chain) -> None:
    def attack() -> None:
        chain.begin(1)
        chain.hidden(1, 1, width=HIDDEN_SIZE - 1)

    reject(stage, chain, attack, "activation width 255")


def test_wrong_cluster_key_fails_the_handshake(stage: LiveStage, baseline: list[int]) -> None:
    since = stage.log_size()
    with pytest.raises(ChannelError, match="prove the cluster key"):
        Chain(stage, key=generate_key())
    stage.wait_for_log("handshake .* failed", since)
    assert stage.worker.popen.poll() is None
    fresh = Chain(stage)
    try:
        fresh.setup()
        assert fresh.first_tokens() == baseline
    finally:
        fresh.close()


def test_garbage_instead_of_a_handshake(stage: LiveStage, baseline: list[int]) -> None:
    since = stage.log_size()
    with socket.create_connection((HOST, stage.worker.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: stage\r\n\r\n")
    stage.wait_for_log("rejected a connection", since)
    fresh = Chain(stage)
    try:
        fresh.setup()
        assert fresh.first_tokens() == baseline
    finally:
        fresh.close()


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


# -- the codec, socket-free ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_activation_round_trip(dtype: mx.Dtype) -> None:
    hidden = (mx.arange(2 * 3 * 5, dtype=mx.float32).reshape(1, 6, 5) / 7).astype(dtype)
    frame = wire.decode(wire.encode(wire.hidden_frame(3, 9, hidden, sample=True)))
    assert (frame.kind, frame.request, frame.step, frame.sample) == (Kind.HIDDEN, 3, 9, True)
    restored = frame.tensor()
    assert restored.dtype == dtype and restored.shape == hidden.shape
    assert mx.array_equal(restored, hidden).item()


def test_associated_data_differs_in_every_field() -> None:
    base = (5, range(4, 8), 2)
    variants = [(6, range(4, 8), 2), (5, range(3, 8), 2), (5, range(4, 9), 2), (5, range(4, 8), 3)]
    assert len({wire.associated_data(*args) for args in [base, *variants]}) == 5


KEY = bytes(range(32))
AD = wire.associated_data(1, UPSTREAM, 1)
SESSION = derive_session_keys(os.urandom(32), KEY, os.urandom(32))
PLAINTEXTS = [
    wire.encode(wire.hidden_frame(1, 1, activation(1, 16), True)),
    wire.encode(wire.token_frame(1, 1, 42)),
    wire.encode(wire.document_frame(Kind.BEGIN, 1, 1, {"seed": 1, "temperature": 0.0})),
    wire.encode(Frame(Kind.END, 1, 1)),
]


def mutate(data: bytes, rng: random.Random) -> bytes:
    mutated = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(5)
        if choice == 0 and mutated:
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        elif choice == 1:
            del mutated[rng.randrange(len(mutated) + 1) :]
        elif choice == 2:
            at = rng.randrange(len(mutated) + 1)
            mutated[at:at] = rng.randbytes(rng.randint(1, 16))
        elif choice == 3 and mutated:
            at = rng.randrange(len(mutated))
            mutated[at : at + 4] = rng.randbytes(4)
        elif mutated:
            at = rng.randrange(len(mutated))
            del mutated[at : at + rng.randint(1, 16)]
    return bytes(mutated)


def test_fuzzed_sealed_frames_never_open() -> None:
    rng = random.Random(20240611)
    tried = 0
    for _ in range(3000):
        plaintext = rng.choice(PLAINTEXTS)
        sealed = SESSION.sealer("client").seal(plaintext, AD)
        mutated = mutate(sealed, rng)
        if mutated == sealed:
            continue
        tried += 1
        try:
            wire.decode(SESSION.opener("server").open(mutated, AD))
        except ChannelError:
            continue
        raise AssertionError(f"a mutated frame opened: {mutated.hex()[:80]}")
    assert tried > 2900


def test_fuzzed_plaintexts_decode_or_raise_wire_error() -> None:
    rng = random.Random(7)
    decoded = 0
    for _ in range(5000):
        payload = mutate(rng.choice(PLAINTEXTS), rng)
        try:
            frame = wire.decode(payload)
        except WireError:
            continue
        decoded += 1
        assert wire.encode(frame) == payload  # whatever decodes is exactly what it says
        if frame.kind is Kind.HIDDEN:
            assert frame.tensor().shape == frame.shape
    assert decoded < 5000
