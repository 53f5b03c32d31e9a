"""Counting into prometheus_client's children at less than its own methods' cost, where that
gives the same exposition: checked once, at import, against the methods themselves.

A request updates about fifteen children. prometheus_client's `Counter.inc`, `Gauge.inc` and
`Histogram.observe` each check that the metric is observable and validate their argument, and
`observe` walks the boundaries one by one (a TTFT histogram has about 70); a burst of 99 zero
gaps would be 99 calls. `DIRECT` puts a value straight into the child's value objects (their own
lock and, with `--workers N`, their own file) and finds a histogram's bucket by bisection. Those
are private attributes of prometheus_client: `direct_works` says whether the installed release
still has them doing what the methods do; where it does not, the metrics take `METHODS`, the
methods' own calls (slower, never wrong).

No prometheus_client import here (only prometheus.py may): the classes to check come as arguments.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any, Final, NamedTuple

# Whether this module runs compiled (proxy/compiled/). There a bisection written out costs a sixth of
# calling bisect_left (whose argument parsing alone is ~900 instructions, once an observation); as
# Python it would cost several times bisect_left's C loop.
_COMPILED: Final = not __file__.endswith(".py")


def _bucket(bounds: list[float], value: float, lo: int = 0) -> int:
    """bisect_left(bounds, value, lo): the first bound at or above `value`, from `lo` on (as
    Python, bisect_left itself: see the end of the module)."""
    hi = len(bounds)
    while lo < hi:
        mid = (lo + hi) // 2
        if bounds[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


class Counting(NamedTuple):
    inc: Callable[..., None]  # (child, amount=1): a counter's or a gauge's (amount >= 0 for a counter)
    dec: Callable[..., None]  # (child, amount=1): a gauge's
    observe: Callable[[Any, float], None]  # (child, value): a histogram's, without an exemplar
    # (child, value, n): n observations of one value at the cost of one: the events of one read
    # share a timestamp, so a burst of 100 adds 99 zero gaps. prometheus_client has no such call.
    observe_many: Callable[[Any, float, int], None]
    # (child, values): each of them observed, a bucket's count added once (a stream's gaps of about
    # a second, handed over together: proxy/core/hooks.py, output_gaps).
    observe_all: Callable[[Any, list[float]], None]
    # (child, value, exemplar): observed with a prometheus_client `Exemplar(labels, value, time)`
    # on the bucket it falls in. Its labels are infertap's own (`trace_id`, 32 hex digits): valid,
    # so not validated again on each request as `observe(value, labels)` does.
    observe_exemplar: Callable[[Any, float, Any], None]


def _inc(child: Any, amount: float = 1) -> None:
    child._value.inc(amount)


def _dec(child: Any, amount: float = 1) -> None:
    child._value.inc(-amount)


def _observe(child: Any, value: float) -> None:
    # What Histogram.observe does (the same attributes, in its single- and multi-process value
    # classes alike): _bucket finds the first boundary >= value, as observe's `value <= bound`.
    child._sum.inc(value)
    child._buckets[_bucket(child._upper_bounds, value)].inc(1)


def _observe_exemplar(child: Any, value: float, exemplar: Any) -> None:
    child._sum.inc(value)
    bucket = child._buckets[_bucket(child._upper_bounds, value)]
    bucket.inc(1)
    bucket.set_exemplar(exemplar)


def _observe_many_at_once(child: Any, value: float, n: int) -> None:
    child._sum.inc(value * n)
    child._buckets[_bucket(child._upper_bounds, value)].inc(n)


def _observe_all_at_once(child: Any, values: list[float]) -> None:
    bounds = child._upper_bounds
    buckets = child._buckets
    if len(values) == 1:
        value = values[0]
        child._sum.inc(value)
        buckets[_bucket(bounds, value)].inc(1)
        return
    for i, n in _bucket_counts(bounds, values).items():
        buckets[i].inc(n)
    child._sum.inc(sum(values))


def _bucket_counts(bounds: list[float], values: list[float]) -> dict[int, int]:
    """How many of `values` fall in each bucket (prometheus_client's: the first bound at or above
    the value; the last bound is +Inf). A stream's second of gaps is a hundred values, mostly in
    one or two buckets: sorted once (in C) and walked against the bounds, with a bisection only
    where the bucket changes, that costs a fifth of bisecting each value and counting the indexes
    (a Counter over a map) compiled, a third as Python (100 steady gaps: 3.2 against 15.5 µs
    compiled, 6.2 against 19.6 µs as Python)."""
    counts: dict[int, int] = {}
    i = n = 0
    bound = bounds[0]
    for value in sorted(values):
        if value <= bound:
            n += 1
            continue
        if n:
            counts[i] = n
        i = _bucket(bounds, value, i + 1)
        bound = bounds[i]
        n = 1
    if n:
        counts[i] = n
    return counts


def _inc_method(child: Any, amount: float = 1) -> None:
    child.inc(amount)


def _dec_method(child: Any, amount: float = 1) -> None:
    child.dec(amount)


def _observe_method(child: Any, value: float) -> None:
    child.observe(value)


def _observe_exemplar_method(child: Any, value: float, exemplar: Any) -> None:
    child.observe(value, exemplar.labels)


def _observe_each(child: Any, value: float, n: int) -> None:
    for _ in range(n):
        child.observe(value)


def _observe_all_each(child: Any, values: list[float]) -> None:
    for value in values:
        child.observe(value)


# In one process (prometheus_client's MutexValue), the float itself, without the value's lock:
# infertap counts only on its event loop's thread (the observers' hooks, the loop-lag probe), so no
# two writers meet, and a scrape's read under the lock sees one float or the next (the GIL swaps
# the attribute whole). The lock and the method call around it were half of a count's cost.
def _inc_unlocked(child: Any, amount: float = 1) -> None:
    child._value._value += amount


def _dec_unlocked(child: Any, amount: float = 1) -> None:
    child._value._value -= amount


def _observe_unlocked(child: Any, value: float) -> None:
    child._sum._value += value
    child._buckets[_bucket(child._upper_bounds, value)]._value += 1


def _observe_many_unlocked(child: Any, value: float, n: int) -> None:
    child._sum._value += value * n
    child._buckets[_bucket(child._upper_bounds, value)]._value += n


def _observe_all_unlocked(child: Any, values: list[float]) -> None:
    buckets = child._buckets
    for i, n in _bucket_counts(child._upper_bounds, values).items():
        buckets[i]._value += n
    child._sum._value += sum(values)


def _observe_exemplar_unlocked(child: Any, value: float, exemplar: Any) -> None:
    child._sum._value += value
    bucket = child._buckets[_bucket(child._upper_bounds, value)]
    bucket._value += 1
    bucket._exemplar = exemplar


DIRECT = Counting(_inc, _dec, _observe, _observe_many_at_once, _observe_all_at_once, _observe_exemplar)
UNLOCKED = Counting(
    _inc_unlocked,
    _dec_unlocked,
    _observe_unlocked,
    _observe_many_unlocked,
    _observe_all_unlocked,
    _observe_exemplar_unlocked,
)
METHODS = Counting(
    _inc_method, _dec_method, _observe_method, _observe_each, _observe_all_each, _observe_exemplar_method
)


def direct_works(
    histogram: type[Any],
    counter: type[Any],
    gauge: type[Any],
    values: Any,
    exemplar: type[Any],
    direct: Counting = DIRECT,
) -> bool:
    """Whether `direct` (DIRECT or UNLOCKED) counts what METHODS count in this prometheus_client:
    throwaway metrics of each kind, one counted each way, compared sample for sample. They hold
    their values in memory, never in the multiprocess directory (whose files every scrape reads):
    prometheus_client's in-memory value class (`values.MutexValue`) is chosen for them."""
    chosen = values.ValueClass
    try:
        values.ValueClass = values.MutexValue
        pairs = [
            [histogram("check", "check", registry=None, buckets=(0.5, 1.0)) for _ in range(2)],
            [counter("check", "check", registry=None) for _ in range(2)],
            [gauge("check", "check", registry=None) for _ in range(2)],
        ]
    except Exception:  # whatever changed, the answer is no
        return False
    finally:
        values.ValueClass = chosen
    try:
        (h_method, h_direct), (c_method, c_direct), (g_method, g_direct) = pairs
        for value, n in ((0.0, 3), (0.5, 2), (0.75, 4), (1.0, 1), (7.0, 5), (-1.0, 1)):
            for counting, h, c, g in (
                (METHODS, h_method, c_method, g_method),
                (direct, h_direct, c_direct, g_direct),
            ):
                counting.observe_many(h, value, n)
                counting.observe(h, value)
                counting.observe_all(h, [value, 0.5, value])
                counting.observe_exemplar(h, value, exemplar({"trace_id": f"{n:032x}"}, value, 0.0))
                counting.inc(c, n)
                counting.inc(g, n)
                counting.dec(g)
        # Values that sum exactly in binary floating point; `_created` is each one's own time.
        for pair in pairs:
            got, want = (
                [(*s[:3], s.exemplar and s.exemplar[:2]) for s in m._child_samples() if s.name != "_created"]
                for m in pair
            )
            if got != want:
                return False
        return True
    except Exception:
        return False


if not _COMPILED:
    # As Python, the C bisection is the faster, and a frame around it would cost every observation.
    _bucket = bisect_left  # type: ignore[assignment]
