"""RequestRecord: one finished request's counts and latency breakdown, from its timestamps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.core.engine import TokenEvent

if TYPE_CHECKING:
    from engines.core.runner import Submission

# The latency segments of a request, in order; they add up to its duration. The metrics
# (tandem_request_segment_seconds{segment=...}) and the request log use the same names.
SEGMENTS = ("parse", "queue", "prefill", "decode")
REJECTED = "rejected"  # the finish reason of a request refused before it was queued


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the request log, the metrics and the dashboard keep of one finished request.

    parse: the HTTP request arrived → it was queued (body validation, template, tokenizing);
    queue: waiting for a batch slot; prefill: admitted → its first token (prompt chunks, run
    alongside the other sequences' decode steps); decode: first token → final event.
    """

    request_id: str
    model: str
    strategy: str
    finish_reason: str
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    started_at: float  # wall-clock seconds since the epoch when the HTTP request arrived
    parse_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    time_to_first_token_s: float | None  # None when no token came
    prompt_token_ids: tuple[int, ...] = ()  # only ever logged when the operator asks for it
    http_status: int | None = None  # set for a request the API refused before the engine saw it
    drafted_tokens: int = 0  # speculative decoding: tokens drafted, and those accepted
    accepted_tokens: int = 0
    # The engine's own step segments (engines/observability/step_timing.py: tp all_sum, pp hops and
    # sealing) summed over the steps that carried this request. Steps are shared by the
    # batch, so these overlap the other requests' and lie inside prefill + decode.
    engine_s: tuple[tuple[str, float], ...] = ()

    @property
    def duration_s(self) -> float:
        return self.parse_s + self.queue_s + self.prefill_s + self.decode_s

    @property
    def inter_token_s(self) -> float | None:
        """The mean gap between two tokens of this request (None below two tokens)."""
        if self.time_to_first_token_s is None or self.completion_tokens < 2:
            return None
        return self.decode_s / (self.completion_tokens - 1)

    def segments(self) -> dict[str, float]:
        values = (self.parse_s, self.queue_s, self.prefill_s, self.decode_s)
        return dict(zip(SEGMENTS, values, strict=True))

    def to_dict(self) -> dict[str, object]:
        """The JSON form (request log line, dashboard row); never the prompt."""
        return {
            "id": self.request_id or None,
            "model": self.model,
            "strategy": self.strategy,
            "started_at": round(self.started_at, 3),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "duration_s": round(self.duration_s, 6),
            "time_to_first_token_s": _rounded(self.time_to_first_token_s),
            "inter_token_s": _rounded(self.inter_token_s),
            "segments_s": {name: round(value, 6) for name, value in self.segments().items()},
        } | self._optional()

    def _optional(self) -> dict[str, object]:
        extra: dict[str, object] = {}
        if self.engine_s:
            extra["engine_s"] = {name: round(value, 6) for name, value in self.engine_s}
        if self.http_status is not None:
            extra["http_status"] = self.http_status
        return extra


def record_of(
    submission: Submission,
    event: TokenEvent,
    model: str,
    strategy: str,
    engine_times: dict[str, float] | None = None,
) -> RequestRecord:
    """Build the record from the submission's monotonic timestamps and its final event.

    A request that never reached the batch (cancelled or failed while queued) spends all
    of its time after parsing in the queue; one that never produced a token, in prefill.
    """
    finished = submission.finished_at if submission.finished_at is not None else time.monotonic()
    received, submitted = submission.received_at, submission.submitted_at
    admitted, first = submission.admitted_at, submission.first_token_at
    queue_end = admitted if admitted is not None else finished
    prefill_end = first if first is not None else finished
    return RequestRecord(
        request_id=submission.request.request_id,
        model=model,
        strategy=strategy,
        finish_reason=event.finish_reason or "error",
        error=event.error,
        prompt_tokens=event.prompt_tokens or len(submission.request.prompt_tokens),
        completion_tokens=event.completion_tokens,
        cached_tokens=getattr(event, "cached_tokens", 0),  # the field may not exist yet
        drafted_tokens=getattr(event, "drafted_tokens", 0),
        accepted_tokens=getattr(event, "accepted_tokens", 0),
        started_at=time.time() - (time.monotonic() - received),
        parse_s=max(submitted - received, 0.0),
        queue_s=queue_end - submitted,
        prefill_s=(prefill_end - admitted) if admitted is not None else 0.0,
        decode_s=(finished - first) if first is not None else 0.0,
        time_to_first_token_s=(first - received) if first is not None else None,
        prompt_token_ids=submission.request.prompt_tokens,
        engine_s=tuple((engine_times or {}).items()),
    )


def rejected_record(
    received_at: float, status: int, error: str, model: str, strategy: str
) -> RequestRecord:
    """A generation request the API answered with an error before queueing it (400, 401,
    429, 503 ...): all of its time was spent in `parse`; it has no id yet."""
    now = time.monotonic()
    return RequestRecord(
        request_id="",
        model=model,
        strategy=strategy,
        finish_reason=REJECTED,
        error=error,
        prompt_tokens=0,
        completion_tokens=0,
        cached_tokens=0,
        started_at=time.time() - (now - received_at),
        parse_s=now - received_at,
        queue_s=0.0,
        prefill_s=0.0,
        decode_s=0.0,
        time_to_first_token_s=None,
        http_status=status,
    )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
