"""Graceful drain on SIGTERM, as a rollout needs it (Envoy's drain rather than uvicorn's 5 s).

On SIGTERM: readiness fails at once; new requests are still served for `[server] drain_delay`
(load balancers need a moment to notice); then the listener closes and requests in flight may
run until `[server] drain_timeout` after the signal; whatever is still open then ends with a
visible error (`on_deadline`), never a silent cut.

uvicorn installs its SIGTERM handler before the app starts (with `--workers N` in each worker
too), and that handler stops accepting at once. The app's start-up wraps it: the signal starts
the drain, and uvicorn's handler runs only after the delay. Outside the main thread (tests that
run the server in a thread) there are no signals; `begin()` starts a drain directly.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("infertap.drain")


class Drain:
    def __init__(self, delay: float, timeout: float, on_deadline: Callable[[], None]) -> None:
        self.delay = delay
        self.timeout = timeout
        self.on_deadline = on_deadline
        self.draining = False
        self.started_at: float | None = None  # perf_counter at the signal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: Any = None
        self._timers: list[asyncio.TimerHandle] = []

    def install(self) -> None:
        """Called in the app's start-up, inside the running loop, after uvicorn set its handler."""
        self._loop = asyncio.get_running_loop()
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.draining:
            return  # a repeat (with --workers the supervisor sends one more): the drain is under way
        self.started_at = time.perf_counter()
        self.draining = True  # before anything else: /readyz answers 503 from here on
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._arm)

    def begin(self) -> None:
        """Start a drain without a signal (tests; in the loop's thread)."""
        if self.draining:
            return
        self.started_at = time.perf_counter()
        self.draining = True
        self._arm()

    def _arm(self) -> None:
        assert self._loop is not None
        log.warning(
            "SIGTERM: draining (not ready; new requests served for %.1f s; requests in flight get "
            "up to %.1f s)",
            self.delay,
            self.timeout,
        )
        self._timers = [
            self._loop.call_later(self.delay, self._stop_accepting),
            self._loop.call_later(self.timeout, self._deadline),
        ]

    def _stop_accepting(self) -> None:
        previous, self._previous = self._previous, None
        if callable(previous):
            previous(signal.SIGTERM, None)  # uvicorn's own handler: close the listener, wait

    def _deadline(self) -> None:
        log.warning("drain time of %.1f s is over: ending the requests still open", self.timeout)
        self.on_deadline()

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
