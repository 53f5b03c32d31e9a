"""Numbers, targets and tables of `infertap bench`.

A row is one (scenario, phase, target): what the load generator saw, and for a proxy target
the proxy's CPU and memory. Each round gives its own rows, compared with the direct and nginx rows
of the same round (by quantile: added TTFT p99 = p99 through the proxy minus p99 direct); a
reported row holds the median over the rounds of every number, and the spread (min, max) of the
ones that move most.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.tools.bench.loadgen import JobResult
from proxy.tools.probe.stats import percentile

DIRECT = "direct"
NGINX = "nginx"


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
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, r: JobResult, cpu_s: float | None) -> None:
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


def _ms(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": percentile(values, 50) * 1000, "p99": percentile(values, 99) * 1000}


def _diff(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float] | None:
    if a is None or b is None:
        return None
    return {q: a[q] - b[q] for q in ("p50", "p99")}


def _ratio(a: float | None, b: float | None) -> float | None:
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
        **acc.extra,
    }
    if direct is not None and target != DIRECT:
        row["added_ttft_ms"] = _diff(row["ttft_ms"], direct["ttft_ms"])
        row["added_e2e_ms"] = _diff(row["e2e_ms"], direct["e2e_ms"])
        row["added_gap_ms"] = _diff(row["gap_ms"], direct["gap_ms"])
        row["requests_per_s_ratio"] = _ratio(rps, direct["requests_per_s"])
        row["tokens_per_s_ratio"] = _ratio(row["tokens_per_s"], direct["tokens_per_s"])
    if nginx is not None and target not in (DIRECT, NGINX):
        row["nginx_requests_per_s_ratio"] = _ratio(rps, nginx["requests_per_s"])
        row["nginx_cpu_ratio"] = _ratio(row["cpu_ms_per_request"], nginx["cpu_ms_per_request"])
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


# --- targets -------------------------------------------------------------------------------------


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
            lambda r: _ratio(
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
            lambda r: _ratio(
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


# --- tables --------------------------------------------------------------------------------------

_COLUMNS = [
    "phase", "target", "ok/req", "err", "TTFT p50/p99", "+TTFT p50/p99", "+TTFT p99 range", "gap p50/p99",
    "+gap p99", "e2e p50/p99", "req/s", "x direct", "x nginx", "CPU ms/req", "CPU range", "CPU x nginx",
    "RSS MB now/peak",
]  # fmt: skip


def _pair(d: dict[str, float] | None, signed: bool = False) -> str:
    if d is None:
        return "-"
    f = "{:+.2f}" if signed else "{:.2f}"
    return f"{f.format(d['p50'])}/{f.format(d['p99'])}"


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _range(row: dict[str, Any], name: str, fmt: str) -> str:
    """min..max over the rounds (a single round has none)."""
    lo_hi = row.get("spread", {}).get(name)
    if lo_hi is None or row.get("rounds", 1) < 2:
        return "-"
    return f"{fmt.format(lo_hi[0])}..{fmt.format(lo_hi[1])}"


def _cells(row: dict[str, Any]) -> list[str]:
    rss = "-"
    if row.get("rss_mb") is not None:
        rss = f"{row['rss_mb']:.0f}/{row['peak_rss_mb']:.0f}"
        if row.get("held_rss_mb") is not None:
            rss = f"{row['held_rss_mb']:.0f} held, peak {row['peak_rss_mb']:.0f}"
    added_gap = row.get("added_gap_ms")
    return [
        row["phase"],
        row["target"],
        f"{row['ok']}/{row['requests']}",
        str(row["errors"]),
        _pair(row["ttft_ms"]),
        _pair(row.get("added_ttft_ms"), signed=True),
        _range(row, "added_ttft_p99", "{:+.2f}"),
        _pair(row["gap_ms"]),
        "-" if not added_gap else f"{added_gap['p99']:+.2f}",
        _pair(row["e2e_ms"]),
        _num(row["requests_per_s"]),
        _num(row.get("requests_per_s_ratio"), "{:.2f}"),
        _num(row.get("nginx_requests_per_s_ratio"), "{:.2f}"),
        _num(row.get("cpu_ms_per_request"), "{:.2f}"),
        _range(row, "cpu_ms_per_request", "{:.2f}"),
        _num(row.get("nginx_cpu_ratio"), "{:.2f}"),
        rss,
    ]


def _table(rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        out = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
        return out + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*_COLUMNS), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def _verdict(check: dict[str, Any]) -> str:
    return {True: "PASS", False: "MISS", None: "n/a"}[check["pass"]]


def render(report: dict[str, Any], markdown: bool) -> str:
    m = report["machine"]
    where = (
        f"upstream and load generator on CPU {m['harness_cpu']}, infertap on CPU {m['proxy_cpu']}"
        if m["proxy_cpu"] is not None
        else "not pinned"
    )
    lines = [
        f"machine: {m['cpu_model'] or 'unknown CPU'}, {m['cpus']} CPUs, Linux {m['kernel']}, "
        f"Python {m['python']}, infertap {m['infertap']}; {where}",
        "",
    ]
    h = "### " if markdown else "== "
    for name, sc in report["scenarios"].items():
        lines += [f"{h}{name}: {sc['title']}", ""]
        lines += _table([_cells(r) for r in sc["rows"]], markdown)
        if sc["notes"] and markdown:
            lines.append("")  # a list right under a table would not end it everywhere
        for note in sc["notes"]:
            lines.append(f"{'- ' if markdown else '  note: '}{note}")
        checks = [c for c in report["checks"] if c["scenario"] == name]
        if checks:
            lines.append("")
        for c in checks:
            v = "-" if c["value"] is None else f"{c['value']:.2f}"
            bullet = "- " if markdown else "  "
            lines.append(f"{bullet}{_verdict(c)}  {c['name']}: {v} (target {c['target']})")
        lines.append("")
    lines.append(
        "Times in ms; +X is the proxy minus direct, quantile by quantile; gap = inter-token gap at the "
        "client; x direct, x nginx = req/s ratios; CPU = the proxy's utime+stime per completed request; "
        "each number is the median over the rounds (target order rotating), range = min..max over them. "
        "Under contention the direct row's own p99 rises: read the rows against it."
    )
    if report.get("quick"):
        lines.append("--quick: tiny counts, the verdicts are indicative only.")
    for note in report["machine"]["notes"]:
        lines.append(f"{'- ' if markdown else 'note: '}{note}")
    return "\n".join(lines)
