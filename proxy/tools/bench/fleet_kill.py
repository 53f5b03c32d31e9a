"""The fleet scenario's `kill` workload: a replica killed mid-run (issue 26).

Streaming single turns of distinct prompts, `concurrency` at a time in a closed loop, go to one
infertap with a pool of the sims. When the `kill_after`-th request starts, one sim gets SIGKILL (a
crashed engine: its connections reset, its streams cut mid-way). Once infertap shows it ejected
(`infertap_replica_up` 0 on its /metrics) and `down_s` have passed, the sim is started again on
its port, so the pool's URL answers again; the load goes on until infertap has readmitted it (the
gauge back at 1) and it has answered `served_after` more requests, then stops.

What the client counts: requests that failed without any output token (each should have been
retried on another replica: issue 26 wants none), streams that had tokens and then ended with
infertap's in-band error event (those flowing from the killed replica: they cannot move), other
failures, and the rest ok. Every run has an infertap of its own, started fresh, with a [circuit]
that acts within seconds (CIRCUIT). The rows, notes and targets: fleet_kill_rows.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from proxy.tools.bench.fleet_load import _text
from proxy.tools.bench.processes import BenchError, Infertap
from proxy.tools.doctor.exposition import parse

KILLED = 1  # the index of the replica killed
# The defaults (20 calls, a 30 s window, 30 s before a probe) would take minutes of load to eject
# and readmit; these act within seconds, as a small fleet's operator might set them.
CIRCUIT = {"min_calls": 5, "window_seconds": 2.0, "cooldown_seconds": 1.0}
POLL_S = 0.05


@dataclass(frozen=True)
class KillWorkload:
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    kill_after: int  # requests started when the replica is killed
    down_s: float  # dead at least this long (and until infertap ejected it)
    served_after: int  # answered by the restarted replica before the load stops
    # Worker i starts i x this late: the streams stay out of step (in step, the kill would come as
    # one wave of them ends and the next begins, when none is flowing).
    stagger_s: float
    deadline_s: float = 60.0  # for each wait: the kill, the ejection, the readmission


def kill_workload(quick: bool, replicas: int) -> KillWorkload:
    if quick:
        return KillWorkload(4, 40, 8, kill_after=12, down_s=0.5, served_after=2, stagger_s=0.05)
    return KillWorkload(
        4 * replicas, 200, 32, kill_after=16 * replicas, down_s=2.0, served_after=16, stagger_s=0.04
    )


def circuit_section() -> str:
    return "\n[circuit]\n" + "".join(f"{k} = {v}\n" for k, v in CIRCUIT.items())


class Replica(Protocol):
    """What the workload needs of a sim (fleet.Sim)."""

    url: str

    def kill(self) -> None: ...

    def spawn(self) -> None: ...

    def ready(self) -> None: ...


@dataclass
class KillOutcome:
    requests: int = 0
    ok: int = 0
    ttft: list[float] = field(default_factory=list)
    before_first: Counter[str] = field(default_factory=Counter)  # failed without any output token
    interrupted: int = 0  # tokens, then infertap's in-band error event
    after_first: Counter[str] = field(default_factory=Counter)  # tokens, then any other failure
    ejected_s: float | None = None  # after the kill
    restarted_s: float | None = None
    readmitted_s: float | None = None
    served_after_restart: int = 0
    load: list[float] = field(default_factory=list)  # ok answers per replica, as infertap counts them
    decisions: dict[str, float] = field(default_factory=dict)


def pool_series(text: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """From infertap's /metrics: infertap_replica_up and the ok answers, by replica; the balance
    decisions, by reason."""
    samples = parse(text)
    return (
        samples.by("infertap_replica_up", "replica"),
        samples.by("infertap_replica_requests_total", "replica", outcome="ok"),
        samples.by("infertap_balance_decisions_total", "reason"),
    )


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: KillOutcome) -> None:
    out.requests += 1
    started = time.perf_counter()
    first: float | None = None
    done = False

    def failed(kind: str) -> None:
        if first is None:
            out.before_first[kind] += 1
        else:
            out.after_first[kind] += 1

    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                failed(f"HTTP {resp.status_code}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    if first is None:
                        failed(f"in-band {event['error'].get('code')}")
                        return
                    out.interrupted += 1
                    return
                for choice in event.get("choices") or ():
                    if (choice.get("delta") or {}).get("content") and first is None:
                        first = time.perf_counter()
    except (httpx.HTTPError, ValueError) as e:
        failed(type(e).__name__)
        return
    if first is None or not done:
        failed("no token" if first is None else "no [DONE]")
        return
    out.ok += 1
    out.ttft.append(first - started)


class _Run:
    def __init__(self, port: int, sim: Replica, w: KillWorkload, salt: int) -> None:
        self.port, self.sim, self.w, self.salt = port, sim, w, salt
        self.out = KillOutcome()
        self.started = 0
        self.kill_now = asyncio.Event()
        self.stop = asyncio.Event()

    def body(self, n: int) -> dict[str, Any]:
        text = f"kill run {self.salt} request {n}: " + _text_for(self.salt, n, self.w.prompt_tokens)
        return {
            "model": "fleet",
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "max_tokens": self.w.output_tokens,
        }

    async def worker(self, client: httpx.AsyncClient, i: int) -> None:
        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        await asyncio.sleep(i * self.w.stagger_s)
        while not self.stop.is_set():
            n = self.started
            self.started += 1
            if self.started == self.w.kill_after:
                self.kill_now.set()
            await _stream(client, url, self.body(n), self.out)

    async def replica(self, client: httpx.AsyncClient) -> tuple[float | None, float]:
        """The killed replica's infertap_replica_up and ok answers, now."""
        resp = await client.get(f"http://127.0.0.1:{self.port}/metrics")
        up, ok, _ = pool_series(resp.text)
        return up.get(self.sim.url), ok.get(self.sim.url, 0.0)

    async def until(self, what: Callable[[], Any], since: float) -> bool:
        """Polls `what` (a coroutine function) until it is true; False after the deadline."""
        while time.monotonic() < since + self.w.deadline_s:
            if await what():
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def control(self, client: httpx.AsyncClient) -> None:
        out, w = self.out, self.w
        try:
            await asyncio.wait_for(self.kill_now.wait(), w.deadline_s)
        except TimeoutError:
            return
        t0 = time.monotonic()
        self.sim.kill()

        async def ejected() -> bool:
            if (await self.replica(client))[0] == 0:
                out.ejected_s = time.monotonic() - t0
            return out.ejected_s is not None

        await self.until(ejected, t0)
        await asyncio.sleep(max(0.0, t0 + w.down_s - time.monotonic()))
        await _restart(self.sim)
        out.restarted_s = time.monotonic() - t0
        served0 = (await self.replica(client))[1]

        async def readmitted() -> bool:
            up, ok = await self.replica(client)
            if up == 1 and out.readmitted_s is None:
                out.readmitted_s = time.monotonic() - t0
            out.served_after_restart = int(ok - served0)
            return out.readmitted_s is not None and out.served_after_restart >= w.served_after

        await self.until(readmitted, time.monotonic())

    async def main(self) -> KillOutcome:
        limits = httpx.Limits(max_connections=self.w.concurrency * 2 + 2)
        async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
            workers = [asyncio.create_task(self.worker(client, i)) for i in range(self.w.concurrency)]
            try:
                await self.control(client)
            finally:
                self.stop.set()
                await asyncio.gather(*workers)
        return self.out


def _text_for(salt: int, n: int, words: int) -> str:
    return _text(random.Random(f"kill {salt}/{n}"), words)


async def _restart(sim: Replica, tries: int = 5) -> None:
    """Starts the sim again on its port (another socket may hold it a moment: tried again)."""
    for i in range(tries):
        sim.spawn()
        try:
            await asyncio.to_thread(sim.ready)
            return
        except BenchError:
            if i == tries - 1:
                raise
            await asyncio.sleep(0.5)


def run_kill(sims: Sequence[Replica], config: str, label: str, w: KillWorkload, salt: int) -> KillOutcome:
    """One run: a fresh infertap with `config` (a pool of `sims`), the load, sims[KILLED] killed
    and started again. BenchError when that infertap does not start."""
    proxy = Infertap(label, "", None, config=config)
    try:
        proxy.wait_ready()
        out = asyncio.run(_Run(proxy.port, sims[KILLED], w, salt).main())
        _, ok, out.decisions = pool_series(httpx.get(f"http://127.0.0.1:{proxy.port}/metrics").text)
        out.load = [ok.get(s.url, 0.0) for s in sims]
    finally:
        proxy.close()
    return out
