"""Replica pools as a state machine: the real pool and balance objects under random sequences of
discovery changes, reloads, ejections and recoveries, and requests that start, finish, fail (and
are retried on another replica) or lose their client.

Invariants: every replica's in-flight count is the number of attempts on it, and all return to 0;
no attempt goes to a replica after it left the pool; a retry goes to a replica not yet tried while
one is admitted; prefix_affinity's chosen replica carries at most ceil((1 + eps) x mean) requests;
its key table stays within its size, counts its keys per replica right, and never points at a
replica that left the pool.

INFERTAP_POOL_EXAMPLES=2000 INFERTAP_POOL_STEPS=200 runs the long profile (docs/fleet.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from proxy.core.balance import PrefixAffinity
from proxy.core.circuit import Breaker, Permit
from proxy.core.replicas import Replica, ReplicaPool

EXAMPLES = int(os.environ.get("INFERTAP_POOL_EXAMPLES", "60"))
STEPS = int(os.environ.get("INFERTAP_POOL_STEPS", "40"))
URLS = [f"http://10.0.0.{i}:8000/v1" for i in range(1, 7)]
POLICIES = ["least_request", "round_robin", "prefix_affinity"]
EPS = 0.25
COOLDOWN = 10.0
TABLE = 5  # a small key table, so that it fills up and evicts
KEYS = st.one_of(st.none(), st.integers(0, 7), st.integers(0, 2**64 - 1))  # repeats are conversations


@dataclass
class Request:
    pool: ReplicaPool  # the pool it started on (a reload leaves it there, as a Call keeps its plan)
    key: int | None
    replica: Replica | None = None
    permit: Permit | None = None
    tried: list[Replica] = field(default_factory=list)


def breaker() -> Breaker:
    return Breaker(failure_rate=0.5, min_calls=2, window=1000.0, cooldown=COOLDOWN)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.pool: ReplicaPool | None = None
        self.pools: list[ReplicaPool] = []
        self.requests: list[Request] = []
        self.seen: dict[int, Replica] = {}
        self.left: set[int] = set()  # replicas no longer in the current pool

    def _new_pool(self, policy: str, urls: list[str]) -> ReplicaPool:
        pool = ReplicaPool("qwen", policy, breaker, EPS)
        if isinstance(pool.balancer, PrefixAffinity):
            pool.balancer.table_size = TABLE
        pool.set_members(urls)
        self.pools.append(pool)
        return pool

    def _track(self) -> None:
        assert self.pool is not None
        members = {id(r) for r in self.pool.members}
        for r in self.pool.members:
            self.seen[id(r)] = r
        self.left = {i for i in self.seen if i not in members}

    @rule(
        policy=st.sampled_from(POLICIES),
        urls=st.lists(st.sampled_from(URLS), min_size=1, max_size=4, unique=True),
    )
    @precondition(lambda self: self.pool is None)
    def configure(self, policy: str, urls: list[str]) -> None:
        self.pool = self._new_pool(policy, urls)
        self._track()

    @rule(urls=st.lists(st.sampled_from(URLS), max_size=5, unique=True))
    @precondition(lambda self: self.pool is not None)
    def discover(self, urls: list[str]) -> None:
        assert self.pool is not None
        self.pool.set_members(urls)
        self._track()

    @rule(
        policy=st.sampled_from(POLICIES),
        urls=st.lists(st.sampled_from(URLS), min_size=1, max_size=4, unique=True),
        circuit_changed=st.booleans(),
    )
    @precondition(lambda self: self.pool is not None)
    def reload(self, policy: str, urls: list[str], circuit_changed: bool) -> None:
        assert self.pool is not None
        new = self._new_pool(policy, urls)
        before = {r.url: r for r in self.pool.members}
        new.adopt(self.pool, circuit_changed)
        for r in new.members:
            if r.url in before:
                assert r is before[r.url], "a kept URL keeps its replica (in-flight, circuit)"
        self.pool = new
        self._track()

    @rule(key=KEYS, panic=st.booleans())
    @precondition(lambda self: self.pool is not None)
    def start(self, key: int | None, panic: bool) -> None:
        assert self.pool is not None
        req = Request(self.pool if not self.requests else self.requests[-1].pool, key)
        if len(self.requests) % 3 == 0:
            req.pool = self.pool
        self._attempt(req, panic)
        if req.replica is not None:
            self.requests.append(req)

    def _attempt(self, req: Request, panic: bool = False) -> None:
        pool = req.pool.current()
        members = list(pool.members)
        loads_before = {id(r): r.in_flight for r in members}
        live = [r for r in members if r.admitted(self.now)]
        replica, reason = req.pool.choose(req.key, req.tried, panic, self.now)
        if replica is None:
            assert not any(r.admitted(self.now) for r in members) or (req.tried and not panic and not members)
            return
        assert id(replica) not in self.left and not replica.draining, "sent to a replica that left"
        assert replica in members
        untried = [r for r in members if r.admitted(self.now) and r not in req.tried]
        if req.tried and untried:
            assert replica in untried, "a retry goes to a replica not tried yet"
        permit = Permit("panic") if panic else replica.breaker.acquire(self.now)
        if permit is None:
            return
        if pool.policy == "prefix_affinity" and not req.tried and not panic and req.key is not None:
            total = sum(loads_before[id(r)] for r in live) + 1
            ceiling = math.ceil((1 + EPS) * total / len(live))
            assert replica.in_flight + 1 <= ceiling, (reason, replica.in_flight, ceiling)
        req.pool.begin(replica)
        req.replica, req.permit = replica, permit
        req.tried.append(replica)

    def _end(self, req: Request, ok: bool | None) -> None:
        assert req.replica is not None and req.permit is not None
        if ok is not None:
            req.replica.breaker.record(req.permit, ok, self.now, None if ok else "failed")
        req.replica.breaker.release(req.permit)
        req.pool.end(req.replica)
        req.replica = req.permit = None

    @rule(data=st.data(), ok=st.sampled_from([True, None]))
    @precondition(lambda self: bool(self.requests))
    def finish_or_disconnect(self, data: st.DataObject, ok: bool | None) -> None:
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self._end(req, ok)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.requests))
    def fail_and_retry(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.requests) - 1))
        req = self.requests[i]
        self._end(req, False)
        self._attempt(req)
        if req.replica is None:
            self.requests.pop(i)  # nothing left to try: it ends with the failure

    @rule(hours=st.sampled_from([0, 0, 1]))
    def time_passes(self, hours: int) -> None:
        self.now += COOLDOWN + 3600 * hours  # ejected replicas may be probed (half-open); keys expire

    @invariant()
    def key_table_bounded_and_in_the_pool(self) -> None:
        if self.pool is None or not isinstance(self.pool.balancer, PrefixAffinity):
            return
        table = self.pool.balancer
        assert len(table.keys) <= TABLE
        members = set(map(id, self.pool.members))
        counts: dict[int, int] = {}
        for r, _used in table.keys.values():
            assert id(r) in members, f"a key points at {r}, which left the pool"
            counts[id(r)] = counts.get(id(r), 0) + 1
        assert counts == {id(r): c for r, c in table.counts.items()}

    @invariant()
    def in_flight_is_the_attempts_on_it(self) -> None:
        counts: dict[int, int] = {}
        for req in self.requests:
            assert req.replica is not None
            counts[id(req.replica)] = counts.get(id(req.replica), 0) + 1
        for i, r in self.seen.items():
            assert r.in_flight == counts.get(i, 0), r
        for pool in self.pools:
            for r in pool.draining:
                assert r.in_flight > 0 or not r.draining, "a drained replica is forgotten"
        if self.pool is not None:
            assert not any(r.draining for r in self.pool.members)

    def teardown(self) -> None:
        while self.requests:
            self._end(self.requests.pop(), True)
        assert all(r.in_flight == 0 for r in self.seen.values())
        assert all(not pool.draining for pool in self.pools), "every drained replica is forgotten"


PoolMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None)
TestPool = PoolMachine.TestCase
