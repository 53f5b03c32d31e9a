"""The observer fan-out: `ended` after every terminal hook, so registration order never matters;
the inter-token gaps handed over in batches, every one of them, before the terminal hook."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.exchange import Exchange, Outcome
from proxy.core.forward.relay import stamp_outputs
from proxy.core.hooks import GAPS_EVERY_S, Observer, ObserverSet


class Setter(Observer):
    name = "setter"

    def finished(self, ex: Exchange) -> None:
        ex.cost = 1.5


class Reader(Observer):
    name = "reader"

    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def ended(self, ex: Exchange) -> None:
        self.seen.append(ex.cost)


class Broken(Observer):
    name = "broken"

    def ended(self, ex: Exchange) -> None:
        raise RuntimeError("observer bug")


def test_what_a_terminal_hook_sets_every_ended_sees_in_either_order() -> None:
    for order in ("setter first", "reader first"):
        reader = Reader()
        chain: list[Observer] = [Setter(), Broken(), reader]
        obs = ObserverSet(chain if order == "setter first" else chain[::-1])
        ex = Exchange("r", "chat.completions", "POST", "/v1/chat/completions")
        ex.outcome = Outcome.OK
        obs.finished(ex)
        assert reader.seen == [1.5], order


class Retries(Observer):
    name = "retries"

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.seen: list[tuple[str, float]] = []

    def retry(self, ex: Exchange, reason: str, backoff: float) -> None:
        self.seen.append((reason, backoff))
        if self.fail:
            raise RuntimeError("observer bug")


def test_an_observer_that_fails_is_logged_and_the_others_are_still_called(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, broken, last = Retries(False), Retries(True), Retries(False)
    obs = ObserverSet([first, broken, last, Broken()])
    ex = Exchange("r", "chat.completions", "POST", "/v1/chat/completions")
    with caplog.at_level(logging.ERROR, logger="infertap.observer"):
        obs.retry(ex, "connect_error", 2.0)
        obs.ended(ex)
    assert first.seen == broken.seen == last.seen == [("connect_error", 2.0)]
    failures = [r.getMessage() for r in caplog.records]
    assert failures == [
        "observer retries failed in retry; the request goes on",
        "observer broken failed in ended; the request goes on",
    ]


def test_ended_follows_each_terminal_hook_once() -> None:
    reader = Reader()
    obs = ObserverSet([reader])
    for hook in (obs.finished, obs.failed, obs.client_disconnected):
        hook(Exchange("r", "embeddings", "POST", "/v1/embeddings"))
    assert reader.seen == [None, None, None]


class GapCounter(Observer):
    name = "gaps"

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.zeros = 0
        self.handovers = 0
        self.after_end = 0
        self.ended_seen = False

    def output_gaps(self, ex: Exchange, gaps: list[float], zeros: int) -> None:
        self.handovers += 1
        self.after_end += self.ended_seen
        self.gaps += gaps
        self.zeros += zeros

    def ended(self, ex: Exchange) -> None:
        self.ended_seen = True


@settings(max_examples=300, deadline=None)
@given(
    reads=st.lists(
        st.tuples(st.floats(0.0, 0.7, allow_nan=False), st.integers(1, 5)), min_size=1, max_size=40
    ),
    terminal=st.sampled_from(["finished", "failed", "client_disconnected"]),
)
def test_every_inter_token_gap_reaches_the_observers_once_before_the_terminal_hook(
    reads: list[tuple[float, int]], terminal: str
) -> None:
    """However a stream's reads fall (many events in one read, a stream shorter or longer than a
    hand-over interval), the observers get one observation per output event after the first, the
    gaps adding up to the first token's distance from the last, at most one hand-over per
    GAPS_EVERY_S of stream plus the last, and nothing once the request has ended."""
    counter = GapCounter()
    obs = ObserverSet([counter])
    ex = Exchange("r", "chat.completions", "POST", "/v1/chat/completions")
    now = 100.0
    for dt, outputs in reads:
        now += dt
        stamp_outputs(ex, obs, outputs, now)
    getattr(obs, terminal)(ex)
    assert ex.first_token_at is not None and ex.last_token_at is not None
    assert len(counter.gaps) + counter.zeros == ex.output_events - 1 == sum(n for _, n in reads) - 1
    assert sum(counter.gaps) == pytest.approx(ex.last_token_at - ex.first_token_at)
    assert counter.handovers <= (ex.last_token_at - ex.first_token_at) / GAPS_EVERY_S + 2
    assert counter.after_end == 0 and ex.gaps == [] and ex.zero_gaps == 0


def test_an_observer_still_implementing_the_retired_chunk_hook_is_told_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Old(Observer):
        name = "old"

        def chunk(self, ex: Exchange, gap: float, count: int) -> None:
            pass

    with caplog.at_level(logging.WARNING, logger="infertap.observer"):
        ObserverSet([Old(), Reader()])
    [record] = caplog.records
    assert "observer old implements chunk" in record.getMessage()
    assert "output_gaps(ex, gaps, zeros)" in record.getMessage()
