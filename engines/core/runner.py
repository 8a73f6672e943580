"""EngineRunner: the API side of an engine core — submissions in, text events out.

The core (engines/core/scheduler.py) batches and steps the engine, in this process
(`LocalCore`) or in one of its own (engines/core/core_process.py). It reports every step's
tokens; the runner turns them into each request's text events (detokenizing, stop strings,
usage) and ends a request when its text, its client or its deadline says so, asking the core
to drop it. Requests join and leave the running batch between two steps.

"Runner" here is the API side. It is not what vLLM and nano-vllm call the model runner (the
side that runs the model's forward pass): that is the Engine (engines/core/engine.py), which
the core steps. The name is kept: it is used in some 1100 places.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from engines.core.engine import Engine, Failure, Finish, TokenEvent
from engines.core.request import GenerationRequest
from engines.core.scheduler import SHUTTING_DOWN, BatchScheduler, Ended, Release, StepReport
from engines.core.sequence import ActiveSequence, Ending
from errors import EngineError, QueueFullError
from planner.memory import DEFAULT_MAX_BATCH

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 8


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
        on_cancel: Callable[[Submission], None] | None = None,
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
        self.uid: int | None = None  # the core's uid for it
        self.step_times: dict[str, float] = {}  # the engine's step seconds, once it let go
        self.final_event: TokenEvent | None = None
        self._on_finish = on_finish
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        """Ask the core to drop the sequence at the next step (or skip it if queued)."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self._on_cancel is not None and not self.done:
                self._on_cancel(self)

    def push(self, event: TokenEvent) -> None:
        """Called from the runner's thread: hand the event to the event loop."""
        if event.finish_reason is not None and self.finished_at is None:
            self.finished_at = time.monotonic()
            self.final_event = event
        self._post.post(self._loop, self._events, event)

    def settle(self, step_times: dict[str, float]) -> None:
        """The core let it go: record it (metrics, request log) with its step times."""
        self.step_times = step_times
        if self._on_finish is None or self.final_event is None:
            return
        on_finish, self._on_finish = self._on_finish, None
        try:
            on_finish(self, self.final_event)
        except Exception:  # metrics or logging must never break the runner
            log.exception("recording request %s failed", self.request.request_id)

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


class CoreListener(Protocol):
    """Where a core delivers what happened: its step reports, and its loss."""

    def on_report(self, report: StepReport) -> None: ...
    def on_lost(self, reason: str) -> None: ...


class EngineCore(Protocol):
    """What the runner drives: an engine's batch, here or in a process of its own."""

    engine: Any  # the Engine, or a view of it (info, health, features, abort, ...)
    tokenizer: Any

    def start(self, listener: CoreListener, load_timeout_s: float | None) -> None: ...
    def add(self, uid: int, request: GenerationRequest) -> None: ...
    def abort(self, uids: list[int]) -> None: ...
    def evict(self, keep_fraction: float) -> None: ...
    def memory_accounting(self) -> dict[str, dict[str, int]]: ...
    def close(self) -> None: ...


class LocalCore:
    """The core on a thread of this process: the engine's steps share this interpreter."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        self.engine = engine
        self._max_batch = max_batch
        self._scheduler: BatchScheduler | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def start(self, listener: CoreListener, load_timeout_s: float | None) -> None:
        self._scheduler = BatchScheduler(self.engine, self._max_batch, listener.on_report)
        self._scheduler.start(load_timeout_s)

    def add(self, uid: int, request: GenerationRequest) -> None:
        self._running().add(uid, request)

    def abort(self, uids: list[int]) -> None:
        self._running().abort(uids)

    def evict(self, keep_fraction: float) -> None:
        self._running().evict(keep_fraction)

    def memory_accounting(self) -> dict[str, dict[str, int]]:
        from engines.observability.process_memory import process_memory

        return {"serve": process_memory(self.engine)}

    def close(self) -> None:
        if self._scheduler is None:
            self.engine.close()
        else:
            self._scheduler.close()

    def _running(self) -> BatchScheduler:
        if self._scheduler is None:
            raise EngineError("the engine core is not started")
        return self._scheduler


class EngineRunner:
    """The API's side of one engine core: queue bound, submissions, their text events."""

    def __init__(
        self,
        engine: Engine | EngineCore,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if queue_size < 1 or max_batch < 1:
            raise ValueError(
                f"queue size and max batch must be at least 1, got {queue_size}, {max_batch}"
            )
        self.core: EngineCore = (
            LocalCore(engine, max_batch) if isinstance(engine, Engine) else engine
        )
        self.queue_size = queue_size
        self.max_batch = max_batch
        self._lock = threading.Lock()  # _waiting and _closed, shared with the event loop
        self._reporting = threading.RLock()  # one report at a time (a loss may race a step)
        self._waiting: dict[int, Submission] = {}  # submitted, not admitted yet
        self._active: dict[int, ActiveSequence] = {}  # admitted (the core's thread only)
        self._ended: dict[int, Submission] = {}  # ended here, not yet let go by the core
        self._closed = False
        self._next_uid = 0
        self.steps = 0
        self.prefix_evictions = 0
        self.prefix_evicted_bytes = 0
        self.generated_tokens = 0  # step outputs so far: the live tokens/s of the dashboard
        self._post = EventPost()  # a report's events reach the event loop in one wakeup

    @property
    def engine(self) -> Any:
        return self.core.engine

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, load_timeout_s: float | None = None) -> None:
        """Start the core and wait until its engine has loaded (or failed to).

        On a time-out the caller must still close() the runner: that aborts the load where
        the engine can (remote workers) and closes the engine once load() has returned.
        """
        self.core.start(self, load_timeout_s)

    def close(self) -> None:
        """Fail what waits or runs, and close the core (which closes the engine)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.core.close()
        finally:
            self.on_lost(SHUTTING_DOWN)

    # -- submitting --------------------------------------------------------------------------

    def submit(
        self,
        request: GenerationRequest,
        *,
        received_at: float | None = None,
        on_finish: Callable[[Submission, TokenEvent], None] | None = None,
    ) -> Submission:
        """Queue a request; raises QueueFullError at once when the queue is full.

        `received_at` (monotonic) is when the HTTP request arrived; `on_finish` runs with the
        final event once the core has let the sequence go (its step times are known then).
        """
        submission = Submission(
            request, asyncio.get_running_loop(), received_at, on_finish, self._post, self._cancel
        )
        with self._lock:
            if self._closed:
                raise EngineError("the engine is shutting down")
            if len(self._waiting) >= self.queue_size + max(0, self.max_batch - self.active):
                raise QueueFullError(
                    f"request queue is full ({self.max_batch} running, {self.queue_size} "
                    "waiting); retry later"
                )
            uid, self._next_uid = self._next_uid, self._next_uid + 1
            submission.uid = uid
            self._waiting[uid] = submission
        try:
            self.core.add(uid, request)
        except EngineError:
            with self._lock:
                self._waiting.pop(uid, None)
            raise
        return submission

    def _cancel(self, submission: Submission) -> None:
        if submission.uid is not None:
            try:
                self.core.abort([submission.uid])
            except EngineError:  # the core is gone: closing fails the request anyway
                pass

    def request_prefix_eviction(self, keep_fraction: float) -> None:
        """From any thread: have the core call engine.evict_prefix_cache between two steps
        (at once when idle); requests that meet before it runs merge into the smallest."""
        if not 0.0 <= keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be within [0, 1], got {keep_fraction}")
        if self._closed:
            return
        try:
            self.core.evict(keep_fraction)
        except EngineError:  # the core is gone, and what it cached with it
            pass

    def memory_accounting(self) -> dict[str, dict[str, int]]:
        """Memory by process ("serve" with a core on a thread; "api" and "engine_core" with
        one in a process of its own), each by kind (observability/process_memory.py)."""
        return self.core.memory_accounting()

    @property
    def queued(self) -> int:
        return max(0, len(self._waiting) - max(0, self.max_batch - self.active))

    @property
    def active(self) -> int:
        return len(self._active)

    def running(self) -> list[Submission]:
        """The submissions in the batch now (a snapshot)."""
        return [sequence.submission for sequence in list(self._active.values())]

    @property
    def idle(self) -> bool:
        # Ended streams count until the core lets them go (and they are recorded).
        return not self._active and not self._waiting and not self._ended

    # -- what the core reports (on its thread, or the channel's reader) ---------------------

    def on_report(self, report: StepReport) -> None:
        with self._reporting:
            self._apply(report)

    def _apply(self, report: StepReport) -> None:
        self.steps = max(self.steps, report.steps)
        self.generated_tokens += len(report.outputs)
        if report.evicted_bytes is not None:
            self._count_eviction(report.evicted_bytes)
        ended_by_core = {release.uid for release in report.ended}
        aborts: list[int] = []
        with self._post.holding():
            for uid, cached_tokens, admitted_at in report.admitted:
                self._admit(uid, cached_tokens, admitted_at)
            for output in report.outputs:
                sequence = self._active.get(output.uid)
                if sequence is None:  # ended here already; a token still in flight
                    continue
                if output.cached_tokens is not None:
                    sequence.cached_tokens = output.cached_tokens
                reason = sequence.accept(output)
                if reason is not None:
                    self._end(sequence, Ending(reason))
                    if output.uid not in ended_by_core:
                        aborts.append(output.uid)  # a stop string: the core goes on otherwise
            now = time.monotonic()
            for sequence in list(self._active.values()):
                expired = sequence.expired(now)
                if expired is not None:
                    self._end(sequence, expired)
                    if sequence.uid not in ended_by_core:
                        aborts.append(sequence.uid)
            for release in report.ended:
                self._let_go(release)
        if aborts:
            try:
                self.core.abort(aborts)
            except EngineError:  # the core is gone; its loss ends everything
                pass

    def on_lost(self, reason: str) -> None:
        """The core is gone (or closing): everything waiting or running ends with `reason`."""
        with self._lock:
            uids = list(self._waiting) + list(self._active) + list(self._ended)
        self.on_report(StepReport(ended=[Release(uid, Ended.ERROR, reason) for uid in uids]))

    def _admit(self, uid: int, cached_tokens: int, admitted_at: float) -> None:
        with self._lock:
            submission = self._waiting.pop(uid, None)
        if submission is None:
            return
        submission.admitted_at = admitted_at
        self._active[uid] = ActiveSequence(
            uid, submission, self.core.tokenizer, self._eos(), cached_tokens
        )

    def _end(self, sequence: ActiveSequence, ending: Ending) -> None:
        """The request's stream ends now; the core may still hold it until it lets go."""
        if ending.reason is Finish.ERROR:
            log.warning("request %s failed: %s", sequence.request.request_id, ending.error)
        sequence.finish(ending)
        del self._active[sequence.uid]
        self._ended[sequence.uid] = sequence.submission

    def _let_go(self, release: Release) -> None:
        """The core no longer holds `release.uid`: end its stream if that has not happened
        (an error, EOS or length the text has not seen), and record it."""
        sequence = self._active.get(release.uid)
        if sequence is not None:
            self._end(sequence, _ending_of(release, sequence.submission))
        submission = self._ended.pop(release.uid, None)
        if submission is None:  # never admitted: refused by the engine, cancelled, or closing
            with self._lock:
                submission = self._waiting.pop(release.uid, None)
            if submission is None:
                return
            ending = _ending_of(release, submission)
            ActiveSequence(release.uid, submission, self.core.tokenizer, set()).finish(ending)
        submission.settle(release.step_times)

    def _eos(self) -> set[int]:
        return set(self.core.engine.eos_token_ids)  # the core's: it ends sequences on them too

    def _count_eviction(self, freed: int) -> None:
        self.prefix_evictions += 1
        self.prefix_evicted_bytes += freed
        log.log(
            logging.INFO if freed else logging.DEBUG,
            "prefix-cache eviction #%d freed %d bytes",
            self.prefix_evictions,
            freed,
        )


def _ending_of(release: Release, submission: Submission) -> Ending:
    if release.reason == Ended.EOS:
        return Ending(Finish.STOP)
    if release.reason == Ended.LENGTH:
        return Ending(Finish.LENGTH)
    if release.reason == Ended.ABORTED and submission.cancelled.is_set():
        return Ending(Finish.CANCELLED)
    return Ending(Finish.ERROR, release.error or SHUTTING_DOWN, Failure.ENGINE)
