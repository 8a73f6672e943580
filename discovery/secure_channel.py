"""A mutually authenticated, encrypted channel between two holders of the cluster key.

Handshake (three frames, see framing.py for the 4-byte length prefix):
  client -> server  hello  = b"TNDM" | version | len(purpose) | purpose | client_pub | client_nonce
  server -> client  answer = server_pub | server_nonce | HMAC(cluster_key, transcript | b"server")
  client -> server  proof  = HMAC(cluster_key, transcript | b"client")
where transcript = PROTOCOL_LABEL | len(purpose) | purpose | client_pub | server_pub |
client_nonce | server_nonce. The client checks the server's proof before sending its own.
The X25519 secret and the transcript hash become the session keys, and every frame after the
handshake is sealed with them; both are described in sealing.py.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from discovery import cluster_key as cluster_keys
from discovery.framing import MAX_FRAME_BYTES, ChannelTimeout, recv_frame, send_frame
from discovery.sealing import (
    COUNTER,
    FRAME_OVERHEAD,
    MAX_COUNTER,
    FrameOpener,
    FrameSealer,
    Role,
    SessionKeys,
    derive_session_keys,
)
from errors import ChannelError

# The sealing names are re-exported for callers that import them from here.
__all__ = [
    "COUNTER",
    "FRAME_OVERHEAD",
    "MAX_COUNTER",
    "FrameOpener",
    "FrameSealer",
    "SecureChannel",
    "SessionKeys",
    "derive_session_keys",
]

logger = logging.getLogger(__name__)

PROTOCOL_LABEL = b"tandem secure channel v1"
HELLO_MAGIC = b"TNDM"
PROTOCOL_VERSION = 1
NONCE_BYTES = 32
PUBLIC_KEY_BYTES = 32
PROOF_BYTES = 32
MAX_PURPOSE_BYTES = 64
HANDSHAKE_FRAME_LIMIT = 256


class SecureChannel:
    """An authenticated, encrypted, ordered channel over a connected socket it owns.

    Build one with `SecureChannel.client` or `SecureChannel.server`. `send` is thread-safe;
    one thread at a time receives. Any failure closes the channel for good.
    """

    def __init__(
        self,
        sock: socket.socket,
        keys: SessionKeys,
        role: Role,
        purpose: bytes,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self._sock = sock
        self._keys = keys
        self._role = role
        self._purpose = purpose
        self._max_payload = max_frame_bytes
        self._sealer = keys.sealer(role)
        self._opener = keys.opener(role)
        self._peer_address = _peer_address(sock)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._closed_reason: str | None = None
        # Seconds spent sealing and opening frames so far (the pipeline's step timing reads them).
        self.seal_seconds = 0.0
        self.open_seconds = 0.0

    @classmethod
    def client(
        cls,
        sock: socket.socket,
        cluster_key: bytes,
        purpose: bytes,
        timeout_s: float = 10.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> SecureChannel:
        """Run the client side of the handshake; on failure close `sock` and raise ChannelError."""
        keys = _handshake(sock, cluster_key, purpose, timeout_s, "client")
        return cls(sock, keys, "client", purpose, max_frame_bytes)

    @classmethod
    def server(
        cls,
        sock: socket.socket,
        cluster_key: bytes,
        purpose: bytes,
        timeout_s: float = 10.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> SecureChannel:
        """Run the server side of the handshake; on failure close `sock` and raise ChannelError."""
        keys = _handshake(sock, cluster_key, purpose, timeout_s, "server")
        return cls(sock, keys, "server", purpose, max_frame_bytes)

    @property
    def session_id(self) -> bytes:
        return self._keys.session_id

    @property
    def cluster_id(self) -> str:
        return self._keys.cluster_id

    @property
    def purpose(self) -> bytes:
        return self._purpose

    @property
    def role(self) -> Role:
        return self._role

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """(host, port) of the peer, or None for a non-IP socket such as a socketpair."""
        return self._peer_address

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def send(self, payload: bytes, associated: bytes = b"") -> None:
        """Seal and send one frame; `associated` must match what the receiver passes to recv."""
        with self._send_lock:
            self._check_open()
            if len(payload) > self._max_payload:
                raise ChannelError(
                    f"payload of {len(payload)} bytes exceeds the channel limit of "
                    f"{self._max_payload} bytes"
                )
            try:
                started = time.perf_counter()
                sealed = self._sealer.seal(payload, associated)
                self.seal_seconds += time.perf_counter() - started
                send_frame(self._sock, sealed)
            except ChannelError as error:
                self._check_open()  # close() from another thread interrupted the write
                self._fail(str(error), logging.INFO)
                raise

    def set_send_timeout(self, timeout_s: float) -> None:
        """Bound each later send by `timeout_s` instead of the handshake's deadline (a bulk
        transfer over a slow link takes longer per frame than a handshake may)."""
        self._sock.settimeout(timeout_s)

    def recv(self, timeout_s: float, associated: bytes = b"") -> bytes:
        """The next payload. ChannelTimeout if none arrived (channel still open); else any
        failure closes the channel and raises ChannelError."""
        with self._recv_lock:
            self._check_open()
            try:
                frame = recv_frame(self._sock, timeout_s, self._max_payload + FRAME_OVERHEAD)
            except ChannelTimeout:
                self._check_open()  # close() from another thread while we waited
                raise
            except ChannelError as error:
                self._check_open()
                self._fail(str(error), logging.INFO)
                raise
            try:
                started = time.perf_counter()
                opened = self._opener.open(frame, associated)
                self.open_seconds += time.perf_counter() - started
                return opened
            except ChannelError as error:
                self._fail(str(error), logging.WARNING)  # possible tampering: worth a warning
                raise

    def close(self) -> None:
        """Close the channel and its socket; a receiver blocked in another thread wakes up."""
        self._close("closed locally")

    def __enter__(self) -> SecureChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"SecureChannel({self._role}, purpose={self._purpose!r}, "
            f"peer={_describe(self._peer_address)}, session={self.session_id.hex()[:8]}, {state})"
        )

    def _check_open(self) -> None:
        reason = self._closed_reason
        if reason is not None:
            raise ChannelError(f"channel closed ({reason})")

    def _fail(self, reason: str, level: int) -> None:
        logger.log(
            level,
            "closing %s channel with %s: %s",
            self._purpose.decode(errors="replace"),
            _describe(self._peer_address),
            reason,
        )
        self._close(reason)

    def _close(self, reason: str) -> None:
        with self._state_lock:
            if self._closed_reason is not None:
                return
            self._closed_reason = reason
        _close_socket(self._sock)


def _handshake(
    sock: socket.socket, cluster_key: bytes, purpose: bytes, timeout_s: float, role: Role
) -> SessionKeys:
    if len(cluster_key) != cluster_keys.KEY_BYTES:
        raise ValueError(
            f"cluster key must be {cluster_keys.KEY_BYTES} bytes, got {len(cluster_key)}"
        )
    if not 0 < len(purpose) <= MAX_PURPOSE_BYTES:
        raise ValueError(f"purpose must be 1 to {MAX_PURPOSE_BYTES} bytes, got {len(purpose)}")
    deadline = time.monotonic() + timeout_s
    peer = _describe(_peer_address(sock))
    try:
        sock.settimeout(timeout_s)  # bounds every later send; reads use their own deadlines
        if role == "client":
            return _client_handshake(sock, cluster_key, purpose, deadline)
        return _server_handshake(sock, cluster_key, purpose, deadline)
    except ChannelError as error:
        _close_socket(sock)
        # The caller reports it (a listener's HandshakeGate once per source, not per connection).
        logger.debug("%s handshake with %s (purpose %r) failed: %s", role, peer, purpose, error)
        raise ChannelError(
            f"secure {purpose.decode(errors='replace')} handshake with {peer} failed: {error}"
        ) from None
    except OSError as error:
        _close_socket(sock)
        raise ChannelError(f"secure handshake with {peer} failed: {error}") from None


def _client_handshake(
    sock: socket.socket, cluster_key: bytes, purpose: bytes, deadline: float
) -> SessionKeys:
    private = X25519PrivateKey.generate()
    client_public = private.public_key().public_bytes_raw()
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    header = HELLO_MAGIC + bytes([PROTOCOL_VERSION, len(purpose)])
    send_frame(sock, header + purpose + client_public + client_nonce)

    answer = _recv_handshake_frame(sock, deadline, "the server's answer")
    if len(answer) != PUBLIC_KEY_BYTES + NONCE_BYTES + PROOF_BYTES:
        raise ChannelError(f"the server's answer is {len(answer)} bytes, not a tandem answer")
    server_public = answer[:PUBLIC_KEY_BYTES]
    server_nonce = answer[PUBLIC_KEY_BYTES : PUBLIC_KEY_BYTES + NONCE_BYTES]
    server_proof = answer[PUBLIC_KEY_BYTES + NONCE_BYTES :]
    transcript = _transcript(purpose, client_public, server_public, client_nonce, server_nonce)
    if not hmac.compare_digest(server_proof, _proof(cluster_key, transcript, b"server")):
        raise ChannelError("peer failed to prove the cluster key (or serves another purpose)")
    shared = _exchange(private, server_public)
    send_frame(sock, _proof(cluster_key, transcript, b"client"))
    return derive_session_keys(shared, cluster_key, hashlib.sha256(transcript).digest())


def _server_handshake(
    sock: socket.socket, cluster_key: bytes, purpose: bytes, deadline: float
) -> SessionKeys:
    hello = _recv_handshake_frame(sock, deadline, "the client's hello")
    client_purpose, client_public, client_nonce = _parse_hello(hello)
    if client_purpose != purpose:
        raise ChannelError(
            f"peer asked for a {client_purpose!r} channel but this endpoint serves {purpose!r}"
        )
    private = X25519PrivateKey.generate()
    server_public = private.public_key().public_bytes_raw()
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    shared = _exchange(private, client_public)
    transcript = _transcript(purpose, client_public, server_public, client_nonce, server_nonce)
    send_frame(sock, server_public + server_nonce + _proof(cluster_key, transcript, b"server"))

    try:
        client_proof = _recv_handshake_frame(sock, deadline, "the client's proof")
    except ChannelTimeout:
        raise
    except ChannelError as error:
        raise ChannelError(
            f"peer failed to prove the cluster key: it hung up instead ({error}); "
            f"it probably holds a different cluster key"
        ) from None
    if not hmac.compare_digest(client_proof, _proof(cluster_key, transcript, b"client")):
        raise ChannelError("peer failed to prove the cluster key")
    return derive_session_keys(shared, cluster_key, hashlib.sha256(transcript).digest())


def _parse_hello(hello: bytes) -> tuple[bytes, bytes, bytes]:
    fixed = len(HELLO_MAGIC) + 2
    if len(hello) < fixed or not hello.startswith(HELLO_MAGIC):
        raise ChannelError("the peer did not send a tandem secure channel hello")
    version, purpose_length = hello[len(HELLO_MAGIC)], hello[len(HELLO_MAGIC) + 1]
    if version != PROTOCOL_VERSION:
        raise ChannelError(
            f"peer speaks secure channel version {version}, this node speaks {PROTOCOL_VERSION}; "
            f"run the same tandem version on every node"
        )
    if len(hello) != fixed + purpose_length + PUBLIC_KEY_BYTES + NONCE_BYTES:
        raise ChannelError(f"the client's hello is {len(hello)} bytes, which does not add up")
    purpose = hello[fixed : fixed + purpose_length]
    client_public = hello[fixed + purpose_length : fixed + purpose_length + PUBLIC_KEY_BYTES]
    client_nonce = hello[fixed + purpose_length + PUBLIC_KEY_BYTES :]
    return purpose, client_public, client_nonce


def _recv_handshake_frame(sock: socket.socket, deadline: float, what: str) -> bytes:
    remaining = deadline - time.monotonic()
    try:
        # No grace for the body: a peer trickling its hello must finish within the deadline.
        return recv_frame(sock, max(remaining, 0.0), HANDSHAKE_FRAME_LIMIT, body_grace_s=0.0)
    except ChannelTimeout:
        raise ChannelTimeout(f"timed out waiting for {what}") from None


def _transcript(
    purpose: bytes,
    client_public: bytes,
    server_public: bytes,
    client_nonce: bytes,
    server_nonce: bytes,
) -> bytes:
    return (
        PROTOCOL_LABEL
        + bytes([len(purpose)])
        + purpose
        + client_public
        + server_public
        + client_nonce
        + server_nonce
    )


def _proof(cluster_key: bytes, transcript: bytes, role: bytes) -> bytes:
    return hmac.new(cluster_key, transcript + role, hashlib.sha256).digest()


def _exchange(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:  # a low-order point gives an all-zero secret
        raise ChannelError(f"peer sent an unusable X25519 public key: {error}") from None


def _peer_address(sock: socket.socket) -> tuple[str, int] | None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        address = sock.getpeername()
    except OSError:
        return None
    return str(address[0]), int(address[1])


def _describe(address: tuple[str, int] | None) -> str:
    if address is None:
        return "a local peer"
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _close_socket(sock: socket.socket) -> None:
    # shutdown first: close alone does not wake a thread blocked in poll on this socket.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
