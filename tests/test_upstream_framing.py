"""An upstream that breaks HTTP's own framing mid-answer (issue 24, item 15): a bad chunk-size
line, a size that overflows, a chunk without its CRLF, bytes after the last chunk, a connection
closed mid-chunk, a Content-Length answer that sends less and then stalls or closes, a body
delimited by the close, a response head sent again mid-body, a 1 GB chunk declared then dropped,
and NUL or invalid UTF-8 inside the SSE data.

Whatever the fault, and wherever it falls (before the first token, or after): the client gets an
answer that ends (a stream: well-formed events and then `[DONE]` or infertap's in-band error event;
a body that is no stream: complete, or an aborted connection), the request's outcome is never
`client_disconnect`, and infertap closes the upstream's socket (never left open, never reused for
another request). A hang shows as the client's own timeout (30 s), far beyond infertap's idle
timeout (0.25 s) here.

The tests drive a real infertap end to end (its HTTP client, whichever one it is, included) in
front of a raw socket upstream. CI runs every fault at three points plus INFERTAP_SSE_EXAMPLES
(default 25) randomized ones; `INFERTAP_SSE_EXAMPLES=2000` is the long run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.exchange import Outcome
from tests import loop_thread
from tests.conftest import RecordingObserver, make_settings, run_proxy
from tests.sse_read import sse_events

EXAMPLES = int(os.environ.get("INFERTAP_SSE_EXAMPLES", "25"))


def _delta(text: str) -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}}],
    }
    return json.dumps(obj, separators=(",", ":")).encode()


GOOD = b"".join(b"data: " + _delta(w) + b"\n\n" for w in ("one", " two", " three")) + b"data: [DONE]\n\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
JSON_BODY = json.dumps(
    {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "x" * 200}}]}
).encode()


def _chunks(body: bytes, piece: int = 61) -> bytes:
    return b"".join(
        b"%x\r\n" % len(body[i : i + piece]) + body[i : i + piece] + b"\r\n"
        for i in range(0, len(body), piece)
    )


def _chunked_head(head: bytes = SSE_HEAD) -> bytes:
    return head + b"transfer-encoding: chunked\r\n\r\n"


# Each fault: (the body that is sent, where in it the fault falls) -> the raw answer. The answer is
# then followed by the connection's close, or (held) by silence until infertap closes it.
FAULTS: dict[str, Callable[[bytes, int], bytes]] = {
    "bad-chunk-size": lambda b, at: (
        _chunked_head() + _chunks(b[:at]) + b"zz\r\n" + _chunks(b[at:]) + b"0\r\n\r\n"
    ),
    "overflowing-chunk-size": lambda b, at: (
        _chunked_head() + _chunks(b[:at]) + b"1" + b"0" * 40 + b"\r\n" + b[at:] + b"\r\n0\r\n\r\n"
    ),
    "chunk-without-crlf": lambda b, at: (
        _chunked_head() + _chunks(b[:at]) + b"%x\r\n" % len(b[at:]) + b[at:] + b"5\r\nhello\r\n0\r\n\r\n"
    ),
    "bytes-after-last-chunk": lambda b, at: (
        _chunked_head()
        + _chunks(b)
        + b"0\r\n\r\n"
        + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"[:at]
    ),
    "closed-mid-chunk": lambda b, at: (
        _chunked_head() + _chunks(b[:at]) + b"%x\r\n" % (len(b) - at + 10) + b[at:]
    ),
    "short-content-length": lambda b, at: SSE_HEAD + b"content-length: %d\r\n\r\n" % (len(b) + 100) + b[:at],
    "close-delimited": lambda b, at: SSE_HEAD + b"connection: close\r\n\r\n" + b[:at],
    "head-again-mid-body": lambda b, at: (
        _chunked_head() + _chunks(b[:at]) + _chunked_head() + _chunks(b[at:]) + b"0\r\n\r\n"
    ),
    "a-1gb-chunk-then-close": lambda b, at: _chunked_head() + _chunks(b[:at]) + b"40000000\r\n" + b[at:],
    # aiohttp hands a 101 over as the final answer (an upgrade), whatever was asked.
    "switching-protocols": lambda b, at: (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n" + b[:at]
    ),
    "not-http": lambda b, at: b"SSH-2.0-OpenSSH_9.6\r\n" + b[:at],
    "nul-and-invalid-utf8-in-data": lambda b, at: (
        _chunked_head() + _chunks(b[:at] + b"data: \x00\xff\xfe\xc0\xae{\x00\n\n" + b[at:]) + b"0\r\n\r\n"
    ),
}
POINTS = {"at-0": 0, "before-first-token": 20, "after-first-token": len(b"data: " + _delta("one") + b"\n\n")}


@dataclass
class Connection:
    """One connection as the upstream saw it: the cases it carried (a kept-alive one: several; one
    that infertap gave up on before its request went out: none), and whether it is closed."""

    cases: list[str] = field(default_factory=list)
    closed: threading.Event = field(default_factory=threading.Event)


@dataclass
class Upstream:
    """A raw upstream answering `answers[x-test-case]` (then closing, or holding the connection
    open for infertap to close or send its next request on)."""

    url: str = ""
    answers: dict[str, tuple[bytes, bool]] = field(default_factory=dict)
    connections: list[Connection] = field(default_factory=list)

    def carried(self) -> list[list[str]]:
        return [list(c.cases) for c in list(self.connections)]


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    loop = asyncio.new_event_loop()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection()
        up.connections.append(conn)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                lines = (ln.partition(":") for ln in head.split("\r\n")[1:])
                headers = {k.strip().lower(): v.strip() for k, _, v in lines if k}
                await reader.readexactly(int(headers.get("content-length", "0")))
                case = headers.get("x-test-case")
                if case is None:  # infertap's background model-list checks
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    return
                conn.cases.append(case)
                raw, hold = up.answers[case]
                writer.write(raw)
                await writer.drain()
                if not hold:
                    return
                # Held: the connection stays open; infertap may close it, or send its next request.
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            conn.closed.set()

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    up.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    thread = loop_thread.start(loop)
    try:
        yield up
    finally:
        loop_thread.stop(loop, thread, server)


@pytest.fixture(scope="module")
def proxies(upstream: Upstream) -> Iterator[dict[str, tuple[str, RecordingObserver]]]:
    """An infertap per `[server] stream_headers` mode, both in front of the raw upstream."""
    found = {}
    with ExitStack() as stack:
        for mode in ("first_token", "immediately"):
            rec = RecordingObserver()
            s = make_settings(("raw", upstream.url))
            s.server.stream_headers = mode
            s.retry.max_attempts = 1
            s.circuit.min_calls = 1_000_000  # every request here fails on purpose
            # Short, so that the stalls end quickly; an idle timeout that fires early ends the stream
            # with its error event, which these tests accept as any other end.
            s.timeouts.idle = 0.25
            s.timeouts.ttft = 0.5
            found[mode] = (stack.enter_context(run_proxy(s, rec)), rec)
        yield found


@pytest.fixture(scope="module")
def proxy(proxies: dict[str, tuple[str, RecordingObserver]]) -> tuple[str, RecordingObserver]:
    return proxies["first_token"]


_CASES = itertools.count()


def _is_error(event: bytes) -> bool:
    try:
        obj = json.loads(event)
    except ValueError:
        return False
    return isinstance(obj, dict) and "error" in obj


def check(
    up: Upstream,
    proxy: tuple[str, RecordingObserver],
    raw: bytes,
    hold: bool,
    stream: bool = True,
    sse: bool = True,
) -> str:
    """Sends `raw` as the upstream's answer to one request through `proxy`; returns its case."""
    base, rec = proxy
    case = f"c{next(_CASES)}"
    up.answers[case] = (raw, hold)
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    headers = {"x-test-case": case}
    with httpx.Client(timeout=30) as client:
        try:
            r = client.post(base + "/v1/chat/completions", json=req, headers=headers)
        except httpx.TimeoutException:
            pytest.fail(f"the client waited for its own timeout: {raw[-120:]!r}")
        except httpx.TransportError:
            assert not (stream and sse), "a stream ends with an event, never an aborted connection"
            r = None
    if r is not None and stream and sse:
        if r.status_code == 200:
            events = sse_events(r.content)
            assert events, r.content
            # [DONE] (what an upstream sends after it, complete events, reaches the client too), or
            # infertap's error event last.
            assert b"[DONE]" in events or _is_error(events[-1]), r.content[-200:]
        else:
            assert r.json()["error"]["message"].startswith("upstream 'raw'"), r.content
    elif r is not None:
        assert r.status_code != 200 or json.loads(r.content), r.content  # complete, or no 200
    (rid,) = [r for r, ex in list(rec.exchanges.items()) if ex.upstream_headers.get("x-test-case") == case]
    ex = rec.wait_terminal(rid)
    assert rec.terminal_count(rid) == 1
    assert ex.outcome is not Outcome.CLIENT_DISCONNECT, (ex.outcome, ex.error_message)
    if ex.outcome is Outcome.OK and (stream and sse):
        return case  # a whole answer, well framed: its connection may go back to the pool
    # infertap closed the upstream's socket: no stalled connection kept, none reused after a fault.
    # Where infertap gave up before its request went out (its own short deadline ran out first, on
    # a slow machine), no connection carries the case: the one it had opened carries none, and is
    # closed as well.
    carriers = [c for c in list(up.connections) if case in c.cases]
    waited = carriers or [c for c in list(up.connections) if not c.cases]
    assert all(c.closed.wait(20) for c in waited), (
        f"infertap kept the upstream's socket open: {raw[-120:]!r} ({ex.outcome}: {ex.error_message})"
    )
    return case


@pytest.mark.parametrize("hold", [False, True], ids=["then-close", "then-stall"])
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_framing_fault_ends_the_stream(
    upstream: Upstream, proxy: tuple[str, RecordingObserver], fault: str, point: str, hold: bool
) -> None:
    check(upstream, proxy, FAULTS[fault](GOOD, POINTS[point]), hold)


def test_bytes_after_an_answer_never_answer_the_next_request(
    upstream: Upstream, proxy: tuple[str, RecordingObserver]
) -> None:
    """An upstream that writes a second answer after the first, on a kept-alive connection: that
    connection is never reused, or the next request (maybe another client's) would get it."""
    base, _ = proxy
    injected = b"data: " + _delta("INJECTED") + b"\n\ndata: [DONE]\n\n"
    second = SSE_HEAD + b"content-length: %d\r\n\r\n" % len(injected) + injected
    whole = _chunked_head() + _chunks(GOOD) + b"0\r\n\r\n"
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    for i in range(3):
        upstream.answers[f"a{i}"] = (whole + second, True)
        upstream.answers[f"b{i}"] = (whole, True)
        for case in (f"a{i}", f"b{i}"):
            r = httpx.post(base + "/v1/chat/completions", json=req, headers={"x-test-case": case}, timeout=30)
            assert r.status_code == 200 and r.content == GOOD, r.content
    carried = [
        c for c in upstream.carried() if any(case in c for case in ("a0", "b0", "a1", "b1", "a2", "b2"))
    ]
    assert any(len(c) > 1 for c in carried), carried  # the pool does reuse a connection here
    assert not any(c[-1] != case and case.startswith("a") for c in carried for case in c), carried


@pytest.mark.parametrize("hold", [False, True], ids=["then-close", "then-stall"])
@pytest.mark.parametrize("fault", ["short-content-length", "closed-mid-chunk", "a-1gb-chunk-then-close"])
def test_a_body_that_is_no_stream_ends_or_is_aborted(
    upstream: Upstream, proxy: tuple[str, RecordingObserver], fault: str, hold: bool
) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    raw = FAULTS[fault](JSON_BODY, 50).replace(SSE_HEAD, head)
    check(upstream, proxy, raw, hold, stream=False)


@pytest.mark.parametrize("hold", [False, True], ids=["then-close", "then-stall"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_framing_fault_ends_an_early_stream_in_band(
    upstream: Upstream, proxies: dict[str, tuple[str, RecordingObserver]], fault: str, hold: bool
) -> None:
    """`stream_headers = "immediately"`: the 200 is gone before the fault, which ends in-band."""
    check(upstream, proxies["immediately"], FAULTS[fault](GOOD, POINTS["before-first-token"]), hold)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    fault=st.sampled_from(list(FAULTS)),
    at=st.integers(0, len(GOOD)),
    hold=st.booleans(),
    junk=st.binary(max_size=40),
    mode=st.sampled_from(["first_token", "immediately"]),
)
def test_framing_faults_anywhere(
    upstream: Upstream,
    proxies: dict[str, tuple[str, RecordingObserver]],
    fault: str,
    at: int,
    hold: bool,
    junk: bytes,
    mode: str,
) -> None:
    """The class: any fault at any byte, with random bytes spliced in where the fault falls."""
    body = GOOD[:at] + junk + GOOD[at:] if fault == "nul-and-invalid-utf8-in-data" else GOOD
    check(upstream, proxies[mode], FAULTS[fault](body, at), hold)


@pytest.mark.parametrize("hold", [False, True], ids=["then-close", "then-stall"])
@pytest.mark.parametrize("content_type", [b"text/plain", b"application/octet-stream", None])
@pytest.mark.parametrize("fault", ["short-content-length", "closed-mid-chunk", "bad-chunk-size"])
def test_a_stream_answered_without_an_event_stream(
    upstream: Upstream,
    proxy: tuple[str, RecordingObserver],
    fault: str,
    content_type: bytes | None,
    hold: bool,
) -> None:
    head = b"HTTP/1.1 200 OK\r\n" + (b"content-type: " + content_type + b"\r\n" if content_type else b"")
    raw = FAULTS[fault](GOOD, 70).replace(SSE_HEAD, head)
    check(upstream, proxy, raw, hold, sse=False)


@pytest.mark.parametrize(
    ("deadline", "outcome"), [("connect", Outcome.CONNECT_TIMEOUT), ("ttft", Outcome.TTFT_TIMEOUT)]
)
def test_a_connection_given_up_before_its_request_went_out_is_closed(
    upstream: Upstream, deadline: str, outcome: Outcome
) -> None:
    """A deadline of infertap's runs out while it connects (here at once): the upstream may see a
    connection, and never a request on it. That connection is closed too, and check() holds
    infertap to it. In CI a request's case reached no connection (a 0.5 s deadline had most likely
    run out on a starved machine), and check(), which then waited for that case's own connection,
    failed a proxy that had closed it."""
    rec = RecordingObserver()
    s = make_settings(("raw", upstream.url))
    s.retry.max_attempts = 1
    setattr(s.timeouts, deadline, 1e-9)
    whole = _chunked_head() + _chunks(GOOD) + b"0\r\n\r\n"
    with run_proxy(s, rec) as base:
        case = check(upstream, (base, rec), whole, hold=True)
    (ex,) = [ex for ex in rec.exchanges.values() if ex.upstream_headers.get("x-test-case") == case]
    assert ex.outcome is outcome, (ex.outcome, ex.error_message)
    assert not any(case in c for c in upstream.carried())
