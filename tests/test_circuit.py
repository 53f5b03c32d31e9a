"""The circuit breaker: a failure rate over a window, probes that always release, panic mode, and
an open circuit's error that says why and for how long."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from proxy.app import InfertapApp, create_app
from proxy.core.circuit import CLOSED, PANIC, Breaker
from proxy.settings import CircuitSettings, Settings
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, RecordingObserver, make_settings, run_proxy, serve_in_thread, wait_until
from tests.promtext import scrape, value

CLOSED_PORT = "http://127.0.0.1:9/v1"  # nothing listens: connections are refused


def post(proxy: str, model: str = "fake-model", timeout: float = 30, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{proxy}/v1/chat/completions", json={**CHAT, "model": model}, headers=headers, timeout=timeout
    )


def circuit(**kw: Any) -> CircuitSettings:
    return CircuitSettings.model_validate(kw)


def quick(settings: Settings, **circuit_kw: Any) -> Settings:
    settings.retry.max_attempts = 1
    settings.retry.backoff_seconds = 0.01
    settings.timeouts.ttft = 0.5
    settings.timeouts.idle = 0.5
    settings.circuit = circuit(**circuit_kw)
    return settings


# -- the breaker alone -------------------------------------------------------------------------
def test_rate_needs_min_calls_and_the_share() -> None:
    b = Breaker(failure_rate=0.5, min_calls=10, window=30.0, cooldown=5.0)
    for _ in range(9):
        assert not b.record(CLOSED, False, 100.0, "boom")  # 9 of 9 failed, but under min_calls
    assert not b.is_open
    assert b.record(CLOSED, False, 100.0, "boom") and b.is_open
    b = Breaker(0.5, 10, 30.0, 5.0)
    for i in range(100):
        b.record(CLOSED, True, 100.0 + i * 0.01)
    for _ in range(6):  # a burst of 6 among 100 good calls: chance, not an outage
        assert not b.record(CLOSED, False, 101.0, "ttft")
    assert not b.is_open


def test_a_success_never_opens_the_circuit() -> None:
    """Found by the fault-sequence test: 1 success and 2 failures, then the success that made
    min_calls (4) found the window at 50% and opened the circuit to an upstream that had answered."""
    b = Breaker(0.5, 4, 5.0, 0.5)
    b.record(CLOSED, True, 0.0)
    b.record(CLOSED, False, 0.1, "ttft")
    b.record(CLOSED, False, 0.2, "ttft")
    assert not b.record(CLOSED, True, 0.3) and not b.is_open


def test_window_forgets_old_failures() -> None:
    b = Breaker(0.5, 4, 10.0, 5.0)
    for _ in range(3):
        b.record(CLOSED, False, 0.0, "x")
    # 20 s later those three are out of the window: one more failure is 1 call, under min_calls.
    assert not b.record(CLOSED, False, 20.0, "x")
    assert b.counts(20.0) == (1, 1)


def test_probe_is_released_on_every_path() -> None:
    b = Breaker(0.5, 1, 10.0, 1.0)
    b.record(CLOSED, False, 0.0, "refused")
    assert b.acquire(0.5) is None  # cooling down
    probe = b.acquire(1.5)
    assert probe is not None and b.acquire(1.5) is None  # one probe at a time
    b.release(probe)  # cancelled before any result: the slot is free again
    again = b.acquire(1.6)
    assert again is not None
    assert not b.record(again, False, 1.7, "still refused")  # failed probe: another cool-down
    b.release(again)
    assert b.acquire(2.0) is None and b.retry_in(2.0) == pytest.approx(0.7)
    assert b.record(PANIC, True, 2.1)  # panic mode's success closes it too
    assert not b.is_open


# -- end to end --------------------------------------------------------------------------------
@pytest.fixture
def two() -> Iterator[tuple[FakeUpstream, str, FakeUpstream, str]]:
    a, b = FakeUpstream(), FakeUpstream()
    with serve_in_thread(a) as ua, serve_in_thread(b) as ub:
        yield a, ua + "/v1", b, ub + "/v1"


def _with_fallback(ua: str, ub: str, **circuit_kw: Any) -> Settings:
    settings = quick(make_settings(("a", ua), ("b", ub)), **circuit_kw)
    settings.upstreams[0].models = ["fake-*"]
    settings.upstreams[1].models = ["b-*"]
    settings.upstreams[0].fallback = ["b"]
    return settings


@contextmanager
def proxy_app(settings: Settings) -> Iterator[tuple[str, InfertapApp]]:
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield url, app


def half_open(app: InfertapApp, name: str) -> Callable[[], bool]:
    """The upstream's cool-down is over: the next attempt there is its probe."""
    up = next((u for u in app.routing.upstreams if u.name == name), None)
    assert up is not None
    return lambda: up.breaker.state(time.monotonic()) == "half_open"


def test_fallback_circuit_recovers_when_the_fallback_is_never_reached(
    two: tuple[FakeUpstream, str, FakeUpstream, str],
) -> None:
    """Defect 1: planning a fallback marked its probe in flight, and nothing cleared the mark."""
    _, ua, b, ub = two
    settings = _with_fallback(ua, ub, min_calls=1, cooldown_seconds=0.3, when_all_open="refuse")
    with proxy_app(settings) as (proxy, app):
        assert post(proxy, "b-1", **{"x-fake-status": "500"}).status_code == 500  # opens b
        assert value(scrape(proxy), "infertap_upstream_up", upstream="b") == 0
        wait_until(half_open(app, "b"), what="b's cool-down to end")
        # Requests to a (whose plan lists b as its fallback) are answered by a: b is never tried.
        for _ in range(3):
            assert post(proxy).status_code == 200
        assert len(b.requests) == 1
        # b's own traffic must now probe it, and the probe closes the circuit.
        assert post(proxy, "b-1").status_code == 200
        assert value(scrape(proxy), "infertap_upstream_up", upstream="b") == 1


def test_cancelled_probe_releases_the_probe_slot(
    two: tuple[FakeUpstream, str, FakeUpstream, str],
) -> None:
    _, ua, b, ub = two
    settings = _with_fallback(ua, ub, min_calls=1, cooldown_seconds=0.3, when_all_open="refuse")
    settings.timeouts.ttft = settings.timeouts.idle = 60  # the probe hangs until its client leaves
    with proxy_app(settings) as (proxy, app):
        assert post(proxy, "b-1", **{"x-fake-status": "500"}).status_code == 500
        wait_until(half_open(app, "b"), what="b's cool-down to end")
        with pytest.raises(httpx.TimeoutException):
            post(proxy, "b-1", timeout=1, **{"x-fake-hang": "before-headers"})
        assert len(b.requests) == 2  # the probe reached b, then its client left
        wait_until(b.disconnected.is_set, 10, "infertap to cancel the abandoned probe")
        assert post(proxy, "b-1").status_code == 200  # the next request probes, and closes it
        assert value(scrape(proxy), "infertap_upstream_up", upstream="b") == 1


def test_open_circuit_error_names_the_cause_and_the_wait() -> None:
    settings = quick(
        make_settings(("dead", CLOSED_PORT)), min_calls=2, cooldown_seconds=60, when_all_open="refuse"
    )
    with run_proxy(settings) as proxy:
        for _ in range(2):
            assert post(proxy).status_code == 502
        r = post(proxy)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "circuit_open"
    assert "2 of its last 2 calls failed" in err["message"]
    assert "is unreachable" in err["message"] and "127.0.0.1:9" in err["message"]  # the cause
    assert "probe it again in 5" in err["message"] or "probe it again in 6" in err["message"]
    assert 55 <= int(r.headers["retry-after"]) <= 60


def test_a_burst_among_good_calls_does_not_open(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = quick(make_settings(("fake", url)), min_calls=10, when_all_open="refuse")
    with run_proxy(settings) as proxy:
        for _ in range(30):
            assert post(proxy).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            burst = list(pool.map(lambda _: post(proxy, **{"x-fake-hang": "before-headers"}), range(6)))
        assert [r.status_code for r in burst] == [504] * 6
        assert [post(proxy).status_code for _ in range(10)] == [200] * 10
        assert value(scrape(proxy), "infertap_upstream_up", upstream="fake") == 1


def test_panic_mode_keeps_sending_to_the_only_upstream(fake: tuple[FakeUpstream, str]) -> None:
    upstream, url = fake
    settings = quick(make_settings(("fake", url)), min_calls=2, cooldown_seconds=600)  # default: send
    with run_proxy(settings) as proxy:
        for _ in range(2):
            assert post(proxy, **{"x-fake-status": "500"}).status_code == 500
        assert value(scrape(proxy), "infertap_upstream_up", upstream="fake") == 0
        assert post(proxy).status_code == 200  # no alternative: sent anyway, and it answered
        assert len(upstream.requests) == 3
        assert value(scrape(proxy), "infertap_upstream_up", upstream="fake") == 1  # its success closed it


# -- no backoff and no retry when nothing can be tried (issue 23, item 14) --------------------------
@pytest.mark.parametrize("fallback_open", [False, True], ids=["alone", "fallback-already-open"])
def test_a_failure_that_opens_the_last_circuit_neither_waits_nor_counts_a_retry(
    two: tuple[FakeUpstream, str, FakeUpstream, str], fallback_open: bool
) -> None:
    """Regression: the request slept its backoff (Retry-After: 30, capped by max_backoff_seconds)
    and counted a retry, although its own failure had just opened the only circuit left and no
    attempt followed. Now nothing waits and no retry is counted; the upstream's answer is relayed."""
    a, ua, b, ub = two
    settings = _with_fallback(ua, ub, min_calls=1, cooldown_seconds=60, when_all_open="refuse")
    if not fallback_open:
        settings.upstreams[0].fallback = []
    settings.retry.max_attempts = 3
    settings.retry.max_backoff_seconds = 5
    rec = RecordingObserver()
    app = create_app(settings, [rec])
    with serve_in_thread(app) as proxy:
        if fallback_open:
            assert post(proxy, "b-1", **{"x-fake-status": "500"}).status_code == 500  # opens b
        r = post(
            proxy,
            **{"x-request-id": "opens-a", "x-fake-fail-first": "9", "x-fake-retry-after": "30"},
        )
        ex = rec.wait_terminal("opens-a")
        assert r.status_code == 503
        assert "retry" not in rec.hooks_for("opens-a")
        assert ex.retries == 0 and ex.attempts == 1
        assert len(a.requests) == 1
        assert value(scrape(proxy), "infertap_retries_total") == 0


def test_a_failure_that_opens_a_circuit_goes_on_to_an_open_fallback_at_once(
    two: tuple[FakeUpstream, str, FakeUpstream, str],
) -> None:
    """The other side: a fallback that can be tried is tried, at once (no backoff for the upstream
    whose circuit just opened), and that is one retry."""
    _, _, b, ub = two
    settings = _with_fallback(CLOSED_PORT, ub, min_calls=1, cooldown_seconds=60, when_all_open="refuse")
    settings.retry.max_attempts = 3
    settings.retry.max_backoff_seconds = 5
    rec = RecordingObserver()
    with serve_in_thread(create_app(settings, [rec])) as proxy:
        r = post(proxy, **{"x-request-id": "to-b"})
        ex = rec.wait_terminal("to-b")
    assert r.status_code == 200 and ex.upstream == "b"
    assert ex.retries == 1 and ex.attempts == 2 and len(b.requests) == 1
    assert rec.hooks_for("to-b").count("retry") == 1
