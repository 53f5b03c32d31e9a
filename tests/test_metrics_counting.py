"""The metrics' direct counting (proxy/observe/metrics/fast.py) exposes exactly what
prometheus_client's own methods do, for any sequence of counts; and a prometheus_client whose
private attributes changed is counted by its methods instead."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.samples import Exemplar

from proxy.observe.metrics import prometheus
from proxy.observe.metrics.buckets import TTFT_BUCKETS
from proxy.observe.metrics.fast import DIRECT, METHODS, UNLOCKED, Counting, direct_works
from tests.promtext import samples

VALUES = st.one_of(
    st.sampled_from([0.0, *TTFT_BUCKETS[:-1]]),  # on a boundary: the bucket it belongs to
    st.floats(-1.0, 1e5, allow_nan=False),
    st.integers(0, 10**6).map(float),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("inc"), st.integers(0, 10**6)),
        st.tuples(st.just("gauge"), st.integers(1, 5)),
        st.tuples(st.just("observe"), VALUES),
        st.tuples(st.just("many"), st.tuples(VALUES, st.integers(1, 300))),
        st.tuples(st.just("all"), st.lists(VALUES, min_size=1, max_size=50)),
        st.tuples(st.just("exemplar"), st.tuples(VALUES, st.integers(0, 2**128 - 1))),
    ),
    max_size=40,
)


def _count(counting: Counting, ops: list[tuple[str, Any]]) -> tuple[list[Any], list[Any]]:
    registry = CollectorRegistry()
    counter = Counter("c", "c", ["m"], registry=registry).labels("x")
    gauge = Gauge("g", "g", ["m"], registry=registry).labels("x")
    histogram = Histogram("h", "h", ["m"], buckets=TTFT_BUCKETS, registry=registry).labels("x")
    for op, arg in ops:
        if op == "inc":
            counting.inc(counter, arg)
        elif op == "gauge":
            counting.inc(gauge, arg)
            counting.dec(gauge)
        elif op == "observe":
            counting.observe(histogram, arg)
        elif op == "all":
            counting.observe_all(histogram, arg)
        elif op == "exemplar":
            value, trace = arg
            counting.observe_exemplar(histogram, value, Exemplar({"trace_id": f"{trace:032x}"}, value, 0.0))
        else:
            counting.observe_many(histogram, *arg)
    exposed = [s for s in samples(generate_latest(registry).decode()) if not s[0].endswith("_created")]
    # Exemplars (not in the text format): which bucket holds which, its time aside (the methods
    # stamp their own).
    exemplars = [
        (s.labels["le"], s.exemplar.labels, s.exemplar.value)
        for family in registry.collect()
        for s in family.samples
        if s.exemplar is not None
    ]
    return exposed, exemplars


@pytest.mark.parametrize("direct", [DIRECT, UNLOCKED], ids=["direct", "unlocked"])
@given(ops=OPS)
@settings(max_examples=200, deadline=None)
def test_direct_counting_exposes_what_the_methods_do(direct: Counting, ops: list[tuple[str, Any]]) -> None:
    # The prometheus_client installed here, one process: the fastest path is in use.
    assert prometheus.COUNTING is UNLOCKED
    (got, got_exemplars), (want, want_exemplars) = _count(direct, ops), _count(METHODS, ops)
    assert [s[:2] for s in got] == [s[:2] for s in want]
    assert [s[2] for s in got] == pytest.approx([s[2] for s in want], rel=1e-9, abs=1e-6)
    assert got_exemplars == want_exemplars


def test_a_changed_prometheus_client_is_counted_by_its_methods() -> None:
    class Renamed(Counter):  # a release that keeps a counter's value under another name
        def _metric_init(self) -> None:
            super()._metric_init()
            self._total = self.__dict__.pop("_value")

        def inc(self, amount: float = 1, exemplar: Any = None) -> None:
            self._total.inc(amount)

        def _child_samples(self) -> Any:
            self._value = self._total
            try:
                return super()._child_samples()
            finally:
                del self._value

    assert direct_works(Histogram, Counter, Gauge, values, Exemplar)
    assert not direct_works(Histogram, Renamed, Gauge, values, Exemplar)


def test_a_prometheus_client_that_keeps_exemplars_elsewhere_is_counted_by_its_methods() -> None:
    class Elsewhere(Histogram):  # a release whose buckets no longer hold their exemplars themselves
        def observe(self, amount: float, exemplar: Any = None) -> None:
            super().observe(amount)
            if exemplar:
                self.last = Exemplar(exemplar, amount, 0.0)

        def _child_samples(self) -> Any:
            last = getattr(self, "last", None)
            return [s._replace(exemplar=last) if s.name == "_bucket" else s for s in super()._child_samples()]

    assert not direct_works(Elsewhere, Counter, Gauge, values, Exemplar)


def test_a_prometheus_client_whose_in_memory_value_changed_is_counted_under_its_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UNLOCKED writes the in-memory value's float itself: a release that keeps it under another
    name is counted through the value's own (locked) methods, as DIRECT does."""

    class Renamed(values.MutexValue):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
            self._total = 0.0

        def inc(self, amount: float) -> None:
            with self._lock:
                self._total += amount

        def set(self, value: float, timestamp: float | None = None) -> None:
            with self._lock:
                self._total = value

        def get(self) -> float:
            with self._lock:
                return self._total

    assert direct_works(Histogram, Counter, Gauge, values, Exemplar, UNLOCKED)
    monkeypatch.setattr(values, "MutexValue", Renamed)
    assert direct_works(Histogram, Counter, Gauge, values, Exemplar, DIRECT)
    assert not direct_works(Histogram, Counter, Gauge, values, Exemplar, UNLOCKED)
