"""A chat completion mapped out: the assistant message whole, or as chunks; with tools on
offer its calls, and the finish reason "tool_calls"."""

from __future__ import annotations

import time
from typing import Any

from engines.api.conversation import ToolCall
from engines.api.errors import APIError
from engines.api.generate import Replies, Submitted
from engines.api.generation import Outcome
from engines.api.openai.errors import error_body
from engines.api.openai.fields import chat_top_logprobs
from engines.api.openai.logprobs import chat_logprobs
from engines.api.openai.schemas import (
    AssistantMessage,
    AssistantToolCall,
    CalledFunction,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChoiceLogprobs,
    ToolCallDelta,
    Usage,
)
from engines.api.reply import ReplyStream
from engines.api.streaming import OPENAI_SSE, Frame
from engines.api.token_score import TokenScore
from engines.api.tools import ends_in_calls
from engines.core.engine import TokenEvent
from engines.core.service import Service


def api_tool_calls(calls: list[ToolCall]) -> list[AssistantToolCall]:
    return [
        AssistantToolCall(
            id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments)
        )
        for call in calls
    ]


class ChatChunks:
    """The chunk shapes of a streamed chat completion (a streaming.StreamWriter).

    With tools on offer, text that may start a tool call is held back; the calls go out in
    one chunk at the end, and the finish reason becomes "tool_calls".
    """

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        tokenizer: Any,
        reply: ReplyStream,
        include_usage: bool = False,
    ) -> None:
        self.id = id
        self.created = created
        self.model = model
        self._tokenizer = tokenizer
        self._reply = reply
        self._include_usage = include_usage

    def opening(self) -> list[Frame]:
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def content(self, text: str, scores: list[TokenScore]) -> list[Frame]:
        pieces = self._reply.feed(text)
        if not pieces:
            return []  # logprobs of held-back tokens are not sent (OpenAI sends none)
        logprobs = chat_logprobs(self._tokenizer, scores) if scores else None
        return [
            self._chunk(
                self._delta(piece.kind, piece.text), logprobs=logprobs if index == 0 else None
            )
            for index, piece in enumerate(pieces)
        ]

    def finish(self, final: TokenEvent) -> list[Frame]:
        pieces, calls = self._reply.finish()
        frames = [self._chunk(self._delta(piece.kind, piece.text)) for piece in pieces]
        reason = str(final.finish_reason)
        if calls:  # a call cut short keeps the reason "length", its arguments as written
            deltas = [
                ToolCallDelta(
                    index=index,
                    id=call.id,
                    function=CalledFunction(name=call.name, arguments=call.arguments),
                )
                for index, call in enumerate(calls)
            ]
            frames.append(self._chunk(ChatDelta(tool_calls=deltas)))
            reason = "tool_calls" if ends_in_calls(calls) else reason
        frames.append(self._chunk(ChatDelta(), reason))
        if self._include_usage:
            usage = Usage.of(final)
            chunk = ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[], usage=usage
            )
            frames.append((None, chunk))
        return frames

    def failure(self, error: APIError) -> list[Frame]:
        return [(None, error_body(error))]

    @staticmethod
    def _delta(kind: str, text: str) -> ChatDelta:
        return ChatDelta(reasoning_content=text) if kind == "reasoning" else ChatDelta(content=text)

    def _chunk(
        self,
        delta: ChatDelta,
        finish_reason: str | None = None,
        logprobs: ChoiceLogprobs | None = None,
    ) -> Frame:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        chunk = ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )
        return (None, chunk)


def chat_replies(body: ChatCompletionRequest, service: Service, completion_id: str) -> Replies:
    """A chat completion's chunks, or its one ChatCompletion."""
    created = int(time.time())
    tokenizer = service.tokenizer

    def chunks(run: Submitted) -> ChatChunks:
        return ChatChunks(
            completion_id,
            created,
            service.model_id,
            tokenizer,
            run.chat_reply(),
            body.include_usage(),
        )

    def completion(run: Submitted, outcome: Outcome) -> dict[str, Any]:
        whole = run.chat_reply().read_whole(outcome.text)
        finish_reason = "tool_calls" if ends_in_calls(whole.calls) else outcome.finish_reason
        # OpenAI's content is null beside calls when the model said nothing else
        content = (whole.content or None) if whole.calls else whole.content
        message = AssistantMessage(
            content=content,
            reasoning_content=whole.reasoning or None,
            tool_calls=api_tool_calls(whole.calls) or None,
        )
        wants_logprobs = chat_top_logprobs(body) is not None
        logprobs = chat_logprobs(tokenizer, outcome.scores) if wants_logprobs else None
        choice = ChatChoice(message=message, finish_reason=finish_reason, logprobs=logprobs)
        return ChatCompletion(
            id=completion_id,
            created=created,
            model=service.model_id,
            choices=[choice],
            usage=Usage.of(outcome),
        ).model_dump()

    return Replies(OPENAI_SSE, chunks, completion)
