"""The routes of the built-in page: GET /ui, its two static files, and GET /ui/data.

/ui and /ui/data follow the auth of /metrics: with `auth.metrics_token_env` set they need
`Authorization: Bearer <token>`, or `?token=<token>` (a browser cannot add a header to a page
load; the page passes the token on to /ui/data in the header). The static script and style
sheet are the same for everyone and carry no data: they are served without the token. The token
is the one that applies now, so a reload that changes it ([auth]) holds here as for /metrics.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from urllib.parse import parse_qs

import orjson

from proxy.core.asgi import RawHeaders, Receive, Scope, Send, header, send_error, send_json
from proxy.observe.ui.observer import UIObserver

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

# The page loads nothing from elsewhere; the empty data: icon keeps browsers from asking for
# /favicon.ico.
_CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_COMMON: RawHeaders = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]
REUSE_SECONDS = 0.5
STATIC: dict[str, tuple[str, bytes]] = {
    "/ui": ("index.html", b"text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", b"text/css; charset=utf-8"),
}


def static_file(name: str) -> bytes:
    return resources.files("proxy.observe.ui").joinpath("static", name).read_bytes()


class UIRoutes:
    def __init__(self, observer: UIObserver, token: Callable[[], str | None]) -> None:
        self.observer = observer
        self.token = token
        self.files = {path: (static_file(name), ctype) for path, (name, ctype) in STATIC.items()}
        # The last /ui/data answer: several open pages share one computation per REUSE_SECONDS,
        # unless a reload came in between (its configuration shows at once).
        self._body: bytes | None = None
        self._body_at = 0.0
        self._body_config: object = None

    def routes(self) -> dict[tuple[str, str], Handler]:
        table: dict[tuple[str, str], Handler] = {("GET", path): self._static for path in STATIC}
        table[("GET", "/ui/")] = self._slash
        table[("GET", "/ui/data")] = self._data
        return table

    def authorized(self, scope: Scope) -> bool:
        token = self.token()
        if token is None:
            return True
        expected = token.encode()
        given = header(scope, b"authorization") or ""
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), expected):
            return True
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return any(hmac.compare_digest(t.encode(), expected) for t in query.get("token", []))

    async def _static(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        body, ctype = self.files[path]
        extra: RawHeaders = []
        if path == "/ui":
            if not self.authorized(scope):
                await _plain(send, 401, b"/ui needs the metrics token: open /ui?token=<token> (docs/ui.md)")
                return
            extra = [(b"content-security-policy", _CSP)]
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *_COMMON, *extra]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _slash(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Relative, so that the page also works behind a proxy that adds a path prefix.
        query: bytes = scope.get("query_string", b"")
        location = b"../ui" + (b"?" + query if query else b"")
        headers = [(b"location", location), (b"content-length", b"0"), *_COMMON]
        await send({"type": "http.response.start", "status": 308, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _data(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.authorized(scope):
            await send_error(
                send,
                401,
                "/ui/data needs 'Authorization: Bearer <token>' (auth.metrics_token_env)",
                "invalid_request_error",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        now = time.monotonic()
        config = self.observer.config
        if self._body is None or now - self._body_at >= REUSE_SECONDS or config is not self._body_config:
            self._body, self._body_at = orjson.dumps(self.observer.snapshot()), now
            self._body_config = config
        await send_json(send, 200, self._body, list(_COMMON))


async def _plain(send: Send, status: int, text: bytes) -> None:
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(text)).encode()),
        (b"www-authenticate", b"Bearer"),
        *_COMMON,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text, "more_body": False})
