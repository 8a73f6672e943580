"""The OpenAI dialect's routes: POST /v1/chat/completions (messages in, one assistant message
or its chunks out) and POST /v1/completions (a raw prompt in, its continuation out)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engines.api.generate import Job, generate
from engines.api.generation import serving
from engines.api.openai.chat_replies import chat_replies
from engines.api.openai.completion_replies import completion_replies
from engines.api.openai.errors import ERROR_RESPONSES
from engines.api.openai.fields import check_chat_fields, check_completion_fields
from engines.api.openai.mapping import chat_input_of, chat_sampling_of, completion_sampling_of
from engines.api.openai.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)
from engines.api.streaming import STREAMED
from engines.core.service_registry import ServiceRegistry


def create_router(models: ServiceRegistry, max_prompt_tokens: int) -> APIRouter:
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
        sampling = chat_sampling_of(body, service)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        job = Job(completion_id, sampling, max_prompt_tokens, body.stream, chat)
        return await generate(request, service, job, chat_replies(body, service, completion_id))

    @router.post(
        "/v1/completions",
        response_model=None,
        responses={200: {"model": Completion, "content": STREAMED}, **ERROR_RESPONSES},
    )
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        service = await serving(models, body.model)
        check_completion_fields(body)
        sampling = completion_sampling_of(body, service)
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        job = Job(completion_id, sampling, max_prompt_tokens, body.stream, raw_prompt=body.prompt)
        replies = completion_replies(body, service, completion_id)
        return await generate(request, service, job, replies)

    return router
