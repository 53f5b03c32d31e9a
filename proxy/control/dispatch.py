"""The raw dispatch in front of FastAPI: the proxied OpenAI routes go to the forwarder here, before
FastAPI's router, middleware or request parsing run (a raw dispatch costs ~2 µs, a FastAPI
endpoint ~54 µs). Everything else goes on to FastAPI, with X-Request-Id added to its answer.

The client's key is checked here, for every /v1/* request (GET /v1/models included) and before
anything of the body is read; the operator API answers only on its own port when one is set.

Every request is accounted for once: the forwarder's have their Exchange and hooks; every other
one (refused here, or FastAPI's) gets the one `answered` hook (a count in
infertap_http_requests_total, an access-log line) as its last byte goes out.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from proxy.control.auth import ANONYMOUS
from proxy.control.runtime import Runtime
from proxy.core.asgi import Message, RawHeaders, Receive, Scope, Send, header, send_error
from proxy.core.exchange import LocalAnswer
from proxy.core.hooks import ObserverSet
from proxy.core.route_table import OTHER, PROXIED

UNAUTHORIZED = (
    "a valid infertap key is required: send 'Authorization: Bearer <key>' with a key configured in [auth]"
)
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# The `route` of a request FastAPI answers: a closed vocabulary, whatever path a client sends.
_LOCAL_ROUTES = {
    "/healthz": "healthz",
    "/readyz": "readyz",
    "/metrics": "metrics",
    "/status": "status",
    "/v1/models": "models",
    "/ui": "ui",
    "/docs": "docs",
    "/openapi.json": "docs",
}
_LOCAL_PREFIXES = (("/ui/", "ui"), ("/docs/", "docs"), ("/admin/", "admin"))
UNKNOWN = "unknown"


def route_class(path: str) -> str:
    """The route label of a request that infertap answers itself."""
    found = _LOCAL_ROUTES.get(path)
    if found is not None:
        return found
    for prefix, name in _LOCAL_PREFIXES:
        if path.startswith(prefix):
            return name
    return UNKNOWN


def _refused_route(path: str) -> str:
    """The route label of a /v1/ request refused for its key."""
    route = PROXIED.get(path)
    if route is not None:
        return route.label
    return "models" if path == "/v1/models" else OTHER.label


# The ops routes a probe or a person may type with a trailing slash. /ui/ has its own (relative)
# redirect; anything else with a slash FastAPI does not know is a 404, never a redirect.
SLASH_TOLERANT = frozenset({"/healthz", "/readyz", "/status", "/metrics", "/openapi.json", "/docs"})

# Methods no OpenAI route has, and a passthrough must not carry: TRACE (and TRACK) echo the request,
# the upstream's key included; CONNECT would open a tunnel.
NEVER_RELAYED = frozenset({"TRACE", "TRACK", "CONNECT"})


def forwarded(method: str, path: str) -> bool:
    """Whether `Dispatch` answers the request through the forwarder or refuses it as one of the
    proxied routes (401, 405), never reaching FastAPI: the server runs these at the protocol level
    (proxy/server/raw_routes.py). GET /v1/models is FastAPI's."""
    return path.startswith("/v1/") and not (path == "/v1/models" and method == "GET")


class Dispatch:
    def __init__(self, runtime: Runtime, fastapi: App) -> None:
        self.runtime = runtime
        self.fastapi = fastapi

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runtime.follow_peers()  # another worker reloaded: follow it first
        path: str = scope["path"]
        client: str | None = None
        if path.startswith("/v1/"):
            client = self._identify(scope)
            if client is None:
                label = _refused_route(path)
                bearer: RawHeaders = [(b"www-authenticate", b"Bearer")]
                await self._refuse(scope, send, label, 401, UNAUTHORIZED, "invalid_api_key", bearer)
                return
            if await self._proxied(scope, receive, send, path, client):
                return
        if path.endswith("/") and path.rstrip("/") in SLASH_TOLERANT:
            # /metrics/ is /metrics, answered, never redirected (see InfertapApp: redirect_slashes).
            scope["path"] = path = path.rstrip("/")
        admin_port = self.runtime.settings.server.admin_port
        if admin_port and path.startswith("/admin/") and (scope.get("server") or ("", 0))[1] != admin_port:
            msg = f"no route {path} on this port: the operator API is on port {admin_port}"
            await self._refuse(scope, send, "admin", 404, msg, "not_found")
            return
        answer = Answer(self.runtime, scope, send, route_class(path), client)
        try:
            await self.fastapi(scope, receive, answer.send)
        finally:
            answer.report()

    def _identify(self, scope: Scope) -> str | None:
        """The request's bounded client name; None: refused (no valid client key)."""
        access = self.runtime.access
        if access.client_keys is not None:
            return access.client_keys.identify(header(scope, b"authorization"))
        if access.client_header is not None:
            return access.client_header(header(scope, access.client_header.header))
        return ANONYMOUS

    async def _proxied(self, scope: Scope, receive: Receive, send: Send, path: str, client: str) -> bool:
        """The OpenAI API, raw: True when answered here (everything but GET /v1/models)."""
        method: str = scope["method"]
        route = PROXIED.get(path)
        if route is not None and method != route.method:
            msg = f"{path} accepts {route.method} only, not {method}"
            await self._refuse(scope, send, route.label, 405, msg, "method_not_allowed", client=client)
            return True
        if route is None:
            if path == "/v1/models" and method == "GET":
                return False  # FastAPI's (proxy/api/ops.py)
            if method in NEVER_RELAYED:
                msg = f"infertap never relays {method}: an upstream that echoes a request would echo its key"
                await self._refuse(scope, send, OTHER.label, 405, msg, "method_not_allowed", client=client)
                return True
            route = OTHER
        scope["infertap.client"] = client  # the bounded name, read by the forwarder into the Exchange
        await self.runtime.forwarder.handle(scope, receive, send, route)
        return True

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        route: str,
        status: int,
        message: str,
        code: str,
        extra: RawHeaders | None = None,
        client: str | None = None,
    ) -> None:
        answer = Answer(self.runtime, scope, send, route, client)
        try:
            await send_error(answer.send, status, message, "invalid_request_error", code, extra)
        finally:
            answer.report()


class Answer:
    """One request that infertap answers itself: X-Request-Id added to its answer, and its one
    `answered` hook fired just before its last byte goes out, so that a client holding the whole
    answer finds it counted and logged."""

    __slots__ = ("record", "observers", "_send", "_rid")

    def __init__(self, runtime: Runtime, scope: Scope, send: Send, route: str, client: str | None) -> None:
        rid = runtime.request_ids(scope)
        self.record = LocalAnswer(rid, scope["method"], route, client=client)
        self.observers: ObserverSet = runtime.observers
        self._send = send
        self._rid = (b"x-request-id", rid.encode())

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.record.status = message["status"]
            message = {**message, "headers": [*message.get("headers", ()), self._rid]}
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.report()
        await self._send(message)

    def report(self) -> None:
        """Once: at the last byte, or when the answer ended without one."""
        record = self.record
        if record.finished_at is not None:
            return
        record.finished_at = time.perf_counter()
        if not record.status:
            record.status = 499  # no answer went out: the client left (or the server stopped) first
        self.observers.answered(record)
