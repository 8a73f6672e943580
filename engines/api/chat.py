"""POST /v1/chat/completions: messages in, one assistant message (or its chunks) out."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..service import Service
from .generation import build_request, check_supported, collect, wait_budget_s
from .metrics import mark_submitted, received_at
from .prompts import chat_prompt_tokens
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Usage,
)
from .streaming import EventStreamResponse, stream_generation


@dataclass(frozen=True, slots=True)
class ChatChunks:
    """The chunk shapes of a streamed chat completion (see streaming.ChunkWriter)."""

    id: str
    created: int
    model: str

    def opening(self) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(role="assistant", content=""))

    def content(self, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(content=text))

    def finish(self, reason: str) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(), reason)

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def _chunk(self, delta: ChatDelta, finish_reason: str | None = None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )


def create_router(service: Service, max_prompt_tokens: int) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        check_supported(service, body)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        # Templating and tokenizing a long prompt takes a while: never on the event loop.
        prompt = await asyncio.to_thread(
            chat_prompt_tokens, service.tokenizer, body.messages, max_prompt_tokens
        )
        submission = service.submit(
            build_request(service, completion_id, body, prompt, max_prompt_tokens),
            received_at=received_at(request.scope),
        )
        mark_submitted(request.scope)
        if body.stream:
            writer = ChatChunks(completion_id, created, service.model_id)
            events = stream_generation(
                submission, wait_budget_s(service), writer, body.include_usage()
            )
            return EventStreamResponse(events, on_close=submission.cancel)
        outcome = await collect(submission, wait_budget_s(service), request.is_disconnected)
        usage = Usage.counted(
            outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens
        )
        choice = ChatChoice(
            message=AssistantMessage(content=outcome.text), finish_reason=outcome.finish_reason
        )
        completion = ChatCompletion(
            id=completion_id,
            created=created,
            model=service.model_id,
            choices=[choice],
            usage=usage,
        )
        return JSONResponse(completion.model_dump())

    return router
