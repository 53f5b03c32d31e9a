"""Prometheus metrics: the ONLY module that imports prometheus_client (its registry type is re-exported).

Every metric is defined in one constructor on an explicit registry. Label values are
bounded: `model` passes an allow-list with a cap, everything else has a closed vocabulary.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Iterator
from importlib.metadata import version
from typing import Any, Final

from mypy_extensions import mypyc_attr
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, values
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Exemplar

from proxy import __version__
from proxy.core.errors import TIMEOUT_PHASES
from proxy.core.exchange import Exchange, LocalAnswer, Outcome
from proxy.core.hooks import Observer
from proxy.core.route_table import route_of
from proxy.observe.metrics.buckets import (
    DURATION_BUCKETS,
    ITL_BUCKETS,
    OVERHEAD_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
)
from proxy.observe.metrics.fast import DIRECT, METHODS, UNLOCKED, _observe_each, direct_works
from proxy.observe.metrics.labels import NONE, OTHER, ModelLabels, multiprocess_dir
from proxy.observe.metrics.loop_lag import LoopLagProbe
from proxy.observe.metrics.pools import PoolMetrics
from proxy.observe.spend import billed_tokens
from proxy.settings import MetricsSettings, Settings

__all__ = [
    "AT_ONCE",
    "NONE",
    "OTHER",
    "CollectorRegistry",
    "Metrics",
    "ModelLabels",
    "_observe_each",
    "multiprocess_dir",
    "observe_many",
]

UPSTREAM_UP = "infertap_upstream_up"
IN_FLIGHT = "infertap_in_flight_requests"


# The outcomes `ended` compares, as the strings its labels carry (an Enum member's `value` is a
# property, and reading a member off its class goes through EnumType's __getattr__).
_OK, _REJECTED, _CLIENT_DISCONNECT = Outcome.OK.value, Outcome.REJECTED.value, Outcome.CLIENT_DISCONNECT.value

# Checked once, at import (proxy/observe/metrics/fast.py): a prometheus_client that no longer keeps
# the attributes DIRECT counts into gets its own methods (slower, never wrong), not an
# AttributeError per request.
AT_ONCE = direct_works(Histogram, Counter, Gauge, values, Exemplar)
# Without the values' locks only where they are in memory (one process): with --workers N each
# value is a file's slot, written under its lock.
IN_MEMORY = values.ValueClass is values.MutexValue
UNLOCKED_WORKS = IN_MEMORY and direct_works(Histogram, Counter, Gauge, values, Exemplar, UNLOCKED)
COUNTING = UNLOCKED if UNLOCKED_WORKS else DIRECT if AT_ONCE else METHODS
# Final: compiled, each is read from a static, not looked up in the module's dict (about fifteen a request).
inc: Final = COUNTING.inc
dec: Final = COUNTING.dec
observe: Final = COUNTING.observe
observe_many: Final = COUNTING.observe_many
observe_all: Final = COUNTING.observe_all
observe_exemplar: Final = COUNTING.observe_exemplar
if not AT_ONCE:
    logging.getLogger("infertap.metrics").warning(
        "prometheus_client %s: every observation takes its own methods, and a burst of output "
        "events is observed one by one (slower)",
        version("prometheus_client"),
    )


# `ended`'s children of one combination of a request's labels (route, model, the upstream it was
# routed to and the one that answered, stream, outcome, client), kept in a list by these indexes: one
# lookup of the combination, where each child was a lookup of its own (about ten a request, ~1k
# instructions each). The combinations a process meets are few; should a
# long-lived one meet more than MAX_ENDED_KEYS, the lists start again (the children stay in _c's cache).
_IN_FLIGHT: Final = 0
_REQUESTS: Final = 1
_ATTEMPTS: Final = 2
_DURATION: Final = 3
_TPOT: Final = 4
_TTFT_ANSWER: Final = 5
_PROMPT_TOKENS: Final = 6
_REQ_PROMPT_TOKENS: Final = 7
_COMPLETION_TOKENS: Final = 8
_REQ_COMPLETION_TOKENS: Final = 9
_ENDED_SLOTS: Final = 10
MAX_ENDED_KEYS: Final = 4096


def _default_model_patterns(settings: Settings) -> list[str] | None:
    if settings.metrics.models is not None:
        return settings.metrics.models
    patterns: list[str] = []
    for up in settings.upstreams:
        if not up.models:
            return None  # a catch-all upstream: any model may appear, the cap still bounds them
        patterns.extend(up.models)
    return patterns or None


# Native (proxy/compiled/), and open to subclasses that are not compiled.
@mypyc_attr(allow_interpreted_subclasses=True)
class Metrics(Observer):
    """Turns each Exchange into Prometheus observations. O(1) work per output event."""

    name = "metrics"

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        m: MetricsSettings = settings.metrics
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.multiprocess = multiprocess_dir() is not None
        self.exemplars = m.exemplars and not self.multiprocess
        # Across workers: the cap is the instance's, not each process's.
        self.model_label = ModelLabels(_default_model_patterns(settings), m.max_models, multiprocess_dir())
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._ended: dict[tuple[str, ...], list[Any]] = {}
        r = self.registry
        self.requests = Counter(
            "infertap_requests_total",
            "Requests by how they ended.",
            ["route", "model", "upstream", "stream", "outcome", "client"],
            registry=r,
        )
        self.answered_total = Counter(
            "infertap_http_requests_total",
            "Requests infertap answered itself, without forwarding: refused before being read (a wrong "
            "or missing client key, a wrong method) and its own routes (/v1/models, probes, /metrics, "
            "/ui, /docs, /admin, unknown paths). With infertap_requests_total: every request.",
            ["route", "code"],
            registry=r,
        )
        self.duration = Histogram(
            "infertap_request_duration_seconds",
            "From request receipt to the last byte sent to the client.",
            ["route", "model", "upstream", "stream"],
            registry=r,
            buckets=m.duration_buckets or DURATION_BUCKETS,
        )
        self.ttft = Histogram(
            "infertap_time_to_first_token_seconds",
            "From request receipt to the first event carrying output text handed to "
            "the client (prefill, queueing and network).",
            ["model", "upstream", "prompt_class"],
            registry=r,
            buckets=m.ttft_buckets or TTFT_BUCKETS,
        )
        self.ttfb = Histogram(
            "infertap_time_to_first_byte_seconds",
            "From request receipt to the upstream's response headers.",
            ["model", "upstream"],
            registry=r,
            buckets=m.ttft_buckets or TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "infertap_inter_token_latency_seconds",
            "Gap between consecutive output events of a stream (an event may carry several tokens).",
            ["model", "upstream"],
            registry=r,
            buckets=m.itl_buckets or ITL_BUCKETS,
        )
        self.tpot = Histogram(
            "infertap_time_per_output_token_seconds",
            "Per request: (last output event - first output event) / (output tokens - 1).",
            ["model", "upstream"],
            registry=r,
            buckets=m.tpot_buckets or ITL_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "infertap_prompt_tokens_total",
            "Prompt tokens (from usage; estimated from text when absent).",
            ["model", "upstream", "client"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "infertap_completion_tokens_total",
            "Completion tokens (from usage; counted events when absent).",
            ["model", "upstream", "client"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "infertap_cached_prompt_tokens",
            "Prompt tokens the upstream served from its prefix cache (usage's cached_tokens).",
            ["model", "upstream", "client"],
            registry=r,
        )
        self.reasoning_tokens = Counter(
            "infertap_reasoning_tokens",
            "Completion tokens spent on hidden reasoning (usage's reasoning_tokens; part of completion).",
            ["model", "upstream", "client"],
            registry=r,
        )
        self.spend = Counter(
            "infertap_spend",
            f"What the tokens cost, in {settings.spend.currency}, from the prices in [spend] "
            "(requests that ended ok).",
            ["model", "upstream", "client"],
            registry=r,
        )
        self.unpriced = Counter(
            "infertap_unpriced_tokens",
            "Tokens (prompt and completion) of models without a price in [spend.prices].",
            ["model", "upstream"],
            registry=r,
        )
        self.budget = Gauge(
            "infertap_spend_daily_budget",
            f"A client's daily budget in {settings.spend.currency} ([spend] daily_budget, budgets).",
            ["client"],
            registry=r,
            multiprocess_mode="max",
        )
        self.estimated = Counter(
            "infertap_requests_without_usage_total",
            "Responses whose token counts are estimated: the upstream sent no usage.",
            ["model", "upstream"],
            registry=r,
        )
        self.req_prompt_tokens = Histogram(
            "infertap_request_prompt_tokens",
            "Prompt tokens per request.",
            ["model", "upstream"],
            registry=r,
            buckets=TOKEN_BUCKETS,
        )
        self.req_completion_tokens = Histogram(
            "infertap_request_completion_tokens",
            "Completion tokens per request.",
            ["model", "upstream"],
            registry=r,
            buckets=TOKEN_BUCKETS,
        )
        self.ttft_answer = Histogram(
            "infertap_time_to_first_answer_token_seconds",
            "From request receipt to the first answer (not reasoning) event handed to the client; "
            "equals TTFT for a stream without reasoning.",
            ["model", "upstream"],
            registry=r,
            buckets=m.ttft_buckets or TTFT_BUCKETS,
        )
        self.attempts = Counter(
            "infertap_upstream_attempts_total",
            "Upstream attempts by result.",
            ["upstream", "result"],
            registry=r,
        )
        self.retries = Counter(
            "infertap_retries_total",
            "Attempts that failed and were retried.",
            ["upstream", "reason"],
            registry=r,
        )
        self.timeouts = Counter(
            "infertap_timeouts_total", "Timeouts by phase.", ["upstream", "phase"], registry=r
        )
        self.in_flight = Gauge(
            IN_FLIGHT,
            "Requests being served now.",
            ["upstream"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.upstream_up = Gauge(
            UPSTREAM_UP,
            "1 while infertap sends traffic to the upstream, 0 while its circuit is open.",
            ["upstream"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.degenerate = Counter(
            "infertap_degenerate_responses_total",
            "Responses whose output text repeats itself (loop detection, [loops] enabled).",
            ["model"],
            registry=r,
        )
        self.overhead_on = m.overhead
        self.overhead = Histogram(
            "infertap_overhead_seconds",
            "infertap's own time per request, by phase: intake (request arrival to the upstream "
            "request written) and first_token (the first output event's bytes arriving from the "
            "upstream to their being handed to the client).",
            ["phase"],
            registry=r,
            buckets=OVERHEAD_BUCKETS,
        )
        self._intake = self.overhead.labels("intake")
        self._first_token = self.overhead.labels("first_token")
        self.loop_lag = Histogram(
            "infertap_event_loop_lag_seconds",
            "How late a task sleeping on infertap's event loop wakes up (a probe every second).",
            registry=r,
            buckets=OVERHEAD_BUCKETS,
        )
        self.lag_probe = LoopLagProbe(self.loop_lag.observe) if m.overhead else None
        self.build_info = Gauge(
            "infertap_build_info", "infertap's version.", ["version"], registry=r, multiprocess_mode="max"
        )
        self.build_info.labels(__version__).set(1)
        self.spend_on = bool(settings.spend.prices)
        self.budgets = dict(settings.spend.budgets)
        self.default_budget = settings.spend.daily_budget
        self._budgeted: set[str] = set()
        for client in self.budgets:
            self._set_budget(client)
        self.pools = PoolMetrics(r, m.ttft_buckets or TTFT_BUCKETS, Counter, Gauge, Histogram, COUNTING)
        self._upstreams: set[str] = set()  # the upstreams configured now
        self._follow(settings, {up.name for up in settings.upstreams})

    def configuration_changed(self, settings: Settings, fresh_circuits: Collection[str]) -> None:
        # Without [metrics] models the allow-list is the upstreams' patterns, which a reload may
        # change: a new upstream's models get their own label, not `other`. Names admitted before
        # keep theirs (the cap still bounds them).
        self.model_label.patterns = _default_model_patterns(settings)
        self._follow(settings, fresh_circuits)

    def _follow(self, settings: Settings, fresh_circuits: Collection[str]) -> None:
        """The per-upstream series for the upstreams configured now (at start and on each reload)."""
        now = {up.name for up in settings.upstreams}
        self.pools.follow(settings)
        for name in fresh_circuits:
            # Known children up front: dashboards see zeros instead of missing series, and a circuit
            # that starts anew is closed. A kept circuit goes on, and so does its upstream_up.
            self.in_flight.labels(name)
            self.upstream_up.labels(name).set(1)
            self.retries.labels(name, "connect_error")
            for phase in TIMEOUT_PHASES.values():
                self.timeouts.labels(name, phase)
        for name in self._upstreams - now:
            # Hidden from now on (`render`). With --workers N the value stays in this worker's
            # file: 1 there keeps a last 0 from showing should the name come back while this
            # worker has not yet followed that reload.
            self.upstream_up.labels(name).set(1)
        self._upstreams = now

    # -- hooks ------------------------------------------------------------------------------
    def _c(self, metric: Any, *labels: str) -> Any:
        """The metric's child for these label values, cached: prometheus_client's labels() takes a
        lock and validates on every call, and the per-request hooks need about ten children."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_received(self, ex: Exchange) -> None:
        model = self.model_label(ex.model)
        upstream = ex.upstream or NONE
        ex.scratch["metrics"] = (model, upstream)
        inc(self._c(self.in_flight, upstream))

    # ex.upstream is the upstream of the current attempt (a fallback may take over); the
    # in-flight gauge keeps the label it was raised with.
    def retry(self, ex: Exchange, reason: str, backoff: float) -> None:
        upstream = ex.upstream or NONE
        inc(self._c(self.attempts, upstream, reason))
        inc(self._c(self.retries, upstream, reason))
        phase = TIMEOUT_PHASES.get(reason)
        if phase is not None:
            inc(self._c(self.timeouts, upstream, phase))

    def upstream_health(self, ex: Exchange, upstream: str, up: bool) -> None:
        self._c(self.upstream_up, upstream).set(1 if up else 0)

    # A pool's replicas: metrics/pools.py.
    def balanced(self, ex: Exchange, policy: str, reason: str) -> None:
        self.pools.balanced(ex, policy, reason)

    def replica_released(self, ex: Exchange, upstream: str, replica: str, outcome: str | None) -> None:
        self.pools.replica_released(ex, outcome)

    def replica_health(self, upstream: str, replica: str, up: bool) -> None:
        self.pools.replica_health(upstream, replica, up)

    def first_byte(self, ex: Exchange) -> None:
        model, upstream = ex.scratch["metrics"][0], ex.upstream or NONE
        ttfb = ex.ttfb
        if ttfb is not None:
            observe(self._c(self.ttfb, model, upstream), ttfb)

    def first_token(self, ex: Exchange) -> None:
        model, upstream = ex.scratch["metrics"][0], ex.upstream or NONE
        ttft = ex.ttft
        if ttft is not None:
            self._observe_traced(self._c(self.ttft, model, upstream, ex.prompt_class), ttft, ex)
        if ex.replica is not None:
            self.pools.first_token(ex)
        ex.scratch["metrics.itl"] = self._c(self.itl, model, upstream)
        if self.overhead_on:
            overhead = ex.first_token_overhead
            if overhead is not None:
                observe(self._first_token, overhead)

    def output_gaps(self, ex: Exchange, gaps: list[float], zeros: int) -> None:
        itl = ex.scratch["metrics.itl"]
        if gaps:
            observe_all(itl, gaps)
        if zeros:
            observe_many(itl, 0.0, zeros)

    def ended(self, ex: Exchange) -> None:
        model, routed = ex.scratch["metrics"]
        upstream = ex.upstream or NONE
        outcome = ex.outcome._value_ if ex.outcome is not None else NONE  # not the slower `value`
        stream = "true" if ex.stream else "false"
        route = ex.route
        client = ex.client
        # The children this request counts into, found by one lookup of its labels (the indexes
        # above); each is asked of _c the first time that combination needs it, as before, so the
        # same series appear, no more.
        key = (route, model, routed, upstream, stream, outcome, client)
        kids = self._ended.get(key)
        if kids is None:
            if len(self._ended) >= MAX_ENDED_KEYS:
                self._ended.clear()
            kids = self._ended[key] = [None] * _ENDED_SLOTS
        c = kids[_IN_FLIGHT]
        if c is None:
            c = kids[_IN_FLIGHT] = self._c(self.in_flight, routed)
        dec(c)
        if self.overhead_on:
            intake = ex.intake_overhead
            if intake is not None:
                observe(self._intake, intake)
        c = kids[_REQUESTS]
        if c is None:
            c = kids[_REQUESTS] = self._c(self.requests, route, model, upstream, stream, outcome, client)
        inc(c)
        if ex.replica is not None:
            self.pools.ended(ex, outcome)
        if ex.attempts:
            c = kids[_ATTEMPTS]
            if c is None:
                result = "cancelled" if outcome == _CLIENT_DISCONNECT else outcome
                c = kids[_ATTEMPTS] = self._c(self.attempts, upstream, result)
            inc(c)
        phase = TIMEOUT_PHASES.get(outcome)
        if phase is not None:
            inc(self._c(self.timeouts, upstream, phase))
        if outcome == _REJECTED:
            return
        duration = ex.duration
        if duration is not None:
            c = kids[_DURATION]
            if c is None:
                c = kids[_DURATION] = self._c(self.duration, route, model, upstream, stream)
            self._observe_traced(c, duration, ex)
        if outcome != _OK:
            return
        tpot = ex.tpot
        if tpot is not None:
            c = kids[_TPOT]
            if c is None:
                c = kids[_TPOT] = self._c(self.tpot, model, upstream)
            observe(c, tpot)
        ttft_answer = ex.ttft_answer
        if ttft_answer is not None:
            c = kids[_TTFT_ANSWER]
            if c is None:
                c = kids[_TTFT_ANSWER] = self._c(self.ttft_answer, model, upstream)
            observe(c, ttft_answer)
        if self.spend_on:
            self._spend(ex, model, upstream, client)
        prompt = ex.prompt_tokens if ex.prompt_tokens is not None else ex.estimated_prompt_tokens
        if prompt:
            c = kids[_PROMPT_TOKENS]
            if c is None:
                c = kids[_PROMPT_TOKENS] = self._c(self.prompt_tokens, model, upstream, client)
            inc(c, prompt)
            c = kids[_REQ_PROMPT_TOKENS]
            if c is None:
                c = kids[_REQ_PROMPT_TOKENS] = self._c(self.req_prompt_tokens, model, upstream)
            observe(c, prompt)
        if ex.cached_tokens is not None:  # 0 too: the upstream reports them
            inc(self._c(self.cached_tokens, model, upstream, client), ex.cached_tokens)
        if not route_of(route).generation:
            return
        completion = ex.output_tokens
        c = kids[_COMPLETION_TOKENS]
        if c is None:
            c = kids[_COMPLETION_TOKENS] = self._c(self.completion_tokens, model, upstream, client)
        inc(c, completion)
        c = kids[_REQ_COMPLETION_TOKENS]
        if c is None:
            c = kids[_REQ_COMPLETION_TOKENS] = self._c(self.req_completion_tokens, model, upstream)
        observe(c, completion)
        if ex.reasoning_tokens is not None:
            inc(self._c(self.reasoning_tokens, model, upstream, client), ex.reasoning_tokens)
        if ex.completion_tokens is None:
            inc(self._c(self.estimated, model, upstream))

    def answered(self, answer: LocalAnswer) -> None:
        inc(self._c(self.answered_total, answer.route, str(answer.status)))

    def _spend(self, ex: Exchange, model: str, upstream: str, client: str) -> None:
        """ex.cost was set by the spend observer (proxy/observe/spend.py), which runs before this one."""
        if ex.cost is not None:
            inc(self._c(self.spend, model, upstream, client), ex.cost)
            if client not in self._budgeted:
                self._set_budget(client)
        elif ex.unpriced:
            self._c(self.unpriced, model, upstream).inc(sum(billed_tokens(ex)))

    def _set_budget(self, client: str) -> None:
        self._budgeted.add(client)
        budget = self.budgets.get(client, self.default_budget)
        if budget is not None:
            self.budget.labels(client).set(budget)

    def degenerate_response(self, ex: Exchange, score: float) -> None:
        """Called by the loop detector (proxy/observe/repetition.py) for an answer that repeats itself."""
        self._c(self.degenerate, self.model_label(ex.model)).inc()

    def _observe_traced(self, child: Any, value: float, ex: Exchange) -> None:
        """With the request's trace id as the exemplar, where exemplars are on and it was traced."""
        if self.exemplars and ex.trace_id:
            observe_exemplar(child, value, Exemplar({"trace_id": ex.trace_id}, value, time.time()))
        else:
            observe(child, value)

    def start_probes(self) -> None:
        """Inside the running loop, at start-up."""
        if self.lag_probe is not None:
            self.lag_probe.start()

    async def stop_probes(self) -> None:
        if self.lag_probe is not None:
            await self.lag_probe.stop()

    def close(self) -> None:
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]

    # -- exposition -------------------------------------------------------------------------
    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition, in OpenMetrics (with exemplars) when the scraper asks for it."""
        registry: Any = self.registry
        if self.multiprocess:
            # Each worker writes its own files; a scrape aggregates them all, whichever worker answers.
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        encoder, content_type = choose_encoder(accept or "")
        return encoder(_Configured(registry, self._upstreams)), content_type


class _Configured:
    """A registry's metrics without the gauges of upstreams that a reload removed: their
    `upstream_up` (a last 0 would page for an upstream that no longer exists) and their in-flight
    count once it is 0 (while requests that began before the reload run, it still counts them).

    Left out at each scrape rather than removed from the registry: with --workers N every worker's
    values stay in its own file, which no worker can take a series out of, and the worker that
    answers a scrape has followed every reload (it catches up before any request). Counters and
    histograms stay: they are history (docs/metrics.md)."""

    def __init__(self, registry: Any, upstreams: Collection[str]) -> None:
        self.registry = registry
        self.upstreams = upstreams

    def collect(self) -> Iterator[Metric]:
        keep = self.upstreams
        for family in self.registry.collect():
            if family.name == UPSTREAM_UP:
                family.samples = [s for s in family.samples if s.labels["upstream"] in keep]
            elif family.name == IN_FLIGHT:
                family.samples = [
                    s
                    for s in family.samples
                    if s.value or s.labels["upstream"] in keep or s.labels["upstream"] == NONE
                ]
            yield family
