"""The Anthropic Messages dialect: POST /v1/messages and /v1/messages/count_tokens."""

from engines.api.anthropic.errors import render_error
from engines.api.anthropic.routes import create_router
from engines.api.dialect import Dialect

DIALECT = Dialect(
    name="anthropic",
    router=create_router,
    generation_paths=("/v1/messages",),
    path_prefix="/v1/messages",
    render_error=render_error,
)

__all__ = ["DIALECT"]
