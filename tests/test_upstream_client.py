"""The core against a scripted transport, through the seam (proxy/core/seam.py); and what every
implementation of the seam (proxy/transport/) must do behind it (tests/test_transport.py has the
wire-level tests).

A real client and a real infertap (uvicorn on 127.0.0.1:0); only the upstream side is a script:
each send takes the next step, which fails the send or answers with chunks that may break.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
import pytest

from proxy.app import create_app
from proxy.core.errors import ErrorKind, UpstreamError
from proxy.core.seam import Pool, Timeouts, UpstreamClient, UpstreamResponse
from proxy.settings import RetrySettings
from proxy.tools.fake_upstream import FakeUpstream
from proxy.transport import AiohttpClient, H1Client
from tests.conftest import RecordingObserver, make_settings, serve_in_thread
from tests.promtext import scrape, value

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
EVENTS = [
    b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"Hello"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":" world"}}]}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class Scripted:
    """One scripted answer: `body` items are relayed in order; an UpstreamError among them is a
    read that fails there."""

    status: int = 200
    body: list[bytes | UpstreamError] = field(default_factory=lambda: list(EVENTS))
    content_type: str = "text/event-stream"
    ended: str = ""  # "release" or "close": how the core let go of it
    sent_at: float | None = None  # a scripted answer was never written anywhere

    @property
    def headers(self) -> Mapping[str, str]:
        return {"content-type": self.content_type}

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return [(b"content-type", self.content_type.encode())]

    async def chunks(self) -> AsyncIterator[bytes]:
        for item in self.body:
            if isinstance(item, UpstreamError):
                raise item
            yield item

    async def read(self) -> bytes:
        return b"".join(b for b in self.body if isinstance(b, bytes))

    def release(self) -> None:
        self.ended = self.ended or "release"

    def close(self) -> None:
        self.ended = self.ended or "close"


class ScriptedClient:
    errors: tuple[type[BaseException], ...] = ()

    def __init__(self, *steps: Scripted | UpstreamError) -> None:
        self.steps = deque(steps)
        self.sent: list[tuple[str, str, dict[str, str], bytes | None]] = []
        self.closed = False

    async def send(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        timeouts: Timeouts,
        pool: Pool | None = None,
    ) -> UpstreamResponse:
        self.sent.append((method, url, dict(headers), body))
        step = self.steps.popleft()
        if isinstance(step, UpstreamError):
            raise step
        return step

    async def fetch(self, url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, bytes]:
        return 200, b'{"object":"list","data":[{"id":"m"}]}'

    def error(self, exc: BaseException) -> UpstreamError:
        assert isinstance(exc, UpstreamError)
        return exc

    async def close(self) -> None:
        self.closed = True


def run(client: ScriptedClient, rid: str) -> tuple[httpx.Response, RecordingObserver]:
    rec = RecordingObserver()
    settings = make_settings(("up", "http://upstream.invalid/v1"), retry=RetrySettings(backoff_seconds=0))

    def factory() -> UpstreamClient:
        return client

    with serve_in_thread(create_app(settings, (rec,), client=factory)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"x-request-id": rid}, timeout=10)
        rec.wait_terminal(rid)
    assert client.closed, "the app's lifespan closes the client it made"
    return r, rec


def test_a_failed_send_is_retried_and_the_answer_relayed_unchanged() -> None:
    answer = Scripted()
    client = ScriptedClient(UpstreamError(ErrorKind.CONNECT_ERROR, None, "refused"), answer)
    r, rec = run(client, "retry")
    assert r.status_code == 200 and r.content == b"".join(EVENTS)
    ex = rec.exchanges["retry"]
    assert (ex.outcome, ex.attempts, ex.retries) == ("ok", 2, 1)
    assert answer.ended == "release"
    method, url, headers, _ = client.sent[1]
    assert (method, url, headers["x-request-id"]) == (
        "POST",
        "http://upstream.invalid/v1/chat/completions",
        "retry",
    )


def test_a_read_that_fails_after_the_first_token_is_an_in_band_error() -> None:
    broken = Scripted(body=[*EVENTS[:2], UpstreamError(ErrorKind.STREAM_INTERRUPTED, None, "reset by peer")])
    r, rec = run(ScriptedClient(broken), "cut")
    assert r.status_code == 200
    assert r.content.startswith(b"".join(EVENTS[:2]))
    tail = r.content[len(b"".join(EVENTS[:2])) :]
    assert b'"type":"stream_interrupted"' in tail and b"reset by peer" in tail
    assert rec.exchanges["cut"].outcome == "stream_interrupted"
    assert broken.ended == "close", "a broken answer's connection is dropped, not reused"


def test_every_attempt_failing_ends_with_the_last_kind_and_its_status() -> None:
    timeout = UpstreamError(ErrorKind.CONNECT_TIMEOUT, None, "slow")
    r, rec = run(ScriptedClient(timeout, timeout, timeout), "down")
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "connect_timeout"
    assert rec.exchanges["down"].attempts == 3


# -- a pool per upstream (issue 23, item 13) ---------------------------------------------------------
@pytest.mark.parametrize("client", [AiohttpClient, H1Client], ids=["aiohttp", "httptools"])
def test_long_streams_to_one_upstream_never_make_another_wait(
    client: type[AiohttpClient] | type[H1Client],
) -> None:
    """Regression: one pool with a fixed limit served every upstream, and aiohttp's connect timeout
    included the wait for a slot: streams to `a` filling the pool made a healthy `b` fail with
    connect_timeout, counted against b's circuit. Now each upstream has its own pool; waiting past
    [timeouts] pool is `pool_timeout`, infertap's own queue, never the upstream's fault."""
    a, b = FakeUpstream(), FakeUpstream()
    with serve_in_thread(a) as ua, serve_in_thread(b) as ub:
        settings = make_settings(("a", ua + "/v1"), ("b", ub + "/v1"))
        settings.upstreams[0].models, settings.upstreams[1].models = ["a-*"], ["b-*"]
        settings.retry.max_attempts = 1
        settings.timeouts.connect, settings.timeouts.pool = 1, 0.3
        settings.circuit.min_calls = 1
        app = create_app(settings, client=lambda: client(max_connections=2))
        with serve_in_thread(app) as proxy, httpx.Client(timeout=30) as http, ExitStack() as held:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            reading: list[Iterator[bytes]] = []
            for _ in range(2):  # a's two connections, held open mid-stream
                r = held.enter_context(
                    http.stream(
                        "POST",
                        f"{proxy}/v1/chat/completions",
                        json={**body, "model": "a-1"},
                        headers={"x-fake-hang": "after-first"},
                    )
                )
                assert r.status_code == 200
                reading.append(r.iter_raw())  # kept: a dropped iterator would close the stream
                next(reading[-1])
            ok = http.post(f"{proxy}/v1/chat/completions", json={**body, "model": "b-1", "stream": False})
            assert ok.status_code == 200, ok.text
            full = http.post(f"{proxy}/v1/chat/completions", json={**body, "model": "a-1", "stream": False})
            assert full.status_code == 503
            err = full.json()["error"]
            assert err["type"] == "pool_timeout" and err["message"].startswith("upstream 'a' (http://")
            assert "had all 2 of its connections busy for 0.3 s (pool timeout" in err["message"]
            assert "aiohttp" not in err["message"] and "httptools" not in err["message"]
            assert "Error" not in err["message"]
            text = scrape(proxy)
            assert value(text, "infertap_requests_total", upstream="b", outcome="ok") == 1
            assert value(text, "infertap_timeouts_total", upstream="a", phase="pool") == 1
            assert value(text, "infertap_upstream_up", upstream="a") == 1  # not a's fault
            assert value(text, "infertap_upstream_up", upstream="b") == 1
