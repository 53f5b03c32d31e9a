"""The composition root: create_app() wires infertap's planes into one FastAPI application.

The observers (proxy/observe/), the running proxy and its control plane (proxy/control/runtime.py:
upstream client, forwarder, checks, drain, reload), the ops and operator routes and the OpenAPI
document (proxy/api/), and the raw dispatch of the proxied OpenAI routes in front of FastAPI
(proxy/control/dispatch.py). Nothing here runs per request but the two lines of `__call__`. No
BaseHTTPMiddleware anywhere (it hides client disconnects).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from proxy import __version__
from proxy.api import operator, ops
from proxy.api.deps import STATE_KEY
from proxy.api.docs import install_docs
from proxy.api.errors import install_error_handlers
from proxy.api.openapi import DESCRIPTION, build_openapi
from proxy.api.raw_routes import raw_routes
from proxy.control.dispatch import Dispatch
from proxy.control.reload_sharing import Peers
from proxy.control.runtime import Runtime
from proxy.core.asgi import Receive, Scope, Send
from proxy.core.hooks import Observer, ObserverSet
from proxy.core.model_routing import ModelRouter
from proxy.core.seam import UpstreamClient
from proxy.observe.access_log import AccessLog
from proxy.observe.metrics import Metrics
from proxy.observe.metrics.prometheus import CollectorRegistry
from proxy.observe.repetition import RepetitionDetector
from proxy.observe.spend import SpendObserver
from proxy.observe.tracing import build_tracing
from proxy.observe.ui import UIObserver, UIRoutes
from proxy.observe.upstream_stats import UpstreamStats
from proxy.settings import Settings
from proxy.transport import CLIENTS

log = logging.getLogger("infertap.app")


@asynccontextmanager
async def _lifespan(api: FastAPI) -> AsyncIterator[None]:
    assert isinstance(api, InfertapApp)
    try:
        await api.runtime.start()
    except Exception:
        log.exception("startup failed")
        raise
    try:
        yield
    finally:
        await api.runtime.stop()


class InfertapApp(FastAPI):
    """FastAPI, with the proxied routes dispatched raw before it (proxy/control/dispatch.py)."""

    def __init__(self, runtime: Runtime, ui: UIObserver | None) -> None:
        super().__init__(
            title="infertap",
            version=__version__,
            description=DESCRIPTION,
            lifespan=_lifespan,
            docs_url=None,  # api/docs.py: the same page, its assets served here, not from a CDN
            redoc_url=None,
            openapi_url="/openapi.json",
            # A redirect to the slash-less path would be built from the client's Host header (an
            # open redirect, carrying ?token=): the dispatch answers /metrics/ as /metrics instead.
            redirect_slashes=False,
        )
        self.runtime = runtime
        self.dispatch = Dispatch(runtime, super().__call__)
        setattr(self.state, STATE_KEY, runtime)
        self.include_router(ops.router)
        self.include_router(operator.router)
        if runtime.settings.ui.enabled and ui is not None:
            page = UIRoutes(ui, lambda: runtime.access.metrics_token)
            self.router.routes.extend(raw_routes(page.routes()))
        install_docs(self, "/openapi.json")
        install_error_handlers(self)

    def openapi(self) -> dict[str, Any]:
        return build_openapi(self)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.dispatch(scope, receive, send)  # FastAPI's requests go on from there
            return
        await super().__call__(scope, receive, send)

    # The running proxy's, for callers that hold the app (tests, tools, `infertap serve`).
    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def routing(self) -> ModelRouter:
        return self.runtime.routing

    @property
    def observers(self) -> ObserverSet:
        return self.runtime.observers

    @property
    def freeze_heap(self) -> bool:
        return self.runtime.freeze_heap

    @freeze_heap.setter
    def freeze_heap(self, on: bool) -> None:
        self.runtime.freeze_heap = on

    def ready(self) -> tuple[bool, str]:
        return self.runtime.ready()

    def share_reloads(self, peers: Peers) -> None:
        self.runtime.share_reloads(peers)


def create_app(
    settings: Settings,
    observers: Sequence[Observer] = (),
    *,
    registry: CollectorRegistry | None = None,
    metrics: bool = True,
    client: Callable[[], UpstreamClient] | None = None,
    reload: Callable[[], Settings] | None = None,
) -> InfertapApp:
    """The proxy app. `client` makes the upstream client (none: `[server] upstream_client`'s).
    `reload` gives the settings that POST /admin/reload and SIGHUP apply (none:
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
        chain.append(RepetitionDetector(settings.loops, collector.degenerate_response if collector else None))
    if settings.ui.enabled:
        chain.append(UIObserver(settings, collector.model_label if collector is not None else None))
    chain.extend(observers)
    stats = next(o for o in chain if isinstance(o, UpstreamStats))
    make_client = client or CLIENTS[settings.server.upstream_client]
    runtime = Runtime(settings, ObserverSet(chain), stats, collector, make_client, reload)
    ui = next((o for o in chain if isinstance(o, UIObserver)), None)
    if ui is not None:
        ui.pool_rows = runtime.pool_rows
    return InfertapApp(runtime, ui)
