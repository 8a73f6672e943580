"""ActiveSequence: one admitted request, turning its tokens into text events until it ends."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from engines.core.engine import StepOutput, TokenEvent
from engines.decoding.stop_text import StopTextFilter

if TYPE_CHECKING:
    from engines.core.runner import Submission


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
        self._stopped_by_text = False
        self.completion_tokens = 0

    def accept(self, output: StepOutput) -> str | None:
        """Emit the token's text; return the finish reason when this token ends the sequence."""
        token = output.token
        if self.submission.first_token_at is None:
            self.submission.first_token_at = time.monotonic()
        if token in self._eos:
            return "stop"
        self.completion_tokens += 1
        self._detokenizer.add_token(token)
        text, matched = self._stop_filter.feed(self._detokenizer.last_segment)
        if text or not matched:
            event = TokenEvent(text, token, output.logprob, output.top_logprobs)
            self.submission.push(event)
        if matched:
            self._stopped_by_text = True
            return "stop"
        if self.completion_tokens >= self.request.max_tokens:
            return "length"
        return None

    def expired(self, now: float) -> tuple[str, str | None] | None:
        """("cancelled", None) or ("error", why) when the sequence must end before its tokens do."""
        if self.submission.cancelled.is_set():
            return "cancelled", None
        if now > self._deadline:
            return "error", f"request timed out after {self.request.timeout_s:g} s"
        return None

    def finish(self, reason: str, error: str | None = None) -> None:
        """Flush held-back text (a natural end only) and send the final event with usage."""
        if reason in ("stop", "length") and not self._stopped_by_text:
            self._detokenizer.finalize()
            tail, _ = self._stop_filter.feed(self._detokenizer.last_segment)
            tail += self._stop_filter.flush()
            if tail:
                self.submission.push(TokenEvent(text=tail))
        self.submission.push(
            TokenEvent(
                finish_reason=reason,
                error=error,
                prompt_tokens=len(self.request.prompt_tokens),
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
            )
        )
        self.submission.done = True
