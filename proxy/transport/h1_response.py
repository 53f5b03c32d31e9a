"""One answer of the httptools client: status and headers as llhttp parsed them, and the body as
it arrives, through a bounded buffer (when the consumer falls behind, the connection stops reading
from the upstream's socket, and reads again once the consumer has taken everything), or piped: handed
to a callback from the connection's own receive callback (`pipe`, the seam's `Piped`), once per
read and with no reader task, reading paused and resumed by the callback's owner."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol, cast

from proxy.core.errors import UpstreamError
from proxy.transport.h1_headers import Headers

# Bytes held for a consumer before the upstream's socket is no longer read: a few hundred events.
HIGH_WATER = 256 * 1024


class Source(Protocol):
    """The connection an answer arrives on (h1_connection.H1Connection)."""

    loop: asyncio.AbstractEventLoop
    paused: bool

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def reuse(self) -> None: ...
    def close(self) -> None: ...


class H1Response:
    __slots__ = (
        "status",
        "raw_headers",
        "sent_at",
        "done",
        "exc",
        "_headers",
        "_conn",
        "_slot",
        "_buf",
        "_size",
        "_waiter",
        "_loop",
        "_pipe",
        "_piped",
    )

    def __init__(self, conn: Source, slot: asyncio.Semaphore | None) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.sent_at: float | None = None
        self.done = False  # the body arrived whole
        self.exc: UpstreamError | None = None  # what ended it otherwise
        self._headers: Headers | None = None
        self._conn: Source | None = conn
        self._slot = slot
        self._buf: deque[bytes] = deque()
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._loop = conn.loop
        self._pipe: Callable[[bytes], None] | None = None
        self._piped: asyncio.Future[None] | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        if self._headers is None:
            self._headers = Headers(self.raw_headers)
        return cast(Mapping[str, str], self._headers)  # a registered Mapping (h1_headers.py)

    # -- fed by the connection's protocol callbacks ----------------------------------------------
    def take(self, bodies: list[bytes]) -> None:
        """One read's body pieces (llhttp's chunks: an event each, often), emptied from `bodies`: to
        the pipe in one call (one scan and one write per read), or into the buffer. A piped read
        of one piece does not come here: H1Connection.data_received hands it to the pipe itself,
        as this does (a frame less once a token): change the two together."""
        data = bodies[0] if len(bodies) == 1 else b"".join(bodies)
        bodies.clear()
        pipe = self._pipe
        if pipe is not None:
            try:
                pipe(data)
            except Exception as e:  # the consumer's failure ends the body (a scanner's limit)
                self._settle(e)
            return
        self._buf.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and self._conn is not None:
            self._conn.pause()
        self._wake()

    def finish(self) -> None:
        self.done = True
        if self._piped is not None:
            self._settle(None)
        self._wake()

    def fail(self, exc: UpstreamError) -> None:
        if not self.done and self.exc is None:
            self.exc = exc
            if self._piped is not None:
                self._settle(exc)
            self._wake()

    def _settle(self, exc: BaseException | None) -> None:
        if self._pipe is not None:
            self._pipe = None
            if exc is not None:
                self.pause_body()  # nobody takes what follows: the connection is dropped next
        fut = self._piped
        if fut is not None and not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    # -- the seam's side -------------------------------------------------------------------------
    def chunks(self) -> AsyncIterator[bytes]:
        return _Chunks(self)

    def pipe(self, on_data: Callable[[bytes], None]) -> asyncio.Future[None]:
        self._piped = fut = self._loop.create_future()
        buf = self._buf
        if buf:
            data = buf[0] if len(buf) == 1 else b"".join(buf)
            buf.clear()
            self._size = 0
            try:
                on_data(data)
            except Exception as e:
                fut.set_exception(e)
                return fut
        if self.done:
            fut.set_result(None)
        elif self.exc is not None:
            fut.set_exception(self.exc)
        else:
            self._pipe = on_data
            self.resume_body()  # the buffer is empty: whatever paused reading for it is over
        return fut

    def unpipe(self) -> None:
        self._pipe = None

    def pause_body(self) -> None:
        if self._conn is not None:
            self._conn.pause()

    def resume_body(self) -> None:
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()

    async def read(self) -> bytes:
        return b"".join([data async for data in _Chunks(self)])

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if self.done and not self._buf:
                conn.reuse()
            else:
                conn.close()
        self._free()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        self._free()

    def _free(self) -> None:
        # Once, whichever of release and close comes (both may).
        if self._slot is not None:
            self._slot.release()
            self._slot = None


class _Chunks:
    """The body as it arrives (`UpstreamResponse.chunks`): what the buffer holds, in one piece, at
    each step. An iterator class, not an async generator: mypyc compiles no async generator
    (proxy/compiled/), and this runs once a read."""

    def __init__(self, resp: H1Response) -> None:
        self.resp = resp
        self.over = False  # as an async generator is, once it returned or raised

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        resp = self.resp
        buf = resp._buf
        while not self.over:
            if buf:
                if len(buf) == 1:
                    data = buf.popleft()
                else:
                    data = b"".join(buf)
                    buf.clear()
                resp._size = 0
                conn = resp._conn
                if conn is not None and conn.paused:
                    conn.resume()  # drained: the upstream may send again
                return data
            if resp.done:
                self.over = True
            elif resp.exc is not None:
                self.over = True
                raise resp.exc
            else:
                resp._waiter = waiter = resp._loop.create_future()
                await waiter
        raise StopAsyncIteration
