"""The one path every dialect's generation request takes once its body is mapped: the engine's
checks, the prompt, the queue, then the reply streamed or whole in the dialect's own shapes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from engines.api.call_guard import call_guard
from engines.api.constraints import output_grammar
from engines.api.conversation import ChatInput
from engines.api.errors import APIError
from engines.api.generation import (
    Outcome,
    Sampling,
    build_request,
    check_features,
    collect,
    engine_features,
    wait_budget_s,
)
from engines.api.metrics import mark_submitted, received_at
from engines.api.prompts import chat_prompt_tokens, completion_prompt_tokens
from engines.api.reply import ReplyStream
from engines.api.streaming import Framing, StreamWriter, stream_response
from engines.api.tools import tool_format_for
from engines.core.request import GenerationRequest
from engines.core.runner import Submission
from engines.core.service import Service

RawPrompt = str | list[str] | list[int]


@dataclass(frozen=True, slots=True)
class Job:
    """What a dialect's request asks to generate, mapped into tandem's terms.

    `chat` carries the conversation, the tools and the output format (None: a plain text
    continuation); `raw_prompt`, when given, goes to the model as it is instead of the chat's
    turns through the template (the chat still says how to read the reply).
    """

    request_id: str
    sampling: Sampling
    context_tokens: int  # what the prompt and the reply must fit in
    stream: bool
    chat: ChatInput | None = None
    raw_prompt: RawPrompt | None = None
    # Why the context is smaller than the server's, added to a prompt-too-long 400 so the
    # caller knows which of its own fields to raise.
    context_note: str | None = None

    def grammar_param(self) -> str | None:
        return self.chat.grammar_param() if self.chat is not None else None


@dataclass(frozen=True, slots=True)
class Submitted:
    """A generation on its way: what a dialect builds its reply from."""

    submission: Submission
    prompt: tuple[int, ...]
    reply: ReplyStream | None  # reads thought, text and calls out of a chat's reply

    def chat_reply(self) -> ReplyStream:
        if self.reply is None:
            raise TypeError("a plain text continuation has no chat reply to read")
        return self.reply


@dataclass(frozen=True, slots=True)
class Replies:
    """A dialect's two ways of answering: a stream of its frames, or its one JSON body."""

    framing: Framing
    writer: Callable[[Submitted], StreamWriter]
    whole: Callable[[Submitted, Outcome], dict[str, Any]]


async def generate(request: Request, service: Service, job: Job, replies: Replies) -> Response:
    """Run `job` on `service` and answer in the dialect's `replies`; every 400 comes before
    the request queues, so a refused request never reaches the engine."""
    features = engine_features(service)
    check_features(features, job.sampling, job.grammar_param())
    tokenizer = service.tokenizer
    chat = job.chat
    tools = tool_format_for(chat, tokenizer) if chat is not None else None
    grammar = output_grammar(chat, tokenizer, tools) if chat is not None else None
    prompt = await prompt_tokens(tokenizer, job)
    generation = None
    if grammar is None and chat is not None and "grammar" in features:
        generation = guarded_request(service, job, prompt, call_guard(chat, tokenizer, tools))
    if generation is None:
        generation = build_request(
            service,
            job.request_id,
            job.sampling,
            prompt,
            job.context_tokens,
            grammar,
            job.grammar_param(),
        )
    submission = service.submit(generation, received_at=received_at(request.scope))
    mark_submitted(request.scope)
    reply = ReplyStream.of(tokenizer, chat, tools, prompt) if chat is not None else None
    submitted = Submitted(submission, prompt, reply)
    if job.stream:
        writer = replies.writer(submitted)
        return stream_response(submission, wait_budget_s(service), writer, replies.framing)
    outcome = await collect(submission, wait_budget_s(service), request.is_disconnected)
    return JSONResponse(replies.whole(submitted, outcome))


def guarded_request(
    service: Service, job: Job, prompt: tuple[int, ...], guard: str | None
) -> GenerationRequest | None:
    """The request with its tool calls guarded (engines/api/call_guard.py), or None: no
    guard, or one the engine would not take (a pipeline frame too small for it, say), which
    costs the guard and never the request."""
    if guard is None:
        return None
    try:
        return build_request(
            service, job.request_id, job.sampling, prompt, job.context_tokens, guard
        )
    except APIError:
        return None


async def prompt_tokens(tokenizer: Any, job: Job) -> tuple[int, ...]:
    """The job's prompt as token ids, off the event loop: templating and tokenizing a long
    prompt takes a while."""
    try:
        if job.raw_prompt is not None:
            return await asyncio.to_thread(
                completion_prompt_tokens, tokenizer, job.raw_prompt, job.context_tokens
            )
        return await asyncio.to_thread(chat_prompt_tokens, tokenizer, job.chat, job.context_tokens)
    except APIError as error:
        if error.code == "context_length_exceeded" and job.context_note is not None:
            error.message += job.context_note
        raise
