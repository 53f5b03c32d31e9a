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
import sys
from collections.abc import Sequence
from typing import Any

from proxy.tools.doctor.evidence import Inputs, Thresholds, fmt_s, needs, summary
from proxy.tools.doctor.rules import diagnose
from proxy.tools.doctor.sources import DEFAULT_METRICS, SourceError, collect

__all__ = ["DEFAULT_METRICS", "SourceError", "build_parser", "main"]
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

With no --engine-metrics, doctor asks infertap for its upstreams (GET /ui/data) and reads the
/metrics of the first that serves vLLM-style metrics (the embedded sim, a local vLLM or SGLang).

Exit status: 0 no problem found, 1 problems found, 2 a source could not be read (or is not
infertap's /metrics) or bad usage, 3 not enough evidence to judge (the report says what it needs).
"""


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
