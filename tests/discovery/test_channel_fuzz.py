"""Thousands of mangled frames and handshakes: none opens, and nothing but ChannelError escapes."""

from __future__ import annotations

import os
import random
import socket

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from discovery.framing import recv_frame
from discovery.sealing import SessionKeys, derive_session_keys
from discovery.secure_channel import _parse_hello
from errors import ChannelError

KEY = bytes(range(32))
ASSOCIATED = b"request=req-7;layers=16-31;step=3"
KEYS: SessionKeys = derive_session_keys(os.urandom(32), KEY, os.urandom(32))
PAYLOADS = [b"", b"x", os.urandom(100), os.urandom(8192)]


def sealed(payload_index: int) -> bytes:
    """Frame 0 of a fresh sealer: what a fresh opener expects next."""
    return KEYS.sealer("client").seal(PAYLOADS[payload_index], ASSOCIATED)


def assert_refused(frame: bytes, associated: bytes = ASSOCIATED) -> None:
    opener = KEYS.opener("server")
    with pytest.raises(ChannelError):
        opener.open(frame, associated)


@st.composite
def mutated_frames(draw: st.DrawFn) -> tuple[bytes, bytes]:
    original = sealed(draw(st.integers(0, len(PAYLOADS) - 1)))
    frame = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "replace", "delete"]))
        if kind == "flip" and frame:
            index = draw(st.integers(0, len(frame) - 1))
            frame[index] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            frame = frame[: draw(st.integers(0, len(frame)))]
        elif kind == "insert":
            index = draw(st.integers(0, len(frame)))
            frame[index:index] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "replace" and frame:
            index = draw(st.integers(0, len(frame) - 1))
            chunk = draw(st.binary(min_size=1, max_size=16))
            frame[index : index + len(chunk)] = chunk
        elif kind == "delete" and frame:
            index = draw(st.integers(0, len(frame) - 1))
            del frame[index : index + draw(st.integers(1, 16))]
    return original, bytes(frame)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_frames())
def test_mutated_frames_never_open(pair: tuple[bytes, bytes]) -> None:
    original, frame = pair
    assume(frame != original)
    assert_refused(frame)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_open(frame: bytes) -> None:
    assert_refused(frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_valid_frame_with_other_associated_data_never_opens(associated: bytes) -> None:
    assume(associated != ASSOCIATED)
    assert_refused(sealed(2), associated)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_hellos_raise_only_channel_error(hello: bytes) -> None:
    try:
        _parse_hello(hello)
    except ChannelError:
        return
    # A parse that succeeds must have consumed exactly the declared layout.
    assert len(hello) == 4 + 2 + hello[5] + 64


def test_seeded_random_mutations_never_open() -> None:
    generator = random.Random(20240611)
    for _ in range(3000):
        original = sealed(generator.randrange(len(PAYLOADS)))
        frame = bytearray(original)
        index = generator.randrange(len(frame))
        choice = generator.randrange(4)
        if choice == 0:
            frame[index] ^= 1 << generator.randrange(8)
        elif choice == 1:
            del frame[index:]
        elif choice == 2:
            frame.insert(index, generator.randrange(256))
        else:
            frame = bytearray(generator.randbytes(len(frame)))
        if bytes(frame) != original:
            assert_refused(bytes(frame))


def test_random_streams_through_the_framing_raise_only_channel_error() -> None:
    generator = random.Random(7)
    for _ in range(200):
        reader, writer = socket.socketpair()
        with reader, writer:
            writer.sendall(generator.randbytes(generator.randrange(0, 64)))
            writer.shutdown(socket.SHUT_WR)
            try:
                frame = recv_frame(reader, 1.0, max_size=1024)
            except ChannelError:
                continue
            assert_refused(frame)
