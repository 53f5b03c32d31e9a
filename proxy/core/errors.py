"""The one error table: each way an upstream request can fail, and everything that follows from it.

Pure stdlib. A kind's string is its `retries{reason}` label and its JSON error `type`; the table
says which request outcome it becomes, which status infertap answers with when it fails before
anything was sent, whether it counts against the upstream's health, and which timeout phase (if
any) it is. The core, metrics, tracing and the live view all read this table, so they cannot
drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from proxy.core.exchange import Outcome


class ErrorKind(StrEnum):
    """Why an upstream attempt (or the request around it) failed."""

    CONNECT_TIMEOUT = "connect_timeout"
    CONNECT_ERROR = "connect_error"
    TTFT_TIMEOUT = "ttft_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    # The request's own deadline ([timeouts] total), across all its attempts.
    TOTAL_TIMEOUT = "total_timeout"
    # Every connection of the upstream's pool was busy for [timeouts] pool: infertap's own queue,
    # never the upstream's fault (its circuit does not count it).
    POOL_TIMEOUT = "pool_timeout"
    STREAM_INTERRUPTED = "stream_interrupted"
    UPSTREAM_429 = "rate_limited"
    UPSTREAM_5XX = "upstream_error"
    # The upstream rejected the stream_options infertap added: asked again at once without it (a
    # retry reason only, never a request's outcome).
    STREAM_OPTIONS = "stream_options_rejected"


@dataclass(frozen=True, slots=True)
class KindInfo:
    outcome: Outcome | None  # None: never ends a request (a retry reason only)
    status: int  # infertap's answer when this ends a request before anything was relayed
    unhealthy: bool  # counts as a failure of the upstream (its circuit breaker)
    timeout_phase: str | None  # the `phase` label of infertap_timeouts_total
    # How an attempt's error message says it ("upstream 'x' (url) <what>: <exception>").
    what: str = "failed before the first token"


ERRORS: dict[ErrorKind, KindInfo] = {
    ErrorKind.CONNECT_TIMEOUT: KindInfo(
        Outcome.CONNECT_TIMEOUT, 504, True, "connect", "did not accept a connection in time"
    ),
    ErrorKind.CONNECT_ERROR: KindInfo(Outcome.CONNECT_ERROR, 502, True, None, "is unreachable"),
    ErrorKind.TTFT_TIMEOUT: KindInfo(Outcome.TTFT_TIMEOUT, 504, True, "ttft", "did not answer in time"),
    ErrorKind.IDLE_TIMEOUT: KindInfo(Outcome.IDLE_TIMEOUT, 504, True, "idle"),
    ErrorKind.TOTAL_TIMEOUT: KindInfo(Outcome.TOTAL_TIMEOUT, 504, False, "total"),
    ErrorKind.POOL_TIMEOUT: KindInfo(
        Outcome.POOL_TIMEOUT, 503, False, "pool", "had no free connection in time (max_connections)"
    ),
    ErrorKind.STREAM_INTERRUPTED: KindInfo(Outcome.STREAM_INTERRUPTED, 502, True, None),
    ErrorKind.UPSTREAM_429: KindInfo(Outcome.RATE_LIMITED, 429, False, None),
    ErrorKind.UPSTREAM_5XX: KindInfo(Outcome.UPSTREAM_ERROR, 502, True, None),
    ErrorKind.STREAM_OPTIONS: KindInfo(None, 400, False, None),
}

# By label string: retry reasons and outcomes share their strings with the kinds.
TIMEOUT_PHASES: dict[str, str] = {
    kind.value: info.timeout_phase for kind, info in ERRORS.items() if info.timeout_phase is not None
}


def outcome_of(kind: ErrorKind) -> Outcome:
    """The outcome of a request that `kind` ends."""
    outcome = ERRORS[kind].outcome
    if outcome is None:
        raise ValueError(f"{kind} never ends a request")
    return outcome


def timeout_phase(label: str) -> str | None:
    """The timeout phase of a retry reason or an outcome label, or None when it is no timeout."""
    return TIMEOUT_PHASES.get(label)


def describe(exc: BaseException) -> str:
    """A short, key-free description of a failure: the exception's type and message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class UpstreamError(Exception):
    """An upstream call that failed, named by the error table: what the seam
    (proxy.transport.aiohttp_client) raises for every transport failure, whatever the HTTP client."""

    def __init__(self, kind: ErrorKind, status: int | None, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        # The upstream's HTTP status when it sent one, else the table's answer for the kind.
        self.status = ERRORS[kind].status if status is None else status
        self.message = message

    def __str__(self) -> str:
        return self.message
