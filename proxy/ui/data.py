"""The bounded rings behind /ui/data, and the arithmetic done when the page asks.

Pure stdlib. Filling is O(1) per request (a few counter increments, one sample into a capped
reservoir, one row into a deque); sorting and quantiles happen only in `quantiles()`, on read.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

from proxy.request import display_url
from proxy.settings import Settings

QUANTILES = (0.5, 0.9, 0.99)


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

    __slots__ = ("n", "values")

    def __init__(self) -> None:
        self.n = 0
        self.values: list[float] = []

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


def quantiles(groups: Iterable[Reservoir], qs: Sequence[float] = QUANTILES) -> tuple[int, list[float | None]]:
    """(values offered, [quantile for q in qs]) over several reservoirs, by nearest rank.

    A reservoir that kept all its values weighs each one 1, so the result is exactly the
    ceil(q * n)-th smallest value; one that sampled weighs each kept value n / kept.
    `qs` must be ascending.
    """
    pairs: list[tuple[float, float]] = []
    n = 0
    for r in groups:
        if not r.values:
            continue
        n += r.n
        weight = r.n / len(r.values)
        pairs.extend((v, weight) for v in r.values)
    if not pairs:
        return 0, [None] * len(qs)
    pairs.sort()
    total = sum(w for _, w in pairs)
    out: list[float | None] = []
    i, below = 0, 0.0
    for q in qs:
        target = q * total - 1e-9 * total
        while i < len(pairs) - 1 and below + pairs[i][1] < target:
            below += pairs[i][1]
            i += 1
        out.append(pairs[i][0])
    return n, out


# -- the active configuration, with nothing secret in it ------------------------------------
HIDDEN = "(hidden)"
_SECRET_NAME = re.compile(r"key|token|secret|passw|credential|cookie", re.IGNORECASE)


def public_config(settings: Settings) -> dict[str, Any]:
    """`settings.model_dump()` for display: URLs without user info or query, upstream header
    values hidden (only their names shown), and any other string whose field name sounds secret
    hidden, except the names of environment variables and files (`*_env`, `*_file`)."""
    data = settings.model_dump(mode="json")
    for up in data.get("upstreams", []):
        up["base_url"] = display_url(up["base_url"])
        up["headers"] = {name: HIDDEN for name in up.get("headers", {})}
    tracing = data.get("tracing", {})
    if tracing.get("endpoint"):
        tracing["endpoint"] = display_url(tracing["endpoint"])
    scrubbed: dict[str, Any] = _scrub(data)
    return scrubbed


def _scrub(value: Any, name: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, name) for v in value]
    if (
        isinstance(value, str)
        and value != HIDDEN
        and _SECRET_NAME.search(name)
        and not name.endswith(("_env", "_file"))
    ):
        return HIDDEN
    return value
