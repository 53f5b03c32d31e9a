"""Where `infertap doctor` reads its inputs: infertap's /metrics (one scrape, or two and the
difference), a Prometheus server, and the engine's /metrics (given, or found through infertap).

Every failure to read a source is a SourceError: doctor prints it and exits 2.
"""

from __future__ import annotations

import argparse
import os
import re
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import httpx

from proxy.tools.doctor.evidence import ENGINE_GAUGES, Inputs
from proxy.tools.doctor.exposition import ExpositionError, Labels, Samples, delta, from_vector, parse

DEFAULT_METRICS = "http://127.0.0.1:8080/metrics"
# The classic text format: an OpenMetrics scrape may rename `vllm:` series (both are accepted).
ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"
_WINDOW = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")

# Series queried from Prometheus: increase() over the window for cumulative ones, max_over_time()
# for gauges. increase() drops the metric name, hence one query per name.
PROXY_SERIES = tuple(
    [f"infertap_{h}_{s}" for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                    "time_per_output_token_seconds", "request_prompt_tokens")
     for s in ("bucket", "sum", "count")]
    + ["infertap_request_completion_tokens_sum", "infertap_request_completion_tokens_count",
       "infertap_requests_total", "infertap_degenerate_responses_total"]
)  # fmt: skip
ENGINE_SERIES = tuple(
    [f"vllm:{h}_{s}" for h in ("time_to_first_token_seconds", "inter_token_latency_seconds")
     for s in ("bucket", "sum", "count")]
    + [f"vllm:{h}_{s}" for h in ("request_queue_time_seconds", "request_prefill_time_seconds")
       for s in ("sum", "count")]
    + ["vllm:num_preemptions_total", "vllm:request_success_total"]
)  # fmt: skip


class SourceError(Exception):
    """A source could not be read: exit status 2 with this message."""


def _get(client: httpx.Client, url: str, **kw: Any) -> httpx.Response:
    try:
        resp = client.get(url, **kw)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise SourceError(f"cannot reach {url}: {type(e).__name__}: {str(e) or 'no detail'}") from None
    if resp.status_code != 200:
        raise SourceError(f"{url} answered HTTP {resp.status_code}: {resp.text[:200].strip()}")
    return resp


def scrape(client: httpx.Client, url: str, headers: dict[str, str] | None = None) -> Samples:
    resp = _get(client, url, headers={"accept": ACCEPT, **(headers or {})})
    try:
        return parse(resp.text)
    except ExpositionError as e:
        raise SourceError(f"{url} is not a Prometheus /metrics endpoint: {e}") from None


def check_infertap(samples: Samples, url: str) -> None:
    """Refuse a /metrics that is not infertap's: judging it would report "no requests" as health."""
    if any(name.startswith("infertap_") for name, _ in samples.values):
        return
    if any(name.startswith("vllm:") for name, _ in samples.values):
        kind = "an engine's (vLLM names)"
        hint = f"pass it as --engine-metrics {url} and give --metrics infertap's /metrics"
    else:
        kind, hint = "not infertap's", "give --metrics infertap's /metrics (http://HOST:PORT/metrics)"
    raise SourceError(f"{url} is {kind} /metrics, not infertap's (no infertap_* series): {hint}")


def discover_engine(client: httpx.Client, url: str, headers: dict[str, str]) -> tuple[str, str] | None:
    """(upstream name, its /metrics URL) for the first of infertap's upstreams that serves
    vLLM-style metrics at its origin (the embedded sim, vLLM, SGLang), from infertap's /ui/data."""
    parts = urllib.parse.urlsplit(url)
    try:
        resp = client.get(f"{parts.scheme}://{parts.netloc}/ui/data", headers=headers, timeout=3)
        upstreams = resp.json()["config"]["upstreams"] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    for up in upstreams if isinstance(upstreams, list) else []:
        base = urllib.parse.urlsplit(str(up.get("base_url", "")))
        if base.scheme not in ("http", "https"):
            continue
        candidate = f"{base.scheme}://{base.netloc}/metrics"
        try:
            resp = client.get(candidate, headers={"accept": ACCEPT}, timeout=3)
            found = parse(resp.text) if resp.status_code == 200 else None
        except (httpx.HTTPError, ExpositionError):
            continue
        if found is not None and any(name.startswith("vllm:") for name, _ in found.values):
            return str(up.get("name", "?")), candidate
    return None


def engine_gauges(samples: Samples) -> dict[str, float]:
    return {name: v for name in ENGINE_GAUGES if (v := samples.gauge(name)) is not None}


def from_scrapes(args: argparse.Namespace, client: httpx.Client, headers: dict[str, str]) -> Inputs:
    url = args.metrics or DEFAULT_METRICS
    first = scrape(client, url, headers)
    check_infertap(first, url)
    if not args.engine_metrics and not args.no_discover:
        found = discover_engine(client, url, headers)
        if found is not None:
            args.engine_upstream, args.engine_metrics = found
    engine_url = args.engine_metrics
    e_first = scrape(client, engine_url) if engine_url else None
    polls = [engine_gauges(e_first)] if e_first is not None else []
    if args.interval <= 0:
        return Inputs(first, e_first, polls)
    deadline = time.monotonic() + args.interval
    e_last = e_first
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(max(args.poll, 0.05), left))
        if engine_url and deadline - time.monotonic() > 0:
            e_last = scrape(client, engine_url)
            polls.append(engine_gauges(e_last))
    last = scrape(client, url, headers)
    if engine_url:
        e_last = scrape(client, engine_url)
        polls.append(engine_gauges(e_last))
    engine = delta(e_first, e_last) if e_first is not None and e_last is not None else None
    return Inputs(delta(first, last), engine, polls)


def _query(client: httpx.Client, base: str, promql: str) -> list[dict[str, Any]]:
    resp = _get(client, f"{base.rstrip('/')}/api/v1/query", params={"query": promql})
    try:
        body = resp.json()
    except ValueError:
        raise SourceError(f"{base} is not a Prometheus API (answer is not JSON)") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        raise SourceError(
            f"Prometheus refused {promql!r}: {body.get('error') if isinstance(body, dict) else body}"
        )
    data = body.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    return result if isinstance(result, list) else []


def from_prometheus(args: argparse.Namespace, client: httpx.Client) -> Inputs:
    if not _WINDOW.match(args.window):
        raise SourceError(f"--window {args.window!r}: use a Prometheus duration such as 30s, 15m, 1h")
    base, w = args.prometheus, args.window

    def series(fn: str, name: str, sel: str) -> dict[tuple[str, Labels], float]:
        found = from_vector(name, _query(client, base, f"{fn}({name}{{{sel}}}[{w}])"))
        if not found and name.startswith("vllm:"):  # scraped as OpenMetrics: vllm_ names
            other = "vllm_" + name[5:]
            found = from_vector(other, _query(client, base, f"{fn}({other}{{{sel}}}[{w}])"))
        return found

    def fetch(names: Sequence[str], sel: str) -> Samples:
        out = Samples()
        for name in names:
            out.values |= series("increase", name, sel)
        return out

    proxy = fetch(PROXY_SERIES, args.selector)
    if not any(proxy.values) and not _query(client, base, f"infertap_build_info{{{args.selector}}}"):
        raise SourceError(
            f"{base} holds no infertap_* series{' for ' + args.selector if args.selector else ''}: "
            "is it the Prometheus that scrapes infertap (check --selector)?"
        )
    engine: Samples | None = None
    polls: list[dict[str, float]] = []
    if args.engine_metrics:
        engine = scrape(client, args.engine_metrics)
        polls = [engine_gauges(engine)]
    else:
        engine = fetch(ENGINE_SERIES, args.engine_selector)
        poll: dict[str, float] = {}
        for name in ENGINE_GAUGES:
            values = series("max_over_time", name, args.engine_selector)
            if values:
                poll[name] = sum(values.values())
        if not engine.values and not poll:
            engine = None
        elif poll:
            polls = [poll]
    return Inputs(proxy, engine, polls)


def collect(args: argparse.Namespace) -> Inputs:
    headers: dict[str, str] = {}
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise SourceError(f"--token-env {args.token_env}: the variable is not set")
        headers["authorization"] = f"Bearer {token}"
    with httpx.Client(timeout=args.timeout) as client:
        if args.prometheus:
            return from_prometheus(args, client)
        return from_scrapes(args, client, headers)
