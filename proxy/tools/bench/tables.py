"""The tables of `infertap bench`: the report (machine, rows, notes, target verdicts) as text or
Markdown. The rows and the verdicts are computed in report.py and targets.py.
"""

from __future__ import annotations

from typing import Any

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


_FLEET_COLUMNS = [
    "workload", "target", "ok/req", "err", "prefix-cache hit rate", "hit range", "TTFT p50/p95/p99",
    "p50 range", "load max/mean", "requests per replica",
]  # fmt: skip


def _fleet_cells(row: dict[str, Any]) -> list[str]:
    t = row["ttft_ms"]
    spread = row.get("spread", {}) if row.get("rounds", 1) > 1 else {}
    hits, p50 = spread.get("hit_rate"), spread.get("ttft_p50")
    return [
        row["phase"],
        row["target"],
        f"{row['ok']}/{row['requests']}",
        str(row["errors"]),
        _num(row["hit_rate"], "{:.2f}"),
        "-" if not hits else f"{hits[0]:.2f}..{hits[1]:.2f}",
        "-" if not t else f"{t['p50']:.0f}/{t['p95']:.0f}/{t['p99']:.0f}",
        "-" if not p50 else f"{p50[0]:.0f}..{p50[1]:.0f}",
        _num(row["load_max_over_mean"], "{:.2f}"),
        " ".join(_num(v) for v in row["load"]),
    ]


def _table(rows: list[list[str]], markdown: bool, columns: list[str] = _COLUMNS) -> list[str]:
    if markdown:
        out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return out + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*columns), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


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
        f"Python {m['python']}, infertap {m['infertap']} (hot path: {m.get('hot_path', 'unknown')}); {where}",
        "",
    ]
    h = "### " if markdown else "== "
    for name, sc in report["scenarios"].items():
        lines += [f"{h}{name}: {sc['title']}", ""]
        if sc.get("kind") == "fleet":
            lines += _table([_fleet_cells(r) for r in sc["rows"]], markdown, _FLEET_COLUMNS)
        else:
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
    if any(sc.get("kind") == "fleet" for sc in report["scenarios"].values()):
        lines.append(
            "fleet: hit rate = the sims' vllm:prefix_cache_hits_total / queries_total over the row's run; "
            "TTFT in ms at the client; load = requests each sim finished, max / mean; medians over rounds."
        )
    if all(sc.get("kind") == "fleet" for sc in report["scenarios"].values()):
        return "\n".join(lines + [f"{'- ' if markdown else 'note: '}{n}" for n in report["machine"]["notes"]])
    lines.append(
        "Times in ms; +X is the proxy minus direct, quantile by quantile; gap = inter-token gap at the "
        "client; x direct, x nginx = req/s ratios; CPU = the proxy's CPU time (all its processes and "
        "threads, in ns where Linux counts it) per completed request; "
        "each number is the median over the rounds (target order rotating), range = min..max over them. "
        "Under contention the direct row's own p99 rises: read the rows against it."
    )
    if report.get("quick"):
        lines.append("--quick: tiny counts, the verdicts are indicative only.")
    for note in report["machine"]["notes"]:
        lines.append(f"{'- ' if markdown else 'note: '}{note}")
    return "\n".join(lines)
