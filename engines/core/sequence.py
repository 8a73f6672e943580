"""ActiveSequence: one admitted request, turning its tokens into text events until it ends."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from engines.core.engine import Failure, Finish, StepOutput, TokenEvent
from engines.core.request import GenerationRequest
from engines.core.stop_text import StopTextFilter


class Submission(Protocol):
    """What a sequence needs of the request it runs (runner.Submission)."""

    request: GenerationRequest
    cancelled: threading.Event
    first_token_at: float | None
    done: bool

    def push(self, event: TokenEvent) -> None: ...


@dataclass(frozen=True, slots=True)
class Ending:
    """How a sequence ends: the finish reason and, for an error, its kind and message."""

    reason: Finish
    error: str | None = None
    failure: Failure | None = None


class ActiveSequence:
    """Detokenizes, holds back stop strings, counts, and decides when the sequence is done.

    The scheduler feeds it one token per step (`accept`) and asks it every step whether the
    client gave up or the deadline passed (`expired`); `finish` sends the one final event.
    """

    def __init__(
        self,
        uid: int,
        submission: Submission,
        tokenizer: Any,
        eos: set[int],
        cached_tokens: int = 0,
    ) -> None:
        self.uid = uid
        self.cached_tokens = cached_tokens
        self.submission = submission
        self.request = submission.request
        self._detokenizer = tokenizer.detokenizer
        self._stop_filter = StopTextFilter(self.request.stop)
        self._eos = eos
        self._deadline = time.monotonic() + self.request.timeout_s
        self._matched_stop: str | None = None  # the stop string that ended it
        self.completion_tokens = 0
        self.drafted_tokens = 0  # speculative decoding's drafts for this request ...
        self.accepted_tokens = 0  # ... and those accepted

    def accept(self, output: StepOutput) -> Finish | None:
        """Emit the token's text; return the finish reason when this token ends the sequence."""
        token = output.token
        self.drafted_tokens += output.drafted
        self.accepted_tokens += output.accepted
        if self.submission.first_token_at is None:
            self.submission.first_token_at = time.monotonic()
        if token in self._eos:
            return Finish.STOP
        self.completion_tokens += 1
        self._detokenizer.add_token(token)
        text, matched = self._stop_filter.feed(self._detokenizer.last_segment)
        if text or matched is None:
            event = TokenEvent(text, token, output.logprob, output.top_logprobs)
            self.submission.push(event)
        if matched is not None:
            self._matched_stop = matched
            return Finish.STOP
        if self.completion_tokens >= self.request.max_tokens:
            return Finish.LENGTH
        return None

    def expired(self, now: float) -> Ending | None:
        """CANCELLED, or a TIMEOUT error, when the sequence must end before its tokens do."""
        if self.submission.cancelled.is_set():
            return Ending(Finish.CANCELLED)
        if now > self._deadline:
            why = f"request timed out after {self.request.timeout_s:g} s"
            return Ending(Finish.ERROR, why, Failure.TIMEOUT)
        return None

    def finish(self, ending: Ending) -> None:
        """Flush held-back text (a natural end only) and send the final event with usage."""
        if ending.reason.natural and self._matched_stop is None:
            self._detokenizer.finalize()
            tail, _ = self._stop_filter.feed(self._detokenizer.last_segment)
            tail += self._stop_filter.flush()
            if tail:
                self.submission.push(TokenEvent(text=tail))
        self.submission.push(
            TokenEvent(
                finish_reason=ending.reason,
                error=ending.error,
                failure=ending.failure,
                prompt_tokens=len(self.request.prompt_tokens),
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
                drafted_tokens=self.drafted_tokens,
                accepted_tokens=self.accepted_tokens,
                stop_sequence=self._matched_stop,
            )
        )
        self.submission.done = True
