"""One proxied request's cycle at the protocol level: infertap's own, in place of uvicorn's
`RequestResponseCycle` and its ASGI task (proxy/server/raw_routes.py decides which requests).

It keeps the cycle's contract, so the core's ASGI-shaped `Receive`/`Send` work unchanged:

- `receive` hands over the body as llhttp delivers it (no copy of a single chunk), pauses reading
  above uvicorn's high-water mark and resumes it at the next read, answers `Expect: 100-continue`
  at the first read, and says `http.disconnect` once the connection is lost or the answer is done;
- `send` writes the answer's head as bytes (uvicorn's status lines, its default headers, the same
  header checks, `content-length` or chunked, `connection: close` where the connection ends) and
  each body chunk with one `transport.write`; it waits only while the client's transport has paused
  writing (the edge's `write_timeout` aborts a client that never drains it).

`start` and `write` are plain methods that write to the transport at once; `push`, `attach` and
`detach` (the seam's `Sink`) let a relay driven by the upstream's protocol callbacks write
synchronously, its upstream's reading paused while the client's transport has paused writing
(and once the client is gone), and resumed when it resumes. An application's failure ends the
cycle as uvicorn's does (a 500 before the head, the connection closed after it), with uvicorn's
log messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from itertools import chain
from typing import TYPE_CHECKING, Any, Final

from mypy_extensions import i64
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

App = Callable[[Any, Any, Any], Awaitable[None]]
RawHeaders = Iterable[tuple[bytes, bytes]]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# The chunk-size lines (hex and CRLF) of the sizes a streamed event has. `%x` is formatted by the
# interpreter's generic `%` (about 900 instructions a chunk); a row of this table and a `%b`-only
# format, which mypyc compiles to one allocation and its copies, cost a tenth of it.
_SIZE_LINES: Final[tuple[bytes, ...]] = tuple(b"%x\r\n" % n for n in range(4096))


# Whether this module runs compiled (proxy/compiled/): there a loop over a header's bytes costs a
# fifth of uvicorn's pattern search (the call alone is ~2,000 instructions); as Python, five times it.
_COMPILED: Final = not __file__.endswith(".py")
# The bytes uvicorn's patterns refuse in a header's name and in its value (one byte each), as tables.
_BAD_NAME: Final = bytes(HEADER_RE.fullmatch(bytes([c])) is not None for c in range(256))
_BAD_VALUE: Final = bytes(HEADER_VALUE_RE.fullmatch(bytes([c])) is not None for c in range(256))


def _any_of(data: bytes, table: bytes) -> bool:
    """Whether a byte of `data` is marked in `table`."""
    n: i64 = len(data)
    i: i64 = 0
    while i < n:
        if table[data[i]]:
            return True
        i += 1
    return False


def framed(body: bytes) -> bytes:
    """`body` framed as one chunk of a chunked body."""
    n = len(body)
    return b"%b%b\r\n" % (_SIZE_LINES[n] if n < 4096 else b"%x\r\n" % n, body)


class RawCycle:
    __slots__ = (
        "scope",
        "protocol",
        "transport",
        "flow",
        "on_response",
        "keep_alive",
        "waiting_for_100_continue",
        "disconnected",
        "response_started",
        "response_complete",
        "chunked",
        "remaining",
        "more_body",
        "_chunks",
        "_size",
        "_ready",
        "_waiters",
        "_head",
        "_on_pause",
        "_on_resume",
        "_on_gone",
    )

    def __init__(self, protocol: HttpToolsProtocol, scope: Any, keep_alive: bool, expect_100: bool) -> None:
        self.scope = scope
        self.protocol = protocol
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.on_response: Callable[[], None] = protocol.on_response_complete
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.chunked: bool | None = None
        self.remaining = 0
        self.more_body = True
        self._chunks: list[bytes] = []
        self._size = 0
        self._ready = False  # uvicorn's message_event, set
        self._waiters: list[asyncio.Future[None]] | None = None
        self._head: bytes | None = None  # written with the first body chunk, or at the loop's next turn
        self._on_pause: Callable[[], None] | None = None  # a piped relay's (attach)
        self._on_resume: Callable[[], None] | None = None
        self._on_gone: Callable[[], object] | None = None  # the disconnect watch's (watch_disconnect)

    # -- from the protocol's parser callbacks ---------------------------------------------------
    def body_received(self, body: bytes) -> None:
        if self.response_complete:
            return
        self._chunks.append(body)
        self._size += len(body)
        if self._size > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        self._wake()

    def body_complete(self) -> None:
        if self.response_complete:
            return
        self.more_body = False
        self._wake()

    def lost(self) -> None:
        if not self.response_complete:
            self.disconnected = True
        self._wake()
        if self._on_pause is not None:
            self._on_pause()  # the relay's upstream stops at once; the disconnect watcher ends it
        if self.disconnected:
            self._gone()

    def writing_paused(self) -> None:
        if self._on_pause is not None:
            self._on_pause()

    def writing_resumed(self) -> None:
        if self._on_resume is not None and not self.disconnected:
            self._on_resume()

    def _wake(self) -> None:
        self._ready = True
        waiters, self._waiters = self._waiters, None
        if waiters:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    # -- the application's side ---------------------------------------------------------------------
    def watch_disconnect(self, on_gone: Callable[[], object]) -> _Watch:
        """`on_gone` when the connection is lost before the answer is complete: called from the
        protocol's `connection_lost`, where a task reading `receive` until `http.disconnect` would
        wake up to say so (proxy.core.asgi.watch_disconnect)."""
        self._on_gone = on_gone
        if self.disconnected:  # already: at the loop's next turn, unless cancelled by then
            self.protocol.loop.call_soon(self._gone)
        return _Watch(self)

    def _gone(self) -> None:
        gone, self._on_gone = self._on_gone, None
        if gone is not None:
            gone()

    async def receive(self) -> dict[str, Any]:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            if not self._ready:
                waiter = self.protocol.loop.create_future()
                if self._waiters is None:
                    self._waiters = [waiter]
                else:
                    self._waiters.append(waiter)
                await waiter
            self._ready = False
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        chunks = self._chunks
        if not chunks:
            body = b""
        elif len(chunks) == 1:
            body = chunks[0]
            chunks.clear()
        else:
            body = b"".join(chunks)
            chunks.clear()
        self._size = 0
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self.start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
            self.write(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")

    @property
    def writable(self) -> bool:
        """False while the client's transport has paused writing: a relay stops reading then."""
        return not self.flow.write_paused

    def start(self, status: int, headers: RawHeaders) -> None:
        """The answer's head, written at once (uvicorn's rules for its headers)."""
        self.response_started = True
        self.waiting_for_100_continue = False
        protocol = self.protocol
        scope = self.scope
        if protocol.access_log:
            protocol.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(scope),
                scope["method"],
                get_path_with_query_string(scope),
                scope["http_version"],
                status,
            )
        content = [STATUS_LINE[status]]
        close_sent = False
        names: list[bytes] = []
        values: list[bytes] = []
        for name, value in chain(protocol.server_state.default_headers, headers):
            names.append(name)
            values.append(value)
            name = name.lower()
            if name == b"content-length" and self.chunked is None:
                self.remaining = int(value.decode())
                self.chunked = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.remaining = 0
                self.chunked = True
            elif name == b"connection":
                if b"close" in [token.lower().strip() for token in value.split(b",")]:
                    self.keep_alive = False
                    close_sent = True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not close_sent:
            content.append(b"connection: close\r\n")
        if self.chunked is None and scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        # uvicorn's checks: compiled, each byte looked up in their patterns' tables; as Python, a
        # search over all the names and one over all the values (tab-separated: a value may hold a
        # tab, and no name may), two calls, not two a header.
        if _COMPILED:
            for name in names:
                if _any_of(name, _BAD_NAME):
                    raise RuntimeError("Invalid HTTP header name.")
            for value in values:
                if _any_of(value, _BAD_VALUE):
                    raise RuntimeError("Invalid HTTP header value.")
        else:
            if HEADER_RE.search(b"".join(names)):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(b"\t".join(values)):
                raise RuntimeError("Invalid HTTP header value.")
        # One write (one send(2)) for the head and the body that follows in the same step (a whole
        # answer, a stream's first events); a head alone (a stream opened early) goes at the next turn.
        self._head = b"".join(content)
        protocol.loop.call_soon(self._flush)

    def _flush(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if not self.transport.is_closing():
                self.transport.write(head)

    # -- a relay driven by the upstream's callbacks (the seam's `Sink`) ----------------------------
    def push(self, body: bytes) -> None:
        if self.disconnected or self.response_complete:
            return
        if self.chunked and self._head is None and body:
            # A stream's event after its first (the head gone): write's chunked case, written out,
            # as this runs once per upstream read.
            # framed() where compiled; as Python, its `%x` format without the call (once a token).
            self.transport.write(framed(body) if _COMPILED else b"%x\r\n%b\r\n" % (len(body), body))
            return
        self.write(body, True)

    def attach(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._on_pause = pause
        self._on_resume = resume
        # RawRoutesProtocol's (not imported: raw_routes imports this module).
        self.protocol.relayed = self  # type: ignore[attr-defined]
        if self.flow.write_paused or self.disconnected:
            pause()

    def detach(self) -> None:
        self._on_pause = self._on_resume = None
        protocol: Any = self.protocol
        if protocol.relayed is self:
            protocol.relayed = None

    def write(self, body: bytes, more_body: bool) -> None:
        """One body chunk, one `transport.write`; the last one completes the answer."""
        if self.scope["method"] == "HEAD":
            self.remaining = 0
            data = b""
        elif self.chunked:
            if body:
                data = framed(body) if more_body else framed(body) + _LAST_CHUNK
            else:
                data = b"" if more_body else _LAST_CHUNK
        else:
            if len(body) > self.remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self.remaining -= len(body)
            data = body
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        if data:
            self.transport.write(data)
        if not more_body:
            if self.remaining != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self._wake()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    # -- the request's task -------------------------------------------------------------------------
    async def run(self, app: App) -> None:
        """uvicorn's `run_asgi`, for this cycle: the same ends for an application that fails."""
        logger: logging.Logger = self.protocol.logger
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self._flush()
                self.transport.close()
        else:
            if not self.response_started and not self.disconnected:
                logger.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                logger.error("ASGI callable returned without completing response.")
                self._flush()
                self.transport.close()
        finally:
            self.on_response = _nothing

    async def _send_500(self) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"21"),
            (b"connection", b"close"),
        ]
        await self.send({"type": "http.response.start", "status": 500, "headers": headers})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error", "more_body": False})


class _Watch:
    """A cycle's disconnect watch, as `cancel()` ends it."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: RawCycle) -> None:
        self.cycle = cycle

    def cancel(self) -> None:
        self.cycle._on_gone = None


def _nothing() -> None:
    pass
