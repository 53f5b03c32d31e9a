"""OpenTelemetry spans, end to end: client -> infertap (+ TracingObserver) -> a real upstream."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind, StatusCode

from proxy.core.asgi import Receive, Scope, Send
from proxy.core.exchange import Exchange, Outcome
from proxy.core.hooks import ObserverSet
from proxy.observe.tracing import TracingObserver, build_tracing, export_config
from proxy.settings import ConfigError, TracingSettings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import (
    CHAT,
    RecordingObserver,
    make_settings,
    run_proxy,
    serve_in_thread,
    serve_process,
    wait_until,
)
from tests.otlp_receiver import otlp_grpc_receiver, otlp_http_receiver

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's OTEL_* variables must not change what these tests see."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


@dataclass
class Traced:
    observer: TracingObserver
    exporter: InMemorySpanExporter
    rec: RecordingObserver

    def spans(self, rid: str) -> list[ReadableSpan]:
        self.rec.wait_terminal(rid)  # the tracing observer ran its terminal hook before this one
        return [
            s
            for s in self.exporter.get_finished_spans()
            if (s.attributes or {}).get("infertap.request_id") == rid
        ]

    def server(self, rid: str) -> ReadableSpan:
        (span,) = [s for s in self.spans(rid) if s.kind is SpanKind.SERVER]
        return span

    def attempts(self, rid: str) -> list[ReadableSpan]:
        spans = [s for s in self.spans(rid) if s.kind is SpanKind.CLIENT]
        return sorted(spans, key=lambda s: s.start_time or 0)


def _traced(**tracing: Any) -> Traced:
    exporter = InMemorySpanExporter()
    observer = TracingObserver(TracingSettings(**tracing), processor=SimpleSpanProcessor(exporter))
    return Traced(observer, exporter, RecordingObserver())


@pytest.fixture
def traced() -> Traced:
    return _traced()


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _events(span: ReadableSpan) -> dict[str, dict[str, Any]]:
    return {e.name: dict(e.attributes or {}) for e in span.events}


def _wall(ex: Exchange, t: float | None) -> int:
    assert t is not None
    return ex.started_unix_ns + int((t - ex.received_at) * 1e9)


def _hexes(traceparent: str) -> tuple[str, str, bool]:
    """(trace id, span id, sampled) of a W3C traceparent."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, span_id, bool(int(flags, 16) & 1)


def _port(url: str) -> int:
    port = httpx.URL(url).port
    assert port is not None
    return port


def test_stream_makes_a_server_span_and_an_attempt_span(
    fake: tuple[FakeUpstream, str], traced: Traced
) -> None:
    upstream, url = fake
    body = {**CHAT, "stream": True, "max_tokens": 50, "temperature": 0.5, "top_p": 0.9}
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        r = httpx.post(
            f"{proxy}/v1/chat/completions",
            json=body,
            headers={"x-request-id": "tr-stream", "x-fake-events": "4"},
        )
        assert r.status_code == 200
        server, (attempt,) = traced.server("tr-stream"), traced.attempts("tr-stream")
        ex = traced.rec.exchanges["tr-stream"]

    assert server.name == attempt.name == "chat fake-model"
    assert attempt.parent is not None and attempt.parent.span_id == server.context.span_id
    assert attempt.context.trace_id == server.context.trace_id
    assert server.parent is None  # no traceparent came in: a new trace
    assert ex.trace_id == format(server.context.trace_id, "032x")

    a = _attrs(server)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.model"] == "fake-model"
    assert a["gen_ai.response.model"] == "fake-model"
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.request.max_tokens"] == 50
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.response.id"] == "chatcmpl-fake"
    assert a["gen_ai.response.finish_reasons"] == ("stop",)
    assert a["gen_ai.usage.input_tokens"] == 7 and a["gen_ai.usage.output_tokens"] == 4
    assert a["infertap.output_tokens_source"] == "usage"
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == _port(url)
    assert a["http.response.status_code"] == 200
    assert a["infertap.upstream"] == "fake" and a["infertap.outcome"] == "ok"
    assert a["infertap.attempts"] == 1 and a["infertap.retries"] == 0
    assert a["infertap.prompt_class"] == "<1k"
    assert "error.type" not in a
    # The same numbers as the metrics: the Exchange's own properties, unrounded.
    assert a["infertap.ttft_s"] == ex.ttft == a["gen_ai.response.time_to_first_chunk"]
    assert a["infertap.tpot_s"] == ex.tpot and a["infertap.ttfb_s"] == ex.ttfb
    assert ex.duration is not None and server.end_time is not None
    assert server.start_time == ex.started_unix_ns
    assert server.end_time - server.start_time == int(ex.duration * 1e9)
    assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a  # not by default

    first = [e for e in server.events if e.name == "first_token"]
    assert len(first) == 1 and first[0].timestamp == _wall(ex, ex.first_token_at)
    assert server.status.status_code is StatusCode.OK

    b = _attrs(attempt)
    assert b["infertap.attempt"] == 1 and b["http.response.status_code"] == 200
    assert b["gen_ai.request.model"] == "fake-model" and b["server.port"] == _port(url)
    assert "gen_ai.usage.output_tokens" not in b  # usage is counted once, on the request's span
    assert attempt.start_time == _wall(ex, ex.attempt_started_at)
    assert attempt.status.status_code is StatusCode.OK

    # The upstream joins the trace under the attempt span.
    sent = upstream.requests[-1].headers["traceparent"]
    assert _hexes(sent) == (
        format(attempt.context.trace_id, "032x"),
        format(attempt.context.span_id, "016x"),
        True,
    )


def test_plain_json_request_and_estimated_tokens(fake: tuple[FakeUpstream, str], traced: Traced) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        r = httpx.post(f"{proxy}/v1/chat/completions", json=CHAT, headers={"x-request-id": "tr-json"})
        assert r.status_code == 200
        r = httpx.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": False}},
            headers={"x-request-id": "tr-est", "x-fake-events": "3"},
        )
        assert r.status_code == 200
        plain, est = _attrs(traced.server("tr-json")), _attrs(traced.server("tr-est"))
    assert plain["gen_ai.request.stream"] is False
    assert plain["gen_ai.usage.output_tokens"] == 5 and plain["infertap.output_tokens_source"] == "usage"
    assert "infertap.ttft_s" not in plain  # no stream, no first token
    assert est["gen_ai.usage.output_tokens"] == 3 and est["infertap.output_tokens_source"] == "estimated"
    assert "gen_ai.usage.input_tokens" not in est


def test_retried_503_makes_two_attempt_spans_and_ends_in_error(
    fake: tuple[FakeUpstream, str], traced: Traced
) -> None:
    upstream, url = fake
    settings = make_settings(("fake", url))
    settings.retry.max_attempts = 2
    settings.retry.backoff_seconds = 0
    with run_proxy(settings, traced.observer, traced.rec) as proxy:
        r = httpx.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-request-id": "tr-503", "x-fake-status": "503"},
        )
        assert r.status_code == 503
        server, attempts = traced.server("tr-503"), traced.attempts("tr-503")
    assert [_attrs(s)["infertap.attempt"] for s in attempts] == [1, 2]
    for span in attempts:
        assert span.status.status_code is StatusCode.ERROR
        assert _attrs(span)["error.type"] == "upstream_error"
        assert _attrs(span)["http.response.status_code"] == 503
    retry = _events(server)["retry"]
    assert retry == {
        "infertap.retry.reason": "upstream_error",
        "infertap.retry.backoff_s": 0.0,
        "infertap.attempt": 1,
    }
    a = _attrs(server)
    assert a["infertap.attempts"] == 2 and a["infertap.retries"] == 1
    assert a["error.type"] == "upstream_error" == a["infertap.outcome"]
    assert server.status.status_code is StatusCode.ERROR
    # Each attempt carried its own span's context upstream.
    sent = [_hexes(q.headers["traceparent"])[1] for q in upstream.requests[-2:]]
    assert sent == [format(s.context.span_id, "016x") for s in attempts]


class _FlakyUpstream:
    """Answers the first `failures` generation requests with 503, then behaves like FakeUpstream."""

    def __init__(self, failures: int) -> None:
        self.inner = FakeUpstream()
        self.failures = failures

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/completions") and self.failures > 0:
            self.failures -= 1
            while (await receive()).get("more_body"):
                pass
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"error": {"message": "busy"}}'})
            return
        await self.inner(scope, receive, send)


def test_retry_then_success(traced: Traced) -> None:
    flaky = _FlakyUpstream(failures=1)
    with serve_in_thread(flaky) as url:
        settings = make_settings(("flaky", url + "/v1"))
        settings.retry.backoff_seconds = 0
        with run_proxy(settings, traced.observer, traced.rec) as proxy:
            r = httpx.post(
                f"{proxy}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers={"x-request-id": "tr-flaky"},
            )
            assert r.status_code == 200
            server, (first, second) = traced.server("tr-flaky"), traced.attempts("tr-flaky")
    assert first.status.status_code is StatusCode.ERROR and _attrs(first)["error.type"] == "upstream_error"
    assert second.status.status_code is StatusCode.OK and "error.type" not in _attrs(second)
    assert first.end_time is not None and second.start_time is not None
    assert first.end_time <= second.start_time
    assert server.status.status_code is StatusCode.OK
    assert _events(server)["retry"]["infertap.retry.reason"] == "upstream_error"
    assert _attrs(server)["infertap.retries"] == 1


@pytest.mark.parametrize(
    ("timeout", "hang", "outcome", "phase"),
    [
        ("idle", "after-first", "idle_timeout", "idle"),
        ("ttft", "after-role", "ttft_timeout", "ttft"),
        ("total", "after-first", "total_timeout", "total"),
    ],
)
def test_timeout_ends_the_span_in_error(
    fake: tuple[FakeUpstream, str], traced: Traced, timeout: str, hang: str, outcome: str, phase: str
) -> None:
    _, url = fake
    settings = make_settings(("fake", url))
    setattr(settings.timeouts, timeout, 0.3)
    settings.retry.max_attempts = 1
    with run_proxy(settings, traced.observer, traced.rec) as proxy:
        httpx.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-request-id": "tr-timeout", "x-fake-hang": hang},
            timeout=10,
        )
        server, (attempt,) = traced.server("tr-timeout"), traced.attempts("tr-timeout")
        ex = traced.rec.exchanges["tr-timeout"]
    assert ex.outcome == outcome
    assert server.status.status_code is StatusCode.ERROR
    assert _attrs(server)["error.type"] == outcome == _attrs(server)["infertap.outcome"]
    assert _events(server)["timeout"] == {"infertap.timeout.phase": phase}
    assert ("first_token" in _events(server)) == (hang == "after-first")
    assert attempt.status.status_code is StatusCode.ERROR and _attrs(attempt)["error.type"] == outcome


def test_client_disconnect_ends_the_span(fake: tuple[FakeUpstream, str], traced: Traced) -> None:
    upstream, url = fake
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        with (
            httpx.Client(timeout=10) as c,
            c.stream(
                "POST",
                f"{proxy}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers={"x-request-id": "tr-gone", "x-fake-hang": "after-first"},
            ) as r,
        ):
            for line in r.iter_lines():
                if "tok0" in line:
                    break  # leave after the first token: closing the stream drops the connection
        assert upstream.disconnected.wait(10)
        server, (attempt,) = traced.server("tr-gone"), traced.attempts("tr-gone")
    assert _attrs(server)["infertap.outcome"] == "client_disconnect"
    assert server.status.status_code is StatusCode.ERROR
    assert _attrs(server)["error.type"] == "client_disconnect"
    assert _events(server)["client_disconnect"] == {"infertap.disconnect.phase": "streaming"}
    assert attempt.status.status_code is StatusCode.ERROR


def test_stream_interrupted_event(fake: tuple[FakeUpstream, str], traced: Traced) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        httpx.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-request-id": "tr-cut", "x-fake-no-done": "1"},
        )
        server = traced.server("tr-cut")
    assert _attrs(server)["error.type"] == "stream_interrupted"
    assert "stream_interrupted" in _events(server)
    assert server.status.status_code is StatusCode.ERROR


def test_caller_faults_leave_the_server_span_unset(fake: tuple[FakeUpstream, str], traced: Traced) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        r = httpx.post(
            f"{proxy}/v1/chat/completions",
            json=CHAT,
            headers={"x-request-id": "tr-400", "x-fake-status": "400"},
        )
        assert r.status_code == 400
        r = httpx.post(f"{proxy}/v1/chat/completions", content=b"{nope", headers={"x-request-id": "tr-bad"})
        assert r.status_code == 400
        relayed, (attempt,) = traced.server("tr-400"), traced.attempts("tr-400")
        rejected = traced.server("tr-bad")
        assert traced.attempts("tr-bad") == []
    # OTel HTTP conventions: a SERVER span is not in error for the caller's own 4xx ...
    assert relayed.status.status_code is StatusCode.UNSET
    assert _attrs(relayed)["infertap.outcome"] == "client_error" and "error.type" not in _attrs(relayed)
    assert _attrs(relayed)["http.response.status_code"] == 400
    # ... while the CLIENT span of the attempt that got it is.
    assert attempt.status.status_code is StatusCode.ERROR and _attrs(attempt)["error.type"] == "client_error"
    assert rejected.status.status_code is StatusCode.UNSET and rejected.name == "chat"
    assert _attrs(rejected)["infertap.outcome"] == "rejected"


def test_other_routes_are_named_by_method_and_route(fake: tuple[FakeUpstream, str], traced: Traced) -> None:
    _, url = fake
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        r = httpx.post(f"{proxy}/v1/moderations", json=CHAT, headers={"x-request-id": "tr-other"})
        assert r.status_code == 200
        server = traced.server("tr-other")
    assert server.name == "POST other"
    assert "gen_ai.operation.name" not in _attrs(server)


def test_incoming_traceparent_is_continued_upstream(fake: tuple[FakeUpstream, str], traced: Traced) -> None:
    upstream, url = fake
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        r = httpx.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={
                "x-request-id": "tr-parent",
                "traceparent": f"00-{TRACE}-{PARENT}-01",
                "tracestate": "vendor=abc",
            },
        )
        assert r.status_code == 200
        server, (attempt,) = traced.server("tr-parent"), traced.attempts("tr-parent")
        ex = traced.rec.exchanges["tr-parent"]
    assert format(server.context.trace_id, "032x") == TRACE == ex.trace_id
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT
    assert server.parent.is_remote
    got = upstream.requests[-1].headers
    assert _hexes(got["traceparent"]) == (TRACE, format(attempt.context.span_id, "016x"), True)
    assert got["tracestate"] == "vendor=abc"


def test_unsampled_parent_records_nothing_but_still_propagates(
    fake: tuple[FakeUpstream, str], traced: Traced
) -> None:
    upstream, url = fake
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        r = httpx.post(
            f"{proxy}/v1/chat/completions",
            json=CHAT,
            headers={"x-request-id": "tr-unsampled", "traceparent": f"00-{TRACE}-{PARENT}-00"},
        )
        assert r.status_code == 200
        assert traced.spans("tr-unsampled") == []
        ex = traced.rec.exchanges["tr-unsampled"]
    assert ex.trace_id is None  # no exemplar may point at a trace that was not recorded
    trace_id, _, sampled = _hexes(upstream.requests[-1].headers["traceparent"])
    assert (trace_id, sampled) == (TRACE, False)


def test_sample_ratio_zero_records_no_root_spans(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    traced = _traced(sample_ratio=0.0)
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        assert httpx.post(
            f"{proxy}/v1/chat/completions", json=CHAT, headers={"x-request-id": "r0"}
        ).is_success
        assert traced.spans("r0") == []


def test_no_credentials_in_any_span(fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch) -> None:
    upstream, url = fake
    upstream_key, client_key = "sk-upstream-SECRET-4242", "sk-client-SECRET-1717"
    monkeypatch.setenv("INFERTAP_TEST_TRACE_KEY", upstream_key)
    settings = make_settings(("fake", url))
    settings.upstreams[0].api_key_env = "INFERTAP_TEST_TRACE_KEY"
    settings.retry.backoff_seconds = 0
    traced = _traced(capture_content=True)
    with run_proxy(settings, traced.observer, traced.rec) as proxy:
        for rid, extra in (("k-ok", {}), ("k-503", {"x-fake-status": "503"})):
            httpx.post(
                f"{proxy}/v1/chat/completions",
                json={**CHAT, "stream": True},
                headers={"x-request-id": rid, "authorization": f"Bearer {client_key}", **extra},
            )
            assert traced.spans(rid)
    assert upstream.requests[-1].headers["authorization"] == f"Bearer {upstream_key}"  # it was in play
    dumped = "\n".join(s.to_json() for s in traced.exporter.get_finished_spans())
    for secret in (upstream_key, client_key, "Bearer"):
        assert secret not in dumped


def test_content_is_captured_only_when_asked_and_truncated() -> None:
    @dataclass(eq=False)
    class WithContent(Exchange):  # the Exchange fields proposed for content capture
        request_json: dict[str, Any] | None = None
        output_text: str | None = None

    def run(observer: TracingObserver, ex: WithContent) -> None:
        observer.request_received(ex)
        ex.finished_at = ex.received_at + 0.5
        ex.outcome = Outcome.OK
        ex.finish_reasons = ["stop"]
        observer.ended(ex)

    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "x" * 30}, {"type": "image_url", "image_url": {}}],
        },
    ]
    for capture in (False, True):
        traced = _traced(capture_content=capture, content_max_chars=20)
        ex = WithContent("c-1", "chat.completions", "POST", "/v1/chat/completions", model="m")
        ex.request_json, ex.output_text = {"model": "m", "messages": messages}, "y" * 50
        run(traced.observer, ex)
        (span,) = traced.exporter.get_finished_spans()
        a = _attrs(span)
        if not capture:
            assert not any(k.startswith("gen_ai.input") or k.startswith("gen_ai.output") for k in a)
            continue
        assert json.loads(str(a["gen_ai.input.messages"])) == [
            {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
            {"role": "user", "parts": [{"type": "text", "content": "x" * 12}, {"type": "image_url"}]},
        ]
        assert json.loads(str(a["gen_ai.output.messages"])) == [
            {"role": "assistant", "parts": [{"type": "text", "content": "y" * 20}], "finish_reason": "stop"}
        ]
        assert a["infertap.content_truncated"] is True


@pytest.mark.skipif(
    "output_text" not in Exchange.__dataclass_fields__,
    reason="needs the core's content fields (Exchange.request_json, capture_output_chars, output_text)",
)
@pytest.mark.parametrize("stream", [True, False])
def test_content_capture_end_to_end(fake: tuple[FakeUpstream, str], stream: bool) -> None:
    _, url = fake
    traced = _traced(capture_content=True, content_max_chars=12)
    with run_proxy(make_settings(("fake", url)), traced.observer, traced.rec) as proxy:
        r = httpx.post(
            f"{proxy}/v1/chat/completions",
            json={**CHAT, "stream": stream},
            headers={"x-request-id": "cc", "x-fake-events": "5"},
        )
        assert r.status_code == 200
        a = _attrs(traced.server("cc"))
    assert json.loads(str(a["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text", "content": "hello"}]}
    ]
    text = "tok0 tok1 to" if stream else "tok tok tok "
    assert json.loads(str(a["gen_ai.output.messages"])) == [
        {"role": "assistant", "parts": [{"type": "text", "content": text}], "finish_reason": "stop"}
    ]
    assert a["infertap.content_truncated"] is True


# -- setup from settings and the standard environment ------------------------------------------
def test_tracing_is_off_without_an_endpoint() -> None:
    assert build_tracing(make_settings(("a", "http://127.0.0.1:9/v1"))) is None


@pytest.mark.parametrize(
    ("env", "endpoint", "protocol", "expect"),
    [
        ({}, "http://col:4318", "http/protobuf", ("http://col:4318/v1/traces", "http/protobuf")),
        ({}, "http://col:4318/v1/traces", "http/protobuf", ("http://col:4318/v1/traces", "http/protobuf")),
        ({}, "http://col:4317", "grpc", ("http://col:4317", "grpc")),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318/"}, "http://col:4318", "http/protobuf",
         ("http://env:4318/v1/traces", "http/protobuf")),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://sig:9/x"}, "http://col:4318", "http/protobuf",
         ("http://sig:9/x", "http/protobuf")),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, None,
         "http/protobuf", ("http://env:4317", "grpc")),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
         "http://col:4317", "http/protobuf", ("http://col:4317", "grpc")),
        ({"OTEL_SDK_DISABLED": "true"}, "http://col:4318", "http/protobuf", None),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4318"}, None,
         "http/protobuf", None),
        ({}, None, "http/protobuf", None),
    ],
)  # fmt: skip
def test_export_config_env_wins(
    env: dict[str, str], endpoint: str | None, protocol: str, expect: tuple[str, str] | None
) -> None:
    cfg = export_config(TracingSettings(endpoint=endpoint, protocol=protocol), env)
    assert (None if cfg is None else (cfg.endpoint, cfg.protocol)) == expect


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="http/json"):
        export_config(
            TracingSettings(endpoint="http://col:4318"), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )


def test_resource_and_sampler_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = TracingSettings(service_name="from-settings", sample_ratio=0.25)
    exporter = InMemorySpanExporter()
    plain = TracingObserver(settings, processor=SimpleSpanProcessor(exporter))
    assert plain.provider.resource.attributes["service.name"] == "from-settings"
    assert "0.25" in plain.provider.sampler.get_description()
    plain.close()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test,service.name=ignored")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    env = TracingObserver(settings, processor=SimpleSpanProcessor(exporter))
    assert env.provider.resource.attributes["service.name"] == "from-env"
    assert env.provider.resource.attributes["deployment.environment.name"] == "test"
    assert env.provider.sampler.get_description() == "AlwaysOffSampler"
    env.close()
    assert (
        TracingObserver(settings, processor=SimpleSpanProcessor(exporter), sampler=ALWAYS_ON).provider.sampler
        is ALWAYS_ON
    )


def test_a_dead_collector_never_breaks_a_request(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = fake
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")  # keeps shutdown's last try short
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    settings = make_settings(("fake", url))
    settings.tracing.endpoint = f"http://127.0.0.1:{dead}"
    observer = build_tracing(settings)
    assert observer is not None
    settings.tracing.endpoint = None  # the proxy's own wiring must not add a second tracer
    with run_proxy(settings, observer) as proxy:
        for _ in range(5):
            r = httpx.post(f"{proxy}/v1/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


def test_grpc_export_reaches_a_receiver(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with otlp_grpc_receiver() as (received, endpoint):
        settings = make_settings(("fake", url))
        settings.tracing.endpoint, settings.tracing.protocol = endpoint, "grpc"
        observer = build_tracing(settings)
        assert observer is not None
        settings.tracing.endpoint = None
        with run_proxy(settings, observer) as proxy:
            assert httpx.post(f"{proxy}/v1/chat/completions", json=CHAT).status_code == 200
        # Leaving run_proxy shut the app down, and close() flushed the batch.
        spans = received.snapshot()
    assert sorted(s.name for s in spans) == ["chat fake-model", "chat fake-model"]
    assert {s.resource["service.name"] for s in spans} == {"infertap"}


@pytest.fixture
def otlp_http() -> Iterator[tuple[Any, str]]:
    with otlp_http_receiver() as pair:
        yield pair


def test_serve_exports_to_otlp_http_from_the_standard_env(
    fake: tuple[FakeUpstream, str], otlp_http: tuple[Any, str], tmp_path: Path
) -> None:
    upstream, url = fake
    received, collector = otlp_http
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERTAP_"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=collector,
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_SERVICE_NAME="infertap-under-test",
    )
    args = ("--upstream", f"fake={url}", "--log-level", "warning")
    with serve_process(*args, env=env, log=tmp_path / "serve.log") as (base, _):
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"x-request-id": "otlp-1", "traceparent": f"00-{TRACE}-{PARENT}-01"},
        )
        assert r.status_code == 200
        wait_until(lambda: len(received.snapshot()) >= 2, 15, "spans at the OTLP receiver")
    spans = received.snapshot()
    assert set(received.paths) == {"/v1/traces"}
    by_kind = {s.span.kind: s for s in spans if s.attributes.get("infertap.request_id") == "otlp-1"}
    server, client = by_kind[2], by_kind[3]  # SPAN_KIND_SERVER, SPAN_KIND_CLIENT
    assert server.resource["service.name"] == "infertap-under-test"
    assert server.span.trace_id.hex() == TRACE and server.span.parent_span_id.hex() == PARENT
    assert client.span.parent_span_id == server.span.span_id
    assert server.name == "chat fake-model" and server.attributes["infertap.outcome"] == "ok"
    assert server.attributes["gen_ai.usage.output_tokens"] == 5
    assert _hexes(upstream.requests[-1].headers["traceparent"])[:2] == (TRACE, client.span.span_id.hex())


def test_the_tracing_observer_takes_a_python_subclass() -> None:
    """Compiled, TracingObserver is a native class: open to subclasses that are not, as a user's
    observer built on it would be, its hooks reached through the subclass's overrides."""

    class Counting(TracingObserver):
        name = "counting"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.ended_calls = 0

        def ended(self, ex: Exchange) -> None:
            self.ended_calls += 1
            super().ended(ex)

    exporter = InMemorySpanExporter()
    observer = Counting(TracingSettings(), processor=SimpleSpanProcessor(exporter))
    ex = Exchange("sub-1", "chat.completions", "POST", "/v1/chat/completions", model="m")
    ObserverSet([observer]).request_received(ex)
    ex.finished_at, ex.outcome = ex.received_at + 0.25, Outcome.OK
    ObserverSet([observer]).ended(ex)
    assert observer.ended_calls == 1
    (span,) = exporter.get_finished_spans()
    assert span.name == "chat m" and _attrs(span)["infertap.request_id"] == "sub-1"
