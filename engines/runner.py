"""EngineRunner: a bounded queue and one worker thread between the asyncio API and an Engine."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from planner.errors import EngineError, QueueFullError

from .base import Engine, GenerationRequest, TokenEvent
from .stop_text import StopTextFilter

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 8


class Submission:
    """A queued or running request; the API iterates its events and may cancel it."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self._loop = loop
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done = False

    def cancel(self) -> None:
        """Ask the worker to stop at the next token (or skip the request if still queued)."""
        self.cancelled.set()

    def push(self, event: TokenEvent) -> None:
        """Called from the worker thread: hand the event to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

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
    """Runs submissions one at a time on a dedicated thread so the event loop never blocks."""

    def __init__(self, engine: Engine, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        if queue_size < 1:
            raise ValueError(f"queue size must be at least 1, got {queue_size}")
        self.engine = engine
        self.queue_size = queue_size
        self._pending: queue.Queue[Submission | None] = queue.Queue(maxsize=queue_size)
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._closed = False
        self.current: Submission | None = None
        self._thread = threading.Thread(target=self._work, name="engine-runner", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, load_timeout_s: float | None = None) -> None:
        """Start the worker thread and wait until the engine has loaded (or failed to)."""
        self._thread.start()
        if not self._loaded.wait(load_timeout_s):
            raise EngineError(f"engine did not load within {load_timeout_s} s")
        if self._load_error is not None:
            raise self._load_error

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Cancel what is running, drain the queue, stop the thread, close the engine."""
        if self._closed:
            return
        self._closed = True
        if self.current is not None:
            self.current.cancel()
        while True:
            try:
                sub = self._pending.get_nowait()
            except queue.Empty:
                break
            if sub is not None:
                sub.push(TokenEvent(finish_reason="error", error="server is shutting down"))
        self._pending.put(None)
        self._thread.join(join_timeout_s)
        self.engine.close()

    # -- submitting --------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Submission:
        """Queue a request; raises QueueFullError at once when the queue is full."""
        if self._closed:
            raise EngineError("the engine is shutting down")
        submission = Submission(request, asyncio.get_running_loop())
        try:
            self._pending.put_nowait(submission)
        except queue.Full:
            raise QueueFullError(
                f"request queue is full ({self.queue_size} waiting); retry later"
            ) from None
        return submission

    @property
    def queued(self) -> int:
        return self._pending.qsize()

    # -- the worker thread -------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self.engine.load()
        except BaseException as error:  # reported to start(), which re-raises it
            self._load_error = error
            self._loaded.set()
            return
        self._loaded.set()
        while True:
            submission = self._pending.get()
            if submission is None:
                return
            self.current = submission
            try:
                self._run(submission)
            finally:
                self.current = None
                submission.done = True

    def _run(self, submission: Submission) -> None:
        request = submission.request
        prompt_count = len(request.prompt_tokens)
        if submission.cancelled.is_set():
            submission.push(TokenEvent(finish_reason="cancelled", prompt_tokens=prompt_count))
            return
        detokenizer = self.engine.tokenizer.detokenizer
        stop_filter = StopTextFilter(request.stop)
        eos = self.engine.eos_token_ids
        deadline = time.monotonic() + request.timeout_s
        count = 0
        finish: str | None = None
        error: str | None = None
        matched = False
        tokens = self.engine.generate_tokens(request)
        try:
            for token in tokens:
                if submission.cancelled.is_set():
                    finish = "cancelled"
                    break
                if token in eos:
                    finish = "stop"
                    break
                count += 1
                detokenizer.add_token(token)
                text, matched = stop_filter.feed(detokenizer.last_segment)
                if text or not matched:
                    submission.push(TokenEvent(text=text, token=token))
                if matched:
                    finish = "stop"
                    break
                if count >= request.max_tokens:
                    finish = "length"
                    break
                if time.monotonic() > deadline:
                    finish, error = "error", f"request timed out after {request.timeout_s:g} s"
                    break
            else:
                finish = "length"
        except EngineError as failure:
            finish, error = "error", str(failure)
            log.error("request %s failed: %s", request.request_id, failure)
        except Exception as failure:  # an engine bug must not kill the worker thread
            finish, error = "error", f"internal engine error: {failure}"
            log.exception("request %s crashed the engine step", request.request_id)
        finally:
            try:
                tokens.close()  # tells remote ranks/stages to stop; must not kill this thread
            except Exception:
                log.exception("request %s: closing the generation failed", request.request_id)
        if finish in ("length", "stop") and not matched:
            detokenizer.finalize()
            tail, _ = stop_filter.feed(detokenizer.last_segment)
            tail += stop_filter.flush()
            if tail:
                submission.push(TokenEvent(text=tail))
        submission.push(
            TokenEvent(
                finish_reason=finish,
                error=error,
                prompt_tokens=prompt_count,
                completion_tokens=count,
            )
        )
