"""Server-sent events: token events become `data: {json}` chunks, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from engines.api.errors import SERVER_ERROR, APIError, error_body, generation_timeout
from engines.api.generation import GenerationTimeout, failure_of, watch_events
from engines.api.logprobs import TokenScore
from engines.api.schemas import Usage
from engines.core.runner import Submission

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
# An SSE comment: clients ignore it, proxies see a live connection during a long prefill.
KEEPALIVE = ": keep-alive\n\n"
KEEPALIVE_S = 10.0


class ChunkWriter(Protocol):
    """The chunk shapes of one endpoint (chat and completions differ only here).

    `content` may hold text back (a tool call being written) and return None; `finish`
    returns the last chunks, the held-back ones first.
    """

    def opening(self) -> BaseModel | None: ...

    def content(self, text: str, scores: list[TokenScore]) -> BaseModel | None: ...

    def finish(self, reason: str) -> list[BaseModel]: ...

    def usage(self, usage: Usage) -> BaseModel: ...


def encode_event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the stream ends.

    A client that disconnects cancels the stream, possibly before the generator ever
    started (then its own cleanup never runs): `on_close` is what cancels the generation.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, headers=headers)
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            self._on_close()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


async def stream_generation(
    submission: Submission, timeout_s: float, writer: ChunkWriter, include_usage: bool
) -> AsyncIterator[str]:
    """The whole SSE body of one generation; it always ends with [DONE], errors included."""
    try:
        opening = writer.opening()
        if opening is not None:
            yield encode_event(opening)
        quiet = True  # nothing sent since the last tick
        async with aclosing(watch_events(submission, timeout_s, KEEPALIVE_S)) as events:
            async for event in events:
                if event is None:
                    if quiet:
                        yield KEEPALIVE
                    quiet = True
                    continue
                quiet = False
                score = TokenScore.of(event)
                scores = [score] if score is not None else []
                if event.text or scores:
                    chunk = writer.content(event.text, scores)
                    if chunk is not None:
                        yield encode_event(chunk)
                if event.finish_reason is not None and event.finish_reason.natural:
                    for chunk in writer.finish(event.finish_reason):
                        yield encode_event(chunk)
                    if include_usage:
                        usage = Usage.counted(
                            event.prompt_tokens, event.completion_tokens, event.cached_tokens
                        )
                        yield encode_event(writer.usage(usage))
                elif event.finish_reason is not None:
                    yield encode_event(failure_of(event).body())
    except GenerationTimeout as error:
        yield encode_event(generation_timeout(f"request timed out: {error}").body())
    except APIError as error:
        yield encode_event(error.body())
    except Exception as error:  # the headers are sent: report in-band, never drop the stream
        log.error("stream %s failed", submission.request.request_id, exc_info=error)
        message = "internal server error; see the server log"
        yield encode_event(error_body(message, type=SERVER_ERROR))
    yield DONE
