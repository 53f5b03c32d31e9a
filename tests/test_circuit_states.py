"""The circuit breaker as a state machine: random interleavings of concurrent attempts (acquire,
record, release, cancellation), panic-mode sends and the clock, with the invariants that keep an
upstream from being lost for good (the class of bug behind issue 13's first defect).

Pure and fast, so it runs thousands of steps in CI; tests/test_fault_sequences.py covers the
breaker through real sockets."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from proxy.core.circuit import PANIC, Breaker, Permit

RATE, MIN_CALLS, WINDOW, COOLDOWN = 0.5, 4, 10.0, 5.0


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.b = Breaker(RATE, MIN_CALLS, WINDOW, COOLDOWN)
        self.now = 1000.0
        self.in_flight: list[Permit] = []  # acquired, not yet released
        self.open_since: float | None = None

    # -- the clock ----------------------------------------------------------------------------
    @rule(dt=st.floats(min_value=0.0, max_value=2 * COOLDOWN))
    def tick(self, dt: float) -> None:
        self.now += dt

    # -- one attempt's life, as the forwarder drives it ----------------------------------------
    @rule()
    def acquire(self) -> None:
        could = self.b.available(self.now)
        permit = self.b.acquire(self.now)
        # available() is acquire() without the side effect: planning must agree with sending.
        assert could == (permit is not None)
        if permit is not None:
            self.in_flight.append(permit)

    @precondition(lambda self: self.b.is_open and not self.b.available(self.now))
    @rule()
    def panic_send(self) -> None:
        """[circuit] when_all_open = "send": the attempt goes without a permit of its own."""
        self.in_flight.append(PANIC)

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(min_value=0), ok=st.booleans())
    def finish(self, i: int, ok: bool) -> None:
        permit = self.in_flight.pop(i % len(self.in_flight))
        was_open, was_probe = self.b.is_open, permit is self.b.probe
        calls_before, failures_before = self.b.counts(self.now)
        changed = self.b.record(permit, ok, self.now, None if ok else "boom")
        self.b.release(permit)  # the `finally` after every attempt
        if changed and not was_open:
            # Only a failure opens it, and only past the floor of calls and the rate.
            assert not ok and calls_before + 1 >= MIN_CALLS
            assert failures_before + 1 >= RATE * (calls_before + 1)
        if was_open and was_probe:
            # The probe decides: success closes, failure starts another cool-down.
            assert self.b.is_open is (not ok)
            if not ok:
                assert self.b.open_until == self.now + COOLDOWN
        if was_open and permit is PANIC and not ok:
            assert self.b.is_open  # a panic send that fails changes nothing

    @precondition(lambda self: self.in_flight)
    @rule(i=st.integers(min_value=0))
    def cancel(self, i: int) -> None:
        """The client left mid-attempt: nothing recorded, the permit still released."""
        self.b.release(self.in_flight.pop(i % len(self.in_flight)))

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def at_most_one_probe_and_only_while_it_is_held(self) -> None:
        if self.b.probe is not None:
            assert self.b.is_open
            assert sum(p is self.b.probe for p in self.in_flight) == 1

    @invariant()
    def an_open_circuit_always_lets_a_probe_through_after_its_cool_down(self) -> None:
        """Liveness: nothing held by an attempt that has ended can keep an upstream out."""
        if self.b.is_open and not any(p is self.b.probe for p in self.in_flight):
            assert self.b.probe is None
            assert self.b.available(self.b.open_until)
            assert self.b.retry_in(self.now) <= COOLDOWN + 1e-6

    @invariant()
    def the_window_totals_are_its_buckets_sums(self) -> None:
        """The breaker keeps the window's totals as they change (read on every record): whatever
        the sequence, they are what its buckets add up to."""
        buckets = self.b._buckets
        assert (self.b._calls, self.b._failures) == (sum(b[1] for b in buckets), sum(b[2] for b in buckets))

    @invariant()
    def counts_are_sane(self) -> None:
        calls, failures = self.b.counts(self.now)
        assert 0 <= failures <= calls
        if self.b.is_open:
            assert self.b.state(self.now) in ("open", "half_open")
        else:
            assert self.b.state(self.now) == "closed" and self.b.retry_in(self.now) == 0.0


BreakerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_breaker_state_machine = BreakerMachine.TestCase
