"""The rules of `infertap doctor`: the seed article's five faults, each judged from metrics.

Input: infertap's series (differences over a window, or totals since start), optionally the
engine's (vLLM names), and polls of the engine's gauges; their names, the thresholds and the
derived measures are in evidence.py. Output: findings, each with a title, the evidence in
numbers, and the config knobs to change. How each rule decides, and what it cannot see, is in
docs/doctor.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.tools.doctor.evidence import (
    CUT_OUTCOMES,
    DEGENERATE,
    E_CACHE_INFO,
    E_ITL,
    E_PREEMPTIONS,
    E_PREFILL,
    E_QUEUE,
    E_RUNNING,
    E_SUCCESS,
    E_TTFT,
    E_WAITING,
    ITL,
    PROMPT,
    REQUESTS,
    TPOT,
    TTFT,
    Inputs,
    Thresholds,
    cache_blocks,
    fmt_s,
    kv_usage,
    length_ratio,
    pct,
    quantile_of,
    rnd,
    safe_ratio,
)

FAULTS = ("kv_cache", "prefill_queueing", "context_length", "stream_cut", "looping")


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


# -- fault 1 --------------------------------------------------------------------------------------
def kv_cache(inp: Inputs, th: Thresholds) -> Finding | None:
    p = inp.proxy
    tpot = p.histogram(TPOT)
    evidence: list[str] = []
    numbers: dict[str, Any] = {}
    fired = False
    # Σ decode time / Σ (tokens - 1) over streams: each stream weighted by its length. Above the
    # per-request mean TPOT exactly when longer answers decode slower per token.
    ratio = length_ratio(p)
    if tpot is not None and tpot.mean and ratio is not None and tpot.count >= th.min_requests:
        weighted = ratio * tpot.mean
        numbers |= {"tpot_mean_s": rnd(tpot.mean), "tpot_token_weighted_s": rnd(weighted),
                    "length_ratio": rnd(ratio, 3), "streams": int(tpot.count)}  # fmt: skip
        if ratio >= th.tpot_length_ratio:
            fired = True
            evidence.append(
                f"TPOT grows with answer length: weighted by length it is {fmt_s(weighted)}, "
                f"{ratio:.2f}x the per-request mean of {fmt_s(tpot.mean)} over {int(tpot.count)} streams "
                "(longer answers decode slower per token)"
            )
    blocks = cache_blocks(inp.engine)
    if blocks == 0:
        fired = True
        numbers["engine_num_gpu_blocks"] = 0
        evidence.append(f'the engine reports no KV-cache blocks ({E_CACHE_INFO} num_gpu_blocks="0")')
    running = [poll for poll in inp.engine_polls if poll.get(E_RUNNING, 0) > 0]
    usage = [kv_usage(poll) for poll in running]
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
        p50, p90 = quantile_of(h, 0.5), quantile_of(h, 0.9)
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
    numbers: dict[str, Any] = {"ttft_p50_s": rnd(p50), "ttft_p90_s": rnd(p90), "prompt_class": cls}
    tpot = p.histogram(TPOT)
    if tpot is not None and tpot.count > 0:
        evidence.append(f"decode looks normal next to it: TPOT p50 {fmt_s(tpot.quantile(0.5))}")
    confirmed: bool | None = None
    if inp.engine is not None:
        waiting = [poll[E_WAITING] for poll in inp.engine_polls if E_WAITING in poll]
        running = [poll[E_RUNNING] for poll in inp.engine_polls if E_RUNNING in poll]
        queue, e_ttft = inp.engine.histogram(E_QUEUE), inp.engine.histogram(E_TTFT)
        q_mean = queue.mean if queue is not None else None
        share = safe_ratio(q_mean, e_ttft.mean if e_ttft is not None else None)
        if waiting or q_mean is not None:
            confirmed = False
        if waiting and max(waiting) > 0:
            confirmed = True
            numbers["engine_waiting_max"] = max(waiting)
            evidence.append(f"the engine had up to {max(waiting):g} requests waiting for a slot")
        if q_mean is not None and share is not None and q_mean >= th.queue_min_s and share >= th.queue_share:
            confirmed = True
            numbers |= {"engine_queue_mean_s": rnd(q_mean), "engine_queue_share": rnd(share, 3)}
            evidence.append(
                f"requests spent {fmt_s(q_mean)} on average queued in the engine, {pct(share)} of its TTFT"
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
            f"{int(errors)} of {int(total)} requests ({pct(errors / total)}) were refused by the upstream "
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
                numbers |= {"itl_bunched_share": rnd(bunched, 3), "tpot_p50_s": rnd(t50)}
                evidence.append(
                    f"chunks arrive bunched: {pct(bunched)} of token gaps are under "
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
    share = f" ({pct(flagged / ok)} of successful requests)" if ok else ""
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


def diagnose(inp: Inputs, th: Thresholds | None = None) -> list[Finding]:
    th = th or Thresholds()
    return [f for rule in RULES if (f := rule(inp, th)) is not None]
