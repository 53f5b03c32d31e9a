"""create_app(): the FastAPI application, with the proxied OpenAI routes dispatched raw in front of it.

FastAPI owns the application: its lifespan (the upstream client, the observers, SIGHUP), the ops
routes (proxy/api/ops.py), the operator API (proxy/api/operator.py) and the OpenAPI document (/docs,
/openapi.json). The proxied routes are the hot path: `__call__` hands them to the forwarder
before FastAPI's router, middleware or request parsing run (a raw dispatch costs ~2 µs, a
FastAPI endpoint ~54 µs). No BaseHTTPMiddleware anywhere (it hides client disconnects).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from proxy import __version__
from proxy.api import operator as admin
from proxy.api import ops
from proxy.api.openapi import DESCRIPTION, build_openapi
from proxy.control.auth import ANONYMOUS
from proxy.control.drain import Drain
from proxy.control.reload import Access, Reloader
from proxy.control.reload_sharing import PEER_POLL_SECONDS, Peers
from proxy.control.upstream_checks import UpstreamChecker
from proxy.core.asgi import Message, Receive, Scope, Send, header, send_error
from proxy.core.forward.forwarder import Forwarder
from proxy.core.hooks import Observer, ObserverSet
from proxy.core.model_routing import Router
from proxy.core.request_ids import RequestIds
from proxy.core.route_table import OTHER, PROXIED
from proxy.core.seam import UpstreamClient
from proxy.observe.access_log import AccessLog
from proxy.observe.metrics.prometheus import CollectorRegistry, Metrics
from proxy.observe.repetition import LoopDetector
from proxy.observe.spend import SpendObserver
from proxy.observe.tracing.spans import build_tracing
from proxy.observe.ui import UIObserver, UIRoutes
from proxy.observe.upstream_stats import UpstreamStats
from proxy.settings import Settings
from proxy.transport import AiohttpClient

log = logging.getLogger("infertap.app")


@dataclass(slots=True)
class _Runtime:
    client: UpstreamClient
    forwarder: Forwarder
    checker: UpstreamChecker
    drain: Drain


@asynccontextmanager
async def _lifespan(api: FastAPI) -> AsyncIterator[None]:
    app = api if isinstance(api, InfertapApp) else None
    assert app is not None
    try:
        await app.startup()
    except Exception:
        log.exception("startup failed")
        raise
    try:
        yield
    finally:
        await app.shutdown()


class InfertapApp(FastAPI):
    def __init__(
        self,
        settings: Settings,
        observers: Sequence[Observer],
        metrics: Metrics | None,
        client: Callable[[], UpstreamClient] = AiohttpClient,
        reload: Callable[[], Settings] | None = None,
    ) -> None:
        super().__init__(
            title="infertap",
            version=__version__,
            description=DESCRIPTION,
            lifespan=_lifespan,
            docs_url="/docs",
            redoc_url=None,
            openapi_url="/openapi.json",
        )
        self.settings = settings
        self.metrics = metrics
        self.make_client = client
        # Read at construction, so that a bad key setting stops start-up with a clear message.
        self.access = Access.from_settings(settings)
        self.observers = ObserverSet(observers)
        stats = next((o for o in observers if isinstance(o, UpstreamStats)), None)
        self.stats = stats if stats is not None else UpstreamStats()
        self.request_ids = RequestIds()
        self.reloader = Reloader(self, reload) if reload is not None else None
        self.reloaded_at: float | None = None
        self._peers: Peers | None = None
        self._peer_timer: asyncio.TimerHandle | None = None
        self._routing: Router | None = None
        self._runtime: _Runtime | None = None
        self.freeze_heap = False  # `infertap serve` sets it: the process is the app's alone
        self.include_router(ops.router)
        self.include_router(admin.router)
        ui = next((o for o in observers if isinstance(o, UIObserver)), None)
        if settings.ui.enabled and ui is not None:
            page = UIRoutes(ui, lambda: self.access.metrics_token)
            self.router.routes.extend(ops.raw_routes(page.routes()))
        ops.install_error_handlers(self)

    def openapi(self) -> dict[str, Any]:
        return build_openapi(self)

    # -- lifespan ---------------------------------------------------------------------------
    async def startup(self) -> None:
        router = Router.from_settings(self.settings)
        client = self.make_client()
        s = self.settings.server
        forwarder = Forwarder(
            router,
            client,
            self.observers,
            s.max_body_bytes,
            tuple(self.settings.metrics.prompt_class_bounds),
            s.max_concurrency,
            self.settings.circuit.when_all_open,
        )
        checker = UpstreamChecker(router, client, s.upstream_check_interval, s.upstream_check_timeout)
        drain = Drain(s.drain_delay, s.drain_timeout, forwarder.shut_down)
        self._routing = router
        self._runtime = _Runtime(client, forwarder, checker, drain)
        drain.install()
        checker.start()
        if self.metrics is not None:
            self.metrics.start_probes()
        if self.reloader is not None:
            self.reloader.install()
        if self._peers is not None:
            self._poll_peers()
        self._log_upstreams(router)
        if self.freeze_heap:
            # What start-up built (FastAPI's routes and models, settings, observers) lives as long
            # as the process: out of the collector's way, so full collections under load stay
            # cheap (measured: ~8% CPU per non-streaming request without this, and full
            # collections of 30-40 ms under load, 2-6 ms with it: docs/benchmarks.md). Only where
            # the app owns the process (`infertap serve`): frozen objects are never collected.
            gc.collect()
            gc.freeze()

    async def shutdown(self) -> None:
        if self._runtime is not None:
            try:
                if self.reloader is not None:
                    self.reloader.uninstall()
                if self._peer_timer is not None:
                    self._peer_timer.cancel()
                self._runtime.drain.close()
                await self._runtime.checker.stop()
                if self.metrics is not None:
                    await self.metrics.stop_probes()
            finally:
                await self._runtime.client.close()
                self._runtime = None
        self.observers.close()

    def ready(self) -> tuple[bool, str]:
        """From state the process has, so that a probe answers at once whatever the upstreams do."""
        rt = self._runtime
        if rt is None or self._routing is None:
            return False, "starting"
        if rt.drain.draining:
            return False, "draining: shutting down"
        if self.settings.server.ready_needs_upstream:
            now = time.monotonic()
            if all(up.breaker.is_open and not up.breaker.available(now) for up in self._routing.upstreams):
                return False, "every upstream's circuit is open"
        return True, "ready"

    @staticmethod
    def _log_upstreams(router: Router) -> None:
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

    @property
    def runtime(self) -> _Runtime:
        if self._runtime is None:
            raise RuntimeError("the app has not started: run it under an ASGI server with lifespan on")
        return self._runtime

    # -- reload (proxy.control.reload.Target) -------------------------------------------------------
    @property
    def routing(self) -> Router:
        """The upstreams and routing that new requests follow (FastAPI's own `router` is its routes)."""
        if self._routing is None:
            raise RuntimeError("the app has not started: run it under an ASGI server with lifespan on")
        return self._routing

    def swap(self, settings: Settings, access: Access, router: Router) -> None:
        # Which circuits start anew, from the breakers themselves: the reload carried over the
        # ones it keeps (proxy/control/reload.py), every other upstream has a new, closed one.
        kept = {id(up.breaker) for up in self._routing.upstreams} if self._routing is not None else set()
        fresh = [up.name for up in router.upstreams if id(up.breaker) not in kept]
        self.settings, self.access, self._routing = settings, access, router
        rt = self.runtime
        rt.forwarder.router = router
        rt.forwarder.panic = settings.circuit.when_all_open == "send"
        rt.checker.router = router
        self.observers.reloaded(settings, fresh)
        self.reloaded_at = time.time()
        self._log_upstreams(router)

    def stream_options_memory(self) -> set[str]:
        return self.runtime.forwarder.attempter.no_stream_options

    def share_reloads(self, peers: Peers) -> None:
        """With --workers N: a reload here reaches the other workers, and theirs reach this one."""
        if self.reloader is not None:
            self._peers = self.reloader.peers = peers

    def _poll_peers(self) -> None:
        """An idle worker follows another's reload within PEER_POLL_SECONDS too, not only at its next
        request: its background checks, and the per-upstream gauges it holds in the shared metrics
        (a circuit its old configuration had open), would show the old configuration meanwhile."""
        peers = self._peers
        if peers is None or self.reloader is None:
            return
        if peers.behind():
            self.reloader.catch_up()
        self._peer_timer = asyncio.get_running_loop().call_later(PEER_POLL_SECONDS, self._poll_peers)

    # -- dispatch ---------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            peers = self._peers
            if peers is not None and peers.behind():  # another worker reloaded: follow it first
                assert self.reloader is not None
                self.reloader.catch_up()
            path: str = scope["path"]
            if path.startswith("/v1/") and await self._proxied(scope, receive, send, path):
                return
            send = self._stamped(scope, send)
            admin_port = self.settings.server.admin_port
            if (
                admin_port
                and path.startswith("/admin/")
                and (scope.get("server") or ("", 0))[1] != admin_port
            ):
                msg = f"no route {path} on this port: the operator API is on port {admin_port}"
                await send_error(send, 404, msg, "invalid_request_error", "not_found")
                return
        await super().__call__(scope, receive, send)

    async def _proxied(self, scope: Scope, receive: Receive, send: Send, path: str) -> bool:
        """The OpenAI API, raw: True when answered here (everything but GET /v1/models)."""
        method: str = scope["method"]
        access = self.access
        client: str | None = ANONYMOUS
        if access.client_keys is not None:
            client = access.client_keys.identify(header(scope, b"authorization"))
        elif access.client_header is not None:
            client = access.client_header(header(scope, access.client_header.header))
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
            return True
        route = PROXIED.get(path)
        if route is not None and method != route.method:
            await send_error(
                self._stamped(scope, send),
                405,
                f"{path} accepts {route.method} only, not {method}",
                "invalid_request_error",
                "method_not_allowed",
            )
            return True
        if route is None:
            if path == "/v1/models" and method == "GET":
                return False  # FastAPI's (ops.models)
            route = OTHER
        scope["infertap.client"] = client  # the bounded name, read by the forwarder into the Exchange
        await self.runtime.forwarder.handle(scope, receive, send, route)
        return True

    def _stamped(self, scope: Scope, send: Send) -> Send:
        """`send` with X-Request-Id added to the response: for every answer that the forwarder
        (which sets its own) does not give."""
        rid = (b"x-request-id", self.request_ids(scope).encode())

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), rid]}
            await send(message)

        return stamped


def create_app(
    settings: Settings,
    observers: Sequence[Observer] = (),
    *,
    registry: CollectorRegistry | None = None,
    metrics: bool = True,
    client: Callable[[], UpstreamClient] = AiohttpClient,
    reload: Callable[[], Settings] | None = None,
) -> InfertapApp:
    """The proxy app. `reload` gives the settings that POST /admin/reload and SIGHUP apply (none:
    nothing to reload). No observer depends on another's place in the chain: the spend observer
    prices a request in `finished`, which runs for all before the readers' `ended`; tracing sets
    the trace id (metrics' exemplar) in `request_received`, before anyone reads it."""
    chain: list[Observer] = [UpstreamStats()]
    if settings.spend.prices:
        chain.append(SpendObserver(settings.spend))
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
    return InfertapApp(settings, chain, collector, client, reload)
