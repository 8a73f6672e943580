"""Streamed generations: token events become a dialect's frames (its StreamWriter), framed as
server-sent events (`data:` lines, or named `event:` lines) or as NDJSON (Framing)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from engines.api.errors import SERVER_ERROR, APIError, generation_timeout
from engines.api.generation import GenerationTimeout, failure_of, watch_events
from engines.api.token_score import TokenScore
from engines.core.engine import TokenEvent
from engines.core.runner import Submission

log = logging.getLogger(__name__)

KEEPALIVE_S = 10.0
# The body of a 200, for the OpenAPI document: one JSON document, or with "stream": true the
# dialect's stream.
STREAMED: dict[str, Any] = {"text/event-stream": {}}
# (an SSE event name, or None for a bare `data:` line; the payload)
Frame = tuple[str | None, BaseModel | dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Framing:
    """How a dialect's frames go on the wire."""

    style: Literal["sse", "ndjson"]
    keepalive: str | None  # sent when nothing else went out for KEEPALIVE_S; None: nothing
    closing: str | None = None  # after the last frame, whatever happened (OpenAI's [DONE])

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.style == "sse" else "application/x-ndjson"

    def encode(self, frame: Frame) -> str:
        name, payload = frame
        if isinstance(payload, BaseModel):
            data = payload.model_dump_json()
        else:
            data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        if self.style == "ndjson":
            return data + "\n"
        return (f"event: {name}\n" if name else "") + f"data: {data}\n\n"


# An SSE comment: clients ignore it, proxies see a live connection during a long prefill.
SSE_COMMENT = ": keep-alive\n\n"
OPENAI_SSE = Framing("sse", SSE_COMMENT, "data: [DONE]\n\n")


class StreamWriter(Protocol):
    """One dialect's frames for a streamed generation.

    `content` may hold text back (a tool call being written) and return nothing; `finish`
    returns the last frames of a natural end (held-back text first, usage last); `failure`
    the frames that report an error once the headers are sent.
    """

    def opening(self) -> list[Frame]: ...

    def content(self, text: str, scores: list[TokenScore]) -> list[Frame]: ...

    def finish(self, final: TokenEvent) -> list[Frame]: ...

    def failure(self, error: APIError) -> list[Frame]: ...


class EventStreamResponse(StreamingResponse):
    """A streamed response that runs `on_close` however the stream ends.

    A client that disconnects cancels the stream, possibly before the generator ever
    started (then its own cleanup never runs): `on_close` is what cancels the generation.
    """

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], None],
        media_type: str = "text/event-stream",
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, headers=headers, media_type=media_type)
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            self._on_close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def stream_response(
    submission: Submission, timeout_s: float, writer: StreamWriter, framing: Framing
) -> EventStreamResponse:
    events = stream_generation(submission, timeout_s, writer, framing)
    return EventStreamResponse(events, submission.cancel, framing.media_type)


async def stream_generation(
    submission: Submission, timeout_s: float, writer: StreamWriter, framing: Framing
) -> AsyncIterator[str]:
    """The whole body of one streamed generation; errors go out in-band, in the dialect's
    frames, and the framing's closing line always ends it."""
    try:
        for frame in writer.opening():
            yield framing.encode(frame)
        quiet = True  # nothing sent since the last tick
        async with aclosing(watch_events(submission, timeout_s, KEEPALIVE_S)) as events:
            async for event in events:
                if event is None:
                    if quiet and framing.keepalive is not None:
                        yield framing.keepalive
                    quiet = True
                    continue
                quiet = False
                score = TokenScore.of(event)
                scores = [score] if score is not None else []
                frames: list[Frame] = []
                if event.text or scores:
                    frames += writer.content(event.text, scores)
                if event.finish_reason is not None and event.finish_reason.natural:
                    frames += writer.finish(event)
                elif event.finish_reason is not None:
                    frames += writer.failure(failure_of(event))
                for frame in frames:
                    yield framing.encode(frame)
    except GenerationTimeout as error:
        for frame in writer.failure(generation_timeout(f"request timed out: {error}")):
            yield framing.encode(frame)
    except APIError as error:
        for frame in writer.failure(error):
            yield framing.encode(frame)
    except Exception as error:  # the headers are sent: report in-band, never drop the stream
        log.error("stream %s failed", submission.request.request_id, exc_info=error)
        internal = APIError(500, "internal server error; see the server log", type=SERVER_ERROR)
        for frame in writer.failure(internal):
            yield framing.encode(frame)
    if framing.closing is not None:
        yield framing.closing
