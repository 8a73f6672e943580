"""The secure channel and the cluster key: handshake, sealing, and every way a frame is refused."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from discovery.cluster_key import (
    cluster_id,
    format_key,
    generate_key,
    load_key_file,
    load_or_create_key,
    parse_key,
)
from discovery.framing import ChannelTimeout, recv_frame, send_frame
from discovery.sealing import COUNTER, MAX_COUNTER, FrameOpener, FrameSealer, derive_session_keys
from discovery.secure_channel import SecureChannel
from errors import ChannelError, ConfigError
from tests.helpers.threads import run_in_thread

KEY = bytes(range(32))
PURPOSE = b"pipeline"
ASSOCIATED = b"request=req-1;layers=0-15;step=0"
WAIT_S = 5.0


def connected_pair(
    client_key: bytes = KEY,
    server_key: bytes = KEY,
    client_purpose: bytes = PURPOSE,
    server_purpose: bytes = PURPOSE,
    timeout_s: float = WAIT_S,
) -> tuple[SecureChannel, SecureChannel]:
    client_sock, server_sock = socket.socketpair()
    join_server = run_in_thread(
        lambda: SecureChannel.server(server_sock, server_key, server_purpose, timeout_s)
    )
    try:
        client = SecureChannel.client(client_sock, client_key, client_purpose, timeout_s)
    finally:
        server = join_server()
    assert isinstance(server, SecureChannel)
    return client, server


@dataclass
class Wire:
    """A client and server whose bytes pass through the test: it reads, mangles, and writes."""

    client: SecureChannel
    server: SecureChannel
    from_client: socket.socket  # frames the client sent
    to_server: socket.socket  # what the server will read
    from_server: socket.socket
    to_client: socket.socket

    def client_frames(self, count: int) -> list[bytes]:
        for index in range(count):
            self.client.send(f"message {index}".encode(), ASSOCIATED)
        return [recv_frame(self.from_client, WAIT_S) for _ in range(count)]

    def close(self) -> None:
        for item in (self.client, self.server):
            item.close()
        for sock in (self.from_client, self.to_server):
            sock.close()


def relayed_pair() -> Wire:
    client_sock, from_client = socket.socketpair()
    server_sock, to_server = socket.socketpair()
    join_server = run_in_thread(lambda: SecureChannel.server(server_sock, KEY, PURPOSE, WAIT_S))
    join_client = run_in_thread(lambda: SecureChannel.client(client_sock, KEY, PURPOSE, WAIT_S))
    # The handshake is three frames: hello, answer, proof.
    send_frame(to_server, recv_frame(from_client, WAIT_S))
    send_frame(from_client, recv_frame(to_server, WAIT_S))
    send_frame(to_server, recv_frame(from_client, WAIT_S))
    client, server = join_client(), join_server()
    assert isinstance(client, SecureChannel) and isinstance(server, SecureChannel)
    return Wire(client, server, from_client, to_server, to_server, from_client)


@pytest.fixture
def wire() -> Iterator[Wire]:
    relayed = relayed_pair()
    yield relayed
    relayed.close()


def assert_rejected(channel: SecureChannel, match: str, associated: bytes = ASSOCIATED) -> None:
    """recv fails with `match`, and the channel refuses every later use."""
    with pytest.raises(ChannelError, match=match):
        channel.recv(WAIT_S, associated)
    assert channel.closed
    with pytest.raises(ChannelError, match="channel closed"):
        channel.recv(0.1, associated)
    with pytest.raises(ChannelError, match="channel closed"):
        channel.send(b"anything")


def flip(frame: bytes, index: int, mask: int = 0x01) -> bytes:
    mutated = bytearray(frame)
    mutated[index] ^= mask
    return bytes(mutated)


# --- handshake -----------------------------------------------------------------------------


def test_round_trip_both_directions() -> None:
    client, server = connected_pair()
    with client, server:
        client.send(b"hidden state", ASSOCIATED)
        assert server.recv(WAIT_S, ASSOCIATED) == b"hidden state"
        server.send(b"")
        assert client.recv(WAIT_S) == b""
        large = os.urandom(1 << 20)  # bigger than the socket buffer: the reader must run too
        join = run_in_thread(lambda: client.recv(WAIT_S, b"token"))
        server.send(large, b"token")
        assert join() == large


def test_both_ends_agree_on_session_and_cluster_id() -> None:
    client, server = connected_pair()
    with client, server:
        assert client.session_id == server.session_id
        assert len(client.session_id) == 16
        assert client.cluster_id == server.cluster_id == cluster_id(KEY)
        again, other = connected_pair()
        with again, other:
            assert again.session_id != client.session_id


def test_directions_use_separate_keys() -> None:
    keys = derive_session_keys(os.urandom(32), KEY, os.urandom(32))
    assert keys.client_to_server != keys.server_to_client
    assert KEY.hex() not in repr(keys) and keys.client_to_server.hex() not in repr(keys)
    frame = keys.sealer("client").seal(b"payload")
    with pytest.raises(ChannelError, match="failed authentication"):
        keys.opener("client").open(frame)  # the client does not accept its own frames
    assert keys.opener("server").open(frame) == b"payload"


def test_reflected_frame_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_client, frame)  # back to the sender
    assert_rejected(wire.client, "failed authentication")


def test_wrong_cluster_key_fails_on_both_sides() -> None:
    client_sock, server_sock = socket.socketpair()
    join_server = run_in_thread(lambda: SecureChannel.server(server_sock, KEY, PURPOSE, WAIT_S))
    with pytest.raises(ChannelError, match="peer failed to prove the cluster key"):
        SecureChannel.client(client_sock, generate_key(), PURPOSE, WAIT_S)
    with pytest.raises(ChannelError, match="peer failed to prove the cluster key"):
        join_server()
    assert client_sock.fileno() == -1 and server_sock.fileno() == -1


def test_frames_from_another_cluster_key_do_not_open() -> None:
    secret, transcript = os.urandom(32), os.urandom(32)
    ours = derive_session_keys(secret, KEY, transcript)
    theirs = derive_session_keys(secret, generate_key(), transcript)
    with pytest.raises(ChannelError, match="failed authentication"):
        ours.opener("server").open(theirs.sealer("client").seal(b"payload"))


def test_purpose_mismatch_fails_on_both_sides() -> None:
    client_sock, server_sock = socket.socketpair()
    join_server = run_in_thread(lambda: SecureChannel.server(server_sock, KEY, b"control", WAIT_S))
    with pytest.raises(ChannelError, match="handshake"):
        SecureChannel.client(client_sock, KEY, b"pipeline", WAIT_S)
    with pytest.raises(
        ChannelError, match="b'pipeline' channel but this endpoint serves b'control'"
    ):
        join_server()


def test_stranger_speaking_garbage_is_refused() -> None:
    client_sock, server_sock = socket.socketpair()
    join_server = run_in_thread(lambda: SecureChannel.server(server_sock, KEY, PURPOSE, WAIT_S))
    send_frame(client_sock, b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(ChannelError, match="did not send a tandem secure channel hello"):
        join_server()
    assert client_sock.recv(1) == b""  # the server hung up
    client_sock.close()


def test_handshake_read_times_out() -> None:
    client_sock, server_sock = socket.socketpair()
    started = time.monotonic()
    with pytest.raises(ChannelError, match="timed out waiting for the client's hello"):
        SecureChannel.server(server_sock, KEY, PURPOSE, timeout_s=0.3)
    assert time.monotonic() - started < 2.0
    client_sock.close()


# --- tampering, one case at a time ---------------------------------------------------------


def test_untouched_frames_open(wire: Wire) -> None:
    frames = wire.client_frames(2)
    for frame in frames:
        send_frame(wire.to_server, frame)
    assert wire.server.recv(WAIT_S, ASSOCIATED) == b"message 0"
    assert wire.server.recv(WAIT_S, ASSOCIATED) == b"message 1"


def test_flipped_ciphertext_byte_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_server, flip(frame, COUNTER.size + 2))
    assert_rejected(wire.server, "frame 0 failed authentication")


def test_flipped_tag_byte_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_server, flip(frame, len(frame) - 1, 0x80))
    assert_rejected(wire.server, "failed authentication")


def test_flipped_counter_byte_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_server, flip(frame, COUNTER.size - 1))
    assert_rejected(wire.server, "expected 0, got 1")


def test_counter_rewritten_to_match_is_still_refused(wire: Wire) -> None:
    # The counter is authenticated too: giving frame 1 the expected counter 0 does not help.
    frames = wire.client_frames(2)
    send_frame(wire.to_server, COUNTER.pack(0) + frames[1][COUNTER.size :])
    assert_rejected(wire.server, "failed authentication")


def test_replayed_frame_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_server, frame)
    send_frame(wire.to_server, frame)
    assert wire.server.recv(WAIT_S, ASSOCIATED) == b"message 0"
    assert_rejected(wire.server, "expected 1, got 0")


def test_reordered_frames_are_refused(wire: Wire) -> None:
    first, second = wire.client_frames(2)
    send_frame(wire.to_server, second)
    send_frame(wire.to_server, first)
    assert_rejected(wire.server, "expected 0, got 1")


def test_dropped_frame_is_refused(wire: Wire) -> None:
    _, second = wire.client_frames(2)
    send_frame(wire.to_server, second)
    assert_rejected(wire.server, "expected 0, got 1")


def test_truncated_frame_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_server, frame[:-1])
    assert_rejected(wire.server, "failed authentication")


def test_frame_shorter_than_counter_and_tag_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_server, frame[:10])
    assert_rejected(wire.server, "shorter than the 24-byte minimum")


def test_frame_cut_off_on_the_wire_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    wire.to_server.sendall(struct.pack(">I", len(frame)) + frame[: len(frame) // 2])
    wire.to_server.shutdown(socket.SHUT_WR)
    assert_rejected(wire.server, f"connection closed by peer after {len(frame) // 2} of")


def test_frame_from_another_session_is_refused(wire: Wire) -> None:
    other = relayed_pair()
    try:
        [foreign] = other.client_frames(1)  # same key, same counter 0, other session
    finally:
        other.close()
    send_frame(wire.to_server, foreign)
    assert_rejected(wire.server, "failed authentication")


def test_wrong_associated_data_is_refused(wire: Wire) -> None:
    [frame] = wire.client_frames(1)
    send_frame(wire.to_server, frame)
    other_request = ASSOCIATED.replace(b"req-1", b"req-2")
    assert_rejected(wire.server, "failed authentication", associated=other_request)


def test_oversized_length_prefix_is_refused_before_reading_a_body(wire: Wire) -> None:
    wire.to_server.sendall(struct.pack(">I", 0xFFFF_FFF0))  # no body follows
    started = time.monotonic()
    assert_rejected(wire.server, "frame length 4294967280 exceeds the limit")
    assert time.monotonic() - started < 1.0


def test_receiver_limit_refuses_a_frame_the_sender_allowed() -> None:
    client_sock, server_sock = socket.socketpair()
    join_server = run_in_thread(
        lambda: SecureChannel.server(server_sock, KEY, PURPOSE, WAIT_S, max_frame_bytes=1024)
    )
    client = SecureChannel.client(client_sock, KEY, PURPOSE, WAIT_S)
    server = join_server()
    assert isinstance(server, SecureChannel)
    client.send(b"x" * 2048)
    assert_rejected(server, "exceeds the limit of 1048 bytes")
    client.close()


def test_send_above_the_limit_is_refused_locally_and_channel_stays_open() -> None:
    client_sock, server_sock = socket.socketpair()
    join_server = run_in_thread(lambda: SecureChannel.server(server_sock, KEY, PURPOSE, WAIT_S))
    client = SecureChannel.client(client_sock, KEY, PURPOSE, WAIT_S, max_frame_bytes=100)
    server = join_server()
    assert isinstance(server, SecureChannel)
    with client, server:
        with pytest.raises(ChannelError, match="payload of 101 bytes exceeds the channel limit"):
            client.send(b"x" * 101)
        client.send(b"x" * 100)
        assert server.recv(WAIT_S) == b"x" * 100


# --- counters, timeouts, threads -----------------------------------------------------------


def test_nonce_counters_increment_per_direction(wire: Wire) -> None:
    frames = wire.client_frames(3)
    assert [COUNTER.unpack(frame[: COUNTER.size])[0] for frame in frames] == [0, 1, 2]
    for frame in frames:
        send_frame(wire.to_server, frame)
        wire.server.recv(WAIT_S, ASSOCIATED)
    wire.server.send(b"reply")
    reply = recv_frame(wire.from_server, WAIT_S)
    assert COUNTER.unpack(reply[: COUNTER.size])[0] == 0  # the other direction counts alone


def test_sealer_refuses_to_wrap_the_counter() -> None:
    keys = derive_session_keys(os.urandom(32), KEY, os.urandom(32))
    sealer = FrameSealer(keys.client_to_server, 0, keys.session_id, keys.cluster_id, MAX_COUNTER)
    opener = FrameOpener(keys.client_to_server, 0, keys.session_id, keys.cluster_id, MAX_COUNTER)
    assert opener.open(sealer.seal(b"last")) == b"last"
    with pytest.raises(ChannelError, match="send counter exhausted"):
        sealer.seal(b"one too many")


def test_opener_refuses_everything_after_a_failure() -> None:
    keys = derive_session_keys(os.urandom(32), KEY, os.urandom(32))
    sealer, opener = keys.sealer("server"), keys.opener("client")
    good = sealer.seal(b"good")
    with pytest.raises(ChannelError):
        opener.open(flip(good, 12))
    with pytest.raises(ChannelError, match="channel closed"):
        opener.open(good)


def test_timeout_leaves_the_channel_usable() -> None:
    client, server = connected_pair()
    with client, server:
        with pytest.raises(ChannelTimeout, match="no frame arrived within 0.1 s"):
            server.recv(0.1)
        assert not server.closed
        client.send(b"late")
        assert server.recv(WAIT_S) == b"late"


def test_peer_hanging_up_closes_the_channel() -> None:
    client, server = connected_pair()
    client.close()
    assert_rejected(server, "connection closed by peer")


def test_close_wakes_a_blocked_receiver() -> None:
    client, server = connected_pair()
    with client:
        join = run_in_thread(lambda: server.recv(30.0))
        time.sleep(0.1)
        started = time.monotonic()
        server.close()
        with pytest.raises(ChannelError, match="channel closed"):
            join()
        assert time.monotonic() - started < 2.0


def test_concurrent_senders_keep_frames_in_order() -> None:
    client, server = connected_pair()
    senders, per_sender = 4, 200
    with client, server:

        def send_many(sender: int) -> None:
            for index in range(per_sender):
                client.send(f"{sender}:{index}".encode())

        threads = [threading.Thread(target=send_many, args=(n,)) for n in range(senders)]
        for thread in threads:
            thread.start()
        received = [server.recv(WAIT_S).decode() for _ in range(senders * per_sender)]
        for thread in threads:
            thread.join()
        for sender in range(senders):
            mine = [item for item in received if item.startswith(f"{sender}:")]
            assert mine == [f"{sender}:{index}" for index in range(per_sender)]


def test_peer_address_of_tcp_channel() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    join_server = run_in_thread(
        lambda: SecureChannel.server(listener.accept()[0], KEY, PURPOSE, WAIT_S)
    )
    client = SecureChannel.client(socket.create_connection(("127.0.0.1", port)), KEY, PURPOSE)
    server = join_server()
    assert isinstance(server, SecureChannel)
    with client, server:
        assert client.peer_address == ("127.0.0.1", port)
        assert server.peer_address is not None and server.peer_address[0] == "127.0.0.1"
    listener.close()


# --- the cluster key -----------------------------------------------------------------------


def test_key_text_round_trip() -> None:
    key = generate_key()
    text = format_key(key)
    assert text.startswith("tandem-") and "=" not in text and len(text) == 7 + 43
    assert parse_key(f"  {text}\n") == key


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "starts with 'tandem-'"),
        ("secret-" + "A" * 43, "starts with 'tandem-'"),
        ("tandem-" + "A" * 42, "this one has 42 characters"),
        ("tandem-" + "A" * 42 + "!", "contains other characters"),
        ("tandem-" + "A" * 42 + "B", "not canonical"),
    ],
)
def test_bad_key_text_is_refused_without_echoing_it(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as raised:
        parse_key(text)
    if len(text) > 10:
        assert text[7:] not in str(raised.value)


def test_cluster_id_is_stable_short_and_not_the_key() -> None:
    assert cluster_id(KEY) == cluster_id(bytes(KEY))
    assert len(cluster_id(KEY)) == 16 and int(cluster_id(KEY), 16) >= 0
    assert cluster_id(KEY) != cluster_id(generate_key())
    assert cluster_id(KEY) not in KEY.hex()


def test_load_or_create_key_creates_then_loads(tmp_path: Path) -> None:
    path = tmp_path / "config" / "tandem" / "cluster.key"
    key, created = load_or_create_key(path)
    assert created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_key(path) == (key, False)
    assert load_key_file(path) == key
    assert [item.name for item in path.parent.iterdir()] == ["cluster.key"]


def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    path.write_text(format_key(KEY) + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"permissions 0o644.*chmod 600"):
        load_key_file(path)
    with pytest.raises(ConfigError, match="permissions"):
        load_or_create_key(path)


def test_missing_and_malformed_key_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no cluster key file"):
        load_key_file(tmp_path / "absent.key")
    path = tmp_path / "bad.key"
    path.write_text("not a key\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=f"{path}: a cluster key starts with"):
        load_key_file(path)
