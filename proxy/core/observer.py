"""The observer's base class: every hook a request's life has, each a no-op.

Compiled (proxy/compiled/) and open to subclasses that are not: the compiled observers are native
classes over it, the others (tracing, spend, a user's) plain Python ones.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, ClassVar

from mypy_extensions import mypyc_attr

from proxy.core.exchange import Exchange, LocalAnswer

if TYPE_CHECKING:
    from proxy.settings import Settings


@mypyc_attr(allow_interpreted_subclasses=True)
class Observer:
    """Base class: every hook is a no-op. Hooks are synchronous and must be cheap."""

    # A class attribute each observer sets (a native base's own attribute would hide theirs).
    name: ClassVar[str] = "observer"

    def request_received(self, ex: Exchange) -> None:
        pass

    def attempt_started(self, ex: Exchange) -> None:
        pass

    def retry(self, ex: Exchange, reason: str, backoff: float) -> None:
        """The previous attempt failed (`reason`, an ErrorKind value) and another goes now, after
        `backoff` seconds (0: at once, or on to a fallback). Fired as that attempt goes, so a retry
        that cannot happen (every circuit left open) is never reported; `ex.attempt_failed_at` is
        when the failed attempt ended."""

    def first_byte(self, ex: Exchange) -> None:
        pass

    def first_token(self, ex: Exchange) -> None:
        pass

    def output_gaps(self, ex: Exchange, gaps: list[float], zeros: int) -> None:
        """The inter-token latencies of later output events, handed over together about once a
        second (GAPS_EVERY_S) and before the request's terminal hook: `gaps`, the seconds between
        the first event of each read and the event before it; `zeros`, how many events came in
        the same read as another (0 s each). The list is the observer's to read, not to keep:
        the fan-out hands each observer the same one."""

    def finished(self, ex: Exchange) -> None:
        pass

    def failed(self, ex: Exchange) -> None:
        pass

    def client_disconnected(self, ex: Exchange) -> None:
        pass

    def ended(self, ex: Exchange) -> None:
        """After whichever terminal hook fired (finished, failed or client_disconnected), for an
        observer that only needs to know that the request ended: `ex.outcome` says how.

        Every observer's terminal hook runs before any observer's `ended`: what one observer
        derives for the others (the spend observer's `ex.cost`) is set in a terminal hook and
        read in `ended`, so no observer depends on the order in which they were registered."""

    def upstream_health(self, ex: Exchange, upstream: str, up: bool) -> None:
        """An upstream's circuit opened (up=False) or closed again (up=True) during `ex`."""

    def balanced(self, ex: Exchange, policy: str, reason: str) -> None:
        """A pool chose `ex.replica` of `ex.upstream` for the next attempt (reason: balance.py's);
        it carries the attempt until the matching `replica_released`."""

    def replica_released(self, ex: Exchange, upstream: str, replica: str, outcome: str | None) -> None:
        """The attempt (and, once committed, the stream) on `replica` is over: exactly once per
        `balanced`. `outcome`: the failure's (an Outcome value) for an attempt that failed before
        its commit; None for the one whose answer was relayed, or one cut short (the request's
        outcome then says how it ended)."""

    def replica_health(self, upstream: str, replica: str, up: bool) -> None:
        """A pool replica was ejected or left the pool (up=False), or was readmitted or joined."""

    def answered(self, answer: LocalAnswer) -> None:
        """A request that infertap answered itself (refused before it was read, or one of its own
        routes): it gets this one hook and no other, as its last byte goes out."""

    def configuration_changed(self, settings: Settings, fresh_circuits: Collection[str]) -> None:
        """The configuration was reloaded (POST /admin/reload, SIGHUP, or another worker's): new
        requests follow `settings`; `fresh_circuits` names the upstreams whose circuit the reload
        started anew, closed (a new name or base URL, or every one when [circuit] changed). Called
        at reload time, never on a request's path, so that an observer can rebuild there what it
        derives from the configuration."""

    def close(self) -> None:
        """Called once at shutdown."""
