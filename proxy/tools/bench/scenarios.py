"""The bench's scenarios: what each one runs, direct, through nginx and through infertap, and its
targets."""

from __future__ import annotations

import json
from dataclasses import dataclass

from proxy.tools.bench.report import DIRECT, NGINX, VLLM_ROUTER

PROXY, TRACED, WORKERS = "infertap", "infertap+tracing", "infertap --workers 2"
# Tracing to an OTLP endpoint where nothing listens: requests must not notice.
DEAD_COLLECTOR = "infertap+tracing, dead collector"
# The live view's observer is on by default; this one runs without it, to show what /ui costs.
UI_OFF = "infertap, /ui off"
# Loop detection is off by default because it makes the scanner parse every output event.
LOOPS_ON = "infertap, loop detection on"
# Spend ([spend] prices) and named clients (a client key per request, checked and named) are off by
# default; this one has both on, to show what pricing every request and naming its client cost.
SPEND_ON = "infertap, spend + named clients on"
# infertap_overhead_seconds and the loop-lag probe are on by default; this one runs without them.
OVERHEAD_OFF = "infertap, overhead metrics off"
POISSON_RATES = (30.0, 60.0)
BENCH_KEY = "sk-bench-client"
SPEND_ENV = {
    "INFERTAP_AUTH__KEYS_ENV": "INFERTAP_BENCH_CLIENT_KEYS",
    "INFERTAP_BENCH_CLIENT_KEYS": f"ci=sk-ci-client,bench={BENCH_KEY}",
    "INFERTAP_SPEND__CURRENCY": "USD",
    "INFERTAP_SPEND__DAILY_BUDGET": "100",
    "INFERTAP_SPEND__PRICES": json.dumps(
        [
            {"models": ["gpt-*"], "input_per_mtok": 2.5, "output_per_mtok": 10.0},
            {
                "models": ["bench-*"],
                "input_per_mtok": 1.0,
                "cached_input_per_mtok": 0.1,
                "output_per_mtok": 4.0,
            },
        ]
    ),
}
# The traced infertap exports spans every TRACE_FLUSH_S (OTEL_BSP_SCHEDULE_DELAY; the SDK's default
# is 5 s) so that the bench can wait for a run's spans to leave before it reads the CPU time.
TRACE_FLUSH_S = 0.5


@dataclass(frozen=True)
class Phase:
    label: str
    stream: bool
    concurrency: int
    count: int  # requests per target, over all rounds
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    tokens: int = 100
    hold: bool = False  # sample infertap's RSS while every stream of the phase is open
    rate: float = 0.0  # open loop: Poisson arrivals per second (concurrency: connections opened up front)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    targets: tuple[str, ...]
    phases: tuple[Phase, ...]
    rounds: int = 3


def scenarios(
    quick: bool, rates: tuple[float, ...] = POISSON_RATES, rounds: int | None = None
) -> list[Scenario]:
    def n(full: int, small: int) -> int:
        return small if quick else full

    def poisson(rate: float) -> Phase:  # a real engine's pace, arriving at random
        seconds = n(10, 2)  # per round
        # Connections for the streams open at once (rate x stream time), and some to spare.
        conns = int(rate * (0.05 + 0.01 * n(100, 10)) * 1.5) + 4
        count = int(rate * seconds) * (1 if quick else 3)
        return Phase(f"{rate:g}/s", True, conns, count, 50.0, 10.0, n(100, 10), rate=rate)

    def realistic(c: int, count: int) -> Phase:  # a real engine's pace: TTFT 50 ms, 10 ms per token
        return Phase(f"c={c}", True, c, count, ttft_ms=50.0, itl_ms=10.0, tokens=n(100, 10))

    zero_delay = Phase("stream c=64", True, 64, n(3000, 64))
    held = n(1000, 100)  # idle-ish: a long TTFT keeps them all open at once, then a few tokens
    memory = Phase(f"{held} held", True, held, held, ttft_ms=n(5000, 1000), itl_ms=10.0, tokens=5, hold=True)
    out = [
        Scenario(
            "overhead",
            "sequential zero-delay 100-token streams: per-request overhead",
            (DIRECT, NGINX, VLLM_ROUTER, PROXY),
            (Phase("c=1", True, 1, n(300, 20)),),
        ),
        Scenario(
            "realistic",
            "TTFT 50 ms, tokens 10 ms apart: added TTFT and inter-token gaps",
            (DIRECT, NGINX, VLLM_ROUTER, PROXY),
            (realistic(1, n(15, 2)), realistic(16, n(48, 16)), realistic(64, n(192, 64))),
        ),
        Scenario(
            "poisson",
            "open loop: streams arriving at random (Poisson) at a fixed rate, TTFT 50 ms, tokens 10 ms apart",
            (DIRECT, NGINX, VLLM_ROUTER, PROXY),
            tuple(poisson(r) for r in rates),
        ),
        Scenario(
            "throughput",
            "zero-delay streams and non-streaming requests at c=64",
            (DIRECT, NGINX, VLLM_ROUTER, PROXY),
            (zero_delay, Phase("non-stream c=64", False, 64, n(6000, 128))),
        ),
        Scenario(
            "memory",
            f"{held} concurrent idle-ish streams held at once: infertap's RSS",
            (PROXY,),
            (memory,),
            rounds=1,
        ),
        Scenario(
            "tracing",
            "the zero-delay streams with OpenTelemetry tracing on (spans to the bench upstream, "
            "and to a closed port)",
            (DIRECT, PROXY, TRACED, DEAD_COLLECTOR),
            (zero_delay,),
        ),
        Scenario(
            "ui",
            "the zero-delay streams with the /ui live view on (the default) and off",
            (DIRECT, PROXY, UI_OFF),
            (zero_delay,),
        ),
        Scenario(
            "selfcost",
            "the zero-delay streams with infertap's own overhead metrics on (the default) and off",
            (DIRECT, PROXY, OVERHEAD_OFF),
            (zero_delay,),
            rounds=4,
        ),
        Scenario(
            "loops",
            "the zero-delay streams with loop detection ([loops]) off (the default) and on",
            (DIRECT, PROXY, LOOPS_ON),
            (zero_delay,),
        ),
        Scenario(
            "spend",
            "the zero-delay streams with spend ([spend] prices) and named clients (client keys) off "
            "(the default) and on",
            (DIRECT, PROXY, SPEND_ON),
            (zero_delay,),
            rounds=4,
        ),
        Scenario(
            "workers",
            "the zero-delay streams with --workers 2",
            (DIRECT, PROXY, WORKERS),
            (zero_delay,),
        ),
    ]
    for i, sc in enumerate(out):
        if quick or rounds is not None:
            # --quick: one round (two where a ratio between infertap's own rows is the point).
            want = rounds if rounds is not None else (2 if sc.rounds > 3 else 1)
            out[i] = Scenario(sc.name, sc.title, sc.targets, sc.phases, 1 if sc.name == "memory" else want)
    return out
