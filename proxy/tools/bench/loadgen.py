"""The load generator of `infertap bench`: raw asyncio HTTP/1.1 clients, cheap per event.

One keep-alive connection per concurrent slot. A request is sent as precomputed bytes; the
response head is parsed once, the body de-chunked, SSE event boundaries found with
`bytes.find`, and every arrival stamped with `time.perf_counter()` (once per read: events that
arrive in the same read did arrive together). TTFT is the first event whose `"content":"` holds
text (the role chunk's empty content does not count); the gaps between content events are the
inter-token gaps the client sees.

It runs in its own process (`python -m proxy.tools.bench.loadgen --fd N [--cpu C]`), pinned next to
the upstream, and takes `Job`s over a `multiprocessing` connection, answering each with a
`JobResult`. A subprocess rather than `multiprocessing.Process`: `python -m proxy` has no
`__main__` guard, so a spawned child would run the command again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import cast

from proxy.oslimits import raise_nofile
from proxy.tools.bench.osutil import new_loop, pin

_CONTENT = b'"content":"'
_QUOTE = 0x22


@dataclass(frozen=True, slots=True)
class Job:
    host: str
    port: int
    stream: bool
    concurrency: int
    count: int
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    tokens: int = 100
    timeout_s: float = 60.0
    authorization: str = ""  # a client key, for an infertap that requires one
    # Open loop: `rate` streams per second arriving as a Poisson process (seeded, so that every
    # target of a round sees the same arrivals), however slowly the target answers; `concurrency`
    # connections are opened up front and more as needed. 0: a closed loop of `concurrency` slots.
    rate: float = 0.0
    seed: int = 0


@dataclass(slots=True)
class JobResult:
    """Seconds throughout. Lists hold one entry per successful request; gaps are pooled."""

    requests: int = 0
    ok: int = 0
    wall_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0
    gaps: array[float] = field(default_factory=lambda: array("d"))
    errors: Counter[str] = field(default_factory=Counter)


def request_bytes(job: Job) -> bytes:
    body: dict[str, object] = {
        "model": "bench-model",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": job.tokens,
        "stream": job.stream,
    }
    if job.stream:
        # Asked for by the client, so direct and proxied streams carry the same bytes (infertap
        # otherwise injects the option and strips the usage chunk it caused).
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {job.host}:{job.port}\r\n"
        f"content-type: application/json\r\naccept: text/event-stream\r\n"
        f"content-length: {len(payload)}\r\nx-bench-ttft-ms: {job.ttft_ms:g}\r\n"
        f"x-bench-itl-ms: {job.itl_ms:g}\r\nx-bench-tokens: {job.tokens}\r\n"
    )
    if job.authorization:
        head += f"authorization: Bearer {job.authorization}\r\n"
    head += "\r\n"
    return head.encode() + payload


class _Outcome:
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
        self.waiter: asyncio.Future[_Outcome] | None = None
        self.out = _Outcome()
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

    def request(self, data: bytes) -> asyncio.Future[_Outcome]:
        assert self.transport is not None
        self.out = _Outcome()
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


async def _connect(host: str, port: int) -> ClientConnection:
    _, proto = await asyncio.get_running_loop().create_connection(ClientConnection, host, port)
    return proto


def _check(job: Job, out: _Outcome) -> str | None:
    """What went wrong with a finished request, or None."""
    if out.error:
        return out.error
    if out.status != 200:
        return f"HTTP {out.status}: {out.body[:160].decode(errors='replace')}"
    if job.stream:
        if not out.done:
            return "stream ended without data: [DONE]"
        if len(out.times) != job.tokens:
            return f"stream carried {len(out.times)} content events, expected {job.tokens}"
    elif b'"choices"' not in out.body:
        return "non-streaming answer without choices"
    return None


async def _one(job: Job, res: JobResult, data: bytes, conn: ClientConnection) -> bool:
    """One request on `conn`, recorded in `res`; False when the connection cannot be reused."""
    t0 = time.perf_counter()
    try:
        out = await asyncio.wait_for(conn.request(data), job.timeout_s)
    except TimeoutError:
        res.errors[f"no complete answer within {job.timeout_s:g} s"] += 1
        if conn.transport is not None:
            conn.transport.close()
        return False
    problem = _check(job, out)
    if problem:
        res.errors[problem] += 1
        return conn.usable
    res.ok += 1
    res.e2e.append(out.end - t0)
    times = out.times
    if times:
        res.ttft.append(times[0] - t0)
        res.tokens += len(times)
        res.gaps.extend(b - a for a, b in zip(times, times[1:], strict=False))
    else:
        res.tokens += job.tokens  # non-streaming: the answer held them all
    return conn.usable


async def _open_loop(job: Job, res: JobResult, data: bytes, idle: list[ClientConnection]) -> JobResult:
    """Poisson arrivals at `job.rate`: a request starts when its time comes, not when an earlier
    one ends, so a slow target faces a growing queue instead of a slower load (closed loops hide
    that, and start their streams in synchronised waves)."""
    rng = random.Random(job.seed)
    perf = time.perf_counter

    async def one() -> None:
        conn = None
        while idle and conn is None:
            conn = idle.pop()
            if not conn.usable:  # closed while it waited (a keep-alive timeout, `connection: close`)
                conn = None
        if conn is None:
            conn = await _connect(job.host, job.port)
        if await _one(job, res, data, conn):
            idle.append(conn)

    tasks: list[asyncio.Task[None]] = []
    start = due = perf()
    for _ in range(job.count):
        due += rng.expovariate(job.rate)
        wait = due - perf()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    res.wall_s = perf() - start
    for conn in idle:
        if conn.transport is not None:
            conn.transport.close()
    return res


async def run_job(job: Job) -> JobResult:
    res = JobResult(requests=job.count)
    data = request_bytes(job)
    # Connections are opened before the clock starts: their set-up is not what the bench measures.
    conns = await asyncio.gather(*(_connect(job.host, job.port) for _ in range(job.concurrency)))
    issued = 0

    if job.rate > 0:
        return await _open_loop(job, res, data, conns)

    async def slot(conn: ClientConnection) -> None:
        nonlocal issued
        while issued < job.count:
            issued += 1
            if not conn.usable:
                conn = await _connect(job.host, job.port)
            await _one(job, res, data, conn)
        if conn.transport is not None:
            conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(slot(c) for c in conns))
    res.wall_s = time.perf_counter() - t0
    return res


def serve(conn: Connection) -> None:
    """Answer Jobs until None (or the parent goes away)."""
    loop = new_loop()
    asyncio.set_event_loop(loop)
    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:
                return
            if job is None:
                return
            try:
                result = loop.run_until_complete(run_job(job))
            except OSError as e:
                result = JobResult(requests=job.count)
                result.errors[f"could not connect to {job.host}:{job.port}: {e}"] = job.count
            conn.send(result)
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.tools.bench.loadgen")
    p.add_argument("--fd", type=int, required=True, help="the parent's multiprocessing connection")
    p.add_argument("--cpu", type=int, help="pin to this CPU")
    args = p.parse_args(argv)
    pin(args.cpu)
    raise_nofile()
    serve(Connection(args.fd))
    return 0


if __name__ == "__main__":
    # Run the imported module, not this __main__ copy: results must pickle as
    # proxy.tools.bench.loadgen.JobResult for the parent to load them.
    from proxy.tools.bench import loadgen

    sys.exit(loadgen.main())
