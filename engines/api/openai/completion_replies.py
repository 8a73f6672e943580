"""A completion mapped out: its continuation whole, or as chunks (OpenAI's one shape for both)."""

from __future__ import annotations

import time
from typing import Any

from engines.api.errors import APIError
from engines.api.generate import Replies, Submitted
from engines.api.generation import Outcome
from engines.api.openai.errors import error_body
from engines.api.openai.logprobs import completion_logprobs
from engines.api.openai.schemas import Completion, CompletionChoice, CompletionRequest, Usage
from engines.api.streaming import OPENAI_SSE, Frame
from engines.api.token_score import TokenScore
from engines.core.engine import TokenEvent
from engines.core.service import Service


class CompletionChunks:
    """The chunk shapes of a streamed completion (a streaming.StreamWriter); OpenAI sends no
    opening chunk here."""

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        tokenizer: Any,
        top: int | None = None,
        include_usage: bool = False,
    ) -> None:
        self.id = id
        self.created = created
        self.model = model
        self._tokenizer = tokenizer
        self._top = top  # None: no logprobs
        self._include_usage = include_usage
        self._offset = 0  # text_offset of the next token

    def opening(self) -> list[Frame]:
        return []

    def content(self, text: str, scores: list[TokenScore]) -> list[Frame]:
        logprobs = None
        if self._top is not None and scores:
            logprobs = completion_logprobs(self._tokenizer, scores, self._top, self._offset)
        self._offset += len(text)
        return [self._chunk([CompletionChoice(text=text, logprobs=logprobs)])]

    def finish(self, final: TokenEvent) -> list[Frame]:
        reason = str(final.finish_reason)
        frames = [self._chunk([CompletionChoice(text="", finish_reason=reason)])]
        if self._include_usage:
            usage = Usage.of(final)
            frames.append(self._chunk([], usage))
        return frames

    def failure(self, error: APIError) -> list[Frame]:
        return [(None, error_body(error))]

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Frame:
        completion = Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return (None, completion)


def completion_replies(body: CompletionRequest, service: Service, completion_id: str) -> Replies:
    """A completion's chunks, or its one Completion (OpenAI's one shape for both)."""
    created = int(time.time())
    tokenizer = service.tokenizer

    def chunks(run: Submitted) -> CompletionChunks:
        return CompletionChunks(
            completion_id,
            created,
            service.model_id,
            tokenizer,
            body.logprobs,
            body.include_usage(),
        )

    def completion(run: Submitted, outcome: Outcome) -> dict[str, Any]:
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, outcome.scores, body.logprobs)
        choice = CompletionChoice(
            text=outcome.text, finish_reason=outcome.finish_reason, logprobs=logprobs
        )
        return Completion(
            id=completion_id,
            created=created,
            model=service.model_id,
            choices=[choice],
            usage=Usage.of(outcome),
        ).model_dump()

    return Replies(OPENAI_SSE, chunks, completion)
