"""Routes of one path declared apart (GET and DELETE of a stored response, GET and POST of
/v1/models): a 405 there must allow every method of the path, where Starlette names only those
of the first route that matched it."""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send


def shared_path_route(methods: tuple[str, ...]) -> type[APIRoute]:
    """An APIRoute class whose 405 allows `methods`: every method its path answers."""

    class SharedPathRoute(APIRoute):
        async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["method"] not in methods:
                raise HTTPException(405, headers={"Allow": ", ".join(methods)})
            await super().handle(scope, receive, send)

    return SharedPathRoute
