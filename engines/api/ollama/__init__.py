"""The Ollama dialect: /api/chat, /api/generate and the model routes, NDJSON streams."""

from engines.api.ollama.routes import ERROR_PREFIX, create_router, render_error

__all__ = ["ERROR_PREFIX", "create_router", "render_error"]
