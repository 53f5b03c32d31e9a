"""Raw ASGI handlers (the /ui page's) as Starlette routes: no request parsing on their way."""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from proxy.core.asgi import Receive, Scope, Send


class RawRoute:
    """A raw ASGI handler (the /ui page's) as a Starlette route endpoint: no request parsing."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


def raw_routes(table: dict[tuple[str, str], Any]) -> list[Route]:
    return [
        Route(path, RawRoute(h), methods=[method], include_in_schema=False)
        for (method, path), h in table.items()
    ]
