"""Observer hooks for one request's life, and their fan-out.

Pure stdlib. A failing observer is logged and contained: it never breaks a stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from mypy_extensions import mypyc_attr

from proxy.core.exchange import Exchange, LocalAnswer
from proxy.core.observer import Observer

if TYPE_CHECKING:
    from proxy.settings import Settings

__all__ = ["GAPS_EVERY_S", "HOOKS", "RETIRED_HOOKS", "Observer", "ObserverSet"]

log = logging.getLogger("infertap.observer")

# How often a stream's inter-token gaps are handed to the observers (`output_gaps`): a hook per
# token cost more than everything else infertap does per token; a histogram a second behind does not.
GAPS_EVERY_S = 1.0

# Hooks an observer could implement once, and what replaced each: a custom observer that still
# defines one is told at start-up instead of silently never being called.
RETIRED_HOOKS = {"chunk": "output_gaps(ex, gaps, zeros)"}

HOOKS = (
    "request_received",
    "attempt_started",
    "retry",
    "first_byte",
    "first_token",
    "output_gaps",
    "finished",
    "failed",
    "client_disconnected",
    "ended",
    "upstream_health",
    "answered",
    "balanced",
    "replica_released",
    "replica_health",
)


def _failed(observer: Observer, hook: str) -> None:
    log.exception("observer %s failed in %s; the request goes on", observer.name, hook)


# A plain class, its methods compiled (proxy/compiled/): the tests re-run its __init__ on a set they
# changed, which a native class ignores.
@mypyc_attr(native_class=False)
class ObserverSet:
    """Fans each hook out to the observers that implement it.

    Per hook, only observers that override it are called, so a hook nobody cares about costs one
    empty loop.
    """

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self.observers = list(observers)
        # Each hook's observers and their bound methods, called in one loop with a `try` (free in
        # 3.11 until it catches): a wrapper per observer cost a frame and an argument tuple each,
        # about 950 instructions a call, ten calls a request.
        self._calls: dict[str, list[tuple[Observer, Callable[..., None]]]] = {
            hook: [
                (o, getattr(o, hook))
                for o in self.observers
                if getattr(type(o), hook) is not getattr(Observer, hook)
            ]
            for hook in HOOKS
        }
        for o in self.observers:
            for hook, instead in RETIRED_HOOKS.items():
                if callable(getattr(o, hook, None)):
                    log.warning(
                        "observer %s implements %s, which infertap no longer calls: implement %s "
                        "instead (CHANGELOG.md)",
                        o.name,
                        hook,
                        instead,
                    )

    def _each(self, hook: str, arg: object) -> None:
        """Calls `hook` of each observer that has it with `arg`; one that fails is logged, and the
        rest are still called. (The hooks of every request take one argument: no tuple of them.)"""
        for o, method in self._calls[hook]:
            try:
                method(arg)
            except Exception:
                _failed(o, hook)

    def _fan(self, hook: str, *args: Any) -> None:
        """_each, for the hooks that take several arguments."""
        for o, method in self._calls[hook]:
            try:
                method(*args)
            except Exception:
                _failed(o, hook)

    def request_received(self, ex: Exchange) -> None:
        self._each("request_received", ex)

    def attempt_started(self, ex: Exchange) -> None:
        self._each("attempt_started", ex)

    def retry(self, ex: Exchange, reason: str, backoff: float) -> None:
        self._fan("retry", ex, reason, backoff)

    def first_byte(self, ex: Exchange) -> None:
        self._each("first_byte", ex)

    def first_token(self, ex: Exchange) -> None:
        self._each("first_token", ex)

    def output_gaps(self, ex: Exchange, now: float) -> None:
        """Hands the gaps `ex` holds to the observers (and empties them); the next go at `now` +
        GAPS_EVERY_S."""
        ex.gaps_due = now + GAPS_EVERY_S
        gaps, zeros = ex.gaps, ex.zero_gaps
        if gaps or zeros:
            ex.gaps = []
            ex.zero_gaps = 0
            self._fan("output_gaps", ex, gaps, zeros)

    def finished(self, ex: Exchange) -> None:
        self.output_gaps(ex, 0.0)
        self._each("finished", ex)
        self.ended(ex)

    def failed(self, ex: Exchange) -> None:
        self.output_gaps(ex, 0.0)
        self._each("failed", ex)
        self.ended(ex)

    def client_disconnected(self, ex: Exchange) -> None:
        self.output_gaps(ex, 0.0)
        self._each("client_disconnected", ex)
        self.ended(ex)

    def ended(self, ex: Exchange) -> None:
        self._each("ended", ex)

    def upstream_health(self, ex: Exchange, upstream: str, up: bool) -> None:
        self._fan("upstream_health", ex, upstream, up)

    def balanced(self, ex: Exchange, policy: str, reason: str) -> None:
        self._fan("balanced", ex, policy, reason)

    def replica_released(self, ex: Exchange, upstream: str, replica: str, outcome: str | None) -> None:
        self._fan("replica_released", ex, upstream, replica, outcome)

    def replica_health(self, upstream: str, replica: str, up: bool) -> None:
        self._fan("replica_health", upstream, replica, up)

    def answered(self, answer: LocalAnswer) -> None:
        self._each("answered", answer)

    def configuration_changed(self, settings: Settings, fresh_circuits: Collection[str]) -> None:
        for o in self.observers:
            try:
                o.configuration_changed(settings, fresh_circuits)
            except Exception:
                log.exception("observer %s failed to follow the reload; it goes on as it was", o.name)

    def close(self) -> None:
        for o in self.observers:
            try:
                o.close()
            except Exception:
                log.exception("observer %s failed to close", o.name)
