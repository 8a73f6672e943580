"""Measuring the link to a member over its control channel: pings of a few bytes give the
latency, pings padded with a quarter of a megabyte (echoed back) give the bandwidth. Membership
mixes this in; its receiving thread hands every Pong to `_pong`.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from discovery.control import MAX_PING_PADDING, Ping, Pong
from discovery.members import CONNECTED, Link
from errors import ChannelError, PeerError

SMALL_PINGS = 5  # the fastest of these is the round trip
LARGE_PINGS = 3
PING_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    """One member's link as the coordinator measured it."""

    latency_s: float  # one way: half the fastest small round trip
    bytes_per_s: float  # padding sent both ways over the extra time a padded round trip took


class LinkProbes:
    """Pings over control connections; the class that mixes this in owns `_links`, `_lock`
    and `_pings` (nonce -> the event its Pong sets)."""

    _links: dict[str, Link]
    _lock: threading.Lock
    _pings: dict[int, threading.Event]

    def _pong(self, message: Pong) -> None:
        with self._lock:
            waiting = self._pings.get(message.nonce)
        if waiting is not None:
            waiting.set()

    def measure_link(self, node_id: str) -> LinkMeasurement:
        """Latency and bandwidth of the link to `node_id`; PeerError when it does not answer."""
        small = min(self._round_trip(node_id, 0) for _ in range(SMALL_PINGS))
        large = min(self._round_trip(node_id, MAX_PING_PADDING) for _ in range(LARGE_PINGS))
        carried = 2 * MAX_PING_PADDING
        return LinkMeasurement(small / 2, carried / max(large - small, 1e-6))

    def _round_trip(self, node_id: str, padding: int) -> float:
        with self._lock:
            link = self._links.get(node_id)
            if link is None or link.state != CONNECTED or link.connection is None:
                raise PeerError(f"cannot measure the link to node {node_id}: it is not connected")
            connection = link.connection
            nonce = next(_NONCES)
            arrived = threading.Event()
            self._pings[nonce] = arrived
        try:
            started = time.perf_counter()
            connection.send(Ping(nonce=nonce, padding="x" * padding))
            if not arrived.wait(PING_TIMEOUT_S):
                raise PeerError(
                    f"node {node_id} did not answer a link probe within {PING_TIMEOUT_S:g} s"
                )
            return time.perf_counter() - started
        except ChannelError as error:
            raise PeerError(f"cannot measure the link to node {node_id}: {error}") from None
        finally:
            with self._lock:
                self._pings.pop(nonce, None)


_NONCES = itertools.count(1)
