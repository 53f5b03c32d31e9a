"""The bounded rings behind /ui/data, and the arithmetic done when the page asks.

Pure stdlib. Filling is O(1) per request (a few counter increments, one sample into a capped
reservoir, one row into a deque); sorting and quantiles happen only in `quantiles()`, on read.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterable, Sequence

QUANTILES = (0.5, 0.9, 0.99)
MERGE_MAX = 2048


class Second:
    """What ended during one second: requests by outcome, tokens, retries, timeouts."""

    __slots__ = ("sec", "outcomes", "prompt_tokens", "completion_tokens", "retries", "timeouts")

    def __init__(self, sec: int) -> None:
        self.reset(sec)

    def reset(self, sec: int) -> None:
        self.sec = sec
        self.outcomes: dict[str, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.retries = 0
        self.timeouts = 0


class SecondRing:
    """Per-second counters over the last `size` seconds; a slot is reused when its second is past."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots = [Second(-1) for _ in range(size)]

    def at(self, sec: int) -> Second:
        slot = self.slots[sec % self.size]
        if slot.sec != sec:
            slot.reset(sec)
        return slot

    def get(self, sec: int) -> Second | None:
        slot = self.slots[sec % self.size]
        return slot if slot.sec == sec else None

    def span(self, first: int, last: int) -> Iterable[Second]:
        """The seconds in [first, last] that saw anything."""
        for sec in range(max(first, last - self.size + 1), last + 1):
            slot = self.get(sec)
            if slot is not None:
                yield slot


class Reservoir:
    """Up to `cap` values, a uniform sample (Vitter's algorithm R) of the `n` offered."""

    __slots__ = ("n", "values", "cached")

    def __init__(self) -> None:
        self.n = 0
        self.values: list[float] = []
        self.cached: tuple[int, list[float | None]] | None = None  # (n, quantiles) of the last read

    def add(self, value: float, cap: int, rng: random.Random) -> None:
        self.n += 1
        if len(self.values) < cap:
            self.values.append(value)
        else:
            j = rng.randrange(self.n)
            if j < cap:
                self.values[j] = value


class Step:
    """One chart step of one model: its TTFT and TPOT samples."""

    __slots__ = ("step", "ttft", "tpot")

    def __init__(self, step: int) -> None:
        self.step = step
        self.ttft = Reservoir()
        self.tpot = Reservoir()


class StepRing:
    """One model's steps over the window; a slot is reused when its step is past."""

    __slots__ = ("slots",)

    def __init__(self, steps: int) -> None:
        self.slots: list[Step | None] = [None] * steps

    def at(self, step: int) -> Step:
        i = step % len(self.slots)
        slot = self.slots[i]
        if slot is None or slot.step != step:
            slot = self.slots[i] = Step(step)
        return slot

    def get(self, step: int) -> Step | None:
        slot = self.slots[step % len(self.slots)]
        return slot if slot is not None and slot.step == step else None


def rank(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank: the ceil(q * n)-th smallest value."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))]


def step_quantiles(r: Reservoir | None) -> tuple[int, list[float | None]]:
    """One reservoir's (values offered, QUANTILES), remembered until it is offered another value."""
    if r is None or not r.values:
        return (0 if r is None else r.n), [None] * len(QUANTILES)
    if r.cached is None or r.cached[0] != r.n:
        r.values.sort()
        r.cached = (r.n, [rank(r.values, q) for q in QUANTILES])
    return r.cached


def quantiles(groups: Iterable[Reservoir], qs: Sequence[float] = QUANTILES) -> tuple[int, list[float | None]]:
    """(values offered, [quantile for q in qs]) over several reservoirs, by nearest rank.

    Exact (the ceil(q * n)-th smallest value) while the reservoirs kept all they were offered
    and hold at most MERGE_MAX values together. Beyond that each kept value weighs offered /
    kept, over at most MERGE_MAX values thinned evenly by rank, so that the cost of a read stays
    bounded whatever the traffic. Sorts each reservoir in place (once per change: see
    step_quantiles). `qs` must be ascending.
    """
    kept = [r for r in groups if r.values]
    if not kept:
        return 0, [None] * len(qs)
    n = sum(r.n for r in kept)
    size = 0
    for r in kept:
        step_quantiles(r)  # sorts it, unless it is sorted since it was last offered a value
        size += len(r.values)
    if len(kept) == 1 or (size <= MERGE_MAX and size == n):
        merged = kept[0].values
        if len(kept) > 1:
            merged = []
            for r in kept:
                merged += r.values
            merged.sort()
        return n, [rank(merged, q) for q in qs]
    stride = math.ceil(size / MERGE_MAX)
    values: list[float] = []
    weights: list[float] = []
    for r in kept:
        thinned = r.values[stride // 2 :: stride] or r.values[-1:]
        values += thinned
        weights.extend(itertools.repeat(r.n / len(thinned), len(thinned)))
    order = sorted(range(len(values)), key=values.__getitem__)
    below = list(itertools.accumulate(weights[i] for i in order))  # weight at or below each value
    total = below[-1]
    return n, [
        values[order[min(bisect.bisect_left(below, q * total - 1e-9 * total), len(order) - 1)]] for q in qs
    ]


# -- the active configuration, with nothing secret in it ------------------------------------
