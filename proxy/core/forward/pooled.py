"""A pool's part of an attempt (proxy/core/replicas.py): the replica taken for it, given back
exactly once however it ends, and its circuit (outlier ejection) judged by the attempt's result."""

from __future__ import annotations

import logging
import time

from proxy.core.circuit import Permit
from proxy.core.exchange import Exchange
from proxy.core.hooks import ObserverSet
from proxy.core.model_routing import Upstream
from proxy.core.replicas import Replica, ReplicaPool

log = logging.getLogger("infertap.forward")


def take(
    observers: ObserverSet, ex: Exchange, up: Upstream, replica: Replica, tried: list[Replica], reason: str
) -> None:
    pool = _pool(up)
    pool.begin(replica)
    if replica not in tried:
        tried.append(replica)
    ex.upstream = up.name
    ex.replica = replica.display_url
    observers.balanced(ex, pool.policy, reason)


def release(
    observers: ObserverSet, ex: Exchange, up: Upstream, replica: Replica, committed: bool, outcome: str | None
) -> None:
    if committed:
        replica.observe(ex.ttft_of_attempt, ex.tpot)
    pool = _pool(up)
    pool.end(replica)
    observers.replica_released(ex, pool.upstream, replica.display_url, outcome)


def judge(
    observers: ObserverSet, up: Upstream, replica: Replica, permit: Permit, ok: bool, cause: str
) -> None:
    """The attempt's result on the replica's own circuit: enough failures eject it (its peers take
    its requests); after the cool-down one request probes it, and a success readmits it."""
    if not replica.breaker.record(permit, ok, time.monotonic(), None if ok else cause):
        return
    back = not replica.breaker.is_open
    how = (
        "readmitted (the probe succeeded)"
        if back
        else f"ejected: {replica.breaker.describe(time.monotonic())}"
    )
    log.warning("upstream %s: replica %s %s", up.name, replica.display_url, how)
    observers.replica_health(up.name, replica.display_url, back)


def _pool(up: Upstream) -> ReplicaPool:
    assert up.replicas is not None
    return up.replicas
