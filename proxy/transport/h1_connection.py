"""One HTTP/1.1 connection to an upstream: an asyncio protocol whose every byte is parsed by llhttp
(httptools.HttpResponseParser), one request at a time.

Three things a pooled connection must get right:
- The pool race: a kept-alive connection the upstream closed while it sat idle fails the next
  request sent on it before a byte of the answer arrives. That is nobody's failure: `head` then
  raises `Stale`, and the client asks again on a fresh connection. Once a byte arrived, a failure
  is the upstream's, as on a fresh connection.
- The idle timeout (between two reads, from the request's last byte on) costs one stored time per
  read, not a timer per read: one timer looks at the last read's time when it fires.
- Backpressure: the answer's buffer pauses reading here when its consumer falls behind.
"""

from __future__ import annotations

import asyncio
import asyncio.protocols  # named for mypyc: the base class of H1Connection lives there
import time
from collections.abc import Callable

import httptools

from proxy.core.errors import UpstreamError
from proxy.transport import h1_errors
from proxy.transport.h1_response import H1Response


class Stale(Exception):
    """A reused connection failed before a byte of the answer arrived: ask again on a fresh one."""


class H1Connection(asyncio.protocols.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, put: Callable[[H1Connection], None]) -> None:
        self.loop = loop
        self.put = put  # back to the origin's idle connections
        self.transport: asyncio.Transport | None = None
        # llhttp's body callback is this list's own append (httptools binds each callback once, when
        # the parser is made): a read's body pieces are collected without a Python frame each, and
        # handed to the answer once per read (_hand_over).
        self.bodies: list[bytes] = []
        self.on_body = self.bodies.append
        self.parser = httptools.HttpResponseParser(self)
        self.resp: H1Response | None = None
        self.head: asyncio.Future[None] | None = None
        self.closed = False
        self.reused = False  # the current request is not the connection's first
        self.got = False  # a byte of the current answer arrived
        self.paused = False
        self.head_only = False  # HEAD, CONNECT: no body follows the head
        self.interim = False  # a 1xx head: another head follows
        self.keep_alive = False
        self.idle = 0.0
        self.last_read = 0.0
        self.idle_since = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.write_paused: asyncio.Future[None] | None = None

    def new_parser(self) -> httptools.HttpResponseParser:
        return httptools.HttpResponseParser(self)

    # -- a request -------------------------------------------------------------------------------
    def start(self, idle: float, slot: asyncio.Semaphore | None, head_only: bool) -> H1Response:
        self.resp = resp = H1Response(self, slot)
        self.head = self.loop.create_future()
        self.got = False
        self.head_only = head_only
        self.keep_alive = False
        self.idle = idle
        self.last_read = now = self.loop.time()
        # The timer of the answer before goes on (it fires at that answer's last read + its idle,
        # and _check_idle moves it on while reads come): a timer made and cancelled for every
        # answer cost ~10k instructions of each. Only one due later than this answer's deadline
        # (another upstream's longer idle) is made anew.
        timer = self.timer
        if timer is None or timer.when() > now + idle:
            if timer is not None:
                timer.cancel()
            self.timer = self.loop.call_at(now + idle, self._check_idle)
        return resp

    async def write(self, data: bytes) -> float:
        """Writes the request; returns when its last byte went to the socket (time.perf_counter())."""
        assert self.transport is not None
        self.transport.write(data)
        if self.write_paused is not None:  # more than the transport's high-water mark is queued
            await self.write_paused
        return time.perf_counter()

    def pause_writing(self) -> None:
        self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        w, self.write_paused = self.write_paused, None
        if w is not None and not w.done():
            w.set_result(None)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    # -- llhttp's callbacks ----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self.got = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self._end(h1_errors.error(e))
            self.close()
        bodies = self.bodies
        if bodies:
            if self.resp is resp:
                pipe = resp._pipe
                if pipe is not None and len(bodies) == 1:
                    # A piped stream's usual read, one body piece: straight to the relay, as
                    # H1Response.take's piped case does, without its frame (once a token).
                    data = bodies.pop()
                    try:
                        pipe(data)
                    except Exception as e:
                        resp._settle(e)
                    return
                resp.take(bodies)
            else:  # after the answer was complete (a HEAD's, at its head): bytes nobody asked for
                self.bodies.clear()
                self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.raw_headers.append((name, value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        status = self.parser.get_status_code()
        if status == 101:  # switching protocols: no answer to relay, malformed as a proxy sees it
            self._end(h1_errors.error(httptools.HttpParserUpgrade()))
            self.close()
            return
        if 100 <= status < 200:
            self.interim = True
            resp.raw_headers.clear()
            return
        resp.status = status
        if self.head is not None and not self.head.done():
            self.head.set_result(None)
        if self.head_only:
            self._complete(keep_alive=False)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.resp is not None:
            self._complete(self.parser.should_keep_alive())

    def _complete(self, keep_alive: bool) -> None:
        resp = self.resp
        assert resp is not None
        self.resp = None
        self.keep_alive = keep_alive
        # The idle timer stays for the next answer (start); _check_idle, should it fire first,
        # finds no answer and lets it go.
        if self.bodies:  # what this read held of the body goes before its end
            resp.take(self.bodies)
        resp.finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.resume_writing()
        resp = self.resp
        if resp is None:
            return
        head = self.head
        if head is not None and not head.done() and self.reused and not self.got:
            self.resp = None
            head.set_exception(Stale())
        elif exc is None and resp.status and not _framed(resp):
            self._complete(keep_alive=False)  # a body delimited by the connection's end
        else:
            self._end(h1_errors.lost(exc))

    def eof_received(self) -> bool | None:
        return None  # close: a half-closed upstream sends no more answers

    # -- the idle timeout, backpressure, the end -------------------------------------------------
    def _check_idle(self) -> None:
        self.timer = None
        if self.resp is None:
            return
        now = self.loop.time()
        due = self.last_read + self.idle
        if self.paused or now < due:
            self.timer = self.loop.call_at(now + self.idle if self.paused else due, self._check_idle)
            return
        self._end(h1_errors.idle_timeout())
        self.close()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _end(self, err: UpstreamError) -> None:
        resp, self.resp = self.resp, None
        self._stop_timer()
        head = self.head
        if head is not None and not head.done():
            head.set_exception(err)
        elif resp is not None:
            if self.bodies:  # what arrived before the failure goes first
                resp.take(self.bodies)
            resp.fail(err)
        self.bodies.clear()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.last_read = self.loop.time()  # the idle clock restarts: the wait was infertap's
            self.transport.resume_reading()

    def reuse(self) -> None:
        """The answer was read whole: back to the pool if both sides keep the connection."""
        if (
            self.keep_alive
            and not self.closed
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self.resume()
            self.reused = True
            self.head = None
            self.idle_since = self.loop.time()
            self.put(self)
        else:
            self.close()

    def close(self) -> None:
        self.resp = None
        self.bodies.clear()
        self._stop_timer()
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()


def _framed(resp: H1Response) -> bool:
    """Whether the answer's length was stated (Content-Length, chunked): then a close before its end
    cut it short. Without either (and with a body), the connection's end is the body's end."""
    if resp.status in (204, 304):
        return True
    for name, _ in resp.raw_headers:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            return True
    return False
