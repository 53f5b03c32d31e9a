"""The proxied routes at the protocol level (proxy/server/raw_routes.py, raw_cycle.py; issue 25,
items 1 and 4): served by infertap's own cycle, with uvicorn's keep-alive, pipelining, HTTP/1.0,
100-continue and backpressure, and malformed or smuggled requests refused as uvicorn refuses them."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httptools
import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http import httptools_impl

from proxy.app import create_app
from proxy.server.raw_cycle import framed
from proxy.settings import AuthSettings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import (
    CHAT,
    RecordingObserver,
    make_settings,
    serve_in_thread,
    server_in_thread,
    wait_until,
)

KEYS_ENV = "INFERTAP_TEST_RAW_KEYS"
KEY = b"sk-raw-test"
PATH = b"/v1/chat/completions"


@pytest.fixture(autouse=True)
def client_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, KEY.decode())


@contextmanager
def proxy(url: str, observers: tuple[Any, ...] = (), **server: Any) -> Iterator[int]:
    settings = make_settings(("fake", url))
    settings.server = settings.server.model_copy(update=server)
    settings.auth = AuthSettings(keys_env=KEYS_ENV)
    with serve_in_thread(create_app(settings, observers)) as base:
        yield int(base.rsplit(":", 1)[1])


@contextmanager
def stock_uvicorn(url: str) -> Iterator[int]:
    """The same app under uvicorn's own httptools protocol: what uvicorn answers, for comparison."""
    settings = make_settings(("fake", url))
    settings.auth = AuthSettings(keys_env=KEYS_ENV)
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=0, log_level="warning", loop="asyncio", http="httptools"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="server start")
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def request(
    body: dict[str, Any] | None = None, *, version: bytes = b"1.1", rid: bytes = b"", **extra: str
) -> bytes:
    data = httpx.Request("POST", "http://x", json=body or CHAT).content
    lines = [
        b"POST " + PATH + b" HTTP/" + version,
        b"host: x",
        b"authorization: Bearer " + KEY,
        b"content-type: application/json",
        b"content-length: %d" % len(data),
    ]
    if rid:
        lines.append(b"x-request-id: " + rid)
    lines += [k.replace("_", "-").encode() + b": " + v.encode() for k, v in extra.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n" + data


class Answers:
    """Responses read off one connection with llhttp, in the order they came."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[dict[str, Any]] = []
        self.current: dict[str, Any] = {}

    def on_message_begin(self) -> None:
        self.current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current["status"] = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current["body"] += body

    def on_message_complete(self) -> None:
        self.done.append(self.current)

    def read(self, s: socket.socket, n: int) -> list[dict[str, Any]]:
        while len(self.done) < n:
            chunk = s.recv(65536)
            assert chunk, f"the connection closed after {len(self.done)} answers"
            self.parser.feed_data(chunk)
        return self.done


def status_of(port: int, data: bytes) -> bytes:
    """The status line the server answers to `data` (then it closes, or 10 s fail the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        while b"\r\n" not in out:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out.split(b"\r\n", 1)[0]


def test_proxied_requests_skip_uvicorns_cycle_and_the_rest_use_it(
    fake: tuple[FakeUpstream, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[tuple[int, str]] = []  # the fake upstream's own, in this process too, set apart by port

    class Counted(httptools_impl.RequestResponseCycle):
        def __init__(self, scope: Any, **kwargs: Any) -> None:
            built.append((scope["server"][1], scope["path"]))
            super().__init__(scope, **kwargs)

    monkeypatch.setattr(httptools_impl, "RequestResponseCycle", Counted)
    _, url = fake
    with proxy(url) as port:
        base = f"http://127.0.0.1:{port}"
        auth = {"authorization": "Bearer " + KEY.decode()}
        assert httpx.post(base + PATH.decode(), json=CHAT, headers=auth).status_code == 200
        assert httpx.post(base + PATH.decode(), json=CHAT).status_code == 401  # refused as a proxied route
        assert httpx.get(base + "/v1/chat/completions", headers=auth).status_code == 405
        assert httpx.get(base + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(base + "/healthz").status_code == 200
    assert [path for at, path in built if at == port] == ["/v1/models", "/healthz"]


def test_pipelined_requests_are_answered_in_order(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    health = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    stream = request({**CHAT, "stream": True}, rid=b"p-2", x_fake_events="3")
    batch = request(rid=b"p-1", x_fake_delay_ms="50") + stream + health + request(rid=b"p-3")
    with proxy(url) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(batch)  # in one write
        answers = Answers().read(s, 4)
    assert [a["status"] for a in answers] == [200, 200, 200, 200]
    assert [a["headers"].get("x-request-id") for a in answers[:2]] == ["p-1", "p-2"]
    assert answers[3]["headers"]["x-request-id"] == "p-3"
    assert b"chat.completion" in answers[0]["body"] and b"data: [DONE]" in answers[1]["body"]
    assert answers[2]["body"].startswith(b"{") and b"chat.completion" in answers[3]["body"]
    assert [r.headers["x-request-id"] for r in upstream.requests] == ["p-1", "p-2", "p-3"]


def test_keep_alive_across_proxied_requests_and_refusals(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with proxy(url) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        reader = Answers()
        for i, data in enumerate(
            [
                request(rid=b"k-1"),
                request({**CHAT, "stream": True}, rid=b"k-2"),
                request(rid=b"k-3").replace(b"Bearer " + KEY, b"Bearer wrong"),
                request(rid=b"k-4"),
            ]
        ):
            s.sendall(data)
            answer = reader.read(s, i + 1)[i]
            assert "close" not in answer["headers"].get("connection", ""), answer
    assert [a["status"] for a in reader.done] == [200, 200, 401, 200]
    assert reader.done[1]["headers"]["transfer-encoding"] == "chunked"
    assert "date" in reader.done[0]["headers"]  # uvicorn's default header, as before


def test_an_http_1_0_client_gets_its_answer_and_the_connection_closes(fake: tuple[FakeUpstream, str]) -> None:
    _, url = fake
    with proxy(url) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request(version=b"1.0", rid=b"old"))
        out = b""
        while chunk := s.recv(65536):  # the server closes: the loop ends
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert b"\r\nconnection: close" in head and b"x-request-id: old" in head
    assert b"chat.completion" in body


def test_connection_close_from_the_client_ends_the_connection_after_its_answer(
    fake: tuple[FakeUpstream, str],
) -> None:
    _, url = fake
    with proxy(url) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        # A second request after it is never read: the connection ends with the first answer.
        s.sendall(
            request({**CHAT, "stream": True}, rid=b"last", connection="close") + request(rid=b"ignored")
        )
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close\r\n" in out
    assert out.endswith(b"0\r\n\r\n") and out.count(b"HTTP/1.1 ") == 1


def test_100_continue_is_sent_when_the_body_is_read_and_not_for_a_refusal(
    fake: tuple[FakeUpstream, str],
) -> None:
    _, url = fake
    data = request(rid=b"c-1", expect="100-continue")
    head, _, body = data.partition(b"\r\n\r\n")
    with proxy(url) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head + b"\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            s.sendall(body)
            assert Answers().read(s, 1)[0]["status"] == 200
        refused = head.replace(b"Bearer " + KEY, b"Bearer wrong") + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(refused)
            first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 401 "), first  # never a 100 for a body no one reads


_MALFORMED = {
    "content-length with transfer-encoding": b"content-length: 5\r\ntransfer-encoding: chunked\r\n",
    "two content-lengths": b"content-length: 5\r\ncontent-length: 6\r\n",
    "obs-fold": b"content-length: 2\r\nx-folded: a\r\n  b\r\n",
    "bare LF": b"content-length: 2\nx-a: b\n",
    "transfer-encoding not chunked last": b"transfer-encoding: chunked, gzip\r\n",
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_smuggling_and_malformed_heads_are_refused_as_uvicorn_refuses_them(
    case: str, fake: tuple[FakeUpstream, str]
) -> None:
    upstream, url = fake
    data = b"POST " + PATH + b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY + b"\r\n"
    data += _MALFORMED[case] + b"\r\n{}"
    with stock_uvicorn(url) as port:
        stock = status_of(port, data)
    with proxy(url) as port:
        ours = status_of(port, data)
    assert ours == stock == b"HTTP/1.1 400 Bad Request", (ours, stock)
    assert upstream.requests == []


def test_oversized_and_unfinished_heads_are_refused_on_a_proxied_path(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    head = b"POST " + PATH + b" HTTP/1.1\r\nhost: x\r\n"
    with proxy(url, max_head_bytes=4096, head_timeout=0.3) as port:
        assert status_of(port, head + b"x-big: " + b"a" * 8000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
        assert status_of(port, head + b"x-never: ").startswith(b"HTTP/1.1 408 ")
    assert upstream.requests == []


def test_a_client_that_never_reads_pauses_the_upstream_and_is_cut_off(fake: tuple[FakeUpstream, str]) -> None:
    """Backpressure on the raw path: nothing of the stream piles up in the proxy (the upstream sent
    a bounded part of it, the sockets' buffers), and write_timeout ends it."""
    upstream, url = fake
    rec = RecordingObserver()
    events, size = 5000, 20000
    data = request(
        {**CHAT, "stream": True}, rid=b"never-reads", x_fake_events=str(events), x_fake_event_bytes=str(size)
    )
    with proxy(url, (rec,), write_timeout=1.0) as port, socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.sendall(data)  # and never read the answer
        ex = rec.wait_terminal("never-reads", timeout=30)
        assert ex.outcome == "client_disconnect"
        wait_until(upstream.disconnected.is_set, 10, "the upstream request to be cancelled")
    streamed = len(upstream.sent["never-reads"])
    assert 0 < streamed < events * size // 4, streamed


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False


class _Protocol:
    """What RawCycle.start reads of uvicorn's protocol (its head is built and checked, not sent)."""

    access_log = False

    def __init__(self) -> None:
        self.transport = _Transport()
        self.flow = None
        self.on_response_complete = lambda: None
        self.server_state = type("State", (), {"default_headers": [(b"server", b"uvicorn")]})()
        self.loop = type("Loop", (), {"call_soon": staticmethod(lambda f: None)})()


_HEADER_BYTES = st.binary(max_size=6) | st.sampled_from(
    [b"x-ok", b"a b", b"x\t", b"x\x7f", b"v\n", b"v\r", b"\x00"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_HEADER_BYTES, _HEADER_BYTES), max_size=5))
def test_the_answers_head_is_refused_exactly_where_uvicorn_refuses_a_header(
    headers: list[tuple[bytes, bytes]],
) -> None:
    """RawCycle.start checks each byte against its tables (compiled) or all the names in one search
    and all the values in another (as Python): either way it refuses a head exactly when uvicorn's
    check, header by header, refuses one of them."""
    from proxy.server.raw_cycle import RawCycle

    bad = any(
        httptools_impl.HEADER_RE.search(name) or httptools_impl.HEADER_VALUE_RE.search(value)
        for name, value in headers
        if not name.lower() == b"content-length"  # (its value must also be a number: not drawn)
    )
    headers = [(n, v) for n, v in headers if n.lower() != b"content-length"]
    scope = {"method": "POST", "http_version": "1.1", "path": "/v1/x", "query_string": b""}
    cycle = RawCycle(_Protocol(), scope, True, False)  # type: ignore[arg-type]
    try:
        cycle.start(200, headers)
    except RuntimeError as e:
        assert bad, e
    else:
        assert not bad


@given(st.integers(min_value=1, max_value=70_000))
def test_a_chunk_is_framed_with_its_size_in_hex_on_both_sides_of_the_table(size: int) -> None:
    # framed() takes the size line from a table below 4096 bytes and formats it above: both give
    # the framing that `%x` formatting gave.
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert framed(body) == b"%x\r\n%b\r\n" % (size, body)


@settings(max_examples=500)
@given(st.binary(max_size=40))
def test_the_byte_tables_refuse_what_uvicorns_patterns_find(data: bytes) -> None:
    # The compiled build's check (the tables) against uvicorn's patterns, whichever build runs.
    from proxy.server.raw_cycle import _BAD_NAME, _BAD_VALUE, _any_of

    assert _any_of(data, _BAD_NAME) == (httptools_impl.HEADER_RE.search(data) is not None)
    assert _any_of(data, _BAD_VALUE) == (httptools_impl.HEADER_VALUE_RE.search(data) is not None)


def test_a_kept_connections_next_request_outlives_the_keep_alive_timeout(
    fake: tuple[FakeUpstream, str],
) -> None:
    """uvicorn arms a timer when an answer completes (`timeout_keep_alive`), and the connection's
    next read cancels it (its `_unset_keepalive_if_required`, which RequestHead.feed writes out).
    Left armed, it would close the connection under the next request's answer: here a stream held
    at the fake upstream's gate until the timer would have fired."""
    upstream, url = fake
    settings = make_settings(("fake", url))
    settings.auth = AuthSettings(keys_env=KEYS_ENV)
    keep = 1.0  # long enough for the second request to come before it, on a slow machine too
    config = uvicorn.Config(
        create_app(settings),
        host="127.0.0.1",
        port=0,
        log_level="warning",
        loop="asyncio",
        http="proxy.server.edge:EdgeProtocol",
        timeout_keep_alive=keep,
    )
    headers = {"authorization": "Bearer " + KEY.decode()}
    with (
        server_in_thread(config) as (_, _, base),
        httpx.Client(base_url=base, headers=headers, timeout=30) as c,
    ):
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        answered = time.monotonic()
        stream = {**CHAT, "stream": True}
        held = {"x-fake-gate": "kept-alive", "x-fake-events": "3"}
        with c.stream("POST", "/v1/chat/completions", json=stream, headers=held) as r:
            lines = r.iter_lines()
            assert any('"content"' in line for line in lines)  # the first content event: at the gate
            wait_until(lambda: time.monotonic() > answered + 2 * keep, 10, "the keep-alive timeout to pass")
            upstream.open_gate("kept-alive")
            rest = list(lines)
        assert "data: [DONE]" in rest, rest
        assert len(upstream.requests) == 2
