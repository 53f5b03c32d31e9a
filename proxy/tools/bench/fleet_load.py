"""The fleet scenario's workloads: multi-turn conversations whose history grows every turn, sent
to whatever `route` names for each turn (a simulated engine straight, or a router in front of them).

A conversation is a system prompt of its own (an agent's instructions: ~1,200 tokens of the sim's
tokenizer, one word a token) and turns of a user message; every turn sends the whole history,
the answers the engine streamed included, as a chat client does. So turn k's prompt starts with
turn k-1's, and an engine that saw turn k-1 has its blocks in its prefix cache, if they were not
evicted meanwhile. `salt` makes every prompt of a run distinct from every other run's, so that no
row inherits the cache of the row before it.

Conversations arrive interleaved, in an open loop: at random (exponential gaps of `stagger_s` on
average; later when `concurrency` are already under way), and each user reads an answer for a random
while (`think_s` on average) before the next turn. Without that randomness the turns of 8
conversations on 4 replicas march in step, and round robin sends every conversation to the same
replica each turn, as an oracle would. `seed` draws those times: the same for every row of a round.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

# Short words: the sim's tokenizer makes one token of each (proxy/sim/sampling.py).
_WORDS = (
    "agent tool call plan step check list table user data file read write query model token cache "
    "reply state task goal rule note field value index page node edge graph score rank limit order "
    "case test build run stage batch queue time date unit range sum mean count path route shard"
).split()

Route = Callable[[int, int], str]  # (conversation, turn) -> the base URL (".../v1") to send it to


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: int
    turns: int
    concurrency: int
    system_tokens: int
    user_tokens: int = 40
    output_tokens: int = 24
    stagger_s: float = 0.1
    think_s: float = 0.25


@dataclass
class Outcome:
    requests: int = 0
    ok: int = 0
    ttft: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _turn(
    client: httpx.AsyncClient, base: str, messages: list[dict[str, str]], w: Workload, out: Outcome
) -> str | None:
    """One streamed chat completion: its TTFT into `out`, the answer's text returned (None: failed)."""
    body = {"model": "fleet", "messages": messages, "stream": True, "max_tokens": w.output_tokens}
    out.requests += 1
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    try:
        async with client.stream("POST", f"{base}/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                out.errors[f"HTTP {resp.status_code}"] += 1
                return None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.errors["in-band error"] += 1
                    return None
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter()
                        parts.append(piece)
    except (httpx.HTTPError, ValueError) as e:
        out.errors[type(e).__name__] += 1
        return None
    if first is None:
        out.errors["no token"] += 1
        return None
    out.ok += 1
    out.ttft.append(first - started)
    return "".join(parts)


async def _conversation(
    client: httpx.AsyncClient, route: Route, conv: int, w: Workload, salt: int, seed: int, out: Outcome
) -> None:
    rng = random.Random(f"{salt}/{conv}")
    pace = random.Random(f"think {seed}/{conv}")
    messages = [{"role": "system", "content": f"run {salt} agent {conv}: " + _text(rng, w.system_tokens)}]
    for turn in range(w.turns):
        if turn:
            await asyncio.sleep(pace.expovariate(1 / w.think_s) if w.think_s > 0 else 0.0)
        messages.append({"role": "user", "content": _text(rng, w.user_tokens)})
        answer = await _turn(client, route(conv, turn), messages, w, out)
        if answer is None:
            return  # a client gives up on a conversation that failed
        messages.append({"role": "assistant", "content": answer})


async def _run(route: Route, w: Workload, salt: int, seed: int) -> Outcome:
    out = Outcome()
    arrivals = random.Random(f"arrivals {seed}")
    starts = [0.0]
    for _ in range(w.conversations - 1):
        starts.append(starts[-1] + (arrivals.expovariate(1 / w.stagger_s) if w.stagger_s > 0 else 0.0))
    gate = asyncio.Semaphore(w.concurrency)
    limits = httpx.Limits(max_connections=w.concurrency * 2, max_keepalive_connections=w.concurrency * 2)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:

        async def one(conv: int) -> None:
            await asyncio.sleep(starts[conv])
            async with gate:
                await _conversation(client, route, conv, w, salt, seed, out)

        await asyncio.gather(*(one(c) for c in range(w.conversations)))
    return out


def run_workload(route: Route, w: Workload, salt: int, seed: int = 0) -> Outcome:
    """`salt`: the prompts' text (distinct per run); `seed`: the arrival and think times."""
    return asyncio.run(_run(route, w, salt, seed))


def main(argv: list[str] | None = None) -> int:
    """Multi-turn chat against one base URL, round after round: the traffic of docker-compose's
    `fleet` profile, so that the Fleet dashboard has something to show."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m proxy.tools.bench.fleet_load", description=main.__doc__)
    p.add_argument("--url", required=True, help="base URL, e.g. http://infertap-fleet:8080/v1")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1200)
    p.add_argument("--rounds", type=int, default=0, help="0: until stopped")
    p.add_argument("--pause", type=float, default=5.0, help="seconds between rounds")
    args = p.parse_args(argv)
    w = Workload("chat", args.conversations, args.turns, args.concurrency, args.system_tokens)
    r = 0
    while not args.rounds or r < args.rounds:
        out = run_workload(lambda _c, _t: args.url, w, salt=int(time.time()) * 1000 + r, seed=r)
        print(
            f"round {r + 1}: {out.ok}/{out.requests} ok, errors {dict(out.errors)}",
            file=sys.stderr,
            flush=True,
        )
        r += 1
        time.sleep(args.pause)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
