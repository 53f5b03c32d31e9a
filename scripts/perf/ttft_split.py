"""A stream's added TTFT split in two from outside the proxy, kernel included, for any build (the
compiled one cannot be patched with probes as scripts/perf/ttft_path.py patches the Python one):

  in    the client's write of the request -> the upstream's first read of it
  back  the upstream's write of the first content event -> the client's first read of it

  .venv/bin/python scripts/perf/ttft_split.py ROUNDS N [LABEL[,NAME=VALUE...] ...]
  e.g. .venv/bin/python scripts/perf/ttft_split.py 3 100 infertap python,INFERTAP_NATIVE=0

The upstream and the client are asyncio protocols in this process, on core 0, so both ends read
one clock; each target runs alone on core 1: direct (no proxy), nginx (where installed),
scripts/perf/stack_floor.py's uvicorn-proto relay (the layers infertap is built on, none of its
own work), and one `infertap serve` per LABEL with those environment variables (default: one,
`infertap`). Each round sends N streams one at a time (the head and role event at once, the first
content event 20 ms later, four more 5 ms apart) to every target, the order rotating, 5 ms apart.
Printed: the medians with the 10th..90th percentiles in microseconds, and in+back minus direct's.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httptools
import uvloop

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stack_floor_run import Relay  # noqa: E402  # (this script's folder is on sys.path when it runs)

from proxy.tools.bench import processes as P  # noqa: E402
from proxy.tools.bench.nginx import Nginx, find_nginx  # noqa: E402

TTFT_S, ITL_S, TOKENS = 0.020, 0.005, 5
clock = time.perf_counter_ns
marks: dict[str, int] = {}


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(delta: dict[str, str]) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
ROLE = _event({"role": "assistant", "content": ""})
TOKEN = [_event({"content": f"tok{i}"}) for i in range(TOKENS)]
END = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
BODY = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()


class Upstream(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        marks.setdefault("up_in", clock())
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(HEAD + ROLE)
        asyncio.get_running_loop().call_later(TTFT_S, self.token, 0)

    def token(self, i: int) -> None:
        if i == 0:
            marks["up_out"] = clock()
        self.transport.write(TOKEN[i])
        if i + 1 < TOKENS:
            asyncio.get_running_loop().call_later(ITL_S, self.token, i + 1)
        else:
            self.transport.write(END)


class Client(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.done: asyncio.Future[int] | None = None

    def data_received(self, data: bytes) -> None:
        if "cl_in" not in marks and b"tok0" in data:
            marks["cl_in"] = clock()
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        assert self.done is not None
        self.done.set_result(self.parser.get_status_code())

    async def ask(self, port: int) -> tuple[float, float]:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n" % port
        head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY)
        self.parser = httptools.HttpResponseParser(self)
        self.done = asyncio.get_running_loop().create_future()
        marks.clear()
        marks["cl_out"] = clock()
        self.transport.write(head + BODY)
        status = await self.done
        if status != 200:
            sys.exit(f"port {port} answered {status}")
        return (marks["up_in"] - marks["cl_out"]) / 1e3, (marks["cl_in"] - marks["up_out"]) / 1e3


def _q(values: list[float], f: float) -> float:
    s = sorted(values)
    return s[int(f * (len(s) - 1))]


async def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rounds, n = int(sys.argv[1]), int(sys.argv[2])
    os.sched_setaffinity(0, {0})
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", 0)
    up_port = server.sockets[0].getsockname()[1]
    targets: dict[str, tuple[int, Any]] = {"direct": (up_port, None)}
    started: list[Any] = []
    try:
        exe = find_nginx()
        if exe:
            nginx = Nginx("nginx", exe, up_port, 1, None)
            started.append(nginx)
            await asyncio.to_thread(nginx.wait_ready)  # (this loop serves the upstream meanwhile)
            targets["nginx"] = (nginx.port, nginx)
        floor = Relay("uvicorn-proto", up_port)  # on core 1, as the targets
        started.append(floor)
        targets["floor (uvicorn-proto)"] = (floor.port, floor)
        for spec in sys.argv[3:] or ["infertap"]:
            label, *settings = spec.split(",")
            env = dict(kv.split("=", 1) for kv in settings)
            proxy = P.Infertap(label, f"http://127.0.0.1:{up_port}", 1, extra_env=env)
            started.append(proxy)
            await asyncio.to_thread(proxy.wait_ready)
            targets[label] = (proxy.port, proxy)
        clients: dict[str, Client] = {}

        async def connect(name: str) -> Client:
            _, client = await loop.create_connection(Client, "127.0.0.1", targets[name][0])
            for _ in range(20):  # warm-up: connections, caches
                await client.ask(targets[name][0])
            return client

        for name in targets:
            clients[name] = await connect(name)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        names = list(targets)
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                print(f"round {r + 1}/{rounds}: {name}", file=sys.stderr)
                for _ in range(n):
                    if clients[name].transport.is_closing():  # a keep-alive timeout while idle
                        clients[name] = await connect(name)
                    times[name].append(await clients[name].ask(targets[name][0]))
                    await asyncio.sleep(0.005)
        direct = times["direct"]
        base = statistics.median(a for a, _ in direct) + statistics.median(b for _, b in direct)
        print(f"{'target':24} {'in p50':>7} {'(p10..p90)':>15} {'back p50':>9} {'(p10..p90)':>15}", end="")
        print(f" {'added':>7}")
        for name, pairs in times.items():
            a, b = [x for x, _ in pairs], [y for _, y in pairs]
            added = statistics.median(a) + statistics.median(b) - base
            print(
                f"{name:24} {statistics.median(a):7.0f} ({_q(a, 0.1):5.0f}..{_q(a, 0.9):6.0f}) "
                f"{statistics.median(b):9.0f} ({_q(b, 0.1):5.0f}..{_q(b, 0.9):6.0f}) {added:7.0f}"
            )
    finally:
        for target in started:
            target.close()


if __name__ == "__main__":
    uvloop.run(main())
