"""What `infertap doctor` judges from: the metric names, the inputs, the thresholds, and the
measures derived from them; whether the evidence is enough for a verdict, and the traffic summary.

The rules that turn this evidence into findings are in rules.py; docs/doctor.md has the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.tools.doctor.exposition import Histogram, Samples

REQUESTS = "infertap_requests_total"
TTFT = "infertap_time_to_first_token_seconds"
ITL = "infertap_inter_token_latency_seconds"
TPOT = "infertap_time_per_output_token_seconds"
COMPLETION = "infertap_request_completion_tokens"
PROMPT = "infertap_request_prompt_tokens"
DEGENERATE = "infertap_degenerate_responses_total"
E_TTFT = "vllm:time_to_first_token_seconds"
E_ITL = "vllm:inter_token_latency_seconds"
E_QUEUE = "vllm:request_queue_time_seconds"
E_PREFILL = "vllm:request_prefill_time_seconds"
E_PREEMPTIONS = "vllm:num_preemptions_total"
E_SUCCESS = "vllm:request_success_total"
E_WAITING = "vllm:num_requests_waiting"
E_RUNNING = "vllm:num_requests_running"
E_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, pre-0.10 name
E_CACHE_INFO = "vllm:cache_config_info"
ENGINE_GAUGES = (E_WAITING, E_RUNNING, *E_KV_USAGE)
CUT_OUTCOMES = ("stream_interrupted", "idle_timeout", "total_timeout")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a rule fires. The defaults are documented in docs/doctor.md."""

    min_requests: int = 5  # fewer streams than this: no verdict on a distribution
    tpot_length_ratio: float = 1.2  # token-weighted TPOT / per-request mean TPOT
    ttft_spread: float = 1.5  # TTFT p90/p50 within one prompt class
    ttft_spread_min_s: float = 0.1  # and p90 - p50 at least this
    queue_share: float = 0.25  # engine mean queue time / engine mean TTFT
    queue_min_s: float = 0.05  # and the mean queue time at least this
    error_share: float = 0.01  # client errors, cut streams: share of all requests
    preemption_share: float = 0.01  # engine preemptions per finished request
    bunched_gap_s: float = 0.001  # gaps up to this are "arrived together"
    bunched_share: float = 0.5  # share of ITL gaps that arrived together
    bunched_tpot_min_s: float = 0.005  # while the median TPOT is at least this


@dataclass(slots=True)
class Inputs:
    proxy: Samples
    engine: Samples | None = None
    engine_polls: list[dict[str, float]] = field(default_factory=list)  # engine gauges, per poll


# Formatting and None-safe arithmetic, shared by the rules, needs() and the CLI's report.
def fmt_s(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def rnd(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def quantile_of(h: Histogram | None, q: float) -> float | None:
    return None if h is None else h.quantile(q)


def safe_ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


# Measures derived from the series, for the rules and for needs().
def kv_usage(poll: dict[str, float]) -> float | None:
    for name in E_KV_USAGE:
        if name in poll:
            return poll[name]
    return None


def cache_blocks(engine: Samples | None) -> int | None:
    """num_gpu_blocks from the engine's cache_config_info, when it says."""
    if engine is None:
        return None
    for labels, _ in engine.series(E_CACHE_INFO):
        value = dict(labels).get("num_gpu_blocks", "")
        if value.isdigit():
            return int(value)
    return None


def length_ratio(p: Samples) -> float | None:
    """Length-weighted TPOT over the per-request mean TPOT (docs/doctor.md, fault 1)."""
    tpot, itl = p.histogram(TPOT), p.histogram(ITL)
    if tpot is None or itl is None or not tpot.count or not itl.count or not tpot.mean or itl.mean is None:
        return None
    gaps_in_tokens = p.total(COMPLETION + "_sum") - tpot.count
    per_event = max(1.0, gaps_in_tokens / itl.count) if gaps_in_tokens > 0 else 1.0
    return itl.mean / per_event / tpot.mean


SAMPLE_MORE_S = 30  # what to ask for when there are too few streams


def needs(inp: Inputs, th: Thresholds) -> list[str]:
    """What doctor lacks to call the metrics healthy: empty when the evidence is enough."""
    out: list[str] = []
    ttft = inp.proxy.histogram(TTFT)
    streams = int(ttft.count) if ttft is not None else 0
    if streams < th.min_requests:
        out.append(
            f"too little traffic to judge: {streams} stream(s), at least {th.min_requests} needed; "
            f"sample for {SAMPLE_MORE_S} s more while traffic flows "
            f"(`infertap doctor --interval {SAMPLE_MORE_S}`)"
        )
    ratio = length_ratio(inp.proxy)
    if inp.engine is None and ratio is not None and 1.05 <= ratio < th.tpot_length_ratio:
        out.append(
            f"TPOT rises with answer length ({ratio:.2f}x, {th.tpot_length_ratio:g}x would be a finding): "
            "too little to call without the engine: point me at the engine's /metrics (--engine-metrics URL)"
        )
    return out


def summary(inp: Inputs) -> dict[str, Any]:
    """Traffic in the window: request outcomes and the latency quantiles, for the report."""
    p = inp.proxy
    outcomes = {k: int(v) for k, v in sorted(p.by(REQUESTS, "outcome").items()) if v}
    out: dict[str, Any] = {"requests": sum(outcomes.values()), "outcomes": outcomes}
    for key, name in (("ttft_s", TTFT), ("tpot_s", TPOT), ("itl_s", ITL)):
        h = p.histogram(name)
        out[key] = (
            None
            if h is None or h.count <= 0
            else {
                "count": int(h.count),
                "p50": rnd(h.quantile(0.5)),
                "p90": rnd(h.quantile(0.9)),
                "mean": rnd(h.mean),
            }  # fmt: skip
        )
    out["degenerate"] = int(p.total(DEGENERATE)) if p.has(DEGENERATE) else None
    if inp.engine is not None:
        e = inp.engine
        engine: dict[str, Any] = {}
        for key, name in (("ttft_s", E_TTFT), ("itl_s", E_ITL), ("queue_s", E_QUEUE)):
            h = e.histogram(name)
            engine[key] = (
                None if h is None or h.count <= 0 else {"p50": rnd(h.quantile(0.5)), "mean": rnd(h.mean)}
            )
        for key, gauge in (("waiting_max", E_WAITING), ("running_max", E_RUNNING)):
            seen = [poll[gauge] for poll in inp.engine_polls if gauge in poll]
            engine[key] = max(seen) if seen else None
        engine["preemptions"] = int(e.total(E_PREEMPTIONS)) if e.has(E_PREEMPTIONS) else None
        out["engine"] = engine
    return out
