"""UIObserver: keeps what /ui shows in bounded rings, from the same Exchange values the metrics see.

Work per request: a dict entry in `request_received`, a few counter increments, at most two
reservoir samples and one table row at the terminal hook. No `output_gaps` hook. Everything else
(quantiles, rates, the JSON) is computed in `snapshot()`, when the page asks.

Counting rules mirror `proxy/observe/metrics/prometheus.py`, so /ui/data and /metrics agree for
the same workload: TTFT for every request that delivered a first token, TPOT and tokens for
successful ones only, timeouts counted both when an attempt timed out and was retried and when a
request ended so.
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from mypy_extensions import mypyc_attr

from proxy import __version__
from proxy.core.errors import TIMEOUT_PHASES
from proxy.core.exchange import Exchange, Outcome
from proxy.core.hooks import Observer
from proxy.core.route_table import route_of
from proxy.observe.metrics.labels import NONE, ModelLabels
from proxy.observe.ui.data import (
    QUANTILES,
    SecondRing,
    Step,
    StepRing,
    quantiles,
    step_quantiles,
)
from proxy.settings import RELOADABLE, Settings, display_url, public_config

MAX_MODEL_CHARS = 120
CHARTED_MODELS = 12
NAMES = tuple(f"p{round(q * 100)}" for q in QUANTILES)
_OK, _REJECTED = Outcome.OK.value, Outcome.REJECTED.value


# Native (proxy/compiled/), and open to subclasses that are not compiled.
@mypyc_attr(allow_interpreted_subclasses=True)
class UIObserver(Observer):
    name = "ui"

    def __init__(
        self,
        settings: Settings,
        model_label: Callable[[str | None], str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ) -> None:
        ui = settings.ui
        self.settings = settings
        # Each pool's replicas now (address, state, in flight, recent TTFT), by upstream: the
        # composition root hands in the running proxy's (proxy/app.py).
        self.pool_rows: Callable[[], dict[str, list[dict[str, Any]]]] = dict
        # The metrics' own label mapping when there are metrics: the same allow-list and cap,
        # so a chart's model is a `model` label value of /metrics.
        self.model_label = model_label or ModelLabels(settings.metrics.models, settings.metrics.max_models)
        # perf_counter, the clock of Exchange timestamps: a first token is placed in its own step.
        self.clock = clock
        self.wall = wall
        self.step = ui.step_seconds
        self.steps = -(-ui.window_seconds // ui.step_seconds)
        self.cap = ui.samples_per_step
        self.rng = random.Random(0)
        self.seconds = SecondRing(self.steps * self.step + 1)
        self.latency: dict[str, StepRing] = {}
        # The last requests, as they ended: a tuple each (in _ROW's order), made a row (a dict)
        # only when the page asks. Not the Exchange itself: it holds the parsed request body.
        self.recent: deque[tuple[Any, ...]] = deque(maxlen=ui.recent_requests)
        self.started = clock()
        self.in_flight = 0
        self.in_flight_by: dict[str, int] = {up.name: 0 for up in settings.upstreams}
        # Circuit state by upstream: (up, wall-clock time of the last change); all up at start.
        self.health: dict[str, tuple[bool, float | None]] = {u.name: (True, None) for u in settings.upstreams}
        # Since start, this worker: requests by upstream and outcome, retries, timeouts by phase.
        self.outcomes: dict[str, dict[str, int]] = {}
        self.retries = 0
        self.timeouts: dict[str, int] = dict.fromkeys(TIMEOUT_PHASES.values(), 0)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.config = public_config(settings)
        self.reloaded_at: float | None = None

    def configuration_changed(self, settings: Settings, fresh_circuits: Collection[str]) -> None:
        # The panel and the upstreams table show what new requests follow; redacted here, once
        # per reload, not per read. Counters and rings stay: they are this worker's history.
        # An upstream whose circuit starts anew is up, whatever its old circuit was.
        for name in fresh_circuits:
            self.health[name] = (True, None)
        self.settings, self.config, self.reloaded_at = settings, public_config(settings), self.wall()

    # -- hooks ------------------------------------------------------------------------------
    def request_received(self, ex: Exchange) -> None:
        routed = ex.upstream or NONE
        ex.scratch["ui"] = (self.model_label(ex.model), routed)
        self.in_flight += 1
        self.in_flight_by[routed] = self.in_flight_by.get(routed, 0) + 1

    def retry(self, ex: Exchange, reason: str, backoff: float) -> None:
        second = self.seconds.at(int(self.clock()))
        second.retries += 1
        self.retries += 1
        phase = TIMEOUT_PHASES.get(reason)
        if phase is not None:
            second.timeouts += 1
            self.timeouts[phase] += 1

    def upstream_health(self, ex: Exchange, upstream: str, up: bool) -> None:
        self.health[upstream] = (up, self.wall())

    def ended(self, ex: Exchange) -> None:
        model, routed = ex.scratch.get("ui") or (self.model_label(ex.model), ex.upstream or NONE)
        upstream = ex.upstream or NONE
        outcome = ex.outcome._value_ if ex.outcome is not None else NONE  # not the slower `value`
        self.in_flight -= 1
        self.in_flight_by[routed] = self.in_flight_by.get(routed, 1) - 1
        now = self.clock()
        second = self.seconds.at(int(now))
        second.outcomes[outcome] = second.outcomes.get(outcome, 0) + 1
        by = self.outcomes.setdefault(upstream, {})
        by[outcome] = by.get(outcome, 0) + 1
        phase = TIMEOUT_PHASES.get(outcome)
        if phase is not None:
            second.timeouts += 1
            self.timeouts[phase] += 1
        ttft, tpot = ex.ttft, None
        if ttft is not None and ex.first_token_at is not None:
            self._step(model, ex.first_token_at, now).ttft.add(ttft, self.cap, self.rng)
        prompt = ex.prompt_tokens if ex.prompt_tokens is not None else ex.estimated_prompt_tokens
        completion = ex.output_tokens if route_of(ex.route).generation else 0
        if outcome == _OK:
            tpot = ex.tpot
            if tpot is not None:
                self._step(model, now, now).tpot.add(tpot, self.cap, self.rng)
            second.prompt_tokens += prompt
            second.completion_tokens += completion
            self.prompt_tokens += prompt
            self.completion_tokens += completion
        rejected = outcome == _REJECTED
        self.recent.append(
            (
                self.wall(),  # when it ended: the table's order
                ex.started_unix_ns / 1e9,
                ex.request_id,
                (ex.model or "")[:MAX_MODEL_CHARS],
                upstream,
                ex.route,
                ex.stream,
                outcome,
                ex.status_code,
                ttft,
                ex.tpot,
                ex.decode_time,
                ex.duration,
                None if rejected else prompt,
                None if rejected else completion,
                ex.completion_tokens is None,
                ex.retries,
            )
        )

    def _step(self, model: str, at: float, now: float) -> Step:
        ring = self.latency.get(model)
        if ring is None:
            ring = self.latency[model] = StepRing(self.steps)
        step = int(at) // self.step
        if step <= int(now) // self.step - self.steps:
            step = int(now) // self.step  # older than the window: count it now
        return ring.at(step)

    # -- the page's data --------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now, wall = self.clock(), self.wall()
        sec = int(now)
        last = sec // self.step
        steps = range(last - self.steps + 1, last + 1)
        t = [round(wall - (now - s * self.step), 3) for s in steps]
        latency, others = self._latency(steps)
        return {
            "version": __version__,
            "pid": os.getpid(),
            "workers": self.settings.server.workers,
            "now": wall,
            "uptime_s": round(now - self.started, 3),
            "window_s": self.steps * self.step,
            "step_s": self.step,
            "refresh_s": self.settings.ui.refresh_seconds,
            "quantiles": list(QUANTILES),
            "in_flight": self.in_flight,
            "totals": self._totals(),
            "last_minute": self._last_minute(now),
            "series": {"t": t, **self._rates(steps, now)},
            "latency": latency,
            "other_models": others,
            "requests": [dict(zip(_ROW, row, strict=True)) for row in reversed(self.recent)],
            "upstreams": self._upstreams(),
            "config": self.config,
            "config_reloaded_at": self.reloaded_at,
            "config_reloadable": RELOADABLE,
        }

    def _totals(self) -> dict[str, Any]:
        requests: dict[str, int] = {}
        for by in self.outcomes.values():
            for outcome, n in by.items():
                requests[outcome] = requests.get(outcome, 0) + n
        return {
            "requests": requests,
            "retries": self.retries,
            "timeouts": dict(self.timeouts),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }

    def _last_minute(self, now: float) -> dict[str, Any]:
        sec = int(now)
        span = max(1.0, min(60.0, now - self.started))
        outcomes: dict[str, int] = {}
        prompt = completion = retries = timeouts = 0
        for s in self.seconds.span(sec - 59, sec):
            for outcome, n in s.outcomes.items():
                outcomes[outcome] = outcomes.get(outcome, 0) + n
            prompt += s.prompt_tokens
            completion += s.completion_tokens
            retries += s.retries
            timeouts += s.timeouts
        return {
            "seconds": round(span, 3),
            "requests": outcomes,
            "requests_per_s": sum(outcomes.values()) / span,
            "prompt_tokens_per_s": prompt / span,
            "completion_tokens_per_s": completion / span,
            "retries": retries,
            "timeouts": timeouts,
        }

    def _rates(self, steps: range, now: float) -> dict[str, Any]:
        """Per step, per second: requests by outcome, tokens in and out, retries, timeouts."""
        outcomes: dict[str, list[float | None]] = {}
        prompt: list[float | None] = []
        completion: list[float | None] = []
        retries: list[float | None] = []
        timeouts: list[float | None] = []
        for i, s in enumerate(steps):
            first = s * self.step
            if first + self.step <= self.started:  # before this worker started: no data, not zero
                for empty in (prompt, completion, retries, timeouts):
                    empty.append(None)
                continue
            span = min(float(self.step), max(1.0, now - first))
            p = c = r = to = 0
            for sec in self.seconds.span(first, min(first + self.step - 1, int(now))):
                for outcome, n in sec.outcomes.items():
                    line = outcomes.get(outcome)
                    if line is None:
                        line = outcomes[outcome] = self._zeros(steps)
                    line[i] = (line[i] or 0.0) + n / span
                p += sec.prompt_tokens
                c += sec.completion_tokens
                r += sec.retries
                to += sec.timeouts
            prompt.append(p / span)
            completion.append(c / span)
            retries.append(r / span)
            timeouts.append(to / span)
        return {
            "requests_per_s": outcomes,
            "prompt_tokens_per_s": prompt,
            "completion_tokens_per_s": completion,
            "retries_per_s": retries,
            "timeouts_per_s": timeouts,
        }

    def _zeros(self, steps: range) -> list[float | None]:
        return [None if (s + 1) * self.step <= self.started else 0.0 for s in steps]

    def _latency(self, steps: range) -> tuple[dict[str, Any], list[str]]:
        """Quantile series per model, for the CHARTED_MODELS models with the most samples in the
        window (a bound on the cost of a read); and the names of the other models."""
        present: list[tuple[int, str, list[Step | None]]] = []
        for model, ring in self.latency.items():
            found = [ring.get(s) for s in steps]
            seen = sum(st.ttft.n + st.tpot.n for st in found if st is not None)
            if seen:
                present.append((seen, model, found))
        present.sort(key=lambda p: (-p[0], p[1]))
        out: dict[str, Any] = {}
        for _, model, found in sorted(present[:CHARTED_MODELS], key=lambda p: p[1]):
            entry: dict[str, Any] = {}
            for kind in ("ttft", "tpot"):
                kept = [None if st is None else (st.ttft if kind == "ttft" else st.tpot) for st in found]
                series: dict[str, list[float | None]] = {name: [] for name in NAMES}
                counts: list[int] = []
                for res in kept:
                    n, qs = step_quantiles(res)
                    counts.append(n)
                    for name, v in zip(NAMES, qs, strict=True):
                        series[name].append(v)
                n, qs = quantiles([r for r in kept if r is not None])
                window: dict[str, Any] = {"count": n, **dict(zip(NAMES, qs, strict=True))}
                entry[kind] = {**series, "count": counts, "window": window}
            out[model] = entry
        return out, sorted(model for _, model, _ in present[CHARTED_MODELS:])

    def _upstreams(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        # The router's default: the one flagged, else the first (as the start-up log says).
        ups = self.settings.upstreams
        default = next((u.name for u in ups if u.default), ups[0].name if ups else None)
        pools = self.pool_rows()
        for up in self.settings.upstreams:
            is_up, since = self.health.get(up.name, (True, None))
            rows.append(
                {
                    "name": up.name,
                    "base_url": display_url(up.base_url)
                    if up.base_url
                    else ", ".join(map(display_url, up.replicas)),
                    "state": "up" if is_up else "circuit_open",
                    "since": since,
                    "default": up.name == default,
                    "models": up.models,
                    "fallback": up.fallback,
                    "api_key_env": up.api_key_env,
                    "api_key_set": up.api_key() is not None if up.api_key_env else None,
                    "in_flight": self.in_flight_by.get(up.name, 0),
                    "requests": dict(self.outcomes.get(up.name, {})),
                }
            )
            if up.name in pools:
                rows[-1]["balance"] = up.balance
                rows[-1]["replicas"] = pools[up.name]
        return rows


# The fields of a row of the last-requests table, in the order `ended` records them.
_ROW = (
    "time",
    "started",
    "request_id",
    "model",
    "upstream",
    "route",
    "stream",
    "outcome",
    "status",
    "ttft",
    "tpot",
    "decode",
    "duration",
    "prompt_tokens",
    "completion_tokens",
    "tokens_estimated",
    "retries",
)
