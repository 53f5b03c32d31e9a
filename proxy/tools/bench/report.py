"""The rows of `infertap bench`: its numbers, per round and reduced over the rounds. The targets
judged on them are in targets.py, the tables that print them in tables.py.

A row is one (scenario, phase, target): what the load generator saw, and for a proxy target
the proxy's CPU and memory. Each round gives its own rows, compared with the direct and nginx rows
of the same round (by quantile: added TTFT p99 = p99 through the proxy minus p99 direct); a
reported row holds the median over the rounds of every number, and the spread (min, max) of the
ones that move most.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.tools.bench.loadgen import JobResult
from proxy.tools.probe.stats import percentile

DIRECT = "direct"
NGINX = "nginx"
VLLM_ROUTER = "vllm-router"  # vLLM's own router, round_robin to the one upstream


@dataclass
class Acc:
    """One row's measurements, accumulated over the rounds of a phase."""

    requests: int = 0
    ok: int = 0
    wall_s: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    cpu_s: float | None = None
    main_cpu_s: float | None = None  # the processes' first threads (the event loops) only
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, r: JobResult, cpu_s: float | None, main_cpu_s: float | None = None) -> None:
        self.requests += r.requests
        self.ok += r.ok
        self.wall_s += r.wall_s
        self.tokens += r.tokens
        self.ttft += r.ttft
        self.e2e += r.e2e
        self.gaps += r.gaps
        self.errors.update(r.errors)
        if cpu_s is not None:
            self.cpu_s = (self.cpu_s or 0.0) + cpu_s
        if main_cpu_s is not None:
            self.main_cpu_s = (self.main_cpu_s or 0.0) + main_cpu_s


def _ms(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": percentile(values, 50) * 1000, "p99": percentile(values, 99) * 1000}


def _diff(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float] | None:
    if a is None or b is None:
        return None
    return {q: a[q] - b[q] for q in ("p50", "p99")}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0 (a row that did not run, or no CPU read)."""
    return a / b if a is not None and b else None


def make_row(
    scenario: str,
    phase: str,
    target: str,
    acc: Acc,
    direct: dict[str, Any] | None,
    nginx: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rps = acc.ok / acc.wall_s if acc.wall_s > 0 else 0.0
    row: dict[str, Any] = {
        "scenario": scenario,
        "phase": phase,
        "target": target,
        "requests": acc.requests,
        "ok": acc.ok,
        "errors": sum(acc.errors.values()),
        "error_kinds": dict(acc.errors.most_common(5)),
        "wall_s": round(acc.wall_s, 3),
        "requests_per_s": rps,
        "tokens_per_s": acc.tokens / acc.wall_s if acc.wall_s > 0 else 0.0,
        "ttft_ms": _ms(acc.ttft),
        "e2e_ms": _ms(acc.e2e),
        "gap_ms": _ms(acc.gaps),
        "cpu_ms_per_request": acc.cpu_s * 1000 / acc.ok if acc.cpu_s is not None and acc.ok else None,
        "main_thread_cpu_ms_per_request": (
            acc.main_cpu_s * 1000 / acc.ok if acc.main_cpu_s is not None and acc.ok else None
        ),
        **acc.extra,
    }
    if direct is not None and target != DIRECT:
        row["added_ttft_ms"] = _diff(row["ttft_ms"], direct["ttft_ms"])
        row["added_e2e_ms"] = _diff(row["e2e_ms"], direct["e2e_ms"])
        row["added_gap_ms"] = _diff(row["gap_ms"], direct["gap_ms"])
        row["requests_per_s_ratio"] = ratio(rps, direct["requests_per_s"])
        row["tokens_per_s_ratio"] = ratio(row["tokens_per_s"], direct["tokens_per_s"])
    if nginx is not None and target not in (DIRECT, NGINX):
        row["nginx_requests_per_s_ratio"] = ratio(rps, nginx["requests_per_s"])
        row["nginx_cpu_ratio"] = ratio(row["cpu_ms_per_request"], nginx["cpu_ms_per_request"])
        row["added_ttft_vs_nginx_ms"] = _diff(row.get("added_ttft_ms"), nginx.get("added_ttft_ms"))
    return row


# The numbers whose spread over the rounds a table shows.
SPREAD = {
    "added_ttft_p99": ("added_ttft_ms", "p99"),
    "ttft_p99": ("ttft_ms", "p99"),
    "requests_per_s": ("requests_per_s", None),
    "cpu_ms_per_request": ("cpu_ms_per_request", None),
}


def _get(row: dict[str, Any], key: str, q: str | None) -> float | None:
    v = row.get(key)
    if q is not None:
        v = v.get(q) if isinstance(v, dict) else None
    return float(v) if isinstance(v, int | float) else None


def median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's rows from each round -> the reported row: counts summed, every other number
    the median over the rounds, and `spread`: {name: [min, max]} for SPREAD's numbers."""
    if len(rounds) == 1:
        row = dict(rounds[0])
    else:
        row = dict(rounds[-1])  # labels, and extras such as the held streams of the last round
        for key in ("requests", "ok", "errors"):
            row[key] = sum(r[key] for r in rounds)
        row["wall_s"] = round(sum(r["wall_s"] for r in rounds), 3)
        kinds: Counter[str] = Counter()
        for r in rounds:
            kinds.update(r["error_kinds"])
        row["error_kinds"] = dict(kinds.most_common(5))
        for key, v in rounds[0].items():
            if key in ("requests", "ok", "errors", "wall_s", "error_kinds"):
                continue
            if isinstance(v, dict) and set(v) == {"p50", "p99"}:
                row[key] = {q: _median([_get(r, key, q) for r in rounds]) for q in ("p50", "p99")}
            elif isinstance(v, int | float) and not isinstance(v, bool):
                row[key] = _median([_get(r, key, None) for r in rounds])
    row["rounds"] = len(rounds)
    spread: dict[str, list[float]] = {}
    for name, (key, q) in SPREAD.items():
        vals = [x for x in (_get(r, key, q) for r in rounds) if x is not None]
        if vals:
            spread[name] = [min(vals), max(vals)]
    row["spread"] = spread
    return row


def _median(vals: list[float | None]) -> float | None:
    xs = [v for v in vals if v is not None]
    return statistics.median(xs) if xs else None
