"""The rules of `infertap doctor`: the seed article's five faults, each judged from metrics.

Input: infertap's series (differences over a window, or totals since start), optionally the
engine's (vLLM names), and polls of the engine's gauges. Output: findings, each with a title,
the evidence in numbers, and the config knobs to change. How each rule decides, and what it
cannot see, is in docs/doctor.md.
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

FAULTS = ("kv_cache", "prefill_queueing", "context_length", "stream_cut", "looping")


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


@dataclass(slots=True)
class Finding:
    fault: str  # one of FAULTS
    title: str
    evidence: list[str]
    change: list[str]
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "title": self.title,
            "evidence": self.evidence,
            "change": self.change,
            "numbers": self.numbers,
        }


def fmt_s(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _q(h: Histogram | None, q: float) -> float | None:
    return None if h is None else h.quantile(q)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _kv_usage(poll: dict[str, float]) -> float | None:
    for name in E_KV_USAGE:
        if name in poll:
            return poll[name]
    return None


def _cache_blocks(engine: Samples | None) -> int | None:
    """num_gpu_blocks from the engine's cache_config_info, when it says."""
    if engine is None:
        return None
    for labels, _ in engine.series(E_CACHE_INFO):
        value = dict(labels).get("num_gpu_blocks", "")
        if value.isdigit():
            return int(value)
    return None


def _length_ratio(p: Samples) -> float | None:
    """Length-weighted TPOT over the per-request mean TPOT (docs/doctor.md, fault 1)."""
    tpot, itl = p.histogram(TPOT), p.histogram(ITL)
    if tpot is None or itl is None or not tpot.count or not itl.count or not tpot.mean or itl.mean is None:
        return None
    gaps_in_tokens = p.total(COMPLETION + "_sum") - tpot.count
    per_event = max(1.0, gaps_in_tokens / itl.count) if gaps_in_tokens > 0 else 1.0
    return itl.mean / per_event / tpot.mean


# -- fault 1 --------------------------------------------------------------------------------------
def kv_cache(inp: Inputs, th: Thresholds) -> Finding | None:
    p = inp.proxy
    tpot = p.histogram(TPOT)
    evidence: list[str] = []
    numbers: dict[str, Any] = {}
    fired = False
    # Σ decode time / Σ (tokens - 1) over streams: each stream weighted by its length. Above the
    # per-request mean TPOT exactly when longer answers decode slower per token.
    ratio = _length_ratio(p)
    if tpot is not None and tpot.mean and ratio is not None and tpot.count >= th.min_requests:
        weighted = ratio * tpot.mean
        numbers |= {"tpot_mean_s": _r(tpot.mean), "tpot_token_weighted_s": _r(weighted),
                    "length_ratio": _r(ratio, 3), "streams": int(tpot.count)}  # fmt: skip
        if ratio >= th.tpot_length_ratio:
            fired = True
            evidence.append(
                f"TPOT grows with answer length: weighted by length it is {fmt_s(weighted)}, "
                f"{ratio:.2f}x the per-request mean of {fmt_s(tpot.mean)} over {int(tpot.count)} streams "
                "(longer answers decode slower per token)"
            )
    blocks = _cache_blocks(inp.engine)
    if blocks == 0:
        fired = True
        numbers["engine_num_gpu_blocks"] = 0
        evidence.append(f'the engine reports no KV-cache blocks ({E_CACHE_INFO} num_gpu_blocks="0")')
    running = [poll for poll in inp.engine_polls if poll.get(E_RUNNING, 0) > 0]
    usage = [_kv_usage(poll) for poll in running]
    if running and all(u is not None and u <= 0 for u in usage):
        fired = True
        most = max(poll[E_RUNNING] for poll in running)
        numbers |= {"engine_kv_cache_usage": 0.0, "engine_running_max": most}
        evidence.append(
            f"the engine's KV cache usage stayed at 0% while up to {most:g} requests were running "
            f"({len(running)} engine scrape(s)): nothing is being cached"
        )
    if not fired:
        return None
    if tpot is not None:
        evidence.append(f"TPOT p50 {fmt_s(tpot.quantile(0.5))}, p90 {fmt_s(tpot.quantile(0.9))}")
    e_itl = inp.engine.histogram(E_ITL) if inp.engine is not None else None
    if e_itl is not None and e_itl.count > 0:
        evidence.append(
            f"engine inter-token latency p50 {fmt_s(e_itl.quantile(0.5))}, p90 {fmt_s(e_itl.quantile(0.9))}"
        )
    return Finding(
        "kv_cache",
        "KV cache apparently not in effect: TPOT is high and grows with the context",
        evidence,
        [
            "engine config: [kv_cache] enable = true (`infertap engine-args` prints your engine's flags)",
            'check the engine\'s start-up log for "KV cache enabled" and the number of KV blocks it got',
            "engines may drop the cache when memory is short: raise [model] gpu_memory_utilization "
            "(e.g. 0.90) or lower [model] max_model_len",
            "prove it: `infertap compare` the same requests against the engine with the cache on and off",
        ],
        numbers,
    )


# -- fault 2 --------------------------------------------------------------------------------------
def prefill_queueing(inp: Inputs, th: Thresholds) -> Finding | None:
    p = inp.proxy
    worst: tuple[float, str, float, float, int] | None = None
    for cls, n in p.by(TTFT + "_count", "prompt_class").items():
        if n < th.min_requests:
            continue
        h = p.histogram(TTFT, prompt_class=cls)
        p50, p90 = _q(h, 0.5), _q(h, 0.9)
        if p50 is None or p90 is None or p50 <= 0:
            continue
        if p90 - p50 >= th.ttft_spread_min_s and (worst is None or p90 / p50 > worst[0]):
            worst = (p90 / p50, cls, p50, p90, int(n))
    if worst is None or worst[0] < th.ttft_spread:
        return None
    spread, cls, p50, p90, n = worst
    evidence = [
        f"TTFT swings: p50 {fmt_s(p50)}, p90 {fmt_s(p90)} ({spread:.1f}x) for prompts of "
        f"{cls or '?'} tokens ({n} streams)"
    ]
    numbers: dict[str, Any] = {"ttft_p50_s": _r(p50), "ttft_p90_s": _r(p90), "prompt_class": cls}
    tpot = p.histogram(TPOT)
    if tpot is not None and tpot.count > 0:
        evidence.append(f"decode looks normal next to it: TPOT p50 {fmt_s(tpot.quantile(0.5))}")
    confirmed: bool | None = None
    if inp.engine is not None:
        waiting = [poll[E_WAITING] for poll in inp.engine_polls if E_WAITING in poll]
        running = [poll[E_RUNNING] for poll in inp.engine_polls if E_RUNNING in poll]
        queue, e_ttft = inp.engine.histogram(E_QUEUE), inp.engine.histogram(E_TTFT)
        q_mean = queue.mean if queue is not None else None
        share = _ratio(q_mean, e_ttft.mean if e_ttft is not None else None)
        if waiting or q_mean is not None:
            confirmed = False
        if waiting and max(waiting) > 0:
            confirmed = True
            numbers["engine_waiting_max"] = max(waiting)
            evidence.append(f"the engine had up to {max(waiting):g} requests waiting for a slot")
        if q_mean is not None and share is not None and q_mean >= th.queue_min_s and share >= th.queue_share:
            confirmed = True
            numbers |= {"engine_queue_mean_s": _r(q_mean), "engine_queue_share": _r(share, 3)}
            evidence.append(
                f"requests spent {fmt_s(q_mean)} on average queued in the engine, {_pct(share)} of its TTFT"
            )
        prefill = inp.engine.histogram(E_PREFILL)
        if confirmed and prefill is not None and prefill.mean is not None:
            evidence.append(f"the prefill itself took {fmt_s(prefill.mean)} on average")
        if confirmed and running and max(running) > 0:
            numbers["engine_running_max"] = max(running)
            evidence.append(
                f"at most {max(running):g} requests were running at once (max_num_seqs caps this)"
            )
    if confirmed is False:
        return None
    if confirmed is None:
        evidence.append("not confirmed by the engine: pass --engine-metrics to see its queue")
    numbers["engine_confirmed"] = confirmed
    return Finding(
        "prefill_queueing",
        "Prefill queueing: requests wait for a prefill slot, so TTFT swings under load",
        evidence,
        [
            "[batching] max_num_batched_tokens: raise it so more prompt tokens fit one step "
            "(vLLM --max-num-batched-tokens)",
            "[prefill] chunked_prefill = true so one long prompt does not hold up the others "
            "(vLLM --enable-chunked-prefill)",
            "[batching] max_num_seqs: raise it when running requests sit at the cap (vLLM --max-num-seqs)",
            "clients: reuse connections (a pooled, keep-alive HTTP client); new connections add latency",
        ],
        numbers,
    )


# -- fault 3 --------------------------------------------------------------------------------------
def context_length(inp: Inputs, th: Thresholds) -> Finding | None:
    p = inp.proxy
    outcomes = p.by(REQUESTS, "outcome")
    total = sum(outcomes.values())
    errors = outcomes.get("client_error", 0.0)
    evidence: list[str] = []
    numbers: dict[str, Any] = {}
    if total > 0 and errors >= 1 and errors / total >= th.error_share:
        numbers |= {"client_errors": int(errors), "requests": int(total)}
        evidence.append(
            f"{int(errors)} of {int(total)} requests ({_pct(errors / total)}) were refused by the upstream "
            "with a 4xx (outcome client_error); on chat completions the usual cause is a prompt over the "
            "engine's max_model_len (vLLM: 400 \"This model's maximum context length is ...\")"
        )
    if inp.engine is not None:
        preempted = inp.engine.total(E_PREEMPTIONS)
        finished = inp.engine.total(E_SUCCESS)
        if preempted >= 1 and preempted / max(finished, 1.0) >= th.preemption_share:
            numbers |= {"engine_preemptions": int(preempted), "engine_finished": int(finished)}
            evidence.append(
                f"the engine preempted {int(preempted)} times for {int(finished)} finished requests: "
                "it runs out of KV-cache blocks for the prompts it holds"
            )
    if not evidence:
        return None
    rejected = outcomes.get("rejected", 0.0)
    if rejected:
        evidence.append(f"infertap itself refused {int(rejected)} requests (too large or malformed)")
    prompts = p.histogram(PROMPT)
    if prompts is not None and prompts.count > 0:
        evidence.append(f"prompts that succeeded: p99 about {prompts.quantile(0.99) or 0:.0f} tokens")
    evidence.append("the upstream's message is in infertap's access log (field `error`)")
    return Finding(
        "context_length",
        "Prompts too long for the engine: refused over the context limit, or short of KV-cache room",
        evidence,
        [
            "[model] max_model_len: raise it if the model supports a longer context (vLLM --max-model-len), "
            "or shorten prompts on the client (trim history, summarise)",
            "[prefill] chunked_prefill = true and a lower max_prefill_tokens, so a long prompt prefills "
            "in chunks instead of one memory peak",
            "KV-cache room: raise [kv_cache] num_gpu_blocks, or balance [model] gpu_memory_utilization "
            "against the memory the prefill needs; fewer [batching] max_num_seqs also frees blocks",
        ],
        numbers,
    )


# -- fault 4 --------------------------------------------------------------------------------------
def stream_cut(inp: Inputs, th: Thresholds) -> Finding | None:
    p = inp.proxy
    outcomes = p.by(REQUESTS, "outcome")
    total = sum(outcomes.values())
    cut = {k: outcomes.get(k, 0.0) for k in CUT_OUTCOMES if outcomes.get(k, 0.0) > 0}
    evidence: list[str] = []
    numbers: dict[str, Any] = {}
    if total > 0 and sum(cut.values()) >= 1 and sum(cut.values()) / total >= th.error_share:
        numbers |= {k: int(v) for k, v in cut.items()} | {"requests": int(total)}
        parts = ", ".join(f"{int(v)} {k}" for k, v in cut.items())
        evidence.append(f"{int(sum(cut.values()))} of {int(total)} requests ended early: {parts}")
    itl, tpot = p.histogram(ITL), p.histogram(TPOT)
    if itl is not None and tpot is not None and itl.count >= 10 * th.min_requests:
        bunched = itl.share_at_most(th.bunched_gap_s)
        t50 = tpot.quantile(0.5)
        if bunched is not None and t50 is not None:
            if bunched >= th.bunched_share and t50 >= th.bunched_tpot_min_s:
                numbers |= {"itl_bunched_share": _r(bunched, 3), "tpot_p50_s": _r(t50)}
                evidence.append(
                    f"chunks arrive bunched: {_pct(bunched)} of token gaps are under "
                    f"{fmt_s(th.bunched_gap_s)} while TPOT p50 is {fmt_s(t50)}: something between "
                    "infertap and the engine buffers the stream"
                )
    if not evidence:
        return None
    return Finding(
        "stream_cut",
        "Streams cut off or held back: timeouts, broken connections or buffering",
        evidence,
        [
            "read timeout: raise infertap's [timeouts] idle and the client's read timeout (seed: 120 s) "
            "above the longest silence in a stream (a long prefill under load)",
            "a proxy in front of the engine must not buffer streams: nginx `proxy_buffering off;` "
            "(or `X-Accel-Buffering: no`, which infertap sends to its own clients)",
            "check the network path and the engine log at the times of the cuts (infertap's access log "
            "has each request's outcome and error)",
        ],
        numbers,
    )


# -- fault 5 --------------------------------------------------------------------------------------
def looping(inp: Inputs, th: Thresholds) -> Finding | None:
    p = inp.proxy
    flagged = p.total(DEGENERATE)
    if flagged < 1:
        return None
    ok = p.total(REQUESTS, outcome="ok")
    by_model = {m: v for m, v in p.by(DEGENERATE, "model").items() if v >= 1}
    models = ", ".join(f"{m}: {int(v)}" for m, v in sorted(by_model.items()))
    share = f" ({_pct(flagged / ok)} of successful requests)" if ok else ""
    return Finding(
        "looping",
        "Degenerate output: answers repeat the same phrase over and over",
        [f"{int(flagged)} answers flagged by loop detection{share}; by model: {models}"],
        [
            "[decode] temperature: greedy decoding (0) loops; sample instead (the seed uses 0.7)",
            "[decode] repetition_penalty: raise it above 1.0 (e.g. 1.05 to 1.2)",
            "this is a decoding-strategy problem, not a KV-cache one",
        ],
        {
            "degenerate": int(flagged),
            "ok_requests": int(ok),
            "by_model": {m: int(v) for m, v in by_model.items()},
        },
    )


RULES = (kv_cache, prefill_queueing, context_length, stream_cut, looping)
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
    ratio = _length_ratio(inp.proxy)
    if inp.engine is None and ratio is not None and 1.05 <= ratio < th.tpot_length_ratio:
        out.append(
            f"TPOT rises with answer length ({ratio:.2f}x, {th.tpot_length_ratio:g}x would be a finding): "
            "too little to call without the engine: point me at the engine's /metrics (--engine-metrics URL)"
        )
    return out


def diagnose(inp: Inputs, th: Thresholds | None = None) -> list[Finding]:
    th = th or Thresholds()
    return [f for rule in RULES if (f := rule(inp, th)) is not None]


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
                "p50": _r(h.quantile(0.5)),
                "p90": _r(h.quantile(0.9)),
                "mean": _r(h.mean),
            }  # fmt: skip
        )
    out["degenerate"] = int(p.total(DEGENERATE)) if p.has(DEGENERATE) else None
    if inp.engine is not None:
        e = inp.engine
        engine: dict[str, Any] = {}
        for key, name in (("ttft_s", E_TTFT), ("itl_s", E_ITL), ("queue_s", E_QUEUE)):
            h = e.histogram(name)
            engine[key] = (
                None if h is None or h.count <= 0 else {"p50": _r(h.quantile(0.5)), "mean": _r(h.mean)}
            )
        for key, gauge in (("waiting_max", E_WAITING), ("running_max", E_RUNNING)):
            seen = [poll[gauge] for poll in inp.engine_polls if gauge in poll]
            engine[key] = max(seen) if seen else None
        engine["preemptions"] = int(e.total(E_PREEMPTIONS)) if e.has(E_PREEMPTIONS) else None
        out["engine"] = engine
    return out
