"""Length-prefixed frames over a blocking TCP socket, where every read has a deadline."""

from __future__ import annotations

import select
import socket
import struct
import time

from errors import ChannelError

MAX_FRAME_BYTES = 64 * 1024 * 1024
HEADER = struct.Struct(">I")  # body length, big-endian


class ChannelTimeout(ChannelError):
    """Nothing arrived before the deadline; no byte was consumed, so the stream is still usable."""


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """Open a TCP connection with TCP_NODELAY; `timeout_s` bounds the connect and later sends."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as error:
        raise ChannelError(
            f"cannot connect to {host}:{port} within {timeout_s} s: {error}"
        ) from error
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Write one frame; the socket's own timeout (set once, never per call) bounds the write."""
    if len(payload) > 0xFFFFFFFF:
        raise ChannelError(f"frame of {len(payload)} bytes does not fit a 4-byte length prefix")
    try:
        sock.sendall(HEADER.pack(len(payload)) + payload)
    except TimeoutError as error:
        raise ChannelError(f"timed out sending a {len(payload)}-byte frame") from error
    except OSError as error:
        raise ChannelError(f"sending a {len(payload)}-byte frame failed: {error}") from error


BODY_TIMEOUT_S = 10.0  # the longest a started frame may take to finish arriving


def recv_frame(
    sock: socket.socket,
    timeout_s: float,
    max_size: int = MAX_FRAME_BYTES,
    body_grace_s: float = BODY_TIMEOUT_S,
) -> bytes:
    """Read one frame within `timeout_s`; the length is checked against `max_size` first.

    Raises ChannelTimeout when nothing at all arrived in time (the caller may try again), and
    ChannelError for an oversized length, end of stream, or a timeout in the middle of a frame.
    """
    deadline = time.monotonic() + timeout_s
    header = bytearray(HEADER.size)
    received, closed = _read_into(sock, memoryview(header), deadline, "frame header")
    if received == 0 and not closed:
        raise ChannelTimeout(f"no frame arrived within {timeout_s} s")
    if received < HEADER.size:
        _raise_short(received, HEADER.size, closed, timeout_s, "frame header")
    (length,) = HEADER.unpack(header)
    if length > max_size:
        raise ChannelError(f"frame length {length} exceeds the limit of {max_size} bytes")
    body = bytearray(length)
    # A frame whose header arrived gets its own deadline for the body, so a header landing
    # just before a short poll timeout is not mistaken for a stalled peer.
    body_deadline = max(deadline, time.monotonic() + body_grace_s)
    received, closed = _read_into(sock, memoryview(body), body_deadline, "frame body")
    if received < length:
        _raise_short(received, length, closed, timeout_s, "frame body")
    return bytes(body)


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """True when `sock` has data (or EOF) to read within `timeout_s`; waits without settimeout."""
    if sock.fileno() < 0:
        raise ChannelError("the socket is closed")
    timeout_s = max(timeout_s, 0.0)
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(timeout_s * 1000.0))
    readable, _, _ = select.select([sock], [], [], timeout_s)
    return bool(readable)


def _read_into(
    sock: socket.socket, buffer: memoryview, deadline: float, what: str
) -> tuple[int, bool]:
    """Fill `buffer` until full, end of stream or the deadline: (bytes read, peer closed).

    Waiting uses poll rather than sock.settimeout so that a sender in another thread keeps
    the socket's own timeout.
    """
    filled = 0
    while filled < len(buffer):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not wait_readable(sock, remaining):
            return filled, False
        try:
            count = sock.recv_into(buffer[filled:])
        except (BlockingIOError, InterruptedError, TimeoutError):
            continue
        except OSError as error:
            raise ChannelError(f"reading the {what} failed: {error}") from error
        if count == 0:
            return filled, True
        filled += count
    return filled, False


def _raise_short(received: int, expected: int, closed: bool, timeout_s: float, what: str) -> None:
    if closed:
        raise ChannelError(
            f"connection closed by peer after {received} of {expected} bytes of the {what}"
        )
    raise ChannelError(
        f"timed out after {timeout_s} s with {received} of {expected} bytes of the {what}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS handed out on `host` a moment ago (loopback clusters, tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
