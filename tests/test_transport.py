"""The seam's implementations on the wire (proxy/transport/): each client against raw HTTP/1.1
servers on 127.0.0.1 that answer byte for byte, in the test's own event loop.

What every client must do (parametrized over both): bodies framed by length, by chunks and by the
connection's end; a malformed answer is `upstream_error`; a redirect is never followed. What the
httptools client adds (its own tests): the pool race, backpressure, TLS with a test CA and SNI,
and the environment's proxies (CONNECT through a proxy written here).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest
import trustme

from proxy.app import create_app
from proxy.core.errors import ErrorKind, UpstreamError
from proxy.core.seam import Pool, Timeouts, UpstreamClient
from proxy.transport import CLIENTS, H1Client
from proxy.transport.h1_response import HIGH_WATER
from tests import loop_thread
from tests.conftest import make_settings, serve_in_thread
from tests.promtext import scrape, value

T = Timeouts(connect=5, pool=5, idle=5)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return head[0], headers, body


@asynccontextmanager
async def server(handler: Handler, ssl_ctx: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=ssl_ctx)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()


def answering(*answers: bytes) -> Handler:
    """Answers each request on a connection with the next bytes, then closes the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for answer in answers:
                await read_request(reader)
                writer.write(answer)
                await writer.drain()
        finally:
            writer.close()

    return handle


async def body_of(client: UpstreamClient, url: str) -> tuple[int, bytes]:
    resp = await client.send("POST", url, {"content-type": "application/json"}, b"{}", T, Pool("u"))
    try:
        chunks = [c async for c in resp.chunks()]
    except client.errors as e:
        resp.close()
        raise client.error(e) from e
    resp.release()
    return resp.status, b"".join(chunks)


def run(make: Callable[[], UpstreamClient], test: Callable[[UpstreamClient], Awaitable[None]]) -> None:
    async def main() -> None:
        client = make()
        try:
            await test(client)
        finally:
            await client.close()

    asyncio.run(main())


IMPLEMENTATIONS = pytest.mark.parametrize("name", sorted(CLIENTS))

BODY = b"0123456789" * 100
FRAMINGS = {
    "length": b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY),
    "chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (100, BODY[i : i + 100]) for i in range(0, len(BODY), 100))
    + b"0\r\n\r\n",
    "close": b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n" + BODY,
    "after a 100": b"HTTP/1.1 100 Continue\r\nx-interim: 1\r\n\r\n"
    + b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY),
}


@IMPLEMENTATIONS
@pytest.mark.parametrize("framing", sorted(FRAMINGS))
def test_bodies_framed_every_way_arrive_whole(name: str, framing: str) -> None:
    async def test(client: UpstreamClient) -> None:
        async with server(answering(FRAMINGS[framing])) as port:
            assert await body_of(client, f"http://127.0.0.1:{port}/v1/x") == (200, BODY)

    run(CLIENTS[name], test)


@IMPLEMENTATIONS
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_cut_short_is_an_interrupted_stream(name: str, framing: str) -> None:
    async def test(client: UpstreamClient) -> None:
        async with server(answering(FRAMINGS[framing][:-300])) as port:
            with pytest.raises(UpstreamError) as e:
                await body_of(client, f"http://127.0.0.1:{port}/v1/x")
            assert (e.value.kind, e.value.message) == (ErrorKind.STREAM_INTERRUPTED, "closed the connection")

    run(CLIENTS[name], test)


@IMPLEMENTATIONS
@pytest.mark.parametrize("cut", [False, True])
def test_a_body_read_to_its_end_or_its_failure_has_nothing_more(name: str, cut: bool) -> None:
    """Asked again after its end, a body ends again, and after its failure it fails or ends: never
    waits, never gives more (the httptools client's body is an iterator class, not an async
    generator, since mypyc compiles none)."""

    async def test(client: UpstreamClient) -> None:
        answer = FRAMINGS["chunked"]
        async with server(answering(answer[:-300] if cut else answer)) as port:
            resp = await client.send("POST", f"http://127.0.0.1:{port}/v1/x", {}, b"{}", T, Pool("u"))
            chunks = resp.chunks()
            got = []
            try:
                async for data in chunks:
                    got.append(data)
                assert not cut
            except client.errors as e:
                assert cut and client.error(e).kind is ErrorKind.STREAM_INTERRUPTED
            assert BODY.startswith(b"".join(got)) and bool(got)
            for _ in range(2):
                with pytest.raises((StopAsyncIteration, *client.errors) if cut else StopAsyncIteration):
                    await asyncio.wait_for(anext(chunks), 5)
            resp.close()

    run(CLIENTS[name], test)


@IMPLEMENTATIONS
@pytest.mark.parametrize("answer", [b"HELLO WORLD\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"])
def test_a_malformed_answer_is_an_upstream_error(name: str, answer: bytes) -> None:
    async def test(client: UpstreamClient) -> None:
        async with server(answering(answer)) as port:
            with pytest.raises(UpstreamError) as e:
                await body_of(client, f"http://127.0.0.1:{port}/v1/x")
            assert (e.value.kind, e.value.message) == (ErrorKind.UPSTREAM_5XX, "sent malformed HTTP")

    run(CLIENTS[name], test)


AFTER_THE_ANSWER = {
    # A HEAD answer is complete at its head; the 5 bytes its Content-Length names never come.
    "a HEAD answer's body": ("HEAD", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", b""),
    "a second answer to one request": (
        "POST",
        FRAMINGS["length"] + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
        BODY,
    ),
}


@IMPLEMENTATIONS
@pytest.mark.parametrize("case", sorted(AFTER_THE_ANSWER))
def test_bytes_after_a_complete_answer_never_join_it(name: str, case: str) -> None:
    """Regression: with llhttp's body callback bound straight to a list, body bytes that came in the
    same read after the answer was complete (a HEAD answer's, at its head) went into that answer.
    They are bytes nobody asked for: dropped with the connection (the httptools client), or the
    answer is an upstream error (aiohttp's, for the HEAD); never part of the body."""
    method, answer, body = AFTER_THE_ANSWER[case]

    async def test(client: UpstreamClient) -> None:
        async with server(answering(answer)) as port:
            url = f"http://127.0.0.1:{port}/v1/x"
            try:
                resp = await client.send(method, url, {}, b"", T, Pool("u"))
            except UpstreamError as e:  # aiohttp reads the 5 bytes as the next answer's status line
                assert (name, method, e.kind) == ("aiohttp", "HEAD", ErrorKind.UPSTREAM_5XX)
                return
            chunks = [c async for c in resp.chunks()]
            resp.release()
            assert (resp.status, b"".join(chunks)) == (200, body)

    run(CLIENTS[name], test)


def test_an_upgrade_is_no_answer_to_relay() -> None:
    switch = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\nxx"

    async def test(client: UpstreamClient) -> None:
        async with server(answering(switch)) as port:
            with pytest.raises(UpstreamError) as e:
                await body_of(client, f"http://127.0.0.1:{port}/v1/x")
            assert (e.value.kind, e.value.message) == (ErrorKind.UPSTREAM_5XX, "sent malformed HTTP")

    run(H1Client, test)


@IMPLEMENTATIONS
def test_a_redirect_is_never_followed(name: str) -> None:
    elsewhere: list[str] = []

    async def other(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        elsewhere.append((await read_request(reader))[0])
        writer.close()

    async def test(client: UpstreamClient) -> None:
        async with server(other) as to:
            moved = (
                b"HTTP/1.1 307 Moved\r\nlocation: http://127.0.0.1:%d/v1/x\r\ncontent-length: 0\r\n\r\n" % to
            )
            async with server(answering(moved, moved)) as port:
                status, _ = await body_of(client, f"http://127.0.0.1:{port}/v1/x")
                assert status == 307
                assert (await client.fetch(f"http://127.0.0.1:{port}/v1/models", {}, 5))[0] == 307
        assert elsewhere == []

    run(CLIENTS[name], test)


# -- the pool race ----------------------------------------------------------------------------------
@dataclass
class RaceUpstream:
    """Answers the first request on each connection with keep-alive; what follows on that
    connection is `then` (b"": closed unanswered, as an upstream whose keep-alive ran out the
    moment the next request came), and the connection is closed."""

    then: bytes
    answer: bytes = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    connections: int = 0
    requests: list[str] = field(default_factory=list)

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            self.requests.append((await read_request(reader))[0])
            writer.write(self.answer)
            await writer.drain()
            self.requests.append((await read_request(reader))[0])
            writer.write(self.then)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its kept connection
        finally:
            writer.close()


def test_a_kept_connection_closed_under_us_is_asked_again_on_a_fresh_one() -> None:
    """The classic pool race: the upstream closed a kept-alive connection just as the next request
    went out on it. Not one byte of an answer came: nobody failed, and the request is not lost."""
    up = RaceUpstream(then=b"")

    async def test(client: UpstreamClient) -> None:
        async with server(up) as port:
            url = f"http://127.0.0.1:{port}/v1/x"
            assert await body_of(client, url) == (200, b"ok")
            assert await body_of(client, url) == (200, b"ok")  # would raise before the fix
        assert up.connections == 2 and len(up.requests) == 3

    run(H1Client, test)


def test_through_infertap_the_pool_race_is_no_retry_and_no_failure() -> None:
    body = b'{"object":"chat.completion","choices":[]}'
    up = RaceUpstream(
        then=b"",
        answer=b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body),
    )
    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(asyncio.start_server(up, "127.0.0.1", 0))
    thread = loop_thread.start(loop)
    try:
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1"
        settings = make_settings(("u", url))
        settings.server.upstream_client = "httptools"
        with serve_in_thread(create_app(settings)) as proxy, httpx.Client(timeout=10) as http:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(3):
                r = http.post(f"{proxy}/v1/chat/completions", json=chat)
                assert (r.status_code, r.content) == (200, body)
            text = scrape(proxy)
    finally:
        loop_thread.stop(loop, thread, srv)
    assert value(text, "infertap_requests_total", upstream="u", outcome="ok") == 3
    assert value(text, "infertap_retries_total") == 0, "no retry counted"
    assert value(text, "infertap_upstream_attempts_total", upstream="u") == 3
    assert value(text, "infertap_upstream_attempts_total", upstream="u", result="ok") == 3
    assert value(text, "infertap_upstream_up", upstream="u") == 1
    assert up.connections >= 3, "each kept connection met the race once"


def test_a_kept_connection_that_broke_mid_answer_is_a_real_failure() -> None:
    """Once a byte of the answer arrived, the upstream has the request: asking again could run it
    twice. The failure is the upstream's, as on a fresh connection."""
    up = RaceUpstream(then=b"HTTP/1.1 200 OK\r\ncontent-le")

    async def test(client: UpstreamClient) -> None:
        async with server(up) as port:
            url = f"http://127.0.0.1:{port}/v1/x"
            assert await body_of(client, url) == (200, b"ok")
            with pytest.raises(UpstreamError) as e:
                await body_of(client, url)
            assert (e.value.kind, e.value.message) == (ErrorKind.STREAM_INTERRUPTED, "closed the connection")
        assert up.connections == 1

    run(H1Client, test)


def _stalled_after(answers: int, connections: list[int]) -> Handler:
    """Answers the first `answers` requests on a connection whole; then sends the next one's head
    and half its body, and nothing more."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            for _ in range(answers):
                await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nok")
            await writer.drain()
            await reader.read()  # until the client gives up and closes
        finally:
            writer.close()

    return handle


@pytest.mark.parametrize(
    "before", [3600.0, 0.01, None], ids=["after a longer idle", "after a shorter", "fresh"]
)
def test_the_idle_timeout_holds_on_a_kept_connection_whatever_the_answer_before_had(
    before: float | None,
) -> None:
    """A kept connection's idle timer goes on from one answer to the next (h1_connection.start):
    the answer after one with a far longer idle timeout (another upstream's, on the same origin)
    still times out on its own."""
    connections: list[int] = []

    async def test(client: UpstreamClient) -> None:
        async with server(_stalled_after(0 if before is None else 1, connections)) as port:
            url = f"http://127.0.0.1:{port}/v1/x"
            if before is not None:
                first = Timeouts(connect=5, pool=5, idle=before)
                resp = await client.send("POST", url, {}, b"{}", first, Pool("u"))
                assert b"".join([c async for c in resp.chunks()]) == b"ok"
                resp.release()
            resp = await client.send(
                "POST", url, {}, b"{}", Timeouts(connect=5, pool=5, idle=0.05), Pool("u")
            )
            with pytest.raises(UpstreamError) as e:
                async with asyncio.timeout(60):  # the test's own guard: a missed timeout hangs
                    async for _ in resp.chunks():
                        pass
            resp.close()
            assert e.value.kind is ErrorKind.IDLE_TIMEOUT
        assert len(connections) == 1, "the second answer came on the kept connection"

    run(H1Client, test)


# -- backpressure -----------------------------------------------------------------------------------
def test_a_consumer_that_stops_reading_pauses_the_upstream() -> None:
    total = 32 * 1024 * 1024
    piece = b"x" * 65536
    written = 0
    draining = False  # the upstream waits for its socket to take more

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written, draining
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        try:
            while written < total:
                writer.write(piece)
                written += len(piece)
                draining = True
                await writer.drain()
                draining = False
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def test(client: UpstreamClient) -> None:
        async with server(flood) as port:
            resp = await client.send("GET", f"http://127.0.0.1:{port}/big", {}, None, T)
            chunks = resp.chunks()
            got = len(await chunks.__anext__())
            conn = resp._conn  # type: ignore[attr-defined]
            # The buffer fills while the upstream writes; then infertap stops reading, and the
            # upstream's writes wait on its full socket.
            await until(lambda: conn.paused and draining)
            assert resp._size <= HIGH_WATER + 1024 * 1024, "the buffer is bounded"  # type: ignore[attr-defined]
            assert written < total // 2, "the upstream was held back, not read into memory"
            async for data in chunks:  # reading again resumes it
                got += len(data)
            resp.release()
            assert got == total

    run(H1Client, test)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Polls `cond` (a deadline, not a sleep that passes)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


# -- TLS and proxies --------------------------------------------------------------------------------
@pytest.fixture
def ca(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> trustme.CA:
    """A test CA that OpenSSL trusts through SSL_CERT_FILE, as an operator's CA bundle would be."""
    authority = trustme.CA()
    pem = f"{tmp_path}/ca.pem"
    authority.cert_pem.write_to_path(pem)
    monkeypatch.setenv("SSL_CERT_FILE", pem)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    return authority


def tls_server_context(authority: trustme.CA, names: list[str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("localhost").configure_cert(ctx)
    ctx.sni_callback = lambda sock, name, _: names.append(name or "")  # type: ignore[assignment,misc,return-value]
    return ctx


def test_tls_with_the_system_trust_store_and_sni(ca: trustme.CA) -> None:
    names: list[str] = []

    async def test(client: UpstreamClient) -> None:
        async with server(answering(FRAMINGS["length"]), tls_server_context(ca, names)) as port:
            assert await body_of(client, f"https://localhost:{port}/v1/x") == (200, BODY)
        assert names == ["localhost"]

    run(H1Client, test)


def test_a_certificate_no_trusted_ca_signed_is_refused(ca: trustme.CA) -> None:
    async def test(client: UpstreamClient) -> None:
        async with server(answering(FRAMINGS["length"]), tls_server_context(trustme.CA(), [])) as port:
            with pytest.raises(UpstreamError) as e:
                await body_of(client, f"https://localhost:{port}/v1/x")
            assert (e.value.kind, e.value.message) == (
                ErrorKind.CONNECT_ERROR,
                "is unreachable: its TLS certificate did not verify",
            )

    run(H1Client, test)


@dataclass
class ConnectProxy:
    """An HTTP proxy for the test: CONNECT tunnels to 127.0.0.1 only; a request in absolute form is
    answered by the proxy itself. Records each request line and its Proxy-Authorization."""

    seen: list[tuple[str, str]] = field(default_factory=list)

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, headers, _ = await read_request(reader)
        self.seen.append((line, headers.get("proxy-authorization", "")))
        method, target, _ = line.split(" ")
        if method != "CONNECT":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\nconnection: close\r\n\r\nproxied")
            await writer.drain()
            writer.close()
            return
        host, port = target.rsplit(":", 1)
        assert host in ("localhost", "127.0.0.1")
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(port))
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_https_goes_through_the_environments_proxy_by_connect(
    ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, names = ConnectProxy(), []

    async def test(client: UpstreamClient) -> None:
        async with server(answering(FRAMINGS["chunked"]), tls_server_context(ca, names)) as port:
            assert await body_of(client, f"https://localhost:{port}/v1/x") == (200, BODY)
        assert proxy.seen == [(f"CONNECT localhost:{port} HTTP/1.1", "Basic dXNlcjpwQHNz")]
        assert names == ["localhost"]

    async def main() -> None:
        async with server(proxy) as pport:
            monkeypatch.setenv("HTTPS_PROXY", f"http://user:p%40ss@127.0.0.1:{pport}")
            client = H1Client()
            try:
                await test(client)
            finally:
                await client.close()

    asyncio.run(main())


def test_http_goes_to_the_proxy_in_absolute_form_and_no_proxy_goes_direct(
    ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = ConnectProxy()

    async def main() -> None:
        async with server(proxy) as pport, server(answering(FRAMINGS["length"])) as port:
            monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{pport}")
            client = H1Client()
            try:
                assert await body_of(client, f"http://127.0.0.1:{port}/v1/x?a=1") == (200, b"proxied")
                assert proxy.seen == [(f"POST http://127.0.0.1:{port}/v1/x?a=1 HTTP/1.1", "")]
            finally:
                await client.close()
            monkeypatch.setenv("no_proxy", "127.0.0.1")
            client = H1Client()
            try:
                assert await body_of(client, f"http://127.0.0.1:{port}/v1/x") == (200, BODY)
                assert len(proxy.seen) == 1
            finally:
                await client.close()

    asyncio.run(main())
