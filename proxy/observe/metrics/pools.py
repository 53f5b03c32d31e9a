"""The replica pools' series (docs/fleet.md): per replica, its requests by outcome, in flight, its
TTFT and whether it is admitted; per pool, the balancer's choices. Only upstreams with `replicas`
have them: a `base_url` upstream adds none.

The `replica` label is the replica's address, bounded per pool (MAX_REPLICAS; beyond it `other`),
so a Deployment that churns pods cannot grow the exposition without bound.

prometheus.py hands in prometheus_client's metric types: it stays the one module that imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from proxy.core.exchange import Exchange
from proxy.observe.metrics.fast import Counting
from proxy.observe.metrics.labels import BoundedLabels
from proxy.settings import Settings, display_url

MAX_REPLICAS = 64  # replicas labelled per pool
REASONS = ("affinity_hit", "spilled", "ejected", "least_request", "round_robin", "retry")
_SCRATCH = "metrics.replica"  # the current attempt's labels
_PENDING = "metrics.replica.pending"  # the labels whose request count the request's end gives


class PoolMetrics:
    def __init__(
        self,
        registry: Any,
        ttft_buckets: Sequence[float],
        Counter: Callable[..., Any],  # noqa: N803 - prometheus_client's types, under their names
        Gauge: Callable[..., Any],  # noqa: N803
        Histogram: Callable[..., Any],  # noqa: N803
        counting: Counting,  # how the children are counted (prometheus.py's COUNTING)
    ) -> None:
        r = registry
        self.count = counting
        self.requests = Counter(
            "infertap_replica_requests_total",
            "Attempts on a pool's replica by how they ended (the request's outcome for the attempt "
            "that answered, the failure's for one retried elsewhere).",
            ["upstream", "replica", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "infertap_replica_in_flight_requests",
            "Attempts (and committed streams) on the replica now.",
            ["upstream", "replica"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ttft = Histogram(
            "infertap_replica_time_to_first_token_seconds",
            "From the attempt's start on the replica to the first output event handed to the client.",
            ["upstream", "replica"],
            registry=r,
            buckets=ttft_buckets,
        )
        self.up = Gauge(
            "infertap_replica_up",
            "1 while the replica is admitted, 0 while it is ejected (its circuit open) or draining.",
            ["upstream", "replica"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.decisions = Counter(
            "infertap_balance_decisions_total",
            "A pool's replica choices by policy and reason (affinity_hit, spilled, ejected, "
            "least_request, round_robin, retry).",
            ["upstream", "policy", "reason"],
            registry=r,
        )
        self.labels: dict[str, BoundedLabels] = {}
        self.listed: dict[str, set[str]] = {}  # each pool's configured replicas (a static list)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def follow(self, settings: Settings) -> None:
        """The pools configured now: their decision series and their listed replicas, known up front;
        a listed replica that a reload removed is 0 (it drains, then is gone)."""
        listed: dict[str, set[str]] = {}
        for up in settings.upstreams:
            if not up.replicas:
                continue
            for reason in REASONS:
                self._c(self.decisions, up.name, up.balance, reason)
            listed[up.name] = {display_url(url) for url in up.urls()}
        for name, before in self.listed.items():
            for replica in before - listed.get(name, set()):
                self.replica_health(name, replica, False)
        for name, now in listed.items():
            for replica in now - self.listed.get(name, set()):
                self.replica_health(name, replica, True)
        self.listed = listed

    def _c(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _label(self, upstream: str, replica: str) -> str:
        bounded = self.labels.get(upstream)
        if bounded is None:
            bounded = self.labels[upstream] = BoundedLabels(MAX_REPLICAS)
        return bounded(replica)

    def balanced(self, ex: Exchange, policy: str, reason: str) -> None:
        upstream = ex.upstream or ""
        replica = self._label(upstream, ex.replica or "")
        ex.scratch[_SCRATCH] = ex.scratch[_PENDING] = (upstream, replica)
        self.count.inc(self._c(self.decisions, upstream, policy, reason))
        self.count.inc(self._c(self.in_flight, upstream, replica))

    def replica_released(self, ex: Exchange, outcome: str | None) -> None:
        labels = ex.scratch.get(_SCRATCH)
        if labels is None:
            return
        self.count.dec(self._c(self.in_flight, *labels))
        # An attempt that failed before its commit is counted now; the answering one at the
        # request's end (which may come before or after this, as the stream ends or is cut).
        if outcome is not None:
            self.count.inc(self._c(self.requests, *labels, outcome))
            ex.scratch.pop(_PENDING, None)

    def first_token(self, ex: Exchange) -> None:
        labels = ex.scratch.get(_SCRATCH)
        ttft = ex.ttft_of_attempt
        if labels is not None and ttft is not None:
            self.count.observe(self._c(self.ttft, *labels), ttft)

    def ended(self, ex: Exchange, outcome: str) -> None:
        labels = ex.scratch.pop(_PENDING, None)
        if labels is not None:
            self.count.inc(self._c(self.requests, *labels, outcome))

    def replica_health(self, upstream: str, replica: str, up: bool) -> None:
        self._c(self.up, upstream, self._label(upstream, replica)).set(1 if up else 0)
