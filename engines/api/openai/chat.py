"""POST /v1/chat/completions: messages in, one assistant message (or its chunks) out."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engines.api.conversation import ChatInput, FunctionTool, OutputFormat, ToolCall, Turn
from engines.api.errors import APIError
from engines.api.generate import Job, Replies, Submitted, generate
from engines.api.generation import Outcome, Sampling, check_max_tokens, serving
from engines.api.openai.errors import ERROR_RESPONSES, error_body
from engines.api.openai.fields import chat_top_logprobs, check_chat_fields
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
from engines.api.streaming import OPENAI_SSE, STREAMED, Frame
from engines.api.token_score import TokenScore
from engines.api.tools import ends_in_calls
from engines.core.engine import TokenEvent
from engines.core.served_models import ServedModels
from engines.core.service import Service


def chat_input_of(body: ChatCompletionRequest) -> ChatInput:
    """The conversation, tools and output format a chat completion asks for."""
    choice = body.tool_choice
    forced = None if isinstance(choice, str | None) else choice.function.name
    mode = "required" if forced is not None else (choice or "auto")
    output = None
    requested = body.response_format
    if requested is not None and requested.type == "json_object":
        output = OutputFormat()
    elif requested is not None and requested.type == "json_schema":
        schema = requested.json_schema.json_schema
        output = OutputFormat(None if schema is None else schema.model_dump())
    return ChatInput(
        turns=tuple(
            Turn(
                role=message.role,
                content=message.text(),
                tool_calls=tuple(
                    ToolCall(call.id, call.function.name, call.function.arguments)
                    for call in message.tool_calls or ()
                ),
                tool_call_id=message.tool_call_id,
                name=message.name,
                reasoning=message.reasoning_content,
            )
            for message in body.messages
        ),
        tools=tuple(
            FunctionTool(
                tool.function.name,
                tool.function.description,
                None if tool.function.parameters is None else tool.function.parameters.model_dump(),
            )
            for tool in body.tools or ()
        ),
        tool_mode=mode,
        forced_tool=forced,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        output_format=output,
        thinking=False if body.reasoning_effort == "none" else None,
        template_options=dict(body.chat_template_kwargs or {}),
    )


def sampling_of(body: ChatCompletionRequest, service: Service) -> Sampling:
    """max_completion_tokens wins over the legacy max_tokens (both are checked)."""
    for name in ("max_tokens", "max_completion_tokens"):
        check_max_tokens(getattr(body, name), name, service.limits)
    param, value = "max_completion_tokens", body.max_completion_tokens
    if value is None:
        param, value = "max_tokens", body.max_tokens
    return Sampling(
        max_tokens=value,
        **body.sampling_values(),
        logprobs=chat_top_logprobs(body),
        names={
            "max_tokens": param,
            "prompt_tokens": "messages",
            "logprobs": "logprobs" if body.top_logprobs is None else "top_logprobs",
        },
    )


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


def create_router(models: ServedModels, max_prompt_tokens: int) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletion, "content": STREAMED}, **ERROR_RESPONSES},
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        service = await serving(models, body.model)
        check_chat_fields(body)
        chat = chat_input_of(body)
        sampling = sampling_of(body, service)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        job = Job(completion_id, sampling, max_prompt_tokens, body.stream, chat)
        return await generate(request, service, job, chat_replies(body, service, completion_id))

    return router
