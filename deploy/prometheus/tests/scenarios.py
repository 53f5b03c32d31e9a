"""Traffic scenarios for the promtool rule tests; `python deploy/generate.py` writes *.test.yml from them.

A scenario is a function from a step (one scrape interval) to the traffic of that step: per prompt class
the requests that got a first token and their TTFT, TPOT, failed requests by outcome, timeouts by phase,
and the two up gauges. `series()` turns it into exactly the series infertap would expose (same names and
labels as deploy/metric_names.txt), in promtool's expanding notation. Every test asserts on EVERY alert:
the one a fire scenario is about must fire with its exact labels and annotations, and no alert may fire
in the silent scenarios (steady, low traffic, a weekly pattern, prompts getting longer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODEL, UPSTREAM, JOB = "llama-3.1-8b", "vllm", "infertap"
INSTANCES = ("infertap-0:8080", "infertap-1:8080")
TTFT_LE = (0.25, 0.5, 1.0, 2.0, 3.0, math.inf)
TPOT_LE = (0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, math.inf)
# mean prompt tokens of a class's requests, unless a step says otherwise
PROMPT_TOKENS = {"<1k": 500, "1k-4k": 1500, "4k-16k": 8000, ">16k": 20000}
MIN, HOUR, DAY = 60, 3600, 86400


@dataclass
class Step:
    # prompt_class -> (requests per second, TTFT seconds[, mean prompt tokens])
    classes: dict[str, tuple[float, ...]]
    tpot: float = 0.03
    failed: dict[str, float] = field(default_factory=dict)  # outcome -> share of all requests
    timeouts: dict[str, float] = field(default_factory=dict)  # phase -> share of attempts
    rejected: float = (
        0.0  # client mistakes per second: {model="none", outcome="rejected"}, as infertap counts them
    )
    upstream_up: int = 1
    proxy_up: tuple[int, ...] = (1, 1)  # per instance in INSTANCES; () = nobody scrapes infertap


Scenario = Callable[[int], Step]  # seconds since the start -> traffic


def le_str(le: float) -> str:
    """prometheus_client's spelling of a bucket bound (1.0 -> "1.0", inf -> "+Inf")."""
    return "+Inf" if le == math.inf else repr(float(le))


def fmt(v: float) -> str:
    return format(round(v, 6), ".10g")


def counter(incs: list[float]) -> str:
    """A counter that starts at 0 and grows by incs[i] at step i+1, in expanding notation."""
    parts, value, i = [], 0.0, 0
    while i < len(incs):
        j = i
        while j + 1 < len(incs) and incs[j + 1] == incs[i]:
            j += 1
        n = j - i + 1
        if i == 0:
            parts.append(f"0+{fmt(incs[i])}x{n}")
        else:
            parts.append(f"{fmt(value + incs[i])}+{fmt(incs[i])}x{n - 1}")
        value += incs[i] * n
        i = j + 1
    return " ".join(parts)


def gauge(values: list[float]) -> str:
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        parts.append(f"{fmt(values[i])}+0x{j - i}")
        i = j + 1
    return " ".join(parts)


def labels(name: str, **kv: str) -> str:
    """A series as Prometheus stores infertap's: with the job and instance of its scrape."""
    kv = {"job": JOB, "instance": INSTANCES[0], **kv}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in kv.items()) + "}"


def series(scenario: Scenario, interval: int, duration: int) -> list[dict[str, str]]:
    steps = [scenario(t) for t in range(interval, duration + interval, interval)]
    first = scenario(0)
    acc: dict[str, list[float]] = {}

    def add(key: str, i: int, v: float) -> None:
        acc.setdefault(key, [0.0] * len(steps))[i] += v

    classes = sorted({c for s in steps for c in s.classes})
    outcomes = sorted({o for s in steps for o in s.failed} | {"ok"})
    phases = sorted({p for s in steps for p in s.timeouts})
    req = dict(route="chat.completions", model=MODEL, upstream=UPSTREAM, stream="true")
    for i, s in enumerate(steps):
        served = {c: v[0] * interval for c, v in s.classes.items()} if any(s.proxy_up) else {}
        total = sum(served.values())
        n_failed = {o: share * total for o, share in s.failed.items()}
        # Requests that failed before the first token got no TTFT; stream_interrupted ones did.
        no_token = sum(v for o, v in n_failed.items() if o != "stream_interrupted")
        ok_share = 1 - sum(n_failed.values()) / total if total else 0.0
        prompt_sum = 0.0
        for c in classes:
            n = served.get(c, 0.0) * (1 - no_token / total) if total else 0.0
            ttft = s.classes.get(c, (0.0, 0.0))[1]
            tokens = s.classes[c][2] if len(s.classes.get(c, ())) > 2 else PROMPT_TOKENS[c]
            prompt_sum += served.get(c, 0.0) * ok_share * tokens
            add(
                labels(
                    "infertap_time_to_first_token_seconds_sum", model=MODEL, upstream=UPSTREAM, prompt_class=c
                ),
                i,
                n * ttft,
            )
            for le in TTFT_LE:
                add(
                    labels(
                        "infertap_time_to_first_token_seconds_bucket",
                        model=MODEL,
                        upstream=UPSTREAM,
                        prompt_class=c,
                        le=le_str(le),
                    ),
                    i,
                    n if ttft <= le else 0.0,
                )
            add(
                labels(
                    "infertap_time_to_first_token_seconds_count",
                    model=MODEL,
                    upstream=UPSTREAM,
                    prompt_class=c,
                ),
                i,
                n,
            )
        for le in TPOT_LE:
            add(
                labels(
                    "infertap_time_per_output_token_seconds_bucket",
                    model=MODEL,
                    upstream=UPSTREAM,
                    le=le_str(le),
                ),
                i,
                (total - no_token) if s.tpot <= le else 0.0,
            )
        add(
            labels("infertap_time_per_output_token_seconds_count", model=MODEL, upstream=UPSTREAM),
            i,
            total - no_token,
        )
        add(labels("infertap_request_prompt_tokens_sum", model=MODEL, upstream=UPSTREAM), i, prompt_sum)
        add(
            labels("infertap_request_prompt_tokens_count", model=MODEL, upstream=UPSTREAM),
            i,
            total * ok_share,
        )
        for o in outcomes:
            n = total - sum(n_failed.values()) if o == "ok" else n_failed.get(o, 0.0)
            add(labels("infertap_requests_total", **req, outcome=o), i, n)
        bad = dict(
            route="chat.completions", model="none", upstream="none", stream="false", outcome="rejected"
        )
        add(labels("infertap_requests_total", **bad), i, s.rejected * interval if any(s.proxy_up) else 0.0)
        n_timeouts = {p: share * total for p, share in s.timeouts.items()}
        for p in phases:
            add(labels("infertap_timeouts_total", upstream=UPSTREAM, phase=p), i, n_timeouts.get(p, 0.0))
        add(
            labels("infertap_upstream_attempts_total", upstream=UPSTREAM, result="ok"),
            i,
            total - sum(n_failed.values()),
        )
        add(
            labels("infertap_upstream_attempts_total", upstream=UPSTREAM, result="error"),
            i,
            sum(n_failed.values()),
        )
    out = [{"series": k, "values": counter(v)} for k, v in acc.items()]
    out.append(
        {
            "series": labels("infertap_upstream_up", upstream=UPSTREAM),
            "values": gauge([first.upstream_up] + [s.upstream_up for s in steps]),
        }
    )
    for n, instance in enumerate(INSTANCES if first.proxy_up else ()):
        out.append(
            {
                "series": labels("up", instance=instance),
                "values": gauge([first.proxy_up[n]] + [s.proxy_up[n] for s in steps]),
            }
        )
    return out


# --- the scenarios ------------------------------------------------------------------------------------


def steady(t: int) -> Step:
    return Step({"<1k": (1.0, 0.75), "1k-4k": (0.3, 1.5)})


def low_traffic(t: int) -> Step:
    """0.01 req/s (under the 3/min floor), and in the last hour everything goes bad."""
    bad = t > 8 * DAY - HOUR
    return Step(
        {"<1k": (0.01, 2.5 if bad else 0.75)},
        tpot=0.09 if bad else 0.03,
        failed={"upstream_error": 0.2, "stream_interrupted": 0.2} if bad else {},
        timeouts={"ttft": 0.2} if bad else {},
    )


def weekly_pattern(t: int) -> Step:
    """No traffic at night; every day a 3x evening peak; on day 0 and day 7 (the same weekday) the peak
    is slow: TTFT and TPOT double from 18:00 to 21:00. Today is slower than yesterday but like last week."""
    day, hour = divmod(t, DAY)
    hour //= HOUR
    if hour < 6:
        return Step({})
    peak = 18 <= hour < 21
    slow = peak and day % 7 == 0
    rps = 3.0 if peak else 1.0
    return Step({"<1k": (rps, 1.5 if slow else 0.75), "4k-16k": (rps / 10, 1.5)}, tpot=0.09 if slow else 0.03)


def longer_prompts(t: int) -> Step:
    """Two hours ago traffic moved from <1k prompts to 4k-16k prompts, each class as fast as before:
    the overall p95 TTFT quadruples, no class regressed."""
    if t > 8 * DAY - 2 * HOUR:
        return Step({"<1k": (0.02, 0.375), "4k-16k": (1.0, 1.5)})
    return Step({"<1k": (1.0, 0.375), "4k-16k": (0.02, 1.5)})


def longer_prompts_within_class(t: int) -> Step:
    """Two hours ago every 1k-4k prompt doubled (1500 -> 3000 tokens) and its TTFT with it (prefill is
    per token): that class's p95 doubles, but prefill is as fast per prompt token as before."""
    if t > 8 * DAY - 2 * HOUR:
        return Step({"<1k": (1.0, 0.375), "1k-4k": (0.5, 1.2, 3000)})
    return Step({"<1k": (1.0, 0.375), "1k-4k": (0.5, 0.6, 1500)})


def fast_decode_slower(t: int) -> Step:
    """TPOT 4 ms -> 7 ms: 1.75x, and still faster than anyone reads (under the 25 ms floor)."""
    return Step({"<1k": (1.0, 0.75)}, tpot=0.007 if t > 8 * DAY - HOUR else 0.004)


def ttft_regression(t: int) -> Step:
    slow = t > 8 * DAY - HOUR
    return Step({"<1k": (1.0, 1.5 if slow else 0.75), "1k-4k": (0.3, 1.5)})


def tpot_regression(t: int) -> Step:
    return Step({"<1k": (1.0, 0.75)}, tpot=0.09 if t > 8 * DAY - HOUR else 0.03)


def no_traffic(t: int) -> Step:
    return Step({} if t > 8 * DAY - 90 * MIN else {"<1k": (1.0, 0.75)})


def slo_fast_burn(t: int) -> Step:
    """From 1.5 h on, half the requests wait 2.5 s for their first token."""
    if t > 90 * MIN:
        return Step({"<1k": (0.5, 0.75), "4k-16k": (0.5, 2.5)})
    return Step({"<1k": (0.5, 0.75), "4k-16k": (0.5, 0.75)})


def slo_slow_burn(t: int) -> Step:
    """For the last 18 hours of 2 days, 5% of requests miss 2 s: too slow for a page, worth a ticket."""
    if t > 2 * DAY - 18 * HOUR:
        return Step({"<1k": (0.95, 0.75), "4k-16k": (0.05, 2.5)})
    return Step({"<1k": (0.95, 0.75), "4k-16k": (0.05, 0.75)})


def errors(t: int) -> Step:
    return Step({"<1k": (1.0, 0.75)}, failed={"upstream_error": 0.1} if t > 45 * MIN else {})


def timeouts(t: int) -> Step:
    bad = t > 40 * MIN
    return Step(
        {"<1k": (1.0, 0.75)},
        failed={"ttft_timeout": 0.04} if bad else {},
        timeouts={"ttft": 0.04} if bad else {},
    )


def interrupted(t: int) -> Step:
    return Step({"<1k": (1.0, 0.75)}, failed={"stream_interrupted": 0.03} if t > 40 * MIN else {})


def upstream_down(t: int) -> Step:
    return Step({"<1k": (1.0, 0.75)}, upstream_up=0 if t > 55 * MIN else 1)


def client_mistakes(t: int) -> Step:
    """One bad request (no model: rejected) for every ten good ones: not an outage, not a ticket."""
    return Step({"<1k": (1.0, 0.75)}, rejected=0.1)


def bad_client(t: int) -> Step:
    """From 30 minutes on a client sends one bad request for every two good ones."""
    return Step({"<1k": (1.0, 0.75)}, rejected=0.5 if t > 30 * MIN else 0.0)


def one_proxy_down(t: int) -> Step:
    return Step({"<1k": (1.0, 0.75)}, proxy_up=(0, 1) if t > 55 * MIN else (1, 1))


def proxy_down(t: int) -> Step:
    down = t > 55 * MIN
    return Step({} if down else {"<1k": (1.0, 0.75)}, proxy_up=(0, 0) if down else (1, 1))


def not_scraped(t: int) -> Step:
    return Step({}, proxy_up=())


SEV = {
    "InfertapTTFTRegression": "warning",
    "InfertapTPOTRegression": "warning",
    "InfertapTTFTSLOBurnRateFast": "critical",
    "InfertapTTFTSLOBurnRateSlow": "warning",
    "InfertapHighErrorRatio": "critical",
    "InfertapHighTimeoutRate": "warning",
    "InfertapStreamsInterrupted": "warning",
    "InfertapUpstreamDown": "critical",
    "InfertapProxyDown": "warning",
    "InfertapAllProxiesDown": "critical",
    "InfertapNotScraped": "warning",
    "InfertapNoTraffic": "warning",
    "InfertapClientErrors": "warning",
}

# file -> (sample interval s, rule evaluation interval s, duration s,
#          [(name, scenario, eval times s, {alert: [labels of each firing alert]})])
# The 8-day files evaluate the rules every 30 minutes and the SLO file every 5 minutes: promtool evaluates
# every rule at every step from 0, and a finer grid only makes the tests slower (every `for:` is met).
SILENT_EVALS = [7 * DAY + 20 * HOUR + 30 * MIN, 7 * DAY + 3 * HOUR, 8 * DAY]
FILES: dict[
    str, tuple[int, int, int, list[tuple[str, Scenario, list[int], dict[str, list[dict[str, str]]]]]]
] = {
    "silent.test.yml": (
        5 * MIN,
        30 * MIN,
        8 * DAY,
        [
            ("steady traffic", steady, SILENT_EVALS, {}),
            ("low traffic that goes bad", low_traffic, SILENT_EVALS, {}),
            ("the same weekly pattern as last week", weekly_pattern, SILENT_EVALS, {}),
            ("prompts getting longer", longer_prompts, SILENT_EVALS, {}),
        ],
    ),
    "baselines.test.yml": (
        5 * MIN,
        30 * MIN,
        8 * DAY,
        [
            (
                "TTFT regression in one prompt class",
                ttft_regression,
                [8 * DAY],
                {"InfertapTTFTRegression": [{"model": MODEL, "upstream": UPSTREAM, "prompt_class": "<1k"}]},
            ),
            (
                "TPOT regression",
                tpot_regression,
                [8 * DAY],
                {"InfertapTPOTRegression": [{"model": MODEL, "upstream": UPSTREAM}]},
            ),
            ("traffic stops", no_traffic, [8 * DAY], {"InfertapNoTraffic": [{"job": JOB, "model": MODEL}]}),
            # Silent, and here rather than in silent.test.yml to keep that file's run time down:
            ("prompts twice as long within their class", longer_prompts_within_class, [8 * DAY], {}),
            ("fast decode a little slower (TPOT floor)", fast_decode_slower, [8 * DAY], {}),
        ],
    ),
    "slo.test.yml": (
        MIN,
        5 * MIN,
        2 * DAY,
        [
            (
                "fast TTFT SLO burn",
                slo_fast_burn,
                [2 * HOUR + 30 * MIN],
                {"InfertapTTFTSLOBurnRateFast": [{"model": MODEL}]},
            ),
            (
                "slow TTFT SLO burn",
                slo_slow_burn,
                [2 * DAY],
                {"InfertapTTFTSLOBurnRateSlow": [{"model": MODEL}]},
            ),
        ],
    ),
    "errors.test.yml": (
        MIN,
        MIN,
        2 * HOUR,
        [
            (
                "upstream errors",
                errors,
                [HOUR + 10 * MIN],
                {"InfertapHighErrorRatio": [{"job": JOB, "model": MODEL}]},
            ),
            ("a client's bad requests (10%) do not page", client_mistakes, [HOUR + 10 * MIN], {}),
            (
                "a client sends mostly bad requests: a ticket, not a page",
                bad_client,
                [HOUR + 30 * MIN],
                {"InfertapClientErrors": [{"job": JOB}]},
            ),
            (
                "TTFT timeouts",
                timeouts,
                [HOUR + 10 * MIN],
                {"InfertapHighTimeoutRate": [{"upstream": UPSTREAM, "phase": "ttft"}]},
            ),
            (
                "streams cut off",
                interrupted,
                [HOUR + 10 * MIN],
                {"InfertapStreamsInterrupted": [{"model": MODEL, "upstream": UPSTREAM}]},
            ),
            (
                "upstream circuit open",
                upstream_down,
                [HOUR + 5 * MIN],
                {"InfertapUpstreamDown": [{"upstream": UPSTREAM}]},
            ),
            (
                "one of two proxies not scraped: a ticket",
                one_proxy_down,
                [HOUR + 5 * MIN],
                {"InfertapProxyDown": [{"job": JOB, "instance": INSTANCES[0]}]},
            ),
            (
                "every proxy not scraped: a page",
                proxy_down,
                [HOUR + 5 * MIN],
                {
                    "InfertapProxyDown": [{"job": JOB, "instance": i} for i in INSTANCES],
                    "InfertapAllProxiesDown": [{"job": JOB}],
                },
            ),
            ("no infertap target at all", not_scraped, [HOUR], {"InfertapNotScraped": [{"job": JOB}]}),
        ],
    ),
}

# Extra assertions: the prompt-length shift does move the overall p95 by more than 1.5x against
# yesterday, so the silence of InfertapTTFTRegression in that scenario is the per-class design at work.
EXPR_TESTS = {
    "prompts getting longer": [
        {
            "expr": "histogram_quantile(0.95, sum by (model, le) (rate(infertap_time_to_first_token_seconds_bucket[30m])))"  # noqa: E501
            " > bool 1.5 * histogram_quantile(0.95, sum by (model, le) ("
            "rate(infertap_time_to_first_token_seconds_bucket[30m] offset 1d)))",
            "eval_time": "8d",
            "exp_samples": [{"labels": f'{{model="{MODEL}"}}', "value": 1}],
        }
    ],
    # ... and doubling the prompts of one class doubles that class's p95, past the 1.3x factor: the
    # per-prompt-token signal is what keeps the alert silent.
    "prompts twice as long within their class": [
        {
            "expr": 'model_upstream_prompt_class:infertap_time_to_first_token_seconds:p95_30m{prompt_class="1k-4k"}'  # noqa: E501
            " > bool 1.3 * model_upstream_prompt_class:infertap_time_to_first_token_seconds:p95_30m_1d_ago",
            "eval_time": "8d",
            "exp_samples": [
                {
                    "labels": f'{{model="{MODEL}",prompt_class="1k-4k",upstream="{UPSTREAM}"}}',
                    "value": 1,
                }
            ],
        }
    ],
}


def duration(seconds: int) -> str:
    for unit, size in (("d", DAY), ("h", HOUR), ("m", MIN)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def render(template: str, lbls: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: lbls.get(m.group(1), ""), template)


def test_file(name: str, alerts: dict[str, dict[str, Any]], groups: list[str]) -> dict[str, Any]:
    """alerts: alertname -> its rule; groups: every rule group's name, recording rules first.

    group_eval_order is set because promtool otherwise evaluates groups in random order, and with an
    evaluation interval above the 5m lookback an alert evaluated before the recording rules it reads
    would see nothing."""
    interval, evaluation, dur, cases = FILES[name]
    tests = []
    for title, scenario, evals, firing in cases:
        rule_tests = []
        for t in evals:
            for alert in sorted(alerts):
                exp = []
                for lbls in firing.get(alert, []) if t == evals[-1] else []:
                    full = {**lbls, "severity": SEV[alert]}
                    exp.append(
                        {
                            "exp_labels": full,
                            "exp_annotations": {
                                k: render(v, full) for k, v in alerts[alert]["annotations"].items()
                            },
                        }
                    )
                rule_tests.append({"eval_time": duration(t), "alertname": alert, "exp_alerts": exp})
        test: dict[str, Any] = {
            "name": title,
            "interval": duration(interval),
            "input_series": series(scenario, interval, dur),
            "alert_rule_test": rule_tests,
        }
        if title in EXPR_TESTS:
            test["promql_expr_test"] = EXPR_TESTS[title]
        tests.append(test)
    return {
        "rule_files": ["../rules/infertap-recording.yml", "../rules/infertap-alerts.yml"],
        "evaluation_interval": duration(evaluation),
        "group_eval_order": groups,
        "tests": tests,
    }
