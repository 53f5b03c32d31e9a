"""Replica discovery for `replicas = ["dns://NAME:PORT/PATH"]` pools: NAME is resolved (A and AAAA)
every `discovery_interval_seconds`, one replica `http://ADDRESS:PORT/PATH` per address. A Kubernetes
headless Service answers with one address per ready pod, so pods that start join and pods that go
away drain (their streams finish, they get no new request).

A failed resolution keeps the last known set (a DNS hiccup must not empty a working pool) and is
logged once per change of error, never once per interval. The resolver is a parameter: tests
inject one instead of the system's DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from proxy.core.hooks import ObserverSet
from proxy.core.model_routing import ModelRouter, Upstream
from proxy.core.replicas import ReplicaPool

log = logging.getLogger("infertap.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]
TICK_SECONDS = 0.5  # how often the task looks for a pool that is due
RESOLVE_TIMEOUT = 5.0


async def system_resolver(name: str, port: int) -> list[str]:
    """The addresses NAME resolves to (A and AAAA), through the event loop's resolver thread."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class Discovery:
    def __init__(
        self,
        routing: Callable[[], ModelRouter | None],
        observers: ObserverSet,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.routing = routing
        self.observers = observers
        self.resolver = resolver
        self._due: dict[str, float] = {}
        self._pool: dict[str, ReplicaPool] = {}
        self._error: dict[str, str | None] = {}
        self._task: asyncio.Task[None] | None = None

    def pools(self) -> list[tuple[Upstream, ReplicaPool]]:
        routing = self.routing()
        if routing is None:
            return []
        return [(up, up.replicas) for up in routing.upstreams if up.replicas is not None and up.replicas.dns]

    async def resolve_due(self, now: float | None = None) -> None:
        """Resolves every dns:// pool that is due (or new since a reload), at once."""
        now = time.monotonic() if now is None else now
        due = [
            (up, pool)
            for up, pool in self.pools()
            if self._pool.get(up.name) is not pool or now >= self._due.get(up.name, 0.0)
        ]
        if due:
            await asyncio.gather(*(self._resolve(up.name, pool, now) for up, pool in due))

    async def _resolve(self, name: str, pool: ReplicaPool, now: float) -> None:
        target = pool.dns
        assert target is not None
        self._pool[name] = pool
        self._due[name] = now + pool.discovery_interval
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT):
                addresses = await self.resolver(target.name, target.port)
            if not addresses:
                raise OSError("no address")
        except (OSError, TimeoutError) as e:
            error = str(e) or type(e).__name__
            if self._error.get(name) != error:
                log.warning(
                    "upstream %s: %s does not resolve (%s): keeping its %d known replica(s)",
                    name,
                    target.name,
                    error,
                    len(pool.members),
                )
            self._error[name] = error
            return
        if self._error.pop(name, None) is not None:
            log.warning("upstream %s: %s resolves again", name, target.name)
        urls = [target.replica_url(a) for a in sorted(dict.fromkeys(addresses))]
        joined, left = pool.set_members(urls)
        for r in joined:
            log.info("upstream %s: replica %s joined", name, r.display_url)
            self.observers.replica_health(name, r.display_url, True)
        for r in left:
            log.info("upstream %s: replica %s left (draining %d)", name, r.display_url, r.in_flight)
            self.observers.replica_health(name, r.display_url, False)

    def start(self) -> None:
        """At start-up and after each reload: runs while any dns:// pool is configured."""
        if self.pools() and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run(), name="infertap-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.resolve_due()
            except Exception:  # noqa: BLE001 - discovery goes on; a bug here must not end it silently
                log.exception("replica discovery failed; it goes on")
            await asyncio.sleep(TICK_SECONDS)
