"""The circuit breaker: an upstream whose failure RATE over a sliding window passes a threshold
(with a minimum number of calls, so a short burst among many good calls does not count) is
skipped for a cool-down, then one real request probes it.

Counting consecutive failures across concurrent requests (the first design) opened the circuit by
chance: six timeouts arriving together after a hundred good calls took the only upstream away.
A rate over a window with a floor of calls is what resilience4j, Hystrix and Envoy's outlier
detection do.

Every permission to send is a `Permit`. A probe permit is an object of its own, released on every
path (success, failure, cancellation) by whoever acquired it, so a probe that never finishes
cannot keep the circuit open for good.
"""

from __future__ import annotations

from collections import deque
from typing import Final

from proxy.settings import CircuitSettings

_BUCKETS: Final = 10  # the window is kept as this many time slices: O(1) memory per upstream


class Permit:
    """Why an attempt may go ahead: the circuit is closed, this is the probe, or panic mode."""

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"Permit({self.kind})"


CLOSED: Final = Permit("closed")
PANIC: Final = Permit("panic")  # every candidate's circuit is open and [circuit] when_all_open = "send"


class Breaker:
    __slots__ = (
        "failure_rate",
        "min_calls",
        "window",
        "cooldown",
        "_width",
        "_buckets",
        "_calls",
        "_failures",
        "open_until",
        "opened_at",
        "probe",
        "last_failure",
        "tripped",
    )

    def __init__(self, failure_rate: float, min_calls: int, window: float, cooldown: float) -> None:
        self.failure_rate = failure_rate
        self.min_calls = min_calls
        self.window = window
        self.cooldown = cooldown
        self._width = window / _BUCKETS
        self._buckets: deque[list[int]] = deque()  # [slice index, calls, failures]
        # The buckets' sums, kept as they change: every request's record reads them.
        self._calls = self._failures = 0
        self.open_until = 0.0  # 0.0: closed
        self.opened_at = 0.0
        self.probe: Permit | None = None
        self.last_failure: str | None = None
        self.tripped: tuple[int, int] = (0, 0)  # (failures, calls) that opened it

    @classmethod
    def from_settings(cls, s: CircuitSettings) -> Breaker:
        return cls(s.failure_rate, s.min_calls, s.window_seconds, s.cooldown_seconds)

    @property
    def is_open(self) -> bool:
        return self.open_until > 0.0

    def state(self, now: float) -> str:
        if not self.is_open:
            return "closed"
        return "half_open" if now >= self.open_until else "open"

    def retry_in(self, now: float) -> float:
        """Seconds until the next probe may go (0 while one may go now or is in flight)."""
        return max(0.0, self.open_until - now) if self.is_open else 0.0

    def available(self, now: float) -> bool:
        """Could an attempt go now? No side effects: planning a request's fallbacks asks this."""
        return not self.is_open or (now >= self.open_until and self.probe is None)

    def acquire(self, now: float) -> Permit | None:
        """Permission for one attempt, asked right before it is sent; None: skip this upstream."""
        if not self.is_open:
            return CLOSED
        if now < self.open_until or self.probe is not None:
            return None
        self.probe = Permit("probe")  # half-open: this attempt decides
        return self.probe

    def release(self, permit: Permit) -> None:
        """Must follow every acquire (in a `finally`): frees the probe slot however the attempt ended."""
        if self.probe is permit:
            self.probe = None

    def record(self, permit: Permit, ok: bool, now: float, cause: str | None = None) -> bool:
        """The attempt's result. Returns True when the circuit opened or closed because of it."""
        if not ok and cause:
            self.last_failure = cause
        if self.is_open:
            if permit is CLOSED:
                return False  # sent before the circuit opened: the probe decides, not stragglers
            if permit is self.probe:
                self.probe = None
            if ok:
                self._close()
                return True
            if permit is not PANIC:
                self.open_until = now + self.cooldown  # the probe failed: another cool-down
            return False
        calls, failures = self._count(now, ok)
        # Only a failure can open it: a success that merely lands in a window already over the rate
        # (because it brought the calls up to min_calls) would take a healthy upstream away.
        if not ok and calls >= self.min_calls and failures >= self.failure_rate * calls:
            self.open_until = now + self.cooldown
            self.opened_at = now
            self.tripped = (failures, calls)
            self._forget()
            return True
        return False

    def counts(self, now: float) -> tuple[int, int]:
        """(calls, failures) in the window now."""
        self._expire(int(now / self._width))
        return self._calls, self._failures

    def _count(self, now: float, ok: bool) -> tuple[int, int]:
        index = int(now / self._width)
        self._expire(index)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != index:
            buckets.append([index, 0, 0])
        last = buckets[-1]
        last[1] += 1
        self._calls += 1
        if not ok:
            last[2] += 1
            self._failures += 1
        return self._calls, self._failures

    def _expire(self, index: int) -> None:
        buckets = self._buckets
        while buckets and buckets[0][0] <= index - _BUCKETS:
            _, calls, failures = buckets.popleft()
            self._calls -= calls
            self._failures -= failures

    def _forget(self) -> None:
        self._buckets.clear()
        self._calls = self._failures = 0

    def _close(self) -> None:
        self.open_until = 0.0
        self.probe = None
        self._forget()

    def describe(self, now: float) -> str:
        """Why the circuit is open and when it is tried again; key-free (causes are built so)."""
        failures, calls = self.tripped
        why = f"{failures} of its last {calls} calls failed"
        if self.last_failure:
            why += f"; last failure: {self.last_failure}"
        wait = self.retry_in(now)
        when = (
            f"infertap will probe it again in {wait:.1f} s"
            if wait > 0
            else "a probe request is in flight"
            if self.probe is not None
            else "the next request probes it"
        )
        return f"its circuit is open ({why}); {when}"
