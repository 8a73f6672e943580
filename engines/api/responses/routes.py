"""POST /v1/responses, and GET / DELETE /v1/responses/{id} for the stored ones."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response as HTTPResponse

from engines.api.constraints import output_grammar
from engines.api.conversation import Turn
from engines.api.errors import ERROR_RESPONSES, STREAMED, UNAUTHORIZED, APIError, documented
from engines.api.generation import (
    build_request,
    check_features,
    collect,
    engine_features,
    serving,
    wait_budget_s,
)
from engines.api.metrics import mark_submitted, received_at
from engines.api.prompts import chat_prompt_tokens
from engines.api.reply import ReplyStream
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
from engines.api.streaming import stream_response
from engines.api.tools import tool_format_for
from engines.core.served_models import ServedModels

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


def create_router(
    models: ServedModels, max_prompt_tokens: int, store: ResponseStore | None = None
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
        check_features(engine_features(service), sampling, chat.grammar_param())
        tokenizer = service.tokenizer
        tools = tool_format_for(chat, tokenizer)
        grammar = output_grammar(chat, tokenizer, tools)
        response_id = new_id("resp")
        # Templating and tokenizing a long prompt takes a while: never on the event loop.
        prompt = await asyncio.to_thread(chat_prompt_tokens, tokenizer, chat, max_prompt_tokens)
        generation = build_request(
            service,
            response_id,
            sampling,
            prompt,
            max_prompt_tokens,
            grammar,
            chat.grammar_param(),
        )
        submission = service.submit(generation, received_at=received_at(request.scope))
        mark_submitted(request.scope)
        reply = ReplyStream.of(tokenizer, chat, tools, prompt)
        started = Response(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            model=service.model_id,
            settings=settings_of(body),
        )

        options = OutputOptions(body.max_tool_calls, SEALED_INCLUDE in (body.include or ()))

        def keep(response: Response) -> None:
            if body.store is not False:
                store.put(response, conversation)

        if body.stream:
            writer = ResponseEvents(started, tokenizer, reply, options, keep)
            return stream_response(submission, wait_budget_s(service), writer, RESPONSES_SSE)
        outcome = await collect(submission, wait_budget_s(service), request.is_disconnected)
        whole = reply.read_whole(outcome.text)
        logprobs = token_logprobs(tokenizer, outcome.scores)
        output = output_of(whole, logprobs, outcome.finish_reason, options)
        usage = usage_of(tokenizer, outcome, whole.reasoning)
        response = started.finished(output, usage, outcome.finish_reason)
        keep(response)
        return JSONResponse(response.body())

    stored_router = APIRouter(route_class=shared_path_route(STORED_METHODS))

    @stored_router.get(STORED_PATH, responses=STORED)
    async def retrieve_response(response_id: str) -> JSONResponse:
        stored = store.get(response_id)
        if stored is None:
            raise not_stored(response_id)
        return JSONResponse(stored.response.body())

    @stored_router.delete(STORED_PATH, responses=STORED)
    async def delete_response(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            raise not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    router.include_router(stored_router)
    return router
