"""Small, dependency-free statistics for the client tools: percentiles and a bootstrap CI.

Percentiles interpolate linearly between closest ranks (numpy's default "linear" method),
so `percentile(xs, 50)` is the median. The bootstrap resamples each group with replacement
from a seeded `random.Random`, so a result can be reproduced exactly.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linearly interpolated; ValueError when empty."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    if xs[hi] == xs[lo]:  # also keeps inf from turning into nan
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int] | None:
    """{"n", "p50", "p90", "p99", "mean", "min", "max"}, or None for no values."""
    if not values:
        return None
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


@dataclass(frozen=True, slots=True)
class RatioCI:
    """stat(b) / stat(a) with a bootstrap percentile confidence interval."""

    ratio: float
    low: float
    high: float
    confidence: float
    resamples: int

    @property
    def includes_one(self) -> bool:
        return self.low <= 1.0 <= self.high


def bootstrap_ratio_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    stat: Callable[[Sequence[float]], float] = statistics.median,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> RatioCI:
    """Ratio stat(b)/stat(a) and its percentile bootstrap CI (a and b resampled independently).

    Raises ValueError when a group has fewer than two values, `stat(a)` is not positive, or
    the arguments are out of range.
    """
    if len(a) < 2 or len(b) < 2:
        raise ValueError("each group needs at least two values")
    if resamples < 1:
        raise ValueError("resamples must be at least 1")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be between 0 and 1")
    base = stat(a)
    if base <= 0:
        raise ValueError("the statistic of group A must be positive to form a ratio")
    rng = random.Random(seed)
    ratios: list[float] = []
    for _ in range(resamples):
        sa = stat(rng.choices(a, k=len(a)))
        sb = stat(rng.choices(b, k=len(b)))
        ratios.append(sb / sa if sa > 0 else math.inf)
    tail = (1 - confidence) / 2 * 100
    return RatioCI(
        ratio=stat(b) / base,
        low=percentile(ratios, tail),
        high=percentile(ratios, 100 - tail),
        confidence=confidence,
        resamples=resamples,
    )
