"""The running proxy: what the composition root (proxy/app.py) wires together and the lifespan starts.

`Runtime` owns the settings in force and who may call what, the model routing, and, between
start-up and shutdown, the upstream client, the forwarder, the background upstream checks and the
drain. A reload swaps what it holds (it is the reload's `Target`). The ops and operator routes read
it as an explicit, typed dependency (proxy/api/deps.py); the raw dispatch of the proxied routes
(dispatch.py) hands requests to its forwarder.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.control.discovery import Discovery, Resolver, system_resolver
from proxy.control.drain import Drain
from proxy.control.model_list import ModelLists, ModelUnion
from proxy.control.reload import Access, Reloader
from proxy.control.reload_sharing import PEER_POLL_SECONDS, Peers
from proxy.control.upstream_checks import UpstreamChecker
from proxy.core.forward import Forwarder
from proxy.core.hooks import ObserverSet
from proxy.core.model_routing import ModelRouter
from proxy.core.request_ids import RequestIds
from proxy.core.seam import UpstreamClient
from proxy.observe.metrics import Metrics
from proxy.observe.upstream_stats import UpstreamStats
from proxy.settings import Settings

log = logging.getLogger("infertap.app")

# How long a reload's answer waits for the other workers to apply it (they poll every
# PEER_POLL_SECONDS), and how often it looks at their slots meanwhile.
ACK_WAIT_SECONDS = 2.0
ACK_POLL_SECONDS = 0.02


class NotStarted(RuntimeError):
    def __init__(self) -> None:
        super().__init__("the app has not started: run it under an ASGI server with lifespan on")


@dataclass(slots=True)
class Started:
    """What exists from start-up to shutdown (made inside the running event loop)."""

    client: UpstreamClient
    forwarder: Forwarder
    checker: UpstreamChecker
    drain: Drain
    discovery: Discovery


class Runtime:
    def __init__(
        self,
        settings: Settings,
        observers: ObserverSet,
        stats: UpstreamStats,
        metrics: Metrics | None,
        make_client: Callable[[], UpstreamClient],
        reload: Callable[[], Settings] | None,
    ) -> None:
        self.settings = settings
        # Read at construction, so that a bad key setting stops start-up with a clear message.
        self.access = Access.from_settings(settings)
        self.observers = observers
        self.stats = stats
        self.metrics = metrics
        self.make_client = make_client
        # One source of request ids, for the forwarder's answers and every other one.
        self.request_ids = RequestIds()
        self.reloader = Reloader(self, reload) if reload is not None else None
        self.reloaded_at: float | None = None
        self.model_lists = ModelLists(settings.server.models_cache_seconds)
        self.peers: Peers | None = None
        self.freeze_heap = False  # `infertap serve` sets it: the process is the app's alone
        self._peer_timer: asyncio.TimerHandle | None = None
        self._poll_failed = False
        self._routing: ModelRouter | None = None
        self._started: Started | None = None
        self.resolver: Resolver = system_resolver  # dns:// pools' (tests set their own)

    # -- start-up and shutdown (the app's lifespan) -----------------------------------------
    async def start(self) -> None:
        routing = ModelRouter.from_settings(self.settings)
        client = self.make_client()
        s = self.settings.server
        forwarder = Forwarder(
            routing,
            client,
            self.observers,
            s.max_body_bytes,
            tuple(self.settings.metrics.prompt_class_bounds),
            s.max_concurrency,
            self.settings.circuit.when_all_open,
            request_ids=self.request_ids,
            stream_headers=s.stream_headers,
            keep_alive_seconds=s.stream_keep_alive_seconds,
            body_timeout=s.body_timeout,
            stream_limits=(s.max_sse_event_bytes, s.max_sse_held_bytes),
        )
        checker = UpstreamChecker(routing, client, s.upstream_check_interval, s.upstream_check_timeout)
        drain = Drain(s.drain_delay, s.drain_timeout, forwarder.shut_down)
        self._routing = routing
        discovery = Discovery(lambda: self._routing, self.observers, self.resolver)
        self._started = Started(client, forwarder, checker, drain, discovery)
        await discovery.resolve_due()  # dns:// pools have their replicas before the first request
        discovery.start()
        drain.install()
        checker.start()
        if self.metrics is not None:
            self.metrics.start_probes()
        if self.reloader is not None:
            self.reloader.install()
        if self.peers is not None:
            self._poll_peers()
        self._log_upstreams(routing)
        if self.freeze_heap:
            # What start-up built (FastAPI's routes and models, settings, observers) lives as long
            # as the process: out of the collector's way, so full collections under load stay
            # cheap (measured: ~8% CPU per non-streaming request without this, and full
            # collections of 30-40 ms under load, 2-6 ms with it: docs/benchmarks.md). Only where
            # the app owns the process (`infertap serve`): frozen objects are never collected.
            gc.collect()
            gc.freeze()

    async def stop(self) -> None:
        started = self._started
        if started is not None:
            try:
                if self.reloader is not None:
                    self.reloader.uninstall()
                if self._peer_timer is not None:
                    self._peer_timer.cancel()
                started.drain.close()
                await started.discovery.stop()
                await started.checker.stop()
                if self.metrics is not None:
                    await self.metrics.stop_probes()
            finally:
                await started.client.close()
                self._started = None
                if self.peers is not None:
                    self.peers.close()
        self.observers.close()

    @property
    def started(self) -> Started:
        if self._started is None:
            raise NotStarted
        return self._started

    @property
    def client(self) -> UpstreamClient:
        return self.started.client

    @property
    def forwarder(self) -> Forwarder:
        return self.started.forwarder

    @property
    def checker(self) -> UpstreamChecker:
        return self.started.checker

    @property
    def drain(self) -> Drain:
        return self.started.drain

    def ready(self) -> tuple[bool, str]:
        """From state the process has, so that a probe answers at once whatever the upstreams do."""
        started, routing = self._started, self._routing
        if started is None or routing is None:
            return False, "starting"
        if started.drain.draining:
            return False, "draining: shutting down"
        if self.settings.server.ready_needs_upstream:
            now = time.monotonic()
            if not any(up.available(now) for up in routing.upstreams):
                return False, "every upstream's circuit is open"
        return True, "ready"

    def status(self) -> dict[str, Any]:
        """GET /status's answer: each upstream's background check and circuit."""
        ready, _ = self.ready()
        status = self.checker.status(self.drain.draining, ready)
        # Whether anyone who reaches the port may use the upstreams' keys: worth seeing at a glance.
        status["open"] = self.access.client_keys is None
        return status

    def pool_rows(self) -> dict[str, list[dict[str, Any]]]:
        """Each pool's replicas now, by upstream (for /ui)."""
        routing, now = self._routing, time.monotonic()
        if routing is None:
            return {}
        return {up.name: up.replicas.rows(now) for up in routing.upstreams if up.replicas is not None}

    async def model_union(self) -> ModelUnion:
        """GET /v1/models's answer: the upstreams' lists, fetched at most models_cache_seconds ago."""
        return await self.model_lists.get(self.routing, self.client)

    @staticmethod
    def _log_upstreams(routing: ModelRouter) -> None:
        for up in routing.upstreams:
            key = (
                "no key"
                if not up.api_key_env
                else (f"key from ${up.api_key_env}" if up.api_key else f"${up.api_key_env} is NOT set")
            )
            models = ", ".join(up.models) if up.models else "(no patterns)"
            default = " [default]" if up is routing.default else ""
            log.info("upstream %s%s: %s, models %s, %s", up.name, default, up.display_url, models, key)
            for warning in up.config_warnings:
                log.warning("%s", warning)

    # -- reload (proxy.control.reload.Target) -----------------------------------------------
    @property
    def routing(self) -> ModelRouter:
        """The upstreams and the model routing that new requests follow."""
        if self._routing is None:
            raise NotStarted
        return self._routing

    def swap(self, settings: Settings, access: Access, routing: ModelRouter) -> None:
        # Which circuits start anew, from the breakers themselves: the reload carried over the
        # ones it keeps (proxy/control/reload.py), every other upstream has a new, closed one.
        kept = {id(up.breaker) for up in self._routing.upstreams} if self._routing is not None else set()
        fresh = [up.name for up in routing.upstreams if id(up.breaker) not in kept]
        self.settings, self.access, self._routing = settings, access, routing
        started = self.started
        started.forwarder.routing = routing
        started.forwarder.panic = settings.circuit.when_all_open == "send"
        started.checker.routing = routing
        try:
            started.discovery.start()  # a reload may bring the first dns:// pool
        except RuntimeError:  # no running loop (never expected: reloads apply in the loop)
            log.warning("replica discovery could not start: a dns:// pool added now needs a restart")
        self.observers.configuration_changed(settings, fresh)
        self.reloaded_at = time.time()
        self._log_upstreams(routing)

    def stream_options_memory(self) -> set[str]:
        return self.forwarder.attempter.no_stream_options

    # -- reloads shared between workers (--workers N) ---------------------------------------
    def share_reloads(self, peers: Peers) -> None:
        """With --workers N: a reload here reaches the other workers, and theirs reach this one."""
        if self.reloader is not None:
            self.peers = self.reloader.peers = peers

    def follow_peers(self) -> None:
        """Before a request: when another worker reloaded, apply what it published first (one
        memory read when nothing changed)."""
        peers = self.peers
        if peers is not None and peers.behind():
            assert self.reloader is not None
            self.reloader.catch_up()

    def _poll_peers(self) -> None:
        """An idle worker follows another's reload within PEER_POLL_SECONDS too, not only at its next
        request: its background checks, and the per-upstream gauges it holds in the shared metrics
        (a circuit its old configuration had open), would show the old configuration meanwhile.
        Whatever fails, the next poll is due: a timer that stopped would leave this worker behind
        every later reload for good."""
        self._peer_timer = asyncio.get_running_loop().call_later(PEER_POLL_SECONDS, self._poll_peers)
        try:
            self.follow_peers()
        except Exception:
            if not self._poll_failed:  # once: it polls twice a second
                log.exception("following another worker's reload failed; still polling")
            self._poll_failed = True
        else:
            self._poll_failed = False

    async def acknowledged(self, generation: int | None) -> tuple[int, int]:
        """(workers that have applied reload `generation`, workers running) once every running one
        has, or ACK_WAIT_SECONDS after it was published, whichever comes first. An idle worker
        applies it within PEER_POLL_SECONDS, a busy one before its next request; one that has not
        by then (its event loop blocked, or the reload failed there) is left out of the count."""
        peers = self.peers
        if peers is None or generation is None:
            return 1, 1
        deadline = time.monotonic() + ACK_WAIT_SECONDS
        while True:
            applied, running = peers.acknowledged(generation)
            if applied >= running or time.monotonic() >= deadline:
                return applied, running
            await asyncio.sleep(ACK_POLL_SECONDS)
