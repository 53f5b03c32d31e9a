"""`infertap doctor`: diagnose the seed article's five common faults from metrics.

Reads infertap's /metrics (one scrape: totals since infertap started; with --interval, two
scrapes and the difference) or a Prometheus server (PromQL over --window), and the engine's
/metrics when given (vLLM names). Prints each finding with its evidence and the knob to change.
Exit status: 0 nothing found, 1 findings, 2 a source could not be read or bad usage, 3 the
evidence is too thin to judge (the report says what would settle it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import httpx

from proxy.tools.diagnose import ENGINE_GAUGES, Inputs, Thresholds, diagnose, fmt_s, needs, summary
from proxy.tools.exposition import ExpositionError, Labels, Samples, delta, from_vector, parse

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

_EPILOG = """\
examples:
  infertap doctor                                    # infertap on 127.0.0.1:8080, totals since it started
  infertap doctor --engine-metrics http://127.0.0.1:8000/metrics     # and the engine's (vLLM) metrics
  infertap doctor --interval 30 --engine-metrics http://127.0.0.1:8000/metrics   # what happens in 30 s
  infertap doctor --prometheus http://prometheus:9090 --window 15m --selector 'job="infertap"'
  infertap doctor --json > doctor.json                # schema: docs/doctor.md

The faults (from the seed article) and what each rule looks at:
  kv_cache          TPOT grows with answer length (length-weighted vs per-request mean TPOT);
                    the engine's KV-cache usage stays 0 while requests run (--interval / --prometheus)
  prefill_queueing  TTFT p90/p50 large within a prompt class, confirmed by the engine's queue
  context_length    4xx answers from the upstream (prompts over max_model_len); engine preemptions
  stream_cut        stream_interrupted / idle / total timeouts; chunks arriving bunched (a buffer)
  looping           infertap_degenerate_responses_total > 0 (needs [loops] enabled = true)

Exit status: 0 no problem found, 1 problems found, 2 a source could not be read (or is not
infertap's /metrics) or bad usage, 3 not enough evidence to judge (the report says what it needs).
"""


class SourceError(Exception):
    """A source could not be read: exit status 2 with this message."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infertap doctor",
        description="Diagnose the common prefill/decode faults (KV cache off, prefill queueing, prompts "
        "over the context limit, cut streams, looping output) from infertap's and the engine's metrics.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = parser.add_argument_group("sources")
    src.add_argument("--metrics", metavar="URL", help=f"infertap's /metrics (default: {DEFAULT_METRICS})")
    src.add_argument("--prometheus", metavar="URL", help="a Prometheus server to query instead of --metrics")
    src.add_argument("--window", default="15m", help="PromQL range with --prometheus (default: 15m)")
    src.add_argument(
        "--selector",
        default="",
        metavar="LABELS",
        help="label matchers for infertap's series with --prometheus, e.g. 'job=\"infertap\"'",
    )
    src.add_argument(
        "--engine-selector",
        default="",
        metavar="LABELS",
        help="label matchers for the engine's series with --prometheus",
    )
    src.add_argument(
        "--engine-metrics",
        metavar="URL",
        help="the engine's /metrics (vLLM names); by default doctor asks infertap (GET /ui/data) for its "
        "upstreams and reads the /metrics of the first that serves vLLM-style metrics",
    )
    src.add_argument(
        "--no-discover", action="store_true", help="do not look for the engine's /metrics through infertap"
    )
    src.add_argument(
        "--interval",
        type=float,
        default=0.0,
        metavar="S",
        help="scrape twice S seconds apart and judge the difference (default: one scrape, "
        "totals since start); the engine's gauges are polled in between",
    )
    src.add_argument(
        "--poll",
        type=float,
        default=1.0,
        metavar="S",
        help="engine gauge poll period with --interval (default: 1)",
    )
    src.add_argument(
        "--token-env",
        metavar="NAME",
        help="env variable with a bearer token for infertap's /metrics (auth.metrics_token_env)",
    )
    src.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="per HTTP request (default: 10)"
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        default=Thresholds().min_requests,
        metavar="N",
        help=f"streams needed to judge a distribution (default: {Thresholds().min_requests})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema: docs/doctor.md)")
    return parser


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


def describe_window(args: argparse.Namespace) -> str:
    if args.prometheus:
        return f"the last {args.window}"
    if args.interval > 0:
        return f"{args.interval:g} s between two scrapes"
    return "totals since infertap started"


def notes(inp: Inputs, report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    if getattr(args, "engine_upstream", None):
        out.append(
            f"engine metrics found through infertap: upstream {args.engine_upstream}, {args.engine_metrics}"
        )
    if inp.engine is None:
        out.append(
            "no engine metrics: queueing and KV-cache use cannot be confirmed; point me at the engine's "
            "/metrics (--engine-metrics URL)"
        )
    if report["degenerate"] is None:
        out.append(
            "no infertap_degenerate_responses_total series: loop detection is off ([loops] enabled = "
            "false, the default) or has flagged nothing yet"
        )
    return out


def render_text(result: dict[str, Any]) -> str:
    src, s = result["source"], result["summary"]
    lines = [f"infertap doctor: {src['metrics'] or src['prometheus']} ({src['window']})"]
    if src["engine_metrics"]:
        lines.append(f"engine: {src['engine_metrics']}")
    outcomes = ", ".join(f"{k} {v}" for k, v in s["outcomes"].items()) or "none"
    lines.append(f"requests: {s['requests']} ({outcomes})")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL")):
        h = s[key]
        if h:
            lines.append(f"{name}: p50 {fmt_s(h['p50'])}, p90 {fmt_s(h['p90'])} ({h['count']} observations)")
    findings = result["findings"]
    lines.append("")
    if not findings and result["needs"]:
        lines.append("Not enough evidence to judge; what I need:")
        lines += [f"  - {n}" for n in result["needs"]]
    elif not findings:
        lines.append("No problem found.")
    else:
        lines.append(f"{len(findings)} problem(s) found:")
        for i, f in enumerate(findings, 1):
            lines += ["", f"{i}. {f['title']}  [{f['fault']}]", "   evidence:"]
            lines += [f"     - {e}" for e in f["evidence"]]
            lines.append("   change:")
            lines += [f"     - {c}" for c in f["change"]]
    if result["notes"]:
        lines += ["", "notes:"] + [f"  - {n}" for n in result["notes"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    if args.metrics and args.prometheus:
        print("infertap doctor: give --metrics or --prometheus, not both", file=sys.stderr)
        return 2
    if args.interval and args.prometheus:
        print("infertap doctor: --interval is for --metrics; with --prometheus use --window", file=sys.stderr)
        return 2
    try:
        inp = collect(args)
    except KeyboardInterrupt:
        print("infertap doctor: interrupted", file=sys.stderr)
        return 130
    except SourceError as e:
        print(f"infertap doctor: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(e)}))
        return 2
    thresholds = Thresholds(min_requests=max(1, args.min_requests))
    findings = diagnose(inp, thresholds)
    missing = needs(inp, thresholds)
    report = summary(inp)
    result = {
        "source": {
            "metrics": None if args.prometheus else (args.metrics or DEFAULT_METRICS),
            "prometheus": args.prometheus,
            "engine_metrics": args.engine_metrics,
            "window": describe_window(args),
        },
        "healthy": not findings and not missing,
        "findings": [f.to_json() for f in findings],
        "needs": missing,
        "summary": report,
        "notes": notes(inp, report, args),
    }
    print(json.dumps(result, indent=2) if args.json else render_text(result))
    return 1 if findings else 3 if missing else 0
