"""The Anthropic Messages dialect: POST /v1/messages and /v1/messages/count_tokens."""

from engines.api.anthropic.errors import render_error
from engines.api.anthropic.routes import ERROR_PREFIX, create_router

__all__ = ["ERROR_PREFIX", "create_router", "render_error"]
