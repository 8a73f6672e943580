"""The OpenAPI document as the server behaves: errors in OpenAI's shape, no 422 anywhere."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engines.core.service import Service

# FastAPI documents its own validation error; this app answers those with a 400 instead.
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")
_GENERATION_REQUESTS = ("ChatCompletionRequest", "CompletionRequest")


def install_openapi(app: FastAPI, service: Service, model_ids: list[str] | None) -> None:
    """Replace app.openapi with one that drops the 422s FastAPI adds to every route, and
    states this server's own bounds: the models it serves (`model_ids`, any other gets a
    404; None when models come and go while serving), the largest max_tokens, and the token
    ids the first model's vocabulary has."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
            )
            for path in document.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = document.get("components", {}).get("schemas", {})
            for name in _FASTAPI_VALIDATION:
                schemas.pop(name, None)
            for name in _GENERATION_REQUESTS:
                _state_bounds(schemas.get(name, {}).get("properties", {}), service, model_ids)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _state_bounds(
    properties: dict[str, Any], service: Service, model_ids: list[str] | None
) -> None:
    if "model" in properties and model_ids is not None:
        properties["model"]["enum"] = model_ids
    for name in ("max_tokens", "max_completion_tokens"):
        for option in properties.get(name, {}).get("anyOf", []):
            if option.get("type") == "integer":
                option.update(minimum=1, maximum=service.limits.max_tokens_cap)
    if service.tokenizer is not None:
        for option in properties.get("prompt", {}).get("anyOf", []):
            items = option.get("items", {})
            if items.get("type") == "integer":
                items["maximum"] = len(service.tokenizer) - 1
