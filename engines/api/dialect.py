"""Dialect: what the app needs to know of one API dialect (OpenAI's, Anthropic's, ...): its
routes, which of them generate, and the shape its errors take. Each dialect package exports
one; the app serves the ones it is given, and nothing else lists them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.responses import Response

from engines.api.errors import APIError, ErrorRenderer
from engines.core.service_registry import ServiceRegistry


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    router: Callable[[ServiceRegistry, int], APIRouter]  # (models, max_prompt_tokens)
    # The routes that submit a generation: a refusal on them counts as a rejected request.
    generation_paths: tuple[str, ...]
    # Errors on paths under this prefix, the middlewares' 401s and 413s too, take its shape.
    path_prefix: str
    render_error: ErrorRenderer
    # Why a field its schema accepts only at the default is refused (None: not one of those).
    refusal_of: Callable[[str | None], str | None] | None = None

    def claims(self, path: str) -> bool:
        prefix = self.path_prefix
        return path == prefix or path.startswith(prefix.rstrip("/") + "/")


@dataclass(frozen=True, slots=True)
class Dialects:
    """The dialects an app serves; errors on a path none claims take `default`'s shape."""

    served: tuple[Dialect, ...]
    default: Dialect

    def at(self, path: str) -> Dialect:
        """The dialect whose path prefix is the longest one `path` is under."""
        claiming = [dialect for dialect in self.served if dialect.claims(path)]
        return max(claiming, key=lambda dialect: len(dialect.path_prefix), default=self.default)

    def response(self, path: str, error: APIError) -> Response:
        return self.at(path).render_error(error)

    def generation_paths(self) -> frozenset[str]:
        return frozenset(path for dialect in self.served for path in dialect.generation_paths)

    def refusal_of(self, path: str, param: str | None) -> str | None:
        """Why the field `param` of a generation on `path` is refused, if its dialect says."""
        dialect = self.at(path)
        if path not in dialect.generation_paths or dialect.refusal_of is None:
            return None
        return dialect.refusal_of(param)
