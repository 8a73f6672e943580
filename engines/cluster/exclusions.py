"""MemberExclusions: members whose worker keeps failing sit out of plans for a growing back-off."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FAILURES_BEFORE_EXCLUSION = 2  # one failure may be bad luck; two in a row is the member
FIRST_EXCLUSION_S = 30.0  # doubles with every further failure, up to MAX_EXCLUSION_S
MAX_EXCLUSION_S = 600.0


@dataclass(frozen=True, slots=True)
class Exclusion:
    failures: int
    reason: str
    until: float  # monotonic time; 0 while not excluded


class MemberExclusions:
    """Counts consecutive worker failures per member; a success (served plan) clears them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._members: dict[str, Exclusion] = {}
        self._lock = threading.Lock()

    def record_failure(self, node_id: str, reason: str) -> None:
        with self._lock:
            failures = self._members.get(node_id, Exclusion(0, "", 0.0)).failures + 1
            until = 0.0
            if failures >= FAILURES_BEFORE_EXCLUSION:
                extra = failures - FAILURES_BEFORE_EXCLUSION
                until = self._clock() + min(FIRST_EXCLUSION_S * 2**extra, MAX_EXCLUSION_S)
            self._members[node_id] = Exclusion(failures, reason, until)

    def record_success(self, plan: Any) -> None:
        """Every member of a plan that started and serves has a clean slate again."""
        members = set(plan.ranks) | {stage.node_id for stage in plan.stages}
        with self._lock:
            for node_id in members:
                self._members.pop(node_id, None)

    def excluded_now(self) -> set[str]:
        now = self._clock()
        with self._lock:
            return {node for node, entry in self._members.items() if entry.until > now}

    def describe(self) -> list[dict[str, Any]]:
        """For /v1/cluster: who sits out, why, and for how much longer."""
        now = self._clock()
        with self._lock:
            return [
                {
                    "node_id": node,
                    "failures": entry.failures,
                    "reason": entry.reason,
                    "excluded_for_s": round(entry.until - now, 1),
                }
                for node, entry in self._members.items()
                if entry.until > now
            ]
