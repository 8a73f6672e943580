"""The Ollama API's routes: /api/chat and /api/generate (NDJSON streams), the model routes,
and Ollama's `{"error": ...}` for everything it cannot do."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from engines.api.constraints import output_grammar
from engines.api.conversation import ChatInput
from engines.api.errors import APIError
from engines.api.generation import (
    Sampling,
    build_request,
    check_features,
    collect,
    engine_features,
    ready_service,
    wait_budget_s,
)
from engines.api.metrics import mark_submitted, received_at
from engines.api.ollama.mapping import chat_input_of, generate_input_of
from engines.api.ollama.models import (
    API_VERSION,
    expires_at,
    listed_name,
    model_card,
    served_model,
)
from engines.api.ollama.options import context_of, sampling_of
from engines.api.ollama.replies import NDJSON, OllamaReplies, loaded
from engines.api.ollama.schemas import ChatRequest, GenerateRequest, GenerationFields, ShowRequest
from engines.api.prompts import chat_prompt_tokens, completion_prompt_tokens
from engines.api.reply import ReplyStream
from engines.api.streaming import stream_response
from engines.api.tools import ToolFormat, tool_format_for
from engines.core.served_models import ServedModels
from engines.core.service import Service

ERROR_PREFIX = "/api"
ROUTES = {
    "/api/chat": "POST",
    "/api/generate": "POST",
    "/api/tags": "GET",
    "/api/show": "POST",
    "/api/ps": "GET",
    "/api/version": "GET",
}
# Ollama's model management and embeddings: tandem serves the one model it was started with.
MANAGING = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete")
EMBEDDING = ("/api/embed", "/api/embeddings")
NOT_IMPLEMENTED = 501


def render_error(error: APIError) -> Response:
    """Ollama's error shape: `{"error": "message"}`, with the status; the message names the
    field to fix, since the shape has no `param` of its own."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return JSONResponse({"error": message}, status_code=error.status, headers=error.headers)


def create_router(models: ServedModels, max_prompt_tokens: int) -> APIRouter:
    # Not in the OpenAPI document: Ollama's own docs describe these shapes.
    router = APIRouter(include_in_schema=False)

    async def run(
        service: Service,
        request: Request,
        body: GenerationFields,
        chat: ChatInput,
        tools: ToolFormat | None,
        prompt: tuple[int, ...],
        sampling: Sampling,
        context: int,
    ) -> Response:
        tokenizer = service.tokenizer
        grammar = output_grammar(chat, tokenizer, tools)
        param = chat.names.output_format if grammar is not None else None
        generation = build_request(
            service, f"ollama-{uuid.uuid4().hex}", sampling, prompt, context, grammar, param
        )
        submission = service.submit(generation, received_at=received_at(request.scope))
        mark_submitted(request.scope)
        reply = ReplyStream.of(tokenizer, chat, tools, prompt)
        replies = OllamaReplies(body.model, reply, submission, isinstance(body, ChatRequest))
        if body.streamed():
            return stream_response(submission, wait_budget_s(service), replies, NDJSON)
        outcome = await collect(submission, wait_budget_s(service), request.is_disconnected)
        return JSONResponse(replies.whole(outcome))

    def prepare(
        service: Service, body: GenerationFields, chat: ChatInput, prompt_param: str
    ) -> tuple[Sampling, int]:
        """The checks before templating: thinking, options, what the engine honours."""
        if chat.thinking and not getattr(service.tokenizer, "has_thinking", False):
            raise APIError(
                400,
                f"'{body.model}' does not think (its chat template has no thinking); leave "
                "think out or send false",
                param="think",
                code="unsupported_parameter",
            )
        sampling = sampling_of(body.options, service.limits, prompt_param)
        check_features(engine_features(service), sampling, "format" if body.json_format() else None)
        return sampling, context_of(body.options, max_prompt_tokens)

    async def tokenized(
        tokenize: Callable[[Any, Any, int], tuple[int, ...]],
        tokenizer: Any,
        text: Any,
        context: int,
    ) -> tuple[int, ...]:
        """The prompt's tokens, off the event loop; a prompt too long for a num_ctx below
        --context-tokens says that num_ctx is what it did not fit."""
        try:
            return await asyncio.to_thread(tokenize, tokenizer, text, context)
        except APIError as error:
            if error.code != "context_length_exceeded" or context == max_prompt_tokens:
                raise
            error.message += (
                f" (options.num_ctx={context}; --context-tokens is {max_prompt_tokens})"
            )
            raise

    @router.post("/api/chat")
    async def chat(body: ChatRequest, request: Request) -> Response:
        service = await ready_service(models, served_model(models, body.model))
        if not body.messages:
            return JSONResponse(loaded(body.model, chat=True))
        conversation = chat_input_of(body)
        sampling, context = prepare(service, body, conversation, "messages")
        tools = tool_format_for(conversation, service.tokenizer)
        # Templating and tokenizing a long prompt takes a while: never on the event loop.
        prompt = await tokenized(chat_prompt_tokens, service.tokenizer, conversation, context)
        return await run(service, request, body, conversation, tools, prompt, sampling, context)

    @router.post("/api/generate")
    async def generate_text(body: GenerateRequest, request: Request) -> Response:
        service = await ready_service(models, served_model(models, body.model))
        if not body.prompt:
            return JSONResponse(loaded(body.model, chat=False))
        conversation = generate_input_of(body)
        sampling, context = prepare(service, body, conversation, "prompt")
        tokenizer = service.tokenizer
        if body.raw:
            prompt = await tokenized(completion_prompt_tokens, tokenizer, body.prompt, context)
        else:
            prompt = await tokenized(chat_prompt_tokens, tokenizer, conversation, context)
        return await run(service, request, body, conversation, None, prompt, sampling, context)

    @router.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {
            "models": [
                model_card(service).listing(listed_name(service.model_id))
                for service in models.all()
            ]
        }

    @router.post("/api/show")
    async def show(body: ShowRequest) -> dict[str, Any]:
        if not body.requested():
            raise APIError(400, "'model' is required", param="model", code="invalid_value")
        service = served_model(models, body.requested())
        card = model_card(service)
        tokenizer = service.tokenizer
        capabilities = ["completion"]
        if getattr(tokenizer, "has_tool_calling", False):
            capabilities.append("tools")
        if getattr(tokenizer, "has_thinking", False):
            capabilities.append("thinking")
        return {
            "modelfile": f"# served by tandem: its own chat template, not a Modelfile\n"
            f"FROM {service.model_id}\n",
            "parameters": "",
            # a Jinja template (the model's own), where Ollama shows a Go one
            "template": getattr(tokenizer, "chat_template", None) or "",
            "details": card.details(),
            "model_info": card.info,
            "capabilities": capabilities,
            "modified_at": card.modified_at,
        }

    @router.get("/api/ps")
    async def running() -> dict[str, Any]:
        entries = []
        for service in models.all():
            if service.runner is None or service.tokenizer is None:
                continue
            entry = model_card(service).listing(listed_name(service.model_id))
            entry.pop("modified_at")
            # size_vram 0: tandem does not say where the weights sit (CPU, GPU, machines)
            expires = expires_at(service, models.keep_alive_s)
            entry |= {"expires_at": expires, "size_vram": 0, "context_length": max_prompt_tokens}
            entries.append(entry)
        return {"models": entries}

    @router.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": API_VERSION}

    for path in MANAGING + EMBEDDING:
        router.add_api_route(
            path, refuse_unsupported, methods=["GET", "POST", "DELETE", "HEAD", "PUT"]
        )
    router.add_api_route("/api/blobs/{digest}", refuse_unsupported, methods=["GET", "POST", "HEAD"])
    router.add_api_route(
        "/api/{rest:path}", refuse_unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]
    )
    return router


async def refuse_unsupported(request: Request) -> Response:
    path = request.url.path
    if path in EMBEDDING:
        reason = "tandem serves no embeddings (it generates text)"
    else:
        reason = (
            "tandem serves the one model it was started with (tandem serve --model); it does "
            "not pull, push, create, copy or delete models, nor take blobs"
        )
    raise APIError(NOT_IMPLEMENTED, f"{path} is not supported: {reason}", code="not_implemented")


async def refuse_unknown(request: Request) -> Response:
    path, method = request.url.path, request.method
    served = ", ".join(f"{verb} {route}" for route, verb in ROUTES.items())
    status = 405 if path in ROUTES else 404
    raise APIError(status, f"{method} {path} is not a route here; tandem serves {served}")
