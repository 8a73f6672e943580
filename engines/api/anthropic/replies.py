"""A generation mapped out: the assistant message as content blocks (thinking, text, tool_use),
whole or as Messages' stream of named events."""

from __future__ import annotations

import json
import logging
from typing import Any

from engines.api.anthropic.errors import error_payload
from engines.api.anthropic.schemas import (
    Content,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolUseContent,
    Usage,
)
from engines.api.conversation import ToolCall
from engines.api.errors import APIError
from engines.api.reply import Piece, Reply, ReplyStream
from engines.api.streaming import Frame
from engines.api.token_score import TokenScore
from engines.api.tools import ends_in_calls
from engines.core.engine import TokenEvent

log = logging.getLogger(__name__)


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as Anthropic's `input` object (always an object)."""
    value = call.arguments_value()
    if isinstance(value, dict):
        return value
    log.info("tool call %s has arguments that are not an object: %r", call.id, value)
    return {}


def stop_reason_of(
    finish_reason: str, stop_sequence: str | None, calls: list[ToolCall]
) -> tuple[StopReason, str | None]:
    """(stop_reason, the stop sequence that ended it)."""
    if ends_in_calls(calls):
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return "end_turn", None


def content_of(whole: Reply) -> list[Content]:
    """A whole reply's blocks: its thought, its text, then its calls."""
    blocks: list[Content] = []
    if whole.reasoning:
        blocks.append(ThinkingContent(thinking=whole.reasoning))
    if whole.content:
        blocks.append(TextContent(text=whole.content))
    blocks += [
        ToolUseContent(id=call.id, name=call.name, input=tool_input(call)) for call in whole.calls
    ]
    return blocks


class MessageEvents:
    """The named events of a streamed message (a streaming.StreamWriter).

    Thought and text go out as they come, each run in a block of its own; tool calls are
    held back by the reply stream and go out at the end, one tool_use block each, their
    input in one input_json_delta.
    """

    def __init__(self, id: str, model: str, prompt_tokens: int, reply: ReplyStream) -> None:
        self.id = id
        self.model = model
        self._prompt_tokens = prompt_tokens
        self._reply = reply
        self._index = -1  # the latest block's index
        self._open: str | None = None  # the kind of the block open now ("reasoning", ...)

    def opening(self) -> list[Frame]:
        # The cached part of the prompt is known only at the end (message_delta's usage).
        usage = Usage(input_tokens=self._prompt_tokens, output_tokens=0)
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage.model_dump(),
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def content(self, text: str, scores: list[TokenScore]) -> list[Frame]:
        return self._pieces(self._reply.feed(text))

    def finish(self, final: TokenEvent) -> list[Frame]:
        pieces, calls = self._reply.finish()
        frames = self._pieces(pieces) + self._close()
        for call in calls:
            frames += self._tool_use(call)
        reason, sequence = stop_reason_of(str(final.finish_reason), final.stop_sequence, calls)
        usage = Usage.counted(final.prompt_tokens, final.completion_tokens, final.cached_tokens)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        frames.append(
            (
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": usage.model_dump()},
            )
        )
        frames.append(("message_stop", {"type": "message_stop"}))
        return frames

    def failure(self, error: APIError) -> list[Frame]:
        return [("error", error_payload(error))]

    def _pieces(self, pieces: list[Piece]) -> list[Frame]:
        frames: list[Frame] = []
        for piece in pieces:
            if piece.kind != self._open:
                frames += self._close()
                block = (
                    ThinkingContent(thinking="")
                    if piece.kind == "reasoning"
                    else TextContent(text="")
                )
                frames.append(self._start(block.model_dump()))
                self._open = piece.kind
            delta = (
                {"type": "thinking_delta", "thinking": piece.text}
                if piece.kind == "reasoning"
                else {"type": "text_delta", "text": piece.text}
            )
            frames.append(self._delta(delta))
        return frames

    def _tool_use(self, call: ToolCall) -> list[Frame]:
        block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        partial = json.dumps(tool_input(call), ensure_ascii=False)
        frames = [
            self._start(block),
            self._delta({"type": "input_json_delta", "partial_json": partial}),
        ]
        self._open = "tool_use"
        return frames + self._close()

    def _start(self, block: dict[str, Any]) -> Frame:
        self._index += 1
        payload = {"type": "content_block_start", "index": self._index, "content_block": block}
        return ("content_block_start", payload)

    def _delta(self, delta: dict[str, Any]) -> Frame:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )

    def _close(self) -> list[Frame]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]
