"""Ollama's replies: the NDJSON lines of a streamed chat or generate, the one object of a whole
one, and the final object's counts and durations, measured on the request itself."""

from __future__ import annotations

import datetime
import time
from typing import Any

from engines.api.conversation import ToolCall
from engines.api.errors import APIError
from engines.api.generation import Outcome
from engines.api.reply import Piece, ReplyStream
from engines.api.streaming import Frame, Framing
from engines.api.token_score import TokenScore
from engines.core.engine import TokenEvent
from engines.core.runner import Submission

NDJSON = Framing("ndjson", keepalive=None)  # a blank line is no JSON: nothing while waiting
NANOSECONDS = 1_000_000_000


def created_at() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def durations(submission: Submission, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The final object's counts and nanoseconds: load is the wait before the engine took the
    request (templating, the queue: the model is always loaded), prompt eval its prefill up to
    the first token, eval the rest; the three add up to the total."""
    finished = submission.finished_at or time.monotonic()
    admitted = submission.admitted_at or finished
    first = submission.first_token_at or finished

    def span(start: float, end: float) -> int:
        return max(0, int((end - start) * NANOSECONDS))

    return {
        "total_duration": span(submission.received_at, finished),
        "load_duration": span(submission.received_at, admitted),
        "prompt_eval_count": prompt_tokens,
        "prompt_eval_duration": span(admitted, first),
        "eval_count": completion_tokens,
        "eval_duration": span(first, finished),
    }


def ollama_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Ollama carries a call's arguments as an object, not JSON text; it has no shape for a
    call cut short by num_predict, which is left out (done_reason says "length")."""
    calls = [call for call in calls if call.complete]
    return [
        {
            "id": call.id,
            "function": {"index": index, "name": call.name, "arguments": arguments_object(call)},
        }
        for index, call in enumerate(calls)
    ]


def arguments_object(call: ToolCall) -> dict[str, Any]:
    value = call.arguments_value()
    return value if isinstance(value, dict) else {}


class OllamaReplies:
    """The objects of one chat (`message`) or generate (`response`) reply; a StreamWriter."""

    def __init__(self, model: str, reply: ReplyStream, submission: Submission, chat: bool) -> None:
        self.model = model
        self._reply = reply
        self._submission = submission
        self._chat = chat

    def opening(self) -> list[Frame]:
        return []

    def content(self, text: str, scores: list[TokenScore]) -> list[Frame]:
        return [self._piece(piece) for piece in self._reply.feed(text)]

    def finish(self, final: TokenEvent) -> list[Frame]:
        pieces, calls = self._reply.finish()
        frames = [self._piece(piece) for piece in pieces]
        if ollama_tool_calls(calls):
            frames.append((None, self._object(calls=calls, done=False)))
        counts = durations(self._submission, final.prompt_tokens, final.completion_tokens)
        frames.append((None, self._object(reason=str(final.finish_reason), counts=counts)))
        return frames

    def failure(self, error: APIError) -> list[Frame]:
        return [(None, {"error": error.message})]

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        """The one object of a reply that was not streamed."""
        reply = self._reply.read_whole(outcome.text)
        counts = durations(self._submission, outcome.prompt_tokens, outcome.completion_tokens)
        return self._object(
            reply.content, reply.reasoning, reply.calls, reason=outcome.finish_reason, counts=counts
        )

    def _piece(self, piece: Piece) -> Frame:
        if piece.kind == "reasoning":
            return (None, self._object(thinking=piece.text, done=False))
        return (None, self._object(piece.text, done=False))

    def _object(
        self,
        content: str = "",
        thinking: str = "",
        calls: list[ToolCall] | None = None,
        *,
        done: bool = True,
        reason: str | None = None,
        counts: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls and ollama_tool_calls(calls):
                message["tool_calls"] = ollama_tool_calls(calls)
            body["message"] = message
        else:
            body["response"] = content
            if thinking:
                body["thinking"] = thinking
        body["done"] = done
        if reason is not None:
            body["done_reason"] = reason
        return body | (counts or {})


def loaded(model: str, chat: bool) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate (it loads the model): done at
    once. tandem's model is always loaded, so `keep_alive` 0 does not unload it either."""
    body: dict[str, Any] = {"model": model, "created_at": created_at()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return body | {"done": True, "done_reason": "load"}
