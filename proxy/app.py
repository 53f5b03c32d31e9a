"""create_app(): the ASGI application, its routes and the resources its lifespan owns.

A plain ASGI dispatcher rather than a framework router: the proxied routes are the hot path,
and two dict lookups are all the routing they need. No BaseHTTPMiddleware anywhere (it hides
client disconnects).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy import __version__
from proxy.accesslog import AccessLog
from proxy.asgi import Message, Receive, Scope, Send, error_body, header, send_error, send_json
from proxy.auth import ANONYMOUS, ClientKeys, bearer_token, header_names
from proxy.drain import Drain
from proxy.forward import Forwarder
from proxy.health import UpstreamChecker, probe_models
from proxy.loops import LoopDetector
from proxy.metrics import CollectorRegistry, Metrics
from proxy.observer import Observer, ObserverSet
from proxy.request import RequestIds
from proxy.settings import Settings
from proxy.spend import SpendObserver
from proxy.tracing import build_tracing
from proxy.ui import UIObserver, UIRoutes
from proxy.upstream import Router, describe, make_client

log = logging.getLogger("infertap.app")

# Proxied routes: path -> (route label, allowed method).
PROXIED: dict[str, tuple[str, str]] = {
    "/v1/chat/completions": ("chat.completions", "POST"),
    "/v1/completions": ("completions", "POST"),
    "/v1/responses": ("responses", "POST"),
    "/v1/embeddings": ("embeddings", "POST"),
}
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=3.0)


@dataclass(slots=True)
class _Runtime:
    client: aiohttp.ClientSession
    router: Router
    forwarder: Forwarder
    checker: UpstreamChecker
    drain: Drain


Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class InfertapApp:
    def __init__(self, settings: Settings, observers: Sequence[Observer], metrics: Metrics | None) -> None:
        self.settings = settings
        self.metrics = metrics
        # Read at construction, so that a bad key setting stops start-up with a clear message.
        self.client_keys = ClientKeys.from_settings(settings.auth)
        self.client_header = header_names(settings.clients, self.client_keys)
        self.metrics_token = bearer_token(settings.auth.metrics_token_env)
        self.observers = ObserverSet(observers)
        self.request_ids = RequestIds()
        self._runtime: _Runtime | None = None
        self._plain: dict[tuple[str, str], Handler] = {
            ("GET", "/healthz"): self._healthz,
            ("GET", "/readyz"): self._readyz,
            ("GET", "/status"): self._status,
            ("GET", "/v1/models"): self._models,
        }
        if metrics is not None:
            self._plain[("GET", "/metrics")] = self._metrics
        ui = next((o for o in observers if isinstance(o, UIObserver)), None)
        if settings.ui.enabled and ui is not None:
            self._plain.update(UIRoutes(ui, self.metrics_token).routes())

    # -- lifespan ---------------------------------------------------------------------------
    async def startup(self) -> None:
        router = Router.from_settings(self.settings)
        client = make_client()
        forwarder = Forwarder(
            router,
            client,
            self.observers,
            self.settings.server.max_body_bytes,
            tuple(self.settings.metrics.prompt_class_bounds),
            self.settings.server.max_concurrency,
            self.settings.circuit.when_all_open,
        )
        s = self.settings.server
        checker = UpstreamChecker(router, client, s.upstream_check_interval, s.upstream_check_timeout)
        drain = Drain(s.drain_delay, s.drain_timeout, forwarder.shut_down)
        self._runtime = _Runtime(client, router, forwarder, checker, drain)
        drain.install()
        checker.start()
        if self.metrics is not None:
            self.metrics.start_probes()
        for up in router.upstreams:
            key = (
                "no key"
                if not up.api_key_env
                else (f"key from ${up.api_key_env}" if up.api_key else f"${up.api_key_env} is NOT set")
            )
            models = ", ".join(up.models) if up.models else "(no patterns)"
            default = " [default]" if up is router.default else ""
            log.info("upstream %s%s: %s, models %s, %s", up.name, default, up.display_url, models, key)
            for warning in up.config_warnings:
                log.warning("%s", warning)

    async def shutdown(self) -> None:
        if self._runtime is not None:
            try:
                self._runtime.drain.close()
                await self._runtime.checker.stop()
                if self.metrics is not None:
                    await self.metrics.stop_probes()
            finally:
                await self._runtime.client.close()
                self._runtime = None
        self.observers.close()

    @property
    def runtime(self) -> _Runtime:
        if self._runtime is None:
            raise RuntimeError("the app has not started: run it under an ASGI server with lifespan on")
        return self._runtime

    # -- dispatch ---------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    def _stamped(self, scope: Scope, send: Send) -> Send:
        """`send` with X-Request-Id added to the response: for every answer that the forwarder
        (which sets its own) does not give."""
        rid = (b"x-request-id", self.request_ids(scope).encode())

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), rid]}
            await send(message)

        return stamped

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        client: str | None = ANONYMOUS
        if self.client_keys is not None and path.startswith("/v1/"):
            client = self.client_keys.identify(header(scope, b"authorization"))
        elif self.client_header is not None:
            client = self.client_header(header(scope, self.client_header.header))
        if client is None:
            await send_error(
                self._stamped(scope, send),
                401,
                "a valid infertap key is required: send 'Authorization: Bearer "
                "<key>' with a key configured in [auth]",
                "invalid_request_error",
                "invalid_api_key",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        proxied = PROXIED.get(path)
        if proxied is not None:
            route, allowed = proxied
            if method != allowed:
                await send_error(
                    self._stamped(scope, send),
                    405,
                    f"{path} accepts {allowed} only, not {method}",
                    "invalid_request_error",
                    "method_not_allowed",
                )
                return
            scope["infertap.client"] = client  # the bounded name, read by the forwarder into the Exchange
            await self.runtime.forwarder.handle(scope, receive, send, route)
            return
        handler = self._plain.get((method, path))
        if handler is not None:
            await handler(scope, receive, self._stamped(scope, send))
            return
        if path.startswith("/v1/"):
            scope["infertap.client"] = client
            await self.runtime.forwarder.handle(scope, receive, send, "other")
            return
        await send_error(
            self._stamped(scope, send),
            404,
            f"no route {method} {path}: infertap serves /v1/* (the OpenAI API), /healthz, /readyz, "
            "/status, /metrics and /ui",
            "invalid_request_error",
            "not_found",
        )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": describe(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- plain endpoints --------------------------------------------------------------------
    async def _healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, orjson.dumps({"status": "ok", "version": __version__}))

    def _authorized(self, scope: Scope) -> bool:
        return self.metrics_token is None or hmac.compare_digest(
            (header(scope, b"authorization") or "").encode(), f"Bearer {self.metrics_token}".encode()
        )

    async def _unauthorized(self, send: Send, path: str) -> None:
        await send_error(
            send,
            401,
            f"{path} needs 'Authorization: Bearer <token>' (auth.metrics_token_env)",
            "invalid_request_error",
            "invalid_api_key",
            [(b"www-authenticate", b"Bearer")],
        )

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.metrics is not None
        if not self._authorized(scope):
            await self._unauthorized(send, "/metrics")
            return
        body, content_type = self.metrics.render(header(scope, b"accept"))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def ready(self) -> tuple[bool, str]:
        """From state the process has, so that a probe answers at once whatever the upstreams do."""
        rt = self._runtime
        if rt is None:
            return False, "starting"
        if rt.drain.draining:
            return False, "draining: shutting down"
        if self.settings.server.ready_needs_upstream:
            now = time.monotonic()
            if all(up.breaker.is_open and not up.breaker.available(now) for up in rt.router.upstreams):
                return False, "every upstream's circuit is open"
        return True, "ready"

    async def _readyz(self, scope: Scope, receive: Receive, send: Send) -> None:
        ready, why = self.ready()
        await send_json(send, 200 if ready else 503, orjson.dumps({"status": why}))

    async def _status(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
            await self._unauthorized(send, "/status")
            return
        ready, _ = self.ready()
        rt = self.runtime
        await send_json(send, 200, orjson.dumps(rt.checker.status(rt.drain.draining, ready)))

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        ups = self.runtime.router.upstreams
        results = await asyncio.gather(*(probe_models(self.runtime.client, u, _PROBE_TIMEOUT) for u in ups))
        data: list[dict[str, Any]] = []
        seen: set[Any] = set()
        failures: list[str] = []
        for up, res in zip(ups, results, strict=True):
            if isinstance(res, Exception) or res.status != 200:
                why = describe(res) if isinstance(res, Exception) else f"HTTP {res.status}"
                failures.append(f"{up.name}: {why}")
                continue
            try:
                listed = orjson.loads(res.body).get("data", [])
            except (orjson.JSONDecodeError, AttributeError):
                failures.append(f"{up.name}: not an OpenAI model list")
                continue
            for model in listed:
                # A model two upstreams serve is listed once, under the first (routing order).
                if isinstance(model, dict) and model.get("id") not in seen:
                    seen.add(model.get("id"))
                    data.append({**model, "upstream": up.name})
        if failures:
            log.warning("model list incomplete: %s", "; ".join(failures))
        if not data and failures:
            msg = "no upstream answered the model list: " + "; ".join(failures)
            await send_json(send, 502, error_body(msg, "upstream_error", "upstream_unreachable"))
            return
        await send_json(send, 200, orjson.dumps({"object": "list", "data": data}))


def create_app(
    settings: Settings,
    observers: Sequence[Observer] = (),
    *,
    registry: CollectorRegistry | None = None,
    metrics: bool = True,
) -> InfertapApp:
    """The proxy app. Observers run in order: spend (it prices the request), tracing (it sets the
    trace id that metrics use as an exemplar), metrics, the access log, then `observers`."""
    chain: list[Observer] = []
    if settings.spend.prices:
        chain.append(SpendObserver(settings.spend))  # first: the others read the cost it sets
    tracer = build_tracing(settings)
    if tracer is not None:
        chain.append(tracer)
    collector = Metrics(settings, registry) if metrics else None
    if collector is not None:
        chain.append(collector)
    if settings.metrics.access_log:
        chain.append(AccessLog(settings.metrics.access_log_format))
    if settings.loops.enabled:
        chain.append(LoopDetector(settings.loops, collector.degenerate_response if collector else None))
    if settings.ui.enabled:
        chain.append(UIObserver(settings, collector.model_label if collector is not None else None))
    chain.extend(observers)
    return InfertapApp(settings, chain, collector)
