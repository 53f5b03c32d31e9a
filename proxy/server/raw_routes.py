"""The two paths through the server, split where llhttp has parsed a request's head.

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

import urllib.parse
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.control.dispatch import Dispatch, forwarded
from proxy.server.raw_cycle import RawCycle
from proxy.server.request_head import RequestHead


class RawRoutesProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The app as infertap builds it (no middleware around it: proxy_headers is off, the log
        # level above trace); anything else is served through ASGI alone.
        dispatch = getattr(self.app, "dispatch", None)
        self.dispatch = dispatch if isinstance(dispatch, Dispatch) else None
        # The cycle a piped relay writes to (RawCycle.attach): not always `cycle`, which a
        # pipelined request's takes over while this one's answer is still streaming.
        self.relayed: RawCycle | None = None
        # llhttp's callbacks go to a native object (proxy/server/request_head.py), which hands a raw
        # cycle its body and calls this protocol back where uvicorn's state is made or read; the
        # parser is otherwise the one uvicorn's __init__ makes (tests/test_edge.py fails should
        # that change).
        self.head = RequestHead(self)
        self.parser = httptools.HttpRequestParser(self.head)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)

    def on_headers_complete(self) -> None:
        dispatch = self.dispatch
        parser = self.parser
        if dispatch is None or self.limit_concurrency is not None or parser.should_upgrade():
            super().on_headers_complete()
            return
        method = parser.get_method().decode("ascii")
        parsed_url = httptools.parse_url(self.url)
        raw_path = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        full_path = self.root_path + path
        if not forwarded(method, full_path):
            super().on_headers_complete()
            return
        scope = self.scope
        http_version = parser.get_http_version()
        scope["method"] = method
        if http_version != "1.1":
            scope["http_version"] = http_version
        scope["path"] = full_path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed_url.query or b""
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        existing = self.cycle
        cycle = RawCycle(self, scope, keep_alive, self.expect_100_continue)
        self.cycle = cycle  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            self._start_raw(cycle)
        else:  # pipelined: waits for the answer before it, as uvicorn's own do
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, dispatch))  # type: ignore[arg-type]

    def _start_raw(self, cycle: RawCycle) -> None:
        assert self.dispatch is not None
        if self.config.reset_contextvars:
            import contextvars

            task = self.loop.create_task(cycle.run(self.dispatch), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run(self.dispatch))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is RawCycle:
            self._start_raw(cycle)
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
