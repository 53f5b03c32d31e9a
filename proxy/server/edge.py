"""The edge: uvicorn's httptools protocol with limits on what a client may send before any key is
checked, for every route.

- The request head (request line and headers): at most `[server] max_head_bytes` in all, `max_headers`
  headers and `max_header_line_bytes` per line; beyond: 431 and the connection closed. The bytes of
  a head are counted as they arrive, before llhttp accumulates them, so a 200 MB header line costs
  at most the limit in memory.
- A deadline for the head (`head_timeout`), from a connection's first byte or the first byte of its
  next request, to the end of the head: slowloris and silent connections are closed (408).
- A cap on open connections (`max_connections`): one more is answered 503 and closed at once.
- A client that stops reading: once its socket's buffer is full, an answer waits at most
  `write_timeout` for it to drain, then the connection is aborted (the request ends as a client
  disconnect, and its upstream request is cancelled). No cost per chunk: the timer runs only while
  writing is paused.

`Expect: 100-continue` is answered here, as uvicorn does, when the application first reads the body;
the header itself never goes upstream (proxy/core/headers.py drops it).

The proxied routes are served at the protocol level beneath these limits (proxy/server/raw_routes.py),
everything else through uvicorn's cycle and ASGI.

uvicorn runs this class as `Config(http="proxy.server.edge:EdgeProtocol")` (an importable name, so
that `--workers N` can start it in each worker); it reads the limits from the application's settings
at each connection. It builds on uvicorn's internals (pinned in pyproject.toml); tests/test_edge.py
checks the ones it relies on, so an upgrade that changes them fails loudly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from proxy.server.raw_routes import RawRoutesProtocol
from proxy.server.uvicorn_server import renew_date
from proxy.settings import ServerSettings

log = logging.getLogger("infertap.edge")

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def _refusal(status: int, message: str, code: str) -> bytes:
    body = orjson.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    )
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % (status, _REASONS[status], len(body))
    ) + body


class _HeadTooLarge(Exception):
    """Raised from a parser callback: llhttp stops, and the connection is refused with 431."""


class EdgeProtocol(RawRoutesProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limits = getattr(getattr(self.app, "settings", None), "server", None)
        self.limits = limits = limits if isinstance(limits, ServerSettings) else ServerSettings()
        self.head.max_headers = limits.max_headers  # checked by the parser's callbacks (RequestHead)
        self.head.max_line_bytes = limits.max_header_line_bytes
        self._in_head = True  # until the first request's head is complete
        self._head_seen = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_began = 0.0  # loop.time() when the current head's first byte came
        self._write_timer: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_began = self.loop.time()
        if len(self.connections) > self.limits.max_connections:
            log.warning(
                "connection refused: %d connections are open (max_connections)", len(self.connections) - 1
            )
            self._refuse(
                503, "infertap has too many open connections: try again shortly", "too_many_connections"
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    # -- a client that stops reading ---------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _write_stalled(self) -> None:
        self._write_timer = None
        log.warning(
            "a client read nothing for %g s (write_timeout): its connection is aborted",
            self.limits.write_timeout,
        )
        self.transport.abort()  # close() would wait for a buffer that never drains

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_refusal(status, message, code))
            self.transport.close()

    # -- the head's deadline ----------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        due = self._head_began + self.limits.head_timeout
        self._head_timer = self.loop.call_at(due, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head:
            limit = self.limits.head_timeout
            self._refuse(408, f"the request head did not arrive within {limit:g} s", "request_timeout")

    # -- the head's size --------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._receive(data)
        # A keep-alive connection's next head gets its deadline only when this read left it
        # incomplete: most arrive whole in one read, and a timer armed and cancelled in the same
        # callback would cost every request for nothing.
        if self._in_head and self._head_timer is None and not self.transport.is_closing():
            self._arm_head_timer()

    def _receive(self, data: bytes) -> None:
        if not self._in_head:
            super().data_received(data)
            return
        room = self.limits.max_head_bytes - self._head_seen
        if len(data) <= room:
            self._head_seen += len(data)
            self._feed(data)
            return
        # More than the head may still hold: feed what fits; what follows only if the head ended in it.
        self._head_seen += room
        if not self._feed(data[:room]):
            return
        if self._in_head:
            self._too_large(f"the request head is larger than {self.limits.max_head_bytes} bytes")
            return
        super().data_received(data[room:])

    def _feed(self, data: bytes) -> bool:
        """uvicorn's data_received; False when the connection was refused meanwhile."""
        super().data_received(data)
        return not self.transport.is_closing()

    def _too_large(self, message: str) -> None:
        self._refuse(431, message, "request_header_fields_too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # a keep-alive connection's next request: its own head, its own deadline
            self._in_head = True
            self._head_seen = 0
            self._head_began = self.loop.time()  # the deadline is armed if the read ends in the head

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        renew_date(self.server_state, self.config)  # before a cycle takes the default headers
        super().on_headers_complete()

    # A callback's own exception reaches uvicorn's data_received as a parser error, answered 400;
    # so a limit's refusal (431) is sent from the callback itself, and that 400 is dropped below.
    def refuse_in_callback(self, message: str) -> None:
        """A limit's refusal from a parser callback (RequestHead's): 431, and llhttp stopped."""
        self._too_large(message)
        raise _HeadTooLarge(message)

    def send_400_response(self, msg: str) -> None:
        # After a refusal of ours the parser's own error follows (a callback raised): one answer only.
        if not self.transport.is_closing():
            renew_date(self.server_state, self.config)
            super().send_400_response(msg)
