"""ReplanHistory: the supervisor's recent re-plans, and a count per kind of reason for metrics."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

HISTORY_LENGTH = 50
# (kind, a phrase the supervisor's reason contains), checked in order; the first match wins.
# Kinds are a small fixed set so the metric label cannot grow without bound.
REASON_KINDS = (
    ("worker_failed", "its worker failed"),
    ("member_lost", "lost:"),
    ("engine_unhealthy", "engine became unhealthy"),
    ("membership_changed", "membership changed"),
)
OTHER_KIND = "other"


def reason_kind(reason: str) -> str:
    """The metric label for a re-plan reason, e.g. "member m2 lost: ..." → "member_lost"."""
    for kind, phrase in REASON_KINDS:
        if phrase in reason:
            return kind
    return OTHER_KIND


class ReplanHistory:
    """Thread-safe: the membership and watch threads record, /v1/cluster reads."""

    def __init__(self, length: int = HISTORY_LENGTH) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=length)
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def record(self, reason: str) -> None:
        """A re-plan was asked for: the engine is out of service from now on."""
        kind = reason_kind(reason)
        with self._lock:
            self._counts[kind] += 1
            entry = {"at": time.time(), "reason": reason, "kind": kind, "strategy": None}
            self._entries.append(entry)

    def served(self, strategy: str) -> None:
        """The re-plan succeeded: the requests since the last success now run as `strategy`."""
        now = time.time()
        with self._lock:
            for entry in self._entries:
                if entry["strategy"] is None:
                    entry["strategy"] = strategy
                    entry["outage_s"] = round(now - entry["at"], 3)

    def describe(self) -> list[dict[str, Any]]:
        """Newest first."""
        with self._lock:
            return [dict(entry) for entry in reversed(self._entries)]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
