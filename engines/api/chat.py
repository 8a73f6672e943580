"""POST /v1/chat/completions: messages in, one assistant message (or its chunks) out."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engines.api.constraints import output_grammar
from engines.api.errors import ERROR_RESPONSES, STREAMED
from engines.api.generation import build_request, check_supported, collect, wait_budget_s
from engines.api.logprobs import TokenScore, chat_logprobs
from engines.api.metrics import mark_submitted, received_at
from engines.api.prompts import chat_prompt_tokens
from engines.api.schemas import (
    AssistantMessage,
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
from engines.api.streaming import EventStreamResponse, stream_generation
from engines.api.tools import (
    ToolCallStream,
    ToolFormat,
    forces_call,
    split_tool_calls,
    template_tools,
    tool_format_for,
)
from engines.core.service import Service


class ChatChunks:
    """The chunk shapes of a streamed chat completion (see streaming.ChunkWriter).

    With tools on offer, text that may start a tool call is held back; the calls go out in
    one chunk at the end, and the finish reason becomes "tool_calls".
    """

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        tokenizer: Any,
        tools: ToolFormat | None = None,
        body: ChatCompletionRequest | None = None,
    ) -> None:
        self.id = id
        self.created = created
        self.model = model
        self._tokenizer = tokenizer
        self._tools = ToolCallStream(tools) if tools is not None else None
        self._body = body

    def opening(self) -> ChatCompletionChunk:
        return self._chunk(ChatDelta(role="assistant", content=""))

    def content(self, text: str, scores: list[TokenScore]) -> ChatCompletionChunk | None:
        if self._tools is not None:
            text = self._tools.feed(text)
            if not text:
                return None  # logprobs of held-back tokens are not sent (OpenAI sends none)
        logprobs = chat_logprobs(self._tokenizer, scores) if scores else None
        return self._chunk(ChatDelta(content=text), logprobs=logprobs)

    def finish(self, reason: str) -> list[ChatCompletionChunk]:
        chunks = []
        if self._tools is not None and self._body is not None:
            held, calls = self._tools.finish(template_tools(self._body), single_call(self._body))
            if held:
                chunks.append(self._chunk(ChatDelta(content=held)))
            if calls:
                deltas = [
                    ToolCallDelta(index=index, id=call.id, function=call.function)
                    for index, call in enumerate(calls)
                ]
                chunks.append(self._chunk(ChatDelta(tool_calls=deltas)))
                reason = "tool_calls"
        chunks.append(self._chunk(ChatDelta(), reason))
        return chunks

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def _chunk(
        self,
        delta: ChatDelta,
        finish_reason: str | None = None,
        logprobs: ChoiceLogprobs | None = None,
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )


def single_call(body: ChatCompletionRequest) -> bool:
    """parallel_tool_calls=false, or a forced call (whose grammar allows exactly one)."""
    return body.parallel_tool_calls is False or forces_call(body)


def create_router(service: Service, max_prompt_tokens: int) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletion, "content": STREAMED}, **ERROR_RESPONSES},
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        check_supported(service, body)
        tokenizer = service.tokenizer
        tools = tool_format_for(body, tokenizer)
        grammar = output_grammar(body, tokenizer, tools)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        # Templating and tokenizing a long prompt takes a while: never on the event loop.
        prompt = await asyncio.to_thread(
            chat_prompt_tokens, tokenizer, body.messages, max_prompt_tokens, template_tools(body)
        )
        submission = service.submit(
            build_request(service, completion_id, body, prompt, max_prompt_tokens, grammar),
            received_at=received_at(request.scope),
        )
        mark_submitted(request.scope)
        if body.stream:
            writer = ChatChunks(completion_id, created, service.model_id, tokenizer, tools, body)
            events = stream_generation(
                submission, wait_budget_s(service), writer, body.include_usage()
            )
            return EventStreamResponse(events, on_close=submission.cancel)
        outcome = await collect(submission, wait_budget_s(service), request.is_disconnected)
        usage = Usage.counted(
            outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens
        )
        content: str | None = outcome.text
        calls = None
        finish_reason = outcome.finish_reason
        if tools is not None:
            content, found = split_tool_calls(
                outcome.text, tools, template_tools(body), single_call(body)
            )
            if found:
                calls, finish_reason = found, "tool_calls"
                content = content or None
        logprobs = chat_logprobs(tokenizer, outcome.scores) if body.logprobs else None
        choice = ChatChoice(
            message=AssistantMessage(content=content, tool_calls=calls),
            finish_reason=finish_reason,
            logprobs=logprobs,
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
