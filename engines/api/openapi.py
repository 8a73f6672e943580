"""The OpenAPI document as the server behaves: errors in OpenAI's shape, no 422 anywhere."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

# FastAPI documents its own validation error; this app answers those with a 400 instead.
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")


def install_openapi(app: FastAPI) -> None:
    """Replace app.openapi with one that drops the 422s FastAPI adds to every route."""

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
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
