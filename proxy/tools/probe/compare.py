"""`infertap compare`: the seed's A/B experiment (e.g. the same engine with the KV cache on and off).

The same prompt set goes to target A and target B (two base URLs, or two models on one URL), or
two saved `infertap probe --json` runs are compared (one target under two configs, run in turn,
e.g. an engine restarted with the KV cache off in between). Live requests run in interleaved
rounds: C requests to A, then C to B, and again, so a drift in the machine's load hits both sides
alike. The report puts the TTFT and TPOT distributions side by side and gives, for each, the ratio
of medians B/A with a bootstrap confidence interval (seeded, so a run can be reproduced) and a
plain verdict: "TPOT 3.1x higher in B, 95% CI 2.8-3.4x", or "no clear difference" when the
interval includes 1x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from proxy.tools.probe import plot
from proxy.tools.probe.cli import (
    TOKEN_SOURCE_TEXT,
    add_chart_arguments,
    check_load,
    fmt_seconds,
    format_errors,
    format_histograms,
    parse_args,
    run_json,
)
from proxy.tools.probe.client import Progress, Result, make_client, prepare, run_many
from proxy.tools.probe.stats import RatioCI, bootstrap_ratio_ci
from proxy.tools.probe.target import (
    Target,
    ToolError,
    add_target_arguments,
    prompts_from_args,
    run_cli,
    target_from_args,
    validate_target,
)

METRICS: tuple[tuple[str, str, int], ...] = (
    ("TTFT", "ttft_s", 3),
    ("TPOT", "tpot_s", 4),
    ("total", "total_s", 3),
)

_EPILOG = """\
examples:
  # the seed's KV-cache experiment: two engines, cache on (A) and off (B)
  infertap compare --a http://127.0.0.1:8001/v1 --b http://127.0.0.1:8002/v1 --model sim-model -n 30 -c 4
  # two models behind one base URL (e.g. infertap routing to two upstreams)
  infertap compare --base-url http://127.0.0.1:8080/v1 --model-a small --model-b large -n 20 --json
  # one engine under two configs, run in turn: probe it, restart it with the other config, probe again
  infertap probe -n 30 -c 4 --json > cache-on.json      # ... restart the engine with the KV cache off
  infertap probe -n 30 -c 4 --json > cache-off.json
  infertap compare --runs cache-on.json cache-off.json --label-a on --label-b off

Verdicts use the ratio of medians B/A and its bootstrap CI ({resamples} resamples by default,
seeded with --seed). "no clear difference" means the interval includes 1x, not that the two
are equal: more requests (-n) narrow the interval. Exit status: 0 done, 1 some requests
failed, 2 bad usage or settings.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infertap compare",
        description="A/B two OpenAI-compatible targets: TTFT and TPOT side by side, the B/A ratio of "
        "medians with a bootstrap 95% CI, and a verdict.",
        epilog=_EPILOG.format(resamples=2000),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ab = parser.add_argument_group("the two targets")
    ab.add_argument("--a", metavar="URL", help="base URL of A (default: --base-url / settings / env)")
    ab.add_argument("--b", metavar="URL", help="base URL of B (default: the same as A)")
    ab.add_argument("--model-a", metavar="NAME", help="model for A (default: --model)")
    ab.add_argument("--model-b", metavar="NAME", help="model for B (default: --model)")
    ab.add_argument(
        "--runs",
        nargs=2,
        metavar=("A_JSON", "B_JSON"),
        help="compare two saved `infertap probe --json` runs instead of sending requests",
    )
    ab.add_argument("--label-a", default="A", help="name of A in the report (default: A)")
    ab.add_argument("--label-b", default="B", help="name of B in the report (default: B)")
    add_target_arguments(parser)
    run = parser.add_argument_group("load and statistics")
    run.add_argument(
        "-n", "--requests", type=int, default=20, metavar="N", help="requests per target (default: 20)"
    )
    run.add_argument(
        "-c", "--concurrency", type=int, default=1, metavar="C", help="requests in flight (default: 1)"
    )
    run.add_argument(
        "--bootstrap", type=int, default=2000, metavar="R", help="bootstrap resamples (default: 2000)"
    )
    run.add_argument("--confidence", type=float, default=0.95, help="confidence level (default: 0.95)")
    run.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (schema: docs/tools.md)")
    add_chart_arguments(parser)
    return parser


def targets_from_args(args: argparse.Namespace) -> tuple[Target, Target]:
    base = target_from_args(args)
    a = replace(base, base_url=args.a or base.base_url, model=args.model_a or base.model)
    b = replace(base, base_url=args.b or a.base_url, model=args.model_b or base.model)
    return validate_target(a), validate_target(b)


_RESULT_FIELDS = frozenset(f.name for f in fields(Result))


def load_run(path: str) -> tuple[dict[str, Any], list[Result]]:
    """A saved `infertap probe --json` run, and its per-request results."""
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except OSError as e:
        raise ToolError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ToolError(f"{path}: not JSON ({e}): save a run with `infertap probe --json > FILE`") from None
    if not (
        isinstance(run, dict)
        and isinstance(run.get("target"), dict)
        and isinstance(run.get("summary"), dict)
        and isinstance(run.get("results"), list)
    ):
        raise ToolError(
            f"{path}: not the output of `infertap probe --json` (it needs target, summary, results)"
        )
    try:
        results = [Result(**{k: v for k, v in r.items() if k in _RESULT_FIELDS}) for r in run["results"]]
    except (AttributeError, TypeError) as e:
        raise ToolError(f"{path}: a result is malformed: {e}") from None
    return run, results


# -- statistics and verdicts ------------------------------------------------------------------


def fmt_ratio(x: float, digits: int | None = None) -> str:
    """1 decimal from 2x up ("3.1"), 2 below ("1.04"), unless `digits` says otherwise."""
    if digits is None:
        digits = 1 if x >= 2 else 2
    return f"{x:.{digits}f}"


def _ratios(*xs: float) -> list[str]:
    """Several ratios with one precision, so "1.60–2.50" never reads "1.60–2.5"."""
    digits = 1 if min(xs) >= 2 else 2
    return [fmt_ratio(x, digits) for x in xs]


def verdict(metric: str, ci: RatioCI | None, label_a: str = "A", label_b: str = "B") -> str:
    """A line like "TPOT 3.1× higher in B, 95% CI 2.8–3.4×", "... lower in B", or "no clear difference"."""
    if ci is None:
        return f"{metric}: not enough successful requests on both sides for a verdict"
    pct = f"{ci.confidence * 100:g}% CI"
    if ci.includes_one:
        r, lo, hi = _ratios(ci.ratio, ci.low, ci.high)
        return f"{metric}: no clear difference ({label_b}/{label_a} {r}×, {pct} {lo}–{hi}×)"
    if ci.ratio >= 1:
        r, lo, hi = _ratios(ci.ratio, ci.low, ci.high)
        return f"{metric} {r}× higher in {label_b}, {pct} {lo}–{hi}×"
    # Lower in B: say how many times lower (A/B), with the interval inverted to match.
    r, lo, hi = _ratios(1 / ci.ratio, 1 / ci.high, 1 / ci.low)
    return f"{metric} {r}× lower in {label_b}, {pct} {lo}–{hi}×"


def compare_metric(
    a: Sequence[Result], b: Sequence[Result], key: str, *, resamples: int, confidence: float, seed: int
) -> RatioCI | None:
    va = [float(v) for r in a if r.ok and (v := getattr(r, key)) is not None]
    vb = [float(v) for r in b if r.ok and (v := getattr(r, key)) is not None]
    try:
        return bootstrap_ratio_ci(va, vb, resamples=resamples, confidence=confidence, seed=seed)
    except ValueError:
        return None


def comparison_json(
    a_results: Sequence[Result],
    b_results: Sequence[Result],
    *,
    resamples: int,
    confidence: float,
    seed: int,
    label_a: str = "A",
    label_b: str = "B",
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, key, _ in METRICS:
        ci = compare_metric(a_results, b_results, key, resamples=resamples, confidence=confidence, seed=seed)
        out[key] = {
            "ratio_b_over_a": ci.ratio if ci else None,
            "ci_low": ci.low if ci else None,
            "ci_high": ci.high if ci else None,
            "significant": (not ci.includes_one) if ci else None,
            "verdict": verdict(label, ci, label_a, label_b),
        }
    return out


# -- running ----------------------------------------------------------------------------------


async def _compare(
    a: Target, b: Target, prompts: list[str], n: int, c: int, warmup: bool = True
) -> tuple[Target, Target, list[Result], list[Result], dict[str, float]]:
    """Run both sides in interleaved rounds; also return each side's busy time in seconds."""
    progress = Progress(2 * n, sys.stderr, label="A/B ")
    results: dict[str, list[Result]] = {"a": [], "b": []}
    busy = {"a": 0.0, "b": 0.0}
    async with make_client(a, c) as ca, make_client(b, c) as cb:
        a = await prepare(ca, a, warmup=warmup)
        b = await prepare(cb, b, warmup=warmup)
        try:
            for first in range(0, n, c):  # interleaved rounds: C to A, then the same C prompts to B
                size = min(c, n - first)
                for key, client, target in (("a", ca, a), ("b", cb, b)):
                    started = time.perf_counter()
                    results[key] += await run_many(
                        client, target, prompts, size, c, on_done=progress, start_index=first
                    )
                    busy[key] += time.perf_counter() - started
        finally:
            progress.close()
    return a, b, results["a"], results["b"], busy


def format_report(report: dict[str, Any], histograms: bool = False) -> str:
    la, lb = report["labels"]["a"], report["labels"]["b"]
    lines = []
    for side, label in (("a", la), ("b", lb)):
        r = report[side]
        t = r["target"]
        lines.append(f"{label}: {t['base_url']}  model: {t['model']}  ({r['ok']} ok, {r['failed']} failed)")
        if r["token_source"]:
            lines.append(f"{' ' * (len(label) + 2)}output tokens: {TOKEN_SOURCE_TEXT[r['token_source']]}")
    pct = f"{report['bootstrap']['confidence'] * 100:g}% CI"
    heads = [f"{la} p50", f"{la} p90", f"{lb} p50", f"{lb} p90", f"{lb}/{la}"]
    width = max(11, *(len(h) for h in heads)) + 2
    lines += ["", f"{'':<7}" + "".join(f"{h:>{width}}" for h in heads) + f"  {pct}"]
    for label, key, digits in METRICS:
        sa, sb = report["a"]["summary"][key], report["b"]["summary"][key]
        m = report["metrics"][key]
        cells = [fmt_seconds(s[q], digits) if s else "-" for s in (sa, sb) for q in ("p50", "p90")]
        ci = "-"
        if m["ci_low"] is not None:
            r, lo, hi = _ratios(m["ratio_b_over_a"], m["ci_low"], m["ci_high"])
            cells.append(f"{r}×")
            ci = f"{lo}–{hi}×"
        else:
            cells.append("-")
        lines.append(f"{label:<7}" + "".join(f"{c:>{width}}" for c in cells) + f"  {ci}")
    if histograms:
        lines += format_histograms([(la, report["a"]), (lb, report["b"])])
    lines += ["", "verdict:"] + [f"  {report['metrics'][key]['verdict']}" for key in ("ttft_s", "tpot_s")]
    for side, label in (("a", la), ("b", lb)):
        if report[side]["errors"]:
            lines += ["", f"errors in {label}:", *format_errors(report[side]["errors"])]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):
        return args

    def work() -> tuple[dict[str, Any], dict[str, Any], list[Result], list[Result]]:
        check_load(args.requests, args.concurrency)
        if args.bootstrap < 1:
            raise ToolError("--bootstrap must be at least 1")
        if not 0 < args.confidence < 1:
            raise ToolError("--confidence must be between 0 and 1, e.g. 0.95")
        if args.plot:
            plot.check_output(args.plot)
        if args.runs:
            if args.a or args.b or args.model_a or args.model_b:
                raise ToolError("--runs compares saved runs: leave out --a, --b, --model-a and --model-b")
            (run_a, ra), (run_b, rb) = load_run(args.runs[0]), load_run(args.runs[1])
        else:
            a, b = targets_from_args(args)
            prompts = prompts_from_args(args)
            a, b, ra, rb, busy = asyncio.run(
                _compare(a, b, prompts, args.requests, args.concurrency, not args.no_warmup)
            )
            run_a = run_json(a, ra, busy["a"], args.concurrency)
            run_b = run_json(b, rb, busy["b"], args.concurrency)
        return run_a, run_b, ra, rb

    done, status = run_cli("infertap compare", work)
    if done is None:
        return status or 1
    run_a, run_b, ra, rb = done
    report = {
        "labels": {"a": args.label_a, "b": args.label_b},
        "a": run_a,
        "b": run_b,
        "bootstrap": {
            "statistic": "median",
            "resamples": args.bootstrap,
            "confidence": args.confidence,
            "seed": args.seed,
        },
        "metrics": comparison_json(
            ra,
            rb,
            resamples=args.bootstrap,
            confidence=args.confidence,
            seed=args.seed,
            label_a=args.label_a,
            label_b=args.label_b,
        ),
    }
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        print(format_report(report, histograms=not args.no_histogram))
    failed = [r for r in (*ra, *rb) if not r.ok]
    if failed:
        print(
            f"infertap compare: {len(failed)} of {len(ra) + len(rb)} requests failed; "
            f"first: {failed[0].error}",
            file=sys.stderr,
        )
    if (
        args.plot
        and (status := plot.write_chart(plot.compare_chart, report, args.plot, "infertap compare"))
        is not None
    ):
        return status
    return 1 if failed else 0
