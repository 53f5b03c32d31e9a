"""A replica pool: the servers behind one upstream name, each with its own circuit (outlier
ejection, readmitted through the breaker's half-open probe), in-flight count and recent latency.

A replica that leaves the pool (discovery no longer lists it, a reload drops it) drains: it gets no
new request, the ones it carries finish, and it is forgotten when the last one ends. Every attempt
that takes a replica (`begin`) is matched by exactly one `end`, whatever happens to the request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import cast

from proxy.core.balance import Balancer, make_balancer
from proxy.core.circuit import Breaker
from proxy.settings import DnsTarget, display_url

_EWMA = 0.2  # weight of the newest sample in the recent TTFT/TPOT


class Replica:
    __slots__ = ("url", "display_url", "breaker", "in_flight", "ttft", "tpot", "draining", "served")

    def __init__(self, url: str, breaker: Breaker) -> None:
        self.url = url
        self.display_url = display_url(url)
        self.breaker = breaker
        self.in_flight = 0
        self.ttft: float | None = None  # seconds, recent (EWMA)
        self.tpot: float | None = None
        self.draining = False
        self.served = 0

    def admitted(self, now: float) -> bool:
        """May take a new request now: in the pool, and its circuit closed (or its probe free)."""
        return not self.draining and self.breaker.available(now)

    def state(self, now: float) -> str:
        if self.draining:
            return "draining"
        return "up" if not self.breaker.is_open else "ejected"

    def observe(self, ttft: float | None, tpot: float | None) -> None:
        if ttft is not None:
            self.ttft = ttft if self.ttft is None else self.ttft + _EWMA * (ttft - self.ttft)
        if tpot is not None:
            self.tpot = tpot if self.tpot is None else self.tpot + _EWMA * (tpot - self.tpot)

    def __repr__(self) -> str:
        role = "draining" if self.draining else "member"
        return f"Replica({self.display_url}, in_flight={self.in_flight}, {role})"


class ReplicaPool:
    """The members new requests may go to, and those still draining."""

    def __init__(
        self,
        upstream: str,
        policy: str,
        breaker: Callable[[], Breaker],
        load_factor: float = 0.25,
        session_header: str = "x-session-id",
        dns: DnsTarget | None = None,
        discovery_interval: float = 5.0,
    ) -> None:
        self.upstream = upstream
        self.policy = policy
        self.new_breaker = breaker
        self.load_factor = load_factor
        self.session_header = session_header
        self.dns = dns
        self.discovery_interval = discovery_interval
        self.members: list[Replica] = []
        self.draining: list[Replica] = []
        self.balancer: Balancer = make_balancer(policy, load_factor)
        self.wants_key = policy == "prefix_affinity"
        self.successor: ReplicaPool | None = None  # the pool a reload replaced this one with

    # -- membership (discovery, reload): the control plane's, never on a request's path ---------
    def set_members(
        self, urls: Iterable[str], known: dict[str, Replica] | None = None
    ) -> tuple[list[Replica], list[Replica]]:
        """The pool becomes `urls` (in order); a kept URL keeps its replica (`known` adds those of
        another pool: a reload's). Returns (joined, left); a replica that left drains."""
        current = {r.url: r for r in self.members}
        for r in self.draining:
            current.setdefault(r.url, r)
        pool = {**(known or {}), **current}
        members: list[Replica] = []
        joined: list[Replica] = []
        for url in dict.fromkeys(urls):
            found = pool.get(url)
            if found is None:
                r = Replica(url, self.new_breaker())
                joined.append(r)
            else:
                r = found
            if found is not None and r not in self.members:
                joined.append(r)
            r.draining = False
            members.append(r)
        left = [r for r in self.members if r not in members]
        keep = set(map(id, members))
        self.draining[:] = [r for r in self.draining if id(r) not in keep and r.in_flight > 0]
        for r in left:
            r.draining = True
            if r.in_flight > 0:
                self.draining.append(r)
        self.members = members
        self.balancer.rebuild(members)
        return joined, left

    def adopt(self, old: ReplicaPool, fresh_breakers: bool = False) -> None:
        """A reload's: a replica whose URL stays keeps its state (in-flight, circuit unless
        [circuit] changed); the old pool's others drain, and requests that began on the old pool
        choose among this one's members from now on (none goes to a replica that left)."""
        prev = old.current().by_url()
        if self.dns is not None and self.dns == old.dns and not self.members:
            urls = [r.url for r in old.current().members]  # discovered: kept until the next resolution
        else:
            urls = [r.url for r in self.members]
        self.members = []
        self.set_members(urls, prev)
        self.balancer.inherit(old.current().balancer, self.members)
        if fresh_breakers:
            for r in self.members:
                r.breaker = self.new_breaker()
        kept = {r.url for r in self.members}
        current = old.current()
        current.set_members([r.url for r in current.members if r.url in kept])
        current.successor = self
        # One list of draining replicas for the upstream across reloads: whichever pool a request
        # began on, its end finds the replica there; one that is a member again is not draining.
        current.draining[:] = [r for r in (*current.draining, *self.draining) if r.draining]
        self.draining = current.draining

    def retire(self) -> None:
        """The upstream left the configuration: every replica drains; new attempts find none."""
        self.current().set_members([])

    def current(self) -> ReplicaPool:
        pool = self
        while pool.successor is not None:
            pool = pool.successor
        return pool

    def by_url(self) -> dict[str, Replica]:
        return {r.url: r for r in (*self.draining, *self.members)}

    # -- a request's path ------------------------------------------------------------------------
    def available(self, now: float) -> bool:
        return any(r.admitted(now) for r in self.current().members)

    def choose(
        self, key: int | None, tried: Iterable[Replica] = (), panic: bool = False, now: float | None = None
    ) -> tuple[Replica | None, str]:
        """A replica for the next attempt and why (a `balance` reason); None: none may take it."""
        now = time.monotonic() if now is None else now
        pool = self if self.successor is None else self.current()
        chosen, reason = pool.balancer.choose(pool.members, key, tuple(tried), panic, now)
        return cast("Replica | None", chosen), reason

    @staticmethod
    def begin(replica: Replica) -> None:
        replica.in_flight += 1

    def end(self, replica: Replica) -> None:
        replica.in_flight -= 1
        replica.served += 1
        if (replica.in_flight <= 0 or not replica.draining) and replica in self.draining:
            self.draining.remove(replica)  # drained (or a member again): forgotten here

    # -- what the status routes show ------------------------------------------------------------
    def describe(self, now: float) -> str:
        if not self.members:
            where = f" ({self.dns.name} resolved to no address yet)" if self.dns else ""
            return f"its pool has no replica{where}"
        states = [f"{r.display_url}: {r.breaker.describe(now)}" for r in self.members if not r.admitted(now)]
        return "every replica of its pool is ejected (" + "; ".join(states) + ")"

    def retry_in(self, now: float) -> float:
        waits = [r.breaker.retry_in(now) for r in self.members]
        return min(waits) if waits else self.discovery_interval

    def rows(self, now: float) -> list[dict[str, object]]:
        return [
            {
                "address": r.display_url,
                "state": r.state(now),
                "in_flight": r.in_flight,
                "ttft_seconds": None if r.ttft is None else round(r.ttft, 4),
                "tpot_seconds": None if r.tpot is None else round(r.tpot, 5),
                "why": r.breaker.describe(now) if r.breaker.is_open else None,
            }
            for r in (*self.members, *self.draining)
        ]
