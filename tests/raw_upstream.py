"""A raw HTTP/1.1 upstream on 127.0.0.1 for the failures no well-behaved server produces: a body cut
at an exact byte, a connection closed before the headers, bytes that are not HTTP.

Each request is answered by `answer(path, headers)`, which returns the raw bytes to write; the
connection is closed after them (so a body without a length, or one shorter than it says, is cut
there).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tests import loop_thread

# The raw bytes to write; or parts, where a threading.Event means: wait for it (up to 30 s) before
# writing on (an upstream that waits for the client to have seen something).
Answer = Callable[[str, dict[str, str]], bytes | list[bytes | threading.Event]]


def not_found(path: str, headers: dict[str, str]) -> bytes:
    return whole("404 Not Found", "application/json", b'{"error": {"message": "not here"}}')


def whole(status: str, content_type: str, body: bytes) -> bytes:
    """A complete answer with a Content-Length (and `connection: close`: the server closes after it)."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"connection: close\r\n\r\n" + body


@contextmanager
def raw_upstream(answer: Answer, hold: Callable[[dict[str, str]], bool] | None = None) -> Iterator[str]:
    """Serves `answer` on an OS-chosen loopback port; yields the base URL (with /v1). When `hold`
    says so for a request's headers, the connection stays open after the answer until the other
    side closes it."""
    loop = asyncio.new_event_loop()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                if ":" in line:
                    name, value = line.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            await reader.readexactly(int(headers.get("content-length", "0")))
            parts = answer(head[0].split(" ")[1], headers)
            for part in [parts] if isinstance(parts, bytes) else parts:
                if isinstance(part, threading.Event):
                    await asyncio.get_running_loop().run_in_executor(None, part.wait, 30)
                    continue
                writer.write(part)
                await writer.drain()
            if hold is not None and hold(headers):
                await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = loop_thread.start(loop)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        loop_thread.stop(loop, thread, server)


def chunked(status: str, content_type: str, body: bytes, cut: int | None = None, piece: int = 64) -> bytes:
    """A chunked answer of `body` in chunks of `piece` bytes, cut after `cut` bytes of it (the chunk
    holding that byte sent in part, and never the last, empty chunk); whole when `cut` is None."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n"
    out = [head.encode() + b"connection: close\r\n\r\n"]
    end = len(body) if cut is None else cut
    for i in range(0, len(body), piece):
        if i >= end:
            break
        part = body[i : i + piece]
        sent = body[i : min(i + piece, end)]
        out.append(b"%x\r\n" % len(part) + sent + (b"\r\n" if sent == part else b""))
    if cut is None:
        out.append(b"0\r\n\r\n")
    return b"".join(out)
