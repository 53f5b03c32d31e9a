"""`infertap soak`: many concurrent streams through infertap, with faults mixed in, checked byte for byte.

For every stream that succeeds, the client must have received exactly the upstream's bytes
(SHA-256 compared: nothing lost, duplicated or reordered). Every failed stream must end with an
error the client can see. infertap's RSS must stay flat after warm-up, and its in-flight gauge
must end at 0.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from proxy.tools.fake_upstream import FakeUpstream

# Fault name -> request headers for the fake upstream. "ok" is a clean stream.
FAULTS: dict[str, dict[str, str]] = {
    "ok": {},
    "retry_503": {"x-fake-fail-first": "1"},
    "cut": {"x-fake-cut": "3"},
    "stall": {"x-fake-hang": "after-first"},
    "no_done": {"x-fake-no-done": "1"},
    "upstream_500": {"x-fake-status": "500"},
}
# Faults after which the client must still get the upstream's exact stream.
_CLEAN = {"ok", "retry_503"}


@dataclass
class Report:
    streams: int = 0
    concurrency: int = 0
    duration_s: float = 0.0
    fault_rate: float = 0.0
    by_fault: dict[str, int] = field(default_factory=dict)
    verified_identical: int = 0
    errors_visible: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    rss_after_warmup_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_peak_mb: float = 0.0
    in_flight_end: float = -1.0
    proxy_log_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


class _UpstreamThread:
    def __init__(self, app: FakeUpstream) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=0, log_level="critical", lifespan="on", access_log=False
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the soak upstream did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def _one(
    client: httpx.AsyncClient,
    base: str,
    rid: str,
    fault: str,
    events: int,
    gap_ms: int,
    upstream: FakeUpstream,
    report: Report,
) -> None:
    headers = {
        "x-request-id": rid,
        "x-fake-events": str(events),
        "x-fake-gap-ms": str(gap_ms),
        **FAULTS[fault],
    }
    # Asking for usage ourselves keeps infertap from injecting (and stripping) it: the bytes must match.
    body = {
        "model": "soak-model",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"soak {rid}"}],
    }
    digest = hashlib.sha256()
    status = 0
    last_event = b""
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
            status = r.status_code
            async for piece in r.aiter_raw():
                digest.update(piece)
                last_event = (last_event + piece)[-4096:]
    except httpx.HTTPError as e:
        report.problems.append(f"{rid} ({fault}): transport error at the client: {e!r}")
        return
    sent = upstream.sent.pop(rid, None)
    if status == 200 and fault in _CLEAN:
        if sent is None or hashlib.sha256(sent).digest() != digest.digest():
            report.problems.append(f"{rid} ({fault}): the client's bytes differ from the upstream's")
        else:
            report.verified_identical += 1
        return
    # A failed stream (or a clean one refused while the upstream's circuit was open) must say so.
    tail = last_event.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    if status >= 400 or tail.startswith(b'data: {"error"'):
        report.errors_visible += 1
        kind = (
            f"HTTP {status}"
            if status >= 400
            else "sse " + (tail.split(b'"type":"', 1)[-1].split(b'"')[0]).decode()
        )
        report.error_kinds[kind] = report.error_kinds.get(kind, 0) + 1
    else:
        report.problems.append(f"{rid} ({fault}): failed without an error the client can see (HTTP {status})")


async def _drive(
    base: str, upstream: FakeUpstream, args: argparse.Namespace, report: Report, proxy_pid: int
) -> None:
    rng = random.Random(args.seed)
    faults = [f for f in FAULTS if f != "ok"]
    plan = ["ok" if rng.random() >= args.fault_rate else rng.choice(faults) for _ in range(args.streams)]
    report.by_fault = dict(Counter(plan))
    sem = asyncio.Semaphore(args.concurrency)
    done = 0
    warm = max(1, args.streams // 10)
    # Idle connections expire before the server's 5 s keep-alive does: otherwise a request can
    # race the server closing its connection, a client-side error that says nothing of infertap.
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(60), limits=limits) as client:

        async def run(i: int, fault: str) -> None:
            nonlocal done
            async with sem:
                await _one(client, base, f"soak-{i}", fault, args.events, args.gap_ms, upstream, report)
            done += 1
            if done == warm:
                report.rss_after_warmup_mb = _rss_mb(proxy_pid)
            if args.progress and done % max(1, args.streams // 20) == 0:
                print(f"  {done}/{args.streams} streams", file=sys.stderr, flush=True)

        await asyncio.gather(*(run(i, f) for i, f in enumerate(plan)))
        metrics = (await client.get(f"{base}/metrics")).text
    report.in_flight_end = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("infertap_in_flight_requests{")
    )


def run_soak(args: argparse.Namespace) -> Report:
    report = Report(streams=args.streams, concurrency=args.concurrency, fault_rate=args.fault_rate)
    upstream = FakeUpstream()
    with _UpstreamThread(upstream) as upstream_url:
        port = _free_port()
        env = {
            **os.environ,
            "INFERTAP_METRICS__ACCESS_LOG": "false",
            "INFERTAP_TIMEOUTS__IDLE": "1",
            "INFERTAP_RETRY__BACKOFF_SECONDS": "0.05",
            # The faults are deliberate: keep the circuit breaker from turning clean streams away,
            # so that every stream exercises the data path.
            "INFERTAP_CIRCUIT__MIN_CALLS": "1000000",
        }
        cmd = [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--port",
            str(port),
            "--upstream",
            f"soak={upstream_url}",
            "--forward-header",
            "x-fake-*",
            "--log-level",
            "warning",
        ]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"{base}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("infertap did not start for the soak")
                time.sleep(0.05)
            start = time.perf_counter()
            asyncio.run(_drive(base, upstream, args, report, proc.pid))
            report.duration_s = round(time.perf_counter() - start, 2)
            report.rss_end_mb = round(_rss_mb(proc.pid), 1)
            report.rss_peak_mb = round(_rss_mb(proc.pid, "VmHWM"), 1)
            report.rss_after_warmup_mb = round(report.rss_after_warmup_mb, 1)
        finally:
            proc.terminate()
            proc.wait(timeout=15)
            log.seek(0)
            report.proxy_log_tail = log.read().decode(errors="replace")[-3000:]
            log.close()
    if report.in_flight_end != 0:
        report.problems.append(f"in-flight gauge ended at {report.in_flight_end}, not 0")
    growth = report.rss_end_mb - report.rss_after_warmup_mb
    if growth > args.max_rss_growth_mb:
        report.problems.append(f"RSS grew {growth:.1f} MB after warm-up (limit {args.max_rss_growth_mb} MB)")
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infertap soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: infertap soak --streams 5000 --concurrency 64",
    )
    p.add_argument("--streams", type=int, default=2000, help="streams in all (default 2000)")
    p.add_argument("--concurrency", type=int, default=64, help="streams at once (default 64)")
    p.add_argument("--events", type=int, default=40, help="output events per stream (default 40)")
    p.add_argument("--gap-ms", type=int, default=2, help="gap between events at the upstream (default 2)")
    p.add_argument(
        "--fault-rate", type=float, default=0.2, help="share of streams given a fault (default 0.2)"
    )
    p.add_argument("--max-rss-growth-mb", type=float, default=30.0, help="allowed RSS growth after warm-up")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not Path("/proc/self/status").exists():
        print("infertap soak: needs Linux /proc to read the proxy's memory", file=sys.stderr)
        return 2
    report = run_soak(args)
    data: dict[str, Any] = {**asdict(report), "ok": report.ok}
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for key, val in data.items():
            if key != "problems":
                print(f"{key:>22}: {val}")
        for problem in report.problems[:20]:
            print(f"  PROBLEM: {problem}")
    return 0 if report.ok else 1
