"""The load generator's HTTP/1.1 client: one raw asyncio keep-alive connection, cheap per event.

A request goes out as precomputed bytes; the response head is parsed once, the body de-chunked,
SSE event boundaries found with `bytes.find`, and every arrival stamped with `time.perf_counter()`
(once per read: events that arrive in the same read did arrive together). TTFT is the first event
whose `"content":"` holds text (the role chunk's empty content does not count).
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

_CONTENT = b'"content":"'
_QUOTE = 0x22


class Outcome:
    __slots__ = ("status", "times", "done", "error", "body", "end")

    def __init__(self) -> None:
        self.status = 0
        self.times: list[float] = []  # arrival of each content event
        self.done = False  # saw `data: [DONE]` (streams) or the whole body
        self.error: str | None = None
        self.body = b""
        self.end = 0.0  # when the last byte arrived (not when the awaiting task got to run)


class ClientConnection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future[Outcome] | None = None
        self.out = Outcome()
        self.buf = bytearray()
        self.sse = bytearray()
        self.in_head = True
        self.chunked = False
        self.is_sse = False
        self.remaining = 0  # content-length bodies
        self.keep_alive = True

    @property
    def usable(self) -> bool:
        """Open, and not being closed (an answer with `connection: close` closes it)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's do not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.out.error = "connection closed before the response ended"
            self.out.end = time.perf_counter()
            self.waiter.set_result(self.out)

    def request(self, data: bytes) -> asyncio.Future[Outcome]:
        assert self.transport is not None
        self.out = Outcome()
        self.in_head = True
        self.buf.clear()
        self.sse.clear()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def _finish(self, now: float) -> None:
        self.out.done = True
        self.out.end = now
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.out)
        if not self.keep_alive and self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.buf
        buf += data
        if self.in_head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = buf[:end].decode("latin-1").split("\r\n")
            self.out.status = int(lines[0].split(" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip().lower()
            self.chunked = "chunked" in headers.get("transfer-encoding", "")
            self.is_sse = headers.get("content-type", "").startswith("text/event-stream")
            self.remaining = int(headers.get("content-length", "0"))
            self.keep_alive = headers.get("connection") != "close"
            self.in_head = False
            del buf[: end + 4]
        if not self.chunked:
            if len(buf) >= self.remaining:
                self.out.body = bytes(buf[: self.remaining])
                del buf[: self.remaining]
                self._finish(now)
            return
        # De-chunk whole chunks only: an event split across reads counts when it is complete.
        pos = 0
        sse = self.sse
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(buf[pos:nl].split(b";", 1)[0], 16)
            end = nl + 2 + size
            if len(buf) < end + 2:
                break
            if size == 0:
                del buf[: end + 2]
                if self.is_sse:
                    self._events(now)
                else:  # a chunked JSON answer (infertap relays bodies as they come)
                    self.out.body = bytes(sse)
                self._finish(now)
                return
            sse += buf[nl + 2 : end]
            pos = end + 2
        del buf[:pos]
        if self.is_sse:
            self._events(now)

    def _events(self, now: float) -> None:
        sse = self.sse
        start = 0
        times = self.out.times
        while True:
            end = sse.find(b"\n\n", start)
            if end < 0:
                break
            at = sse.find(_CONTENT, start, end)
            if at >= 0 and sse[at + len(_CONTENT)] != _QUOTE:
                times.append(now)
            elif sse.startswith(b"data: [DONE]", start):
                self.out.done = True
            elif self.out.status == 200 and sse.startswith(b'data: {"error"', start):
                self.out.error = "in-band SSE error event: " + sse[start:end][:200].decode(errors="replace")
            start = end + 2
        if start:
            del sse[:start]


async def connect(host: str, port: int) -> ClientConnection:
    _, proto = await asyncio.get_running_loop().create_connection(ClientConnection, host, port)
    return proto
