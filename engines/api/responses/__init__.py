"""The OpenAI Responses dialect: POST /v1/responses (and GET / DELETE of stored ones); its
errors take OpenAI's shape."""

from engines.api.dialect import Dialect
from engines.api.openai.errors import render_error
from engines.api.responses.routes import create_router

DIALECT = Dialect(
    name="responses",
    router=create_router,
    generation_paths=("/v1/responses",),
    path_prefix="/v1/responses",
    render_error=render_error,
)

__all__ = ["DIALECT"]
