"""The load generator of `infertap bench`: jobs of requests over raw asyncio HTTP/1.1 clients
(proxy/tools/bench/connection.py), closed-loop (one keep-alive connection per concurrent slot) or
open-loop (Poisson arrivals). The gaps between content events are the inter-token gaps the client
sees.

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

from proxy.server.os_limits import raise_nofile
from proxy.tools.bench.connection import ClientConnection, Outcome, connect
from proxy.tools.bench.osutil import new_loop, pin


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


def _check(job: Job, out: Outcome) -> str | None:
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
            conn = await connect(job.host, job.port)
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
    conns = await asyncio.gather(*(connect(job.host, job.port) for _ in range(job.concurrency)))
    issued = 0

    if job.rate > 0:
        return await _open_loop(job, res, data, conns)

    async def slot(conn: ClientConnection) -> None:
        nonlocal issued
        while issued < job.count:
            issued += 1
            if not conn.usable:
                conn = await connect(job.host, job.port)
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
