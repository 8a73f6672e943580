"""The streamed response: token events become Responses' named SSE events, each with its
`type` and an increasing `sequence_number` (a streaming.StreamWriter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engines.api.errors import APIError
from engines.api.reply import Piece, ReplyStream
from engines.api.responses.objects import FunctionCallOutput, OutputItem, Response, new_id
from engines.api.responses.replies import (
    OutputOptions,
    kept_calls,
    message_item,
    reasoning_item,
    token_logprobs,
    usage_of,
)
from engines.api.streaming import SSE_COMMENT, Frame, Framing
from engines.api.token_score import TokenScore
from engines.core.engine import TokenEvent

# Named events (`event: response.output_text.delta`), no closing line: OpenAI sends no [DONE].
RESPONSES_SSE = Framing("sse", SSE_COMMENT)
# What each kind of reply text is sent as: (item id prefix, part type, delta event's name).
KINDS = {
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text"),
    "content": ("msg", "output_text", "response.output_text"),
}


class OpenItem:
    """The output item being written: a reasoning item or a message, one part of text."""

    def __init__(self, kind: str, index: int, options: OutputOptions) -> None:
        self.kind = kind
        self.options = options
        self.index = index
        self.id = new_id(KINDS[kind][0])
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []

    def item(self, status: str) -> OutputItem:
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, self.options, status)
        return message_item(self.id, self.text, self.logprobs, status)

    def part(self, text: str) -> dict[str, Any]:
        part_type = KINDS[self.kind][1]
        if part_type == "output_text":
            return {"type": part_type, "text": text, "annotations": [], "logprobs": []}
        return {"type": part_type, "text": text}


class ResponseEvents:
    """One streamed response's events; `on_finished` gets the final response (to store it)."""

    def __init__(
        self,
        response: Response,
        tokenizer: Any,
        reply: ReplyStream,
        options: OutputOptions,
        on_finished: Callable[[Response], None],
    ) -> None:
        self._response = response
        self._tokenizer = tokenizer
        self._reply = reply
        self._options = options
        self._on_finished = on_finished
        self._sequence = 0
        self._done: list[OutputItem] = []
        self._open: OpenItem | None = None
        self._reasoning = ""

    def opening(self) -> list[Frame]:
        body = self._response.body()
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def content(self, text: str, scores: list[TokenScore]) -> list[Frame]:
        logprobs = token_logprobs(self._tokenizer, scores)
        frames: list[Frame] = []
        for piece in self._reply.feed(text):
            frames += self._write(piece, logprobs)
            logprobs = []  # a token's logprob goes with the first text it made
        return frames

    def finish(self, final: TokenEvent) -> list[Frame]:
        pieces, calls = self._reply.finish()
        frames: list[Frame] = []
        for piece in pieces:
            frames += self._write(piece, [])
        status = "incomplete" if final.finish_reason == "length" else "completed"
        said = any(item.type == "message" for item in self._done) or (
            self._open is not None and self._open.kind == "content"
        )
        if not said and not calls:  # as a whole response: an empty message, never no output
            frames += self._write(Piece("content", ""), [])
        frames += self._close(status)
        for call in kept_calls(calls, self._options.max_calls):
            frames += self._call(call)
        usage = usage_of(self._tokenizer, final, self._reasoning)
        response = self._response.finished(self._done, usage, str(final.finish_reason))
        self._on_finished(response)
        name = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return frames + [self._event(name, response=response.body())]

    def failure(self, error: APIError) -> list[Frame]:
        frames = self._close("incomplete")
        response = self._response.failed(error, self._done)
        return frames + [self._event("response.failed", response=response.body())]

    def _write(self, piece: Piece, logprobs: list[dict[str, Any]]) -> list[Frame]:
        frames: list[Frame] = []
        if self._open is not None and self._open.kind != piece.kind:
            frames += self._close("completed")
        if self._open is None:
            frames += self._start(piece.kind)
        item = self._open
        item.text += piece.text
        item.logprobs += logprobs
        if piece.kind == "reasoning":
            self._reasoning += piece.text
        if not piece.text:
            return frames
        fields: dict[str, Any] = {"logprobs": logprobs} if piece.kind == "content" else {}
        frames.append(
            self._event(
                f"{KINDS[piece.kind][2]}.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=piece.text,
                **fields,
            )
        )
        return frames

    def _start(self, kind: str) -> list[Frame]:
        item = self._open = OpenItem(kind, len(self._done), self._options)
        return [
            self._event(
                "response.output_item.added",
                output_index=item.index,
                item=self._dump(item.item("in_progress"), empty=True),
            ),
            self._event(
                "response.content_part.added",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                part=item.part(""),
            ),
        ]

    def _close(self, status: str) -> list[Frame]:
        item, self._open = self._open, None
        if item is None:
            return []
        done = item.item(status)
        self._done.append(done)
        fields: dict[str, Any] = {"logprobs": item.logprobs} if item.kind == "content" else {}
        position = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        part = done.content[0].model_dump() if done.content else item.part("")
        return [
            self._event(f"{KINDS[item.kind][2]}.done", **position, text=item.text, **fields),
            self._event("response.content_part.done", **position, part=part),
            self._event(
                "response.output_item.done", output_index=item.index, item=self._dump(done)
            ),
        ]

    def _call(self, call: Any) -> list[Frame]:
        index = len(self._done)
        done = FunctionCallOutput.of(call)
        started = done.model_copy(update={"status": "in_progress"})
        self._done.append(done)
        position = {"item_id": done.id, "output_index": index}
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item={**started.model_dump(), "arguments": ""},
            ),
            self._event("response.function_call_arguments.delta", **position, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done", **position, arguments=call.arguments
            ),
            self._event("response.output_item.done", output_index=index, item=done.model_dump()),
        ]

    @staticmethod
    def _dump(item: OutputItem, empty: bool = False) -> dict[str, Any]:
        """An item as an event carries it; `empty`: as it starts, with no content yet."""
        body = item.model_dump()
        if empty:
            body["content"] = []
        return body

    def _event(self, name: str, **fields: Any) -> Frame:
        frame = (name, {"type": name, "sequence_number": self._sequence, **fields})
        self._sequence += 1
        return frame
