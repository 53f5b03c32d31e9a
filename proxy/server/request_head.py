"""llhttp's callbacks for the requests on one client connection, in a class that is compiled native.

httptools calls its protocol's `on_*` methods by name for each part of a request it parses: the
message's begin, the URL, each header, the head's end, each piece of body, the message's end. The
server's protocol (proxy/server/raw_routes.py, edge.py) is uvicorn's subclassed, a Python class,
and each of those calls into it ran as Python: about 3,400 instructions a header with the edge's
checks (callgrind, `scripts/perf/instructions.py`), seven to ten headers a request. So its parser
is built on a `RequestHead` instead, which keeps the URL, counts the headers against the edge's
limits and stores them as uvicorn's `on_url` and `on_header` do, and hands a raw cycle its body;
the protocol is called back only where uvicorn's state is made or read: the message's begin
(uvicorn's scope, the head's deadline), the head's end (the two paths' split) and the body of a
request that uvicorn's own cycle serves.

What the edge refuses here (too many headers, a header line or the request line too long) it
refuses as before: its `refuse_in_callback` answers 431 and raises, which stops llhttp.
"""

from __future__ import annotations

import sys
from typing import Any

from proxy.server.raw_cycle import RawCycle


class RequestHead:
    __slots__ = ("protocol", "max_headers", "max_line_bytes", "url", "headers", "seen")

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        # The edge's limits (EdgeProtocol sets them): none without it.
        self.max_headers = sys.maxsize
        self.max_line_bytes = sys.maxsize
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.seen = 0  # headers of the current request

    def on_message_begin(self) -> None:
        protocol = self.protocol
        protocol.on_message_begin()
        self.url = b""
        self.headers = protocol.headers  # the list that uvicorn's new scope holds
        self.seen = 0

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
        # uvicorn's on_header, written out (tests/test_edge.py fails should it change).
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace, which RFC 9110 excludes
        if name == b"expect" and value.lower() == b"100-continue":
            self.protocol.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        protocol = self.protocol
        protocol.url = self.url
        protocol.on_headers_complete()

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
