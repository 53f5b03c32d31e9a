"""The fault suite: every failure an upstream or a client can produce has a defined, tested result."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.observe.tracing import TracingObserver
from proxy.settings import Settings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, serve_process, wait_until
from tests.promtext import samples, scrape, value

STREAM = {**CHAT, "stream": True}
CLOSED = "http://127.0.0.1:9/v1"  # the discard port: nothing listens, connections are refused


def fast(settings: Settings, attempts: int = 2) -> Settings:
    settings.retry.max_attempts = attempts
    settings.retry.backoff_seconds = 0.01
    settings.timeouts.ttft = 0.5
    settings.timeouts.idle = 0.5
    return settings


def post(proxy: str, body: dict[str, object], **headers: str) -> httpx.Response:
    return httpx.post(f"{proxy}/v1/chat/completions", json=body, headers=headers, timeout=30)


def outcomes(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, lab, v in samples(text):
        if n == "infertap_requests_total" and v:
            out[lab["outcome"]] = out.get(lab["outcome"], 0) + v
    return out


@pytest.fixture
def suite(fake: tuple[FakeUpstream, str]) -> Iterator[tuple[FakeUpstream, str, RecordingObserver]]:
    upstream, url = fake
    rec = RecordingObserver()
    with run_proxy(fast(make_settings(("fake", url))), rec) as proxy:
        yield upstream, proxy, rec


def test_refused_connection_retries_then_502() -> None:
    with run_proxy(fast(make_settings(("dead", CLOSED)), attempts=3)) as proxy:
        r = post(proxy, STREAM)
        text = scrape(proxy)
    assert r.status_code == 502 and r.json()["error"]["type"] == "connect_error"
    assert value(text, "infertap_retries_total", reason="connect_error") == 2
    assert value(text, "infertap_upstream_attempts_total", upstream="dead") == 3
    assert outcomes(text) == {"connect_error": 1}
    assert value(text, "infertap_in_flight_requests") == 0


def test_accepts_and_never_answers_is_a_ttft_timeout(
    suite: tuple[FakeUpstream, str, RecordingObserver],
) -> None:
    upstream, proxy, _ = suite
    r = post(proxy, STREAM, **{"x-fake-hang": "before-headers"})
    text = scrape(proxy)
    assert r.status_code == 504 and r.json()["error"]["type"] == "ttft_timeout"
    assert len(upstream.requests) == 2  # retried once
    assert value(text, "infertap_timeouts_total", phase="ttft") == 2
    assert outcomes(text) == {"ttft_timeout": 1}
    assert value(text, "infertap_in_flight_requests") == 0


def test_stall_before_first_token_is_retried_and_never_half_sent(
    suite: tuple[FakeUpstream, str, RecordingObserver],
) -> None:
    upstream, proxy, _ = suite
    # The role chunk arrives, then nothing: nothing was committed, so the client gets a clean 504.
    r = post(proxy, STREAM, **{"x-fake-hang": "after-role"})
    assert r.status_code == 504 and r.headers["content-type"] == "application/json"
    assert len(upstream.requests) == 2
    assert outcomes(scrape(proxy)) == {"ttft_timeout": 1}


def test_429_retry_after_is_honoured(suite: tuple[FakeUpstream, str, RecordingObserver]) -> None:
    upstream, proxy, _ = suite
    r = post(
        proxy,
        STREAM,
        **{
            "x-fake-fail-first": "1",
            "x-fake-fail-status": "429",
            "x-fake-retry-after": "1",
            "x-request-id": "ra",
        },
    )
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert upstream.arrivals[1] - upstream.arrivals[0] >= 0.9  # waited about the second it was told to
    text = scrape(proxy)
    assert value(text, "infertap_retries_total", reason="rate_limited") == 1
    assert outcomes(text) == {"ok": 1}


def test_503_then_200_is_a_normal_answer(suite: tuple[FakeUpstream, str, RecordingObserver]) -> None:
    upstream, proxy, _ = suite
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="x", max_retries=0)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="fake-model",
            messages=CHAT["messages"],
            stream=True,  # type: ignore[arg-type]
            extra_headers={"x-fake-fail-first": "1", "x-request-id": "r503"},
        )
    )
    client.close()
    assert text == "".join(f"tok{i} " for i in range(5))
    metrics = scrape(proxy)
    assert value(metrics, "infertap_retries_total", reason="upstream_error") == 1
    assert value(metrics, "infertap_upstream_attempts_total", result="upstream_error") == 1
    assert outcomes(metrics) == {"ok": 1}


def test_rejected_stream_options_are_dropped_in_an_ordinary_attempt(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = fast(make_settings(("fake", url)), attempts=1)
    # Each answer takes 1.5 s: within the TTFT timeout per attempt, not for both together.
    settings.timeouts.ttft = 2.5
    settings.timeouts.idle = 10
    rec = RecordingObserver()
    with run_proxy(settings, rec) as proxy:
        script = {"x-fake-reject-stream-options": "1", "x-fake-delay-ms": "1500"}
        r = post(proxy, STREAM, **script, **{"x-request-id": "so"})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        ex = rec.wait_terminal("so")
        hooks = rec.hooks_for("so")
        # Two attempts, each counted, each with its own span, TTFB and deadline; the retry budget of
        # one attempt is not used up by infertap's own addition.
        assert ex.outcome == "ok" and ex.attempts == 2 == len(upstream.requests)
        assert hooks.count("attempt_started") == 2 and hooks.count("first_byte") == 2
        assert hooks.count("retry") == 1
        assert "stream_options" in upstream.requests[0].json()
        assert "stream_options" not in upstream.requests[1].json()
        text = scrape(proxy)
        assert value(text, "infertap_upstream_attempts_total", upstream="fake") == 2
        assert value(text, "infertap_retries_total", reason="stream_options_rejected") == 1
        assert value(text, "infertap_time_to_first_byte_seconds_count") == 2
        # Remembered: the next request goes without it at once.
        assert post(proxy, STREAM, **script, **{"x-request-id": "so2"}).status_code == 200
        assert rec.wait_terminal("so2").attempts == 1 and len(upstream.requests) == 3


def test_400_is_not_retried(suite: tuple[FakeUpstream, str, RecordingObserver]) -> None:
    upstream, proxy, _ = suite
    r = post(proxy, CHAT, **{"x-fake-status": "400"})
    assert r.status_code == 400 and len(upstream.requests) == 1
    text = scrape(proxy)
    assert value(text, "infertap_retries_total") == 0
    assert outcomes(text) == {"client_error": 1}


def test_5xx_on_the_last_attempt_reaches_the_client_unchanged(
    suite: tuple[FakeUpstream, str, RecordingObserver],
) -> None:
    upstream, proxy, _ = suite
    r = post(proxy, CHAT, **{"x-fake-status": "503"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "fake error 503"
    assert len(upstream.requests) == 2


def test_stall_after_first_token_ends_in_an_sse_error(
    suite: tuple[FakeUpstream, str, RecordingObserver],
) -> None:
    _, proxy, rec = suite
    r = post(proxy, STREAM, **{"x-fake-hang": "after-first", "x-request-id": "idle"})
    assert r.status_code == 200
    last = r.text.strip().split("\n\n")[-1]
    assert last.startswith('data: {"error"') and "idle_timeout" in last
    assert rec.wait_terminal("idle").outcome == "idle_timeout"
    text = scrape(proxy)
    assert value(text, "infertap_timeouts_total", phase="idle") == 1
    assert value(text, "infertap_in_flight_requests") == 0


def test_total_timeout_mid_json_answer_aborts_the_connection(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = fast(make_settings(("fake", url)))
    settings.timeouts.idle = 30
    settings.timeouts.total = 1.0
    rec = RecordingObserver()
    with run_proxy(settings, rec) as proxy:
        # Half the JSON answer arrives, then nothing: the total timeout fires while relaying it.
        with pytest.raises(httpx.RemoteProtocolError):
            post(proxy, CHAT, **{"x-fake-hang": "mid-body", "x-request-id": "half"})
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            client.chat.completions.create(
                model="fake-model",
                messages=CHAT["messages"],  # type: ignore[arg-type]
                extra_headers={"x-fake-hang": "mid-body"},
            )
        client.close()
        assert rec.wait_terminal("half").outcome == "total_timeout"
        wait_until(lambda: value(scrape(proxy), "infertap_in_flight_requests") == 0)
        assert outcomes(scrape(proxy)) == {"total_timeout": 2}
    assert len(upstream.requests) == 2


def test_cut_mid_stream_makes_the_sdk_raise(suite: tuple[FakeUpstream, str, RecordingObserver]) -> None:
    _, proxy, rec = suite
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(
            model="fake-model",
            messages=CHAT["messages"],
            stream=True,  # type: ignore[arg-type]
            extra_headers={"x-fake-cut": "3", "x-request-id": "cut"},
        ):
            pass
    client.close()
    assert rec.wait_terminal("cut").outcome == "stream_interrupted"
    assert outcomes(scrape(proxy)) == {"stream_interrupted": 1}


def test_malformed_sse_is_relayed_unchanged(suite: tuple[FakeUpstream, str, RecordingObserver]) -> None:
    upstream, proxy, rec = suite
    r = post(
        proxy,
        {**STREAM, "stream_options": {"include_usage": True}},
        **{"x-fake-malformed": "1", "x-request-id": "bad-sse"},
    )
    assert r.content == bytes(upstream.sent["bad-sse"])
    assert rec.wait_terminal("bad-sse").outcome == "ok"
    r = post(
        proxy,
        {**STREAM, "stream_options": {"include_usage": True}},
        **{"x-fake-malformed": "1", "x-fake-no-done": "1", "x-request-id": "bad-sse-2"},
    )
    assert r.content.startswith(bytes(upstream.sent["bad-sse-2"])) and b"stream_interrupted" in r.content
    assert value(scrape(proxy), "infertap_in_flight_requests") == 0


def test_enormous_single_event_arrives_whole(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    rec = RecordingObserver()
    with run_proxy(make_settings(("fake", url)), rec) as proxy:
        r = post(
            proxy,
            {**STREAM, "stream_options": {"include_usage": True}},
            **{"x-fake-events": "2", "x-fake-event-bytes": str(4 * 1024 * 1024), "x-request-id": "big"},
        )
    assert len(r.content) > 8 * 1024 * 1024
    assert r.content == bytes(upstream.sent["big"])
    assert rec.wait_terminal("big").output_events == 2


def test_very_slow_answer_completes(suite: tuple[FakeUpstream, str, RecordingObserver]) -> None:
    _, proxy, rec = suite
    r = post(proxy, STREAM, **{"x-fake-events": "3", "x-fake-gap-ms": "300", "x-request-id": "slow"})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert rec.wait_terminal("slow").outcome == "ok"


def test_fallback_to_a_healthy_upstream(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = fast(make_settings(("a", CLOSED), ("b", url)))
    settings.upstreams[0].fallback = ["b"]
    rec = RecordingObserver()
    with run_proxy(settings, rec) as proxy:
        r = post(proxy, STREAM, **{"x-request-id": "fb"})
        text = scrape(proxy)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert rec.exchanges["fb"].upstream == "b"
    assert value(text, "infertap_requests_total", upstream="b", outcome="ok") == 1
    assert value(text, "infertap_requests_total", upstream="a") == 0
    assert value(text, "infertap_upstream_attempts_total", upstream="a", result="connect_error") == 2
    assert len(upstream.requests) == 1


def test_circuit_opens_then_probes_and_closes(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = fast(make_settings(("fake", url)), attempts=1)
    settings.circuit.min_calls = 2
    settings.circuit.cooldown_seconds = 2
    settings.circuit.when_all_open = "refuse"
    with run_proxy(settings) as proxy:
        for _ in range(2):
            assert post(proxy, CHAT, **{"x-fake-status": "500"}).status_code == 500
        assert value(scrape(proxy), "infertap_upstream_up", upstream="fake") == 0
        fast_fail = post(proxy, CHAT)
        assert fast_fail.status_code == 503 and fast_fail.json()["error"]["code"] == "circuit_open"
        assert len(upstream.requests) == 2  # the open circuit kept the request away
        # After the cool-down one real request probes the upstream; it is healthy again.
        wait_until(lambda: post(proxy, CHAT).status_code == 200, 10, "the circuit to close")
        assert value(scrape(proxy), "infertap_upstream_up", upstream="fake") == 1


def test_concurrency_cap_answers_429(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = fast(make_settings(("fake", url)))
    settings.server.max_concurrency = 1
    settings.timeouts.ttft = 30
    with run_proxy(settings) as proxy, httpx.Client(timeout=httpx.Timeout(10, read=0.3)) as c:
        with (
            pytest.raises(httpx.ReadTimeout),
            c.stream(
                "POST", f"{proxy}/v1/chat/completions", json=STREAM, headers={"x-fake-hang": "before-headers"}
            ) as hung,
        ):
            wait_until(lambda: len(upstream.requests) == 1, what="the first request to reach the upstream")
            second = httpx.post(f"{proxy}/v1/chat/completions", json=STREAM)
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "too_many_requests"
            hung.read()
        wait_until(lambda: value(scrape(proxy), "infertap_in_flight_requests") == 0)
        assert post(proxy, STREAM).status_code == 200


def test_concurrency_cap_counts_a_request_while_its_body_arrives(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = fast(make_settings(("fake", url)))
    settings.server.max_concurrency = 1
    with run_proxy(settings) as proxy:
        host, port = proxy.removeprefix("http://").split(":")
        body = json.dumps(STREAM).encode()
        # A slow upload: headers and half the body, and the rest only after the second request.
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"x-request-id: slow-upload\r\ncontent-length: %d\r\n\r\n" % len(body) + body[:10]
            )
            # Probes with a broken body: 400 while the upload is not counted yet (nothing reaches the
            # upstream either way), 429 once it is. On main it never was: the probes kept getting 400.
            probes: list[httpx.Response] = []

            def capped() -> bool:
                probes.append(httpx.post(f"{proxy}/v1/chat/completions", content=b"{", timeout=10))
                return probes[-1].status_code == 429

            wait_until(capped, what="the slow upload to count against the cap")
            second = probes[-1]
            assert {p.status_code for p in probes[:-1]} <= {400}
            assert second.headers["retry-after"] == "1"
            err = second.json()["error"]
            assert err["code"] == "too_many_requests" and err["type"] == "rate_limited"
            slow.sendall(body[10:])
            answer = b""
            while not answer.endswith(b"0\r\n\r\n"):
                piece = slow.recv(65536)
                assert piece, "the slow upload's answer was cut"
                answer += piece
        assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
    assert len(upstream.requests) == 1


@pytest.fixture
def keyed(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[FakeUpstream, str]]:
    upstream, url = fake
    monkeypatch.setenv("TEST_CLIENT_KEYS", "sk-alice-1234,sk-bob-5678")
    hashes = tmp_path / "keys.sha256"
    hashes.write_text("# carol\n" + hashlib.sha256(b"sk-carol-9999").hexdigest() + "\n")
    settings = make_settings(("fake", url))
    settings.auth.keys_env = "TEST_CLIENT_KEYS"
    settings.auth.keys_file = str(hashes)
    with run_proxy(settings) as proxy:
        yield upstream, proxy


@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", "sk-alice-1234", "Basic c2stYWxpY2U=", "Bearer"])
def test_client_keys_reject(keyed: tuple[FakeUpstream, str], auth: str | None) -> None:
    upstream, proxy = keyed
    headers = {} if auth is None else {"authorization": auth}
    r = httpx.post(f"{proxy}/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert not upstream.requests
    assert httpx.get(f"{proxy}/healthz").status_code == 200


@pytest.mark.parametrize("key", ["sk-alice-1234", "sk-bob-5678", "sk-carol-9999"])
def test_client_keys_accept(keyed: tuple[FakeUpstream, str], key: str) -> None:
    upstream, proxy = keyed
    r = httpx.post(f"{proxy}/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200 and len(upstream.requests) == 1
    assert "authorization" not in upstream.requests[0].headers  # the client's key stays with infertap


def test_metrics_token(fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = fake
    monkeypatch.setenv("TEST_METRICS_TOKEN", "scrape-me")
    settings = make_settings(("fake", url))
    settings.auth.metrics_token_env = "TEST_METRICS_TOKEN"
    with run_proxy(settings) as proxy:
        assert httpx.get(f"{proxy}/metrics").status_code == 401
        ok = httpx.get(f"{proxy}/metrics", headers={"authorization": "Bearer scrape-me"})
        assert ok.status_code == 200 and "infertap_build_info" in ok.text


def test_upstream_key_appears_nowhere_after_the_fault_suite(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    upstream, url = fake
    secret = "sk-upstream-never-leak-7d3a"
    monkeypatch.setenv("FAULT_UPSTREAM_KEY", secret)
    settings = fast(make_settings(("fake", url), ("dead", CLOSED)))
    settings.upstreams[0].api_key_env = "FAULT_UPSTREAM_KEY"
    settings.upstreams[1].api_key_env = "FAULT_UPSTREAM_KEY"
    settings.upstreams[1].models = ["dead-*"]
    caplog.set_level("DEBUG")
    seen: list[bytes] = []
    spans = InMemorySpanExporter()
    tracer = TracingObserver(settings.tracing, processor=SimpleSpanProcessor(spans))
    faults = [
        {},
        {"x-fake-hang": "before-headers"},
        {"x-fake-hang": "after-first"},
        {"x-fake-cut": "1"},
        {"x-fake-status": "500"},
        {"x-fake-status": "401"},
        {"x-fake-malformed": "1"},
        {"x-fake-fail-first": "1"},
    ]
    with run_proxy(settings, tracer) as proxy:
        for i, h in enumerate(faults):
            r = post(proxy, STREAM, **h, **{"x-request-id": f"k{i}"})
            seen.append(r.content + repr(r.headers).encode())
        r = post(proxy, {**STREAM, "model": "dead-1"})
        seen.append(r.content + repr(r.headers).encode())
        seen.append(scrape(proxy).encode())
        seen.append(httpx.get(f"{proxy}/readyz").content + httpx.get(f"{proxy}/v1/models").content)
    assert all(req.headers.get("authorization") == f"Bearer {secret}" for req in upstream.requests)
    seen.append("".join(span.to_json() for span in spans.get_finished_spans()).encode())
    assert len(spans.get_finished_spans()) > len(faults)
    assert not any(secret.encode() in s for s in seen)
    assert secret not in caplog.text


def _rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_slow_reading_client_keeps_memory_bounded(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    env = {**os.environ, "INFERTAP_METRICS__ACCESS_LOG": "false"}
    with serve_process(
        "--upstream", f"fake={url}", "--forward-header", "x-fake-*", "--log-level", "warning", env=env
    ) as (base, proc):
        before = _rss_kb(proc.pid, "VmRSS")
        total = 0
        # 1,200 events of 64 KiB: about 80 MB that the upstream can produce far faster than this
        # client reads. Buffering it would grow the proxy by as much.
        with (
            httpx.Client(timeout=60) as c,
            c.stream(
                "POST",
                f"{base}/v1/chat/completions",
                json=STREAM,
                headers={"x-fake-events": "1200", "x-fake-event-bytes": str(64 * 1024)},
            ) as r,
        ):
            for piece in r.iter_raw(64 * 1024):
                total += len(piece)
                time.sleep(0.0005)  # a slow reader, on purpose: this is the client under test
        peak = _rss_kb(proc.pid, "VmHWM")
    assert total > 75 * 1024 * 1024
    assert peak - before < 40 * 1024, f"proxy RSS grew by {(peak - before) // 1024} MB for an 80 MB stream"
