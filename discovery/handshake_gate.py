"""HandshakeGate: newcomers prove the cluster key on threads of their own, bounded in time and
in number, so a session already running never waits on a stranger.

A listener that ran the handshake inline let one silent TCP connection hold it for the whole
handshake timeout, and a few of them broke a running pipeline. Here one thread only accepts;
each pending connection gets a handshake thread with a short deadline; pending connections are
capped per source address and in total (the oldest is dropped to make room, so a real peer,
which answers in milliseconds, still gets through a flood); failures are logged once per source
and minute, not once per connection.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from discovery.framing import wait_readable

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_DEADLINE_S = 2.0  # a peer on the LAN proves the key in milliseconds
DEFAULT_MAX_PENDING = 128
DEFAULT_MAX_PER_SOURCE = 32
ACCEPT_POLL_S = 0.2  # how fast stop() is noticed
LOG_EVERY_S = 60.0
MAX_LOGGED_SOURCES = 1024


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    source: str
    since: float = field(default_factory=time.monotonic)


class RefusalLog:
    """Logs a refused source once per LOG_EVERY_S, with how many more it tried meanwhile."""

    def __init__(self, what: str, every_s: float = LOG_EVERY_S) -> None:
        self.what = what
        self.every_s = every_s
        self._lock = threading.Lock()
        self._sources: dict[str, tuple[float, int]] = {}  # source -> (last logged, unlogged)
        self.refused = 0  # every refusal, logged or not

    def note(self, source: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            last, unlogged = self._sources.get(source, (float("-inf"), 0))
            if now - last < self.every_s:
                self._sources[source] = (last, unlogged + 1)
                return
            if len(self._sources) >= MAX_LOGGED_SOURCES:
                self._sources.clear()  # a flood of sources: start over rather than grow
            self._sources[source] = (now, 0)
        more = f" ({unlogged} more refused since the last report)" if unlogged else ""
        log.warning("%s: refused a connection from %s: %s%s", self.what, source, reason, more)


class HandshakeGate(Generic[T]):
    """Accepts on `listener`, runs `prove(sock, deadline_s)` per connection on its own thread,
    and hands each proven peer to `admit(proven, address)` (called on that thread).

    `prove` raises (any OSError or tandem ChannelError) to refuse; it owns the socket then.
    The listener stays the caller's: stop() ends the gate's threads, not the listener.
    """

    def __init__(
        self,
        listener: socket.socket,
        prove: Callable[[socket.socket, float], T],
        admit: Callable[[T, Any], None],
        what: str,
        deadline_s: float = DEFAULT_DEADLINE_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_per_source: int = DEFAULT_MAX_PER_SOURCE,
    ) -> None:
        self.listener = listener
        self.what = what
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.refusals = RefusalLog(what)
        self._prove = prove
        self._admit = admit
        self._lock = threading.Lock()
        self._pending: set[_Pending] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HandshakeGate[T]:
        self._thread = threading.Thread(target=self._accept_loop, name=f"{self.what}-gate")
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop accepting and drop every pending handshake; the listener stays open."""
        self._stopping.set()
        with self._lock:
            pending = list(self._pending)
        for entry in pending:
            _drop(entry.sock)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if not wait_readable(self.listener, ACCEPT_POLL_S):
                    continue
                sock, address = self.listener.accept()
            except (OSError, ValueError):  # closed under us, or a transient accept error
                if self._stopping.is_set() or self.listener.fileno() < 0:
                    return
                time.sleep(ACCEPT_POLL_S)
                continue
            if self._stopping.is_set():
                sock.close()
                return
            entry = _Pending(sock, str(address[0]))
            self._make_room(entry.source)
            with self._lock:
                self._pending.add(entry)
            threading.Thread(
                target=self._handshake, args=(entry, address), name=f"{self.what}-handshake",
                daemon=True,
            ).start()

    def _make_room(self, source: str) -> None:
        """Drop the oldest pending connection of `source`, or of all, when at the cap."""
        with self._lock:
            same = [entry for entry in self._pending if entry.source == source]
            pool = same if len(same) >= self.max_per_source else None
            if pool is None and len(self._pending) >= self.max_pending:
                pool = list(self._pending)
            victim = min(pool, key=lambda entry: entry.since) if pool else None
        if victim is not None:
            self.refusals.note(victim.source, "dropped: too many handshakes pending")
            _drop(victim.sock)

    def _handshake(self, entry: _Pending, address: Any) -> None:
        try:
            entry.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            proven = self._prove(entry.sock, self.deadline_s)
        except Exception as error:  # noqa: BLE001 - every refusal ends here, logged by source
            entry.sock.close()
            if not self._stopping.is_set():
                self.refusals.note(entry.source, str(error))
            return
        finally:
            with self._lock:
                self._pending.discard(entry)
        if self._stopping.is_set():
            entry.sock.close()
            return
        try:
            self._admit(proven, address)
        except Exception:  # an admitted peer's failure is the session's, not the gate's
            log.exception("%s: admitting %s failed", self.what, entry.source)
            entry.sock.close()


def _drop(sock: socket.socket) -> None:
    """Wake a handshake blocked on `sock` (it fails at once); its thread closes the socket."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
