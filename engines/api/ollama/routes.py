"""The Ollama API's routes: /api/chat and /api/generate (NDJSON streams), the model routes,
and Ollama's `{"error": ...}` for everything it cannot do."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from engines.api.conversation import ChatInput
from engines.api.errors import APIError
from engines.api.generate import Job, Replies, Submitted, generate
from engines.api.generation import Outcome, ready_service
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
from engines.core.service import Service
from engines.core.service_registry import ServiceRegistry

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


def ollama_replies(body: GenerationFields) -> Replies:
    """A chat's or generate's NDJSON objects, or its one object."""

    def objects(run: Submitted) -> OllamaReplies:
        chat = isinstance(body, ChatRequest)
        return OllamaReplies(body.model, run.chat_reply(), run.submission, chat)

    def whole(run: Submitted, outcome: Outcome) -> dict[str, Any]:
        return objects(run).whole(outcome)

    return Replies(NDJSON, objects, whole)


def create_router(models: ServiceRegistry, max_prompt_tokens: int) -> APIRouter:
    # Not in the OpenAPI document: Ollama's own docs describe these shapes.
    router = APIRouter(include_in_schema=False)
    add_generation_routes(router, models, max_prompt_tokens)
    add_model_routes(router, models, max_prompt_tokens)
    add_refusals(router)  # last: its catch-all answers every other /api path
    return router


def job_of(
    body: GenerationFields,
    chat: ChatInput,
    prompt_param: str,
    service: Service,
    max_prompt_tokens: int,
    raw_prompt: str | None = None,
) -> Job:
    """The Job of a chat or generate, its thinking and options checked; a prompt too long
    for a num_ctx below --context-tokens will say that num_ctx is what it did not fit."""
    if chat.thinking and not getattr(service.tokenizer, "has_thinking", False):
        raise APIError(
            400,
            f"'{body.model}' does not think (its chat template has no thinking); leave "
            "think out or send false",
            param="think",
            code="unsupported_parameter",
        )
    sampling = sampling_of(body.options, service.limits, prompt_param)
    context = context_of(body.options, max_prompt_tokens)
    note = None
    if context != max_prompt_tokens:
        note = f" (options.num_ctx={context}; --context-tokens is {max_prompt_tokens})"
    request_id = f"ollama-{uuid.uuid4().hex}"
    return Job(request_id, sampling, context, body.streamed(), chat, raw_prompt, note)


def add_generation_routes(
    router: APIRouter, models: ServiceRegistry, max_prompt_tokens: int
) -> None:
    """/api/chat and /api/generate; with nothing to generate each only says it is loaded."""

    @router.post("/api/chat")
    async def chat(body: ChatRequest, request: Request) -> Response:
        service = await ready_service(models, served_model(models, body.model))
        if not body.messages:
            return JSONResponse(loaded(body.model, chat=True))
        job = job_of(body, chat_input_of(body), "messages", service, max_prompt_tokens)
        return await generate(request, service, job, ollama_replies(body))

    @router.post("/api/generate")
    async def generate_text(body: GenerateRequest, request: Request) -> Response:
        service = await ready_service(models, served_model(models, body.model))
        if not body.prompt:
            return JSONResponse(loaded(body.model, chat=False))
        raw_prompt = body.prompt if body.raw else None
        conversation = generate_input_of(body)
        job = job_of(body, conversation, "prompt", service, max_prompt_tokens, raw_prompt)
        return await generate(request, service, job, ollama_replies(body))


def add_model_routes(router: APIRouter, models: ServiceRegistry, max_prompt_tokens: int) -> None:
    """/api/tags, /api/show, /api/ps and /api/version: the served models as Ollama lists them."""

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
        return shown(served_model(models, body.requested()))

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


def shown(service: Service) -> dict[str, Any]:
    """/api/show's answer: the model's card, template and what it can do."""
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


def add_refusals(router: APIRouter) -> None:
    """Ollama's routes tandem does not serve (model management, embeddings), then any other
    /api path: each an error that says why."""
    for path in MANAGING + EMBEDDING:
        router.add_api_route(
            path, refuse_unsupported, methods=["GET", "POST", "DELETE", "HEAD", "PUT"]
        )
    router.add_api_route("/api/blobs/{digest}", refuse_unsupported, methods=["GET", "POST", "HEAD"])
    router.add_api_route(
        "/api/{rest:path}", refuse_unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]
    )


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
