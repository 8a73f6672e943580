"""BatchScheduler: the engine core's continuous-batching loop, on a thread that owns the engine.

Between two steps it applies what arrived (new requests, aborts, a prefix-cache eviction),
admits waiting requests into the batch (up to `max_batch`), steps the engine once and
reports the step: every token, who joined, who ended. It ends a sequence on its own only
for what tokens alone decide (EOS, max_tokens, an engine error); text (stop strings),
clients and deadlines belong to the API side (engines/core/runner.py), which aborts.

Reports go to `sink` on the scheduler thread: the runner itself when the core runs in the
serving process, the channel to it when the core runs in a process of its own
(engines/core/core_process.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.core.engine import Engine, StepOutput
from engines.core.request import GenerationRequest
from errors import EngineError

log = logging.getLogger(__name__)

SHUTTING_DOWN = "server is shutting down"


class Ended:
    """Why the core let a sequence go (StepReport.ended)."""

    EOS = "eos"
    LENGTH = "length"
    ABORTED = "aborted"  # the API side asked (stop string, cancel, deadline, shutdown)
    ERROR = "error"  # the engine refused or dropped it, or the step failed


@dataclass(slots=True)
class Release:
    """One sequence the core no longer holds: why, and its engine step seconds."""

    uid: int
    reason: str
    error: str | None = None
    step_times: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class StepReport:
    """What happened in the core since the last report, in the order it happened."""

    admitted: list[tuple[int, int, float]] = field(default_factory=list)  # uid, cached, when
    outputs: list[StepOutput] = field(default_factory=list)
    ended: list[Release] = field(default_factory=list)
    steps: int = 0  # engine steps so far
    evicted_bytes: int | None = None  # set when an eviction ran

    def __bool__(self) -> bool:
        return bool(self.admitted or self.outputs or self.ended or self.evicted_bytes is not None)


class _Running:
    """What the core tracks per admitted sequence: enough to end it without its text."""

    __slots__ = ("max_tokens", "generated")

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.generated = 0


class BatchScheduler:
    """Owns `engine` on a thread of its own; thread-safe add / abort / evict / close."""

    def __init__(self, engine: Engine, max_batch: int, sink: Callable[[StepReport], None]) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._sink = sink
        self._wakeup = threading.Condition()
        self._pending: deque[tuple[int, GenerationRequest]] = deque()
        self._aborts: set[int] = set()
        self._eviction_keep: float | None = None
        self._closed = False
        self._running: dict[int, _Running] = {}
        self._eos: set[int] | None = None  # the engine's, read at the first insert
        self.steps = 0
        self._loaded = threading.Event()
        self.load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="engine-core", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, load_timeout_s: float | None = None) -> None:
        """Start the thread; wait until the engine loaded (re-raising its error)."""
        self._thread.start()
        if not self._loaded.wait(load_timeout_s):
            raise EngineError(f"engine did not load within {load_timeout_s} s")
        if self.load_error is not None:
            raise self.load_error

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Stop the loop; the thread closes the engine (here, when it never started)."""
        with self._wakeup:
            if self._closed:
                return
            self._closed = True
            self._wakeup.notify_all()
        if not self._thread.is_alive() and not self._thread.ident:
            self.engine.close()
            return
        self.engine.abort(SHUTTING_DOWN)  # a step (or load) blocked on a remote worker returns
        self._thread.join(join_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "the engine thread is still busy after %g s; it closes the engine when done",
                join_timeout_s,
            )

    # -- what the API side asks --------------------------------------------------------------

    def add(self, uid: int, request: GenerationRequest) -> None:
        with self._wakeup:
            self._pending.append((uid, request))
            self._wakeup.notify()

    def abort(self, uids: list[int]) -> None:
        """End these sequences (queued or running) at the next step boundary."""
        with self._wakeup:
            self._aborts.update(uids)
            self._wakeup.notify()

    def evict(self, keep_fraction: float) -> None:
        """Have engine.evict_prefix_cache run between two steps; requests merge into the
        smallest fraction."""
        with self._wakeup:
            pending = self._eviction_keep
            self._eviction_keep = keep_fraction if pending is None else min(pending, keep_fraction)
            self._wakeup.notify()

    # -- the thread --------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self.engine.load()
        except BaseException as error:  # reported to start(), which re-raises it
            self.load_error = error
            self._loaded.set()
            self._close_engine()
            return
        self._loaded.set()
        try:
            while True:
                report = StepReport()
                if not self._between_steps(report):
                    break
                stepped = bool(self._running)
                self._step(report)
                report.steps = self.steps
                if report or stepped:  # every step: the API side checks deadlines then
                    self._sink(report)
        finally:
            report = StepReport(steps=self.steps)
            self._fail_running(SHUTTING_DOWN, report)
            with self._wakeup:
                waiting, self._pending = list(self._pending), deque()
            report.ended += [Release(uid, Ended.ERROR, SHUTTING_DOWN) for uid, _ in waiting]
            if report:
                self._sink(report)
            self._close_engine()

    def _between_steps(self, report: StepReport) -> bool:
        """Apply aborts and evictions, admit what fits; block while there is nothing to do.
        False once closed."""
        with self._wakeup:
            while (
                not self._closed
                and not self._pending
                and not self._running
                and not self._aborts
                and self._eviction_keep is None
            ):
                self._wakeup.wait()
            if self._closed:
                return False
            aborts, self._aborts = self._aborts, set()
            keep_fraction, self._eviction_keep = self._eviction_keep, None
            if aborts:
                kept = [(uid, request) for uid, request in self._pending if uid not in aborts]
                for uid, _ in self._pending:
                    if uid in aborts:
                        report.ended.append(Release(uid, Ended.ABORTED))
                self._pending = deque(kept)
            admitted = []
            while self._pending and len(self._running) + len(admitted) < self.max_batch:
                admitted.append(self._pending.popleft())
        running = [uid for uid in aborts if uid in self._running]
        if running:
            self._release(running, Ended.ABORTED, report)
        if keep_fraction is not None:  # first: free memory before new sequences take some
            report.evicted_bytes = self._evict(keep_fraction)  # None: it failed
        for uid, request in admitted:
            self._insert(uid, request, report)
        return True

    def _evict(self, keep_fraction: float) -> int | None:
        try:
            return self.engine.evict_prefix_cache(keep_fraction)
        except Exception:  # an eviction that failed must not take the batch with it
            log.exception("prefix-cache eviction (keep %.0f%%) failed", keep_fraction * 100)
            return None

    def _insert(self, uid: int, request: GenerationRequest, report: StepReport) -> None:
        admitted_at = time.monotonic()
        if self._eos is None:
            self._eos = set(self.engine.eos_token_ids)
        try:
            cached_tokens = self.engine.insert(uid, request) or 0
        except EngineError as error:
            report.ended.append(Release(uid, Ended.ERROR, str(error)))
            return
        self._running[uid] = _Running(request.max_tokens)
        report.admitted.append((uid, cached_tokens, admitted_at))

    def _step(self, report: StepReport) -> None:
        if not self._running:
            return
        try:
            outputs = self.engine.step()
        except EngineError as failure:
            log.error("engine step failed with %d sequences: %s", len(self._running), failure)
            self._fail_running(str(failure), report)
            return
        except Exception as failure:  # an engine bug must not kill the scheduler thread
            log.exception("engine step crashed with %d sequences", len(self._running))
            self._fail_running(f"internal engine error: {failure}", report)
            return
        self.steps += 1
        ended: dict[str, list[int]] = {}
        errors: dict[int, str] = {}
        for output in outputs:
            running = self._running.get(output.uid)
            if running is None:  # removed earlier; a token already in flight
                continue
            if output.error is not None:
                errors[output.uid] = output.error
                ended.setdefault(Ended.ERROR, []).append(output.uid)
                continue
            report.outputs.append(output)
            if output.token in (self._eos or ()):
                ended.setdefault(Ended.EOS, []).append(output.uid)
                continue
            running.generated += 1
            if running.generated >= running.max_tokens:
                ended.setdefault(Ended.LENGTH, []).append(output.uid)
        for reason, uids in ended.items():
            self._release(uids, reason, report, errors)

    def _release(
        self,
        uids: list[int],
        reason: str,
        report: StepReport,
        errors: dict[int, str] | None = None,
    ) -> None:
        """Take `uids` out of the batch (their KV goes to the prefix cache) and report them."""
        for uid in uids:
            self._running.pop(uid, None)
            error = (errors or {}).get(uid)  # its step times before remove() forgets them
            report.ended.append(Release(uid, reason, error, self.engine.step_times(uid)))
        try:
            self.engine.remove(uids)
        except EngineError as failure:  # the next step reports the loss to everyone left
            log.error("removing %d sequences failed: %s", len(uids), failure)

    def _fail_running(self, error: str, report: StepReport) -> None:
        """Every running sequence ends with `error` (a lost rank or stage takes the batch)."""
        uids = list(self._running)
        if uids:
            self._release(uids, Ended.ERROR, report, dict.fromkeys(uids, error))

    def _close_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:  # closing must never hide the reason the thread is ending
            log.exception("closing the engine failed")
