"""`[server] stream_headers = "immediately"`: a generation stream's 200 and headers before its first
token, keep-alive comments while it waits, retries still invisible, every failure before the first
token in-band (issue 23, item 8)."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.settings import Settings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, serve_in_thread, wait_until
from tests.promtext import scrape, value
from tests.raw_upstream import not_found, raw_upstream

STREAM = {**CHAT, "stream": True}
KEEP_ALIVE = b": keep-alive\n\n"


def early(settings: Settings, attempts: int = 1, keep_alive: float = 0.02) -> Settings:
    settings.server.stream_headers = "immediately"
    settings.server.stream_keep_alive_seconds = keep_alive
    settings.retry.max_attempts = attempts
    settings.retry.backoff_seconds = 0.01
    settings.timeouts.ttft = 0.5
    settings.timeouts.idle = 0.5
    return settings


def data_events(body: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body; comments (`: keep-alive`) are no events."""
    return [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]


def outcome_count(proxy: str, outcome: str) -> float:
    return value(scrape(proxy), "infertap_requests_total", outcome=outcome)


def settled(proxy: str) -> None:
    wait_until(lambda: value(scrape(proxy), "infertap_in_flight_requests") == 0, what="in-flight back to 0")


def test_headers_arrive_while_the_upstream_has_not_answered(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    with run_proxy(early(make_settings(("fake", url)))) as proxy, httpx.Client(timeout=30) as c:
        with c.stream(
            "POST", f"{proxy}/v1/chat/completions", json=STREAM, headers={"x-fake-hang": "before-headers"}
        ) as r:
            # The upstream never answers: these headers can only be infertap's own.
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
            assert r.headers["x-request-id"]
            wait_until(lambda: len(upstream.requests) == 1, what="the request to reach the upstream")
            body = r.read()
        # The ttft timeout ends it, in-band, as the last event.
        events = data_events(body)
        assert b'"code":"ttft_timeout"' in events[-1] and b"[DONE]" not in body
        assert body.endswith(b"\n\n")
        assert outcome_count(proxy, "ttft_timeout") == 1
        settled(proxy)


def test_a_retry_before_the_first_token_stays_invisible(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    rec = RecordingObserver()
    with run_proxy(early(make_settings(("fake", url)), attempts=2), rec) as proxy:
        r = httpx.post(
            f"{proxy}/v1/chat/completions", json=STREAM, headers={"x-fake-fail-first": "1"}, timeout=30
        )
        assert r.status_code == 200
        events = data_events(r.content)
        assert events[-1] == b"[DONE]" and not any(b'"error"' in e for e in events)
        assert sum(b'"content":"tok' in e for e in events) == 5
        assert len(upstream.requests) == 2
        ex = rec.wait_terminal(r.headers["x-request-id"])
        assert ex.retries == 1 and ex.output_events == 5
        assert outcome_count(proxy, "ok") == 1
        assert value(scrape(proxy), "infertap_retries_total") == 1


@pytest.mark.parametrize(
    ("headers", "total", "code", "outcome"),
    [
        ({"x-fake-hang": "after-role"}, None, "ttft_timeout", "ttft_timeout"),
        ({"x-fake-status": "503"}, None, "upstream_error", "upstream_error"),
        ({"x-fake-status": "400"}, None, "client_error", "client_error"),
        ({"x-fake-hang": "before-headers"}, 0.3, "total_timeout", "total_timeout"),
    ],
)
def test_every_failure_before_the_first_token_ends_in_band(
    fake: tuple[FakeUpstream, str], headers: dict[str, str], total: float | None, code: str, outcome: str
) -> None:
    upstream, url = fake
    settings = early(make_settings(("fake", url)), attempts=2)
    if total is not None:
        settings.timeouts.total = total
        settings.timeouts.ttft = 30
    rec = RecordingObserver()
    with run_proxy(settings, rec) as proxy:
        r = httpx.post(f"{proxy}/v1/chat/completions", json=STREAM, headers=headers, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        last = data_events(r.content)[-1]
        assert f'"code":"{code}"'.encode() in last, r.content
        ex = rec.wait_terminal(r.headers["x-request-id"])
        assert rec.terminal_count(ex.request_id) == 1
        assert ex.outcome is not None and ex.outcome.value == outcome
        assert outcome_count(proxy, outcome) == 1
        settled(proxy)
        if headers.get("x-fake-status") == "503":
            assert len(upstream.requests) == 2  # retried before the first token, as with first_token


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_an_open_circuit_ends_in_band_in_the_routes_shape(fake: tuple[FakeUpstream, str], path: str) -> None:
    upstream, url = fake
    settings = early(make_settings(("fake", url)))
    settings.circuit.min_calls = 1
    settings.circuit.cooldown_seconds = 60
    settings.circuit.when_all_open = "refuse"
    with run_proxy(settings) as proxy:
        # A non-stream request is unaffected: its error keeps its HTTP status.
        failed = httpx.post(f"{proxy}/v1/chat/completions", json=CHAT, headers={"x-fake-status": "500"})
        assert failed.status_code == 500
        responses = {"model": "fake-model", "input": "hi", "stream": True}
        body = responses if path.endswith("responses") else STREAM
        r = httpx.post(f"{proxy}{path}", json=body, timeout=30)
        assert r.status_code == 200
        assert b"circuit_open" in r.content
        if path.endswith("responses"):
            assert b"event: error\n" in r.content and b"event: response.failed\n" in r.content
        else:
            assert data_events(r.content)[-1].startswith(b'{"error":')
        assert len(upstream.requests) == 1  # the open circuit kept it away
        assert outcome_count(proxy, "upstream_error") == 2
        settled(proxy)


def test_keep_alive_comments_while_waiting(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = early(make_settings(("fake", url)))
    settings.timeouts.ttft = 30
    with run_proxy(settings) as proxy:
        with (
            httpx.Client(timeout=30) as c,
            c.stream(
                "POST", f"{proxy}/v1/chat/completions", json=STREAM, headers={"x-fake-hang": "after-role"}
            ) as r,
        ):
            seen = b""
            for raw in r.iter_raw():
                seen += raw
                if seen.count(KEEP_ALIVE) >= 2:
                    break
            # Only comments: the role chunk the upstream sent is held until the first output event.
            assert seen == KEEP_ALIVE * (len(seen) // len(KEEP_ALIVE))
        # The client left: counted as such, nothing left in flight.
        wait_until(lambda: outcome_count(proxy, "client_disconnect") == 1, what="the disconnect")
        settled(proxy)


def test_the_sdk_reads_a_stream_with_comments_and_a_timeout_shorter_than_ttft(
    fake: tuple[FakeUpstream, str],
) -> None:
    """openai-python's read timeout is per read: the comments keep reads alive past it."""
    upstream, url = fake
    settings = early(make_settings(("fake", url)), keep_alive=0.05)
    settings.timeouts.ttft = settings.timeouts.idle = 30
    rec = RecordingObserver()
    with run_proxy(settings, rec) as proxy:
        client = openai.OpenAI(
            base_url=f"{proxy}/v1", api_key="unused", max_retries=0, timeout=openai.Timeout(30, read=0.5)
        )
        with client:
            stream = client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                extra_headers={"x-fake-ttft-ms": "1500"},
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "".join(f"tok{i} " for i in range(5))
        (rid,) = {r for _, r in rec.events}
        ex = rec.wait_terminal(rid)
        assert ex.output_events == 5  # the comments are no output
        assert outcome_count(proxy, "ok") == 1


def test_with_first_token_a_client_timeout_shorter_than_ttft_fails(fake: tuple[FakeUpstream, str]) -> None:
    """The other choice's cost, the regression the issue measured: no byte before the first token."""
    upstream, url = fake
    settings = early(make_settings(("fake", url)))
    settings.server.stream_headers = "first_token"
    settings.timeouts.ttft = settings.timeouts.idle = 30
    with run_proxy(settings) as proxy:
        client = openai.OpenAI(
            base_url=f"{proxy}/v1", api_key="unused", max_retries=0, timeout=openai.Timeout(30, read=0.5)
        )
        with client, pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                extra_headers={"x-fake-ttft-ms": "1500"},
            )
        settled(proxy)


def test_non_stream_and_non_generation_requests_keep_their_status(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    with run_proxy(early(make_settings(("fake", url)))) as proxy:
        r = httpx.post(f"{proxy}/v1/chat/completions", json=CHAT, headers={"x-fake-status": "503"})
        assert r.status_code == 503
        emb = {"model": "fake-model", "input": "hi", "stream": True}
        r = httpx.post(f"{proxy}/v1/embeddings", json=emb, headers={"x-fake-status": "503"})
        assert r.status_code == 503


def test_no_comment_once_the_first_token_is_out(fake: tuple[FakeUpstream, str]) -> None:
    """The comments stop at commit: between the upstream's events, however slow, only its bytes."""
    upstream, url = fake
    settings = early(make_settings(("fake", url)), keep_alive=0.01)
    settings.timeouts.ttft = settings.timeouts.idle = 30
    headers = {"x-fake-ttft-ms": "100", "x-fake-gap-ms": "100", "x-fake-events": "4"}
    with run_proxy(settings) as proxy:
        r = httpx.post(f"{proxy}/v1/chat/completions", json=STREAM, headers=headers, timeout=30)
        body = r.content
        while body.startswith(KEEP_ALIVE):
            body = body[len(KEEP_ALIVE) :]
        assert KEEP_ALIVE not in body and body.endswith(b"data: [DONE]\n\n")
        assert len(data_events(body)) >= 5


def test_shutdown_before_the_first_token_ends_in_band(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = early(make_settings(("fake", url)))
    settings.timeouts.ttft = settings.timeouts.idle = 30
    rec = RecordingObserver()
    app = create_app(settings, [rec])
    with serve_in_thread(app) as proxy, httpx.Client(timeout=30) as c:
        with c.stream(
            "POST", f"{proxy}/v1/chat/completions", json=STREAM, headers={"x-fake-hang": "before-headers"}
        ) as r:
            assert r.status_code == 200
            forwarder = app.runtime.forwarder
            wait_until(lambda: len(forwarder.tasks) == 1, what="the request under way")
            # The drain's deadline, on the server's loop (as Drain calls it).
            next(iter(forwarder.tasks)).get_loop().call_soon_threadsafe(forwarder.shut_down)
            body = r.read()
        error = data_events(body)[-1]
        assert b'"code":"shutdown"' in error and b"shutting down" in error
        ex = rec.wait_terminal(r.headers["x-request-id"])
        assert rec.terminal_count(ex.request_id) == 1 and str(ex.outcome) == "shutdown"
        assert outcome_count(proxy, "shutdown") == 1
        settled(proxy)


def test_the_upstreams_comments_reach_the_client_while_it_waits() -> None:
    """Issue 24, item 13: in an early stream the upstream's own keep-alive comments go on as they
    arrive, before the first token, so a load balancer sees the upstream's traffic; the events held
    with them (a role chunk) still wait for the commit (before: the comments were held too, so
    the upstream, which sends its first token only once the client has its comment, never did and
    the request ended at its ttft timeout)."""
    client_saw_it = threading.Event()
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    first = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n" % len(data) + data + b"\r\n"

    def answer(path: str, headers: dict[str, str]) -> list[bytes | threading.Event]:
        if "x-test-case" not in headers:  # the background model-list checks
            return [not_found(path, headers)]
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        # A comment whose event is not complete yet (no blank line) is not passed on: it comes whole.
        return [
            head + chunk(b": upstream-ping\n\n" + role + b": half"),
            client_saw_it,
            chunk(b" a comment\n\n" + first + b"data: [DONE]\n\n") + b"0\r\n\r\n",
        ]

    with raw_upstream(answer) as url:
        settings = early(make_settings(("raw", url)), keep_alive=600)  # infertap's own: none here
        settings.timeouts.ttft = settings.timeouts.idle = 10
        with run_proxy(settings) as proxy, httpx.Client(timeout=30) as c:
            try:
                with c.stream(
                    "POST", f"{proxy}/v1/chat/completions", json=STREAM, headers={"x-test-case": "ping"}
                ) as r:
                    body = b""
                    for raw in r.iter_raw():
                        body += raw
                        if b": upstream-ping\n\n" in body and not client_saw_it.is_set():
                            # Nothing else yet: the role chunk is held until the first token.
                            assert body == b": upstream-ping\n\n"
                            client_saw_it.set()
            finally:
                client_saw_it.set()
    # A comment that comes with the first token goes in its place among the events.
    assert body == b": upstream-ping\n\n" + role + b": half a comment\n\n" + first + b"data: [DONE]\n\n", body
