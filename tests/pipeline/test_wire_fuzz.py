"""Fuzzing the frame codec: mutated sealed frames never open, mutated plaintexts decode to
exactly themselves or raise WireError."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engines.pipeline import wire
from engines.pipeline.sequence_documents import end_frame
from engines.pipeline.wire import PREFILL_GROUP, Kind, Row, WireError
from errors import ChannelError
from tests.helpers.live_stage import GREEDY, SESSION, UPSTREAM

pytestmark = pytest.mark.cluster

AD = wire.associated_data(1, UPSTREAM)
PLAINTEXTS = [
    wire.encode(wire.hidden_frame(1, 0, 1, [Row(1, 0), Row(2, 3)], mx.zeros((2, 1, 16)))),
    wire.encode(wire.hidden_frame(1, wire.PREFILL_GROUP, 1, [Row(1, 0)], mx.zeros((1, 3, 16)))),
    wire.encode(wire.token_frame(1, 0, 1, [Row(1, 0), Row(2, 3)], [42, 43])),
    wire.encode(wire.token_frame(1, wire.PREFILL_GROUP, 1, [Row(1, 0)], [])),
    wire.encode(wire.document_frame(Kind.BEGIN, 1, GREEDY, [Row(1, 0)])),
    wire.encode(end_frame(1, [1, 2, 3])),
    wire.encode(end_frame(1, [1, 2], keep=[(1, 40)], evict=[7, 8])),
    wire.encode(end_frame(1, [], evict=[7], spill=[8, 9])),
    wire.encode(wire.token_frame(1, PREFILL_GROUP, 1, [Row(1, 0)], [42], flags=wire.LAST_CHUNK)),
    wire.encode(wire.document_frame(Kind.BEGIN, 1, {**GREEDY, "prefix_entry": 4}, [Row(1, 9)])),
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
