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


def targets() -> list[Target]:
    """The budget of issue 17 (ratios to nginx where nginx ran: without it those read n/a), and the
    ones kept from issue 8. Keys are (phase, target)."""
    return [
        Target(
            "added TTFT p50, realistic c=1",
            "realistic",
            "ms",
            0.5,
            True,
            lambda r: _q(r["c=1", "infertap"], "added_ttft_ms", "p50"),
        ),
        Target(
            "CPU per paced stream, realistic c=1, x nginx",
            "realistic",
            "x",
            2.0,
            True,
            lambda r: _proxy(r, "c=1", "nginx_cpu_ratio"),
        ),
        Target(
            "added TTFT p99 minus nginx's, Poisson 60/s",
            "poisson",
            "ms",
            2.0,
            True,
            lambda r: _q(r["60/s", "infertap"], "added_ttft_vs_nginx_ms", "p99"),
        ),
        Target(
            "CPU per paced stream, Poisson 60/s, x nginx",
            "poisson",
            "x",
            2.0,
            True,
            lambda r: _proxy(r, "60/s", "nginx_cpu_ratio"),
        ),
        Target(
            "non-streaming zero-delay at c=64, x nginx req/s",
            "throughput",
            "x",
            0.75,
            False,
            lambda r: _proxy(r, "non-stream c=64", "nginx_requests_per_s_ratio"),
        ),
        Target(
            "proxy CPU per zero-delay stream",
            "throughput",
            "ms",
            0.6,
            True,
            lambda r: _proxy(r, "stream c=64", "cpu_ms_per_request"),
        ),
        Target(
            "CPU per stream, overhead metrics on / off",
            "selfcost",
            "x",
            1.02,
            True,
            lambda r: ratio(
                r["stream c=64", "infertap"]["cpu_ms_per_request"],
                r["stream c=64", "infertap, overhead metrics off"]["cpu_ms_per_request"],
            ),
        ),
        Target(
            "CPU per request, tracing on / off",
            "tracing",
            "x",
            1.2,
            True,
            lambda r: ratio(
                r["stream c=64", "infertap+tracing"]["cpu_ms_per_request"],
                r["stream c=64", "infertap"]["cpu_ms_per_request"],
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
