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
at each connection. The head's limits and deadline are checked, for every read, by the
connection's RequestHead (proxy/server/request_head.py, compiled), which calls back here to refuse.
It builds on uvicorn's internals (pinned in pyproject.toml); tests/test_edge.py checks the ones it
relies on, so an upgrade that changes them fails loudly.
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
        # Checked as the head arrives, by the connection's RequestHead (proxy/server/request_head.py).
        head = self.head
        head.max_headers = limits.max_headers
        head.max_line_bytes = limits.max_header_line_bytes
        head.max_head_bytes = limits.max_head_bytes
        head.head_timeout = limits.head_timeout
        self._write_timer: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head.head_began = self.loop.time()
        if len(self.connections) > self.limits.max_connections:
            log.warning(
                "connection refused: %d connections are open (max_connections)", len(self.connections) - 1
            )
            self._refuse(
                503, "infertap has too many open connections: try again shortly", "too_many_connections"
            )
            return
        self.head.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head.disarm()
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
        self.head.disarm()
        if not self.transport.is_closing():
            self.transport.write(_refusal(status, message, code))
            self.transport.close()

    # -- the head: its deadline and its size (RequestHead counts, and calls these) ----------------
    def head_timed_out(self) -> None:
        limit = self.limits.head_timeout
        self._refuse(408, f"the request head did not arrive within {limit:g} s", "request_timeout")

    def too_large(self, message: str) -> None:
        self._refuse(431, message, "request_header_fields_too_large")

    # A callback's own exception reaches uvicorn's data_received as a parser error, answered 400;
    # so a limit's refusal (431) is sent from the callback itself, and that 400 is dropped below.
    def refuse_in_callback(self, message: str) -> None:
        """A limit's refusal from a parser callback (RequestHead's): 431, and llhttp stopped."""
        self.too_large(message)
        raise _HeadTooLarge(message)

    def send_400_response(self, msg: str) -> None:
        # After a refusal of ours the parser's own error follows (a callback raised): one answer only.
        if not self.transport.is_closing():
            renew_date(self.server_state, self.config)
            super().send_400_response(msg)
