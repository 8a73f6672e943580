"""The Ollama dialect: /api/chat, /api/generate and the model routes, NDJSON streams."""

from engines.api.dialect import Dialect
from engines.api.ollama.errors import render_error
from engines.api.ollama.routes import create_router

DIALECT = Dialect(
    name="ollama",
    router=create_router,
    generation_paths=("/api/chat", "/api/generate"),
    path_prefix="/api",
    render_error=render_error,
)

__all__ = ["DIALECT"]
