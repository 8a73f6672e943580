"""The OpenAI Responses dialect: POST /v1/responses (and GET / DELETE of stored ones)."""

from engines.api.responses.routes import create_router

__all__ = ["create_router"]
