"""`infertap probe`: the seed's measurement script, done properly.

Streams chat completions to any OpenAI-compatible base URL (infertap, TaoToken, a vLLM) and
reports TTFT, total time, output tokens, TPOT = (total - TTFT) / max(tokens - 1, 1) and
TPS = 1 / TPOT. With `-n N -c C` it runs N requests at concurrency C and reports p50/p90/p99.
`--json` prints one object whose schema is in docs/tools.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from proxy.tools.probe import plot
from proxy.tools.probe.client import Progress, Result, make_client, prepare, run_many
from proxy.tools.probe.histogram import histograms
from proxy.tools.probe.stats import summarize
from proxy.tools.probe.target import (
    Target,
    ToolError,
    add_target_arguments,
    prompts_from_args,
    run_cli,
    target_from_args,
)

_EPILOG = """\
examples:
  infertap probe --base-url http://127.0.0.1:8080/v1 --model sim-model
  infertap probe --settings examples/settings.json           # the seed's client settings, as is (TaoToken)
  infertap probe --settings examples/settings.json --base-url http://127.0.0.1:8080/v1   # offline: infertap
  infertap probe --base-url http://127.0.0.1:8000/v1 -n 100 -c 8 --json > run.json
  TAOTOKEN_API_KEY=sk-... infertap probe --base-url https://taotoken.net/api --model MODEL

Precedence: flags > --settings file > $TAOTOKEN_BASE_URL / $TAOTOKEN_API_KEY > defaults.
TTFT counts from sending the request to the first event that carries output text (not the
role-only chunk). Output tokens come from the server's usage chunk when it sends one, else
from counting content events (the report says which). Exit status: 0 all requests ok,
1 some failed, 2 bad usage or settings.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infertap probe",
        description="Stream chat completions to an OpenAI-compatible server and report TTFT, TPOT and TPS.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(parser)
    run = parser.add_argument_group("load")
    run.add_argument(
        "-n", "--requests", type=int, default=1, metavar="N", help="requests to send (default: 1)"
    )
    run.add_argument(
        "-c", "--concurrency", type=int, default=1, metavar="C", help="requests in flight (default: 1)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema: docs/tools.md)")
    add_chart_arguments(parser)
    return parser


def add_chart_arguments(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("charts")
    out.add_argument(
        "--no-histogram",
        action="store_true",
        help="leave out the text histograms of TTFT and TPOT (never in --json output)",
    )
    out.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the TTFT and TPOT distributions into FILE (.png, .svg, .pdf; 1200x500 px); "
        "needs matplotlib: pip install 'infertap[plot]', from a checkout .venv/bin/pip install -e '.[plot]'",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace | int:
    """Parsed args, or the exit status when argparse finished (--help: 0, a usage error: 2)."""
    try:
        return parser.parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)


def check_load(n: int, c: int) -> None:
    if n < 1:
        raise ToolError("-n must be at least 1")
    if c < 1:
        raise ToolError("-c must be at least 1")


# -- reporting (shared with compare) ----------------------------------------------------------


def token_source(results: Sequence[Result]) -> str | None:
    sources = {r.token_source for r in results if r.ok}
    if not sources:
        return None
    return sources.pop() if len(sources) == 1 else "mixed"


TOKEN_SOURCE_TEXT = {
    "usage": "from the server's usage chunk",
    "counted": "counted content events: the server sent no usage, and an event may hold more than one token",
    "mixed": "from usage where the server sent it, else counted content events",
}


def summary_json(results: Sequence[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]

    def col(name: str) -> list[float]:
        return [float(v) for r in ok if (v := getattr(r, name)) is not None]

    return {
        "ttft_s": summarize(col("ttft_s")),
        "tpot_s": summarize(col("tpot_s")),
        "total_s": summarize(col("total_s")),
        "tps": summarize(col("tps")),
        "output_tokens": summarize(col("output_tokens")),
    }


def errors_json(results: Sequence[Result]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.ok or r.error_kind is None:
            continue
        entry = out.setdefault(r.error_kind, {"count": 0, "first": r.error})
        entry["count"] += 1
    return out


def run_json(target: Target, results: Sequence[Result], wall_s: float, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens or 0 for r in ok)
    return {
        "target": target.describe(),
        "requests": len(results),
        "concurrency": concurrency,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "token_source": token_source(results),
        "summary": summary_json(results),
        "errors": errors_json(results),
        "results": [r.as_json() for r in results],
    }


def fmt_seconds(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f} s"


ROWS: tuple[tuple[str, str, int], ...] = (
    ("TTFT", "ttft_s", 3),
    ("TPOT", "tpot_s", 4),
    ("total", "total_s", 3),
)


def format_table(summary: dict[str, Any]) -> list[str]:
    lines = [f"{'':<8}{'p50':>11}{'p90':>11}{'p99':>11}{'mean':>11}"]
    for label, key, digits in ROWS:
        s = summary[key]
        if s is None:
            continue
        cells = "".join(f"{fmt_seconds(s[q], digits):>11}" for q in ("p50", "p90", "p99", "mean"))
        lines.append(f"{label:<8}{cells}")
    for label, key in (("TPS", "tps"), ("tokens", "output_tokens")):
        s = summary[key]
        if s is not None:
            lines.append(f"{label:<8}" + "".join(f"{s[q]:>11.1f}" for q in ("p50", "p90", "p99", "mean")))
    return lines


def ok_values(run: dict[str, Any], key: str) -> list[float]:
    """The metric of every successful request of a run_json report."""
    return [float(r[key]) for r in run["results"] if r["ok"] and r.get(key) is not None]


def format_histograms(series: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Text histograms of TTFT and TPOT for (label, run_json report) pairs, over shared bins."""
    blocks = histograms(
        [
            (f"{label} (s)", [(name, ok_values(run, key)) for name, run in series], digits)
            for label, key, digits in ROWS[:2]
        ]
    )
    return [line for block in blocks if block for line in ("", *block)]


def format_errors(errors: dict[str, dict[str, Any]]) -> list[str]:
    return [f"  {kind} x{e['count']}: {e['first']}" for kind, e in sorted(errors.items())]


def format_single(r: Result) -> str:
    source = TOKEN_SOURCE_TEXT.get(r.token_source or "", "")
    tps = r.tps
    return "\n".join(
        [
            f"TTFT (time to first token):   {r.ttft_s:.3f} s",
            f"total time:                   {r.total_s:.3f} s",
            f"output tokens:                {r.output_tokens} ({source})",
            f"TPOT (time per output token): {r.tpot_s:.4f} s",
            f"TPS (tokens per second):      {tps:.2f}" if tps else "TPS (tokens per second):      -",
        ]
    )


def format_run(report: dict[str, Any], histograms: bool = False) -> str:
    t = report["target"]
    rps = report["requests_per_s"]
    lines = [
        f"target: {t['base_url']}  model: {t['model']}",
        f"requests: {report['ok']} ok, {report['failed']} failed, concurrency {report['concurrency']}, "
        f"{report['wall_s']:.2f} s wall" + (f" ({rps:.2f} req/s)" if rps else ""),
    ]
    if report["token_source"]:
        lines.append(f"output tokens: {TOKEN_SOURCE_TEXT[report['token_source']]}")
    if report["ok"]:
        lines += ["", *format_table(report["summary"])]
        if histograms:
            lines += format_histograms([("requests", report)])
    if report["errors"]:
        lines += ["", "errors:", *format_errors(report["errors"])]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


async def _probe(
    target: Target, prompts: list[str], n: int, c: int, warmup: bool
) -> tuple[Target, list[Result], float]:
    progress = Progress(n, sys.stderr)
    async with make_client(target, c) as client:
        target = await prepare(client, target, warmup=warmup)
        started = time.perf_counter()
        try:
            results = await run_many(client, target, prompts, n, c, on_done=progress)
        finally:
            progress.close()
        return target, results, time.perf_counter() - started


def main(argv: list[str]) -> int:
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):
        return args

    def work() -> tuple[Target, list[Result], float]:
        notes: list[str] = []
        check_load(args.requests, args.concurrency)
        target = target_from_args(args, notes=notes)
        prompts = prompts_from_args(args)
        if args.plot:
            plot.check_output(args.plot)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        return asyncio.run(_probe(target, prompts, args.requests, args.concurrency, not args.no_warmup))

    done, status = run_cli("infertap probe", work)
    if done is None:
        return status or 1
    target, results, wall = done
    report = run_json(target, results, wall, args.concurrency)
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    elif len(results) == 1:
        if results[0].ok:
            print(format_single(results[0]))
    else:
        print(format_run(report, histograms=not args.no_histogram))
    failed = [r for r in results if not r.ok]
    if len(failed) == 1 and len(results) == 1:
        print(f"infertap probe: {failed[0].error}", file=sys.stderr)
    elif failed:
        kinds = ", ".join(f"{k} x{n}" for k, n in Counter(r.error_kind for r in failed).items())
        print(
            f"infertap probe: {len(failed)} of {len(results)} requests failed ({kinds}); "
            f"first: {failed[0].error}",
            file=sys.stderr,
        )
    if (
        args.plot
        and (status := plot.write_chart(plot.probe_chart, report, args.plot, "infertap probe")) is not None
    ):
        return status
    return 1 if failed else 0
