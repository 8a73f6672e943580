"""The OpenAI dialect: POST /v1/chat/completions and /v1/completions; its error shape is
every path's that no other dialect claims."""

from engines.api.dialect import Dialect
from engines.api.openai.errors import render_error
from engines.api.openai.fields import refusal_of
from engines.api.openai.routes import create_router

DIALECT = Dialect(
    name="openai",
    router=create_router,
    generation_paths=("/v1/chat/completions", "/v1/completions"),
    path_prefix="/v1",
    render_error=render_error,
    refusal_of=refusal_of,
)

__all__ = ["DIALECT"]
