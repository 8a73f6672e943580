"""POST /v1/responses, and GET / DELETE /v1/responses/{id} for the stored ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response as HTTPResponse

from engines.api.conversation import Turn
from engines.api.errors import APIError
from engines.api.generate import Job, Replies, Submitted, generate
from engines.api.generation import Outcome, serving
from engines.api.openai.errors import ERROR_RESPONSES, UNAUTHORIZED, documented
from engines.api.responses.events import RESPONSES_SSE, ResponseEvents
from engines.api.responses.mapping import (
    chat_input_of,
    check_fields,
    conversation_of,
    note_ignored,
    sampling_of,
    settings_of,
)
from engines.api.responses.objects import Response, new_id
from engines.api.responses.replies import OutputOptions, output_of, token_logprobs, usage_of
from engines.api.responses.schemas import ResponsesRequest
from engines.api.responses.store import ResponseStore
from engines.api.shared_path import shared_path_route
from engines.api.streaming import STREAMED
from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry

STORED = {**UNAUTHORIZED, 404: documented("no stored response has this id")}
SEALED_INCLUDE = "reasoning.encrypted_content"
STORED_PATH = "/v1/responses/{response_id}"
STORED_METHODS = ("GET", "DELETE")


def not_stored(response_id: str, param: str | None = None) -> APIError:
    message = (
        f"no stored response has the id '{response_id}' (responses are kept in memory, the "
        "most recent ones only, and only when created with store true)"
    )
    if param is not None:  # a request that continues one: the request is at fault
        return APIError(400, message, param=param, code="previous_response_not_found")
    return APIError(404, message, param="response_id", code="not_found")


def response_replies(
    body: ResponsesRequest, service: Service, response_id: str, keep: Callable[[Response], None]
) -> Replies:
    """A response's events, or its one Response object; `keep` stores the finished one."""
    tokenizer = service.tokenizer
    options = OutputOptions(body.max_tool_calls, SEALED_INCLUDE in (body.include or ()))
    created_at = int(time.time())  # now, not when a whole response has been generated

    def started() -> Response:
        return Response(
            id=response_id,
            created_at=created_at,
            status="in_progress",
            model=service.model_id,
            settings=settings_of(body),
        )

    def events(run: Submitted) -> ResponseEvents:
        return ResponseEvents(started(), tokenizer, run.chat_reply(), options, keep)

    def response(run: Submitted, outcome: Outcome) -> dict[str, Any]:
        whole = run.chat_reply().read_whole(outcome.text)
        logprobs = token_logprobs(tokenizer, outcome.scores)
        output = output_of(whole, logprobs, outcome.finish_reason, options)
        usage = usage_of(tokenizer, outcome, whole.reasoning)
        finished = started().finished(output, usage, outcome.finish_reason)
        keep(finished)
        return finished.body()

    return Replies(RESPONSES_SSE, events, response)


def create_router(
    models: ServiceRegistry, max_prompt_tokens: int, store: ResponseStore | None = None
) -> APIRouter:
    router = APIRouter()
    store = store if store is not None else ResponseStore()

    def earlier_turns(body: ResponsesRequest) -> tuple[Turn, ...]:
        if body.previous_response_id is None:
            return ()
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise not_stored(body.previous_response_id, "previous_response_id")
        return stored.conversation

    @router.post(
        "/v1/responses",
        response_model=None,
        responses={200: {"description": "the response", "content": STREAMED}, **ERROR_RESPONSES},
    )
    async def create_response(body: ResponsesRequest, request: Request) -> HTTPResponse:
        service = await serving(models, body.model)
        check_fields(body)
        note_ignored(body)
        conversation = conversation_of(body, earlier_turns(body))
        chat = chat_input_of(body, conversation)
        sampling = sampling_of(body, service.limits)
        response_id = new_id("resp")
        job = Job(response_id, sampling, max_prompt_tokens, body.stream, chat)

        def keep(response: Response) -> None:
            if body.store is not False:
                store.put(response, conversation)

        replies = response_replies(body, service, response_id, keep)
        return await generate(request, service, job, replies)

    router.include_router(stored_router(store))
    return router


def stored_router(store: ResponseStore) -> APIRouter:
    """GET and DELETE /v1/responses/{id}: a stored response, by the id it was created with."""
    router = APIRouter(route_class=shared_path_route(STORED_METHODS))

    @router.get(STORED_PATH, responses=STORED)
    async def retrieve_response(response_id: str) -> JSONResponse:
        stored = store.get(response_id)
        if stored is None:
            raise not_stored(response_id)
        return JSONResponse(stored.response.body())

    @router.delete(STORED_PATH, responses=STORED)
    async def delete_response(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            raise not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router
