"""The assistant's reply read out of the generated text: its reasoning (between the template's
think markers), its content, and its tool calls — whole, or piece by piece while streaming."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.api.conversation import ChatInput, ToolCall
from engines.api.tools import ToolCallStream, ToolFormat, partial_suffix

PieceKind = Literal["reasoning", "content"]


@dataclass(frozen=True, slots=True)
class Piece:
    kind: PieceKind
    text: str


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """The text that opens and closes the model's thinking (mlx-lm's tokenizer knows it)."""

    start: str
    end: str

    @classmethod
    def of(cls, tokenizer: Any, chat: ChatInput) -> ThinkMarkers | None:
        """None when the template does not think, or the request turned thinking off."""
        if chat.resolved_thinking() is False or not getattr(tokenizer, "has_thinking", False):
            return None
        return cls(tokenizer.think_start, tokenizer.think_end)

    def open_at_end(self, tokenizer: Any, prompt: Sequence[int]) -> bool:
        """The prompt ends inside a thought: the template opened it for the model."""
        tail = tokenizer.decode(list(prompt[-32:]))
        start, end = tail.rfind(self.start), tail.rfind(self.end)
        return start >= 0 and start > end


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole reply: its reasoning, its content (calls cut out) and its calls."""

    reasoning: str
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ReplyStream:
    """Feed generated text; get back reasoning and content pieces safe to send now.

    Text that could begin a think marker is held until it is not; content goes through the
    tool-call stream, which holds back calls until `finish`.
    """

    def __init__(
        self,
        chat: ChatInput,
        tools: ToolFormat | None,
        markers: ThinkMarkers | None = None,
        thinking: bool = False,
    ) -> None:
        self._chat = chat
        self._tools = ToolCallStream(tools, chat.offered_tools()) if tools is not None else None
        self._markers = markers
        self._thinking = thinking and markers is not None  # inside a thought now
        self._held = ""

    @classmethod
    def of(
        cls, tokenizer: Any, chat: ChatInput, tools: ToolFormat | None, prompt: Sequence[int]
    ) -> ReplyStream:
        """The stream for one request: thinking when the template thinks and the request did
        not turn it off, starting inside a thought when the prompt opened one."""
        markers = ThinkMarkers.of(tokenizer, chat)
        thinking = markers is not None and markers.open_at_end(tokenizer, prompt)
        return cls(chat, tools, markers, thinking)

    def read_whole(self, text: str) -> Reply:
        """The whole reply of a finished generation (a fresh stream reads it)."""
        pieces = self.feed(text)
        rest, calls = self.finish()
        pieces += rest
        reasoning = "".join(piece.text for piece in pieces if piece.kind == "reasoning")
        content = "".join(piece.text for piece in pieces if piece.kind == "content")
        return Reply(reasoning, content, calls)

    def feed(self, text: str) -> list[Piece]:
        if self._markers is None:
            return self._content(text)
        self._held += text
        pieces: list[Piece] = []
        while self._held:
            marker = self._markers.end if self._thinking else self._markers.start
            found = self._held.find(marker)
            if found < 0:
                cut = len(self._held) - partial_suffix(self._held, marker)
                ready, self._held = self._held[:cut], self._held[cut:]
                pieces += self._emit(ready)
                break
            pieces += self._emit(self._held[:found])
            self._held = self._held[found + len(marker) :]
            self._thinking = not self._thinking
        return pieces

    def finish(self) -> tuple[list[Piece], list[ToolCall]]:
        """The pieces still held, and the tool calls, once the generation has ended."""
        held, self._held = self._held, ""
        pieces = self._emit(held)
        if self._tools is None:
            return pieces, []
        content, calls = self._tools.finish(self._chat.template_tools(), self._chat.single_call())
        if content:
            pieces.append(Piece("content", content))
        return pieces, calls

    def _emit(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._thinking:
            return [Piece("reasoning", text)]
        return self._content(text)

    def _content(self, text: str) -> list[Piece]:
        if self._tools is not None:
            text = self._tools.feed(text)
        return [Piece("content", text)] if text else []
