"""The infertap Grafana dashboards, as data. `python deploy/generate.py` writes dashboards/*.json.

Editing a dashboard: change it here (or export it from Grafana and port the change here), regenerate,
and commit both; tests/test_dashboards.py fails when the JSON and this file disagree.
"""

from __future__ import annotations

from typing import Any

PROM = {"type": "prometheus", "uid": "${datasource}"}
TRACES_UID = "jaeger"  # the trace datasource's uid in deploy/grafana/provisioning/datasources
SCOPE = 'job=~"$job",namespace=~"$namespace"'
SEL = SCOPE + ',model=~"$model",upstream=~"$upstream"'
UP = SCOPE + ',upstream=~"$upstream"'
ENG = 'model_name=~"$model_name",instance=~"$instance"'
# What InfertapHighErrorRatio counts: client mistakes and disconnects are neither errors nor requests.
NOT_CLIENT = 'outcome!~"client_error|client_disconnect|rejected"'
FAILED = 'outcome!~"ok|client_error|client_disconnect|rejected"'
TOKENS_PER_S = "suffix: tokens/s"
RI = "$__rate_interval"

FAULTS = {
    1: "Fault 1, KV cache not in effect: TPOT abnormally high from the start; engine KV usage stays near 0.",
    2: "Fault 2, TTFT swings: prefill requests queue under concurrency (waiting > 0, queue time up); "
    "TTFB rises with TTFT.",
    3: "Fault 3, long prompt OOM: KV usage near 100%, preemptions, failures on the >16k / 4k-16k classes.",
    4: "Fault 4, stream cut off: stream_interrupted and idle timeouts rise; or tokens arrive in bursts "
    "(ITL p50 near 0, p99 high) when something in front buffers the stream.",
    5: "Fault 5, repeated or looping output: output length distribution shifts to max_tokens; "
    "a decoding problem (temperature, repetition_penalty), not a cache one.",
}


def q(expr: str, legend: str = "", exemplar: bool = False, fmt: str = "time_series") -> dict[str, Any]:
    return {
        "datasource": PROM,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "exemplar": exemplar,
        "format": fmt,
        "range": True,
    }


def hq(quantile: float, metric: str, sel: str, by: str = "") -> str:
    """A quantile of a histogram; `by` keeps series apart (never mix models in one quantile)."""
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({quantile}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[{RI}])))"


def quantiles(metric: str, sel: str, qs: tuple[float, ...], exemplar: bool = False) -> list[dict[str, Any]]:
    """Per model: a quantile over every model mixes a fast small one with a slow big one."""
    return [q(hq(x, metric, sel, "model"), f"{{{{model}}}} p{round(x * 100)}", exemplar) for x in qs]


def ts(
    title: str,
    targets: list[dict[str, Any]],
    unit: str,
    description: str,
    w: int = 12,
    h: int = 8,
    stack: bool = False,
) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": False,
    }
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": PROM,
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def heatmap(title: str, expr: str, unit: str, description: str, exemplar: bool = False) -> dict[str, Any]:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": PROM,
        "gridPos": {"h": 8, "w": 12, "x": 0, "y": 0},
        "maxDataPoints": 60,
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {
            "calculate": False,
            "yAxis": {"unit": unit, "axisPlacement": "left"},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "tooltip": {"mode": "single"},
            "rowsFrame": {"layout": "auto"},
            "legend": {"show": True},
        },
        "targets": [q(expr, "{{le}}", exemplar, "heatmap")],
    }


def stat(
    title: str,
    expr: str,
    unit: str,
    description: str,
    legend: str = "",
    steps: list[tuple[float, str]] | None = None,
    base_color: str = "green",
) -> dict[str, Any]:
    """steps: (from value, color) above green; none means the number is never good or bad by itself
    (without thresholds Grafana's default turns it red at 80)."""
    base = [{"color": base_color, "value": None}]
    thresholds = {"mode": "absolute", "steps": base + [{"color": c, "value": v} for v, c in steps or []]}
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": PROM,
        "gridPos": {"h": 4, "w": 6, "x": 0, "y": 0},
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": thresholds}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
        "targets": [q(expr, legend)],
    }


def text(title: str, content: str, w: int = 24, h: int = 7) -> dict[str, Any]:
    return {
        "type": "text",
        "title": title,
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "options": {"mode": "markdown", "content": content},
    }


def row(title: str) -> dict[str, Any]:
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
    }


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give ids and flow panels left to right, top to bottom, on Grafana's 24-column grid."""
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        for n, target in enumerate(p.get("targets", [])):
            target["refId"] = chr(ord("A") + n)
        g = p["gridPos"]
        if x + g["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        g["x"], g["y"] = x, y
        x += g["w"]
        row_h = max(row_h, g["h"])
    return panels


def variables(with_upstream: bool = True, engine: bool = False) -> list[dict[str, Any]]:
    def query_var(name: str, label: str, metric: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": PROM,
            "query": {"query": f"label_values({metric}, {name})", "refId": f"{name}-var"},
            "refresh": 2,
            "sort": 1,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        }

    out: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "current": {"selected": False, "text": "Prometheus", "value": "prometheus"},
        }
    ]
    out.append(query_var("job", "Job", "infertap_build_info"))
    out.append(query_var("namespace", "Namespace", "infertap_build_info"))
    out.append(query_var("model", "Model", "infertap_requests_total"))
    if with_upstream:
        out.append(query_var("upstream", "Upstream", "infertap_requests_total"))
    if engine:
        # vLLM's own labels: its model_name, and instance (every vLLM replica reports engine="0").
        out.append(query_var("model_name", "Engine model", "vllm:num_requests_running"))
        out.append(query_var("instance", "Engine instance", "vllm:num_requests_running"))
    return out


def dashboard(
    uid: str, title: str, description: str, panels: list[dict[str, Any]], engine: bool = False
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["infertap", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-3h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "title": "infertap dashboards",
                "type": "dashboards",
                "tags": ["infertap"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            },
            {
                "title": "Traces (Jaeger)",
                "type": "link",
                "icon": "external link",
                "tags": [],
                "asDropdown": False,
                "includeVars": False,
                "keepTime": True,
                "targetBlank": True,
                "tooltip": "Explore traces; exemplar dots on TTFT and e2e panels open one trace",
                "url": f"/explore?left=%7B%22datasource%22:%22{TRACES_UID}%22%7D",
            },
        ],
        "templating": {"list": variables(engine=engine)},
        "panels": layout(panels),
    }


def overview() -> dict[str, Any]:
    req = f"infertap_requests_total{{{SEL}}}"
    err = f"infertap_requests_total{{{SEL},{FAILED}}}"
    served = f"infertap_requests_total{{{SEL},{NOT_CLIENT}}}"
    # `or vector(0)`: with no failure yet only outcome="ok" exists, and the ratio would be "No data".
    err_ratio = f"(sum(rate({err}[{RI}])) or vector(0)) / sum(rate({served}[{RI}]))"
    slo = 'model:infertap_ttft_slo_errors:ratio_rate{w}{{model=~"$model"}}'
    return dashboard(
        "infertap-overview",
        "infertap / Overview",
        "What users of the LLM API feel: traffic, errors, timeouts and latency through infertap.",
        [
            row("Traffic and errors"),
            stat("Requests/s", f"sum(rate({req}[{RI}]))", "reqps", "All requests through infertap."),
            stat(
                "Error ratio",
                err_ratio,
                "percentunit",
                "Failed requests among those clients sent correctly (what InfertapHighErrorRatio reads: "
                "client mistakes and disconnects are in neither part). Red from 5%, its threshold.",
                steps=[(0.01, "yellow"), (0.05, "red")],
            ),
            stat(
                "In flight",
                f"sum(infertap_in_flight_requests{{{UP}}})",
                "short",
                "Requests being served now. It returns to 0 when traffic stops; if it does not, a stream leaked.",  # noqa: E501
            ),
            stat(
                "Version",
                "count by (version) (infertap_build_info)",
                "short",
                "Replicas per infertap version.",
                "{{version}}",
            ),
            ts(
                "Requests/s by outcome",
                [q(f"sum by (outcome) (rate({req}[{RI}]))", "{{outcome}}")],
                "reqps",
                "Every request ends with exactly one outcome: ok, client_error, rate_limited, upstream_error, "  # noqa: E501
                "connect_error, connect_timeout, ttft_timeout, idle_timeout, total_timeout, pool_timeout, "  # noqa: E501
                "stream_interrupted, client_disconnect, rejected or shutdown.",
                stack=True,
            ),
            ts(
                "Error and timeout ratio",
                [
                    q(err_ratio, "errors / requests"),
                    q(
                        f"sum by (phase) (rate(infertap_timeouts_total{{{UP}}}[{RI}])) / ignoring (phase) group_left "  # noqa: E501
                        f"sum(rate(infertap_upstream_attempts_total{{{UP}}}[{RI}]))",
                        "timeouts ({{phase}}) / attempts",
                    ),
                ],
                "percentunit",
                "Alerts InfertapHighErrorRatio (5%) and InfertapHighTimeoutRate (2%) read these.",
            ),
            ts(
                "Requests/s by route",
                [q(f"sum by (route) (rate({req}[{RI}]))", "{{route}}")],
                "reqps",
                "Which API the traffic uses: chat.completions, completions, responses, embeddings...",
                stack=True,
            ),
            ts(
                "Client mistakes/s",
                [
                    q(
                        f'sum by (outcome) (rate(infertap_requests_total{{{SCOPE},outcome=~"rejected|client_error"}}[{RI}]))',  # noqa: E501
                        "{{outcome}}",
                    )
                ],
                "reqps",
                "rejected: infertap refused the request (bad JSON, no model, too large; model is 'none' when "
                "there was none). client_error: the upstream's 4xx. Not an outage: InfertapClientErrors "
                "opens a ticket above 10% (the model and upstream filters do not apply here).",
            ),
            ts(
                "In-flight requests",
                [q(f"sum by (upstream) (infertap_in_flight_requests{{{UP}}})", "{{upstream}}")],
                "short",
                "Concurrent requests per upstream.",
            ),
            ts(
                "Upstream attempts, retries and circuit",
                [
                    q(
                        f"sum by (upstream, result) (rate(infertap_upstream_attempts_total{{{UP}}}[{RI}]))",
                        "attempts {{upstream}} {{result}}",
                    ),
                    q(
                        f"sum by (upstream, reason) (rate(infertap_retries_total{{{UP}}}[{RI}]))",
                        "retries {{upstream}} {{reason}}",
                    ),
                    q(f"max by (upstream) (infertap_upstream_up{{{UP}}})", "up {{upstream}}"),
                ],
                "short",
                "Attempts by result and retries by reason, per second; up is 1 while the upstream's "
                "circuit is closed, 0 while it is open.",
            ),
            ts(
                "Interrupted streams and client disconnects",
                [
                    q(
                        f'sum(rate(infertap_requests_total{{{SEL},outcome="stream_interrupted"}}[{RI}]))',
                        "interrupted",
                    ),
                    q(
                        f'sum(rate(infertap_requests_total{{{SEL},outcome="client_disconnect"}}[{RI}]))',
                        "client left",
                    ),
                    q(
                        f'sum(rate(infertap_requests_total{{{SEL},outcome="idle_timeout"}}[{RI}]))',
                        "idle timeout",
                    ),
                ],
                "reqps",
                FAULTS[4],
            ),
            row("Latency users feel"),
            ts(
                "Time to first token",
                quantiles("infertap_time_to_first_token_seconds", SEL, (0.5, 0.9, 0.99), True),
                "s",
                "From request received to the first event carrying output text. Prefill, queueing and the "
                "network. Exemplar dots open the request's trace. " + FAULTS[2],
            ),
            ts(
                "End-to-end duration",
                quantiles("infertap_request_duration_seconds", SEL, (0.5, 0.99), True),
                "s",
                "Whole request, until the last byte. Exemplar dots open the request's trace.",
            ),
            ts(
                "Time per output token",
                quantiles("infertap_time_per_output_token_seconds", SEL, (0.5, 0.99)),
                "s",
                "Per request: (last token - first token) / (output tokens - 1). Decode speed. " + FAULTS[1],
            ),
            ts(
                "Inter-token latency",
                quantiles("infertap_inter_token_latency_seconds", SEL, (0.5, 0.99)),
                "s",
                "Gap between consecutive output events. An SSE event may carry several tokens. " + FAULTS[4],
            ),
            ts(
                "infertap's own overhead",
                [
                    q(hq(x, "infertap_overhead_seconds", SCOPE, "phase"), f"{{{{phase}}}} p{round(x * 100)}")
                    for x in (0.5, 0.99)
                ]
                + [q(hq(0.99, "infertap_event_loop_lag_seconds", SCOPE), "event loop lag p99")],
                "s",
                "How much of the latency above is infertap's. intake: from the request's arrival to the "
                "upstream request written; first_token: from the first output event's bytes arriving from "
                "the upstream to their being handed to the client (subtract it from TTFT to get the "
                "upstream's share). Event loop lag: how late a task sleeping on infertap's loop wakes; when "
                "it rises with the overhead, infertap's CPU is short (more replicas or workers).",
                w=24,
            ),
            row("TTFT SLO: 99% of streamed requests get their first token within 2 s"),
            stat(
                "Burn rate (1h)",
                f"max({slo.format(w='1h')}) / 0.01",
                "short",
                "How many times faster than allowed the error budget (1%) burns over the last hour. "
                "InfertapTTFTSLOBurnRateFast pages at 14.4 (with the 5-minute window agreeing).",
                steps=[(1, "yellow"), (6, "orange"), (14.4, "red")],
            ),
            stat(
                "Error budget left (3 days)",
                f"1 - max({slo.format(w='3d')}) / 0.01",
                "percentunit",
                "Share of the 1% budget not spent over the last 3 days (the longest recorded window): "
                "below 0 the objective is missed.",
                steps=[(0.25, "yellow"), (0.5, "green")],
                base_color="red",
            ),
            ts(
                "Requests missing the TTFT objective",
                [q(slo.format(w=w), f"{{{{model}}}} {w}") for w in ("5m", "1h", "6h", "1d", "3d")],
                "percentunit",
                "Share of streamed requests over 2 s to the first token (or timed out before it), per "
                "window; the budget is 1%. The burn-rate alerts compare these with 14.4%, 6%, 3% and 1%.",
                w=12,
            ),
            row("Tokens"),
            ts(
                "Tokens/s",
                [
                    q(
                        f"sum by (model) (rate(infertap_prompt_tokens_total{{{SEL}}}[{RI}]))",
                        "{{model}} prompt (in)",
                    ),
                    q(
                        f"sum by (model) (rate(infertap_completion_tokens_total{{{SEL}}}[{RI}]))",
                        "{{model}} completion (out)",
                    ),
                ],
                TOKENS_PER_S,
                "Prompt tokens read and completion tokens written per second, from usage events.",
            ),
            ts(
                "Requests without usage",
                [
                    q(
                        f"sum by (upstream) (rate(infertap_requests_without_usage_total{{{SEL}}}[{RI}]))",
                        "{{upstream}}",
                    )
                ],
                "reqps",
                "Answers whose upstream sent no usage: their token counts are estimated (counted output "
                "events, prompt from its length), so token and spend numbers are approximate for them.",
            ),
        ],
    )


P95 = "model_upstream_prompt_class:infertap_time_to_first_token_seconds:p95_30m"
PER_TOKEN = "model_upstream:infertap_time_to_first_token_per_prompt_token_seconds:mean30m"
RSEL = 'model=~"$model",upstream=~"$upstream"'  # recording rules keep model and upstream only


def prefill_decode() -> dict[str, Any]:
    ttft = "infertap_time_to_first_token_seconds"
    return dashboard(
        "infertap-prefill-decode",
        "infertap / Prefill and decode",
        "TTFT is prefill (plus queueing), TPOT is decode: read them apart.",
        [
            heatmap(
                "TTFT heatmap",
                f"sum by (le) (increase({ttft}_bucket{{{SEL}}}[{RI}]))",
                "s",
                "Distribution of time to first token. Two bands mean two populations (e.g. cache hits and "
                "misses, or short and long prompts). " + FAULTS[2],
                exemplar=True,
            ),
            ts(
                "TTFT p95 by prompt class",
                [q(hq(0.95, ttft, SEL, "model, prompt_class"), "{{model}} {{prompt_class}}")],
                "s",
                "Prefill grows with prompt length: compare each class with itself, not the mix. " + FAULTS[3],
            ),
            ts(
                "Prefix cache hit ratio",
                [q(cache_hit_ratio("model, upstream"), "{{model}} @ {{upstream}}")],
                "percentunit",
                "Share of prompt tokens the upstream served from its prefix cache (usage's cached_tokens): "
                "the engine's KV cache seen from the client's side. Hits cut TTFT: read it next to TTFT "
                "by prompt class. 0 where the upstream reports no cached tokens.",
            ),
            ts(
                "Requests/s by prompt class",
                [
                    q(
                        f"sum by (model, prompt_class) (rate({ttft}_count{{{SEL}}}[{RI}]))",
                        "{{model}} {{prompt_class}}",
                    )
                ],
                "reqps",
                "The prompt-length mix. When it shifts to longer prompts, overall TTFT rises without any "
                "regression: that is why the TTFT alert is per prompt class.",
                stack=True,
            ),
            ts(
                "TTFB vs TTFT",
                [
                    q(hq(0.5, "infertap_time_to_first_byte_seconds", SEL, "model"), "{{model}} TTFB p50"),
                    q(hq(0.5, ttft, SEL, "model"), "{{model}} TTFT p50"),
                    q(hq(0.95, "infertap_time_to_first_byte_seconds", SEL, "model"), "{{model}} TTFB p95"),
                    q(hq(0.95, ttft, SEL, "model"), "{{model}} TTFT p95"),
                ],
                "s",
                "TTFB: upstream status and headers arrived. TTFT: first output text. A gap between them is "
                "the engine's prefill after it accepted the request; TTFB itself high means connect or queueing.",  # noqa: E501
            ),
            ts(
                "TPOT and tokens per second",
                [
                    q(hq(0.5, "infertap_time_per_output_token_seconds", SEL, "model"), "{{model}} TPOT p50"),
                    q(hq(0.95, "infertap_time_per_output_token_seconds", SEL, "model"), "{{model}} TPOT p95"),
                ],
                "s",
                "Decode speed per request. TPS = 1 / TPOT (next panel). " + FAULTS[1],
            ),
            ts(
                "Output tokens/s per request (TPS = 1 / TPOT p50)",
                [
                    q(
                        f"1 / {hq(0.5, 'infertap_time_per_output_token_seconds', SEL, 'model')}",
                        "{{model}} TPS p50",
                    )
                ],
                TOKENS_PER_S,
                "What one user sees as streaming speed.",
            ),
            heatmap(
                "Output length distribution",
                f"sum by (le) (increase(infertap_request_completion_tokens_bucket{{{SEL}}}[{RI}]))",
                "short",
                "Completion tokens per request. " + FAULTS[5],
            ),
            heatmap(
                "Prompt length distribution",
                f"sum by (le) (increase(infertap_request_prompt_tokens_bucket{{{SEL}}}[{RI}]))",
                "short",
                "Prompt tokens per request: the input of prefill.",
            ),
            ts(
                "TTFT p95: now, 1 day and 1 week earlier",
                [
                    q(hq(0.95, ttft, SEL, "model"), "{{model}} now"),
                    q(
                        f"histogram_quantile(0.95, sum by (model, le) (rate({ttft}_bucket{{{SEL}}}[{RI}] offset 1d)))",  # noqa: E501
                        "{{model}} 1d ago",
                    ),
                    q(
                        f"histogram_quantile(0.95, sum by (model, le) (rate({ttft}_bucket{{{SEL}}}[{RI}] offset 1w)))",  # noqa: E501
                        "{{model}} 1w ago",
                    ),
                ],
                "s",
                "The same quantile against itself a day and a week earlier: daily and weekly patterns "
                "line up, a regression stands out.",
            ),
            ts(
                "What the TTFT regression alert sees",
                [
                    q(f"{P95}{{{RSEL}}}", "{{model}} {{upstream}} {{prompt_class}} now"),
                    q(
                        f"1.3 * {P95}_1d_ago{{{RSEL}}}",
                        "{{model}} {{upstream}} {{prompt_class}} 1.3 x 1d ago",
                    ),
                    q(
                        f"1.3 * {P95}_1w_ago{{{RSEL}}}",
                        "{{model}} {{upstream}} {{prompt_class}} 1.3 x 1w ago",
                    ),
                ],
                "s",
                "Recording rules behind InfertapTTFTRegression: p95 per model, upstream and prompt class. It "
                "fires when 'now' is above both thresholds for 15 minutes, above 0.25 s, with 6 requests a "
                "minute now and in both baselines, and the next panel's signal is up 1.3x too.",
            ),
            ts(
                "TTFT per prompt token: now, 1 day and 1 week earlier",
                [
                    q(f"{PER_TOKEN}{{{RSEL}}}", "{{model}} {{upstream}} now"),
                    q(f"{PER_TOKEN}_1d_ago{{{RSEL}}}", "{{model}} {{upstream}} 1d ago"),
                    q(f"{PER_TOKEN}_1w_ago{{{RSEL}}}", "{{model}} {{upstream}} 1w ago"),
                ],
                "s",
                "Mean TTFT / mean prompt tokens: prefill speed whatever the prompt length. Longer prompts "
                "lower it (the fixed part of TTFT is shared by more tokens); slower prefill raises it.",
            ),
            ts(
                "Mean output tokens per request",
                [
                    q(
                        f"sum(rate(infertap_request_completion_tokens_sum{{{SEL}}}[{RI}])) / "
                        f"sum(rate(infertap_request_completion_tokens_count{{{SEL}}}[{RI}]))",
                        "completion",
                    ),
                    q(
                        f"sum(rate(infertap_request_prompt_tokens_sum{{{SEL}}}[{RI}])) / "
                        f"sum(rate(infertap_request_prompt_tokens_count{{{SEL}}}[{RI}]))",
                        "prompt",
                    ),
                ],
                "short",
                "Long answers make e2e duration grow without any decode slowdown.",
                w=24,
            ),
        ],
    )


def engine() -> dict[str, Any]:
    ttft = "infertap_time_to_first_token_seconds"
    faults = "\n".join(f"{i}. {t}" for i, t in FAULTS.items())
    return dashboard(
        "infertap-engine",
        "infertap / Engine",
        "The engine behind infertap (vLLM or the simulated engine): where prefill and decode time "
        "goes. Engine series use the model_name and instance variables (vLLM's labels).",
        [
            text(
                "The five common faults, and where each shows",
                faults
                + "\n\nFirst locate prefill (TTFT, queue, prefill time) or decode (TPOT, KV cache), then tune.",  # noqa: E501
            ),
            ts(
                "TTFT: engine vs proxy (p95)",
                [
                    q(
                        hq(0.95, "vllm:time_to_first_token_seconds", ENG, "model_name"),
                        "engine {{model_name}} p95",
                    ),
                    q(hq(0.95, ttft, SEL, "model"), "proxy {{model}} p95"),
                    q(
                        hq(0.5, "vllm:time_to_first_token_seconds", ENG, "model_name"),
                        "engine {{model_name}} p50",
                    ),
                    q(hq(0.5, ttft, SEL, "model"), "proxy {{model}} p50"),
                ],
                "s",
                "Proxy TTFT minus engine TTFT is the network plus infertap. Equal and high: the engine. "
                "Proxy far above engine: the network, connection setup (pooling) or buffering. " + FAULTS[2],
            ),
            ts(
                "Inter-token latency: engine vs proxy (p50)",
                [
                    q(
                        hq(0.5, "vllm:inter_token_latency_seconds", ENG, "model_name"),
                        "engine {{model_name}}",
                    ),
                    q(hq(0.5, "infertap_inter_token_latency_seconds", SEL, "model"), "proxy {{model}}"),
                ],
                "s",
                FAULTS[4],
            ),
            ts(
                "Queue, prefill and decode time (p95)",
                [
                    q(hq(0.95, "vllm:request_queue_time_seconds", ENG, "model_name"), "{{model_name}} queue"),
                    q(
                        hq(0.95, "vllm:request_prefill_time_seconds", ENG, "model_name"),
                        "{{model_name}} prefill",
                    ),
                    q(
                        hq(0.95, "vllm:request_decode_time_seconds", ENG, "model_name"),
                        "{{model_name}} decode",
                    ),
                ],
                "s",
                "Queue time up: prefill requests wait their turn (fault 2). Prefill time up at the same "
                "prompt length: the engine got slower. Decode time up: see TPOT and KV cache.",
            ),
            ts(
                "Requests waiting and running",
                [
                    q(f"sum by (instance) (vllm:num_requests_waiting{{{ENG}}})", "waiting {{instance}}"),
                    q(f"sum by (instance) (vllm:num_requests_running{{{ENG}}})", "running {{instance}}"),
                ],
                "short",
                "Waiting > 0 for long: the batch is full (max_num_seqs, max_num_batched_tokens). "
                + FAULTS[2],
            ),
            ts(
                "KV cache usage",
                [q(f"max by (instance) (vllm:kv_cache_usage_perc{{{ENG}}})", "{{instance}}")],
                "percentunit",
                FAULTS[1] + " " + FAULTS[3],
            ),
            ts(
                "Prefix cache hit rate",
                [
                    q(
                        f"sum(rate(vllm:prefix_cache_hits_total{{{ENG}}}[{RI}])) / "
                        f"sum(rate(vllm:prefix_cache_queries_total{{{ENG}}}[{RI}]))",
                        "hit rate",
                    )
                ],
                "percentunit",
                "Share of prompt tokens served from the prefix cache. A drop raises TTFT at the "
                "same prompt length.",
            ),
            ts(
                "Preemptions/s",
                [q(f"sum(rate(vllm:num_preemptions_total{{{ENG}}}[{RI}]))", "preemptions")],
                "short",
                "The engine ran out of KV blocks and evicted running requests to recompute them later. "
                + FAULTS[3],
            ),
            ts(
                "Engine tokens/s",
                [
                    q(f"sum(rate(vllm:prompt_tokens_total{{{ENG}}}[{RI}]))", "prompt"),
                    q(f"sum(rate(vllm:generation_tokens_total{{{ENG}}}[{RI}]))", "generation"),
                ],
                TOKENS_PER_S,
                "Compare with infertap's tokens/s: the engine also serves traffic that bypasses infertap.",
            ),
            ts(
                "End-to-end: engine vs proxy (p95)",
                [
                    q(
                        hq(0.95, "vllm:e2e_request_latency_seconds", ENG, "model_name"),
                        "engine {{model_name}}",
                    ),
                    q(
                        hq(0.95, "infertap_request_duration_seconds", SEL, "model"),
                        "proxy {{model}}",
                        exemplar=True,
                    ),
                ],
                "s",
                "Exemplar dots on the proxy series open the request's trace.",
            ),
            ts(
                "Finish reasons (stop vs length)",
                [
                    q(
                        f"sum by (finished_reason) (rate(vllm:request_success_total{{{ENG}}}[{RI}]))",
                        "{{finished_reason}}",
                    )
                ],
                "reqps",
                "stop: the model ended its answer; length: it hit max_tokens; abort: the client left. "
                "length growing at unchanged traffic is " + FAULTS[5],
                stack=True,
            ),
        ],
        engine=True,
    )


def cache_hit_ratio(by: str) -> str:
    """Cached / all prompt tokens; 0 (not empty) where the upstream reports no cached tokens."""
    prompt = f"sum by ({by}) (rate(infertap_prompt_tokens_total{{{SEL}}}[{RI}]))"
    cached = f"sum by ({by}) (rate(infertap_cached_prompt_tokens_total{{{SEL}}}[{RI}]))"
    return f"({cached} or 0 * {prompt}) / {prompt}"


def usage_spend() -> dict[str, Any]:
    """Who uses what and what it costs (docs/spend.md): spend and tokens per client and model."""
    spend = f"infertap_spend_total{{{SEL}}}"
    tokens = f"infertap_prompt_tokens_total{{{SEL}}}"
    completion = f"infertap_completion_tokens_total{{{SEL}}}"
    reasoning = f"infertap_reasoning_tokens_total{{{SEL}}}"
    day = f"sum by (client) (rate({spend}[1h])) * 86400"
    budget = f"max by (client) (infertap_spend_daily_budget) and on (client) ({day})"
    return dashboard(
        "infertap-usage-spend",
        "infertap / Usage and spend",
        "Who uses what and what it costs: tokens and spend per client and model, prefix cache hits, "
        "reasoning share. Spend comes from the prices in infertap's [spend] config.",
        [
            row("Spend"),
            stat(
                "Spend, last 24 h",
                f"sum(increase({spend}[24h]))",
                "none",
                "What the tokens cost over the last day, in [spend]'s currency (requests that ended ok).",
            ),
            stat(
                "Unpriced tokens, last 24 h",
                f"sum(increase(infertap_unpriced_tokens_total{{{SEL}}}[24h]))",
                "short",
                "Tokens of models without a price in [spend.prices]: not in the spend. infertap logs each "
                "such model once.",
            ),
            stat(
                "Prefix cache hit ratio",
                cache_hit_ratio(""),
                "percentunit",
                "Cached / all prompt tokens, all clients and models.",
            ),
            stat(
                "Reasoning share",
                f"(sum(rate({reasoning}[{RI}])) or 0 * sum(rate({completion}[{RI}]))) "
                f"/ sum(rate({completion}[{RI}]))",
                "percentunit",
                "Share of completion tokens that were hidden reasoning (usage's reasoning_tokens).",
            ),
            ts(
                "Spend rate per client (per day)",
                [
                    q(day, "{{client}}"),
                    q(budget, "{{client}} budget"),
                ],
                "none",
                "Spend per client over the last hour, scaled to a day, against its daily budget "
                "([spend] daily_budget, budgets). InfertapClientOverBudget fires when it stays above.",
                w=24,
            ),
            ts(
                "Spend/s by model",
                [q(f"sum by (model) (rate({spend}[{RI}]))", "{{model}}")],
                "none",
                "What each model costs per second, all clients.",
                stack=True,
            ),
            ts(
                "Spend/s by client and upstream",
                [q(f"sum by (client, upstream) (rate({spend}[{RI}]))", "{{client}} @ {{upstream}}")],
                "none",
                "Which client's traffic costs what, and on which upstream.",
                stack=True,
            ),
            row("Tokens"),
            ts(
                "Prompt tokens/s by client",
                [q(f"sum by (client) (rate({tokens}[{RI}]))", "{{client}}")],
                "short",
                "Prompt tokens per client (named by its key, 'anonymous' without client keys).",
                stack=True,
            ),
            ts(
                "Completion tokens/s by client",
                [q(f"sum by (client) (rate({completion}[{RI}]))", "{{client}}")],
                "short",
                "Completion tokens per client, reasoning included.",
                stack=True,
            ),
            ts(
                "Tokens/s by model",
                [
                    q(f"sum by (model) (rate({tokens}[{RI}]))", "{{model}} prompt"),
                    q(f"sum by (model) (rate({completion}[{RI}]))", "{{model}} completion"),
                ],
                "short",
                "Prompt and completion tokens per model, all clients.",
            ),
            ts(
                "Prefix cache hit ratio by model",
                [q(cache_hit_ratio("model, upstream"), "{{model}} @ {{upstream}}")],
                "percentunit",
                "Cached / all prompt tokens. Cached tokens are cheaper where [spend.prices] gives "
                "cached_input_per_mtok. 0 where the upstream reports no cached tokens.",
            ),
            ts(
                "Reasoning share by model",
                [
                    q(
                        f"(sum by (model) (rate({reasoning}[{RI}])) or 0 * sum by (model) "
                        f"(rate({completion}[{RI}]))) / sum by (model) (rate({completion}[{RI}]))",
                        "{{model}}",
                    )
                ],
                "percentunit",
                "Share of completion tokens spent on hidden reasoning: paid for, never shown.",
            ),
            ts(
                "Time to first token vs first answer token (p95)",
                [
                    q(hq(0.95, "infertap_time_to_first_token_seconds", SEL, "model"), "{{model}} first"),
                    q(
                        hq(0.95, "infertap_time_to_first_answer_token_seconds", SEL, "model"),
                        "{{model}} first answer token",
                    ),
                ],
                "s",
                "For reasoning models the answer starts after the reasoning: the second line is what "
                "users waiting for an answer feel. The two are equal for other models.",
            ),
        ],
    )


# A pool's replicas (issue 26): the replica series carry upstream and replica, not model (a pool is
# one upstream); a quantile keeps replicas apart, as the others keep models apart.
REPLICA_TTFT_P95 = hq(0.95, "infertap_replica_time_to_first_token_seconds", UP, "upstream, replica")
PER_REPLICA_RPS = f"sum by (upstream, replica) (rate(infertap_replica_requests_total{{{UP}}}[{RI}]))"


def fleet() -> dict[str, Any]:
    decisions = "infertap_balance_decisions_total"
    chosen = f'{decisions}{{{UP},policy="prefix_affinity",reason!="retry"}}'
    hits = f'{decisions}{{{UP},policy="prefix_affinity",reason="affinity_hit"}}'
    return dashboard(
        "infertap-fleet",
        "infertap / Fleet",
        "A pool of replicas behind one upstream (`replicas = [...]` or `dns://`): how the load "
        "spreads, which replica is slow, which is ejected, and whether prefix affinity keeps "
        "conversations where their KV cache is. Engine series use the model_name and instance variables.",
        [
            row("Load per replica"),
            ts(
                "Requests/s per replica",
                [q(PER_REPLICA_RPS, "{{upstream}} {{replica}}")],
                "reqps",
                "Requests each replica was sent (every outcome). An even spread is the balancer's job; "
                "prefix_affinity trades a little evenness for cache hits, within balance_load_factor.",
            ),
            ts(
                "In-flight requests per replica",
                [
                    q(
                        f"sum by (upstream, replica) (infertap_replica_in_flight_requests{{{UP}}})",
                        "{{upstream}} {{replica}}",
                    )
                ],
                "short",
                "Requests open on each replica now: what least_request balances. One replica holding "
                "far more than the others is slow, or favoured by affinity beyond the load bound.",
            ),
            ts(
                "Load imbalance: busiest replica / pool mean",
                [
                    q(
                        f"max by (upstream) ({PER_REPLICA_RPS}) / avg by (upstream) ({PER_REPLICA_RPS})",
                        "{{upstream}}",
                    )
                ],
                "short",
                "1 is perfectly even. Above 1 + balance_load_factor for long: the bound is not holding, "
                "or one replica gets the retries of the others.",
                w=24,
            ),
            row("Latency per replica"),
            ts(
                "TTFT p95 per replica vs the pool's median",
                [
                    q(REPLICA_TTFT_P95, "{{upstream}} {{replica}}"),
                    q(f"quantile by (upstream) (0.5, {REPLICA_TTFT_P95})", "{{upstream}} pool median"),
                ],
                "s",
                "Each replica's TTFT p95 against the median of its pool's replicas. A single replica far "
                "above its pool is a sick GPU or a noisy neighbour, which a whole-model TTFT averages "
                "away (alert InfertapReplicaSlow).",
            ),
            ts(
                "TTFT p95 per replica / pool median",
                [
                    q(
                        f"{REPLICA_TTFT_P95} / on (upstream) group_left "
                        f"quantile by (upstream) (0.5, {REPLICA_TTFT_P95})",
                        "{{upstream}} {{replica}}",
                    )
                ],
                "short",
                "What InfertapReplicaSlow watches: above 2 for 10 minutes with traffic pages the owner "
                "of that replica, not of the model.",
            ),
            row("Ejections"),
            ts(
                "Replicas admitted per pool",
                [
                    q(f"sum by (upstream) (infertap_replica_up{{{UP}}})", "{{upstream}} admitted"),
                    q(f"count by (upstream) (infertap_replica_up{{{UP}}})", "{{upstream}} known"),
                ],
                "short",
                "Admitted: replicas that get new requests. Known minus admitted: ejected by their "
                "circuit (errors, stalls) or draining (gone from DNS, or removed by a reload).",
            ),
            ts(
                "Ejected or draining replicas",
                [q(f"1 - infertap_replica_up{{{UP}}} > 0", "{{upstream}} {{replica}}")],
                "short",
                "1 while a replica is out of its pool's rotation. Readmitted after its circuit's "
                "cool-down when a trial request succeeds.",
            ),
            ts(
                "Failed requests/s per replica",
                [
                    q(
                        "sum by (upstream, replica, outcome) "
                        f'(rate(infertap_replica_requests_total{{{UP},outcome!="ok"}}[{RI}]))',
                        "{{upstream}} {{replica}} {{outcome}}",
                    )
                ],
                "reqps",
                "What ejects a replica. A request retried on another replica counts here once for the "
                "replica that failed it.",
                w=24,
            ),
            row("Prefix affinity and the engines' cache"),
            ts(
                "Affinity hit rate",
                [
                    q(
                        f"sum by (upstream) (rate({hits}[{RI}])) / sum by (upstream) (rate({chosen}[{RI}]))",
                        "{{upstream}}",
                    )
                ],
                "percentunit",
                "Share of prefix_affinity's choices that went to the conversation's own replica (not "
                "spilled for load, not moved off an ejected one). Read it beside the engines' hit rate: "
                "affinity high and engine hits low means the engines evict (too little KV cache).",
            ),
            ts(
                "Engine prefix cache hit rate per instance",
                [
                    q(
                        f"sum by (instance) (rate(vllm:prefix_cache_hits_total{{{ENG}}}[{RI}])) / "
                        f"sum by (instance) (rate(vllm:prefix_cache_queries_total{{{ENG}}}[{RI}]))",
                        "{{instance}}",
                    )
                ],
                "percentunit",
                "Share of prompt tokens each engine served from its prefix cache (vLLM's own counters, "
                "and the simulated engine's). What affinity is for: round robin spreads a conversation "
                "over every replica, and each pays the whole prefill again.",
            ),
            ts(
                "Balance decisions/s by reason",
                [
                    q(
                        f"sum by (upstream, policy, reason) (rate({decisions}{{{UP}}}[{RI}]))",
                        "{{upstream}} {{policy}} {{reason}}",
                    )
                ],
                "reqps",
                "Why each replica was chosen: affinity_hit, spilled (its replica above the load bound), "
                "ejected (its replica out), least_request, round_robin, retry (after a failure before "
                "the first token).",
                w=24,
            ),
        ],
        engine=True,
    )


DASHBOARDS = {
    "infertap-overview.json": overview,
    "infertap-prefill-decode.json": prefill_decode,
    "infertap-engine.json": engine,
    "infertap-usage-spend.json": usage_spend,
    "infertap-fleet.json": fleet,
}
