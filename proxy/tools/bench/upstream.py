"""The upstream of `infertap bench`: an OpenAI-compatible server cheap enough never to be the bottleneck.

Raw asyncio (one `asyncio.Protocol` per connection, HTTP/1.1 keep-alive), no framework: a
request is parsed only as far as the bench needs (headers up to the blank line, then
`content-length` bytes; the JSON body only for `stream` and `stream_options.include_usage`),
and every SSE event is precomputed, framed as an HTTP/1.1 chunk, and sent with one
`transport.write`. Timing comes from request headers, so one server serves every scenario:

  x-bench-ttft-ms: T    delay before the first content event (the role chunk goes at once)
  x-bench-itl-ms: G     delay between content events (0: all events back to back)
  x-bench-tokens: N     content events (output tokens); default 100

Routes: POST /v1/chat/completions (streaming or not), GET /v1/models, POST /v1/traces (200, so it
is also the OTLP/HTTP sink of the tracing scenario), GET /bench/stats (counters as JSON).

Run: `python -m proxy.tools.bench.upstream --port 0 [--cpu 0]`; it prints
`bench-upstream listening on http://HOST:PORT` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, cast

from proxy.server.os_limits import raise_nofile
from proxy.tools.bench.osutil import new_loop, pin

READY = "bench-upstream listening on "
MODEL = "bench-model"
_WORDS = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."]
_CID = "chatcmpl-bench0000000000000000"
_CREATED = 1700000000


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    # The shape vLLM sends: one choice, a delta, logprobs and finish_reason always present.
    obj = {
        "id": _CID,
        "object": "chat.completion.chunk",
        "created": _CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return _chunk(b"data: " + _json(obj) + b"\n\n")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
ROLE = _event({"role": "assistant", "content": ""})
CONTENT = [_event({"content": w}) for w in _WORDS]
FINISH = _event({}, "stop")
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"  # the last event and the end of the body, one write
PROMPT_TOKENS = 12


def _usage_event(tokens: int) -> bytes:
    obj = {
        "id": _CID,
        "object": "chat.completion.chunk",
        "created": _CREATED,
        "model": MODEL,
        "choices": [],
        "usage": _usage(PROMPT_TOKENS, tokens),
    }
    return _chunk(b"data: " + _json(obj) + b"\n\n")


def _response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        ctype,
        len(body),
        body,
    )


def _completion(tokens: int) -> bytes:
    text = "".join(_WORDS[i % len(_WORDS)] for i in range(tokens))
    obj = {
        "id": _CID,
        "object": "chat.completion",
        "created": _CREATED,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": _usage(PROMPT_TOKENS, tokens),
    }
    return _response("200 OK", _json(obj))


MODELS = _response(
    "200 OK",
    _json({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "infertap-bench"}]}),
)
TRACES_OK = _response("200 OK", b"", b"application/x-protobuf")


class Stats:
    """Counters for GET /bench/stats: the bench reads `open_streams` to know streams are held."""

    def __init__(self) -> None:
        self.open_streams = 0
        self.streams = 0
        self.completions = 0
        self.trace_posts = 0
        self.trace_bytes = 0
        # Responses are cached per token count: a scenario uses one or two counts, so this stays tiny.
        self.usage_events: dict[int, bytes] = {}
        self.completion_bodies: dict[int, bytes] = {}


def _not_found(method: str, path: str) -> bytes:
    msg = f"infertap bench upstream: no route {method} {path}"
    return _response("404 Not Found", _json({"error": {"message": msg, "type": "not_found", "code": 404}}))


class Connection(asyncio.Protocol):
    """One keep-alive connection; requests are served one after the other, as HTTP/1.1 wants."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a streaming response is in progress: later requests wait in `buf`
        self.close_after = False
        self.timer: asyncio.TimerHandle | None = None
        self.left = 0
        self.sent = 0
        self.itl = 0.0
        self.tail = b""
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self._closed_stream()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._serve_buffered()

    def _serve_buffered(self) -> None:
        while not self.busy and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", ""):
                self.transport.write(_response("411 Length Required", b"send a content-length"))
                self.transport.close()
                return
            size = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + size:
                return
            body = bytes(self.buf[end + 4 : end + 4 + size])
            del self.buf[: end + 4 + size]
            self.close_after = headers.get("connection", "").lower() == "close"
            self._dispatch(method, path.split("?", 1)[0], headers, body)
            if not self.busy and self.close_after and self.transport is not None:
                self.transport.close()

    def _dispatch(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        assert self.transport is not None
        if method == "POST" and path == "/v1/chat/completions":
            self._chat(headers, body)
        elif method == "GET" and path == "/v1/models":
            self.transport.write(MODELS)
        elif method == "GET" and path == "/health":  # what vllm-router polls before it routes
            self.transport.write(_response("200 OK", b""))
        elif method == "POST" and path == "/v1/traces":
            self.stats.trace_posts += 1
            self.stats.trace_bytes += len(body)
            self.transport.write(TRACES_OK)
        elif method == "GET" and path == "/bench/stats":
            s = self.stats
            counters = {
                "open_streams": s.open_streams,
                "streams": s.streams,
                "completions": s.completions,
                "trace_posts": s.trace_posts,
                "trace_bytes": s.trace_bytes,
            }
            self.transport.write(_response("200 OK", _json(counters)))
        else:
            self.transport.write(_not_found(method, path))

    def _chat(self, headers: dict[str, str], body: bytes) -> None:
        assert self.transport is not None
        try:
            obj = json.loads(body)
            ttft = float(headers.get("x-bench-ttft-ms", "0")) / 1000
            itl = float(headers.get("x-bench-itl-ms", "0")) / 1000
            tokens = int(headers.get("x-bench-tokens", "100"))
        except ValueError as e:
            self.transport.write(_response("400 Bad Request", _json({"error": {"message": str(e)}})))
            return
        opts = obj.get("stream_options") if isinstance(obj, dict) else None
        stats = self.stats
        if not (isinstance(obj, dict) and obj.get("stream") is True):
            stats.completions += 1
            reply = stats.completion_bodies.get(tokens)
            if reply is None:
                reply = stats.completion_bodies[tokens] = _completion(tokens)
            delay = ttft + itl * tokens
            if delay > 0:
                self.busy = True
                self.timer = asyncio.get_running_loop().call_later(delay, self._write_reply, reply)
            else:
                self.transport.write(reply)
            return
        self.tail = FINISH
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            usage = stats.usage_events.get(tokens)
            if usage is None:
                usage = stats.usage_events[tokens] = _usage_event(tokens)
            self.tail = FINISH + usage  # adjacent events, no gap between them in a real engine either
        stats.streams += 1
        stats.open_streams += 1
        self.counted = True
        self.busy = True
        self.left, self.sent, self.itl = tokens, 0, itl
        self.transport.write(SSE_HEAD + ROLE)
        if ttft > 0:
            self.timer = asyncio.get_running_loop().call_later(ttft, self._tick)
        else:
            self._tick()

    def _write_reply(self, reply: bytes) -> None:
        self.timer = None
        if self.transport is not None:
            self.transport.write(reply)
        self._response_done()

    def _tick(self) -> None:
        """Send the next content event (all of them when there is no inter-token delay)."""
        self.timer = None
        t = self.transport
        if t is None:
            return
        if self.itl <= 0:
            # Back to back: one write per event still, so the proxy sees a realistic event stream.
            while self.left > 0:
                t.write(CONTENT[self.sent % len(CONTENT)])
                self.sent += 1
                self.left -= 1
        elif self.left > 0:
            t.write(CONTENT[self.sent % len(CONTENT)])
            self.sent += 1
            self.left -= 1
            if self.left > 0:
                self.timer = asyncio.get_running_loop().call_later(self.itl, self._tick)
                return
        t.write(self.tail)
        t.write(DONE)
        self._closed_stream()
        self._response_done()

    def _closed_stream(self) -> None:
        if self.counted:
            self.counted = False
            self.stats.open_streams -= 1

    def _response_done(self) -> None:
        self.busy = False
        if self.transport is None:
            return
        if self.close_after:
            self.transport.close()
        elif self.buf:
            self._serve_buffered()


async def _serve(host: str, port: int) -> None:
    stats = Stats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(stats), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    print(f"{READY}http://{host}:{bound}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.tools.bench.upstream", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--cpu", type=int, help="pin to this CPU")
    args = p.parse_args(argv)
    pin(args.cpu)
    raise_nofile()
    loop = new_loop()
    try:
        loop.run_until_complete(_serve(args.host, args.port))
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
