"""The targets of `infertap bench`: each a number read from a scenario's rows and the limit it
must stay within, judged PASS, MISS or n/a (a row it needs did not run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.tools.bench.report import ratio


@dataclass(frozen=True)
class Target:
    name: str
    scenario: str
    unit: str
    limit: float
    at_most: bool  # True: value <= limit passes (or < when strict)
    value: Callable[[dict[tuple[str, str], dict[str, Any]]], float | None]
    strict: bool = False

    def judge(self, rows: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
        try:
            v = self.value(rows)
        except (KeyError, TypeError):
            v = None
        verdict = None
        if v is not None:
            if self.at_most:
                verdict = v < self.limit if self.strict else v <= self.limit
            else:
                verdict = v >= self.limit
        op = ("<" if self.strict else "≤") if self.at_most else "≥"
        return {
            "name": self.name,
            "scenario": self.scenario,
            "value": v,
            "target": f"{op} {self.limit:g} {self.unit}",
            "pass": verdict,
        }


def _q(row: dict[str, Any], key: str, q: str) -> float:
    return float(row[key][q])


def _proxy(r: dict[tuple[str, str], dict[str, Any]], phase: str, key: str) -> float | None:
    v = r[phase, "infertap"].get(key)
    return None if v is None else float(v)


def _vs(r: dict[tuple[str, str], dict[str, Any]], phase: str, other: str, key: str) -> float | None:
    """infertap's `key` (a number) divided by another target's, in the same phase."""
    return ratio(r[phase, "infertap"][key], r[phase, other][key])


def _added_p99_minus(r: dict[tuple[str, str], dict[str, Any]], phase: str, other: str) -> float:
    return _q(r[phase, "infertap"], "added_ttft_ms", "p99") - _q(r[phase, other], "added_ttft_ms", "p99")


def _paced(name: str, scenario: str, phase: str) -> list[Target]:
    """A paced phase's targets: CPU within 1.5x nginx's and at or below vllm-router's."""
    return [
        Target(
            f"CPU per paced stream, {name}, x nginx",
            scenario,
            "x",
            1.5,
            True,
            lambda r: _proxy(r, phase, "nginx_cpu_ratio"),
        ),
        Target(
            f"CPU per paced stream, {name}, x vllm-router",
            scenario,
            "x",
            1.0,
            True,
            lambda r: _vs(r, phase, "vllm-router", "cpu_ms_per_request"),
        ),
    ]


def targets() -> list[Target]:
    """Issue 25's budget: ratios to nginx and to vllm-router in the same run (without one of them,
    its targets read n/a), and the ones kept from issues 17 and 8. Keys are (phase, target)."""
    return [
        Target(
            "added TTFT p50 minus nginx's, realistic c=1",
            "realistic",
            "ms",
            0.3,
            True,
            lambda r: _q(r["c=1", "infertap"], "added_ttft_vs_nginx_ms", "p50"),
        ),
        Target(
            "added TTFT p50 minus nginx's, realistic c=64",
            "realistic",
            "ms",
            0.3,
            True,
            lambda r: _q(r["c=64", "infertap"], "added_ttft_vs_nginx_ms", "p50"),
        ),
        *_paced("realistic c=1", "realistic", "c=1"),
        *_paced("realistic c=64", "realistic", "c=64"),
        Target(
            "added TTFT p99 minus vllm-router's, realistic c=64",
            "realistic",
            "ms",
            0.0,
            True,
            lambda r: _added_p99_minus(r, "c=64", "vllm-router"),
        ),
        Target(
            "added TTFT p99 minus nginx's, Poisson 60/s",
            "poisson",
            "ms",
            1.0,
            True,
            lambda r: _q(r["60/s", "infertap"], "added_ttft_vs_nginx_ms", "p99"),
        ),
        *_paced("Poisson 60/s", "poisson", "60/s"),
        Target(
            "CPU per zero-delay stream at c=64, x nginx",
            "throughput",
            "x",
            2.0,
            True,
            lambda r: _proxy(r, "stream c=64", "nginx_cpu_ratio"),
        ),
        Target(
            "non-streaming zero-delay at c=64, x nginx req/s",
            "throughput",
            "x",
            0.3,
            False,
            lambda r: _proxy(r, "non-stream c=64", "nginx_requests_per_s_ratio"),
        ),
        Target(
            # In the event loop's thread, where the overhead histograms and the lag probe run,
            # counted in ns (processes.cpu_seconds): the all-threads ticks cannot resolve 2%.
            "event-loop CPU per stream, overhead metrics on / off",
            "selfcost",
            "x",
            1.02,
            True,
            lambda r: ratio(
                r["stream c=64", "infertap"]["main_thread_cpu_ms_per_request"],
                r["stream c=64", "infertap, overhead metrics off"]["main_thread_cpu_ms_per_request"],
            ),
        ),
        Target(
            # The span work per request, in the event loop's thread; the exporter's thread
            # (batching and encoding the spans) is in the all-threads CPU column, and its note.
            "event-loop CPU per request, tracing on / off",
            "tracing",
            "x",
            1.2,
            True,
            lambda r: ratio(
                r["stream c=64", "infertap+tracing"]["main_thread_cpu_ms_per_request"],
                r["stream c=64", "infertap"]["main_thread_cpu_ms_per_request"],
            ),
        ),
        Target(
            "infertap RSS with every stream open",
            "memory",
            "MB",
            300,
            True,
            lambda r: next(row["held_rss_mb"] for (_, t), row in r.items() if t == "infertap"),
            strict=True,
        ),
    ]
