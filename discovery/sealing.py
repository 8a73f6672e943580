"""Session keys and sealed frames for the secure channel: AES-256-GCM in counter order, no sockets.

Session keys = HKDF-SHA256(X25519 secret, salt=cluster_key, info=SHA256(transcript)) split into
client->server key | server->client key | session id (the handshake is in secure_channel.py).

Frames: counter (8 bytes, big-endian, in clear) | AES-256-GCM(payload), with nonce =
direction (4 bytes) | counter and associated data = cluster id | session id | direction |
counter | caller's associated bytes. The receiver accepts only the next expected counter.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Literal, NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from discovery import cluster_key as cluster_keys
from errors import ChannelError

SESSION_KEY_BYTES = 32
SESSION_ID_BYTES = 16
COUNTER = struct.Struct(">Q")
TAG_BYTES = 16
FRAME_OVERHEAD = COUNTER.size + TAG_BYTES
MAX_COUNTER = 2**64 - 1
CLIENT_TO_SERVER = 0
SERVER_TO_CLIENT = 1

Role = Literal["client", "server"]


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """What a handshake yields: one AEAD key per direction and a public session id."""

    session_id: bytes
    cluster_id: str
    client_to_server: bytes = field(repr=False)
    server_to_client: bytes = field(repr=False)

    def sealer(self, role: Role) -> FrameSealer:
        """The sealer for frames `role` sends."""
        if role == "client":
            return FrameSealer(
                self.client_to_server, CLIENT_TO_SERVER, self.session_id, self.cluster_id
            )
        return FrameSealer(
            self.server_to_client, SERVER_TO_CLIENT, self.session_id, self.cluster_id
        )

    def opener(self, role: Role) -> FrameOpener:
        """The opener for frames `role` receives."""
        if role == "client":
            return FrameOpener(
                self.server_to_client, SERVER_TO_CLIENT, self.session_id, self.cluster_id
            )
        return FrameOpener(
            self.client_to_server, CLIENT_TO_SERVER, self.session_id, self.cluster_id
        )


def derive_session_keys(
    shared_secret: bytes, cluster_key: bytes, transcript_hash: bytes
) -> SessionKeys:
    """Split HKDF(shared secret, salt=cluster key, info=transcript hash) into the session keys."""
    material = HKDF(
        algorithm=hashes.SHA256(),
        length=2 * SESSION_KEY_BYTES + SESSION_ID_BYTES,
        salt=cluster_key,
        info=transcript_hash,
    ).derive(shared_secret)
    return SessionKeys(
        session_id=material[2 * SESSION_KEY_BYTES :],
        cluster_id=cluster_keys.cluster_id(cluster_key),
        client_to_server=material[:SESSION_KEY_BYTES],
        server_to_client=material[SESSION_KEY_BYTES : 2 * SESSION_KEY_BYTES],
    )


class _FrameCipher:
    """Shared state of a sealer or opener: one direction's key, nonce prefix, and counter."""

    def __init__(
        self, key: bytes, direction: int, session_id: bytes, cluster_id: str, next_counter: int = 0
    ) -> None:
        if direction not in (CLIENT_TO_SERVER, SERVER_TO_CLIENT):
            raise ValueError(f"direction must be 0 or 1, got {direction}")
        if len(session_id) != SESSION_ID_BYTES:
            raise ValueError(f"session id must be {SESSION_ID_BYTES} bytes, got {len(session_id)}")
        self._aead = AESGCM(key)
        self._nonce_prefix = direction.to_bytes(4, "big")
        self._associated_prefix = bytes.fromhex(cluster_id) + session_id + bytes([direction])
        self._next_counter = next_counter

    @property
    def next_counter(self) -> int:
        return self._next_counter

    def _nonce_and_associated(self, counter_bytes: bytes, associated: bytes) -> tuple[bytes, bytes]:
        return (
            self._nonce_prefix + counter_bytes,
            self._associated_prefix + counter_bytes + associated,
        )


class FrameSealer(_FrameCipher):
    """Seals one direction's frames in counter order. Not thread-safe: callers hold a lock."""

    def seal(self, payload: bytes, associated: bytes = b"") -> bytes:
        counter = self._next_counter
        if counter > MAX_COUNTER:
            raise ChannelError(
                f"send counter exhausted after {MAX_COUNTER} frames; open a new channel"
            )
        counter_bytes = COUNTER.pack(counter)
        nonce, full_associated = self._nonce_and_associated(counter_bytes, associated)
        self._next_counter = counter + 1
        return counter_bytes + self._aead.encrypt(nonce, payload, full_associated)


class FrameOpener(_FrameCipher):
    """Opens one direction's frames, only in counter order; refuses everything after a failure."""

    def __init__(
        self, key: bytes, direction: int, session_id: bytes, cluster_id: str, next_counter: int = 0
    ) -> None:
        super().__init__(key, direction, session_id, cluster_id, next_counter)
        self._failure: str | None = None

    def open(self, frame: bytes, associated: bytes = b"") -> bytes:
        if self._failure is not None:
            raise ChannelError(f"channel closed: an earlier frame failed ({self._failure})")
        if len(frame) < FRAME_OVERHEAD:
            self._fail(
                f"frame of {len(frame)} bytes is shorter than the {FRAME_OVERHEAD}-byte minimum"
            )
        counter_bytes = bytes(frame[: COUNTER.size])
        (counter,) = COUNTER.unpack(counter_bytes)
        if counter != self._next_counter:
            self._fail(
                f"frame counter out of order: expected {self._next_counter}, got {counter} "
                f"(replayed, reordered, or dropped frame)"
            )
        nonce, full_associated = self._nonce_and_associated(counter_bytes, associated)
        try:
            payload = self._aead.decrypt(nonce, bytes(frame[COUNTER.size :]), full_associated)
        except InvalidTag:
            self._fail(
                f"frame {counter} failed authentication (tampered, from another session or "
                f"cluster key, or sealed with different associated data)"
            )
        self._next_counter = counter + 1
        return payload

    def _fail(self, reason: str) -> NoReturn:
        self._failure = reason
        raise ChannelError(reason)
