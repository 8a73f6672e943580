"""Waiting for an assignment's outcome: the coordinator blocks until the agent's worker is
ready or has its model in place, while the receiving thread settles it (ready, failed, lost).
Transfer progress extends a wait, because a big model takes what it takes. Membership holds
the pending assignments and the lock; this is the waiting side of them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from errors import PeerError


@dataclass(frozen=True, slots=True)
class AssignmentResult:
    """A worker that reported ready."""

    node_id: str
    assignment_id: str
    detail: dict[str, Any]


@dataclass(slots=True)
class _Pending:
    node_id: str
    done: threading.Event = field(default_factory=threading.Event)
    detail: dict[str, Any] | None = None
    failure: str | None = None
    progress_at: float | None = None  # monotonic time of the last transfer progress
    arrived: threading.Event = field(default_factory=threading.Event)  # model in place


class AssignmentWaits:
    """The waits on pending assignments; the class that mixes this in owns `_pending`
    (assignment id -> _Pending) and `_lock`, which guards it."""

    _pending: dict[str, _Pending]
    _lock: threading.Lock

    def _settle(
        self, assignment_id: str, detail: dict[str, Any] | None = None, failure: str | None = None
    ) -> bool:
        """Give an unsettled assignment its outcome; False when it had one already."""
        with self._lock:
            pending = self._pending.get(assignment_id)
            if pending is None or pending.done.is_set():
                return False
            pending.detail, pending.failure = detail, failure
            pending.done.set()
            pending.arrived.set()
            return True

    def wait_ready(
        self, assignment_id: str, timeout_s: float, stall_s: float | None = None
    ) -> AssignmentResult:
        """Block until the worker is ready; PeerError when it failed, was lost, or timed out.

        With `stall_s`, transfer progress extends the wait: it ends only once `timeout_s`
        has passed and no progress came for `stall_s` (a big model takes what it takes).
        """
        pending = self._waiting(assignment_id)
        try:
            self._wait(pending, pending.done, assignment_id, "ready", timeout_s, stall_s)
            return AssignmentResult(pending.node_id, assignment_id, pending.detail or {})
        finally:
            with self._lock:
                self._pending.pop(assignment_id, None)

    def failure_of(self, assignment_id: str) -> str | None:
        """Why a pending assignment failed, if it has; the wait on it stays open (a caller
        busy with its own side of the work can stop early without settling it)."""
        with self._lock:
            pending = self._pending.get(assignment_id)
            if pending is None or not pending.done.is_set():
                return None
            return pending.failure

    def wait_model(
        self, assignment_id: str, timeout_s: float, stall_s: float | None = None
    ) -> None:
        """Block until the worker has its model in place (received, cached or found there),
        or is ready; PeerError as wait_ready. The assignment stays pending."""
        pending = self._waiting(assignment_id)
        what = "its model in place"
        self._wait(pending, pending.arrived, assignment_id, what, timeout_s, stall_s)

    def _waiting(self, assignment_id: str) -> _Pending:
        with self._lock:
            pending = self._pending.get(assignment_id)
        if pending is None:
            raise PeerError(f"unknown assignment {assignment_id}")
        return pending

    def _wait(
        self,
        pending: _Pending,
        event: threading.Event,
        assignment_id: str,
        what: str,
        timeout_s: float,
        stall_s: float | None,
    ) -> None:
        started = time.monotonic()
        while not event.wait(self._ready_wait(pending, started, timeout_s, stall_s)):
            if self._ready_wait(pending, started, timeout_s, stall_s) > 0:
                continue  # progress came meanwhile
            stalled = ""
            if (
                stall_s is not None
                and pending.progress_at is not None
                and not pending.arrived.is_set()
            ):
                stalled = f" (its model transfer stalled: no progress for {stall_s:g} s)"
            raise PeerError(
                f"node {pending.node_id} did not report {what} for assignment {assignment_id} "
                f"within {timeout_s} s{stalled}"
            )
        if pending.failure is not None:
            raise PeerError(
                f"node {pending.node_id} failed assignment {assignment_id}: {pending.failure}"
            )

    @staticmethod
    def _ready_wait(
        pending: _Pending, started: float, timeout_s: float, stall_s: float | None
    ) -> float:
        """Seconds left to wait: to the ready deadline, or later while transfers progress."""
        deadline = started + timeout_s
        if stall_s is not None and pending.progress_at is not None:
            # Once the model is all there, loading it gets a whole ready timeout of its own.
            extra = timeout_s if pending.arrived.is_set() else stall_s
            deadline = max(deadline, pending.progress_at + extra)
        return max(deadline - time.monotonic(), 0.0)
