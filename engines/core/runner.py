"""EngineRunner: the continuous-batching scheduler between the asyncio API and an Engine.

One thread owns the engine. Between steps it admits waiting requests into the batch (up to
`max_batch`), steps the engine once, hands each sequence its token, and removes every
sequence that finished, was cancelled or timed out — so a request joins and leaves the
running batch between two decode steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from engines.core.engine import (
    DEFAULT_MAX_BATCH,
    Engine,
    Failure,
    Finish,
    TokenEvent,
)
from engines.core.request import GenerationRequest
from engines.core.sequence import ActiveSequence, Ending
from planner.errors import EngineError, QueueFullError

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 8
SHUTTING_DOWN = "server is shutting down"


class EventPost:
    """Hands token events from the scheduler thread to the event loops that wait for them.

    While the scheduler steps, events are held and then handed over in one wakeup per loop
    (with 16 streams, one instead of 16 cross-thread calls, each a write to the loop's
    wakeup pipe, every step); from any other thread, or between steps, at once.
    """

    def __init__(self) -> None:
        self._held: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenEvent]]] = {}
        self._holder: int | None = None  # the thread holding events, while it steps

    def post(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, event: TokenEvent
    ) -> None:
        if self._holder == threading.get_ident():
            self._held.setdefault(loop, []).append((queue, event))
        else:
            _hand_over(loop, [(queue, event)])

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Hold this thread's events until the block ends, then hand them over."""
        self._holder = threading.get_ident()
        try:
            yield
        finally:
            self._holder = None
            held, self._held = self._held, {}
            for loop, items in held.items():
                _hand_over(loop, items)


def _hand_over(
    loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, TokenEvent]]
) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _deliver(items: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class Submission:
    """A queued or running request; the API iterates its events and may cancel it."""

    def __init__(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        received_at: float | None = None,
        on_finish: Callable[[Submission, TokenEvent], None] | None = None,
        post: EventPost | None = None,
    ) -> None:
        self.request = request
        self._loop = loop
        self._post = post or EventPost()
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done = False
        # Monotonic timestamps of the latency breakdown (engines/observability/request_timing.py).
        self.submitted_at = time.monotonic()
        self.received_at = self.submitted_at if received_at is None else received_at
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.uid: int | None = None  # the engine's uid once admitted (its step times)
        self._on_finish = on_finish

    def cancel(self) -> None:
        """Ask the scheduler to drop the sequence at the next step (or skip it if queued)."""
        self.cancelled.set()

    def push(self, event: TokenEvent) -> None:
        """Called from the scheduler thread: hand the event to the event loop."""
        if event.finish_reason is not None and self.finished_at is None:
            self._report_finish(event)
        self._post.post(self._loop, self._events, event)

    def _report_finish(self, event: TokenEvent) -> None:
        self.finished_at = time.monotonic()
        if self._on_finish is not None:
            try:
                self._on_finish(self, event)
            except Exception:  # metrics or logging must never break the scheduler
                log.exception("recording request %s failed", self.request.request_id)

    def fail(self, error: str) -> None:
        self.push(
            TokenEvent(
                finish_reason=Finish.ERROR,
                error=error,
                failure=Failure.ENGINE,
                prompt_tokens=len(self.request.prompt_tokens),
            )
        )
        self.done = True

    async def next_event(self, timeout_s: float) -> TokenEvent | None:
        """The next event, or None when none came within `timeout_s` (nothing is lost)."""
        try:
            return self._events.get_nowait()  # the common case while tokens flow: no timer
        except asyncio.QueueEmpty:
            pass
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await self._events.get()
        except TimeoutError:
            return None

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield events until the final one; the caller applies its own overall timeout."""
        while True:
            event = await self._events.get()
            yield event
            if event.finish_reason is not None:
                return


class EngineRunner:
    """Schedules submissions onto one engine's batch, on a thread of its own."""

    def __init__(
        self,
        engine: Engine,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if queue_size < 1 or max_batch < 1:
            raise ValueError(
                f"queue size and max batch must be at least 1, got {queue_size}, {max_batch}"
            )
        self.engine = engine
        self.queue_size = queue_size
        self.max_batch = max_batch
        self._pending: deque[Submission] = deque()
        self._active: dict[int, ActiveSequence] = {}
        self._wakeup = threading.Condition()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._closed = False
        self._next_uid = 0
        self.steps = 0
        self._eviction_keep: float | None = None  # a requested prefix-cache eviction
        self.prefix_evictions = 0
        self.prefix_evicted_bytes = 0
        self.generated_tokens = 0  # step outputs so far: the live tokens/s of the dashboard
        self._post = EventPost()  # a step's events reach the event loop in one wakeup
        self._thread = threading.Thread(target=self._work, name="engine-runner", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, load_timeout_s: float | None = None) -> None:
        """Start the scheduler thread and wait until the engine has loaded (or failed to).

        On a time-out the caller must still close() the runner: that aborts the load where
        the engine can (remote workers) and closes the engine once load() has returned.
        """
        self._thread.start()
        if not self._loaded.wait(load_timeout_s):
            raise EngineError(f"engine did not load within {load_timeout_s} s")
        if self._load_error is not None:
            raise self._load_error

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Fail what waits or runs, stop the thread; the thread itself closes the engine.

        The engine is closed only once no step can be running on it: by the scheduler
        thread on its way out, or here when the thread never started.
        """
        with self._wakeup:
            if self._closed:
                return
            self._closed = True
            waiting = list(self._pending)
            self._pending.clear()
            self._wakeup.notify_all()
        for submission in waiting:
            submission.fail(SHUTTING_DOWN)
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

    # -- submitting --------------------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        *,
        received_at: float | None = None,
        on_finish: Callable[[Submission, TokenEvent], None] | None = None,
    ) -> Submission:
        """Queue a request; raises QueueFullError at once when the queue is full.

        `received_at` (monotonic) is when the HTTP request arrived; `on_finish` runs on the
        scheduler thread with the final event, before the API sees it.
        """
        submission = Submission(
            request, asyncio.get_running_loop(), received_at, on_finish, self._post
        )
        with self._wakeup:
            if self._closed:
                raise EngineError("the engine is shutting down")
            if len(self._pending) >= self.queue_size:
                raise QueueFullError(
                    f"request queue is full ({self.max_batch} running, {self.queue_size} "
                    "waiting); retry later"
                )
            self._pending.append(submission)
            self._wakeup.notify()
        return submission

    def request_prefix_eviction(self, keep_fraction: float) -> None:
        """From any thread: have the scheduler call engine.evict_prefix_cache between two steps
        (at once when idle); requests that meet before it runs merge into the smallest."""
        if not 0.0 <= keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be within [0, 1], got {keep_fraction}")
        with self._wakeup:
            if self._closed:
                return
            pending = self._eviction_keep
            self._eviction_keep = keep_fraction if pending is None else min(pending, keep_fraction)
            self._wakeup.notify()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def active(self) -> int:
        return len(self._active)

    def running(self) -> list[Submission]:
        """The submissions in the batch now (a snapshot)."""
        return [sequence.submission for sequence in list(self._active.values())]

    @property
    def idle(self) -> bool:
        return not self._active and not self._pending

    # -- the scheduler thread ----------------------------------------------------------------

    def _work(self) -> None:
        try:
            self.engine.load()
        except BaseException as error:  # reported to start(), which re-raises it
            self._load_error = error
            self._loaded.set()
            self._close_engine()
            return
        self._loaded.set()
        try:
            while self._admit_or_wait():
                self._step()
        finally:
            self._fail_active(SHUTTING_DOWN)
            self._close_engine()

    def _admit_or_wait(self) -> bool:
        """Move waiting requests into the batch; block while there is nothing to do.

        Returns False once the runner is closed.
        """
        with self._wakeup:
            while (
                not self._closed
                and not self._pending
                and not self._active
                and self._eviction_keep is None
            ):
                self._wakeup.wait()
            if self._closed:
                return False
            keep_fraction, self._eviction_keep = self._eviction_keep, None
            admitted = []
            while self._pending and len(self._active) + len(admitted) < self.max_batch:
                admitted.append(self._pending.popleft())
        if keep_fraction is not None:  # first: free memory before new sequences take some
            self._evict(keep_fraction)
        for submission in admitted:
            self._insert(submission)
        return True

    def _evict(self, keep_fraction: float) -> None:
        try:
            freed = self.engine.evict_prefix_cache(keep_fraction)
        except Exception:  # an eviction that failed must not take the batch with it
            log.exception("prefix-cache eviction (keep %.0f%%) failed", keep_fraction * 100)
            return
        self.prefix_evictions += 1
        self.prefix_evicted_bytes += freed
        log.log(
            logging.INFO if freed else logging.DEBUG,
            "prefix-cache eviction #%d (keep %.0f%%) freed %d bytes",
            self.prefix_evictions,
            keep_fraction * 100,
            freed,
        )

    def _insert(self, submission: Submission) -> None:
        if submission.cancelled.is_set():
            ActiveSequence(-1, submission, self.engine.tokenizer, set()).finish(
                Ending(Finish.CANCELLED)
            )
            return
        submission.admitted_at = time.monotonic()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        submission.uid = uid
        try:
            cached_tokens = self.engine.insert(uid, submission.request) or 0
        except EngineError as error:
            submission.fail(str(error))
            return
        self._active[uid] = ActiveSequence(
            uid, submission, self.engine.tokenizer, self.engine.eos_token_ids, cached_tokens
        )

    def _step(self) -> None:
        if not self._active:
            return
        try:
            outputs = self.engine.step()
        except EngineError as failure:
            log.error("engine step failed with %d sequences: %s", len(self._active), failure)
            self._fail_active(str(failure))
            return
        except Exception as failure:  # an engine bug must not kill the scheduler thread
            log.exception("engine step crashed with %d sequences", len(self._active))
            self._fail_active(f"internal engine error: {failure}")
            return
        self.steps += 1
        self.generated_tokens += len(outputs)
        ended: list[int] = []
        with self._post.holding():  # handed over before removing: that may wait on peers
            for output in outputs:
                sequence = self._active.get(output.uid)
                if sequence is None:  # removed earlier; a token already in flight
                    continue
                if output.error is not None:
                    self._end(sequence, Ending(Finish.ERROR, output.error, Failure.ENGINE), ended)
                    continue
                if output.cached_tokens is not None:
                    sequence.cached_tokens = output.cached_tokens
                reason = sequence.accept(output)
                if reason is not None:
                    self._end(sequence, Ending(reason), ended)
            now = time.monotonic()
            for sequence in list(self._active.values()):
                expired = sequence.expired(now)
                if expired is not None:
                    self._end(sequence, expired, ended)
        if ended:
            self._remove(ended)

    def _end(self, sequence: ActiveSequence, ending: Ending, ended: list[int]) -> None:
        if ending.reason is Finish.ERROR:
            log.warning("request %s failed: %s", sequence.request.request_id, ending.error)
        sequence.finish(ending)
        del self._active[sequence.uid]
        ended.append(sequence.uid)

    def _remove(self, uids: list[int]) -> None:
        try:
            self.engine.remove(uids)
        except EngineError as failure:  # the next step reports the loss to everyone left
            log.error("removing %d sequences failed: %s", len(uids), failure)

    def _fail_active(self, error: str) -> None:
        """Every running sequence ends with `error` (a lost rank or stage takes the batch)."""
        failed = list(self._active.values())
        self._active.clear()
        for sequence in failed:
            sequence.finish(Ending(Finish.ERROR, error, Failure.ENGINE))
        if failed:
            self._remove([sequence.uid for sequence in failed])

    def _close_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:  # closing must never hide the reason the thread is ending
            log.exception("closing the engine failed")
