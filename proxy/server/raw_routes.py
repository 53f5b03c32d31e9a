"""The two paths through the server, split where llhttp has parsed a request's head (by the
connection's RequestHead, proxy/server/request_head.py, which this protocol's reads go to).

A request the raw dispatch sends to the forwarder (a `/v1/*` path but `GET /v1/models`, its 401 and
405 refusals included: `proxy.control.dispatch.forwarded`) runs in infertap's own cycle
(proxy/server/raw_cycle.py), calling the dispatch directly: no `RequestResponseCycle`, no
`asyncio.Event`, no header re-checks beyond uvicorn's own. Every other request (the ops routes,
the operator API, /ui, /docs, GET /v1/models, a WebSocket upgrade, uvicorn's `limit_concurrency`)
goes to uvicorn's cycle and the ASGI app exactly as before.

Both kinds share the connection: keep-alive and pipelining as uvicorn does them (a request that
arrives while the one before is still answered waits in uvicorn's `pipeline`, reading paused, and
starts when that one completes), the drain's `shutdown` (a cycle's `keep_alive` and
`response_complete`), and uvicorn's task set, which its graceful shutdown waits for and cancels.
"""

from __future__ import annotations

from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.control.dispatch import Dispatch
from proxy.server.raw_cycle import RawCycle
from proxy.server.request_head import RequestHead


class RawRoutesProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The cycle a piped relay writes to (RawCycle.attach): not always `cycle`, which a
        # pipelined request's takes over while this one's answer is still streaming.
        self.relayed: RawCycle | None = None
        # A read and llhttp's callbacks go to a native object (proxy/server/request_head.py), which
        # does what this protocol's Python methods did: the read's handling, uvicorn's scope, the
        # head's limits, the split between the two paths, a raw cycle's body. The transport calls
        # its data_received directly (uvloop looks the method up once, at the connection's start).
        # The parser is otherwise the one uvicorn's __init__ makes (tests/test_edge.py fails
        # should that change). The proxied routes are served there for the app as infertap builds
        # it (no middleware around it: proxy_headers is off, the log level above trace); anything
        # else is served through ASGI alone.
        dispatch = getattr(self.app, "dispatch", None)
        self.head = RequestHead(self, dispatch if isinstance(dispatch, Dispatch) else None)
        self.parser = httptools.HttpRequestParser(self.head)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.head.parser = self.parser
        self.data_received = self.head.data_received  # type: ignore[method-assign]

    def data_received(self, data: bytes) -> None:
        self.head.data_received(data)

    def feed_failed(self, exc: Exception) -> None:
        """uvicorn's data_received's answers to a parser error and to an upgrade (RequestHead.feed
        writes out the rest of it)."""
        if isinstance(exc, httptools.HttpParserUpgrade):
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is RawCycle:  # a pipelined raw cycle, started when the answer before it is done
            self.head.start(cycle)
        else:
            super()._start_asgi_task(cycle, app)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.relayed is not None:
            self.relayed.writing_paused()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.relayed is not None:
            self.relayed.writing_resumed()

    def connection_lost(self, exc: Exception | None) -> None:
        relayed = self.relayed
        cycle: Any = self.cycle
        if relayed is not None and relayed is not cycle:
            relayed.lost()
        if type(cycle) is RawCycle:
            cycle.lost()
            self.cycle = None  # type: ignore[assignment]  # uvicorn's own would touch its cycle's Event
        super().connection_lost(exc)
