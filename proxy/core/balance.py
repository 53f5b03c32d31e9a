"""How a pool picks a replica: least_request (power of two choices on in-flight requests),
round_robin, prefix_affinity (consistent hashing with bounded loads, Mirrokni, Thorup and
Zadimoghaddam 2016: a ring with virtual nodes per replica; a conversation's key is placed clockwise
on the first replica under its share of the live keys and remembered there, and a turn spills
clockwise past a replica already at ceil((1 + eps) x the mean in-flight load)).

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
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol


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

    def inherit(self, old: Balancer, members: Sequence[Replica]) -> None:
        """A reload replaced `old` with this one (control plane only)."""

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
        n = len(members)
        if not tried and n >= 2:
            # The common case in O(1): two distinct members at random, both admitted.
            i, j = random.randrange(n), random.randrange(n - 1)
            a, b = members[i], members[j + (j >= i)]
            if not a.draining and not b.draining and (panic or (a.admitted(now) and b.admitted(now))):
                return (a if a.in_flight <= b.in_flight else b), self.name
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


KEY_TABLE_SIZE = 65536  # conversations remembered per process: ~200 bytes each, 13 MB when full
KEY_IDLE_S = 600.0  # a conversation idle this long is forgotten (its prefix is likely evicted by then)
# The key bound's slack: 0 places a new key only on a replica below ceil(mean) (docs/fleet.md: 0.25,
# the in-flight bound's, let one replica of 4 hold 5 of 16 conversations and evict one).
KEY_LOAD_FACTOR = 0.0


class PrefixAffinity(Balancer):
    """Consistent hashing with bounded loads, the balls being conversations (keys) as in Mirrokni
    et al.: a NEW key walks the ring from its hash to the first replica holding fewer than
    ceil(mean) live keys (and under the in-flight bound), and is remembered there; a known key
    stays where its prefix is cached while its replica is under the in-flight bound (a turn above
    it spills; the key stays). A pure ring gives one replica 1.5-2x the mean of 16 keys over 4
    replicas, more conversations than its cache holds (docs/fleet.md).

    The table is bounded (KEY_TABLE_SIZE, least recently used first out) and forgets keys idle
    for KEY_IDLE_S and keys of replicas that left the pool. It is per process: with several
    workers each places the keys it sees; a key's first choice is still its ring owner, so workers
    agree until the bound moves a key."""

    name = "prefix_affinity"

    def __init__(
        self, load_factor: float, table_size: int = KEY_TABLE_SIZE, idle_s: float = KEY_IDLE_S
    ) -> None:
        self.load_factor = load_factor
        self.points: list[int] = []
        self.owners: list[Replica] = []
        self.fallback = LeastRequest()
        self.table_size = table_size
        self.idle_s = idle_s
        self.keys: OrderedDict[int, list[Any]] = OrderedDict()  # key -> [replica, last used]
        self.counts: dict[Replica, int] = {}  # live keys per replica

    def rebuild(self, members: Sequence[Replica]) -> None:
        ring = sorted(
            ((stable_hash(f"{r.url}#{i}".encode()), r) for r in members for i in range(VIRTUAL_NODES)),
            key=lambda point: point[0],
        )
        self.points = [p for p, _ in ring]
        self.owners = [r for _, r in ring]
        keep = set(map(id, members))
        for key in [k for k, (r, _) in self.keys.items() if id(r) not in keep]:
            self._forget(key)

    def inherit(self, old: Balancer, members: Sequence[Replica]) -> None:
        """A reload's: the keys of the replicas that stay keep their place."""
        if isinstance(old, PrefixAffinity):
            keep = set(map(id, members))
            for key, (r, used) in old.keys.items():
                if id(r) in keep:
                    self._remember(key, r, used)

    def _forget(self, key: int) -> None:
        r = self.keys.pop(key)[0]
        left = self.counts[r] - 1
        if left:
            self.counts[r] = left
        else:
            del self.counts[r]

    def _remember(self, key: int, r: Replica, now: float) -> None:
        if key in self.keys:
            self._forget(key)
        while len(self.keys) >= self.table_size:
            self._forget(next(iter(self.keys)))
        self.keys[key] = [r, now]
        self.counts[r] = self.counts.get(r, 0) + 1

    def _expire(self, now: float) -> None:
        keys = self.keys
        while keys:
            key, entry = next(iter(keys.items()))
            if now - entry[1] < self.idle_s:
                return
            self._forget(key)

    def ceiling(self, members: Sequence[Replica], panic: bool, now: float) -> int:
        """The most requests one replica may carry once this one is placed: ceil((1+eps) x mean)."""
        live = total = 0
        for r in members:
            if not r.draining and (panic or r.admitted(now)):
                live += 1
                total += r.in_flight
        if not live:
            return 0
        return math.ceil((1 + self.load_factor) * (total + 1) / live)

    def key_ceiling(self, members: Sequence[Replica], panic: bool, now: float) -> int:
        """The most live keys one replica may hold once a new one is placed: every replica holds
        ceil(mean) at most, since a remembered key never moves to even them out."""
        live = total = 0
        for r in members:
            if not r.draining and (panic or r.admitted(now)):
                live += 1
                total += self.counts.get(r, 0)
        if not live:
            return 0
        return math.ceil((1 + KEY_LOAD_FACTOR) * (total + 1) / live)

    def choose(
        self, members: Sequence[Replica], key: int | None, tried: tuple[Replica, ...], panic: bool, now: float
    ) -> tuple[Replica | None, str]:
        if key is None or not self.points:
            return self.fallback.choose(members, key, tried, panic, now)
        self._expire(now)
        cap = self.ceiling(members, panic, now)
        entry = self.keys.get(key)
        if entry is not None and not tried:
            home = entry[0]
            self.keys.move_to_end(key)
            entry[1] = now
            if not home.draining and (panic or home.admitted(now)) and home.in_flight + 1 <= cap:
                return home, "affinity_hit"
        keycap = self.key_ceiling(members, panic, now) if entry is None and not tried else 0
        start = bisect.bisect_left(self.points, key)
        n = len(self.owners)
        seen: set[int] = set()
        passed_ejected = passed_full = False
        fallback: Replica | None = None
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
            if entry is None:
                if self.counts.get(r, 0) + 1 > keycap:
                    fallback = fallback or r  # under the in-flight bound, over the key bound
                    continue
                self._remember(key, r, now)
                return r, "spilled" if passed_full else "ejected" if passed_ejected else "affinity_hit"
            if entry[0].draining or not (panic or entry[0].admitted(now)):
                self._remember(key, r, now)  # its replica is out: its prefix gets cached here now
                return r, "ejected"
            return r, "spilled"  # its replica is busy: this turn only
        if fallback is not None:
            self._remember(key, fallback, now)
            return fallback, "spilled" if passed_full else "ejected" if passed_ejected else "affinity_hit"
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
