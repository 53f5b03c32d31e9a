"""The raw dispatch in front of FastAPI: the proxied OpenAI routes go to the forwarder here, before
FastAPI's router, middleware or request parsing run (a raw dispatch costs ~2 µs, a FastAPI
endpoint ~54 µs). Everything else goes on to FastAPI, with X-Request-Id added to its answer.

The client's key is checked here, for every /v1/* request (GET /v1/models included) and before
anything of the body is read; the operator API answers only on its own port when one is set.
"""

from __future__ import annotations

from proxy.control.auth import ANONYMOUS
from proxy.control.runtime import Runtime
from proxy.core.asgi import Message, Receive, Scope, Send, header, send_error
from proxy.core.route_table import OTHER, PROXIED

UNAUTHORIZED = (
    "a valid infertap key is required: send 'Authorization: Bearer <key>' with a key configured in [auth]"
)

# The ops routes a probe or a person may type with a trailing slash. /ui/ has its own (relative)
# redirect; anything else with a slash FastAPI does not know is a 404, never a redirect.
SLASH_TOLERANT = frozenset({"/healthz", "/readyz", "/status", "/metrics", "/openapi.json", "/docs"})

# Methods no OpenAI route has, and a passthrough must not carry: TRACE (and TRACK) echo the request,
# the upstream's key included; CONNECT would open a tunnel.
NEVER_RELAYED = frozenset({"TRACE", "TRACK", "CONNECT"})


class Dispatch:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """True when the request was answered here; False: FastAPI's (send through `stamped`)."""
        self.runtime.follow_peers()  # another worker reloaded: follow it first
        path: str = scope["path"]
        if path.startswith("/v1/") and await self._proxied(scope, receive, send, path):
            return True
        if path.endswith("/") and path.rstrip("/") in SLASH_TOLERANT:
            # /metrics/ is /metrics, answered, never redirected (see InfertapApp: redirect_slashes).
            scope["path"] = path = path.rstrip("/")
        admin_port = self.runtime.settings.server.admin_port
        if admin_port and path.startswith("/admin/") and (scope.get("server") or ("", 0))[1] != admin_port:
            msg = f"no route {path} on this port: the operator API is on port {admin_port}"
            await send_error(self.stamped(scope, send), 404, msg, "invalid_request_error", "not_found")
            return True
        return False

    async def _proxied(self, scope: Scope, receive: Receive, send: Send, path: str) -> bool:
        """The OpenAI API, raw: True when answered here (everything but GET /v1/models)."""
        method: str = scope["method"]
        access = self.runtime.access
        client: str | None = ANONYMOUS
        if access.client_keys is not None:
            client = access.client_keys.identify(header(scope, b"authorization"))
        elif access.client_header is not None:
            client = access.client_header(header(scope, access.client_header.header))
        if client is None:
            await send_error(
                self.stamped(scope, send),
                401,
                UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
            )
            return True
        route = PROXIED.get(path)
        if route is not None and method != route.method:
            await send_error(
                self.stamped(scope, send),
                405,
                f"{path} accepts {route.method} only, not {method}",
                "invalid_request_error",
                "method_not_allowed",
            )
            return True
        if route is None:
            if path == "/v1/models" and method == "GET":
                return False  # FastAPI's (proxy/api/ops.py)
            if method in NEVER_RELAYED:
                await send_error(
                    self.stamped(scope, send),
                    405,
                    f"infertap never relays {method}: an upstream that echoes a request would echo its key",
                    "invalid_request_error",
                    "method_not_allowed",
                )
                return True
            route = OTHER
        scope["infertap.client"] = client  # the bounded name, read by the forwarder into the Exchange
        await self.runtime.forwarder.handle(scope, receive, send, route)
        return True

    def stamped(self, scope: Scope, send: Send) -> Send:
        """`send` with X-Request-Id added to the response: for every answer that the forwarder
        (which sets its own) does not give."""
        rid = (b"x-request-id", self.runtime.request_ids(scope).encode())

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), rid]}
            await send(message)

        return stamped
