"""A client connection's reads and llhttp's callbacks for its requests, in a class that is compiled
native.

The server's protocol (proxy/server/raw_routes.py, edge.py) is uvicorn's subclassed, a Python
class, and every call into it runs as Python: a read's `data_received` went through five Python
frames (the edge's head limits, uvicorn's own) before llhttp saw a byte, and httptools calls its
protocol's `on_*` methods by name for each part of a request: the message's begin, the URL, each
header (about 3,400 instructions a header with the edge's checks), the head's end, each piece of
body, the message's end. So a connection's reads go straight to a `RequestHead`
(`RawRoutesProtocol.__init__` makes its `data_received` the protocol's) and its parser is built on
one: moved here in two steps, that work took a small request from 393.8k to 364.2k instructions
(callgrind, `scripts/perf/instructions.py`; docs/benchmarks.md). It does what they did:

- the edge's limits on a head (its bytes as they arrive, its headers, its lines: too much is
  refused with 431) and its deadline (the timer, armed when a read leaves a head incomplete);
- uvicorn's `data_received`, `on_message_begin` (the request's scope), `on_url`, `on_header`,
  written out (tests/test_edge.py fails should uvicorn's change);
- at the head's end, the split between the two paths: a proxied route gets a raw cycle and its
  task here, anything else goes to uvicorn's own `on_headers_complete` and ASGI;
- a raw cycle's body and its end.

The protocol is called back where the rare paths are (a parser error, a refusal, a pipelined
request) and for uvicorn's own cycle. A refusal from a callback (`refuse_in_callback`) answers and
raises, which stops llhttp.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import time
import urllib.parse
from typing import Any

import httptools

from proxy.control.dispatch import Dispatch, forwarded
from proxy.server.raw_cycle import RawCycle
from proxy.server.uvicorn_server import renew_date


class RequestHead:
    __slots__ = (
        "protocol",
        "parser",
        "loop",
        "dispatch",
        "max_headers",
        "max_line_bytes",
        "max_head_bytes",
        "head_timeout",
        "url",
        "headers",
        "seen",
        "in_head",
        "head_seen",
        "head_began",
        "head_timer",
        "date_second",
    )

    def __init__(self, protocol: Any, dispatch: Dispatch | None) -> None:
        self.protocol = protocol
        self.parser: Any = None  # the protocol's, built on this object (RawRoutesProtocol.__init__)
        self.loop: asyncio.AbstractEventLoop = protocol.loop
        # The app as infertap builds it: its proxied routes are served here, the rest through ASGI.
        self.dispatch = dispatch
        # The edge's limits (EdgeProtocol sets them): none without it.
        self.max_headers = sys.maxsize
        self.max_line_bytes = sys.maxsize
        self.max_head_bytes = sys.maxsize
        self.head_timeout = 0.0  # seconds; 0: no deadline
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.seen = 0  # headers of the current request
        self.in_head = True  # until the first request's head is complete
        self.head_seen = 0  # the current head's bytes so far
        self.head_began = 0.0  # loop.time() when the current head's first byte came
        self.head_timer: asyncio.TimerHandle | None = None
        self.date_second = -1  # the second whose default headers this connection saw renewed

    # -- the head's deadline ----------------------------------------------------------------
    def arm(self) -> None:
        self.disarm()
        if self.head_timeout > 0:
            self.head_timer = self.loop.call_at(self.head_began + self.head_timeout, self._timed_out)

    def disarm(self) -> None:
        timer = self.head_timer
        if timer is not None:
            timer.cancel()
            self.head_timer = None

    def _timed_out(self) -> None:
        self.head_timer = None
        if self.in_head:
            self.protocol.head_timed_out()

    # -- a read -----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if not self.in_head:
            self.feed(data)
        else:
            room = self.max_head_bytes - self.head_seen
            if len(data) <= room:
                self.head_seen += len(data)
                self.feed(data)
            else:
                # More than the head may still hold: what fits, and what follows only if the head
                # ended in it (the bytes of a head are counted before llhttp keeps them).
                self.head_seen += room
                self.feed(data[:room])
                if self.protocol.transport.is_closing():
                    return
                if self.in_head:
                    self.protocol.too_large(f"the request head is larger than {self.max_head_bytes} bytes")
                    return
                self.feed(data[room:])
        # A keep-alive connection's next head gets its deadline only when this read left it
        # incomplete: most arrive whole in one read, and a timer armed and cancelled in the same
        # callback would cost every request for nothing.
        if self.in_head and self.head_timer is None and self.head_timeout > 0:
            if not self.protocol.transport.is_closing():
                self.arm()

    def feed(self, data: bytes) -> None:
        """uvicorn's data_received, written out; its error branches are the protocol's."""
        protocol = self.protocol
        keep_alive_task = protocol.timeout_keep_alive_task
        if keep_alive_task is not None:
            keep_alive_task.cancel()
            protocol.timeout_keep_alive_task = None
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            protocol.feed_failed(e)

    # -- llhttp's callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        protocol = self.protocol
        # uvicorn's on_message_begin, written out.
        headers: list[tuple[bytes, bytes]] = []
        protocol.url = b""
        protocol.expect_100_continue = False
        protocol.headers = headers
        protocol.scope = {
            "type": "http",
            "asgi": {"version": protocol.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": protocol.server,
            "client": protocol.client,
            "scheme": protocol.scheme,
            "root_path": protocol.root_path,
            "headers": headers,
            "state": protocol.app_state.copy(),
        }
        self.url = b""
        self.headers = headers
        self.seen = 0
        if not self.in_head:  # a keep-alive connection's next request: its own head, its own deadline
            self.in_head = True
            self.head_seen = 0
            self.head_began = self.loop.time()  # the deadline is armed if the read ends in the head

    def on_url(self, url: bytes) -> None:
        url = self.url + url  # llhttp may hand it over in pieces (a request line split across reads)
        self.url = url
        if len(url) > self.max_line_bytes:
            self.protocol.refuse_in_callback(f"the request line is longer than {self.max_line_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.seen += 1
        if self.seen > self.max_headers:
            self.protocol.refuse_in_callback(f"the request has more than {self.max_headers} headers")
        if len(name) + len(value) > self.max_line_bytes:
            self.protocol.refuse_in_callback(f"a header line is longer than {self.max_line_bytes} bytes")
        # uvicorn's on_header, written out.
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace, which RFC 9110 excludes
        if name == b"expect" and value.lower() == b"100-continue":
            self.protocol.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        protocol = self.protocol
        protocol.url = self.url
        self.in_head = False
        self.disarm()
        # uvicorn's default headers (Date) renewed before a cycle takes them: once a second.
        second = int(time.time())
        if second != self.date_second:
            renew_date(protocol.server_state, protocol.config)
            self.date_second = second
        dispatch = self.dispatch
        parser = self.parser
        if dispatch is None or protocol.limit_concurrency is not None or parser.should_upgrade():
            protocol.on_headers_complete()  # uvicorn's own
            return
        method = parser.get_method().decode("ascii")
        # Any: httptools' stub types its query as bytes, which compiled code would check, and it
        # is None where the URL has none.
        parsed_url: Any = httptools.parse_url(self.url)
        raw_path: bytes = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root_path: str = protocol.root_path
        full_path = root_path + path
        if not forwarded(method, full_path):
            protocol.on_headers_complete()
            return
        # The scope as uvicorn's on_headers_complete fills it.
        scope = protocol.scope
        http_version = parser.get_http_version()
        scope["method"] = method
        if http_version != "1.1":
            scope["http_version"] = http_version
        scope["path"] = full_path
        scope["raw_path"] = root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed_url.query or b""
        keep_alive = http_version != "1.0" and parser.should_keep_alive()
        existing = protocol.cycle
        cycle = RawCycle(protocol, scope, keep_alive, protocol.expect_100_continue)
        protocol.cycle = cycle
        if existing is None or existing.response_complete:
            self.start(cycle)
        else:  # pipelined: waits for the answer before it, as uvicorn's own do
            protocol.flow.pause_reading()
            protocol.pipeline.appendleft((cycle, dispatch))

    def start(self, cycle: RawCycle) -> None:
        """A raw cycle's task, in uvicorn's task set (which its graceful shutdown waits for)."""
        dispatch = self.dispatch
        assert dispatch is not None
        protocol = self.protocol
        if protocol.config.reset_contextvars:
            task = self.loop.create_task(cycle.run(dispatch), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run(dispatch))
        tasks = protocol.tasks
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    def on_body(self, body: bytes) -> None:
        protocol = self.protocol
        cycle = protocol.cycle
        if type(cycle) is RawCycle:
            cycle.body_received(body)
        else:
            protocol.on_body(body)

    def on_message_complete(self) -> None:
        protocol = self.protocol
        cycle = protocol.cycle
        if type(cycle) is RawCycle:
            cycle.body_complete()
        else:
            protocol.on_message_complete()
