"""UpstreamStats: what GET /admin/upstreams says of each upstream's recent traffic.

Pure stdlib, cheap: a few counter updates per request and, at its end, a sample in a small ring
per upstream (recent TTFT and TPOT, whose p50 the operator API shows). Kept by upstream name, so
it outlives a reload that rebuilds the upstreams.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from proxy.core.exchange import Exchange, Outcome
from proxy.core.hooks import Observer

RING = 256  # recent samples per upstream


@dataclass(slots=True)
class Failure:
    outcome: str
    message: str | None
    at: float  # unix seconds


@dataclass(slots=True)
class Traffic:
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    last_failure: Failure | None = None
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=RING))
    tpot: deque[float] = field(default_factory=lambda: deque(maxlen=RING))


def p50(samples: deque[float]) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[len(ordered) // 2]


# Native (proxy/compiled/), and open to subclasses that are not compiled.
@mypyc_attr(allow_interpreted_subclasses=True)
class UpstreamStats(Observer):
    name = "upstream_stats"

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.by: dict[str, Traffic] = {}

    def traffic(self, upstream: str) -> Traffic:
        t = self.by.get(upstream)
        if t is None:
            t = self.by[upstream] = Traffic()
        return t

    def request_received(self, ex: Exchange) -> None:
        if ex.upstream is not None:
            self.traffic(ex.upstream).in_flight += 1
            ex.scratch[self.name] = ex.upstream  # a fallback may take over: lower the one raised

    def ended(self, ex: Exchange) -> None:
        raised = ex.scratch.pop(self.name, None)
        if raised is not None:
            self.traffic(raised).in_flight -= 1
        if ex.upstream is None:
            return
        t = self.traffic(ex.upstream)
        t.requests += 1
        if ex.outcome is Outcome.OK:
            tpot = ex.tpot
            if tpot is not None:
                t.tpot.append(tpot)
        elif ex.outcome not in (Outcome.CLIENT_DISCONNECT, Outcome.REJECTED, Outcome.CLIENT_ERROR, None):
            t.failures += 1
            t.last_failure = Failure(ex.outcome.value, ex.error_message, self.wall())
        ttft = ex.ttft
        if ttft is not None:
            t.ttft.append(ttft)
