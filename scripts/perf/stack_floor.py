"""Minimal relays, one per combination of server and client layer: what each layer costs by itself.

`scripts/perf/stack_floor_run.py` runs them beside infertap and nginx with the bench's upstream and
load generator; docs/benchmarks.md ("What the stack itself costs") has the numbers. None of these
is a proxy anyone should run: no checks, no errors, no metrics, one upstream.

  raw-raw          asyncio protocols on both sides, bytes relayed as they come (the response is not
                   parsed; its end is found by its last bytes): what Python and uvloop cost
  raw-aiohttp      asyncio protocol server (httptools parses the request), aiohttp client
  uvicorn-raw      uvicorn + a bare ASGI app, an httptools-parsed pooled client
  uvicorn-aiohttp  uvicorn + a bare ASGI app, aiohttp client: the libraries infertap is built on
                   before issue 25, without infertap
  uvicorn-proto    uvicorn with a subclass of its httptools protocol that serves POST at the
                   protocol level: the body gathered in llhttp's callbacks, a pooled
                   httptools-parsed upstream connection whose callbacks write each body chunk to the
                   client's transport (chunked), the upstream paused while the client's transport is
                   full. The layers infertap is built on since issue 25, without infertap's own work

Run: `python scripts/perf/stack_floor.py MODE UPSTREAM_PORT PORT_FILE`; it writes its port to PORT_FILE.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from typing import Any

import httptools
import uvloop

MODE, UP_PORT, PORT_FILE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
HOST = "127.0.0.1"
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host", b"date", b"server"}


# -- raw-raw: bytes through, nothing parsed beyond the request's length -------------------------
class _RawUp(asyncio.Protocol):
    def __init__(self, down: _RawDown) -> None:
        self.down = down
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.down.transport is not None
        self.down.transport.write(data)


class _RawDown(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport | None = transport  # type: ignore[assignment]
        self.buf = b""
        self.up: _RawUp | None = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        length = 0
        for line in self.buf[:end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        request, self.buf = self.buf[: end + 4 + length], self.buf[end + 4 + length :]
        if self.up is None:
            asyncio.ensure_future(self._connect(request))
        else:
            assert self.up.transport is not None
            self.up.transport.write(request)

    async def _connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, self.up = await loop.create_connection(lambda: _RawUp(self), HOST, UP_PORT)
        assert self.up.transport is not None
        self.up.transport.write(request)


# -- an httptools-parsed pooled upstream client (for uvicorn-raw) --------------------------------
class _Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.done = False
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def body(self) -> Any:
        while True:
            while self.chunks:
                yield self.chunks.popleft()
            if self.done:
                return
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter


class _PooledConn(asyncio.Protocol):
    def __init__(self, pool: list[_PooledConn]) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.resp: _Response | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.resp is not None
        self.resp.status = self.parser.get_status_code()
        self.resp.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.resp is not None
        self.resp.chunks.append(body)
        self.resp.wake()

    def on_message_complete(self) -> None:
        assert self.resp is not None
        self.resp.done = True
        self.resp.wake()
        self.resp = None
        self.pool.append(self)


_POOL: list[_PooledConn] = []


async def _raw_request(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> _Response:
    conn = _POOL.pop() if _POOL else None
    if conn is None:
        _, conn = await asyncio.get_running_loop().create_connection(
            lambda: _PooledConn(_POOL), HOST, UP_PORT
        )
    conn.resp = resp = _Response()
    head = [f"{method} {path} HTTP/1.1\r\nhost: {HOST}:{UP_PORT}\r\ncontent-length: {len(body)}\r\n".encode()]
    head += [b"%s: %s\r\n" % (k, v) for k, v in headers if k not in _HOP]
    head.append(b"\r\n")
    assert conn.transport is not None
    conn.transport.write(b"".join(head) + body)
    await resp.head
    return resp


# -- uvicorn-proto: POST relayed in the protocols' callbacks, inside uvicorn ---------------------
class _RelayUp(asyncio.Protocol):
    """A pooled upstream connection; while it carries a request, its callbacks write to `down`."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.down: Any = None  # the client's protocol (uvicorn's, subclassed below)
        self.head: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name not in _HOP:
            self.head.append(b"%s: %s\r\n" % (name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.head.insert(0, b"HTTP/1.1 %d OK\r\ntransfer-encoding: chunked\r\n" % status)
        self.head.append(b"\r\n")
        self.down.transport.write(b"".join(self.head))
        self.head = []

    def on_body(self, body: bytes) -> None:
        down = self.down.transport
        down.write(b"%x\r\n%s\r\n" % (len(body), body))
        if down.get_write_buffer_size() > 65536 and self.transport is not None:
            self.transport.pause_reading()
            self.down.paused_up = self

    def on_message_complete(self) -> None:
        self.down.transport.write(b"0\r\n\r\n")
        self.down = None
        _RELAY_POOL.append(self)


_RELAY_POOL: list[_RelayUp] = []


def _proto_class() -> Any:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class ProtoRelay(HttpToolsProtocol):
        raw = False
        paused_up: _RelayUp | None = None

        def on_headers_complete(self) -> None:
            self.raw = self.parser.get_method() == b"POST"
            if self.raw:
                self.raw_body: list[bytes] = []
            else:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self.raw:
                self.raw_body.append(body)
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self.raw:
                super().on_message_complete()
                return
            up = _RELAY_POOL.pop() if _RELAY_POOL else None
            request = self._request(b"".join(self.raw_body))
            if up is not None:
                up.down = self
                assert up.transport is not None
                up.transport.write(request)
            else:
                asyncio.ensure_future(self._connect(request))

        def _request(self, body: bytes) -> bytes:
            head = [
                b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-length: %d\r\n"
                % (self.url, HOST.encode(), UP_PORT, len(body))
            ]
            head += [b"%s: %s\r\n" % (k, v) for k, v in self.headers if k not in _HOP]
            head.append(b"\r\n")
            return b"".join(head) + body

        async def _connect(self, request: bytes) -> None:
            _, up = await asyncio.get_running_loop().create_connection(_RelayUp, HOST, UP_PORT)
            up.down = self
            assert up.transport is not None
            up.transport.write(request)

        def resume_writing(self) -> None:
            super().resume_writing()
            up, self.paused_up = self.paused_up, None
            if up is not None and up.transport is not None:
                up.transport.resume_reading()

    return ProtoRelay


# -- ASGI app for uvicorn: the same bare relay over either client -------------------------------
_SESSION: Any = None


async def _read_body(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = await _read_body(receive)
    if MODE == "uvicorn-raw":
        resp = await _raw_request(scope["method"], scope["path"], scope["headers"], body)
        headers = [(k, v) for k, v in resp.headers if k not in _HOP]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        async for chunk in resp.body():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    else:
        global _SESSION
        import aiohttp

        if _SESSION is None:
            _SESSION = aiohttp.ClientSession(auto_decompress=False)
        hdrs = {k.decode(): v.decode() for k, v in scope["headers"] if k not in _HOP}
        r = await _SESSION.request(
            scope["method"], f"http://{HOST}:{UP_PORT}{scope['path']}", headers=hdrs, data=body
        )
        headers = [(k.lower(), v) for k, v in r.raw_headers if k.lower() not in _HOP]
        await send({"type": "http.response.start", "status": r.status, "headers": headers})
        async for chunk in r.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        r.release()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- raw-aiohttp: a protocol server parsing requests with httptools, aiohttp upstream -----------
class _ParsedDown(asyncio.Protocol):
    session: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.url = b""

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        headers, body = self.headers, b"".join(self.body)
        self.headers, self.body = [], []
        asyncio.ensure_future(self._forward(method, self.url.decode(), headers, body))

    async def _forward(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        import aiohttp

        if _ParsedDown.session is None:
            _ParsedDown.session = aiohttp.ClientSession(auto_decompress=False)
        hdrs = {k.decode(): v.decode() for k, v in headers if k not in _HOP}
        r = await _ParsedDown.session.request(
            method, f"http://{HOST}:{UP_PORT}{path}", headers=hdrs, data=body
        )
        head = [b"HTTP/1.1 %d OK\r\ntransfer-encoding: chunked\r\n" % r.status]
        head += [b"%s: %s\r\n" % (k.lower(), v) for k, v in r.raw_headers if k.lower() not in _HOP]
        self.transport.write(b"".join(head) + b"\r\n")
        async for chunk in r.content.iter_any():
            self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.transport.write(b"0\r\n\r\n")
        r.release()


async def main() -> None:
    loop = asyncio.get_running_loop()
    if MODE.startswith("uvicorn"):
        import socket

        import uvicorn

        sock = socket.socket()
        sock.bind((HOST, 0))
        http = _proto_class() if MODE == "uvicorn-proto" else "httptools"
        config = uvicorn.Config(asgi_app, loop="uvloop", http=http, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        with open(PORT_FILE, "w") as f:
            f.write(str(sock.getsockname()[1]))
        await server.serve(sockets=[sock])
        return
    factory = _RawDown if MODE == "raw-raw" else _ParsedDown
    srv = await loop.create_server(factory, HOST, 0)
    with open(PORT_FILE, "w") as f:
        f.write(str(srv.sockets[0].getsockname()[1]))
    await srv.serve_forever()


if __name__ == "__main__":
    uvloop.run(main())
