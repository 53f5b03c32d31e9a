"""How a pool picks a replica: least_request (power of two choices on in-flight requests),
round_robin, prefix_affinity (consistent hashing with bounded loads, Mirrokni, Thorup and
Zadimoghaddam 2016: a ring with virtual nodes per replica, spilling clockwise past a replica already
at ceil((1 + eps) x the mean load)).

Each choice comes with its reason, counted in `infertap_balance_decisions_total`:
affinity_hit, spilled, ejected (the preferred replica was ejected, another taken), least_request,
round_robin, retry (another replica after a failed attempt). A replica the request already tried is
avoided while another may take it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from typing import Protocol


class Replica(Protocol):
    """What a policy reads of a replica (proxy/core/replicas.py's)."""

    url: str
    in_flight: int
    draining: bool

    def admitted(self, now: float) -> bool: ...

VIRTUAL_NODES = 64  # points per replica on the ring: keys spread within a few percent


def stable_hash(data: bytes) -> int:
    """The same in every worker and every run (Python's hash() of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _candidates(
    members: Sequence[Replica], tried: tuple[Replica, ...], panic: bool, now: float
) -> list[Replica]:
    ok = [r for r in members if not r.draining and (panic or r.admitted(now))]
    if tried:
        fresh = [r for r in ok if r not in tried]
        return fresh or ok
    return ok


class Balancer:
    name = ""

    def rebuild(self, members: Sequence[Replica]) -> None:
        """The pool's members changed (control plane only)."""

    def choose(
        self, members: Sequence[Replica], key: int | None, tried: tuple[Replica, ...], panic: bool, now: float
    ) -> tuple[Replica | None, str]:
        raise NotImplementedError


class LeastRequest(Balancer):
    """Two replicas at random, the one with fewer requests in flight: close to the least loaded
    without scanning the pool, and no herd onto one replica that looks idle to every worker."""

    name = "least_request"

    def choose(
        self, members: Sequence[Replica], key: int | None, tried: tuple[Replica, ...], panic: bool, now: float
    ) -> tuple[Replica | None, str]:
        cands = _candidates(members, tried, panic, now)
        reason = "retry" if tried else self.name
        if len(cands) <= 1:
            return (cands[0] if cands else None), reason
        a, b = random.sample(cands, 2)
        return (a if a.in_flight <= b.in_flight else b), reason


class RoundRobin(Balancer):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(
        self, members: Sequence[Replica], key: int | None, tried: tuple[Replica, ...], panic: bool, now: float
    ) -> tuple[Replica | None, str]:
        n = len(members)
        for step in range(n):
            r = members[(self.next + step) % n]
            if r.draining or r in tried or not (panic or r.admitted(now)):
                continue
            self.next = (self.next + step + 1) % n
            return r, "retry" if tried else ("ejected" if step else self.name)
        cands = _candidates(members, tried, panic, now)  # every one tried: any admitted one again
        return (cands[0] if cands else None), "retry"


class PrefixAffinity(Balancer):
    name = "prefix_affinity"

    def __init__(self, load_factor: float) -> None:
        self.load_factor = load_factor
        self.points: list[int] = []
        self.owners: list[Replica] = []
        self.fallback = LeastRequest()

    def rebuild(self, members: Sequence[Replica]) -> None:
        ring = sorted(
            ((stable_hash(f"{r.url}#{i}".encode()), r) for r in members for i in range(VIRTUAL_NODES)),
            key=lambda point: point[0],
        )
        self.points = [p for p, _ in ring]
        self.owners = [r for _, r in ring]

    def ceiling(self, members: Sequence[Replica], panic: bool, now: float) -> int:
        """The most requests one replica may carry once this one is placed: ceil((1+eps) x mean)."""
        live = [r for r in members if not r.draining and (panic or r.admitted(now))]
        if not live:
            return 0
        total = sum(r.in_flight for r in live) + 1
        return math.ceil((1 + self.load_factor) * total / len(live))

    def choose(
        self, members: Sequence[Replica], key: int | None, tried: tuple[Replica, ...], panic: bool, now: float
    ) -> tuple[Replica | None, str]:
        if key is None or not self.points:
            return self.fallback.choose(members, key, tried, panic, now)
        cap = self.ceiling(members, panic, now)
        start = bisect.bisect_left(self.points, key)
        n = len(self.owners)
        seen: set[int] = set()
        passed_ejected = passed_full = False
        for step in range(n):
            r = self.owners[(start + step) % n]
            if id(r) in seen:
                if len(seen) == len(members):
                    break
                continue
            seen.add(id(r))
            if r.draining or not (panic or r.admitted(now)) or r in tried:
                passed_ejected = passed_ejected or r not in tried
                continue
            if r.in_flight + 1 > cap:
                passed_full = True
                continue
            if tried:
                return r, "retry"
            return r, "spilled" if passed_full else "ejected" if passed_ejected else "affinity_hit"
        # Every candidate tried (a retry) or full: the least loaded one left.
        cands = _candidates(members, tried, panic, now)
        if not cands:
            return None, "retry" if tried else "ejected"
        return min(cands, key=lambda r: r.in_flight), "retry" if tried else "spilled"


def make_balancer(policy: str, load_factor: float) -> Balancer:
    if policy == "round_robin":
        return RoundRobin()
    if policy == "prefix_affinity":
        return PrefixAffinity(load_factor)
    return LeastRequest()
