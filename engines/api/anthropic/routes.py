"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from engines.api.anthropic.errors import ANTHROPIC_SSE
from engines.api.anthropic.mapping import chat_input_of, sampling_of
from engines.api.anthropic.replies import MessageEvents, content_of, stop_reason_of
from engines.api.anthropic.schemas import (
    CountTokensRequest,
    ErrorBody,
    MessageBody,
    MessagesRequest,
    TokenCount,
    Usage,
)
from engines.api.constraints import output_grammar
from engines.api.generate import Job, Replies, Submitted, generate
from engines.api.generation import Outcome, serving
from engines.api.prompts import chat_prompt_tokens
from engines.api.streaming import STREAMED
from engines.api.tools import tool_format_for
from engines.core.service_registry import ServiceRegistry

log = logging.getLogger(__name__)


def documented(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: documented("invalid_request_error: an invalid or unsupported field"),
    401: documented("authentication_error: missing or wrong API key (with --api-key)"),
    404: documented("not_found_error: the model is not the one this server serves"),
    413: documented("request_too_large: the body is larger than --max-body-bytes"),
    429: documented("rate_limit_error: the request queue is full; retry later"),
    500: documented("api_error: internal server error"),
    503: documented("overloaded_error: no engine is serving, or memory is critical"),
    504: documented("timeout_error: the generation did not finish within --request-timeout"),
}


class UnknownFields:
    """Logs each top-level field nobody here knows, once: ignored, but not unseen."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def note(self, body: CountTokensRequest) -> None:
        for name in (body.model_extra or {}).keys() - self._seen:
            self._seen.add(name)
            log.debug("ignoring the Messages field '%s' (unknown here; logged once)", name)


def message_replies(body: MessagesRequest, message_id: str) -> Replies:
    """A message's named events, or its one MessageBody."""

    def events(run: Submitted) -> MessageEvents:
        return MessageEvents(message_id, body.model, len(run.prompt), run.chat_reply())

    def message(run: Submitted, outcome: Outcome) -> dict[str, Any]:
        whole = run.chat_reply().read_whole(outcome.text)
        reason, sequence = stop_reason_of(outcome.finish_reason, outcome.stop_sequence, whole.calls)
        return MessageBody(
            id=message_id,
            model=body.model,
            content=content_of(whole),
            stop_reason=reason,
            stop_sequence=sequence,
            usage=Usage.counted(
                outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens
            ),
        ).model_dump()

    return Replies(ANTHROPIC_SSE, events, message)


def create_router(models: ServiceRegistry, max_prompt_tokens: int) -> APIRouter:
    router = APIRouter()
    unknown = UnknownFields()

    @router.post(
        "/v1/messages",
        response_model=None,
        responses={200: {"model": MessageBody, "content": STREAMED}, **ERROR_RESPONSES},
    )
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        unknown.note(body)
        service = await serving(models, body.model)
        chat = chat_input_of(body)
        sampling = sampling_of(body, service.limits)
        message_id = f"msg_{uuid.uuid4().hex}"
        job = Job(message_id, sampling, max_prompt_tokens, body.stream, chat)
        return await generate(request, service, job, message_replies(body, message_id))

    @router.post(
        "/v1/messages/count_tokens",
        responses={k: v for k, v in ERROR_RESPONSES.items() if k not in (429, 504)},
    )
    async def count_tokens(body: CountTokensRequest) -> TokenCount:
        """The prompt's tokens as the chat template renders it, tools included."""
        unknown.note(body)
        service = await serving(models, body.model)
        chat = chat_input_of(body)
        tools = tool_format_for(chat, service.tokenizer)
        output_grammar(chat, service.tokenizer, tools)  # the same 400s as a message gets
        prompt = await asyncio.to_thread(
            chat_prompt_tokens, service.tokenizer, chat, max_prompt_tokens
        )
        return TokenCount(input_tokens=len(prompt))

    return router
