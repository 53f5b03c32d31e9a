"""The records a request leaves in the simulated engine, and the stats interface it reports to."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Protocol

from proxy.sim.sampling import TextSource


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[str]  # prompt tokens
    max_new: int  # tokens to generate at most (the natural length, capped by max_tokens)
    final_reason: str  # finish_reason on reaching max_new: "stop" (ended by itself) or "length"
    looping: bool = False
    seed_key: object = None  # None: a fresh seed per request; else the same text for the same key
    stop: tuple[str, ...] = ()
    ttft_ms: float | None = None
    tpot_ms: float | None = None


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop", "length" or "abort"


@dataclass(frozen=True)
class RequestTiming:
    e2e: float
    queue: float
    prefill: float
    decode: float


class EngineStats(Protocol):
    """What the engine reports; proxy.sim.metrics implements it, the engine never sees Prometheus."""

    def step(self, tokens: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def tokens(self, prompt: int, generation: int) -> None: ...
    def prefix_cache(self, queries: int, hits: int) -> None: ...
    def preempted(self) -> None: ...
    def finished(self, reason: str, timing: RequestTiming | None) -> None: ...


class NullStats:
    def step(self, tokens: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def tokens(self, prompt: int, generation: int) -> None: ...
    def prefix_cache(self, queries: int, hits: int) -> None: ...
    def preempted(self) -> None: ...
    def finished(self, reason: str, timing: RequestTiming | None) -> None: ...


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    spec: RequestSpec
    source: TextSource
    hashes: list[int]
    arrival: float
    events: asyncio.Queue[str | Finished] = field(default_factory=asyncio.Queue)
    state: State = State.WAITING
    target: int = 0  # tokens to prefill before the next token can be sampled
    computed: int = 0  # tokens whose K/V exist
    cached: int = 0  # prompt tokens served from the prefix cache (usage's cached_tokens)
    blocks: int = 0
    generated: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tail: str = ""  # end of the text so far, to find stop strings that span tokens

    @property
    def decoding(self) -> bool:
        return self.computed >= self.target
