"""Metrics: exact counts after known workloads, buckets, cardinality, multi-worker, exemplars."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.exchange import Exchange
from proxy.core.hooks import Observer
from proxy.observe.metrics.buckets import ITL_BUCKETS
from proxy.settings import UpstreamSettings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, serve_process, wait_until
from tests.promtext import samples, scrape, value


def test_exact_counts_after_a_known_workload(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    n, k = 4, 6
    rec = RecordingObserver()
    with run_proxy(make_settings(("fake", url)), rec) as proxy, httpx.Client() as c:
        for i in range(n):
            r = c.post(
                f"{proxy}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers={"x-fake-events": str(k), "x-request-id": f"s{i}"},
            )
            assert r.status_code == 200
        for i in range(2):
            c.post(
                f"{proxy}/v1/chat/completions",
                json=CHAT,
                headers={"x-fake-events": "3", "x-request-id": f"n{i}"},
            )
        wait_until(lambda: sum(rec.terminal_count(r) for r in rec.exchanges) == n + 2)
        text = scrape(proxy)
    m = {"model": "fake-model", "upstream": "fake"}
    assert value(text, "infertap_time_to_first_token_seconds_count", **m) == n
    assert value(text, "infertap_inter_token_latency_seconds_count", **m) == n * (k - 1)
    assert value(text, "infertap_time_per_output_token_seconds_count", **m) == n
    assert value(text, "infertap_completion_tokens_total", **m) == n * k + 2 * 3
    assert value(text, "infertap_prompt_tokens_total", **m) == (n + 2) * 7
    assert value(text, "infertap_requests_total", outcome="ok", stream="true", **m) == n
    assert value(text, "infertap_requests_total", outcome="ok", stream="false", **m) == 2
    assert value(text, "infertap_request_duration_seconds_count", stream="false", **m) == 2
    assert value(text, "infertap_request_duration_seconds_count", stream="true", **m) == n
    assert value(text, "infertap_time_to_first_byte_seconds_count", **m) == n + 2
    assert value(text, "infertap_request_completion_tokens_count", **m) == n + 2
    assert value(text, "infertap_requests_without_usage_total", **m) == 0
    assert value(text, "infertap_upstream_attempts_total", upstream="fake", result="ok") == n + 2
    assert value(text, "infertap_in_flight_requests", upstream="fake") == 0
    assert value(text, "infertap_build_info") == 1
    # TTFT per request lands in its prompt class, estimated from the body at arrival.
    assert value(text, "infertap_time_to_first_token_seconds_count", prompt_class="<1k") == n


def test_ttft_is_the_first_content_event_not_the_first_byte(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy, httpx.Client() as c:
        # The role-only chunk goes at once; content follows 300 ms later.
        c.post(
            f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-fake-ttft-ms": "300"}
        )
        text = scrape(proxy)
    assert value(text, "infertap_time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(text, "infertap_time_to_first_token_seconds_bucket", le="0.25") == 0
    assert value(text, "infertap_time_to_first_byte_seconds_bucket", le="0.25") == 1


def test_usage_counted_whether_or_not_the_client_asked(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy, httpx.Client() as c:
        plain = c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True}).content
        asked = c.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        ).content
        text = scrape(proxy)
    assert plain.count(b'"choices":[]') == 0 and asked.count(b'"choices":[]') == 1
    assert value(text, "infertap_completion_tokens_total") == 10
    assert value(text, "infertap_requests_without_usage_total") == 0


class _NoUsageUpstream(FakeUpstream):
    """Like llama.cpp: ignores stream_options, never sends usage."""

    async def _stream(self, rec, req, send, n, model):  # type: ignore[no-untyped-def]
        req = {**req, "stream_options": None}
        await super()._stream(rec, req, send, n, model)


def test_missing_usage_counts_events_and_says_so() -> None:
    from tests.conftest import serve_in_thread

    with serve_in_thread(_NoUsageUpstream()) as url, run_proxy(make_settings(("fake", url + "/v1"))) as proxy:
        httpx.post(
            f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-fake-events": "9"}
        )
        text = scrape(proxy)
    assert value(text, "infertap_completion_tokens_total") == 9
    assert value(text, "infertap_requests_without_usage_total") == 1


def test_in_flight_returns_to_zero_after_a_storm(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = make_settings(("fake", url))
    settings.retry.max_attempts = 1
    rec = RecordingObserver()
    with run_proxy(settings, rec) as proxy:
        with httpx.Client(timeout=httpx.Timeout(10, read=0.3)) as c:
            for i, h in enumerate(
                [
                    {},
                    {"x-fake-status": "500"},
                    {"x-fake-cut": "1"},
                    {"x-fake-no-done": "1"},
                    {"x-fake-status": "429"},
                ]
            ):
                c.post(
                    f"{proxy}/v1/chat/completions",
                    json={**CHAT, "stream": True},
                    headers={**h, "x-request-id": f"r{i}"},
                )
            c.post(f"{proxy}/v1/chat/completions", content=b"nope", headers={"x-request-id": "bad"})
            for where in ("before-headers", "after-first"):
                with (
                    pytest.raises(httpx.ReadTimeout),
                    c.stream(
                        "POST",
                        f"{proxy}/v1/chat/completions",
                        json={**CHAT, "stream": True},
                        headers={"x-fake-hang": where, "x-request-id": where},
                    ) as r,
                ):
                    for _ in r.iter_raw():
                        pass
        wait_until(lambda: all(rec.terminal_count(r) == 1 for r in rec.exchanges) and len(rec.exchanges) == 8)
        text = scrape(proxy)
    assert value(text, "infertap_in_flight_requests") == 0
    outcomes = {lab["outcome"]: v for n, lab, v in samples(text) if n == "infertap_requests_total"}
    assert outcomes == {
        "ok": 1,
        "upstream_error": 1,
        "stream_interrupted": 2,
        "rate_limited": 1,
        "rejected": 1,
        "client_disconnect": 2,
    }


def test_model_label_cardinality_is_capped(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = make_settings(("fake", url))
    settings.metrics.access_log = False
    with run_proxy(settings) as proxy, httpx.Client() as c:
        for i in range(1000):
            c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "model": f"made-up-{i}"})
        text = scrape(proxy)
    models = {lab["model"] for n, lab, _ in samples(text) if n == "infertap_requests_total"}
    assert len(models) <= settings.metrics.max_models + 1 and "other" in models
    assert value(text, "infertap_requests_total") == 1000


def test_model_allow_list_from_upstream_patterns(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    settings = make_settings(("fake", url))
    settings.upstreams[0].models = ["llama-*"]
    with run_proxy(settings) as proxy, httpx.Client() as c:
        c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "model": "llama-3"})
        c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "model": "user-typo"})
        text = scrape(proxy)
    models = {lab["model"] for n, lab, _ in samples(text) if n == "infertap_requests_total"}
    assert models == {"llama-3", "other"}


class _TraceIds(Observer):
    """Stands in for the tracing observer: gives each request a trace id."""

    def request_received(self, ex: Exchange) -> None:
        ex.trace_id = "0af7651916cd43dd8448eb211c80319c"


def test_openmetrics_exposition_carries_exemplars(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    from proxy.app import create_app
    from tests.conftest import serve_in_thread

    settings = make_settings(("fake", url))
    app = create_app(settings)
    app.observers.observers.insert(0, _TraceIds())
    app.observers.__init__(app.observers.observers)  # type: ignore[misc]
    with serve_in_thread(app) as proxy, httpx.Client() as c:
        c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True})
        om = c.get(f"{proxy}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
        plain = c.get(f"{proxy}/metrics")
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    ttft_lines = [
        ln for ln in om.text.splitlines() if ln.startswith("infertap_time_to_first_token_seconds_bucket")
    ]
    assert any('# {trace_id="0af7651916cd43dd8448eb211c80319c"}' in ln for ln in ttft_lines)
    assert "trace_id" not in plain.text and plain.headers["content-type"].startswith("text/plain")


def test_access_log_line_matches_the_histograms(
    fake: tuple[FakeUpstream, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, url = fake
    caplog.set_level(logging.INFO, logger="infertap.access")
    with run_proxy(make_settings(("fake", url))) as proxy, httpx.Client() as c:
        c.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-request-id": "acc-1", "x-fake-events": "8", "x-fake-gap-ms": "5"},
        )
        text = scrape(proxy)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "infertap.access"]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"] == "acc-1" and line["outcome"] == "ok" and line["completion_tokens"] == 8
    assert line["ttft_s"] == pytest.approx(value(text, "infertap_time_to_first_token_seconds_sum"), abs=1e-6)
    assert line["tpot_s"] == pytest.approx(
        value(text, "infertap_time_per_output_token_seconds_sum"), abs=1e-6
    )
    assert line["duration_s"] == pytest.approx(value(text, "infertap_request_duration_seconds_sum"), abs=1e-6)
    assert line["ttfb_s"] == pytest.approx(value(text, "infertap_time_to_first_byte_seconds_sum"), abs=1e-6)
    assert "hello" not in json.dumps(line)  # never prompt text


def test_every_documented_metric_name_is_exposed(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    names_file = os.path.join(os.path.dirname(__file__), "..", "deploy", "metric_names.txt")
    settings = make_settings(("fake", url))
    # A pool too: its replica series exist only where an upstream has `replicas`.
    settings.upstreams.append(UpstreamSettings(name="pool", replicas=[url], models=["pool-*"]))
    with run_proxy(settings) as proxy, httpx.Client() as c:
        c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True})
        c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "model": "pool-m", "stream": True})
        text = scrape(proxy)
    exposed = {n for n, _, _ in samples(text)} | {
        line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")
    }
    with open(names_file) as fh:
        documented = {ln.strip() for ln in fh if ln.strip() and not ln.startswith("#")}
    assert documented <= exposed, sorted(documented - exposed)


@pytest.mark.skipif(
    shutil.which("promtool") is None and os.environ.get("CI") != "true",
    reason="promtool not installed (Debian package prometheus; scripts/test installs it)",
)
def test_promtool_check_metrics(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url))) as proxy, httpx.Client() as c:
        c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True})
        c.post(f"{proxy}/v1/chat/completions", json=CHAT)
        text = scrape(proxy)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# prometheus_client as if a release had renamed Histogram's private `_sum`: its own observe and
# exposition still work, what infertap's fast path reaches into does not.
_RENAMED_SUM = """
import prometheus_client.metrics as m

init, observe, child_samples = m.Histogram._metric_init, m.Histogram.observe, m.Histogram._child_samples


def _metric_init(self):
    init(self)
    self._total = self.__dict__.pop("_sum")


def _with_sum(f):
    def call(self, *args, **kwargs):
        self._sum = self._total
        try:
            return f(self, *args, **kwargs)
        finally:
            del self._sum
    return call


m.Histogram._metric_init = _metric_init
m.Histogram.observe = _with_sum(observe)
m.Histogram._child_samples = _with_sum(child_samples)

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from proxy.observe.metrics import prometheus

h = Histogram("itl", "gaps", registry=CollectorRegistry(), buckets=(0.5, 1.0))
prometheus.observe_many(h, 0.0, 7)
print(prometheus.AT_ONCE, h.collect()[0].samples[3].value)
"""


def test_observe_many_falls_back_when_prometheus_client_changes() -> None:
    """Regression: observe_many reached into prometheus_client's private fields unchecked: a
    release that renamed one would raise AttributeError on every stream with a burst of events.
    Now they are checked once at import, and `observe` is called n times instead."""
    r = subprocess.run([sys.executable, "-c", _RENAMED_SUM], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "7.0"]  # the fallback, and 7 observations counted
    assert "observed one by one" in r.stderr


def test_a_metrics_directory_holding_other_files_is_refused(tmp_path: Path) -> None:
    """Regression: `--workers N` deleted the whole directory PROMETHEUS_MULTIPROC_DIR named, whatever
    it held (pointed at /tmp, it emptied /tmp). Now a directory holding anything but infertap's own
    files is refused, with exit 2 and what to do, and nothing in it is touched."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("mine")
    (shared / "counter_123.db").write_bytes(b"a previous run's")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    with socket.socket() as taken:  # should the directory pass, start-up still ends (port taken)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cmd = ["serve", "--workers", "2", "--port", port, "--upstream", "http://127.0.0.1:9/v1"]
        r = subprocess.run(
            [sys.executable, "-m", "proxy", *cmd], capture_output=True, text=True, timeout=60, env=env
        )
    assert r.returncode == 2, r.stderr
    assert (
        "notes.txt" in r.stderr and "empty directory of its own" in r.stderr and "Traceback" not in r.stderr
    )
    assert sorted(p.name for p in shared.iterdir()) == ["counter_123.db", "notes.txt"]


def test_a_metrics_directory_of_infertaps_own_files_is_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.server.workers import multiprocess_metrics

    own = ["counter_1.db", "gauge_livesum_1.db", "histogram_22.db", "infertap_model_labels.txt"]
    for name in own:
        (tmp_path / name).write_text("")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with multiprocess_metrics() as path:
        assert path == str(tmp_path) and not list(tmp_path.iterdir())
    assert tmp_path.is_dir()  # named by the user: kept
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "new"))
    with multiprocess_metrics() as path:
        assert (tmp_path / "new").is_dir()


def test_two_workers_aggregate_metrics(fake: tuple[FakeUpstream, str], tmp_path: os.PathLike[str]) -> None:
    _, url = fake
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    with serve_process("--workers", "2", "--upstream", f"fake={url}", "--log-level", "warning", env=env) as (
        base,
        _,
    ):
        n = 40
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for _ in range(n):
                assert c.post(f"{base}/v1/chat/completions", json={**CHAT, "stream": True}).status_code == 200
            for _ in range(6):
                text = c.get(f"{base}/metrics").text
                assert value(text, "infertap_requests_total", outcome="ok") == n
                assert value(text, "infertap_time_to_first_token_seconds_count") == n
                gauges = [lab for nm, lab, _ in samples(text) if nm == "infertap_in_flight_requests"]
                assert len(gauges) == len({tuple(sorted(g.items())) for g in gauges}), (
                    "gauge duplicated per pid"
                )
                assert all("pid" not in g for g in gauges)


@pytest.mark.parametrize("label", ["model", "client"])
def test_label_caps_hold_across_workers(fake: tuple[FakeUpstream, str], tmp_path: Path, label: str) -> None:
    """The `model` cap and the trusted client header's cap are per instance, not per worker."""
    _, url = fake
    cap = 5
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "INFERTAP_METRICS__MAX_MODELS": str(cap),
        "INFERTAP_CLIENTS__HEADER": "X-Infertap-Client",
        "INFERTAP_CLIENTS__MAX_CLIENTS": str(cap),
        "INFERTAP_METRICS__ACCESS_LOG": "false",
    }
    with serve_process("--workers", "2", "--upstream", f"fake={url}", "--log-level", "warning", env=env) as (
        base,
        _,
    ):
        # Made-up names, a new connection each, until each worker (told apart by its request id
        # prefix) has seen more than the cap: per-worker caps would then let 2 x cap through.
        per_worker: Counter[str] = Counter()
        sent = 0
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:

            def both_past_the_cap() -> bool:
                nonlocal sent
                name = f"made-up-{sent}"
                body = {**CHAT, "model": name} if label == "model" else CHAT
                r = c.post(f"{base}/v1/chat/completions", json=body, headers={"x-infertap-client": name})
                assert r.status_code == 200
                sent += 1
                per_worker[r.headers["x-request-id"].rsplit("-", 1)[0]] += 1
                return len(per_worker) == 2 and min(per_worker.values()) > cap

            wait_until(both_past_the_cap, 60, f"both workers to see more made-up {label}s than the cap")
            text = c.get(f"{base}/metrics").text
    values = {lab[label] for n, lab, _ in samples(text) if n == "infertap_requests_total"}
    assert "other" in values and len(values - {"other"}) == cap, sorted(values)
    assert value(text, "infertap_requests_total") == sent


def test_exemplars_carry_the_real_trace_id(fake: tuple[FakeUpstream, str]) -> None:
    """With the tracing observer on, the TTFT exemplar names the request's own trace."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from proxy.observe.tracing import TracingObserver

    _, url = fake
    settings = make_settings(("fake", url))
    spans = InMemorySpanExporter()
    tracer = TracingObserver(settings.tracing, processor=SimpleSpanProcessor(spans))
    with run_proxy(settings, tracer) as proxy, httpx.Client() as c:
        c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True})
        om = c.get(f"{proxy}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}).text
    server = [s for s in spans.get_finished_spans() if s.parent is None or s.kind.name == "SERVER"]
    trace_id = format(server[0].context.trace_id, "032x")
    ttft = [ln for ln in om.splitlines() if ln.startswith("infertap_time_to_first_token_seconds_bucket")]
    assert any(f'trace_id="{trace_id}"' in ln for ln in ttft)
    e2e = [ln for ln in om.splitlines() if ln.startswith("infertap_request_duration_seconds_bucket")]
    assert any(f'trace_id="{trace_id}"' in ln for ln in e2e)


def test_embeddings_access_log_says_usage_when_the_upstream_sent_it(
    fake: tuple[FakeUpstream, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (issue 16): an embeddings line said tokens_source "estimated" despite usage."""
    _, url = fake
    caplog.set_level(logging.INFO, logger="infertap.access")
    with run_proxy(make_settings(("fake", url))) as proxy:
        r = httpx.post(f"{proxy}/v1/embeddings", json={"model": "fake-model", "input": "hello world"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "infertap.access"]
    assert line["route"] == "embeddings" and line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert line["tokens_source"] == "usage"


@given(
    value=st.one_of(st.sampled_from([0.0, *ITL_BUCKETS[:-1]]), st.floats(-1.0, 1e4, allow_nan=False)),
    n=st.integers(1, 500),
    fallback=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_observe_many_equals_as_many_observations(value: float, n: int, fallback: bool) -> None:
    """A burst of events read together is one `observe_many` call
    (proxy/observe/metrics/prometheus.py): it must
    expose exactly what `n` calls of prometheus_client's own `observe` do, boundaries included,
    at once (this prometheus_client) and in the fallback (one that changed its private fields)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from proxy.observe.metrics import prometheus

    assert prometheus.AT_ONCE  # the prometheus_client installed here: the fast path is in use
    observe_many = prometheus._observe_each if fallback else prometheus.observe_many

    one, many = CollectorRegistry(), CollectorRegistry()
    a = Histogram("itl", "gaps", ["m"], buckets=ITL_BUCKETS, registry=one).labels("x")
    b = Histogram("itl", "gaps", ["m"], buckets=ITL_BUCKETS, registry=many).labels("x")
    a.observe(0.25)
    b.observe(0.25)
    for _ in range(n):
        a.observe(value)
    observe_many(b, value, n)
    got, want = (
        [x for x in samples(generate_latest(reg).decode()) if not x[0].endswith("_created")]
        for reg in (many, one)
    )
    assert [(name, labels) for name, labels, _ in got] == [(name, labels) for name, labels, _ in want]
    assert [v for *_, v in got] == pytest.approx([v for *_, v in want], rel=1e-9, abs=1e-6)
