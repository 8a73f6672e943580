"""GET /chat: a page to talk to the served model, streamed from /v1/chat/completions in the
browser; its scripts and styles are served from here too (no CDN: it works offline)."""

from __future__ import annotations

from html import escape
from importlib import resources
from string import Template

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from engines.api.errors import APIError
from engines.core.service import Service

PAGE_PATH = "/chat"
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css"}
STATIC_FILES = ("chat.js", "chat.css", "markdown.js")


def create_router(service: Service) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    page = Template(_static_text("chat.html")).substitute(
        title=escape(f"tandem · chat · {service.model_id}")
    )

    @router.get(PAGE_PATH)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get(PAGE_PATH + "/static/{name}")
    async def chat_static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no chat page file {name!r}", code="not_found")
        media_type = STATIC_TYPES[name[name.rindex(".") :]]
        headers = {"Cache-Control": "max-age=300"}
        return Response(_static_text(name), media_type=media_type, headers=headers)

    return router


def _static_text(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")
